// SPDX-License-Identifier: MIT
// The functions the preload interposes, as the libraries behind it define them, and the guards
// every hook runs under.
//
// Hosts load llama.cpp in two ways: linked (the global scope, where dlsym(RTLD_NEXT) finds the
// real function) or dlopen'ed without RTLD_GLOBAL (Node addons such as node-llama-cpp, Python's
// ctypes): there libllama's calls into ggml still bind to the preload, which is global, while the
// real function sits in a local scope RTLD_NEXT never searches. So a hook also looks where its
// caller's library is, and a lookup that fails is never cached
// (docs/design.md, "The engine session").
//
// Re-entry: while a thread is inside a hook, what the hook itself causes (dlsym, malloc, the
// manager's mlock and logging) may call mmap or munmap again; those go straight to the real
// functions. A thread_local flag says so (initial-exec TLS: reading it never allocates, so it is
// safe from inside malloc). While mmap or munmap is being resolved, the system call stands in.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>

#include <llama.h>

namespace residency::preload {

using DecodeFn = std::int32_t (*)(llama_context*, llama_batch);
using SynchronizeFn = void (*)(llama_context*);

void* next_mmap(void* addr, std::size_t len, int prot, int flags, int fd, off_t off) noexcept;
#if defined(__GLIBC__)
void* next_mmap64(void* addr, std::size_t len, int prot, int flags, int fd, off64_t off) noexcept;
#endif
int next_munmap(void* addr, std::size_t len) noexcept;

// libllama's definitions (`near`: the caller's address, where a local scope may hold them), or
// null when no loaded library defines them.
DecodeFn next_llama_decode(const void* near) noexcept;
DecodeFn next_llama_encode(const void* near) noexcept;
SynchronizeFn next_llama_synchronize(const void* near) noexcept;

// True while this thread is inside dlsym for resolve_symbol().
bool resolving_now() noexcept;

// Where the real `name` is: dlsym(RTLD_NEXT); else in the scope of the object that holds address
// `near` (the caller's library, or a real function found already), which then stays loaded for
// good (a cached pointer must never dangle); else in any loaded object but the preload. Null when
// no object defines it, or while this thread is resolving a symbol already.
void* resolve_symbol(const char* name, const void* near) noexcept;
// The same for a caller in the loaded object at `caller_path` (empty or null: the main program,
// whose scope is the global one): dlsym(RTLD_NEXT), else in that object's own scope (it and its
// dependencies); null when neither defines it.
void* resolve_for_object(const char* name, const char* caller_path) noexcept;
// Any loaded object's definition but the preload's, in load order.
void* resolve_anywhere(const char* name) noexcept;

// While one is open on this thread, a hook is forwarding its call to `target`. A hooked call made
// from there by a tail call (ggml-cpu's buffer_from_host_ptr jumps to ggml_backend_cpu_buffer_from_ptr)
// returns into the preload, which then is not its caller: the target's object is.
class ForwardScope {
 public:
  explicit ForwardScope(const void* target) noexcept;
  ~ForwardScope();
  ForwardScope(const ForwardScope&) = delete;
  ForwardScope& operator=(const ForwardScope&) = delete;

 private:
  const void* was_;
};
// The target the innermost hook of this thread forwards to (null: none).
const void* forwarded_to() noexcept;
// Whether `p` lies in the preload itself.
bool in_preload(const void* p) noexcept;
// One warning per name: a hook was called whose real function no loaded library defines.
void warn_unresolved(const char* name) noexcept;

// `name`'s real function, cached once found. A failure is not cached (the library may be loaded
// later); it is said once (`warned`).
template <class Fn>
Fn resolve_next(std::atomic<Fn>& cache, std::atomic<bool>& warned, const char* name, const void* near) noexcept {
  if (Fn f = cache.load(std::memory_order_acquire)) return f;
  Fn f = reinterpret_cast<Fn>(resolve_symbol(name, near));
  if (f != nullptr) cache.store(f, std::memory_order_release);
  else if (!resolving_now() && !warned.exchange(true)) warn_unresolved(name);
  return f;
}

// The per-thread guards below are the hooks' only state besides the resolved functions, the fork
// guard and the session pointer (process_session.hpp).
// True while this thread runs inside one of the preload's hooks.
bool in_hook() noexcept;

// Marks this thread as inside a hook for the rest of its life (the session's worker thread).
void mark_thread_inside_hook() noexcept;

// Marks this thread as inside a hook for the scope's life.
class HookScope {
 public:
  HookScope() noexcept;
  ~HookScope();
  HookScope(const HookScope&) = delete;
  HookScope& operator=(const HookScope&) = delete;

 private:
  bool was_;
};

// While one is open on this thread, the thread is inside ggml's graph allocator
// (ggml_gallocr_reserve_n / _alloc_graph): device memory it allocates holds compute buffers.
class ComputeAllocationScope {
 public:
  ComputeAllocationScope() noexcept;
  ~ComputeAllocationScope();
  ComputeAllocationScope(const ComputeAllocationScope&) = delete;
  ComputeAllocationScope& operator=(const ComputeAllocationScope&) = delete;
};
bool in_compute_allocation() noexcept;

// While one is open on this thread, the thread is inside the engine: a model's load, a context's
// creation, a decode (or a graph compute standing in for one). Anonymous memory it maps then is
// the engine's.
class EngineCallScope {
 public:
  EngineCallScope() noexcept;
  ~EngineCallScope();
  EngineCallScope(const EngineCallScope&) = delete;
  EngineCallScope& operator=(const EngineCallScope&) = delete;
};
bool in_engine_call() noexcept;

// While one is open on this thread, the thread runs the program's own code called back from inside
// the engine (an abort or eval callback, a load's progress callback, a log callback): memory it
// maps or heap it grows is the program's, not the engine's.
class ProgramCallbackScope {
 public:
  ProgramCallbackScope() noexcept;
  ~ProgramCallbackScope();
  ProgramCallbackScope(const ProgramCallbackScope&) = delete;
  ProgramCallbackScope& operator=(const ProgramCallbackScope&) = delete;

 private:
  int depth_;
  std::uintptr_t heap_top_;
};

// The heap the engine grew during one of its calls on this thread: [begin, end) of the program
// break's growth from `before` (heap_top() when the call began) to now, less what program callbacks
// inside the call grew (from the first such growth on); empty when it did not grow.
std::uintptr_t heap_top() noexcept;
struct HeapGrowth {
  std::uintptr_t begin = 0, end = 0;
};
HeapGrowth engine_heap_growth(std::uintptr_t before) noexcept;

// Whether `caller` is the preload's own code (the residency library linked into it calls mlock,
// munlock and madvise through the same symbols the program does).
bool called_from_preload(const void* caller) noexcept;

// The C library's memory calls, as the program would have called them.
using MadviseFn = int (*)(void*, std::size_t, int);
using MprotectFn = int (*)(void*, std::size_t, int);
using MlockFn = int (*)(const void*, std::size_t);
using Mlock2Fn = int (*)(const void*, std::size_t, unsigned int);
using MlockallFn = int (*)(int);
using MunlockallFn = int (*)();
using MremapFn = void* (*)(void*, std::size_t, std::size_t, int, ...);
MadviseFn next_madvise() noexcept;
MprotectFn next_mprotect() noexcept;
MlockFn next_mlock() noexcept;
Mlock2Fn next_mlock2() noexcept;
MlockFn next_munlock() noexcept;
MlockallFn next_mlockall() noexcept;
MunlockallFn next_munlockall() noexcept;
MremapFn next_mremap() noexcept;

// Restores errno at the end of the scope to what it was at its start: what the preload does
// between the caller and the real function never shows in errno.
class ErrnoKeeper {
 public:
  ErrnoKeeper() noexcept : saved_(errno) {}
  ~ErrnoKeeper() { errno = saved_; }
  ErrnoKeeper(const ErrnoKeeper&) = delete;
  ErrnoKeeper& operator=(const ErrnoKeeper&) = delete;

 private:
  int saved_;
};

}  // namespace residency::preload
