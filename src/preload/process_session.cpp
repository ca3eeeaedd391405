// SPDX-License-Identifier: MIT
#include "process_session.hpp"

#include <dlfcn.h>
#include <pthread.h>

#include <atomic>
#include <cstring>
#include <string>

#include "backends/posix/proc_info.hpp"
#include "call_targets.hpp"
#include "core/state_file.hpp"
#include "engine_abi.hpp"
#include "ggml_api.hpp"
#include "next_calls.hpp"
#include "platform/thread_annotations.hpp"
#include "residency/backends.hpp"
#if RESIDENCY_PRELOAD_CUDA
#include "cudapreload/device_backend.hpp"
#endif

// Exported (exports.map): the first copy of the preload in the lookup order is the one that works.
extern "C" __attribute__((visibility("default"))) const char residency_preload_instance[] = "residency";

namespace residency::preload {

namespace {

// An address in this copy (a function of internal linkage: never bound to another copy's symbol,
// as a reference to residency_preload_instance itself would be).
void this_copy_marker() noexcept {}

bool is_this_copy(const void* p) noexcept {
  Dl_info a{}, b{};
  return ::dladdr(p, &a) != 0 && ::dladdr(reinterpret_cast<const void*>(&this_copy_marker), &b) != 0 &&
         a.dli_fbase == b.dli_fbase;
}

constexpr const char* kWithout = "; the program runs without residency";

// The one pointer (leaked on purpose, see the header), the fork guard, and the once-guard of
// making the pointer (0: not tried, 1: made or given up). Constant-initialized: loading the
// library runs no code.
constinit std::atomic<EngineSession*> g_session{nullptr};
constinit std::atomic<bool> g_forked{false};
constinit std::atomic<bool> g_made{false};
constinit Mutex g_make_mu;
// The libraries' generation (call_targets.hpp) at the last start that failed for want of a
// libllama: tried again only once libraries changed (a GGUF reader or another ggml library that
// ran first never turns residency off for good).
constinit std::atomic<std::uint64_t> g_waiting_since{0};
constinit std::atomic<bool> g_said_waiting{false};

void on_fork_child() {
  g_forked.store(true, std::memory_order_relaxed);
  if (EngineSession* s = g_session.load(std::memory_order_acquire)) s->forked();
}

// SwapTotal in /proc/meminfo is above 0; true when unknown (no warning then).
bool machine_has_swap() noexcept {
  try {
    const auto mi = posix::read_meminfo();
    return !mi || !mi->swap_total || *mi->swap_total > 0;
  } catch (...) {
    return true;
  }
}

void synchronize_context(void* ctx) noexcept {
  // Resolved (and cached) when the session was made.
  if (const SynchronizeFn sync = next_llama_synchronize(nullptr)) sync(static_cast<llama_context*>(ctx));
}

// The real backends: llama.cpp's host buffers are host memory, which the posix backend locks,
// also on a machine with a GPU (there "auto" would be the cuda backend, which pins instead); each
// GPU's memory goes through the cuda backend on that device.
Result<std::shared_ptr<Backend>> real_backend(int where, const Config& device_config) {
  if (where == EngineSession::kHost) return make_backend("posix");
#if RESIDENCY_PRELOAD_CUDA
  return cuda_device_backend(where, device_config);
#else
  (void)device_config;
  return make_backend("cuda:" + std::to_string(where));  // an error naming the backends this build has
#endif
}

EngineSession* make_session(const void* near, bool& waiting) noexcept {
  waiting = false;
  try {
    auto config = Config::from_env();
    if (!config) {
      // One line per bad variable, each naming it.
      const std::string msg = config.message();
      std::size_t b = 0;
      while (b <= msg.size()) {
        const std::size_t e = msg.find('\n', b);
        const std::string line = msg.substr(b, e == std::string::npos ? std::string::npos : e - b);
        if (!line.empty()) warn(line + kWithout);
        if (e == std::string::npos) break;
        b = e + 1;
      }
      return nullptr;
    }
    const SessionLog log(config->log_level, config->log_time);
    // A second copy of the preload (loaded twice, from two paths) would run a second manager and
    // charge the process twice to a shared budget: only the first copy in the lookup order works.
    if (const void* first = ::dlsym(RTLD_DEFAULT, "residency_preload_instance"); first != nullptr && !is_this_copy(first)) {
      Dl_info mine{}, theirs{};
      ::dladdr(reinterpret_cast<const void*>(&this_copy_marker), &mine);
      ::dladdr(first, &theirs);
      log.warn(std::string("a second copy of the preload is loaded (") + (mine.dli_fname ? mine.dli_fname : "?") +
               ", besides " + (theirs.dli_fname ? theirs.dli_fname : "?") + "); this copy stays out of the way");
      return nullptr;
    }
    // Looked up, not called: no "was called" warning from resolve_next here. Not yet there, it is
    // looked for again once libraries change (a program's own GGUF reader, or a ggml-based library,
    // may come before libllama). A libllama of another llama.cpp than the one the preload was built
    // against is said once by engine_abi(), and the program runs without residency.
    void* const decode = resolve_symbol("llama_decode", near);
    const EngineAbi abi = decode == nullptr ? EngineAbi::unknown : engine_abi(true);
    if (abi == EngineAbi::refused) return nullptr;
    if (abi == EngineAbi::unknown) {  // none loaded, or llama_decode is the main program's own
      waiting = true;
      if (!g_said_waiting.exchange(true))
        log.warn(
            "a model file was mapped, but llama_decode is not reachable from the preload: no libllama is loaded "
            "yet. Residency starts when one is; a program that links llama.cpp statically runs without it");
      return nullptr;
    }
    if (const int err = ::pthread_atfork(nullptr, nullptr, &on_fork_child); err != 0) {
      log.warn(std::string("pthread_atfork failed (") + std::strerror(err) + ")" + kWithout);
      return nullptr;
    }
    EngineSession::Options o;
    o.config = *config;
    o.backends = &real_backend;
    // A clock of our own, never destroyed like the session: SteadyClock::instance() is a static
    // that exit() destroys while a scheduler thread may still read it.
    o.clock = new SteadyClock;
    o.buffers = ggml_buffer_reader(near);
    if (o.buffers == nullptr)
      o.host_unavailable =
          "ggml's backend functions (ggml_backend_buffer_get_base and others) are not reachable behind the preload "
          "(ggml is not a shared library in this program), so llama.cpp's buffers cannot be followed and the model's "
          "memory stays unmanaged";
    o.synchronize = &synchronize_context;
    o.machine_has_swap = machine_has_swap();
    o.engine_memory = config->engine_memory;
    o.worker_init = &mark_thread_inside_hook;  // the worker's own memory calls pass straight through
    // The llama.cpp this session serves, in its managers' state files (`engine=`): the library that
    // holds the llama_decode it found, for `residency doctor PID`.
    if (Dl_info engine{}; ::dladdr(decode, &engine) != 0 && engine.dli_fname != nullptr)
      core::set_state_engine(engine.dli_fname);
    return new EngineSession(std::move(o));
  } catch (...) {
    return nullptr;  // out of memory while starting: pass through
  }
}

}  // namespace

EngineSession* started_session() noexcept {
  if (g_forked.load(std::memory_order_relaxed)) return nullptr;
  return g_session.load(std::memory_order_acquire);
}

EngineSession* process_session(const void* near) noexcept {
  if (g_forked.load(std::memory_order_relaxed)) return nullptr;
  if (g_made.load(std::memory_order_acquire)) return g_session.load(std::memory_order_acquire);
  MutexLock lock(g_make_mu);
  if (g_made.load(std::memory_order_relaxed)) return g_session.load(std::memory_order_acquire);
  const std::uint64_t generation = libraries_generation();
  if (g_waiting_since.load(std::memory_order_relaxed) == generation) return nullptr;  // nothing changed since
  bool waiting = false;
  EngineSession* s = make_session(near, waiting);
  if (waiting) {
    g_waiting_since.store(generation, std::memory_order_relaxed);
    return nullptr;
  }
  g_session.store(s, std::memory_order_release);
  g_made.store(true, std::memory_order_release);
  return s;
}

bool forked_child() noexcept { return g_forked.load(std::memory_order_relaxed); }

void warn_unresolved(const char* name) noexcept {
  try {
    warn(std::string(name) +
         " was called through the preload, but no loaded library defines it; the preload "
         "returns an error for it");
  } catch (...) {
  }
}

void warn(const std::string& message) noexcept {
  if (const EngineSession* s = started_session()) {
    s->log().warn(message);
    return;
  }
  SessionLog().warn(message);
}

}  // namespace residency::preload
