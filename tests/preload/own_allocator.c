/* SPDX-License-Identifier: MIT */
/* A llama.cpp program with an allocator of its own that maps and unmaps memory while it holds its
 * own lock, as tcmalloc's page heap does (issue 37, item 2). Its malloc family replaces the C
 * library's for the whole process (the preload's own allocations included).
 *
 *   own_allocator MODEL TOKENS
 *
 * One thread of the program allocates and frees 2 MiB blocks (each mapped and unmapped under the
 * allocator's lock) while the main thread decodes TOKENS tokens; the preload takes its snapshots of
 * the engine's memory after the 1st, 2nd, 4th ... decode meanwhile. Prints "tokens=[...]" and
 * "blocks=N". A hook that waited for a lock under which the preload allocates would deadlock here:
 * the test bounds the run's time. Exit status 0 when everything worked. */
#define _GNU_SOURCE
#include <errno.h>
#include <llama.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* ---- The allocator: one lock; small blocks bumped from 2 MiB chunks mapped under the lock (never
 * given back), blocks of 1 MiB or more mapped and unmapped under the lock. ---- */
enum { kChunk = 2 << 20, kBig = 1 << 20, kHeader = 32 };
struct header {
  size_t size;   /* what the caller asked for */
  void* base;    /* the mapping, for a big block; NULL for a small one */
  size_t mapped; /* its length */
  size_t pad;
};
static pthread_mutex_t g_alloc_mu = PTHREAD_MUTEX_INITIALIZER;
static char* g_chunk;
static size_t g_chunk_left;

static void* alloc_aligned(size_t size, size_t align) {
  if (align < 16) align = 16;
  if (size > (SIZE_MAX >> 2)) {
    errno = ENOMEM;
    return NULL;
  }
  const size_t need = size + align + kHeader;
  pthread_mutex_lock(&g_alloc_mu);
  char* raw;
  void* base = NULL;
  size_t mapped = 0;
  if (need >= kBig) {
    mapped = (need + 4095) & ~(size_t)4095;
    raw = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) raw = NULL;
    base = raw;
  } else {
    if (g_chunk_left < need) {
      char* c = mmap(NULL, kChunk, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      g_chunk = c == MAP_FAILED ? NULL : c;
      g_chunk_left = g_chunk != NULL ? kChunk : 0;
    }
    raw = g_chunk_left >= need ? g_chunk : NULL;
    if (raw != NULL) {
      g_chunk += need;
      g_chunk_left -= need;
    }
  }
  pthread_mutex_unlock(&g_alloc_mu);
  if (raw == NULL) {
    errno = ENOMEM;
    return NULL;
  }
  const uintptr_t user = ((uintptr_t)raw + kHeader + align - 1) & ~(uintptr_t)(align - 1);
  struct header* h = (struct header*)(user - kHeader);
  h->size = size;
  h->base = base;
  h->mapped = mapped;
  return (void*)user;
}

void* malloc(size_t size) { return alloc_aligned(size, 16); }
void free(void* p) {
  if (p == NULL) return;
  struct header* h = (struct header*)((uintptr_t)p - kHeader);
  if (h->base == NULL) return;
  pthread_mutex_lock(&g_alloc_mu);
  munmap(h->base, h->mapped);
  pthread_mutex_unlock(&g_alloc_mu);
}
void* calloc(size_t n, size_t size) {
  if (size != 0 && n > SIZE_MAX / size) {
    errno = ENOMEM;
    return NULL;
  }
  void* p = malloc(n * size);
  if (p != NULL) memset(p, 0, n * size);
  return p;
}
size_t malloc_usable_size(void* p) { return p == NULL ? 0 : ((struct header*)((uintptr_t)p - kHeader))->size; }
void* realloc(void* p, size_t size) {
  if (p == NULL) return malloc(size);
  void* q = malloc(size);
  if (q == NULL) return NULL;
  const size_t old = malloc_usable_size(p);
  memcpy(q, p, old < size ? old : size);
  free(p);
  return q;
}
int posix_memalign(void** out, size_t align, size_t size) {
  if (align == 0 || (align & (align - 1)) != 0 || align % sizeof(void*) != 0) return EINVAL;
  void* p = alloc_aligned(size, align);
  if (p == NULL) return ENOMEM;
  *out = p;
  return 0;
}
void* aligned_alloc(size_t align, size_t size) { return alloc_aligned(size, align); }
void* memalign(size_t align, size_t size) { return alloc_aligned(size, align); }
void* valloc(size_t size) { return alloc_aligned(size, 4096); }
void* pvalloc(size_t size) { return alloc_aligned((size + 4095) & ~(size_t)4095, 4096); }

/* ---- The program ---- */
static atomic_int g_stop;
static atomic_long g_blocks;

static void* churn(void* arg) {
  (void)arg;
  while (!atomic_load(&g_stop)) {
    char* p = malloc(2 << 20);
    if (p == NULL) return NULL;
    p[0] = 1;
    p[(2 << 20) - 1] = 1;
    free(p);
    atomic_fetch_add(&g_blocks, 1);
  }
  return NULL;
}

static void quiet_log(enum ggml_log_level level, const char* text, void* user) {
  (void)user;
  if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: own_allocator MODEL TOKENS\n");
    return 2;
  }
  const int tokens = atoi(argv[2]);
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
  const int32_t nv = llama_vocab_n_tokens(vocab);
  llama_token tok = llama_vocab_bos(vocab) >= 0 ? llama_vocab_bos(vocab) : 1;
  pthread_t t;
  if (pthread_create(&t, NULL, churn, NULL) != 0) return 1;
  int ok = 1;
  printf("tokens=[");
  for (int i = 0; i < tokens && ok; ++i) {
    if (llama_decode(ctx, llama_batch_get_one(&tok, 1)) != 0) {
      ok = 0;
      break;
    }
    const float* l = llama_get_logits_ith(ctx, -1);
    llama_token best = 0;
    for (llama_token c = 1; c < nv; ++c)
      if (l[c] > l[best]) best = c;
    printf(i == 0 ? "%d" : ",%d", best);
    tok = best;
    usleep(1000); /* the churning thread gets the lock between tokens too */
  }
  atomic_store(&g_stop, 1);
  pthread_join(t, NULL);
  printf("]\nblocks=%ld\n", atomic_load(&g_blocks));
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return ok ? 0 : 1;
}
