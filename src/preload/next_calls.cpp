// SPDX-License-Identifier: MIT
#include "next_calls.hpp"

#include <dlfcn.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

#include <link.h>

#include "platform/symbol_lookup.hpp"

namespace residency::preload {

namespace {

[[gnu::tls_model("initial-exec")]] thread_local bool t_in_hook = false;
[[gnu::tls_model("initial-exec")]] thread_local bool t_resolving = false;
[[gnu::tls_model("initial-exec")]] thread_local int t_compute_depth = 0;
[[gnu::tls_model("initial-exec")]] thread_local int t_engine_depth = 0;
// Where the heap first grew inside a program callback during the current engine call (0: it did not).
[[gnu::tls_model("initial-exec")]] thread_local std::uintptr_t t_callback_heap_from = 0;

using MmapFn = void* (*)(void*, std::size_t, int, int, int, off_t);
using MunmapFn = int (*)(void*, std::size_t);

// mmap and munmap are libc's, always in the global scope: RTLD_NEXT finds them.
std::atomic<MmapFn> g_mmap{nullptr};
std::atomic<MunmapFn> g_munmap{nullptr};
std::atomic<bool> g_warned{true};  // a miss is never said for these: the system call stands in

template <class Fn>
Fn resolve_libc(std::atomic<Fn>& cache, const char* name) noexcept {
  return resolve_next(cache, g_warned, name, nullptr);
}

void* sys_mmap(void* addr, std::size_t len, int prot, int flags, int fd, off_t off) noexcept {
  return reinterpret_cast<void*>(::syscall(SYS_mmap, addr, len, prot, flags, fd, off));
}

}  // namespace

void* next_mmap(void* addr, std::size_t len, int prot, int flags, int fd, off_t off) noexcept {
  if (MmapFn f = resolve_libc(g_mmap, "mmap")) return f(addr, len, prot, flags, fd, off);
  return sys_mmap(addr, len, prot, flags, fd, off);
}

#if defined(__GLIBC__)
namespace {
using Mmap64Fn = void* (*)(void*, std::size_t, int, int, int, off64_t);
std::atomic<Mmap64Fn> g_mmap64{nullptr};
}  // namespace

void* next_mmap64(void* addr, std::size_t len, int prot, int flags, int fd, off64_t off) noexcept {
  if (Mmap64Fn f = resolve_libc(g_mmap64, "mmap64")) return f(addr, len, prot, flags, fd, off);
  return sys_mmap(addr, len, prot, flags, fd, static_cast<off_t>(off));
}
#endif

int next_munmap(void* addr, std::size_t len) noexcept {
  if (MunmapFn f = resolve_libc(g_munmap, "munmap")) return f(addr, len);
  return static_cast<int>(::syscall(SYS_munmap, addr, len));
}

DecodeFn next_llama_decode(const void* near) noexcept {
  static std::atomic<DecodeFn> cache{nullptr};
  static std::atomic<bool> warned{false};
  return resolve_next(cache, warned, "llama_decode", near);
}
DecodeFn next_llama_encode(const void* near) noexcept {
  static std::atomic<DecodeFn> cache{nullptr};
  static std::atomic<bool> warned{false};
  return resolve_next(cache, warned, "llama_encode", near);
}
SynchronizeFn next_llama_synchronize(const void* near) noexcept {
  static std::atomic<SynchronizeFn> cache{nullptr};
  static std::atomic<bool> warned{false};
  return resolve_next(cache, warned, "llama_synchronize", near);
}

bool in_hook() noexcept { return t_in_hook; }
bool resolving_now() noexcept { return t_resolving; }

namespace {

// The preload's own load address: a definition found there is the hook itself.
const void* self_base() noexcept {
  static const void* base = [] {
    Dl_info info{};
    return ::dladdr(reinterpret_cast<const void*>(&resolve_symbol), &info) != 0 ? info.dli_fbase : nullptr;
  }();
  return base;
}

bool in_self(const void* p) noexcept { return p != nullptr && platform::object_base(p) == self_base(); }

const void* self() noexcept { return reinterpret_cast<const void*>(&resolve_symbol); }

void* find_in_object(const char* path, const char* name) noexcept {
  return platform::find_in_object(path, name, self());
}
void* find_near(const char* name, const void* near) noexcept { return platform::find_near(name, near, self()); }
void* find_anywhere(const char* name) noexcept { return platform::find_anywhere(name, self()); }

}  // namespace

namespace {

// `find()` with the resolving guards: nothing while this thread resolves already (dlsym may call
// back into a hook), the hooks pass straight through meanwhile, errno as it was.
template <class Find>
void* resolving(Find find) noexcept {
  if (t_resolving) return nullptr;
  const int saved = errno;
  t_resolving = true;
  const bool was = t_in_hook;
  t_in_hook = true;
  void* f = find();
  t_in_hook = was;
  t_resolving = false;
  errno = saved;
  return f;
}

// dlsym(RTLD_NEXT), but never the preload's own definition.
void* next_definition(const char* name) noexcept {
  void* f = ::dlsym(RTLD_NEXT, name);
  return f != nullptr && in_self(f) ? nullptr : f;
}

}  // namespace

void* resolve_symbol(const char* name, const void* near) noexcept {
  return resolving([&]() noexcept {
    void* f = next_definition(name);
    if (f == nullptr) f = find_near(name, near);
    return f != nullptr ? f : find_anywhere(name);
  });
}

void* resolve_for_object(const char* name, const char* caller_path) noexcept {
  return resolving([&]() noexcept {
    void* f = next_definition(name);
    if (f == nullptr && caller_path != nullptr && *caller_path != '\0') f = find_in_object(caller_path, name);
    return f;
  });
}

void* resolve_anywhere(const char* name) noexcept {
  return resolving([&]() noexcept { return find_anywhere(name); });
}

bool in_preload(const void* p) noexcept { return in_self(p); }

namespace {
[[gnu::tls_model("initial-exec")]] thread_local const void* t_forwarded_to = nullptr;
}  // namespace

ForwardScope::ForwardScope(const void* target) noexcept : was_(t_forwarded_to) { t_forwarded_to = target; }
ForwardScope::~ForwardScope() { t_forwarded_to = was_; }
const void* forwarded_to() noexcept { return t_forwarded_to; }

EngineCallScope::EngineCallScope() noexcept {
  if (t_engine_depth++ == 0) t_callback_heap_from = 0;
}
EngineCallScope::~EngineCallScope() { --t_engine_depth; }
bool in_engine_call() noexcept { return t_engine_depth > 0; }

ProgramCallbackScope::ProgramCallbackScope() noexcept : depth_(t_engine_depth), heap_top_(heap_top()) {
  t_engine_depth = 0;
}
ProgramCallbackScope::~ProgramCallbackScope() {
  const std::uintptr_t now = heap_top();
  if (now > heap_top_ && (t_callback_heap_from == 0 || heap_top_ < t_callback_heap_from))
    t_callback_heap_from = heap_top_;
  t_engine_depth = depth_;
}

// sbrk(0) reads glibc's cached program break: no system call once malloc has run, no allocation.
std::uintptr_t heap_top() noexcept {
  void* top = ::sbrk(0);
  return top == reinterpret_cast<void*>(-1) ? 0 : reinterpret_cast<std::uintptr_t>(top);
}

HeapGrowth engine_heap_growth(std::uintptr_t before) noexcept {
  std::uintptr_t end = heap_top();
  if (t_callback_heap_from != 0 && t_callback_heap_from < end) end = t_callback_heap_from;
  if (before == 0 || end <= before) return {};
  return {before, end};
}

namespace {

struct Span {
  std::uintptr_t begin = 0, end = 0;
};

// The preload's own loaded segments' span, read once.
Span self_span() noexcept {
  static const Span span = [] {
    Span s;
    struct Ctx {
      const void* base;
      Span* span;
    } ctx{self_base(), &s};
    ::dl_iterate_phdr(
        [](dl_phdr_info* info, std::size_t, void* data) -> int {
          auto& c = *static_cast<Ctx*>(data);
          if (reinterpret_cast<const void*>(info->dlpi_addr) != c.base) return 0;
          for (ElfW(Half) i = 0; i < info->dlpi_phnum; ++i) {
            const ElfW(Phdr)& ph = info->dlpi_phdr[i];
            if (ph.p_type != PT_LOAD) continue;
            const std::uintptr_t b = info->dlpi_addr + ph.p_vaddr, e = b + ph.p_memsz;
            if (c.span->begin == 0 || b < c.span->begin) c.span->begin = b;
            if (e > c.span->end) c.span->end = e;
          }
          return 1;
        },
        &ctx);
    return s;
  }();
  return span;
}

template <class Fn>
Fn libc_next(std::atomic<Fn>& cache, const char* name) noexcept {
  static std::atomic<bool> warned{true};  // libc's own: never missing, never said
  return resolve_next(cache, warned, name, nullptr);
}

}  // namespace

bool called_from_preload(const void* caller) noexcept {
  const Span s = self_span();
  const auto at = reinterpret_cast<std::uintptr_t>(caller);
  return s.begin <= at && at < s.end;
}

#define RESIDENCY_LIBC_NEXT(Type, fn, name)  \
  Type fn() noexcept {                       \
    static std::atomic<Type> cache{nullptr}; \
    return libc_next(cache, name);           \
  }
RESIDENCY_LIBC_NEXT(MadviseFn, next_madvise, "madvise")
RESIDENCY_LIBC_NEXT(MprotectFn, next_mprotect, "mprotect")
RESIDENCY_LIBC_NEXT(MlockFn, next_mlock, "mlock")
RESIDENCY_LIBC_NEXT(Mlock2Fn, next_mlock2, "mlock2")
RESIDENCY_LIBC_NEXT(MlockFn, next_munlock, "munlock")
RESIDENCY_LIBC_NEXT(MlockallFn, next_mlockall, "mlockall")
RESIDENCY_LIBC_NEXT(MunlockallFn, next_munlockall, "munlockall")
RESIDENCY_LIBC_NEXT(MremapFn, next_mremap, "mremap")
#undef RESIDENCY_LIBC_NEXT

ComputeAllocationScope::ComputeAllocationScope() noexcept { ++t_compute_depth; }
ComputeAllocationScope::~ComputeAllocationScope() { --t_compute_depth; }
bool in_compute_allocation() noexcept { return t_compute_depth > 0; }

void mark_thread_inside_hook() noexcept { t_in_hook = true; }

HookScope::HookScope() noexcept : was_(t_in_hook) { t_in_hook = true; }
HookScope::~HookScope() { t_in_hook = was_; }

}  // namespace residency::preload
