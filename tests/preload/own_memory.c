/* SPDX-License-Identifier: MIT */
/* A llama.cpp program with memory of its own, as real hosts have (a runtime's heap, a program's
 * buffers, a reservation, its own locks). The preload must hold only the engine's memory, never
 * change what the program's own calls do, and never unlock what the program locked.
 *
 *   own_memory MODEL IDLE_MS [mlock]
 *
 * Before loading MODEL it maps and fills a 64 MiB buffer (A), mallocs and fills 32 MiB (B), maps,
 * fills and mlocks 16 MiB (L), and reserves 8 GiB PROT_NONE of which it commits and fills 32 MiB
 * (R, as Go's and Java's heaps do). It decodes 5 tokens (the model's weights locked by the
 * preload), then prints what /proc/self/smaps says is locked of each ("A_locked_kb=..." lines),
 * calls madvise(A, MADV_DONTNEED) and mprotect(R's committed part, PROT_NONE) as a runtime
 * returning memory does (their results), grows B with realloc to 256 MiB (glibc moves it with
 * mremap) and prints what is locked of it, idles IDLE_MS (past the keep-alive: the preload
 * releases the model) and prints what is locked of L. "mlock": the model is loaded in llama.cpp's
 * load mode mmap+mlock (llama-server's --load-mode mmap+mlock; use_mmap and use_mlock before
 * load_mode), and VmLck after the idle is printed: llama.cpp's own lock must stay.
 * Exit status 0 when every call worked, 1 otherwise. */
#define _GNU_SOURCE
#include <errno.h>
#include <ggml-backend.h>
#include <llama.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "vm_lck.h"

static void quiet_log(enum ggml_log_level level, const char* text, void* user) {
  (void)user;
  if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static void* filled_map(size_t n) {
  void* p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return NULL;
  memset(p, 0x5a, n);
  return p;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: own_memory MODEL IDLE_MS [mlock]\n");
    return 2;
  }
  const long idle_ms = atol(argv[2]);
  const int use_mlock = argc > 3 && strcmp(argv[3], "mlock") == 0;
  const size_t MiB = 1 << 20;
  int ok = 1;

  char* a = filled_map(64 * MiB);
  char* b = malloc(32 * MiB);
  char* l = filled_map(16 * MiB);
  char* r = mmap(NULL, (size_t)8 << 30, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (a == NULL || b == NULL || l == NULL || r == MAP_FAILED) return 1;
  memset(b, 0x5a, 32 * MiB);
  if (mlock(l, 16 * MiB) != 0) {
    perror("mlock");
    ok = 0;
  }
  if (mprotect(r, 32 * MiB, PROT_READ | PROT_WRITE) != 0) return 1;
  memset(r, 0x5a, 32 * MiB);

  llama_log_set(quiet_log, NULL);
  llama_backend_init();
  struct llama_model_params mp = llama_model_default_params();
#if RESIDENCY_LLAMA_HAS_LOAD_MODE
  if (use_mlock) mp.load_mode = LLAMA_LOAD_MODE_MMAP_MLOCK;
#else
  if (use_mlock) mp.use_mlock = true;
#endif
  struct llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (model == NULL) return 1;
  struct llama_context_params cp = llama_context_default_params();
  cp.n_ctx = 128;
  cp.n_threads = cp.n_threads_batch = 1;
  struct llama_context* ctx = llama_init_from_model(model, cp);
  if (ctx == NULL) return 1;
  const struct llama_vocab* vocab = llama_model_get_vocab(model);
  const int32_t n_vocab = llama_vocab_n_tokens(vocab);
  llama_token tok = llama_vocab_bos(vocab) >= 0 ? llama_vocab_bos(vocab) : 1;
  for (int i = 0; i < 5; ++i) {
    if (llama_decode(ctx, llama_batch_get_one(&tok, 1)) != 0) return 1;
    const float* logits = llama_get_logits_ith(ctx, -1);
    llama_token best = 0;
    for (llama_token t = 1; t < n_vocab; ++t)
      if (logits[t] > logits[best]) best = t;
    tok = best;
    printf("token %d %d\n", i, (int)tok);
  }
  printf("model_locked_kb=%ld\n", vm_lck_kb());
  printf("A_locked_kb=%ld\n", locked_kb(a, 64 * MiB));
  printf("B_locked_kb=%ld\n", locked_kb(b, 32 * MiB));
  printf("R_locked_kb=%ld\n", locked_kb(r, 32 * MiB));
  printf("L_locked_kb=%ld\n", locked_kb(l, 16 * MiB));
  const int madvise_rc = madvise(a, 64 * MiB, MADV_DONTNEED);
  printf("madvise_dontneed=%d%s%s\n", madvise_rc, madvise_rc != 0 ? " " : "", madvise_rc != 0 ? strerror(errno) : "");
  const int mprotect_rc = mprotect(r, 32 * MiB, PROT_NONE);
  printf("mprotect_none=%d\n", mprotect_rc);
  ok = ok && madvise_rc == 0 && mprotect_rc == 0;
  char* b2 = realloc(b, 256 * MiB);
  if (b2 == NULL) return 1;
  printf("B_grown_locked_kb=%ld\n", locked_kb(b2, 256 * MiB));
  fflush(stdout);

  struct timespec ts = {idle_ms / 1000, (idle_ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
  printf("L_locked_after_idle_kb=%ld\n", locked_kb(l, 16 * MiB));
  printf("vm_lck_after_idle_kb=%ld\n", vm_lck_kb());
  fflush(stdout);

  free(b2);
  munlock(l, 16 * MiB);
  munmap(l, 16 * MiB);
  munmap(a, 64 * MiB);
  munmap(r, (size_t)8 << 30);
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return ok ? 0 : 1;
}
