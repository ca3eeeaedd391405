/* SPDX-License-Identifier: MIT */
/* Times llama_decode, one token at a time, in an ordinary llama.cpp program that knows nothing about
 * residency, so that bench/preload_overhead.sh can run it with and without LD_PRELOAD and compare
 * the preload's decode hook against no hook in the same run. Built by that script with cc (not
 * by bench/CMakeLists.txt, whose glob takes bench_*.cpp only).
 *
 *   decode_overhead MODEL WARMUP N [THREADS]
 *
 * Decodes WARMUP tokens untimed (the preload snapshots the engine's memory after its 1st, 2nd, 4th
 * ... 64th decode: a WARMUP over 64 leaves its steady state), then N timed ones, feeding back a fixed
 * token. The KV cache is cleared every 64 tokens, in every run alike, so that each decode attends
 * over the same 0-63 positions. Prints one line:
 *   load_ms L decode_ms_median M decode_ms_mean A decodes N vmlck_kib K
 * load_ms: llama_model_load_from_file + llama_init_from_model (under the preload, with the locking);
 * vmlck_kib: VmLck of /proc/self/status after the last decode (what the preload holds locked). */
#include <llama.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void quiet_log(enum ggml_log_level level, const char* text, void* user) {
  (void)user;
  if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static long vmlck_kib(void) {
  FILE* f = fopen("/proc/self/status", "r");
  if (f == NULL) return -1;
  char line[256];
  long kib = -1;
  while (fgets(line, sizeof line, f) != NULL)
    if (strncmp(line, "VmLck:", 6) == 0) kib = atol(line + 6);
  fclose(f);
  return kib;
}

static int cmp_double(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}

#define CYCLE 64

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: decode_overhead MODEL WARMUP N [THREADS]\n");
    return 2;
  }
  const char* path = argv[1];
  const int warmup = atoi(argv[2]);
  const int n = atoi(argv[3]);
  const int threads = argc > 4 ? atoi(argv[4]) : 1;
  if (warmup < 0 || n < 1 || threads < 1) {
    fprintf(stderr, "decode_overhead: WARMUP >= 0, N >= 1, THREADS >= 1\n");
    return 2;
  }
  llama_log_set(quiet_log, NULL);
  llama_backend_init();
  const double t0 = now_ms();
  struct llama_model_params mparams = llama_model_default_params();
  mparams.n_gpu_layers = 0;
  struct llama_model* model = llama_model_load_from_file(path, mparams);
  if (model == NULL) {
    fprintf(stderr, "decode_overhead: cannot load %s\n", path);
    return 1;
  }
  struct llama_context_params cparams = llama_context_default_params();
  cparams.n_ctx = 2 * CYCLE;
  cparams.n_batch = CYCLE;
  cparams.n_ubatch = CYCLE;
  cparams.n_seq_max = 1;
  cparams.n_threads = threads;
  cparams.n_threads_batch = threads;
  cparams.no_perf = 1;
  struct llama_context* ctx = llama_init_from_model(model, cparams);
  if (ctx == NULL) {
    fprintf(stderr, "decode_overhead: cannot make a context\n");
    return 1;
  }
  const double load_ms = now_ms() - t0;
  llama_memory_t mem = llama_get_memory(ctx);
  llama_token token = llama_vocab_bos(llama_model_get_vocab(model));
  if (token == LLAMA_TOKEN_NULL) token = 1;

  double* times = malloc(sizeof(double) * (size_t)n);
  if (times == NULL) return 1;
  double sum = 0;
  for (int i = 0; i < warmup + n; ++i) {
    if (i % CYCLE == 0) llama_memory_clear(mem, true);
    const double a = now_ms();
    const int32_t status = llama_decode(ctx, llama_batch_get_one(&token, 1));
    const double b = now_ms();
    if (status != 0) {
      fprintf(stderr, "decode_overhead: llama_decode failed at %d (%d)\n", i, status);
      free(times);
      return 1;
    }
    if (i >= warmup) {
      times[i - warmup] = b - a;
      sum += b - a;
    }
  }
  qsort(times, (size_t)n, sizeof(double), cmp_double);
  const double median = n % 2 ? times[n / 2] : (times[n / 2 - 1] + times[n / 2]) / 2;
  printf("load_ms %.3f decode_ms_median %.4f decode_ms_mean %.4f decodes %d vmlck_kib %ld\n", load_ms, median, sum / n,
         n, vmlck_kib());
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  free(times);
  return 0;
}
