// SPDX-License-Identifier: MIT
// libresidency_preload.so's exported symbols, the only ones it exports (exports.map): the
// functions it interposes. Each keeps the re-entry, errno and fork guards, calls the real
// function (next_calls.hpp), and tells the process's EngineSession what the engine did
// (process_session.hpp); the session decides everything. llama.cpp's and ggml's functions are
// exported as trampolines that reach the hook only when this preload serves the process's llama.cpp
// (engine_abi.hpp), and the library's own function otherwise.
#include <dlfcn.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include <ggml-alloc.h>
#include <ggml-backend.h>
#include <llama.h>

#include "buffer_plan.hpp"
#include "call_targets.hpp"
#include "engine_abi.hpp"
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

// The program's locks come first: `call()` (which leaves errno as the C library does) is made
// once more when `failed_on_limit(result)` says it failed on RLIMIT_MEMLOCK, which the session's
// locks count against (no CAP_IPC_LOCK), and the session stepped aside for it. The errno a call made
// again sees is the program's, so that it ends as one call would.
template <class Call, class Failed>
auto program_lock_first(Call call, Failed failed_on_limit) noexcept {
  const int saved = errno;
  auto r = call();
  if (!failed_on_limit(r)) return r;
  const int err = errno;
  EngineSession* s = started_session();
  if (s == nullptr || !s->step_aside_for_program_lock()) {
    errno = err;
    return r;
  }
  errno = saved;
  return call();
}

// The memory hooks below (mmap, munmap, madvise, mprotect, mremap, mlock, munlock, mlockall) are
// the calls an allocator makes while it holds its own lock: they never wait for the session's
// lock and never allocate; they tell the session what changed (EngineSession::memory_gone and the
// others queue it) after the real call, and let go of the session's locks before a call that
// would trip on them (docs/design.md, "The preload's memory hooks").
template <class Call>
void* map(std::size_t len, int prot, int flags, int fd, off64_t off, const void* caller, Call call) noexcept {
  if (in_hook() || forked_child()) return call();
  const bool wanted = SessionRules::may_be_model_file(prot, flags, fd, len);
  // EAGAIN of a MAP_LOCKED mapping: over RLIMIT_MEMLOCK.
  void* r = program_lock_first(call,
                               [&](void* m) { return m == MAP_FAILED && (flags & MAP_LOCKED) != 0 && errno == EAGAIN; });
  if (r == MAP_FAILED) return r;
  const auto rb = reinterpret_cast<std::uintptr_t>(r);
  const std::uintptr_t re = page_end(rb, len);
  if (EngineSession* s = started_session()) {
    ErrnoKeeper keep;
    if ((flags & MAP_LOCKED) == 0) s->program_locks_end(rb, re);
    // Whatever the session tracked where the new mapping lies is gone: replaced (MAP_FIXED), or
    // unmapped through calls no hook sees (glibc's own munmap). While a snapshot is taken every
    // new mapping is said, whatever it lands on.
    if (s->snapshotting() || s->tracks(rb, re)) s->memory_gone(rb, re);
    const bool anonymous_private = (flags & MAP_ANONYMOUS) != 0 && (flags & MAP_PRIVATE) != 0;
    if (in_engine_call() && anonymous_private && (flags & MAP_FIXED) == 0) s->engine_mapped(rb, re);
  }
  if (!wanted) return r;
  // A model file's mapping: made by the engine, or by the program's own GGUF reader, never by an
  // allocator; this one may start the session.
  HookScope hook;
  ErrnoKeeper keep;  // what the real mmap left
  if (const std::size_t n = SessionRules::gguf_bytes(fd, off, len))
    if (EngineSession* session = process_session(caller))
      session->file_mapped(r, n, fd, static_cast<std::uint64_t>(off));
  return r;
}

int unmap(void* addr, std::size_t len) noexcept {
  const int r = next_munmap(addr, len);
  if (r != 0 || len == 0 || in_hook()) return r;
  EngineSession* s = started_session();
  const auto b = reinterpret_cast<std::uintptr_t>(addr);
  const std::uintptr_t e = page_end(b, len);
  if (s == nullptr) return r;
  ErrnoKeeper keep;
  s->program_locks_end(b, e);
  if (s->tracks(b, e)) s->memory_gone(b, e);
  return r;
}

// A hooked name no object the caller can reach defines: said once.
void warn_missing(CallSite& site, const char* name) noexcept {
  if (!resolving_now() && !site.warned.exchange(true)) warn_unresolved(name);
}

// The heap the engine grew during its call, from `before` (heap_top() when it began): the engine's.
void report_heap_growth(EngineSession& s, std::uintptr_t before) noexcept {
  const HeapGrowth g = engine_heap_growth(before);
  if (g.end > g.begin) s.engine_mapped(g.begin, g.end);
}

// ---- The program's callbacks, called from inside the engine ----
// Each (function, data) pair the program gives is kept in a box of a fixed table, never freed (the
// engine may call it from another thread at any time); the engine is given a trampoline and the
// box. A full table leaves further callbacks as they are (what they map then counts as the
// engine's, as before).
template <class Fn>
struct CallbackBox {
  std::atomic<int> state{0};  // 0: free, 1: being filled, 2: ready
  std::atomic<Fn> fn{nullptr};
  std::atomic<void*> data{nullptr};
};
template <class Fn>
using CallbackBoxes = std::array<CallbackBox<Fn>, 64>;

template <class Fn>
CallbackBox<Fn>* box_of(CallbackBoxes<Fn>& boxes, Fn fn, void* data) noexcept {
  for (CallbackBox<Fn>& b : boxes)
    if (b.state.load(std::memory_order_acquire) == 2 && b.fn.load(std::memory_order_relaxed) == fn &&
        b.data.load(std::memory_order_relaxed) == data)
      return &b;
  for (CallbackBox<Fn>& b : boxes) {
    int expected = 0;
    if (!b.state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) continue;
    b.fn.store(fn, std::memory_order_relaxed);
    b.data.store(data, std::memory_order_relaxed);
    b.state.store(2, std::memory_order_release);
    return &b;
  }
  return nullptr;
}

template <class Fn>
CallbackBox<Fn>& box_at(void* p) noexcept {
  return *static_cast<CallbackBox<Fn>*>(p);
}

CallbackBoxes<ggml_abort_callback> g_abort_boxes;
CallbackBoxes<ggml_backend_sched_eval_callback> g_eval_boxes;
CallbackBoxes<llama_progress_callback> g_progress_boxes;
CallbackBoxes<ggml_log_callback> g_log_boxes;

bool abort_trampoline(void* box) {
  auto& b = box_at<ggml_abort_callback>(box);
  ProgramCallbackScope program;
  return b.fn.load(std::memory_order_relaxed)(b.data.load(std::memory_order_relaxed));
}
bool eval_trampoline(ggml_tensor* t, bool ask, void* box) {
  auto& b = box_at<ggml_backend_sched_eval_callback>(box);
  ProgramCallbackScope program;
  return b.fn.load(std::memory_order_relaxed)(t, ask, b.data.load(std::memory_order_relaxed));
}
bool progress_trampoline(float progress, void* box) {
  auto& b = box_at<llama_progress_callback>(box);
  ProgramCallbackScope program;
  return b.fn.load(std::memory_order_relaxed)(progress, b.data.load(std::memory_order_relaxed));
}
void log_trampoline(ggml_log_level level, const char* text, void* box) {
  auto& b = box_at<ggml_log_callback>(box);
  ProgramCallbackScope program;
  b.fn.load(std::memory_order_relaxed)(level, text, b.data.load(std::memory_order_relaxed));
}

template <class Fn>
void wrap(CallbackBoxes<Fn>& boxes, Fn trampoline, Fn& fn, void*& data) noexcept {
  if (fn == nullptr || fn == trampoline || in_hook()) return;
  if (CallbackBox<Fn>* b = box_of(boxes, fn, data)) {
    fn = trampoline;
    data = b;
  }
}
void wrap_abort(ggml_abort_callback& fn, void*& data) noexcept { wrap(g_abort_boxes, &abort_trampoline, fn, data); }
void wrap_eval(ggml_backend_sched_eval_callback& fn, void*& data) noexcept {
  wrap(g_eval_boxes, &eval_trampoline, fn, data);
}
void wrap_progress(llama_progress_callback& fn, void*& data) noexcept {
  wrap(g_progress_boxes, &progress_trampoline, fn, data);
}
void wrap_log(ggml_log_callback& fn, void*& data) noexcept { wrap(g_log_boxes, &log_trampoline, fn, data); }
// What the program gave, for a callback ggml hands back (ggml_log_get).
void unwrap_log(ggml_log_callback& fn, void*& data) noexcept {
  if (fn != &log_trampoline || data == nullptr) return;
  auto& b = box_at<ggml_log_callback>(data);
  fn = b.fn.load(std::memory_order_relaxed);
  data = b.data.load(std::memory_order_relaxed);
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
  const std::uintptr_t heap = heap_top();
  {
    EngineCallScope engine;
    ForwardScope forward(reinterpret_cast<const void*>(next));
    r = next(ctx, batch);
  }
  {
    ErrnoKeeper keep;
    HookScope hook;
    report_heap_growth(*s, heap);
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
  static CallSite site;
  static std::atomic<CudaGetDeviceFn> device_cache{nullptr};
  static std::atomic<bool> device_warned{false};
  const CudaMallocFn next = target_of<CudaMallocFn>(site, "cudaMalloc", CallKind::other, caller).fn;
  if (next == nullptr) {  // no CUDA runtime behind the preload
    warn_missing(site, "cudaMalloc");
    return kCudaErrorInitialization;
  }
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
  static CallSite site;
  const CudaFreeFn next = target_of<CudaFreeFn>(site, "cudaFree", CallKind::other, caller).fn;
  if (next == nullptr) {
    warn_missing(site, "cudaFree");
    return kCudaErrorInitialization;
  }
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
  const std::uintptr_t heap = heap_top();
  auto r = [&] {
    EngineCallScope engine;
    return call();
  }();
  {
    ErrnoKeeper keep;
    HookScope hook;
    report_heap_growth(*s, heap);
    s->decode_ended(scope, nullptr);
  }
  return r;
}

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

// The program takes [addr, addr + len) back: what the session locked there is unlocked before the
// call (system calls only), and forgotten after it.
template <class Call>
auto around_take_back(void* addr, std::size_t len, Call call) noexcept {
  EngineSession* s = started_session();
  const auto b = reinterpret_cast<std::uintptr_t>(addr);
  const std::uintptr_t e = page_end(b, len);
  if (s == nullptr || len == 0 || !s->tracks(b, e)) return call();
  {
    ErrnoKeeper keep;
    s->unlock_before_take_back(b, e);
  }
  auto r = call();
  ErrnoKeeper keep;
  s->memory_gone(b, e);
  return r;
}

// madvise's advice that takes memory back: as above, and where a wire of the session locked a page
// again between the unlock and the call (madvise then fails with EINVAL on it), unlocked again
// and the call made again, a few times at most.
int advise_take_back(MadviseFn next, void* addr, std::size_t len, int advice) noexcept {
  return around_take_back(addr, len, [&]() noexcept {
    int r = next(addr, len, advice);
    for (int again = 0; again < 3 && r != 0 && errno == EINVAL; ++again) {
      EngineSession* s = started_session();
      const auto b = reinterpret_cast<std::uintptr_t>(addr);
      if (s == nullptr || !s->tracks(b, page_end(b, len))) break;
      const int err = errno;
      s->unlock_before_take_back(b, page_end(b, len));
      errno = err;
      r = next(addr, len, advice);
    }
    return r;
  });
}

// A lock of the program's that failed on RLIMIT_MEMLOCK (ENOMEM from mlock, EAGAIN from mmap with
// MAP_LOCKED) where the session's locks count against it.
bool failed_on_lock_limit(int err) noexcept { return err == ENOMEM || err == EAGAIN; }

template <class Call>
int program_locks(const void* addr, std::size_t len, const void* caller, Call call) noexcept {
  EngineSession* s = program_call(caller) ? started_session() : nullptr;
  if (s == nullptr || len == 0) return call();
  const auto b = reinterpret_cast<std::uintptr_t>(addr);
  auto lock = [&]() noexcept {
    const int saved = errno;
    int r = -1, err = 0;
    s->program_locks(b, page_end(b, len), [&] {
      errno = saved;
      r = call();
      err = errno;
      // ENOMEM (a hole in the range, or a page that cannot be faulted in: a PROT_NONE one) and
      // EAGAIN may come after the kernel marked the mappings up to that point locked, and those
      // stay locked for the program.
      return r == 0 || err == ENOMEM || err == EAGAIN;
    });
    errno = err;
    return r;
  };
  return program_lock_first(lock, [](int r) { return r != 0 && failed_on_lock_limit(errno); });
}

// Where a hooked llama.cpp or ggml function's trampoline goes (below): the hook, when this preload
// serves the process's llama.cpp (engine_abi.hpp); else, with another llama.cpp or none loaded yet,
// the definition the caller would have reached without the preload, so that the call is made with
// its arguments as the caller laid them out, whatever llama.cpp's structs and parameter lists are.
void* route(CallSite& site, const char* name, CallKind kind, const void* caller, void* hook) noexcept {
  if (engine_abi(false) == EngineAbi::served) return hook;
  void* f = resolve_call(site, name, kind, caller).fn;
  return f != nullptr ? f : hook;  // no library defines it: the hook says so and returns its error
}

}  // namespace
}  // namespace residency::preload

namespace rp = residency::preload;

// Each hooked llama.cpp and ggml function is exported as a trampoline (TRAMPOLINE below): it keeps
// the argument registers, asks residency_route_NAME(its return address) where to go, and jumps
// there with the stack and registers as the caller left them. So a by-value struct of another
// llama.cpp's layout, or a parameter another ggml added, reaches that library's function intact,
// which no C++ forwarding could do; and the hook (residency_hook_NAME, with the signature of the
// headers it was built against) runs only for the llama.cpp whose headers those are. The hook sees
// the caller's return address as its own (__builtin_return_address(0)), as without the trampoline.
#define RESIDENCY_HOOK __attribute__((visibility("hidden")))
#if defined(__x86_64__)
// rdi, rsi, rdx, rcx, r8, r9 (integer arguments), rax (a variadic call's vector count) and
// xmm0-7 (floating-point arguments) are kept; r11 is free at a call. 7 pushes leave the stack
// 16-byte aligned for the call (it was 8 off at entry); the return address is then 184 bytes up.
#define RESIDENCY_TRAMPOLINE(name)                                                           \
  asm(".pushsection .text\n.globl " #name "\n.type " #name ", @function\n.p2align 4\n" #name \
      ":\n.cfi_startproc\nendbr64\n"                                                         \
      "push %rdi\n.cfi_adjust_cfa_offset 8\npush %rsi\n.cfi_adjust_cfa_offset 8\n"           \
      "push %rdx\n.cfi_adjust_cfa_offset 8\npush %rcx\n.cfi_adjust_cfa_offset 8\n"           \
      "push %r8\n.cfi_adjust_cfa_offset 8\npush %r9\n.cfi_adjust_cfa_offset 8\n"             \
      "push %rax\n.cfi_adjust_cfa_offset 8\nsub $128, %rsp\n.cfi_adjust_cfa_offset 128\n"    \
      "movdqu %xmm0, 0(%rsp)\nmovdqu %xmm1, 16(%rsp)\nmovdqu %xmm2, 32(%rsp)\n"              \
      "movdqu %xmm3, 48(%rsp)\nmovdqu %xmm4, 64(%rsp)\nmovdqu %xmm5, 80(%rsp)\n"             \
      "movdqu %xmm6, 96(%rsp)\nmovdqu %xmm7, 112(%rsp)\n"                                    \
      "mov 184(%rsp), %rdi\ncall residency_route_" #name                                     \
      "\nmov %rax, %r11\n"                                                                   \
      "movdqu 0(%rsp), %xmm0\nmovdqu 16(%rsp), %xmm1\nmovdqu 32(%rsp), %xmm2\n"              \
      "movdqu 48(%rsp), %xmm3\nmovdqu 64(%rsp), %xmm4\nmovdqu 80(%rsp), %xmm5\n"             \
      "movdqu 96(%rsp), %xmm6\nmovdqu 112(%rsp), %xmm7\n"                                    \
      "add $128, %rsp\n.cfi_adjust_cfa_offset -128\npop %rax\n.cfi_adjust_cfa_offset -8\n"   \
      "pop %r9\n.cfi_adjust_cfa_offset -8\npop %r8\n.cfi_adjust_cfa_offset -8\n"             \
      "pop %rcx\n.cfi_adjust_cfa_offset -8\npop %rdx\n.cfi_adjust_cfa_offset -8\n"           \
      "pop %rsi\n.cfi_adjust_cfa_offset -8\npop %rdi\n.cfi_adjust_cfa_offset -8\n"           \
      "jmp *%r11\n.cfi_endproc\n.size " #name ", .-" #name "\n.popsection\n");
#elif defined(__aarch64__)
// x0-x7 (integer arguments, and the addresses of by-value structs over 16 bytes), x8 (the
// result's address) and q0-q7 (floating-point arguments) are kept; the return address is x30.
// x16 takes the target: a BTI landing pad ("bti c") accepts a br through x16.
#define RESIDENCY_TRAMPOLINE(name)                                                                      \
  asm(".pushsection .text\n.globl " #name "\n.type " #name ", %function\n.p2align 4\n" #name            \
      ":\n.cfi_startproc\nhint #34\nstp x29, x30, [sp, #-224]!\n.cfi_def_cfa_offset 224\n"              \
      ".cfi_offset 29, -224\n.cfi_offset 30, -216\nmov x29, sp\n"                                       \
      "stp x0, x1, [sp, #16]\nstp x2, x3, [sp, #32]\nstp x4, x5, [sp, #48]\nstp x6, x7, [sp, #64]\n"    \
      "str x8, [sp, #80]\nstp q0, q1, [sp, #96]\nstp q2, q3, [sp, #128]\nstp q4, q5, [sp, #160]\n"      \
      "stp q6, q7, [sp, #192]\nmov x0, x30\nbl residency_route_" #name                                  \
      "\nmov x16, x0\n"                                                                                 \
      "ldp q6, q7, [sp, #192]\nldp q4, q5, [sp, #160]\nldp q2, q3, [sp, #128]\nldp q0, q1, [sp, #96]\n" \
      "ldr x8, [sp, #80]\nldp x6, x7, [sp, #64]\nldp x4, x5, [sp, #48]\nldp x2, x3, [sp, #32]\n"        \
      "ldp x0, x1, [sp, #16]\nldp x29, x30, [sp], #224\n.cfi_restore 29\n.cfi_restore 30\n"             \
      ".cfi_def_cfa_offset 0\nbr x16\n.cfi_endproc\n.size " #name ", .-" #name "\n.popsection\n");
#else
#error "the preload's trampolines are written for x86_64 and aarch64"
#endif
// The exported `name`: a trampoline to residency_hook_name (defined before it) or the library's own.
#define RESIDENCY_ROUTED(name, kind)                                                                            \
  RESIDENCY_HOOK void* residency_route_##name(const void* caller) noexcept {                                    \
    static rp::CallSite site;                                                                                   \
    return rp::route(site, #name, rp::CallKind::kind, caller, reinterpret_cast<void*>(&residency_hook_##name)); \
  }                                                                                                             \
  RESIDENCY_TRAMPOLINE(name)

// A ggml function, forwarded to the definition its caller's scope reaches (call_targets.hpp); when
// that is the engine's, after `before` (a statement) ran. With no definition behind the preload
// there is nothing to forward to, and `fallback` is returned.
#define RESIDENCY_GGML_HOOK(ret, name, params, args, fallback, before)                                   \
  RESIDENCY_HOOK ret residency_hook_##name params {                                                      \
    using Fn = ret(*) params;                                                                            \
    static rp::CallSite site;                                                                            \
    const auto target = rp::target_of<Fn>(site, #name, rp::CallKind::ggml, __builtin_return_address(0)); \
    const Fn next = target.fn;                                                                           \
    if (next == nullptr) {                                                                               \
      rp::warn_missing(site, #name);                                                                     \
      return fallback;                                                                                   \
    }                                                                                                    \
    if (target.engine) {                                                                                 \
      before;                                                                                            \
    }                                                                                                    \
    rp::ForwardScope forward(reinterpret_cast<const void*>(next));                                       \
    return next args;                                                                                    \
  }                                                                                                      \
  RESIDENCY_ROUTED(name, ggml)
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
  return rp::map(len, prot, flags, fd, off, __builtin_return_address(0),
                 [&]() noexcept { return rp::next_mmap(addr, len, prot, flags, fd, off); });
}

#if defined(__GLIBC__)
RESIDENCY_PRELOAD_EXPORT void* mmap64(void* addr, std::size_t len, int prot, int flags, int fd, off64_t off) noexcept {
  return rp::map(len, prot, flags, fd, off, __builtin_return_address(0),
                 [&]() noexcept { return rp::next_mmap64(addr, len, prot, flags, fd, off); });
}
#endif

RESIDENCY_PRELOAD_EXPORT int munmap(void* addr, std::size_t len) noexcept { return rp::unmap(addr, len); }

RESIDENCY_PRELOAD_EXPORT int madvise(void* addr, std::size_t len, int advice) noexcept {
  const rp::MadviseFn next = rp::next_madvise();
  if (next == nullptr) return static_cast<int>(::syscall(SYS_madvise, addr, len, advice));
  if (!rp::takes_back(advice) || !rp::program_call(__builtin_return_address(0))) return next(addr, len, advice);
  return rp::advise_take_back(next, addr, len, advice);
}

RESIDENCY_PRELOAD_EXPORT int mprotect(void* addr, std::size_t len, int prot) noexcept {
  const rp::MprotectFn next = rp::next_mprotect();
  if (next == nullptr) return static_cast<int>(::syscall(SYS_mprotect, addr, len, prot));
  // PROT_NONE: a runtime decommits its heap (V8, Go, the JVM); locked pages would stay in memory.
  if (prot != PROT_NONE || !rp::program_call(__builtin_return_address(0))) return next(addr, len, prot);
  return rp::around_take_back(addr, len, [&]() noexcept { return next(addr, len, prot); });
}

#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4  // Linux 5.7; older C library headers lack it
#endif

RESIDENCY_PRELOAD_EXPORT void* mremap(void* old_addr, std::size_t old_size, std::size_t new_size, int flags, ...) noexcept {
  // new_address is read when the flags take one (FIXED, DONTUNMAP), as glibc 2.36 and the kernel
  // read it, and always forwarded: given four arguments, glibc read a leftover register for
  // DONTUNMAP and the kernel failed with EINVAL. Where the flags take none, the C library reads
  // none either, and NULL is what it gives the kernel itself.
  void* new_addr = nullptr;
  if ((flags & (MREMAP_FIXED | MREMAP_DONTUNMAP)) != 0) {
    va_list ap;
    va_start(ap, flags);
    new_addr = va_arg(ap, void*);
    va_end(ap);
  }
  const rp::MremapFn next = rp::next_mremap();
  auto call = [&]() noexcept {
    if (next == nullptr)
      return reinterpret_cast<void*>(::syscall(SYS_mremap, old_addr, old_size, new_size, flags, new_addr));
    return next(old_addr, old_size, new_size, flags, new_addr);
  };
  // A locked mapping moved or grown stays locked, and the kernel populates all of it: what the
  // session held of it is let go of first. MREMAP_FIXED also replaces what was at new_address.
  if (!rp::program_call(__builtin_return_address(0))) return call();
  // EAGAIN: a locked mapping could not grow within RLIMIT_MEMLOCK.
  void* r = rp::program_lock_first([&]() noexcept { return rp::around_take_back(old_addr, old_size, call); },
                                   [](void* m) { return m == MAP_FAILED && errno == EAGAIN; });
  if (r != MAP_FAILED && (flags & MREMAP_FIXED) != 0)
    if (rp::EngineSession* s = rp::started_session()) {
      const auto b = reinterpret_cast<std::uintptr_t>(r);
      const std::uintptr_t e = rp::page_end(b, new_size);
      rp::ErrnoKeeper keep;
      if (s->tracks(b, e)) s->memory_gone(b, e);
    }
  return r;
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
  auto call = [&]() noexcept {
    return next != nullptr ? next(addr, len) : static_cast<int>(::syscall(SYS_munlock, addr, len));
  };
  rp::EngineSession* s = rp::program_call(__builtin_return_address(0)) ? rp::started_session() : nullptr;
  if (s == nullptr) return call();
  const int saved = errno;
  int r = -1, err = 0;
  const auto b = reinterpret_cast<std::uintptr_t>(addr);
  s->program_unlocks(b, rp::page_end(b, len), [&] {
    errno = saved;
    r = call();
    err = errno;
    return r == 0;
  });
  errno = err;
  return r;
}

RESIDENCY_PRELOAD_EXPORT int mlockall(int flags) noexcept {
  const rp::MlockallFn next = rp::next_mlockall();
  const int r = next != nullptr ? next(flags) : static_cast<int>(::syscall(SYS_mlockall, flags));
  if (r != 0 || !rp::program_call(__builtin_return_address(0))) return r;
  if (rp::EngineSession* s = rp::started_session()) {
    rp::ErrnoKeeper keep;
    s->program_locked_all(flags);
  }
  return r;
}

RESIDENCY_HOOK std::int32_t residency_hook_llama_decode(llama_context* ctx, llama_batch batch) {
  static rp::CallSite site;
  const auto t = rp::target_of<rp::DecodeFn>(site, "llama_decode", rp::CallKind::llama, __builtin_return_address(0));
  if (t.fn == nullptr) rp::warn_missing(site, "llama_decode");
  return rp::decode(t.fn, ctx, batch);
}
RESIDENCY_ROUTED(llama_decode, llama)

RESIDENCY_HOOK std::int32_t residency_hook_llama_encode(llama_context* ctx, llama_batch batch) {
  static rp::CallSite site;
  const auto t = rp::target_of<rp::DecodeFn>(site, "llama_encode", rp::CallKind::llama, __builtin_return_address(0));
  if (t.fn == nullptr) rp::warn_missing(site, "llama_encode");
  return rp::decode(t.fn, ctx, batch);
}
RESIDENCY_ROUTED(llama_encode, llama)

// CUDA runtime (libcudart): device memory of 2 MiB or more goes through the cuda backend.
RESIDENCY_PRELOAD_EXPORT int cudaMalloc(void** ptr, std::size_t size) {
  return rp::device_malloc(ptr, size, __builtin_return_address(0));
}

RESIDENCY_PRELOAD_EXPORT int cudaFree(void* ptr) { return rp::device_free(ptr, __builtin_return_address(0)); }

RESIDENCY_GGML_WRITE(void, ggml_backend_tensor_set, (struct ggml_tensor * t, const void* data, size_t offset, size_t size),
                     (t, data, offset, size), , rp::tensor_fill(t, data, offset, size))
RESIDENCY_GGML_ACCESS(void, ggml_backend_tensor_get,
                      (const struct ggml_tensor* t, void* data, size_t offset, size_t size), (t, data, offset, size), )
RESIDENCY_GGML_WRITE(void, ggml_backend_tensor_set_2d,
                     (struct ggml_tensor * t, const void* data, size_t offset, size_t size, size_t n, size_t st, size_t sd),
                     (t, data, offset, size, n, st, sd), , rp::tensor_write(t, offset, n == 0 ? 0 : (n - 1) * st + size))
RESIDENCY_GGML_ACCESS(void, ggml_backend_tensor_get_2d,
                      (const struct ggml_tensor* t, void* data, size_t offset, size_t size, size_t n, size_t st, size_t sd),
                      (t, data, offset, size, n, st, sd), )
RESIDENCY_GGML_WRITE(void, ggml_backend_tensor_memset, (struct ggml_tensor * t, uint8_t value, size_t offset, size_t size),
                     (t, value, offset, size), , rp::tensor_write(t, offset, size))
RESIDENCY_GGML_WRITE(void, ggml_backend_tensor_set_async,
                     (ggml_backend_t b, struct ggml_tensor* t, const void* data, size_t offset, size_t size),
                     (b, t, data, offset, size), , rp::tensor_write(t, offset, size))
RESIDENCY_GGML_ACCESS(void, ggml_backend_tensor_get_async,
                      (ggml_backend_t b, const struct ggml_tensor* t, void* data, size_t offset, size_t size),
                      (b, t, data, offset, size), )
RESIDENCY_GGML_WRITE(void, ggml_backend_tensor_set_2d_async,
                     (ggml_backend_t b, struct ggml_tensor* t, const void* data, size_t offset, size_t size, size_t n,
                      size_t st, size_t sd),
                     (b, t, data, offset, size, n, st, sd), ,
                     rp::tensor_write(t, offset, n == 0 ? 0 : (n - 1) * st + size))
RESIDENCY_GGML_ACCESS(void, ggml_backend_tensor_get_2d_async,
                      (ggml_backend_t b, const struct ggml_tensor* t, void* data, size_t offset, size_t size, size_t n,
                       size_t st, size_t sd),
                      (b, t, data, offset, size, n, st, sd), )
RESIDENCY_GGML_WRITE(void, ggml_backend_tensor_copy, (const struct ggml_tensor* src, struct ggml_tensor* dst),
                     (src, dst), , rp::tensor_write_whole(dst, reinterpret_cast<const void*>(next)))
RESIDENCY_GGML_WRITE(void, ggml_backend_tensor_copy_async,
                     (ggml_backend_t bs, ggml_backend_t bd, const struct ggml_tensor* src, struct ggml_tensor* dst),
                     (bs, bd, src, dst), , rp::tensor_write_whole(dst, reinterpret_cast<const void*>(next)))
RESIDENCY_GGML_WRITE(void, ggml_backend_buffer_clear, (ggml_backend_buffer_t buffer, uint8_t value), (buffer, value), ,
                     rp::buffer_write(buffer, reinterpret_cast<const void*>(next)))
// A graph compute: the engine's call itself where llama_decode went past the preload.
#define RESIDENCY_GGML_COMPUTE(name, params, args)                                                         \
  RESIDENCY_HOOK enum ggml_status residency_hook_##name params {                                           \
    using Fn = enum ggml_status(*) params;                                                                 \
    static rp::CallSite site;                                                                              \
    const auto target = rp::target_of<Fn>(site, #name, rp::CallKind::ggml, __builtin_return_address(0));   \
    const Fn next = target.fn;                                                                             \
    if (next == nullptr) {                                                                                 \
      rp::warn_missing(site, #name);                                                                       \
      return GGML_STATUS_FAILED;                                                                           \
    }                                                                                                      \
    rp::ForwardScope forward(reinterpret_cast<const void*>(next));                                         \
    if (!target.engine) return next args;                                                                  \
    return rp::graph_compute([&]() noexcept { return next args; },                                         \
                             [&]() noexcept { rp::graph_write(g, reinterpret_cast<const void*>(next)); }); \
  }                                                                                                        \
  RESIDENCY_ROUTED(name, ggml)
RESIDENCY_GGML_COMPUTE(ggml_backend_graph_compute, (ggml_backend_t b, struct ggml_cgraph* g), (b, g))
RESIDENCY_GGML_COMPUTE(ggml_backend_graph_compute_async, (ggml_backend_t b, struct ggml_cgraph* g), (b, g))
RESIDENCY_GGML_COMPUTE(ggml_backend_sched_graph_compute, (ggml_backend_sched_t s, struct ggml_cgraph* g), (s, g))
RESIDENCY_GGML_COMPUTE(ggml_backend_sched_graph_compute_async, (ggml_backend_sched_t s, struct ggml_cgraph* g), (s, g))

// llama.cpp's buffers (ggml_buffers.hpp): made, placed in, marked, freed. `next`: the definition
// the caller's scope reaches, of the hook's own type (not every llama.cpp's headers declare every
// hooked name); `engine`: it is the engine's (else the call passes through untouched).
#define RESIDENCY_NEXT(name, kind)                                                                              \
  static rp::CallSite site;                                                                                     \
  const void* const caller = __builtin_return_address(0);                                                       \
  const auto target = rp::target_of<decltype(&residency_hook_##name)>(site, #name, rp::CallKind::kind, caller); \
  const auto next = target.fn;                                                                                  \
  [[maybe_unused]] const bool engine = target.engine;                                                           \
  if (next == nullptr) rp::warn_missing(site, #name);                                                           \
  rp::ForwardScope forward_scope(reinterpret_cast<const void*>(next))

RESIDENCY_HOOK ggml_backend_buffer_t residency_hook_ggml_backend_buft_alloc_buffer(ggml_backend_buffer_type_t buft,
                                                                                   size_t size) {
  RESIDENCY_NEXT(ggml_backend_buft_alloc_buffer, ggml);
  if (next == nullptr) return nullptr;
  ggml_backend_buffer_t b = next(buft, size);
  if (engine)
    rp::tell(reinterpret_cast<const void*>(next),
             [b](rp::EngineSession& s) { s.buffer_created(rp::buffer_id(b), false); });
  return b;
}
RESIDENCY_ROUTED(ggml_backend_buft_alloc_buffer, ggml)

RESIDENCY_HOOK ggml_backend_buffer_t residency_hook_ggml_backend_cpu_buffer_from_ptr(void* ptr, size_t size) {
  RESIDENCY_NEXT(ggml_backend_cpu_buffer_from_ptr, ggml);
  if (next == nullptr) return nullptr;
  ggml_backend_buffer_t b = next(ptr, size);
  if (engine)
    rp::tell(reinterpret_cast<const void*>(next), [b](rp::EngineSession& s) { s.buffer_created(rp::buffer_id(b), true); });
  return b;
}
RESIDENCY_ROUTED(ggml_backend_cpu_buffer_from_ptr, ggml)

RESIDENCY_HOOK ggml_backend_buffer_t residency_hook_ggml_backend_dev_buffer_from_host_ptr(ggml_backend_dev_t device,
                                                                                          void* ptr, size_t size,
                                                                                          size_t max_tensor_size) {
  RESIDENCY_NEXT(ggml_backend_dev_buffer_from_host_ptr, ggml);
  if (next == nullptr) return nullptr;
  ggml_backend_buffer_t b = next(device, ptr, size, max_tensor_size);
  if (engine)
    rp::tell(reinterpret_cast<const void*>(next), [b](rp::EngineSession& s) { s.buffer_created(rp::buffer_id(b), true); });
  return b;
}
RESIDENCY_ROUTED(ggml_backend_dev_buffer_from_host_ptr, ggml)

RESIDENCY_HOOK enum ggml_status residency_hook_ggml_backend_tensor_alloc(ggml_backend_buffer_t buffer,
                                                                         struct ggml_tensor* tensor, void* addr) {
  RESIDENCY_NEXT(ggml_backend_tensor_alloc, ggml);
  if (next == nullptr) return GGML_STATUS_FAILED;
  const enum ggml_status st = next(buffer, tensor, addr);
  // Lock-free for every buffer but those over memory that is not ggml's (a model file's).
  if (!engine || st != GGML_STATUS_SUCCESS || tensor == nullptr || addr == nullptr || rp::in_hook()) return st;
  rp::EngineSession* s = rp::started_session();
  if (s == nullptr || !s->wants_tensor_placements(rp::buffer_id(buffer))) return st;
  const rp::GgmlApi* api = rp::ggml_api(reinterpret_cast<const void*>(next));
  if (api == nullptr) return st;
  const auto begin = reinterpret_cast<std::uintptr_t>(addr);
  const std::uintptr_t end = begin + api->nbytes(tensor);
  rp::tell_started([&](rp::EngineSession& session) { session.tensor_placed(rp::buffer_id(buffer), begin, end); });
  return st;
}
RESIDENCY_ROUTED(ggml_backend_tensor_alloc, ggml)

RESIDENCY_HOOK void residency_hook_ggml_backend_buffer_set_usage(ggml_backend_buffer_t buffer,
                                                                 enum ggml_backend_buffer_usage usage) {
  RESIDENCY_NEXT(ggml_backend_buffer_set_usage, ggml);
  if (next == nullptr) return;
  next(buffer, usage);
  if (!engine) return;
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
RESIDENCY_ROUTED(ggml_backend_buffer_set_usage, ggml)

RESIDENCY_HOOK void residency_hook_ggml_backend_buffer_free(ggml_backend_buffer_t buffer) {
  RESIDENCY_NEXT(ggml_backend_buffer_free, ggml);
  if (next == nullptr) return;
  if (engine && buffer != nullptr)
    rp::tell_started([&](rp::EngineSession& s) { s.buffer_freed(rp::buffer_id(buffer)); });
  next(buffer);
}
RESIDENCY_ROUTED(ggml_backend_buffer_free, ggml)

// The program's callbacks that run inside the engine's calls (a load's progress, a compute's abort
// and eval callbacks, the log) are called through trampolines, so that what they map or grow of the
// heap is the program's (rp::ProgramCallbackScope), not the engine's.
RESIDENCY_HOOK llama_model* residency_hook_llama_model_load_from_file(const char* path, llama_model_params params) {
  RESIDENCY_NEXT(llama_model_load_from_file, llama);
  if (next == nullptr) return nullptr;
  rp::wrap_progress(params.progress_callback, params.progress_callback_user_data);
  const std::uintptr_t heap = rp::heap_top();
  llama_model* m = nullptr;
  {
    rp::EngineCallScope engine_call;
    m = next(path, params);
  }
  rp::tell_started([&](rp::EngineSession& s) {
    rp::report_heap_growth(s, heap);
    if (m != nullptr) s.model_loaded();
  });
  return m;
}
RESIDENCY_ROUTED(llama_model_load_from_file, llama)

RESIDENCY_HOOK llama_model* residency_hook_llama_model_load_from_splits(const char** paths, size_t n_paths,
                                                                        llama_model_params params) {
  RESIDENCY_NEXT(llama_model_load_from_splits, llama);
  if (next == nullptr) return nullptr;
  rp::wrap_progress(params.progress_callback, params.progress_callback_user_data);
  const std::uintptr_t heap = rp::heap_top();
  llama_model* m = nullptr;
  {
    rp::EngineCallScope engine_call;
    m = next(paths, n_paths, params);
  }
  rp::tell_started([&](rp::EngineSession& s) {
    rp::report_heap_growth(s, heap);
    if (m != nullptr) s.model_loaded();
  });
  return m;
}
RESIDENCY_ROUTED(llama_model_load_from_splits, llama)

RESIDENCY_HOOK llama_context* residency_hook_llama_init_from_model(llama_model* model, llama_context_params params) {
  RESIDENCY_NEXT(llama_init_from_model, llama);
  if (next == nullptr) return nullptr;
  rp::wrap_abort(params.abort_callback, params.abort_callback_data);
  rp::wrap_eval(params.cb_eval, params.cb_eval_user_data);
  const std::uintptr_t heap = rp::heap_top();
  llama_context* c = nullptr;
  {
    rp::EngineCallScope engine_call;
    c = next(model, params);
  }
  rp::tell_started([&](rp::EngineSession& s) {
    rp::report_heap_growth(s, heap);
    if (c != nullptr) s.context_made();
  });
  return c;
}
RESIDENCY_ROUTED(llama_init_from_model, llama)

RESIDENCY_HOOK void residency_hook_llama_set_abort_callback(llama_context* ctx, ggml_abort_callback callback, void* data) {
  RESIDENCY_NEXT(llama_set_abort_callback, llama);
  if (next == nullptr) return;
  rp::wrap_abort(callback, data);
  next(ctx, callback, data);
}
RESIDENCY_ROUTED(llama_set_abort_callback, llama)

RESIDENCY_HOOK void residency_hook_llama_log_set(ggml_log_callback callback, void* data) {
  RESIDENCY_NEXT(llama_log_set, llama);
  if (next == nullptr) return;
  rp::wrap_log(callback, data);
  next(callback, data);
}
RESIDENCY_ROUTED(llama_log_set, llama)

RESIDENCY_HOOK void residency_hook_ggml_log_get(ggml_log_callback* callback, void** data) {
  RESIDENCY_NEXT(ggml_log_get, ggml);
  if (next == nullptr) return;
  next(callback, data);
  if (callback != nullptr && data != nullptr) rp::unwrap_log(*callback, *data);
}
RESIDENCY_ROUTED(ggml_log_get, ggml)

RESIDENCY_HOOK void residency_hook_llama_log_get(ggml_log_callback* callback, void** data) {
  RESIDENCY_NEXT(llama_log_get, llama);
  if (next == nullptr) return;
  next(callback, data);
  if (callback != nullptr && data != nullptr) rp::unwrap_log(*callback, *data);
}
RESIDENCY_ROUTED(llama_log_get, llama)

RESIDENCY_HOOK void residency_hook_ggml_log_set(ggml_log_callback callback, void* data) {
  RESIDENCY_NEXT(ggml_log_set, ggml);
  if (next == nullptr) return;
  if (engine) rp::wrap_log(callback, data);
  next(callback, data);
}
RESIDENCY_ROUTED(ggml_log_set, ggml)

RESIDENCY_GGML_COMPUTE_ALLOC(bool, ggml_gallocr_reserve_n,
                             (ggml_gallocr_t galloc, struct ggml_cgraph* graph, const int* node_ids, const int* leaf_ids),
                             (galloc, graph, node_ids, leaf_ids), false)
RESIDENCY_GGML_COMPUTE_ALLOC(bool, ggml_gallocr_alloc_graph, (ggml_gallocr_t galloc, struct ggml_cgraph* graph),
                             (galloc, graph), false)

// ---- dlopen and dlclose: the libraries change ----
// Cached call targets are resolved again (call_targets.hpp), and a failed start of the session is
// tried again (a libllama loaded after a GGUF reader or another ggml library ran first).
//
// glibc searches a bare name in the RPATH/RUNPATH of the object dlopen returns to, so the hook must
// not become the caller: dlopen itself is a few instructions (below) that call
// residency_dlopen_route and jump to what it returns, with the caller's arguments and return
// address as they were. For a name with a '/' (no search) the route is the hook's own function,
// which also looks at what was loaded: a libllama loaded with RTLD_DEEPBIND binds its calls inside
// its own scope, past the preload, and that is said.
using DlopenFn = void* (*)(const char*, int);

namespace residency::preload {
namespace {

DlopenFn real_dlopen() noexcept {
  static std::atomic<DlopenFn> cache{nullptr};
  static std::atomic<bool> warned{true};  // libc's own: never missing, never said
  return resolve_next(cache, warned, "dlopen", nullptr);
}

void* no_dlopen(const char*, int) { return nullptr; }

void* dlopen_with_path(const char* file, int mode) {
  const DlopenFn next = real_dlopen();
  if (next == nullptr) return nullptr;
  void* h = next(file, mode);
  if (h == nullptr || in_hook()) return h;
  libraries_changed();
  if ((mode & RTLD_DEEPBIND) != 0) {
    static std::atomic<bool> said{false};
    HookScope hook;
    ErrnoKeeper keep;
    if (brings_in_libllama(h) && !said.exchange(true))
      warn(std::string("libllama was loaded with dlopen(RTLD_DEEPBIND) (") + file +
           "): its calls into ggml and the C library bind inside its own scope, past the preload, so residency "
           "cannot see its memory and the program runs without residency; load it without RTLD_DEEPBIND");
    (void)::dlerror();  // a failed lookup above is not the program's error
  }
  return h;
}

}  // namespace
}  // namespace residency::preload

extern "C" __attribute__((visibility("hidden"))) DlopenFn residency_dlopen_route(const char* file, int mode) {
  if (rp::in_hook() || rp::resolving_now() || (mode & RTLD_NOLOAD) != 0) {
    const DlopenFn next = rp::real_dlopen();
    return next != nullptr ? next : &rp::no_dlopen;
  }
  rp::libraries_changed();
  if (file != nullptr && std::strchr(file, '/') != nullptr) return &rp::dlopen_with_path;
  const DlopenFn next = rp::real_dlopen();
  return next != nullptr ? next : &rp::no_dlopen;
}

#if defined(__x86_64__)
asm(R"(
  .text
  .globl dlopen
  .type dlopen, @function
  .p2align 4
dlopen:
  .cfi_startproc
  endbr64
  push %rdi
  .cfi_adjust_cfa_offset 8
  push %rsi
  .cfi_adjust_cfa_offset 8
  sub $8, %rsp
  .cfi_adjust_cfa_offset 8
  call residency_dlopen_route
  add $8, %rsp
  .cfi_adjust_cfa_offset -8
  pop %rsi
  .cfi_adjust_cfa_offset -8
  pop %rdi
  .cfi_adjust_cfa_offset -8
  jmp *%rax
  .cfi_endproc
  .size dlopen, .-dlopen
)");
#elif defined(__aarch64__)
asm(R"(
  .text
  .globl dlopen
  .type dlopen, %function
  .p2align 4
dlopen:
  .cfi_startproc
  hint #34
  stp x29, x30, [sp, #-32]!
  .cfi_def_cfa_offset 32
  .cfi_offset 29, -32
  .cfi_offset 30, -24
  mov x29, sp
  stp x0, x1, [sp, #16]
  bl residency_dlopen_route
  mov x16, x0
  ldp x0, x1, [sp, #16]
  ldp x29, x30, [sp], #32
  .cfi_restore 29
  .cfi_restore 30
  .cfi_def_cfa_offset 0
  br x16
  .cfi_endproc
  .size dlopen, .-dlopen
)");
#else
#error "the preload's dlopen is written for x86_64 and aarch64"
#endif

RESIDENCY_PRELOAD_EXPORT int dlclose(void* handle) {
  using DlcloseFn = int (*)(void*);
  static std::atomic<DlcloseFn> cache{nullptr};
  static std::atomic<bool> warned{true};
  const DlcloseFn next = rp::resolve_next(cache, warned, "dlclose", nullptr);
  if (next == nullptr) return -1;
  const bool ours = rp::in_hook() || rp::resolving_now();
  if (!ours) rp::libraries_changed();
  const int r = next(handle);
  if (!ours) rp::libraries_changed();
  return r;
}

}  // extern "C"
