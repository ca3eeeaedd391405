/* SPDX-License-Identifier: MIT */
/* What the preload holds as "the engine's memory" must be the engine's (issue 37, item 7): a llama.cpp
 * program whose own memory sits where the engine's memory snapshot used to look.
 *
 *   engine_memory MODEL stack|heap|callback IDLE_MS
 *
 * stack: a thread of the program, on a stack the program mapped, decodes 4 tokens and ends; the
 *   program unmaps that stack, maps a buffer of the same size at the same address and fills it,
 *   idles IDLE_MS (past the keep-alive: the model is released), then decodes 4 tokens on the main
 *   thread (the model wired again, the snapshots taken anew). Prints "buffer_locked_kb=N".
 * heap: decodes 2 tokens, then mallocs and fills 150 MiB in 64 KiB blocks (the main heap grows),
 *   then decodes 6 more. Prints "heap_locked_kb=N" (all of [heap]) and "program_heap_kb=N".
 * callback: the program's abort callback (llama_set_abort_callback), which runs inside the decode's
 *   graph compute, maps and fills 32 MiB the first time; 8 decodes. Prints
 *   "callback_locked_kb=N" and "callback_calls=N".
 * Exit status 0 when every call worked. */
#define _GNU_SOURCE
#include <llama.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "vm_lck.h"

enum { kMiB = 1 << 20 };

static struct llama_context* g_ctx;
static llama_token g_tok;

static void quiet_log(enum ggml_log_level level, const char* text, void* user) {
  (void)user;
  if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static int decode_n(int n) {
  for (int i = 0; i < n; ++i)
    if (llama_decode(g_ctx, llama_batch_get_one(&g_tok, 1)) != 0) return 0;
  return 1;
}

static void idle(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0) {
  }
}

static void* decode_on_thread(void* arg) {
  *(int*)arg = decode_n(4);
  return NULL;
}

static int g_callback_calls;
static void* g_callback_map;
static bool abort_callback(void* data) {
  (void)data;
  if (g_callback_calls++ == 0) {
    g_callback_map = mmap(NULL, 32 * kMiB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (g_callback_map != MAP_FAILED) memset(g_callback_map, 0x5a, 32 * kMiB);
  }
  return false;
}

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: engine_memory MODEL stack|heap|callback IDLE_MS\n");
    return 2;
  }
  const char* mode = argv[2];
  const long idle_ms = atol(argv[3]);
  llama_log_set(quiet_log, NULL);
  llama_backend_init();
  struct llama_model* model = llama_model_load_from_file(argv[1], llama_model_default_params());
  if (model == NULL) return 1;
  struct llama_context_params cp = llama_context_default_params();
  cp.n_ctx = 256;
  cp.n_threads = cp.n_threads_batch = 1; /* the callback runs on the decoding thread */
  g_ctx = llama_init_from_model(model, cp);
  if (g_ctx == NULL) return 1;
  const struct llama_vocab* vocab = llama_model_get_vocab(model);
  g_tok = llama_vocab_bos(vocab) >= 0 ? llama_vocab_bos(vocab) : 1;
  int ok = 1;

  if (strcmp(mode, "stack") == 0) {
    const size_t size = 8 * kMiB;
    char* stack = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    if (stack == MAP_FAILED) return 1;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstack(&attr, stack, size);
    pthread_t t;
    int thread_ok = 0;
    if (pthread_create(&t, &attr, decode_on_thread, &thread_ok) != 0) return 1;
    pthread_join(t, NULL);
    ok = ok && thread_ok;
    if (munmap(stack, size) != 0) return 1;
    char* buf = mmap(stack, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    if (buf != stack) return 1;
    memset(buf, 0x5a, size);
    idle(idle_ms);
    ok = ok && decode_n(4);
    printf("buffer_locked_kb=%ld\n", locked_kb(buf, size));
  } else if (strcmp(mode, "heap") == 0) {
    ok = ok && decode_n(2);
    const uintptr_t before = (uintptr_t)sbrk(0);
    for (int i = 0; i < 150 * 16; ++i) {
      char* p = malloc(64 * 1024);
      if (p == NULL) return 1;
      memset(p, 0x5a, 64 * 1024); /* kept: the program's data */
    }
    const uintptr_t after = (uintptr_t)sbrk(0);
    ok = ok && decode_n(6);
    printf("program_heap_kb=%ld\n", (long)((after - before) / 1024));
    FILE* f = fopen("/proc/self/maps", "r");
    char line[512];
    uintptr_t hb = 0, he = 0;
    while (f != NULL && fgets(line, sizeof line, f) != NULL) {
      unsigned long lo = 0, hi = 0;
      if (strstr(line, "[heap]") != NULL && sscanf(line, "%lx-%lx ", &lo, &hi) == 2) {
        if (hb == 0 || lo < hb) hb = lo;
        if (hi > he) he = hi;
      }
    }
    if (f != NULL) fclose(f);
    printf("heap_locked_kb=%ld\n", hb != 0 ? locked_kb((const void*)hb, he - hb) : -1L);
  } else if (strcmp(mode, "callback") == 0) {
    llama_set_abort_callback(g_ctx, abort_callback, NULL);
    ok = ok && decode_n(8);
    printf("callback_calls=%d\n", g_callback_calls);
    printf("callback_locked_kb=%ld\n",
           g_callback_map != NULL && g_callback_map != MAP_FAILED ? locked_kb(g_callback_map, 32 * kMiB) : -1L);
  } else {
    fprintf(stderr, "engine_memory: unknown mode '%s'\n", mode);
    return 2;
  }
  llama_free(g_ctx);
  llama_model_free(model);
  llama_backend_free();
  return ok ? 0 : 1;
}
