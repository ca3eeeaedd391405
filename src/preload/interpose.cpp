// SPDX-License-Identifier: MIT
// libresidency_preload.so's exported symbols, the only ones it exports (exports.map): the
// functions it interposes. Each keeps the re-entry, errno and fork guards, calls the real
// function (next_calls.hpp), and tells the process's EngineSession what the engine did
// (process_session.hpp); the session decides everything.
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <string>

#include <ggml-alloc.h>
#include <ggml-backend.h>
#include <llama.h>

#include "buffer_plan.hpp"
#include "engine_session.hpp"
#include "ggml_api.hpp"
#include "graph_writes.hpp"
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
void tell(const void* near, F&& f) noexcept {
  if (in_hook() || forked_child()) return;
  ErrnoKeeper keep;
  HookScope hook;
  if (EngineSession* s = process_session(near)) f(*s);
}

template <class Call>
void* map(void* addr, std::size_t len, int prot, int flags, int fd, off64_t off, const void* caller, Call call) noexcept {
  if (in_hook() || forked_child()) return call();
  const bool wanted = SessionRules::may_be_model_file(prot, flags, fd, len);
  EngineSession* s = started_session();
  if (s != nullptr && s->snapshotting() && !called_from_preload(caller)) s->wait_for_snapshot();
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
  if (r == MAP_FAILED) return r;
  const auto rb = reinterpret_cast<std::uintptr_t>(r);
  if (s != nullptr && (flags & MAP_FIXED) == 0) {
    const bool anonymous_private = (flags & MAP_ANONYMOUS) != 0 && (flags & MAP_PRIVATE) != 0;
    if (in_engine_call() && anonymous_private) {
      HookScope hook;
      ErrnoKeeper keep;
      s->engine_mapped(rb, page_end(rb, len));
    } else if (s->tracks(rb, page_end(rb, len))) {
      HookScope hook;
      ErrnoKeeper keep;
      s->mapped_over(rb, page_end(rb, len));
    }
  }
  if (!wanted) return r;
  HookScope hook;
  ErrnoKeeper keep;  // what the real mmap left
  if (const std::size_t n = SessionRules::gguf_bytes(fd, off, len))
    if (EngineSession* session = process_session(caller)) session->file_mapped(r, n, fd, static_cast<std::uint64_t>(off));
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

// llama_decode's "< -1: fatal error": nothing of the batch was processed, and llama-server fails
// the request and goes on serving.
constexpr std::int32_t kDecodeRefused = -3;

std::int32_t decode(DecodeFn next, llama_context* ctx, llama_batch batch) {
  // No library defines it (said once by resolve_next): there is nothing to forward to.
  if (next == nullptr) return -1;
  EngineSession* s = in_hook() ? nullptr : started_session();
  if (s == nullptr) return next(ctx, batch);
  EngineSession::DecodeScope scope;
  {
    ErrnoKeeper keep;
    HookScope hook;
    scope = s->decode_began(reinterpret_cast<std::uintptr_t>(&scope));
    if (scope.device_asleep) {  // refused, not run on unmapped device memory (said by the session)
      s->decode_ended(scope, nullptr);
      return kDecodeRefused;
    }
  }
  std::int32_t r = 0;
  {
    EngineCallScope engine;
    r = next(ctx, batch);
  }
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

int device_malloc(void** ptr, std::size_t size, const void* caller) noexcept {
  using CudaMallocFn = int (*)(void**, std::size_t);
  using CudaGetDeviceFn = int (*)(int*);
  static std::atomic<CudaMallocFn> malloc_cache{nullptr};
  static std::atomic<bool> malloc_warned{false};
  static std::atomic<CudaGetDeviceFn> device_cache{nullptr};
  static std::atomic<bool> device_warned{false};
  const CudaMallocFn next = resolve_next(malloc_cache, malloc_warned, "cudaMalloc", caller);
  if (next == nullptr) return kCudaErrorInitialization;  // no CUDA runtime behind the preload
  if (in_hook() || ptr == nullptr || size < SessionRules::kMinRoutedDeviceBytes || forked_child())
    return next(ptr, size);
  const CudaGetDeviceFn get_device = resolve_next(device_cache, device_warned, "cudaGetDevice",
                                                  reinterpret_cast<const void*>(next));
  int dev = -1;
  if (get_device == nullptr || get_device(&dev) != kCudaSuccess) return next(ptr, size);
  EngineSession::DeviceAllocation a;
  {
    HookScope hook;
    ErrnoKeeper keep;
    if (EngineSession* s = process_session(caller)) a = s->device_allocate(dev, size, in_compute_allocation());
  }
  switch (a.outcome) {
    case EngineSession::DeviceAllocation::Outcome::routed: *ptr = a.ptr; return kCudaSuccess;
    case EngineSession::DeviceAllocation::Outcome::out_of_memory: return kCudaErrorMemoryAllocation;
    case EngineSession::DeviceAllocation::Outcome::pass_through: break;
  }
  return next(ptr, size);
}

int device_free(void* ptr, const void* caller) noexcept {
  using CudaFreeFn = int (*)(void*);
  static std::atomic<CudaFreeFn> cache{nullptr};
  static std::atomic<bool> warned{false};
  const CudaFreeFn next = resolve_next(cache, warned, "cudaFree", caller);
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

// Device memory is about to be written at [begin, end) through one of ggml's entry points (after
// device_access() woke it): reported where its writes are tracked. Lock-free when none are.
void device_write(std::uintptr_t begin, std::uintptr_t end) noexcept {
  EngineSession* s = started_session();
  if (s != nullptr && s->tracks_device_writes()) s->device_written(begin, end);
}

void tensor_write(const ggml_tensor* t, std::size_t offset, std::size_t bytes) noexcept {
  if (t != nullptr && t->data != nullptr) {
    const std::uintptr_t b = reinterpret_cast<std::uintptr_t>(t->data) + offset;
    device_write(b, b + bytes);
  }
}

// A tensor set from host memory at `data`: a weight loaded from a GGUF mapping is filled from its
// file (the file is its backup), anything else is a write.
void tensor_fill(const ggml_tensor* t, const void* data, std::size_t offset, std::size_t bytes) noexcept {
  EngineSession* s = started_session();
  if (t == nullptr || t->data == nullptr || s == nullptr || !s->tracks_device_writes()) return;
  const std::uintptr_t b = reinterpret_cast<std::uintptr_t>(t->data) + offset;
  s->device_filled(b, b + bytes, reinterpret_cast<std::uintptr_t>(data));
}

// The bytes of `t` as ggml counts them (a copy's or a graph node's destination).
void tensor_write_whole(const ggml_tensor* t, const void* near) noexcept {
  if (t == nullptr || t->data == nullptr) return;
  EngineSession* s = started_session();
  if (s == nullptr || !s->tracks_device_writes()) return;
  if (const GgmlApi* api = ggml_api(near)) tensor_write(t, 0, api->nbytes(t));
}

void buffer_write(ggml_backend_buffer_t b, const void* near) noexcept {
  EngineSession* s = started_session();
  if (b == nullptr || s == nullptr || !s->tracks_device_writes()) return;
  if (const GgmlApi* api = ggml_api(near)) {
    const auto base = reinterpret_cast<std::uintptr_t>(api->get_base(b));
    s->device_written(base, base + api->get_size(b));
  }
}

// A graph about to run writes its nodes (graph_writes.hpp). The tracked ranges (weights) are never
// a node's in llama.cpp, so this finds nothing there; it is what makes "never written after load" a
// fact checked at every compute rather than an assumption.
void graph_write(ggml_cgraph* g, const void* near) noexcept {
  EngineSession* s = started_session();
  if (g == nullptr || s == nullptr || !s->tracks_device_writes()) return;
  if (const GgmlApi* api = ggml_api(near)) report_graph_writes(*api, g, *s);
}

// A ggml graph compute: inside a decode the preload saw, it only wakes device memory; outside one
// (the program calls llama_decode through a pointer from dlsym, past the preload) it is the
// engine's call itself. `writes` reports what the graph writes, once its memory is awake.
template <class Call, class Writes>
auto graph_compute(Call call, Writes writes) noexcept {
  EngineSession* s = in_hook() || in_engine_call() ? nullptr : started_session();
  if (s == nullptr) {
    device_access();
    writes();
    return call();
  }
  EngineSession::DecodeScope scope;
  {
    ErrnoKeeper keep;
    HookScope hook;
    s->decodes_seen_as_graph_computes();
    scope = s->decode_began(reinterpret_cast<std::uintptr_t>(&scope));
    if (scope.device_asleep) {  // refused, not run on unmapped device memory (said by the session)
      s->decode_ended(scope, nullptr);
      return static_cast<decltype(call())>(GGML_STATUS_FAILED);
    }
    writes();
  }
  auto r = [&] {
    EngineCallScope engine;
    return call();
  }();
  {
    ErrnoKeeper keep;
    HookScope hook;
    s->decode_ended(scope, nullptr);
  }
  return r;
}

template <class Call>
int program_locks(const void* addr, std::size_t len, const void* caller, Call call) noexcept;

// The program's own memory calls: what the session holds there is let go of first (so the call
// does what it would without the preload); the preload's own calls (the residency library's mlock
// and munlock) pass straight through.
bool program_call(const void* caller) noexcept { return !in_hook() && !forked_child() && !called_from_preload(caller); }

// Advice that fails or does nothing on locked pages, and means the program is done with them.
bool takes_back(int advice) noexcept {
  switch (advice) {
    case MADV_DONTNEED:
#ifdef MADV_FREE
    case MADV_FREE:
#endif
#ifdef MADV_PAGEOUT
    case MADV_PAGEOUT:
#endif
#ifdef MADV_COLD
    case MADV_COLD:
#endif
    case MADV_REMOVE: return true;
    default: return false;
  }
}

template <class Call>
auto around_take_back(void* addr, std::size_t len, Call call) noexcept {
  EngineSession* s = started_session();
  const auto b = reinterpret_cast<std::uintptr_t>(addr);
  if (s == nullptr || len == 0 || !s->tracks(b, page_end(b, len))) return call();
  HookScope hook;
  const int saved = errno;
  int err = 0;
  auto r = s->program_takes_back(b, page_end(b, len), [&] {
    errno = saved;
    auto result = call();
    err = errno;
    return result;
  });
  errno = err;
  return r;
}

template <class Call>
int program_locks(const void* addr, std::size_t len, const void* caller, Call call) noexcept {
  EngineSession* s = program_call(caller) ? started_session() : nullptr;
  if (s == nullptr || len == 0) return call();
  HookScope hook;
  const int saved = errno;
  int r = -1, err = 0;
  const auto b = reinterpret_cast<std::uintptr_t>(addr);
  s->program_locks(b, page_end(b, len), [&] {
    errno = saved;
    r = call();
    err = errno;
    return r == 0;
  });
  errno = err;
  return r;
}

}  // namespace
}  // namespace residency::preload

namespace rp = residency::preload;

// A ggml function, forwarded to libggml's definition after `before` (a statement) ran; with no
// definition behind the preload there is nothing to forward to, and `fallback` is returned.
#define RESIDENCY_GGML_HOOK(ret, name, params, args, fallback, before)                   \
  RESIDENCY_PRELOAD_EXPORT ret name params {                                             \
    using Fn = ret(*) params;                                                            \
    static std::atomic<Fn> cache{nullptr};                                               \
    static std::atomic<bool> warned{false};                                              \
    const Fn next = rp::resolve_next(cache, warned, #name, __builtin_return_address(0)); \
    if (next == nullptr) return fallback;                                                \
    before;                                                                              \
    return next args;                                                                    \
  }
// An entry point that may read or write backend memory: device memory is woken first.
#define RESIDENCY_GGML_ACCESS(ret, name, params, args, fallback) \
  RESIDENCY_GGML_HOOK(ret, name, params, args, fallback, rp::device_access())
// An entry point that writes backend memory: woken first, then the write reported (`range`, a
// statement), then made.
#define RESIDENCY_GGML_WRITE(ret, name, params, args, fallback, range) \
  RESIDENCY_GGML_HOOK(ret, name, params, args, fallback, rp::device_access(); range)
// ggml's graph allocator: device memory it allocates holds the compute buffers (scratch).
#define RESIDENCY_GGML_COMPUTE_ALLOC(ret, name, params, args, fallback) \
  RESIDENCY_GGML_HOOK(ret, name, params, args, fallback, rp::ComputeAllocationScope scope)

extern "C" {

RESIDENCY_PRELOAD_EXPORT void* mmap(void* addr, std::size_t len, int prot, int flags, int fd, off_t off) noexcept {
  return rp::map(addr, len, prot, flags, fd, off, __builtin_return_address(0),
                 [&]() noexcept { return rp::next_mmap(addr, len, prot, flags, fd, off); });
}

#if defined(__GLIBC__)
RESIDENCY_PRELOAD_EXPORT void* mmap64(void* addr, std::size_t len, int prot, int flags, int fd, off64_t off) noexcept {
  return rp::map(addr, len, prot, flags, fd, off, __builtin_return_address(0),
                 [&]() noexcept { return rp::next_mmap64(addr, len, prot, flags, fd, off); });
}
#endif

RESIDENCY_PRELOAD_EXPORT int munmap(void* addr, std::size_t len) noexcept { return rp::unmap(addr, len); }

RESIDENCY_PRELOAD_EXPORT int madvise(void* addr, std::size_t len, int advice) noexcept {
  const rp::MadviseFn next = rp::next_madvise();
  if (next == nullptr) return static_cast<int>(::syscall(SYS_madvise, addr, len, advice));
  if (!rp::takes_back(advice) || !rp::program_call(__builtin_return_address(0))) return next(addr, len, advice);
  return rp::around_take_back(addr, len, [&]() noexcept { return next(addr, len, advice); });
}

RESIDENCY_PRELOAD_EXPORT int mprotect(void* addr, std::size_t len, int prot) noexcept {
  const rp::MprotectFn next = rp::next_mprotect();
  if (next == nullptr) return static_cast<int>(::syscall(SYS_mprotect, addr, len, prot));
  // PROT_NONE: a runtime decommits its heap (V8, Go, the JVM); locked pages would stay in memory.
  if (prot != PROT_NONE || !rp::program_call(__builtin_return_address(0))) return next(addr, len, prot);
  return rp::around_take_back(addr, len, [&]() noexcept { return next(addr, len, prot); });
}

RESIDENCY_PRELOAD_EXPORT void* mremap(void* old_addr, std::size_t old_size, std::size_t new_size, int flags, ...) noexcept {
  void* new_addr = nullptr;
  if ((flags & MREMAP_FIXED) != 0) {
    va_list ap;
    va_start(ap, flags);
    new_addr = va_arg(ap, void*);
    va_end(ap);
  }
  const rp::MremapFn next = rp::next_mremap();
  auto call = [&]() noexcept {
    if (next == nullptr)
      return reinterpret_cast<void*>(::syscall(SYS_mremap, old_addr, old_size, new_size, flags, new_addr));
    return (flags & MREMAP_FIXED) != 0 ? next(old_addr, old_size, new_size, flags, new_addr)
                                       : next(old_addr, old_size, new_size, flags);
  };
  // A locked mapping moved or grown stays locked, and the kernel populates all of it: what the
  // session held of it is let go of first.
  if (!rp::program_call(__builtin_return_address(0))) return call();
  return rp::around_take_back(old_addr, old_size, call);
}

RESIDENCY_PRELOAD_EXPORT int mlock(const void* addr, std::size_t len) noexcept {
  const rp::MlockFn next = rp::next_mlock();
  if (next == nullptr) return static_cast<int>(::syscall(SYS_mlock, addr, len));
  return rp::program_locks(addr, len, __builtin_return_address(0), [&]() noexcept { return next(addr, len); });
}

RESIDENCY_PRELOAD_EXPORT int mlock2(const void* addr, std::size_t len, unsigned int flags) noexcept {
  const rp::Mlock2Fn next = rp::next_mlock2();
  if (next == nullptr) return static_cast<int>(::syscall(SYS_mlock2, addr, len, flags));
  return rp::program_locks(addr, len, __builtin_return_address(0), [&]() noexcept { return next(addr, len, flags); });
}

RESIDENCY_PRELOAD_EXPORT int munlock(const void* addr, std::size_t len) noexcept {
  const rp::MlockFn next = rp::next_munlock();
  const int r = next != nullptr ? next(addr, len) : static_cast<int>(::syscall(SYS_munlock, addr, len));
  if (r == 0 && rp::program_call(__builtin_return_address(0)))
    rp::tell_started([&](rp::EngineSession& s) {
      const auto b = reinterpret_cast<std::uintptr_t>(addr);
      s.program_unlocked(b, rp::page_end(b, len));
    });
  return r;
}

RESIDENCY_PRELOAD_EXPORT int mlockall(int flags) noexcept {
  const rp::MlockallFn next = rp::next_mlockall();
  auto call = [&]() noexcept { return next != nullptr ? next(flags) : static_cast<int>(::syscall(SYS_mlockall, flags)); };
  rp::EngineSession* s = rp::program_call(__builtin_return_address(0)) ? rp::started_session() : nullptr;
  if (s == nullptr) return call();
  rp::HookScope hook;
  const int saved = errno;
  int err = 0;
  const int r = s->program_locks_all([&] {
    errno = saved;
    const int result = call();
    err = errno;
    return result;
  });
  errno = err;
  return r;
}

RESIDENCY_PRELOAD_EXPORT std::int32_t llama_decode(llama_context* ctx, llama_batch batch) {
  return rp::decode(rp::next_llama_decode(__builtin_return_address(0)), ctx, batch);
}

RESIDENCY_PRELOAD_EXPORT std::int32_t llama_encode(llama_context* ctx, llama_batch batch) {
  return rp::decode(rp::next_llama_encode(__builtin_return_address(0)), ctx, batch);
}

// CUDA runtime (libcudart): device memory of 2 MiB or more goes through the cuda backend.
RESIDENCY_PRELOAD_EXPORT int cudaMalloc(void** ptr, std::size_t size) {
  return rp::device_malloc(ptr, size, __builtin_return_address(0));
}

RESIDENCY_PRELOAD_EXPORT int cudaFree(void* ptr) { return rp::device_free(ptr, __builtin_return_address(0)); }

RESIDENCY_GGML_WRITE(void, ggml_backend_tensor_set,
                     (struct ggml_tensor * t, const void* data, size_t offset, size_t size), (t, data, offset, size), ,
                     rp::tensor_fill(t, data, offset, size))
RESIDENCY_GGML_ACCESS(void, ggml_backend_tensor_get,
                      (const struct ggml_tensor* t, void* data, size_t offset, size_t size), (t, data, offset, size), )
RESIDENCY_GGML_WRITE(void, ggml_backend_tensor_set_2d,
                     (struct ggml_tensor * t, const void* data, size_t offset, size_t size, size_t n, size_t st, size_t sd),
                     (t, data, offset, size, n, st, sd), , rp::tensor_write(t, offset, n == 0 ? 0 : (n - 1) * st + size))
RESIDENCY_GGML_ACCESS(void, ggml_backend_tensor_get_2d,
                      (const struct ggml_tensor* t, void* data, size_t offset, size_t size, size_t n, size_t st, size_t sd),
                      (t, data, offset, size, n, st, sd), )
RESIDENCY_GGML_WRITE(void, ggml_backend_tensor_memset,
                     (struct ggml_tensor * t, uint8_t value, size_t offset, size_t size), (t, value, offset, size), ,
                     rp::tensor_write(t, offset, size))
RESIDENCY_GGML_WRITE(void, ggml_backend_tensor_set_async,
                     (ggml_backend_t b, struct ggml_tensor* t, const void* data, size_t offset, size_t size),
                     (b, t, data, offset, size), , rp::tensor_write(t, offset, size))
RESIDENCY_GGML_ACCESS(void, ggml_backend_tensor_get_async,
                      (ggml_backend_t b, const struct ggml_tensor* t, void* data, size_t offset, size_t size),
                      (b, t, data, offset, size), )
RESIDENCY_GGML_WRITE(void, ggml_backend_tensor_set_2d_async,
                     (ggml_backend_t b, struct ggml_tensor* t, const void* data, size_t offset, size_t size, size_t n,
                      size_t st, size_t sd),
                     (b, t, data, offset, size, n, st, sd), , rp::tensor_write(t, offset, n == 0 ? 0 : (n - 1) * st + size))
RESIDENCY_GGML_ACCESS(void, ggml_backend_tensor_get_2d_async,
                      (ggml_backend_t b, const struct ggml_tensor* t, void* data, size_t offset, size_t size, size_t n,
                       size_t st, size_t sd),
                      (b, t, data, offset, size, n, st, sd), )
RESIDENCY_GGML_WRITE(void, ggml_backend_tensor_copy, (const struct ggml_tensor* src, struct ggml_tensor* dst), (src, dst), ,
                     rp::tensor_write_whole(dst, reinterpret_cast<const void*>(next)))
RESIDENCY_GGML_WRITE(void, ggml_backend_tensor_copy_async,
                     (ggml_backend_t bs, ggml_backend_t bd, const struct ggml_tensor* src, struct ggml_tensor* dst),
                     (bs, bd, src, dst), , rp::tensor_write_whole(dst, reinterpret_cast<const void*>(next)))
RESIDENCY_GGML_WRITE(void, ggml_backend_buffer_clear, (ggml_backend_buffer_t buffer, uint8_t value), (buffer, value), ,
                     rp::buffer_write(buffer, reinterpret_cast<const void*>(next)))
// A graph compute: the engine's call itself where llama_decode went past the preload.
#define RESIDENCY_GGML_COMPUTE(name, params, args)                                       \
  RESIDENCY_PRELOAD_EXPORT enum ggml_status name params {                                \
    using Fn = enum ggml_status(*) params;                                               \
    static std::atomic<Fn> cache{nullptr};                                               \
    static std::atomic<bool> warned{false};                                              \
    const Fn next = rp::resolve_next(cache, warned, #name, __builtin_return_address(0)); \
    if (next == nullptr) return GGML_STATUS_FAILED;                                      \
    return rp::graph_compute([&]() noexcept { return next args; },                        \
                             [&]() noexcept { rp::graph_write(g, reinterpret_cast<const void*>(next)); }); \
  }
RESIDENCY_GGML_COMPUTE(ggml_backend_graph_compute, (ggml_backend_t b, struct ggml_cgraph* g), (b, g))
RESIDENCY_GGML_COMPUTE(ggml_backend_graph_compute_async, (ggml_backend_t b, struct ggml_cgraph* g), (b, g))
RESIDENCY_GGML_COMPUTE(ggml_backend_sched_graph_compute, (ggml_backend_sched_t s, struct ggml_cgraph* g), (s, g))
RESIDENCY_GGML_COMPUTE(ggml_backend_sched_graph_compute_async, (ggml_backend_sched_t s, struct ggml_cgraph* g), (s, g))

// llama.cpp's buffers (ggml_buffers.hpp): made, placed in, marked, freed.
#define RESIDENCY_NEXT(name)                              \
  static std::atomic<decltype(&name)> cache{nullptr};     \
  static std::atomic<bool> warned{false};                 \
  const void* const caller = __builtin_return_address(0); \
  const auto next = rp::resolve_next(cache, warned, #name, caller)

RESIDENCY_PRELOAD_EXPORT ggml_backend_buffer_t ggml_backend_buft_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size) {
  RESIDENCY_NEXT(ggml_backend_buft_alloc_buffer);
  if (next == nullptr) return nullptr;
  ggml_backend_buffer_t b = next(buft, size);
  rp::tell(reinterpret_cast<const void*>(next), [b](rp::EngineSession& s) { s.buffer_created(rp::buffer_id(b), false); });
  return b;
}

RESIDENCY_PRELOAD_EXPORT ggml_backend_buffer_t ggml_backend_cpu_buffer_from_ptr(void* ptr, size_t size) {
  RESIDENCY_NEXT(ggml_backend_cpu_buffer_from_ptr);
  if (next == nullptr) return nullptr;
  ggml_backend_buffer_t b = next(ptr, size);
  rp::tell(reinterpret_cast<const void*>(next), [b](rp::EngineSession& s) { s.buffer_created(rp::buffer_id(b), true); });
  return b;
}

RESIDENCY_PRELOAD_EXPORT ggml_backend_buffer_t ggml_backend_dev_buffer_from_host_ptr(ggml_backend_dev_t device, void* ptr,
                                                                                     size_t size, size_t max_tensor_size) {
  RESIDENCY_NEXT(ggml_backend_dev_buffer_from_host_ptr);
  if (next == nullptr) return nullptr;
  ggml_backend_buffer_t b = next(device, ptr, size, max_tensor_size);
  rp::tell(reinterpret_cast<const void*>(next), [b](rp::EngineSession& s) { s.buffer_created(rp::buffer_id(b), true); });
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
  const rp::GgmlApi* api = rp::ggml_api(reinterpret_cast<const void*>(next));
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
  // Weights in device memory: their writes are tracked from now on (only where every graph's
  // nodes can be read, so that a write by a graph cannot go unseen).
  if (usage != GGML_BACKEND_BUFFER_USAGE_WEIGHTS || buffer == nullptr) return;
  const rp::GgmlApi* api = rp::ggml_api(reinterpret_cast<const void*>(next));
  if (api == nullptr || api->graph_n_nodes == nullptr) return;
  const auto base = reinterpret_cast<std::uintptr_t>(api->get_base(buffer));
  const std::size_t size = api->get_size(buffer);
  rp::tell_started([&](rp::EngineSession& s) { s.device_weights_buffer(base, size); });
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
  llama_model* m = nullptr;
  {
    rp::EngineCallScope engine;
    m = next(path, params);
  }
  if (m != nullptr) rp::tell_started([](rp::EngineSession& s) { s.model_loaded(); });
  return m;
}

RESIDENCY_PRELOAD_EXPORT llama_model* llama_model_load_from_splits(const char** paths, size_t n_paths,
                                                                   llama_model_params params) {
  RESIDENCY_NEXT(llama_model_load_from_splits);
  if (next == nullptr) return nullptr;
  llama_model* m = nullptr;
  {
    rp::EngineCallScope engine;
    m = next(paths, n_paths, params);
  }
  if (m != nullptr) rp::tell_started([](rp::EngineSession& s) { s.model_loaded(); });
  return m;
}

RESIDENCY_PRELOAD_EXPORT llama_context* llama_init_from_model(llama_model* model, llama_context_params params) {
  RESIDENCY_NEXT(llama_init_from_model);
  if (next == nullptr) return nullptr;
  llama_context* c = nullptr;
  {
    rp::EngineCallScope engine;
    c = next(model, params);
  }
  if (c != nullptr) rp::tell_started([](rp::EngineSession& s) { s.context_made(); });
  return c;
}

RESIDENCY_GGML_COMPUTE_ALLOC(bool, ggml_gallocr_reserve_n,
                             (ggml_gallocr_t galloc, struct ggml_cgraph* graph, const int* node_ids, const int* leaf_ids),
                             (galloc, graph, node_ids, leaf_ids), false)
RESIDENCY_GGML_COMPUTE_ALLOC(bool, ggml_gallocr_alloc_graph, (ggml_gallocr_t galloc, struct ggml_cgraph* graph),
                             (galloc, graph), false)

}  // extern "C"
