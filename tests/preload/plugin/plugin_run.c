/* SPDX-License-Identifier: MIT */
/* The plugin's own use of its ggml functions (ggml_plugin.c): 1 when both calls reached the
 * plugin's definitions, 0 otherwise. */
#include <stddef.h>
#include <string.h>

void ggml_backend_tensor_get_async(void* backend, const void* tensor, void* data, size_t offset, size_t size);
void* ggml_backend_cpu_buffer_from_ptr(void* ptr, size_t size);
extern int plugin_calls;

int plugin_run(void) {
  unsigned char buf[64];
  memset(buf, 0, sizeof buf);
  const int before = plugin_calls;
  ggml_backend_tensor_get_async(NULL, NULL, buf, 0, sizeof buf);
  void* b = ggml_backend_cpu_buffer_from_ptr(buf, sizeof buf);
  return buf[0] == 0x5a && buf[sizeof buf - 1] == 0x5a && b == buf && plugin_calls == before + 2;
}
