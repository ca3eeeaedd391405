/* SPDX-License-Identifier: MIT */
/* Addresses the program reuses while the engine runs (issue 28, item 3): the preload must never
 * lock a mapping at an address where memory it looked at, or held, used to be.
 *
 *   address_reuse MODEL FILE SECONDS IDLE_MS [MIB]
 *
 * One thread decodes MODEL in bursts of 64 tokens with IDLE_MS between them (run it under a
 * keep-alive shorter than IDLE_MS: each burst wires the model again and the preload takes its
 * snapshots of the engine's memory after the 1st, 2nd, 4th, ... 64th decode). Two threads of the program, for SECONDS, map anonymous memory
 * (MIB, default 1) and fill it, unmap it, and map FILE (at least as long) MAP_SHARED at the same address; each time
 * they ask the kernel whether that file mapping is locked: madvise(MADV_DONTNEED) made as a raw
 * system call, past any hook, fails with EINVAL on a locked mapping. Prints
 * "iterations=N", "same_address=N" (the file landed where the anonymous memory was),
 * "file_seen_locked=N" and, after the model is freed, "vm_lck_at_end_kb=N".
 * Exit status 0 when every call worked, 1 otherwise. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <ggml-backend.h>
#include <llama.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "vm_lck.h"

enum { kMiB = 1 << 20 };
static size_t g_bytes = kMiB; /* of each mapping: the 5th argument, in MiB (default 1) */

static atomic_int g_stop;
static atomic_long g_iterations, g_same, g_locked, g_failed;
static int g_fd = -1;

static void quiet_log(enum ggml_log_level level, const char* text, void* user) {
  (void)user;
  if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static void* reuse(void* arg) {
  (void)arg;
  while (!atomic_load(&g_stop)) {
    char* p = mmap(NULL, g_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      atomic_fetch_add(&g_failed, 1);
      return NULL;
    }
    memset(p, 0x5a, g_bytes);
    if (munmap(p, g_bytes) != 0) atomic_fetch_add(&g_failed, 1);
    char* q = mmap(p, g_bytes, PROT_READ, MAP_SHARED, g_fd, 0);
    if (q == MAP_FAILED) {
      atomic_fetch_add(&g_failed, 1);
      return NULL;
    }
    volatile char c = q[0];
    (void)c;
    if (q == p) atomic_fetch_add(&g_same, 1);
    if (syscall(SYS_madvise, q, g_bytes, MADV_DONTNEED) != 0) {
      if (errno == EINVAL) atomic_fetch_add(&g_locked, 1);
      else atomic_fetch_add(&g_failed, 1);
    }
    if (munmap(q, g_bytes) != 0) atomic_fetch_add(&g_failed, 1);
    atomic_fetch_add(&g_iterations, 1);
  }
  return NULL;
}

int main(int argc, char** argv) {
  if (argc < 5) {
    fprintf(stderr, "usage: address_reuse MODEL FILE SECONDS IDLE_MS\n");
    return 2;
  }
  g_fd = open(argv[2], O_RDONLY);
  if (g_fd < 0) {
    perror(argv[2]);
    return 1;
  }
  const long seconds = atol(argv[3]), idle_ms = atol(argv[4]);
  if (argc > 5) g_bytes = (size_t)atol(argv[5]) * kMiB;

  llama_log_set(quiet_log, NULL);
  llama_backend_init();
  struct llama_model* model = llama_model_load_from_file(argv[1], llama_model_default_params());
  if (model == NULL) return 1;
  struct llama_context_params cp = llama_context_default_params();
  cp.n_ctx = 256;
  cp.n_threads = cp.n_threads_batch = 1;
  struct llama_context* ctx = llama_init_from_model(model, cp);
  if (ctx == NULL) return 1;
  const struct llama_vocab* vocab = llama_model_get_vocab(model);
  llama_token tok = llama_vocab_bos(vocab) >= 0 ? llama_vocab_bos(vocab) : 1;

  pthread_t threads[2];
  for (int i = 0; i < 2; ++i)
    if (pthread_create(&threads[i], NULL, reuse, NULL) != 0) return 1;
  const time_t end = time(NULL) + seconds;
  int ok = 1;
  while (ok && time(NULL) < end) {
    llama_memory_clear(llama_get_memory(ctx), 1);  // each burst starts over, as a server's next request does
    for (int i = 0; i < 64; ++i)
      if (llama_decode(ctx, llama_batch_get_one(&tok, 1)) != 0) {
        ok = 0;
        break;
      }
    struct timespec ts = {idle_ms / 1000, (idle_ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
  }
  atomic_store(&g_stop, 1);
  for (int i = 0; i < 2; ++i) pthread_join(threads[i], NULL);
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  printf("iterations=%ld\nsame_address=%ld\nfile_seen_locked=%ld\nfailed_calls=%ld\nvm_lck_at_end_kb=%ld\n",
         atomic_load(&g_iterations), atomic_load(&g_same), atomic_load(&g_locked), atomic_load(&g_failed), vm_lck_kb());
  close(g_fd);
  return ok && atomic_load(&g_failed) == 0 ? 0 : 1;
}
