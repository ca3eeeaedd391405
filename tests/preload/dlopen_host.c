/* SPDX-License-Identifier: MIT */
/* A host that loads libllama with dlopen, as Python's ctypes and Node addons do, in the shapes the
 * preload must serve (issue 37): other code first, a plugin with ggml functions of its own, or
 * RTLD_DEEPBIND. It knows nothing about residency.
 *
 *   dlopen_host LIBLLAMA MODEL [map-first] [deepbind] [plugin-first PLUGIN | plugin-last PLUGIN]
 *
 * map-first: maps MODEL read-only before libllama is loaded, as gguf-py's reader (numpy.memmap)
 * does, and keeps it mapped. plugin-first / plugin-last: loads PLUGIN (RTLD_LOCAL, its own
 * ggml_backend_tensor_get_async and ggml_backend_cpu_buffer_from_ptr) and runs its plugin_run()
 * before libllama is loaded, or after the model decoded (then once more at the end). deepbind:
 * libllama is loaded with RTLD_DEEPBIND. libllama is always loaded RTLD_LOCAL, and every llama
 * function is called through a pointer from dlsym.
 *
 * Decodes 8 tokens greedily after the BOS token and prints "plugin_ok=0|1" (with a plugin),
 * "tokens=[...]" and "locked_while_generating_kb=N" (VmLck after the last decode). Exit status 0
 * when everything worked. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <llama.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "vm_lck.h"

#define LOAD(var, name)                                                    \
  do {                                                                     \
    *(void**)(&var) = dlsym(lib, name);                                    \
    if (var == NULL) {                                                     \
      fprintf(stderr, "dlopen_host: %s not found: %s\n", name, dlerror()); \
      return 1;                                                            \
    }                                                                      \
  } while (0)

static void quiet_log(enum ggml_log_level level, const char* text, void* user) {
  (void)user;
  if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static int run_plugin(void* plugin) {
  int (*run)(void) = NULL;
  *(void**)(&run) = dlsym(plugin, "plugin_run");
  return run != NULL && run() == 1;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: dlopen_host LIBLLAMA MODEL [map-first] [deepbind] [plugin-first|plugin-last PLUGIN]\n");
    return 2;
  }
  int map_first = 0, deepbind = 0, plugin_first = 0;
  const char* plugin_path = NULL;
  for (int i = 3; i < argc; ++i) {
    if (strcmp(argv[i], "map-first") == 0) map_first = 1;
    else if (strcmp(argv[i], "deepbind") == 0) deepbind = 1;
    else if ((strcmp(argv[i], "plugin-first") == 0 || strcmp(argv[i], "plugin-last") == 0) && i + 1 < argc) {
      plugin_first = strcmp(argv[i], "plugin-first") == 0;
      plugin_path = argv[++i];
    } else {
      fprintf(stderr, "dlopen_host: unknown argument '%s'\n", argv[i]);
      return 2;
    }
  }

  if (map_first) {
    const int fd = open(argv[2], O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) return 1;
    const volatile char* m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return 1;
    (void)m[0]; /* read, as a reader of the header does; kept mapped */
  }
  void* plugin = NULL;
  int plugin_ok = 1;
  if (plugin_path != NULL) {
    plugin = dlopen(plugin_path, RTLD_NOW | RTLD_LOCAL);
    if (plugin == NULL) {
      fprintf(stderr, "dlopen_host: %s\n", dlerror());
      return 1;
    }
    if (plugin_first) plugin_ok = run_plugin(plugin) && plugin_ok;
  }

  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL | (deepbind ? RTLD_DEEPBIND : 0));
  if (lib == NULL) {
    fprintf(stderr, "dlopen_host: %s\n", dlerror());
    return 1;
  }
  void (*log_set)(ggml_log_callback, void*);
  void (*backend_init)(void);
  struct llama_model_params (*model_defaults)(void);
  struct llama_model* (*load)(const char*, struct llama_model_params);
  struct llama_context_params (*context_defaults)(void);
  struct llama_context* (*init)(struct llama_model*, struct llama_context_params);
  const struct llama_vocab* (*vocab_of)(const struct llama_model*);
  llama_token (*bos)(const struct llama_vocab*);
  int32_t (*n_tokens)(const struct llama_vocab*);
  struct llama_batch (*batch_one)(llama_token*, int32_t);
  int32_t (*decode)(struct llama_context*, struct llama_batch);
  float* (*logits)(struct llama_context*, int32_t);
  void (*free_ctx)(struct llama_context*);
  void (*free_model)(struct llama_model*);
  LOAD(log_set, "llama_log_set");
  LOAD(backend_init, "llama_backend_init");
  LOAD(model_defaults, "llama_model_default_params");
  LOAD(load, "llama_model_load_from_file");
  LOAD(context_defaults, "llama_context_default_params");
  LOAD(init, "llama_init_from_model");
  LOAD(vocab_of, "llama_model_get_vocab");
  LOAD(bos, "llama_vocab_bos");
  LOAD(n_tokens, "llama_vocab_n_tokens");
  LOAD(batch_one, "llama_batch_get_one");
  LOAD(decode, "llama_decode");
  LOAD(logits, "llama_get_logits_ith");
  LOAD(free_ctx, "llama_free");
  LOAD(free_model, "llama_model_free");

  log_set(quiet_log, NULL);
  backend_init();
  struct llama_model* model = load(argv[2], model_defaults());
  if (model == NULL) return 1;
  struct llama_context_params cp = context_defaults();
  cp.n_ctx = 128;
  cp.n_threads = cp.n_threads_batch = 2;
  struct llama_context* ctx = init(model, cp);
  if (ctx == NULL) return 1;
  const struct llama_vocab* vocab = vocab_of(model);
  const int32_t nv = n_tokens(vocab);
  llama_token tok = bos(vocab) >= 0 ? bos(vocab) : 1;
  printf("tokens=[");
  for (int i = 0; i < 8; ++i) {
    if (decode(ctx, batch_one(&tok, 1)) != 0) return 1;
    const float* l = logits(ctx, -1);
    llama_token best = 0;
    for (llama_token t = 1; t < nv; ++t)
      if (l[t] > l[best]) best = t;
    printf(i == 0 ? "%d" : ",%d", best);
    tok = best;
  }
  printf("]\nlocked_while_generating_kb=%ld\n", vm_lck_kb());
  if (plugin != NULL && !plugin_first) plugin_ok = run_plugin(plugin) && plugin_ok;
  if (plugin != NULL) plugin_ok = run_plugin(plugin) && plugin_ok;
  if (plugin != NULL) printf("plugin_ok=%d\n", plugin_ok);
  free_ctx(ctx);
  free_model(model);
  fflush(stdout);
  return plugin_ok ? 0 : 1;
}
