/* An ordinary llama.cpp program, knowing nothing about residency: loads a model, decodes greedy
 * tokens and prints them. The preload's tests run it with and without libresidency_preload.so.
 *
 *   decode_loop MODEL N [PAUSE]
 *
 * Decodes N tokens, starting from BOS (token 1 when the vocabulary has none), each time feeding
 * back the most likely next token. Prints "loaded" once the model and context exist, then
 * "token I ID" after each decode, then "done". PAUSE: milliseconds to sleep between decodes
 * (default 0), or "stdin": before each decode, wait for a line on stdin (the test steps it; end
 * of input stops early), and after the last one wait for the end of input before exiting. llama.cpp's own log is dropped except errors. */
#include <errno.h>
#include <llama.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void quiet_log(enum ggml_log_level level, const char* text, void* user) {
  (void)user;
  if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static void sleep_ms(long ms) {
  struct timespec ts;
  ts.tv_sec = ms / 1000;
  ts.tv_nsec = (ms % 1000) * 1000000L;
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s MODEL N [PAUSE_MS|stdin]\n", argv[0]);
    return 2;
  }
  const char* path = argv[1];
  const int n = atoi(argv[2]);
  const int stepped = argc > 3 && strcmp(argv[3], "stdin") == 0;
  const long pause_ms = argc > 3 && !stepped ? atol(argv[3]) : 0;
  if (n < 1 || n > 100) {
    fprintf(stderr, "decode_loop: N must be 1 to 100\n");
    return 2;
  }

  llama_log_set(quiet_log, NULL);
  llama_backend_init();
  struct llama_model_params mparams = llama_model_default_params();
  mparams.n_gpu_layers = 0;
  struct llama_model* model = llama_model_load_from_file(path, mparams);
  if (model == NULL) {
    fprintf(stderr, "decode_loop: cannot load %s\n", path);
    return 1;
  }
  struct llama_context_params cparams = llama_context_default_params();
  cparams.n_ctx = 128;
  cparams.n_batch = 128;
  cparams.n_ubatch = 128;
  cparams.n_seq_max = 1;
  cparams.n_threads = 2;
  cparams.n_threads_batch = 2;
  cparams.no_perf = 1;
  struct llama_context* ctx = llama_init_from_model(model, cparams);
  if (ctx == NULL) {
    fprintf(stderr, "decode_loop: cannot make a context\n");
    llama_model_free(model);
    return 1;
  }
  const struct llama_vocab* vocab = llama_model_get_vocab(model);
  const int n_vocab = llama_vocab_n_tokens(vocab);
  llama_token token = llama_vocab_bos(vocab);
  if (token == LLAMA_TOKEN_NULL) token = 1;
  printf("loaded\n");
  fflush(stdout);

  int rc = 0;
  char line[64];
  for (int i = 0; i < n; ++i) {
    if (stepped) {
      if (fgets(line, sizeof line, stdin) == NULL) break;
    } else if (i > 0 && pause_ms > 0) {
      sleep_ms(pause_ms);
    }
    struct llama_batch batch = llama_batch_get_one(&token, 1);
    if (llama_decode(ctx, batch) != 0) {
      fprintf(stderr, "decode_loop: llama_decode failed at token %d\n", i);
      rc = 1;
      break;
    }
    const float* logits = llama_get_logits_ith(ctx, -1);
    int best = 0;
    for (int k = 1; k < n_vocab; ++k) {
      if (logits[k] > logits[best]) best = k;
    }
    token = best;
    printf("token %d %d\n", i, best);
    fflush(stdout);
  }
  if (stepped) {  /* stay until the end of input, so that the test can look at the last state */
    while (fgets(line, sizeof line, stdin) != NULL) {
    }
  }
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  printf("done\n");
  return rc;
}
