// SPDX-License-Identifier: MIT
// libresidency_preload.so's exported symbols, the only ones it exports (exports.map): the
// functions it interposes. Each keeps the re-entry, errno and fork guards, calls the real
// function (next_calls.hpp), and tells the process's EngineSession what the engine did
// (process_session.hpp); the session decides everything.
#include <sys/mman.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <string>

#include <ggml-alloc.h>
#include <ggml-backend.h>
#include <llama.h>

#include "buffer_plan.hpp"
#include "engine_session.hpp"
#include "ggml_api.hpp"
#include "next_calls.hpp"
#include "process_session.hpp"

#define RESIDENCY_PRELOAD_EXPORT __attribute__((visibility("default")))

namespace residency::preload {
namespace {

std::uintptr_t page_end(std::uintptr_t begin, std::size_t len) noexcept {
  const std::uintptr_t page = system_page_size();
  const std::uintptr_t e = begin + len;
  if (e < begin) return UINTPTR_MAX & ~(page - 1);
  return (e + page - 1) & ~(page - 1);
}

// `f(session)` with errno kept and re-entry marked, on the session if it was made; nothing when
// this thread is inside a hook already.
template <class F>
void tell_started(F&& f) noexcept {
  if (in_hook()) return;
  EngineSession* s = started_session();
  if (s == nullptr) return;
  ErrnoKeeper keep;
  HookScope hook;
  f(*s);
}

// The same, making the session on first need (the calls that start it: a model file's mapping,
// a ggml buffer).
template <class F>
void tell(F&& f) noexcept {
  if (in_hook() || forked_child()) return;
  ErrnoKeeper keep;
  HookScope hook;
  if (EngineSession* s = process_session()) f(*s);
}

template <class Call>
void* map(void* addr, std::size_t len, int prot, int flags, int fd, off64_t off, Call call) noexcept {
  if (in_hook() || forked_child()) return call();
  const bool wanted = SessionRules::may_be_model_file(prot, flags, fd, len);
  EngineSession* s = started_session();
  const auto b = reinterpret_cast<std::uintptr_t>(addr);
  void* r = MAP_FAILED;
  if ((flags & MAP_FIXED) != 0 && s != nullptr && s->tracks(b, page_end(b, len))) {
    // The new mapping replaces tracked memory: that part is unmapped first.
    HookScope hook;
    const int saved = errno;
    int err = 0;
    s->unmap(b, page_end(b, len), [&] {
      errno = saved;
      r = call();
      err = errno;
      return r != MAP_FAILED;
    });
    errno = err;
  } else {
    r = call();
  }
  if (r == MAP_FAILED || !wanted) return r;
  HookScope hook;
  ErrnoKeeper keep;  // what the real mmap left
  if (const std::size_t n = SessionRules::gguf_bytes(fd, off, len))
    if (EngineSession* session = process_session()) session->file_mapped(r, n);
  return r;
}

int unmap(void* addr, std::size_t len) noexcept {
  if (in_hook()) return next_munmap(addr, len);
  EngineSession* s = started_session();
  const auto b = reinterpret_cast<std::uintptr_t>(addr);
  const std::uintptr_t e = page_end(b, len);
  if (s == nullptr || len == 0 || !s->tracks(b, e)) return next_munmap(addr, len);
  HookScope hook;
  const int saved = errno;
  int r = -1, err = 0;
  s->unmap(b, e, [&] {
    errno = saved;
    r = next_munmap(addr, len);
    err = errno;
    return r == 0;
  });
  errno = err;
  return r;
}

std::int32_t decode(DecodeFn next, const char* name, llama_context* ctx, llama_batch batch) {
  if (next == nullptr) {
    // Only reachable when something calls the preload's definition directly: libllama's is not
    // behind it. There is nothing to forward to.
    static std::atomic<bool> warned{false};
    if (!warned.exchange(true)) {
      ErrnoKeeper keep;
      warn(std::string(name) + " was called, but no library behind the preload defines it; returning -1");
    }
    return -1;
  }
  EngineSession* s = in_hook() ? nullptr : started_session();
  if (s == nullptr) return next(ctx, batch);
  EngineSession::DecodeScope scope;
  {
    ErrnoKeeper keep;
    HookScope hook;
    scope = s->decode_began();
  }
  const std::int32_t r = next(ctx, batch);
  {
    ErrnoKeeper keep;
    HookScope hook;
    s->decode_ended(scope, ctx);
  }
  return r;
}

// cudaError_t values (the runtime's headers are not needed to build the preload).
constexpr int kCudaSuccess = 0;
constexpr int kCudaErrorMemoryAllocation = 2;
constexpr int kCudaErrorInitialization = 3;

int device_malloc(void** ptr, std::size_t size) noexcept {
  using CudaMallocFn = int (*)(void**, std::size_t);
  using CudaGetDeviceFn = int (*)(int*);
  static std::atomic<CudaMallocFn> malloc_cache{nullptr};
  static std::atomic<bool> malloc_done{false};
  static std::atomic<CudaGetDeviceFn> device_cache{nullptr};
  static std::atomic<bool> device_done{false};
  const CudaMallocFn next = resolve_next(malloc_cache, malloc_done, "cudaMalloc");
  if (next == nullptr) return kCudaErrorInitialization;  // no CUDA runtime behind the preload
  if (in_hook() || ptr == nullptr || size < SessionRules::kMinRoutedDeviceBytes || forked_child())
    return next(ptr, size);
  const CudaGetDeviceFn get_device = resolve_next(device_cache, device_done, "cudaGetDevice");
  int dev = -1;
  if (get_device == nullptr || get_device(&dev) != kCudaSuccess) return next(ptr, size);
  EngineSession::DeviceAllocation a;
  {
    HookScope hook;
    ErrnoKeeper keep;
    if (EngineSession* s = process_session()) a = s->device_allocate(dev, size, in_compute_allocation());
  }
  switch (a.outcome) {
    case EngineSession::DeviceAllocation::Outcome::routed: *ptr = a.ptr; return kCudaSuccess;
    case EngineSession::DeviceAllocation::Outcome::out_of_memory: return kCudaErrorMemoryAllocation;
    case EngineSession::DeviceAllocation::Outcome::pass_through: break;
  }
  return next(ptr, size);
}

int device_free(void* ptr) noexcept {
  using CudaFreeFn = int (*)(void*);
  static std::atomic<CudaFreeFn> cache{nullptr};
  static std::atomic<bool> done{false};
  const CudaFreeFn next = resolve_next(cache, done, "cudaFree");
  if (next == nullptr) return kCudaErrorInitialization;
  if (ptr == nullptr || in_hook()) return next(ptr);
  EngineSession* s = started_session();
  if (s == nullptr) return next(ptr);
  bool routed = false;
  {
    HookScope hook;
    ErrnoKeeper keep;
    routed = s->device_free(ptr);
  }
  return routed ? kCudaSuccess : next(ptr);
}

void device_access() noexcept {
  tell_started([](EngineSession& s) { s.device_access(); });
}

}  // namespace
}  // namespace residency::preload

namespace rp = residency::preload;

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
  RESIDENCY_GGML_HOOK(ret, name, params, args, fallback, rp::device_access())
// ggml's graph allocator: device memory it allocates holds the compute buffers (scratch).
#define RESIDENCY_GGML_COMPUTE_ALLOC(ret, name, params, args, fallback) \
  RESIDENCY_GGML_HOOK(ret, name, params, args, fallback, rp::ComputeAllocationScope scope)

extern "C" {

RESIDENCY_PRELOAD_EXPORT void* mmap(void* addr, std::size_t len, int prot, int flags, int fd, off_t off) noexcept {
  return rp::map(addr, len, prot, flags, fd, off, [&]() noexcept { return rp::next_mmap(addr, len, prot, flags, fd, off); });
}

#if defined(__GLIBC__)
RESIDENCY_PRELOAD_EXPORT void* mmap64(void* addr, std::size_t len, int prot, int flags, int fd, off64_t off) noexcept {
  return rp::map(addr, len, prot, flags, fd, off,
                 [&]() noexcept { return rp::next_mmap64(addr, len, prot, flags, fd, off); });
}
#endif

RESIDENCY_PRELOAD_EXPORT int munmap(void* addr, std::size_t len) noexcept { return rp::unmap(addr, len); }

RESIDENCY_PRELOAD_EXPORT std::int32_t llama_decode(llama_context* ctx, llama_batch batch) {
  return rp::decode(rp::next_llama_decode(), "llama_decode", ctx, batch);
}

RESIDENCY_PRELOAD_EXPORT std::int32_t llama_encode(llama_context* ctx, llama_batch batch) {
  return rp::decode(rp::next_llama_encode(), "llama_encode", ctx, batch);
}

// CUDA runtime (libcudart): device memory of 2 MiB or more goes through the cuda backend.
RESIDENCY_PRELOAD_EXPORT int cudaMalloc(void** ptr, std::size_t size) { return rp::device_malloc(ptr, size); }

RESIDENCY_PRELOAD_EXPORT int cudaFree(void* ptr) { return rp::device_free(ptr); }

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
  rp::tell([b](rp::EngineSession& s) { s.buffer_created(rp::buffer_id(b), false); });
  return b;
}

RESIDENCY_PRELOAD_EXPORT ggml_backend_buffer_t ggml_backend_cpu_buffer_from_ptr(void* ptr, size_t size) {
  RESIDENCY_NEXT(ggml_backend_cpu_buffer_from_ptr);
  if (next == nullptr) return nullptr;
  ggml_backend_buffer_t b = next(ptr, size);
  rp::tell([b](rp::EngineSession& s) { s.buffer_created(rp::buffer_id(b), true); });
  return b;
}

RESIDENCY_PRELOAD_EXPORT ggml_backend_buffer_t ggml_backend_dev_buffer_from_host_ptr(ggml_backend_dev_t device,
                                                                                     void* ptr, size_t size,
                                                                                     size_t max_tensor_size) {
  RESIDENCY_NEXT(ggml_backend_dev_buffer_from_host_ptr);
  if (next == nullptr) return nullptr;
  ggml_backend_buffer_t b = next(device, ptr, size, max_tensor_size);
  rp::tell([b](rp::EngineSession& s) { s.buffer_created(rp::buffer_id(b), true); });
  return b;
}

RESIDENCY_PRELOAD_EXPORT enum ggml_status ggml_backend_tensor_alloc(ggml_backend_buffer_t buffer,
                                                                    struct ggml_tensor* tensor, void* addr) {
  RESIDENCY_NEXT(ggml_backend_tensor_alloc);
  if (next == nullptr) return GGML_STATUS_FAILED;
  const enum ggml_status st = next(buffer, tensor, addr);
  // Lock-free for every buffer but those over memory that is not ggml's (a model file's).
  if (st != GGML_STATUS_SUCCESS || tensor == nullptr || addr == nullptr || rp::in_hook()) return st;
  rp::EngineSession* s = rp::started_session();
  if (s == nullptr || !s->wants_tensor_placements(rp::buffer_id(buffer))) return st;
  const rp::GgmlApi* api = rp::ggml_api();
  if (api == nullptr) return st;
  const auto begin = reinterpret_cast<std::uintptr_t>(addr);
  const std::uintptr_t end = begin + api->nbytes(tensor);
  rp::tell_started([&](rp::EngineSession& session) { session.tensor_placed(rp::buffer_id(buffer), begin, end); });
  return st;
}

RESIDENCY_PRELOAD_EXPORT void ggml_backend_buffer_set_usage(ggml_backend_buffer_t buffer,
                                                            enum ggml_backend_buffer_usage usage) {
  RESIDENCY_NEXT(ggml_backend_buffer_set_usage);
  if (next == nullptr) return;
  next(buffer, usage);
  rp::tell_started([&](rp::EngineSession& s) { s.buffer_usage(rp::buffer_id(buffer), rp::buffer_usage_of(usage)); });
}

RESIDENCY_PRELOAD_EXPORT void ggml_backend_buffer_free(ggml_backend_buffer_t buffer) {
  RESIDENCY_NEXT(ggml_backend_buffer_free);
  if (next == nullptr) return;
  if (buffer != nullptr) rp::tell_started([&](rp::EngineSession& s) { s.buffer_freed(rp::buffer_id(buffer)); });
  next(buffer);
}

RESIDENCY_PRELOAD_EXPORT llama_model* llama_model_load_from_file(const char* path, llama_model_params params) {
  RESIDENCY_NEXT(llama_model_load_from_file);
  if (next == nullptr) return nullptr;
  llama_model* m = next(path, params);
  if (m != nullptr) rp::tell_started([](rp::EngineSession& s) { s.model_loaded(); });
  return m;
}

RESIDENCY_PRELOAD_EXPORT llama_model* llama_model_load_from_splits(const char** paths, size_t n_paths,
                                                                   llama_model_params params) {
  RESIDENCY_NEXT(llama_model_load_from_splits);
  if (next == nullptr) return nullptr;
  llama_model* m = next(paths, n_paths, params);
  if (m != nullptr) rp::tell_started([](rp::EngineSession& s) { s.model_loaded(); });
  return m;
}

RESIDENCY_PRELOAD_EXPORT llama_context* llama_init_from_model(llama_model* model, llama_context_params params) {
  RESIDENCY_NEXT(llama_init_from_model);
  if (next == nullptr) return nullptr;
  llama_context* c = next(model, params);
  if (c != nullptr) rp::tell_started([](rp::EngineSession& s) { s.context_made(); });
  return c;
}

RESIDENCY_GGML_COMPUTE_ALLOC(bool, ggml_gallocr_reserve_n,
                             (ggml_gallocr_t galloc, struct ggml_cgraph* graph, const int* node_ids,
                              const int* leaf_ids),
                             (galloc, graph, node_ids, leaf_ids), false)
RESIDENCY_GGML_COMPUTE_ALLOC(bool, ggml_gallocr_alloc_graph, (ggml_gallocr_t galloc, struct ggml_cgraph* graph),
                             (galloc, graph), false)

}  // extern "C"
