/* SPDX-License-Identifier: MIT */
/* A plugin with ggml functions of its own, as a library that links its own ggml statically (a
 * speech library built on whisper.cpp) exports them: loaded RTLD_LOCAL next to libllama, its calls
 * to these names must reach these definitions, and libllama's calls libggml's (issue 37, item 3).
 * Its own calls come from plugin_run.c, another translation unit, so they go through the PLT
 * (where the preload's hooks receive them) as a separately compiled library's would. */
#include <stddef.h>
#include <string.h>

int plugin_calls = 0;

/* ggml's signature; this one fills what it "reads" with 0x5a. */
void ggml_backend_tensor_get_async(void* backend, const void* tensor, void* data, size_t offset, size_t size) {
  (void)backend;
  (void)tensor;
  (void)offset;
  memset(data, 0x5a, size);
  ++plugin_calls;
}

/* ggml's signature; returns the memory itself as its "buffer" (a call that starts the preload's
 * session when it is the engine's). */
void* ggml_backend_cpu_buffer_from_ptr(void* ptr, size_t size) {
  (void)size;
  ++plugin_calls;
  return ptr;
}
