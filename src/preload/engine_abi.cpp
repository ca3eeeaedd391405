// SPDX-License-Identifier: MIT
#include "engine_abi.hpp"

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>

#include <ggml.h>
#include <llama.h>

#include "abi_check.hpp"
#include "call_targets.hpp"
#include "next_calls.hpp"
#include "platform/thread_annotations.hpp"
#include "process_session.hpp"

// What this build was compiled against: cmake/ResidencyLlama.cmake passes them from llama.cpp's
// CMake package and headers.
#if !defined(RESIDENCY_BUILT_LLAMA_VERSION) || !defined(RESIDENCY_BUILT_GGML_VERSION) || \
    !defined(RESIDENCY_BUILT_LLAMA_COMMIT) || !defined(RESIDENCY_BUILT_HAS_LLAMA_VERSION)
#error "the preload is built with the llama.cpp versions from cmake/ResidencyLlama.cmake"
#endif

// Calls `fn`, a function that returns a struct in memory, with `slot` as the memory it returns
// into (the ABI's hidden result pointer: rdi on x86-64, x8 on aarch64); its other arguments are
// whatever the registers hold, so only functions that read none of them through a pointer may be
// called so. The library's function then writes into our slot, which we filled beforehand.
extern "C" __attribute__((visibility("hidden"))) void residency_call_with_result_slot(const void* fn, void* slot);
#if defined(__x86_64__)
asm(R"(
  .text
  .hidden residency_call_with_result_slot
  .globl residency_call_with_result_slot
  .type residency_call_with_result_slot, @function
  .p2align 4
residency_call_with_result_slot:
  .cfi_startproc
  endbr64
  mov %rdi, %rax
  mov %rsi, %rdi
  jmp *%rax
  .cfi_endproc
  .size residency_call_with_result_slot, .-residency_call_with_result_slot
)");
#elif defined(__aarch64__)
asm(R"(
  .text
  .hidden residency_call_with_result_slot
  .globl residency_call_with_result_slot
  .type residency_call_with_result_slot, %function
  .p2align 4
residency_call_with_result_slot:
  .cfi_startproc
  hint #34
  mov x16, x0
  mov x8, x1
  br x16
  .cfi_endproc
  .size residency_call_with_result_slot, .-residency_call_with_result_slot
)");
#else
#error "the preload's probe of llama.cpp's structs is written for x86_64 and aarch64"
#endif

namespace residency::preload {

namespace {

constexpr int kUnknown = 0, kServed = 1, kRefused = 2;
constinit std::atomic<int> g_verdict{kUnknown};
// The libraries' generation (call_targets.hpp) at which no libllama was loaded (0: not looked).
constinit std::atomic<std::uint64_t> g_none_at{0};
constinit Mutex g_decide_mu;
// True while this thread makes the verdict: the hooks it reaches meanwhile pass through.
[[gnu::tls_model("initial-exec")]] thread_local bool t_deciding = false;

// Far more than any of the structs below; a function returning one writes at most its own size.
constexpr std::size_t kProbeBytes = 4096;
alignas(64) unsigned char g_probe[2][kProbeBytes] RESIDENCY_GUARDED_BY(g_decide_mu);

// How many leading bytes of the struct `fn` returns it writes: called twice over two fillings, a
// byte it wrote differs from at least one of them. 0: nothing written (not returned in memory).
std::size_t written_by(const void* fn) noexcept RESIDENCY_REQUIRES(g_decide_mu) {
  constexpr unsigned char kFill[2] = {0xa5, 0x5a};
  for (int i = 0; i < 2; ++i) {
    std::memset(g_probe[i], kFill[i], kProbeBytes);
    residency_call_with_result_slot(fn, g_probe[i]);
  }
  for (std::size_t n = kProbeBytes; n > 0; --n)
    if (g_probe[0][n - 1] != kFill[0] || g_probe[1][n - 1] != kFill[1]) return n;
  return 0;
}

// Each struct is returned in memory on both ABIs (over 16 bytes): the probe's slot is used.
template <class T>
StructFact struct_fact(const char* name, const char* returned_by) {
  static_assert(sizeof(T) > 16 && sizeof(T) < kProbeBytes);
  StructFact f;
  f.name = name;
  f.returned_by = returned_by;
  f.built_size = sizeof(T);
  f.built_align = alignof(T);
  return f;
}

BuiltLlama built() {
  BuiltLlama b;
  b.llama_version = RESIDENCY_BUILT_LLAMA_VERSION;
  b.has_llama_version = RESIDENCY_BUILT_HAS_LLAMA_VERSION != 0;
  b.ggml_version = RESIDENCY_BUILT_GGML_VERSION;
  b.commit = RESIDENCY_BUILT_LLAMA_COMMIT;
  return b;
}

using VersionFn = const char* (*)();

std::string text_of(void* fn) {
  if (fn == nullptr) return {};
  const char* s = reinterpret_cast<VersionFn>(fn)();
  return s != nullptr ? std::string(s) : std::string();
}

// What the libllama at `path` (and the ggml it links) is, as the preload's hooks would reach it.
FoundLlama found_at(const std::string& path) RESIDENCY_REQUIRES(g_decide_mu) {
  FoundLlama f;
  f.path = path;
  auto find = [&](const char* name, bool needed) {
    void* p = resolve_for_object(name, path.c_str());
    if (p == nullptr && needed) f.missing.emplace_back(name);
    return p;
  };
  // What the session calls, and what recognises the library.
  find("llama_synchronize", true);
  f.ggml_version = text_of(find("ggml_version", true));
  f.llama_version = text_of(find("llama_version", false));  // the rule decides whether it must be there
  f.commit = text_of(find("ggml_commit", false));
  const StructFact probes[] = {
      struct_fact<llama_model_params>("llama_model_params", "llama_model_default_params"),
      struct_fact<llama_context_params>("llama_context_params", "llama_context_default_params"),
      // llama_batch_get_one(tokens, n) stores its two arguments, never reads through them.
      struct_fact<llama_batch>("llama_batch", "llama_batch_get_one"),
  };
  for (StructFact fact : probes) {
    if (void* fn = find(fact.returned_by, true)) fact.written = written_by(fn);
    f.structs.push_back(fact);
  }
  return f;
}

int decide() RESIDENCY_REQUIRES(g_decide_mu) {
  const std::string path = engine_libllama();
  if (path.empty()) return kUnknown;
  const BuiltLlama b = built();
  const FoundLlama f = found_at(path);
  const std::string difference = abi_difference(b, f);
  if (difference.empty()) return kServed;
  warn(abi_refusal(b, f, difference));
  return kRefused;
}

}  // namespace

EngineAbi engine_abi(bool may_wait) noexcept {
  const auto as_abi = [](int v) {
    return v == kServed ? EngineAbi::served : v == kRefused ? EngineAbi::refused : EngineAbi::unknown;
  };
  const int v = g_verdict.load(std::memory_order_acquire);
  if (v != kUnknown) return as_abi(v);
  // A hook does not look again while the libraries are as they were when none was found; starting
  // the session always does (a libllama a bare-name dlopen was still loading may be there now).
  const std::uint64_t generation = libraries_generation();
  if (t_deciding || resolving_now() || (!may_wait && g_none_at.load(std::memory_order_acquire) == generation))
    return EngineAbi::unknown;
  if (may_wait) {
    g_decide_mu.lock();
  } else if (!g_decide_mu.try_lock()) {
    return EngineAbi::unknown;
  }
  MutexLock lock(g_decide_mu, std::adopt_lock);
  if (const int again = g_verdict.load(std::memory_order_acquire); again != kUnknown) return as_abi(again);
  ErrnoKeeper keep;
  HookScope hook;
  t_deciding = true;
  int made = kUnknown;
  bool failed = false;
  try {
    made = decide();
  } catch (...) {
    failed = true;  // out of memory: asked again at the next call
  }
  t_deciding = false;
  if (made != kUnknown) g_verdict.store(made, std::memory_order_release);
  else if (!failed) g_none_at.store(generation, std::memory_order_release);  // no libllama loaded
  return as_abi(made);
}

}  // namespace residency::preload
