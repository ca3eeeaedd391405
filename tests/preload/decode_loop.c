/* SPDX-License-Identifier: MIT */
/* An ordinary llama.cpp program, knowing nothing about residency: loads a model, decodes greedy
 * tokens and prints them. The preload's tests run it with and without libresidency_preload.so.
 *
 *   decode_loop [--no-repack] [--reads] [--prompt TEXT] [--load-mode MODE] MODEL N [PAUSE]
 *
 * --no-repack: llama.cpp's extra buffer types off (use_extra_bufts = false, llama-server's -nr):
 * the weights stay in the file mapping on every CPU. --reads: the first decode is observed through
 * llama.cpp's eval callback, and before "token 0" one line per tensor the graph reads from host
 * memory is printed, "read USAGE BUFFER_TYPE ADDRESS BYTES BUFFER_BASE BUFFER_SIZE" (addresses in
 * hex, USAGE weights|compute|any, or "output host" for the logits this program reads from
 * llama.cpp's output buffer): what decode really reads, for the tests to compare with what
 * the kernel says is locked.
 *
 * --load-mode MODE: how llama.cpp loads the weights, as llama-server's --load-mode takes it
 * (llama_model_params.load_mode): auto (the default: mmap on a CPU), none (read into anonymous
 * buffers), mmap, mlock (read into anonymous buffers that llama.cpp locks), mmap+mlock (the file
 * mapping, locked by llama.cpp), dio (read with O_DIRECT into anonymous buffers). A llama.cpp
 * older than load_mode (b6431) takes the first five through use_mmap / use_mlock, not dio.
 *
 * --prompt TEXT: the first decode is TEXT as a user's prompt, as llama-cli and llama-server take
 * it: BOS and TEXT's tokens (llama_tokenize) in one batch; "prompt K" (the number of tokens) is
 * printed after "loaded".
 * Decodes N times, starting from BOS (token 1 when the vocabulary has none) or the prompt, each
 * time feeding back the most likely next token. Prints "loaded" once the model and context exist, then
 * "token I ID" after each decode, then "done". PAUSE: milliseconds to sleep between decodes
 * (default 0), or "stdin": before each decode, wait for a line on stdin (the test steps it; end
 * of input stops early), and after the last one wait for the end of input before exiting. llama.cpp's own log is dropped except errors. */
#include <errno.h>
#include <ggml-backend.h>
#include <llama.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void quiet_log(enum ggml_log_level level, const char* text, void* user) {
  (void)user;
  if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

/* MODE into `mp` (see above); 0 when this llama.cpp has no such mode. */
static int set_load_mode(struct llama_model_params* mp, const char* mode) {
#if RESIDENCY_LLAMA_HAS_LOAD_MODE
  static const struct {
    const char* name;
    enum llama_load_mode mode;
  } modes[] = {{"auto", LLAMA_LOAD_MODE_AUTO},
               {"none", LLAMA_LOAD_MODE_NONE},
               {"mmap", LLAMA_LOAD_MODE_MMAP},
               {"mlock", LLAMA_LOAD_MODE_MLOCK},
               {"mmap+mlock", LLAMA_LOAD_MODE_MMAP_MLOCK},
               {"dio", LLAMA_LOAD_MODE_DIRECT_IO}};
  for (size_t i = 0; i < sizeof modes / sizeof modes[0]; ++i) {
    if (strcmp(mode, modes[i].name) == 0) {
      mp->load_mode = modes[i].mode;
      return 1;
    }
  }
#else
  static const struct {
    const char* name;
    bool mmap, mlock;
  } modes[] = {{"auto", true, false},
               {"none", false, false},
               {"mmap", true, false},
               {"mlock", false, true},
               {"mmap+mlock", true, true}};
  for (size_t i = 0; i < sizeof modes / sizeof modes[0]; ++i) {
    if (strcmp(mode, modes[i].name) == 0) {
      mp->use_mmap = modes[i].mmap;
      mp->use_mlock = modes[i].mlock;
      return 1;
    }
  }
#endif
  return 0;
}

static void sleep_ms(long ms) {
  struct timespec ts;
  ts.tv_sec = ms / 1000;
  ts.tv_nsec = (ms % 1000) * 1000000L;
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

/* The tensors the observed decode read, deduplicated by address and size. */
#define MAX_READS 4096
struct read_range {
  uintptr_t addr;
  size_t bytes;
  struct ggml_tensor* t;
};
static struct read_range g_reads[MAX_READS];
static int g_n_reads = 0;
static int g_observing = 0;

static int host_buffer(ggml_backend_buffer_t b) {
  ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(b));
  if (dev == NULL) return 1;
  const enum ggml_backend_dev_type type = ggml_backend_dev_type(dev);
  return type == GGML_BACKEND_DEVICE_TYPE_CPU || type == GGML_BACKEND_DEVICE_TYPE_ACCEL;
}

static void note_read(struct ggml_tensor* t) {
  if (t == NULL || t->buffer == NULL || t->data == NULL || !host_buffer(t->buffer)) return;
  const uintptr_t a = (uintptr_t)t->data;
  const size_t n = ggml_nbytes(t);
  for (int i = 0; i < g_n_reads; ++i)
    if (g_reads[i].addr == a && g_reads[i].bytes == n) return;
  if (g_n_reads < MAX_READS) g_reads[g_n_reads++] = (struct read_range){a, n, t};
}

static bool observe(struct ggml_tensor* t, bool ask, void* user) {
  (void)user;
  if (!ask || !g_observing) return false;
  note_read(t);
  for (int i = 0; i < GGML_MAX_SRC; ++i) note_read(t->src[i]);
  return false; /* never stop the graph: decode runs as without the callback */
}

static void print_reads(void) {
  for (int i = 0; i < g_n_reads; ++i) {
    ggml_backend_buffer_t b = g_reads[i].t->buffer;
    const enum ggml_backend_buffer_usage u = ggml_backend_buffer_get_usage(b);
    printf("read %s %s %zx %zu %zx %zu\n",
           u == GGML_BACKEND_BUFFER_USAGE_WEIGHTS   ? "weights"
           : u == GGML_BACKEND_BUFFER_USAGE_COMPUTE ? "compute"
                                                    : "any",
           ggml_backend_buffer_name(b), (size_t)g_reads[i].addr, g_reads[i].bytes,
           (size_t)ggml_backend_buffer_get_base(b), ggml_backend_buffer_get_size(b));
  }
}

int main(int argc, char** argv) {
  int no_repack = 0, reads = 0;
  const char* prompt = NULL;
  const char* load_mode = NULL;
  while (argc > 1 && strncmp(argv[1], "--", 2) == 0) {
    if (strcmp(argv[1], "--no-repack") == 0) {
      no_repack = 1;
    } else if (strcmp(argv[1], "--reads") == 0) {
      reads = 1;
    } else if (strcmp(argv[1], "--prompt") == 0 && argc > 2) {
      prompt = argv[2];
      --argc;
      ++argv;
    } else if (strcmp(argv[1], "--load-mode") == 0 && argc > 2) {
      load_mode = argv[2];
      --argc;
      ++argv;
    } else {
      fprintf(stderr,
              "decode_loop: unknown option '%s' (accepted: --no-repack, --reads, --prompt TEXT, --load-mode MODE)\n",
              argv[1]);
      return 2;
    }
    --argc;
    ++argv;
  }
  if (argc < 3) {
    fprintf(stderr,
            "usage: decode_loop [--no-repack] [--reads] [--prompt TEXT] [--load-mode MODE] MODEL N [PAUSE_MS|stdin]\n");
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
  if (no_repack) mparams.use_extra_bufts = false;
  if (load_mode != NULL && !set_load_mode(&mparams, load_mode)) {
    fprintf(stderr, "decode_loop: this llama.cpp has no load mode '%s'\n", load_mode);
    return 2;
  }
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
  if (reads) {
    cparams.cb_eval = observe;
    cparams.cb_eval_user_data = NULL;
  }
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
  /* The prompt's tokens (BOS first), or BOS alone. */
  llama_token prompt_tokens[128];
  int n_prompt = 1;
  prompt_tokens[0] = token;
  if (prompt != NULL) {
    n_prompt = llama_tokenize(vocab, prompt, (int32_t)strlen(prompt), prompt_tokens, 100, true, false);
    if (n_prompt <= 0) {
      fprintf(stderr, "decode_loop: cannot tokenize the prompt (%d; at most 100 tokens)\n", n_prompt);
      llama_free(ctx);
      llama_model_free(model);
      return 1;
    }
  }
  printf("loaded\n");
  if (prompt != NULL) printf("prompt %d\n", n_prompt);
  fflush(stdout);

  int rc = 0;
  char line[64];
  for (int i = 0; i < n; ++i) {
    if (stepped) {
      if (fgets(line, sizeof line, stdin) == NULL) break;
    } else if (i > 0 && pause_ms > 0) {
      sleep_ms(pause_ms);
    }
    struct llama_batch batch = i == 0 ? llama_batch_get_one(prompt_tokens, n_prompt) : llama_batch_get_one(&token, 1);
    g_observing = reads && i == 0;
    const int32_t status = llama_decode(ctx, batch);
    g_observing = 0;
    if (status != 0) {
      fprintf(stderr, "decode_loop: llama_decode failed at token %d\n", i);
      rc = 1;
      break;
    }
    const float* logits = llama_get_logits_ith(ctx, -1);
    if (reads && i == 0) {
      print_reads();
      /* The logits decode wrote, outside the graph (llama.cpp's output buffer), which we read. */
      printf("read output host %zx %zu %zx %zu\n", (size_t)logits, (size_t)n_vocab * sizeof(float), (size_t)logits,
             (size_t)n_vocab * sizeof(float));
    }
    int best = 0;
    for (int k = 1; k < n_vocab; ++k) {
      if (logits[k] > logits[best]) best = k;
    }
    token = best;
    printf("token %d %d\n", i, best);
    fflush(stdout);
  }
  if (stepped) { /* stay until the end of input, so that the test can look at the last state */
    while (fgets(line, sizeof line, stdin) != NULL) {
    }
  }
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  printf("done\n");
  return rc;
}
