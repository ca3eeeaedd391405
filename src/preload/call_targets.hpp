// SPDX-License-Identifier: MIT
// Where each intercepted call of llama.cpp's, ggml's or CUDA's would have gone without the preload,
// by caller, and whether that is the engine's.
//
// The preload is in the global scope, so every object's call to a hooked name reaches the hook,
// whatever definition the caller's own scope would have reached. A program can hold two
// definitions of one ggml name in separate dlopen scopes (a plugin loaded RTLD_LOCAL with its own
// statically linked ggml, as whisper.cpp's bindings are, next to libllama loaded RTLD_LOCAL): one
// cached pointer per hook then sends one library's calls into the other's code (wrong tokens with no
// error, or an abort). So the target is resolved per calling object, as the dynamic linker would
// have: the global scope after the preload (dlsym(RTLD_NEXT)), then the caller's own scope (the
// object and its dependencies); and cached per object until a library is loaded or unloaded.
//
// The engine is libllama and the ggml it links: a call whose target is the definition libllama's
// own calls reach is the engine's, and the session hears of it; any other (a plugin's own ggml)
// is passed to its target untouched (docs/design.md, "One call, one target").
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace residency::preload {

// What a hooked name is, for deciding whether a target is the engine's.
enum class CallKind {
  ggml,   // the engine's when it is what libllama's calls reach
  llama,  // libllama's own: the engine's when found
  other,  // the CUDA runtime: the engine's when found (every caller's allocations are routed)
};

// One hook's targets, one per calling object (constant-initialized: a static in each hook).
class CallSite {
 public:
  static constexpr std::size_t kCallers = 8;  // more calling objects resolve on every call
  struct Entry {
    std::atomic<std::uintptr_t> begin{0};  // the calling object's span; 0: free, 1: being filled
    std::atomic<std::uintptr_t> end{0};
    std::atomic<void*> target{nullptr};
    std::atomic<bool> engine{false};
  };
  std::array<Entry, kCallers> entries{};
  std::atomic<std::uint64_t> generation{0};
  std::atomic<bool> warned{false};  // "no library defines it" said once
};

struct CallTarget {
  void* fn = nullptr;   // null: no object the caller can reach defines the name
  bool engine = false;  // the engine's definition: the session hears of the call
};

// Lock-free once cached (a look through at most kCallers spans); the first call from an object
// resolves with dlsym. Never fails the call for want of a target: the caller's scope, then any
// loaded object's definition.
CallTarget resolve_call(CallSite& site, const char* name, CallKind kind, const void* caller) noexcept;

template <class Fn>
struct TypedTarget {
  Fn fn = nullptr;
  bool engine = false;
};
template <class Fn>
TypedTarget<Fn> target_of(CallSite& site, const char* name, CallKind kind, const void* caller) noexcept {
  const CallTarget t = resolve_call(site, name, kind, caller);
  return {reinterpret_cast<Fn>(t.fn), t.engine};
}

// Libraries were loaded or unloaded (the dlopen and dlclose hooks): every cached target is
// resolved again at its next call.
void libraries_changed() noexcept;
// Changes whenever libraries_changed() is called: a failed start is tried again after a change.
std::uint64_t libraries_generation() noexcept;
// Whether the object loaded at `handle` (a dlopen handle) is, or brings in, a libllama.
bool brings_in_libllama(void* handle) noexcept;
// The path of the first libllama loaded (an object that defines llama_decode itself), as the
// libraries are now; empty when none is. Not from inside an allocator (dlsym may allocate).
std::string engine_libllama();

}  // namespace residency::preload
