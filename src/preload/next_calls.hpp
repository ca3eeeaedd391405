// SPDX-License-Identifier: MIT
// The functions the preload interposes, as the next library in the lookup order defines them
// (dlsym(RTLD_NEXT, ...)), and the two guards every hook runs under.
//
// Re-entry: while a thread is inside a hook, what the hook itself causes (dlsym, malloc, the
// manager's mlock and logging) may call mmap or munmap again; those calls must go straight to
// the real functions. A thread_local flag says so (initial-exec TLS: reading it never allocates,
// so it is safe from inside malloc). While mmap or munmap is being resolved, the system call
// stands in for it.
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

// libllama's definitions, or null when no library after the preload defines them (libllama
// linked statically into the program, or not loaded at all). Resolved once, then cached.
DecodeFn next_llama_decode() noexcept;
DecodeFn next_llama_encode() noexcept;
SynchronizeFn next_llama_synchronize() noexcept;

// The per-thread guards below are the hooks' only state besides the resolved functions, the fork
// guard and the session pointer (process_session.hpp).
// True while this thread runs inside one of the preload's hooks.
bool in_hook() noexcept;
// True while this thread is inside dlsym for resolve_next_symbol().
bool resolving_now() noexcept;

// dlsym(RTLD_NEXT, name) as a function pointer, cached in `cache` once `done`; null when no
// later library defines it, or while this thread is resolving a symbol already (the callers of
// mmap then use the system call).
void* resolve_next_symbol(const char* name) noexcept;
template <class Fn>
Fn resolve_next(std::atomic<Fn>& cache, std::atomic<bool>& done, const char* name) noexcept {
  if (done.load(std::memory_order_acquire)) return cache.load(std::memory_order_relaxed);
  if (resolving_now()) return nullptr;  // inside dlsym: not cached, resolved on a later call
  Fn f = reinterpret_cast<Fn>(resolve_next_symbol(name));
  cache.store(f, std::memory_order_relaxed);
  done.store(true, std::memory_order_release);
  return f;
}

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
