// SPDX-License-Identifier: MIT
#include "next_calls.hpp"

#include <dlfcn.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>

namespace residency::preload {

namespace {

[[gnu::tls_model("initial-exec")]] thread_local bool t_in_hook = false;
[[gnu::tls_model("initial-exec")]] thread_local bool t_resolving = false;
[[gnu::tls_model("initial-exec")]] thread_local int t_compute_depth = 0;

using MmapFn = void* (*)(void*, std::size_t, int, int, int, off_t);
using MunmapFn = int (*)(void*, std::size_t);

template <class Fn>
Fn resolve(std::atomic<Fn>& cache, std::atomic<bool>& done, const char* name) noexcept {
  return resolve_next(cache, done, name);
}

std::atomic<MmapFn> g_mmap{nullptr};
std::atomic<bool> g_mmap_done{false};
std::atomic<MunmapFn> g_munmap{nullptr};
std::atomic<bool> g_munmap_done{false};
std::atomic<DecodeFn> g_decode{nullptr};
std::atomic<bool> g_decode_done{false};
std::atomic<DecodeFn> g_encode{nullptr};
std::atomic<bool> g_encode_done{false};
std::atomic<SynchronizeFn> g_sync{nullptr};
std::atomic<bool> g_sync_done{false};

void* sys_mmap(void* addr, std::size_t len, int prot, int flags, int fd, off_t off) noexcept {
  return reinterpret_cast<void*>(::syscall(SYS_mmap, addr, len, prot, flags, fd, off));
}

}  // namespace

void* next_mmap(void* addr, std::size_t len, int prot, int flags, int fd, off_t off) noexcept {
  if (MmapFn f = resolve(g_mmap, g_mmap_done, "mmap")) return f(addr, len, prot, flags, fd, off);
  return sys_mmap(addr, len, prot, flags, fd, off);
}

#if defined(__GLIBC__)
namespace {
using Mmap64Fn = void* (*)(void*, std::size_t, int, int, int, off64_t);
std::atomic<Mmap64Fn> g_mmap64{nullptr};
std::atomic<bool> g_mmap64_done{false};
}  // namespace

void* next_mmap64(void* addr, std::size_t len, int prot, int flags, int fd, off64_t off) noexcept {
  if (Mmap64Fn f = resolve(g_mmap64, g_mmap64_done, "mmap64")) return f(addr, len, prot, flags, fd, off);
  return sys_mmap(addr, len, prot, flags, fd, static_cast<off_t>(off));
}
#endif

int next_munmap(void* addr, std::size_t len) noexcept {
  if (MunmapFn f = resolve(g_munmap, g_munmap_done, "munmap")) return f(addr, len);
  return static_cast<int>(::syscall(SYS_munmap, addr, len));
}

DecodeFn next_llama_decode() noexcept { return resolve(g_decode, g_decode_done, "llama_decode"); }
DecodeFn next_llama_encode() noexcept { return resolve(g_encode, g_encode_done, "llama_encode"); }
SynchronizeFn next_llama_synchronize() noexcept { return resolve(g_sync, g_sync_done, "llama_synchronize"); }

bool in_hook() noexcept { return t_in_hook; }
bool resolving_now() noexcept { return t_resolving; }

void* resolve_next_symbol(const char* name) noexcept {
  if (t_resolving) return nullptr;
  const int saved = errno;
  t_resolving = true;
  const bool was = t_in_hook;
  t_in_hook = true;
  void* f = ::dlsym(RTLD_NEXT, name);
  t_in_hook = was;
  t_resolving = false;
  errno = saved;
  return f;
}

ComputeAllocationScope::ComputeAllocationScope() noexcept { ++t_compute_depth; }
ComputeAllocationScope::~ComputeAllocationScope() { --t_compute_depth; }
bool in_compute_allocation() noexcept { return t_compute_depth > 0; }

HookScope::HookScope() noexcept : was_(t_in_hook) { t_in_hook = true; }
HookScope::~HookScope() { t_in_hook = was_; }

}  // namespace residency::preload
