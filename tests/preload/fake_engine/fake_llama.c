/* SPDX-License-Identifier: MIT */
/* The fake libllama of fake_llama.h: just what the preload looks for and what the program calls. */
#include "fake_llama.h"

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

int fake_tail_intact = -1;
int fake_callback_untouched = -1;
int fake_batch_intact = -1;
llama_progress_callback fake_expected_callback = NULL;

static inline const char* env_or(const char* name, const char* fallback) {
  const char* v = getenv(name);
  return v != NULL && *v != '\0' ? v : fallback;
}

#ifndef FAKE_LACKING
const char* ggml_version(void) { return env_or("FAKE_GGML_VERSION", FAKE_BUILT_GGML_VERSION); }
void llama_synchronize(struct llama_context* ctx) { (void)ctx; }
#endif
const char* ggml_commit(void) { return "fake"; }
#if FAKE_HAS_LLAMA_VERSION
const char* llama_version(void) { return env_or("FAKE_LLAMA_VERSION", FAKE_BUILT_LLAMA_VERSION); }
#endif

/* Defaults, all zero: llama_model_params as the build's headers have it, or the larger one. */
#if FAKE_NEWER
struct fake_model_params fake_model_default_params(void) {
  struct fake_model_params p;
  memset(&p, 0, sizeof p);
  return p;
}
#else
struct llama_model_params fake_build_default_params(void) __asm__("llama_model_default_params");
struct llama_model_params fake_build_default_params(void) {
  struct llama_model_params p;
  memset(&p, 0, sizeof p);
  return p;
}
#endif

struct llama_context_params llama_context_default_params(void) {
  struct llama_context_params p;
  memset(&p, 0, sizeof p);
  return p;
}

struct llama_batch llama_batch_get_one(llama_token* tokens, int32_t n_tokens) {
  struct llama_batch b;
  memset(&b, 0, sizeof b);
  b.token = tokens;
  b.n_tokens = n_tokens;
  return b;
}

/* Maps the model file as llama.cpp does (the preload's mmap hook sees a GGUF mapping, the call
 * that may start its session), and records what arrived. */
struct llama_model* fake_model_load_from_file(const char* path, struct fake_model_params params) {
  int intact = 1;
  for (int i = 0; i < FAKE_TAIL; ++i) intact &= params.tail[i] == (unsigned char)(0xc0 + i);
  fake_tail_intact = intact;
  fake_callback_untouched = params.base.progress_callback == fake_expected_callback;
  const int fd = open(path, O_RDONLY);
  if (fd < 0) return NULL;
  struct stat st;
  void* m = fstat(fd, &st) == 0 ? mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
  close(fd);
  if (m == MAP_FAILED) return NULL;
  if (params.base.progress_callback != NULL)
    params.base.progress_callback(1.0f, params.base.progress_callback_user_data);
  return (struct llama_model*)m;
}

int32_t llama_decode(struct llama_context* ctx, struct llama_batch batch) {
  (void)ctx;
  fake_batch_intact = batch.n_tokens == 3 && batch.token != NULL && batch.token[2] == 42 && batch.embd == NULL;
  return 0;
}
