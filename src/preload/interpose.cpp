// SPDX-License-Identifier: MIT
// libresidency_preload.so's exported symbols, the only ones it exports (exports.map): the
// functions it interposes. Each forwards to the sessions (preload_session.hpp for host
// mappings and decodes, device_memory.hpp for CUDA device memory); nothing here decides anything.
#include <sys/mman.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

#include <ggml-alloc.h>
#include <ggml-backend.h>
#include <llama.h>

#include "device_memory.hpp"
#include "preload_session.hpp"

#define RESIDENCY_PRELOAD_EXPORT __attribute__((visibility("default")))

using residency::preload::Entry;

// A ggml function, forwarded to libggml's definition after `before` (a statement) ran; with no
// definition behind the preload there is nothing to forward to, and `fallback` is returned.
#define RESIDENCY_GGML_HOOK(ret, name, params, args, fallback, before)   \
  RESIDENCY_PRELOAD_EXPORT ret name params {                             \
    using Fn = ret(*) params;                                            \
    static std::atomic<Fn> cache{nullptr};                               \
    static std::atomic<bool> done{false};                                \
    const Fn next = residency::preload::resolve_next(cache, done, #name); \
    if (next == nullptr) return fallback;                                \
    before;                                                              \
    return next args;                                                    \
  }
// An entry point that may read or write backend memory: device memory is woken first.
#define RESIDENCY_GGML_ACCESS(ret, name, params, args, fallback) \
  RESIDENCY_GGML_HOOK(ret, name, params, args, fallback, residency::preload::device_access())
// ggml's graph allocator: device memory it allocates holds the compute buffers (scratch).
#define RESIDENCY_GGML_COMPUTE_ALLOC(ret, name, params, args, fallback) \
  RESIDENCY_GGML_HOOK(ret, name, params, args, fallback, residency::preload::ComputeAllocationScope scope)

extern "C" {

RESIDENCY_PRELOAD_EXPORT void* mmap(void* addr, std::size_t len, int prot, int flags, int fd, off_t off) noexcept {
  return residency::preload::map_hook(addr, len, prot, flags, fd, off, false);
}

#if defined(__GLIBC__)
RESIDENCY_PRELOAD_EXPORT void* mmap64(void* addr, std::size_t len, int prot, int flags, int fd, off64_t off) noexcept {
  return residency::preload::map_hook(addr, len, prot, flags, fd, off, true);
}
#endif

RESIDENCY_PRELOAD_EXPORT int munmap(void* addr, std::size_t len) noexcept {
  return residency::preload::unmap_hook(addr, len);
}

RESIDENCY_PRELOAD_EXPORT std::int32_t llama_decode(llama_context* ctx, llama_batch batch) {
  return residency::preload::decode_hook(Entry::decode, ctx, batch);
}

RESIDENCY_PRELOAD_EXPORT std::int32_t llama_encode(llama_context* ctx, llama_batch batch) {
  return residency::preload::decode_hook(Entry::encode, ctx, batch);
}

// CUDA runtime (libcudart): device memory of 2 MiB or more goes through the cuda backend.
RESIDENCY_PRELOAD_EXPORT int cudaMalloc(void** ptr, std::size_t size) {
  return residency::preload::device_malloc_hook(ptr, size);
}

RESIDENCY_PRELOAD_EXPORT int cudaFree(void* ptr) { return residency::preload::device_free_hook(ptr); }

RESIDENCY_GGML_ACCESS(void, ggml_backend_tensor_set,
                      (struct ggml_tensor * t, const void* data, size_t offset, size_t size),
                      (t, data, offset, size), )
RESIDENCY_GGML_ACCESS(void, ggml_backend_tensor_get,
                      (const struct ggml_tensor* t, void* data, size_t offset, size_t size),
                      (t, data, offset, size), )
RESIDENCY_GGML_ACCESS(void, ggml_backend_tensor_set_2d,
                      (struct ggml_tensor * t, const void* data, size_t offset, size_t size, size_t n, size_t st,
                       size_t sd),
                      (t, data, offset, size, n, st, sd), )
RESIDENCY_GGML_ACCESS(void, ggml_backend_tensor_get_2d,
                      (const struct ggml_tensor* t, void* data, size_t offset, size_t size, size_t n, size_t st,
                       size_t sd),
                      (t, data, offset, size, n, st, sd), )
RESIDENCY_GGML_ACCESS(void, ggml_backend_tensor_memset,
                      (struct ggml_tensor * t, uint8_t value, size_t offset, size_t size), (t, value, offset, size), )
RESIDENCY_GGML_ACCESS(void, ggml_backend_tensor_set_async,
                      (ggml_backend_t b, struct ggml_tensor* t, const void* data, size_t offset, size_t size),
                      (b, t, data, offset, size), )
RESIDENCY_GGML_ACCESS(void, ggml_backend_tensor_get_async,
                      (ggml_backend_t b, const struct ggml_tensor* t, void* data, size_t offset, size_t size),
                      (b, t, data, offset, size), )
RESIDENCY_GGML_ACCESS(void, ggml_backend_tensor_set_2d_async,
                      (ggml_backend_t b, struct ggml_tensor* t, const void* data, size_t offset, size_t size,
                       size_t n, size_t st, size_t sd),
                      (b, t, data, offset, size, n, st, sd), )
RESIDENCY_GGML_ACCESS(void, ggml_backend_tensor_get_2d_async,
                      (ggml_backend_t b, const struct ggml_tensor* t, void* data, size_t offset, size_t size,
                       size_t n, size_t st, size_t sd),
                      (b, t, data, offset, size, n, st, sd), )
RESIDENCY_GGML_ACCESS(void, ggml_backend_tensor_copy, (const struct ggml_tensor* src, struct ggml_tensor* dst),
                      (src, dst), )
RESIDENCY_GGML_ACCESS(void, ggml_backend_tensor_copy_async,
                      (ggml_backend_t bs, ggml_backend_t bd, const struct ggml_tensor* src, struct ggml_tensor* dst),
                      (bs, bd, src, dst), )
RESIDENCY_GGML_ACCESS(void, ggml_backend_buffer_clear, (ggml_backend_buffer_t buffer, uint8_t value),
                      (buffer, value), )
RESIDENCY_GGML_ACCESS(enum ggml_status, ggml_backend_graph_compute, (ggml_backend_t b, struct ggml_cgraph* g),
                      (b, g), GGML_STATUS_FAILED)
RESIDENCY_GGML_ACCESS(enum ggml_status, ggml_backend_graph_compute_async,
                      (ggml_backend_t b, struct ggml_cgraph* g), (b, g), GGML_STATUS_FAILED)
RESIDENCY_GGML_ACCESS(enum ggml_status, ggml_backend_sched_graph_compute,
                      (ggml_backend_sched_t s, struct ggml_cgraph* g), (s, g), GGML_STATUS_FAILED)
RESIDENCY_GGML_ACCESS(enum ggml_status, ggml_backend_sched_graph_compute_async,
                      (ggml_backend_sched_t s, struct ggml_cgraph* g), (s, g), GGML_STATUS_FAILED)

// llama.cpp's buffers (ggml_buffers.hpp): made, placed in, marked, freed.
#define RESIDENCY_NEXT(name)                                              \
  static std::atomic<decltype(&name)> cache{nullptr};                   \
  static std::atomic<bool> done{false};                                 \
  const auto next = residency::preload::resolve_next(cache, done, #name)

RESIDENCY_PRELOAD_EXPORT ggml_backend_buffer_t ggml_backend_buft_alloc_buffer(ggml_backend_buffer_type_t buft,
                                                                              size_t size) {
  RESIDENCY_NEXT(ggml_backend_buft_alloc_buffer);
  if (next == nullptr) return nullptr;
  ggml_backend_buffer_t b = next(buft, size);
  residency::preload::buffer_created_hook(b, false);
  return b;
}

RESIDENCY_PRELOAD_EXPORT ggml_backend_buffer_t ggml_backend_cpu_buffer_from_ptr(void* ptr, size_t size) {
  RESIDENCY_NEXT(ggml_backend_cpu_buffer_from_ptr);
  if (next == nullptr) return nullptr;
  ggml_backend_buffer_t b = next(ptr, size);
  residency::preload::buffer_created_hook(b, true);
  return b;
}

RESIDENCY_PRELOAD_EXPORT ggml_backend_buffer_t ggml_backend_dev_buffer_from_host_ptr(ggml_backend_dev_t device,
                                                                                     void* ptr, size_t size,
                                                                                     size_t max_tensor_size) {
  RESIDENCY_NEXT(ggml_backend_dev_buffer_from_host_ptr);
  if (next == nullptr) return nullptr;
  ggml_backend_buffer_t b = next(device, ptr, size, max_tensor_size);
  residency::preload::buffer_created_hook(b, true);
  return b;
}

RESIDENCY_PRELOAD_EXPORT enum ggml_status ggml_backend_tensor_alloc(ggml_backend_buffer_t buffer,
                                                                    struct ggml_tensor* tensor, void* addr) {
  RESIDENCY_NEXT(ggml_backend_tensor_alloc);
  if (next == nullptr) return GGML_STATUS_FAILED;
  const enum ggml_status st = next(buffer, tensor, addr);
  if (st == GGML_STATUS_SUCCESS) residency::preload::tensor_alloc_hook(buffer, tensor, addr);
  return st;
}

RESIDENCY_PRELOAD_EXPORT void ggml_backend_buffer_set_usage(ggml_backend_buffer_t buffer,
                                                            enum ggml_backend_buffer_usage usage) {
  RESIDENCY_NEXT(ggml_backend_buffer_set_usage);
  if (next == nullptr) return;
  next(buffer, usage);
  residency::preload::buffer_usage_hook(buffer, usage);
}

RESIDENCY_PRELOAD_EXPORT void ggml_backend_buffer_free(ggml_backend_buffer_t buffer) {
  RESIDENCY_NEXT(ggml_backend_buffer_free);
  if (next == nullptr) return;
  residency::preload::buffer_free_hook(buffer);
  next(buffer);
}

RESIDENCY_PRELOAD_EXPORT llama_model* llama_model_load_from_file(const char* path, llama_model_params params) {
  RESIDENCY_NEXT(llama_model_load_from_file);
  if (next == nullptr) return nullptr;
  llama_model* m = next(path, params);
  residency::preload::model_loaded_hook(m);
  return m;
}

RESIDENCY_PRELOAD_EXPORT llama_model* llama_model_load_from_splits(const char** paths, size_t n_paths,
                                                                   llama_model_params params) {
  RESIDENCY_NEXT(llama_model_load_from_splits);
  if (next == nullptr) return nullptr;
  llama_model* m = next(paths, n_paths, params);
  residency::preload::model_loaded_hook(m);
  return m;
}

RESIDENCY_PRELOAD_EXPORT llama_context* llama_init_from_model(llama_model* model, llama_context_params params) {
  RESIDENCY_NEXT(llama_init_from_model);
  if (next == nullptr) return nullptr;
  llama_context* c = next(model, params);
  residency::preload::context_made_hook(c);
  return c;
}

RESIDENCY_GGML_COMPUTE_ALLOC(bool, ggml_gallocr_reserve_n,
                             (ggml_gallocr_t galloc, struct ggml_cgraph* graph, const int* node_ids,
                              const int* leaf_ids),
                             (galloc, graph, node_ids, leaf_ids), false)
RESIDENCY_GGML_COMPUTE_ALLOC(bool, ggml_gallocr_alloc_graph, (ggml_gallocr_t galloc, struct ggml_cgraph* graph),
                             (galloc, graph), false)

}  // extern "C"
