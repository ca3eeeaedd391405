/* SPDX-License-Identifier: MIT */
/* A minimal llama.cpp server loop, knowing nothing about residency: one conversation, driven by
 * commands on stdin, answered on stdout with timings. The CUDA sleep/wake proof
 * (bench/llama_cuda_sleep.py) runs it with and without libresidency_preload.so.
 *
 *   serve_loop [--no-mmap] [--llama-log] MODEL [GPU_LAYERS]
 *     GPU_LAYERS   default 999: every layer on the GPU; fewer: the rest stay in host memory
 *     --no-mmap    read the weights into buffers (llama.cpp's --no-mmap) instead of mapping the file
 *     --llama-log  keep llama.cpp's own log (info and above) on stderr: its buffer sizes per type
 *
 * Prints "ready load_us=T" once the model and context exist. Commands, one per line:
 *   gen K     decode K greedy tokens continuing the conversation (from BOS when it is empty);
 *             after a reload the conversation so far is decoded again first, as a prompt, the
 *             way a client re-sends its history to a server that unloaded the model.
 *             Answers "gen first_us=T total_us=T tokens=A,B,..." where first_us runs from the
 *             command's arrival to the first new token's logits.
 *   reset     forgets the conversation (llama_memory_seq_rm; no device memory is touched)
 *   unload    frees the context and the model (what servers do when idle today)
 *   load      loads them again; answers "ok load us=T"
 *   quit      frees everything and exits
 * llama.cpp's own log is dropped except errors, unless --llama-log. */
#include <llama.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_HISTORY 512

static int g_llama_log;

static void quiet_log(enum ggml_log_level level, const char* text, void* user) {
  (void)user;
  static enum ggml_log_level last = GGML_LOG_LEVEL_INFO;
  if (level == GGML_LOG_LEVEL_CONT) level = last; /* a continuation has its line's level */
  last = level;
  if (level == GGML_LOG_LEVEL_ERROR || (g_llama_log && level >= GGML_LOG_LEVEL_INFO)) fputs(text, stderr);
}

static long long now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (long long)ts.tv_sec * 1000000LL + ts.tv_nsec / 1000;
}

static const char* g_path;
static int g_gpu_layers = 999;
static int g_no_mmap;
static struct llama_model* g_model;
static struct llama_context* g_ctx;
static llama_token g_history[MAX_HISTORY];
static int g_n_history;   /* tokens of the conversation, prompt and answers */
static int g_n_in_memory; /* of which the context holds the first g_n_in_memory */

static int load(void) {
  struct llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = g_gpu_layers;
#if RESIDENCY_LLAMA_HAS_LOAD_MODE
  if (g_no_mmap) mp.load_mode = LLAMA_LOAD_MODE_NONE;
#else
  if (g_no_mmap) mp.use_mmap = false;
#endif
  g_model = llama_model_load_from_file(g_path, mp);
  if (g_model == NULL) {
    fprintf(stderr, "serve_loop: cannot load %s\n", g_path);
    return 1;
  }
  struct llama_context_params cp = llama_context_default_params();
  cp.n_ctx = MAX_HISTORY;
  cp.n_batch = MAX_HISTORY;
  cp.n_ubatch = MAX_HISTORY;
  cp.n_seq_max = 1;
  cp.no_perf = 1;
  g_ctx = llama_init_from_model(g_model, cp);
  if (g_ctx == NULL) {
    fprintf(stderr, "serve_loop: cannot make a context\n");
    llama_model_free(g_model);
    g_model = NULL;
    return 1;
  }
  g_n_in_memory = 0;
  return 0;
}

static void unload(void) {
  if (g_ctx) llama_free(g_ctx);
  if (g_model) llama_model_free(g_model);
  g_ctx = NULL;
  g_model = NULL;
  g_n_in_memory = 0;
}

static int argmax_last(void) {
  const float* logits = llama_get_logits_ith(g_ctx, -1);
  const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(g_model));
  int best = 0;
  for (int k = 1; k < n_vocab; ++k) {
    if (logits[k] > logits[best]) best = k;
  }
  return best;
}

static int gen(int k, long long t0) {
  if (g_ctx == NULL) {
    fprintf(stderr, "serve_loop: gen without a model (load first)\n");
    return 1;
  }
  if (g_n_history + k >= MAX_HISTORY) {
    fprintf(stderr, "serve_loop: the conversation would exceed %d tokens\n", MAX_HISTORY);
    return 1;
  }
  if (g_n_history == 0) {
    llama_token bos = llama_vocab_bos(llama_model_get_vocab(g_model));
    g_history[g_n_history++] = bos == LLAMA_TOKEN_NULL ? 1 : bos;
  }
  /* What the context does not hold yet (all but the last token after a reload): a prompt. */
  if (g_n_in_memory < g_n_history - 1) {
    struct llama_batch b = llama_batch_get_one(g_history + g_n_in_memory, g_n_history - 1 - g_n_in_memory);
    if (llama_decode(g_ctx, b) != 0) {
      fprintf(stderr, "serve_loop: llama_decode failed on the prompt\n");
      return 1;
    }
    g_n_in_memory = g_n_history - 1;
  }
  long long first = -1;
  printf("gen");
  char tokens[4096];
  size_t used = 0;
  tokens[0] = 0;
  for (int i = 0; i < k; ++i) {
    struct llama_batch b = llama_batch_get_one(&g_history[g_n_history - 1], 1);
    if (llama_decode(g_ctx, b) != 0) {
      fprintf(stderr, "serve_loop: llama_decode failed at token %d\n", i);
      return 1;
    }
    g_n_in_memory = g_n_history;
    const int best = argmax_last();
    if (first < 0) first = now_us() - t0;
    g_history[g_n_history++] = best;
    used += (size_t)snprintf(tokens + used, sizeof tokens - used, "%s%d", i ? "," : "", best);
  }
  printf(" first_us=%lld total_us=%lld tokens=%s\n", first, now_us() - t0, tokens);
  fflush(stdout);
  return 0;
}

int main(int argc, char** argv) {
  const char* self = argv[0];
  while (argc > 1 && strncmp(argv[1], "--", 2) == 0) {
    if (strcmp(argv[1], "--no-mmap") == 0) {
      g_no_mmap = 1;
    } else if (strcmp(argv[1], "--llama-log") == 0) {
      g_llama_log = 1;
    } else {
      fprintf(stderr, "serve_loop: unknown option '%s' (accepted: --no-mmap, --llama-log)\n", argv[1]);
      return 2;
    }
    --argc;
    ++argv;
  }
  if (argc < 2 || argc > 3) {
    fprintf(stderr, "usage: %s [--no-mmap] [--llama-log] MODEL [GPU_LAYERS]\n", self);
    return 2;
  }
  g_path = argv[1];
  if (argc == 3) g_gpu_layers = atoi(argv[2]);
  llama_log_set(quiet_log, NULL);
  llama_backend_init();
  long long t0 = now_us();
  if (load() != 0) return 1;
  printf("ready load_us=%lld\n", now_us() - t0);
  fflush(stdout);

  char line[128];
  int rc = 0;
  while (rc == 0 && fgets(line, sizeof line, stdin) != NULL) {
    t0 = now_us();
    int k = 0;
    if (sscanf(line, "gen %d", &k) == 1 && k > 0) {
      rc = gen(k, t0);
    } else if (strncmp(line, "reset", 5) == 0) {
      if (g_ctx) llama_memory_seq_rm(llama_get_memory(g_ctx), -1, -1, -1);
      g_n_history = 0;
      g_n_in_memory = 0;
      printf("ok reset\n");
    } else if (strncmp(line, "unload", 6) == 0) {
      unload();
      printf("ok unload us=%lld\n", now_us() - t0);
    } else if (strncmp(line, "load", 4) == 0) {
      if (g_ctx == NULL && load() != 0) rc = 1;
      else printf("ok load us=%lld\n", now_us() - t0);
    } else if (strncmp(line, "quit", 4) == 0) {
      break;
    } else {
      fprintf(stderr, "serve_loop: unknown command: %s", line);
      rc = 2;
    }
    fflush(stdout);
  }
  unload();
  llama_backend_free();
  return rc;
}
