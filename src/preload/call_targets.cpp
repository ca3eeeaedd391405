// SPDX-License-Identifier: MIT
#include "call_targets.hpp"

#include <dlfcn.h>
#include <link.h>
#include <sched.h>

#include <cerrno>
#include <cstring>

#include "next_calls.hpp"
#include "platform/symbol_lookup.hpp"

namespace residency::preload {

namespace {

// Bumped by every dlopen and dlclose the hooks see (before and after the call): a cached target
// is good while it has not changed. Constant-initialized.
constinit std::atomic<std::uint64_t> g_generation{1};

using Span = platform::ObjectSpan;

bool object_of(const void* addr, Span& out) noexcept { return platform::object_span(addr, out); }

// The loaded libllamas (objects that define llama_decode themselves), by path, for the
// generation they were listed at.
constexpr std::size_t kMaxLibllamas = 4;
struct Libllamas {
  std::uint64_t generation = 0;
  std::size_t n = 0;
  char path[kMaxLibllamas][512] = {};
};
constinit std::atomic<int> g_listing{0};
// The last complete listing, written only while g_listing is held, read as a sequence lock
// (g_list_seq is odd while it is written): no lock that a thread inside dlopen could wait on.
Libllamas g_libllamas;
constinit std::atomic<std::uint32_t> g_list_seq{0};

// The last complete listing (none yet: n == 0, generation 0).
Libllamas read_libllamas() noexcept {
  for (;;) {
    const std::uint32_t before = g_list_seq.load(std::memory_order_acquire);
    if ((before & 1U) != 0) continue;
    Libllamas copy = g_libllamas;
    std::atomic_thread_fence(std::memory_order_acquire);
    if (g_list_seq.load(std::memory_order_relaxed) == before) return copy;
  }
}

// An object defines `name` itself (not through a dependency).
bool defines_itself(const char* path, const char* name) noexcept {
  void* h = ::dlopen(path, RTLD_NOLOAD | RTLD_LAZY);
  if (h == nullptr) return false;
  bool itself = false;
  if (void* f = ::dlsym(h, name)) {
    Dl_info fi{};
    itself = !in_preload(f) && ::dladdr(f, &fi) != 0 && fi.dli_fname != nullptr && std::strcmp(fi.dli_fname, path) == 0;
  }
  ::dlclose(h);
  return itself;
}

// Lists the libllamas again when libraries changed since the last listing. Callers are not inside
// an allocator (a ggml or llama hook, a model file's mapping, a dlopen): dlsym may allocate.
void list_libllamas() noexcept {
  const std::uint64_t gen = g_generation.load(std::memory_order_acquire);
  if (read_libllamas().generation == gen) return;
  int expected = 0;
  if (!g_listing.compare_exchange_strong(expected, 1, std::memory_order_acquire)) return;  // another thread lists
  const int saved = errno;
  HookScope hook;  // its own dlopen and dlclose change nothing
  struct Names {
    const char* path[512];
    std::size_t n = 0;
  } names;
  ::dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t, void* data) -> int {
        auto& v = *static_cast<Names*>(data);
        if (info->dlpi_name != nullptr && info->dlpi_name[0] != '\0' && v.n < 512) v.path[v.n++] = info->dlpi_name;
        return 0;
      },
      &names);
  Libllamas found;
  found.generation = gen;
  for (std::size_t i = 0; i < names.n && found.n < kMaxLibllamas; ++i) {
    const char* p = names.path[i];
    if (std::strlen(p) >= sizeof found.path[0]) continue;
    if (!defines_itself(p, "llama_decode")) continue;
    std::strcpy(found.path[found.n++], p);
  }
  g_list_seq.fetch_add(1, std::memory_order_acq_rel);
  g_libllamas = found;
  g_list_seq.fetch_add(1, std::memory_order_release);
  g_listing.store(0, std::memory_order_release);
  errno = saved;
}

// Whether `f` is the definition of `name` that a libllama's own calls reach, by the newest listing;
// `fresh`: that listing is of the libraries loaded now (else the answer is not cached).
bool is_engine_definition(const char* name, void* f, bool& fresh) noexcept {
  list_libllamas();
  const Libllamas l = read_libllamas();
  fresh = l.generation == g_generation.load(std::memory_order_acquire);
  for (std::size_t i = 0; i < l.n; ++i)
    if (resolve_for_object(name, l.path[i]) == f) return true;
  return false;
}

bool in_span(const CallSite::Entry& e, std::uintptr_t at, void*& target, bool& engine) noexcept {
  const std::uintptr_t b = e.begin.load(std::memory_order_acquire);
  if (b <= 1 || at < b || at >= e.end.load(std::memory_order_relaxed)) return false;
  target = e.target.load(std::memory_order_relaxed);
  engine = e.engine.load(std::memory_order_relaxed);
  return true;
}

}  // namespace

CallTarget resolve_call(CallSite& site, const char* name, CallKind kind, const void* caller) noexcept {
  // Returning into the preload: a tail call from the code a hook forwards to, whose object called.
  if (called_from_preload(caller))
    if (const void* target = forwarded_to()) caller = target;
  const auto at = reinterpret_cast<std::uintptr_t>(caller);
  const std::uint64_t gen = g_generation.load(std::memory_order_acquire);
  if (site.generation.load(std::memory_order_acquire) == gen) {
    for (const CallSite::Entry& e : site.entries) {
      CallTarget t;
      if (in_span(e, at, t.fn, t.engine)) return t;
    }
  } else {
    // Libraries changed: every cached target is resolved again.
    for (CallSite::Entry& e : site.entries) e.begin.store(0, std::memory_order_release);
    site.generation.store(gen, std::memory_order_release);
  }
  Span span;
  const bool known = caller != nullptr && object_of(caller, span);
  CallTarget t;
  t.fn = resolve_for_object(name, known ? span.path : nullptr);
  // Not in the caller's scope (a call through a function pointer from a library that does not
  // link the definition, as ggml-base calls into ggml-cpu): the engine's, then any object's.
  if (t.fn == nullptr) {
    list_libllamas();
    const Libllamas l = read_libllamas();
    for (std::size_t i = 0; i < l.n && t.fn == nullptr; ++i) t.fn = resolve_for_object(name, l.path[i]);
  }
  if (t.fn == nullptr) t.fn = resolve_anywhere(name);
  if (t.fn == nullptr) return t;  // not cached: the library may be loaded later
  bool fresh = true;
  switch (kind) {
    case CallKind::ggml: t.engine = is_engine_definition(name, t.fn, fresh); break;
    case CallKind::llama:
    case CallKind::other: t.engine = true; break;
  }
  if (!known || !fresh) return t;
  for (CallSite::Entry& e : site.entries) {
    std::uintptr_t expected = 0;
    if (!e.begin.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) continue;
    e.target.store(t.fn, std::memory_order_relaxed);
    e.engine.store(t.engine, std::memory_order_relaxed);
    e.end.store(span.end, std::memory_order_relaxed);
    e.begin.store(span.begin, std::memory_order_release);
    break;
  }
  return t;
}

void libraries_changed() noexcept { g_generation.fetch_add(1, std::memory_order_acq_rel); }

std::uint64_t libraries_generation() noexcept { return g_generation.load(std::memory_order_acquire); }

std::string engine_libllama() {
  // Another thread may be listing the libraries as they are now: its listing, not an older one
  // (a while at most, where libraries keep changing).
  constexpr int kTries = 1000;
  for (int i = 1;; ++i) {
    list_libllamas();
    const Libllamas l = read_libllamas();
    if (l.generation == g_generation.load(std::memory_order_acquire) || i == kTries)
      return l.n > 0 ? std::string(l.path[0]) : std::string();
    ::sched_yield();
  }
}

bool brings_in_libllama(void* handle) noexcept {
  if (handle == nullptr) return false;
  const int saved = errno;
  const bool yes = ::dlsym(handle, "llama_decode") != nullptr;
  errno = saved;
  return yes;
}

}  // namespace residency::preload
