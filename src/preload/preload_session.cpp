// SPDX-License-Identifier: MIT
#include "preload_session.hpp"

#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "device_memory.hpp"
#include "buffer_plan.hpp"
#include "engine_code.hpp"
#include "engine_memory.hpp"
#include "ggml_buffers.hpp"
#include "piece_table.hpp"
#include "next_calls.hpp"
#include "backends/posix/proc_info.hpp"
#include "residency/backends.hpp"
#include "residency/residency.hpp"
#include "residency/text.hpp"

namespace residency::preload {

namespace {

enum State : int {
  kIdle = 0,         // no GGUF mapping seen yet: nothing started
  kActive = 1,       // a manager runs; hooks register llama.cpp's buffers and count uses
  kPassThrough = 2,  // residency cannot work here (or a fork child): every hook only forwards
};

struct Session {
  Session(std::unique_ptr<Manager> m, PieceTable::Warn w, bool pressure_without_swap)
      : manager(std::move(m)),
        buffers(*manager, w, &info, &debug, pressure_without_swap),
        code(*manager, w, &info),
        memory(*manager, w, &info, &debug),
        gguf(nullptr, w, "GGUF mappings"),
        holds_between_calls(manager->config().keep_alive.in_effect() == KeepAlive::Kind::duration ||
                            manager->config().keep_alive.in_effect() == KeepAlive::Kind::forever) {}
  std::unique_ptr<Manager> manager;
  // What is registered: llama.cpp's buffers in host memory, and while a model is loaded the
  // engine's read-only code (engine_code.hpp) and its anonymous working memory (engine_memory.hpp).
  GgmlBuffers buffers;
  EngineCode code;
  EngineMemory memory;
  // The GGUF file mappings (not registered): where the file ranges no buffer reads lie.
  PieceTable gguf;
  // Under a duration or forever the memory stays between decodes, and so does the engine's working
  // memory; under keep-alive 0 (wired around each decode) it is not held.
  const bool holds_between_calls;
  // Decodes since the memory was last wired by a decode (or since the engine memory was dropped):
  // its snapshot is taken after the 1st, 2nd, 4th, ... 64th.
  std::atomic<std::uint32_t> decodes_since_wire{0};
};

// Constant-initialized: loading the library runs no code.
constinit std::atomic<int> g_state{kIdle};
constinit std::atomic<Session*> g_session{nullptr};  // leaked on purpose (see the header)
constinit std::atomic<bool> g_warn_enabled{true};   // RESIDENCY_LOG=error silences our warnings
constinit std::atomic<bool> g_info_enabled{false};  // RESIDENCY_LOG=info or debug
constinit std::atomic<bool> g_debug_enabled{false};  // RESIDENCY_LOG=debug
constinit std::atomic<bool> g_log_time{false};      // RESIDENCY_LOG_TIME=1
constinit std::atomic<bool> g_warned_unwired{false};  // the wired limit left registered memory unwired
constinit std::atomic<bool> g_warned_no_decode{false};
constinit std::atomic<bool> g_forked{false};         // a fork child: nothing but pass-through
constinit std::atomic<const Startup*> g_startup{nullptr};
constinit std::atomic<bool> g_startup_done{false};
constinit std::mutex g_startup_mu;
// Guards starting the session and every change of the tracked buffers and mappings. Never taken by
// a hook that only forwards, nor for memory that is not tracked (see piece_table.hpp).
constinit std::mutex g_mu;

constexpr const char* kWithout = "; the program runs without residency";

std::string one_line(std::string s) {
  for (std::size_t p = s.find('\n'); p != std::string::npos; p = s.find('\n', p)) s.replace(p, 1, "; ");
  return s;
}

void on_fork_child() {
  g_state.store(kPassThrough, std::memory_order_relaxed);
  g_forked.store(true, std::memory_order_relaxed);
}

Session* active_session() noexcept {
  if (g_state.load(std::memory_order_acquire) != kActive) return nullptr;
  return g_session.load(std::memory_order_acquire);
}

// Once per process: the configuration, libllama's functions behind the preload, the fork handler.
const Startup* make_startup() noexcept {
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
    g_warn_enabled.store(config->log_level >= LogLevel::warn, std::memory_order_relaxed);
    g_info_enabled.store(config->log_level >= LogLevel::info, std::memory_order_relaxed);
    g_debug_enabled.store(config->log_level >= LogLevel::debug, std::memory_order_relaxed);
    g_log_time.store(config->log_time, std::memory_order_relaxed);
    const SynchronizeFn sync = next_llama_synchronize();
    if (next_llama_decode() == nullptr || sync == nullptr) {
      warn(std::string("llama_decode is not reachable behind the preload (the program does not load libllama, or "
                       "links it statically), so the model's memory stays unmanaged: without its decodes the "
                       "keep-alive would release the model and never wire it again") +
           kWithout);
      return nullptr;
    }
    if (const int err = ::pthread_atfork(nullptr, nullptr, &on_fork_child); err != 0) {
      warn(std::string("pthread_atfork failed (") + std::strerror(err) + ")" + kWithout);
      return nullptr;
    }
    // A clock of our own, never destroyed like the managers: SteadyClock::instance() is a static
    // that exit() destroys while a scheduler thread may still read it.
    return new Startup{*config, sync, new SteadyClock};
  } catch (...) {
    return nullptr;  // out of memory while starting: pass through
  }
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

// With g_mu held and g_state == kIdle: starts the session, or passes through for good.
void start() noexcept {
  g_state.store(kPassThrough, std::memory_order_release);  // unless everything below works
  try {
    const Startup* up = startup();
    if (up == nullptr) return;
    if (ggml_api() == nullptr) {
      warn(std::string("ggml's backend functions (ggml_backend_buffer_get_base and others) are not reachable behind the "
                       "preload (ggml is not a shared library in this program), so llama.cpp's buffers cannot be "
                       "followed and the model's memory stays unmanaged") +
           kWithout);
      return;
    }
    // llama.cpp's host buffers are host memory: the posix backend locks them, also on a machine
    // with a GPU (there "auto" would be the cuda backend, which pins host memory instead).
    auto backend = make_backend("posix");
    if (!backend) {
      warn(backend.message() + kWithout);
      return;
    }
    ManagerOptions options;
    options.config = up->config;
    options.backend = *backend;
    options.clock = up->clock;
    auto manager = Manager::create(std::move(options));
    if (!manager) {
      warn(manager.message() + kWithout);
      return;
    }
    auto* session = new Session(std::move(*manager), &warn, up->config.release_on_pressure && !machine_has_swap());
    g_session.store(session, std::memory_order_release);
    g_state.store(kActive, std::memory_order_release);
  } catch (...) {
    // Out of memory while starting: pass through.
  }
}

std::uintptr_t page_end(std::uintptr_t begin, std::size_t len) noexcept {
  const std::uintptr_t page = system_page_size();
  const std::uintptr_t e = begin + len;
  if (e < begin) return UINTPTR_MAX & ~(page - 1);
  return (e + page - 1) & ~(page - 1);
}

// The bytes of [off, off + len) of `fd` to register: 0 unless `fd` is a regular file that starts
// with "GGUF" and the range starts inside it (the part past the end of the file has no pages).
std::size_t gguf_bytes(int fd, off64_t off, std::size_t len) noexcept {
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || off < 0 || off >= st.st_size) return 0;
  char magic[4] = {};
  if (::pread(fd, magic, sizeof magic, 0) != static_cast<ssize_t>(sizeof magic) || std::memcmp(magic, "GGUF", 4) != 0)
    return 0;
  const auto avail = static_cast<std::uint64_t>(st.st_size - off);
  return static_cast<std::size_t>(avail < len ? avail : len);
}

// With g_mu held: the session, started on first need; null: pass through.
Session* session_locked() noexcept {
  if (g_state.load(std::memory_order_relaxed) == kIdle) start();
  return active_session();
}

// With g_mu held: a new mapping of a GGUF file.
void track(void* addr, std::size_t size) noexcept {
  if (Session* s = session_locked()) {
    const auto b = reinterpret_cast<std::uintptr_t>(addr);
    s->gguf.add(b, b + size, RegionClass::weights, 0);
  }
}

bool tracked(const Session& s, std::uintptr_t b, std::uintptr_t e) noexcept {
  return s.buffers.pieces().overlaps(b, e) || s.code.pieces().overlaps(b, e) || s.memory.pieces().overlaps(b, e) ||
         s.gguf.overlaps(b, e);
}

// With g_mu held, around an unmap of [b, e) (or a MAP_FIXED mapping over it).
struct Cuts {
  PieceTable::Cut regions, code, memory, mappings;
};
Cuts cut_all(Session& s, std::uintptr_t b, std::uintptr_t e) noexcept {
  return Cuts{s.buffers.pieces().cut(b, e), s.code.pieces().cut(b, e), s.memory.pieces().cut(b, e), s.gguf.cut(b, e)};
}
void after_unmap_all(Session& s, const Cuts& c, std::uintptr_t b, std::uintptr_t e, bool unmapped) noexcept {
  s.buffers.pieces().after_unmap(c.regions, b, e, unmapped);
  s.code.pieces().after_unmap(c.code, b, e, unmapped);
  s.memory.pieces().after_unmap(c.memory, b, e, unmapped);
  s.gguf.after_unmap(c.mappings, b, e, unmapped);
}

// With g_mu held: what is registered besides the engine memory (llama.cpp's buffers, the engine's
// code), sorted, disjoint.
std::vector<Extent> held_extents(const Session& s) {
  std::vector<Extent> held;
  for (const PieceTable* t : {&s.buffers.pieces(), &s.code.pieces()})
    for (const PieceTable::Piece& p : t->pieces()) held.push_back({p.begin, p.end});
  std::sort(held.begin(), held.end(), [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
  return held;
}

// With g_mu held: the engine memory is dropped (before buffers are registered, which may lie where
// freed heap memory was, and before a decode wires again what may have been unmapped since), and
// its snapshots start over after the next decode.
void drop_engine_memory(Session& s) noexcept {
  s.memory.unregister();
  s.decodes_since_wire.store(0, std::memory_order_relaxed);
}

// Pages of [b, e) in memory now (mincore), bytes.
std::uint64_t resident_bytes(std::uintptr_t b, std::uintptr_t e) noexcept {
  const std::size_t page = system_page_size();
  std::uint64_t n = 0;
  unsigned char vec[256];
  for (std::uintptr_t at = b; at < e;) {
    const std::size_t pages = std::min<std::size_t>(sizeof vec, (e - at) / page);
    if (pages == 0) break;
    if (::mincore(reinterpret_cast<void*>(at), pages * page, vec) != 0) return n;
    for (std::size_t i = 0; i < pages; ++i) n += (vec[i] & 1U) != 0 ? page : 0;
    at += pages * page;
  }
  return n;
}

// With g_mu held, once a model is loaded: the pages of the GGUF mappings that no buffer reads
// (their tensors were copied into AMX, CPU_REPACK or GPU buffers, or they are the header) are
// given back to the kernel. They are never wired, and keeping them would hold the model twice.
void give_back_unread_file_pages(Session& s) noexcept {
  try {
    const std::size_t page = system_page_size();
    const std::vector<Extent> runs = s.buffers.from_ptr_runs();
    std::uint64_t unread = 0, before = 0, after = 0;
    for (const PieceTable::Piece& m : s.gguf.pieces()) {
      for (const Extent& g : page_gaps(m.begin, m.end, runs, page)) {
        unread += g.end - g.begin;
        before += resident_bytes(g.begin, g.end);
#ifdef MADV_PAGEOUT
        if (::madvise(reinterpret_cast<void*>(g.begin), g.end - g.begin, MADV_PAGEOUT) != 0)
#endif
          ::madvise(reinterpret_cast<void*>(g.begin), g.end - g.begin, MADV_DONTNEED);
        after += resident_bytes(g.begin, g.end);
      }
    }
    if (unread >= (std::uint64_t{1} << 20))
      info("model file pages no buffer reads: " + format_size(unread) + " mapped, " + format_size(before) +
           " of them resident before, " + format_size(after) + " after giving them back (not wired)");
  } catch (...) {
  }
}

// With g_mu held: registers what changed (GgmlBuffers::flush: one summary line), and once a
// model is loaded the engine's code (EngineCode), then says what that wired and how long it took
// ("wired 131.7 MiB in 12.30 ms (model loaded)"), and, once per process, warns when the wired
// limit left part of it unwired: without that a limit below the model wires nothing and only a
// debug line would say so.
void flush_buffers(Session& s, const char* why, bool model_loaded = false) noexcept {
  try {
    const Stats before = s.manager->stats();
    const auto t0 = std::chrono::steady_clock::now();
    drop_engine_memory(s);
    s.buffers.flush();
    // Only for a model with weights: llama-server first loads one without (its vocabulary).
    if (model_loaded && s.buffers.holds_weights()) s.code.register_once();
    const Stats after = s.manager->stats();
    if (after.wired_bytes > before.wired_bytes) {
      char took[32];
      std::snprintf(took, sizeof took, "%.2f ms",
                    std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      info("wired " + format_size(after.wired_bytes - before.wired_bytes) + " in " + took + " (" + why + ")");
    }
    // Only for a limit the user set: a limit clamped to RLIMIT_MEMLOCK or over the recommended
    // working set has its own warning from the manager, and so has a full shared budget.
    const Startup* up = startup();
    if (after.pending_bytes > 0 && after.wired_limit < after.tracked_bytes && up != nullptr && up->config.wired_limit &&
        !g_warned_unwired.exchange(true))
      warn(format_size(after.pending_bytes) + " of the " + format_size(after.tracked_bytes) +
           " llama.cpp registered stays unwired: it is over the wired limit of " + format_size(after.wired_limit) +
           " (RESIDENCY_WIRED_LIMIT=" + up->config.wired_limit->to_string() +
           ", or RLIMIT_MEMLOCK where that is lower); that part can be paged out");
  } catch (...) {
  }
}

// `f(session)` with the preload's lock held, errno kept and re-entry marked; nothing when the
// session is not active or this thread is inside a hook already.
template <class F>
void with_session(F&& f) noexcept {
  Session* s = active_session();
  if (s == nullptr || in_hook()) return;
  ErrnoKeeper keep;
  HookScope hook;
  std::lock_guard<std::mutex> lock(g_mu);
  f(*s);
}

}  // namespace

void info(const std::string& message) noexcept {
  if (!g_info_enabled.load(std::memory_order_relaxed)) return;
  try {
    log_to_stderr(LogLevel::info, "preload: " + one_line(message), g_log_time.load(std::memory_order_relaxed));
  } catch (...) {
  }
}

void debug(const std::string& message) noexcept {
  if (!g_debug_enabled.load(std::memory_order_relaxed)) return;
  try {
    log_to_stderr(LogLevel::debug, "preload: " + one_line(message), g_log_time.load(std::memory_order_relaxed));
  } catch (...) {
  }
}

void warn(const std::string& message) noexcept {
  if (!g_warn_enabled.load(std::memory_order_relaxed)) return;
  try {
    log_to_stderr(LogLevel::warn, "preload: " + one_line(message), g_log_time.load(std::memory_order_relaxed));
  } catch (...) {
  }
}

const Startup* startup() noexcept {
  if (g_forked.load(std::memory_order_relaxed)) return nullptr;
  if (g_startup_done.load(std::memory_order_acquire)) return g_startup.load(std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(g_startup_mu);
  if (!g_startup_done.load(std::memory_order_relaxed)) {
    g_startup.store(make_startup(), std::memory_order_relaxed);
    g_startup_done.store(true, std::memory_order_release);
  }
  return g_startup.load(std::memory_order_relaxed);
}

bool forked_child() noexcept { return g_forked.load(std::memory_order_relaxed); }

void* map_hook(void* addr, std::size_t len, int prot, int flags, int fd, off64_t off, bool is64) noexcept {
  auto call = [&]() noexcept {
#if defined(__GLIBC__)
    if (is64) return next_mmap64(addr, len, prot, flags, fd, off);
#else
    (void)is64;
#endif
    return next_mmap(addr, len, prot, flags, fd, static_cast<off_t>(off));
  };
  if (in_hook()) return call();
  const int state = g_state.load(std::memory_order_acquire);
  if (state == kPassThrough) return call();

  const bool file = (flags & MAP_ANONYMOUS) == 0 && fd >= 0;
  const bool wanted = file && len > 0 && (prot & PROT_READ) != 0 && (prot & PROT_WRITE) == 0;
  Session* s = active_session();
  const auto b = reinterpret_cast<std::uintptr_t>(addr);
  if ((flags & MAP_FIXED) != 0 && s != nullptr && tracked(*s, b, page_end(b, len))) {
    // The new mapping replaces tracked memory: that part is unmapped first.
    HookScope hook;
    const int saved = errno;
    std::lock_guard<std::mutex> lock(g_mu);
    const Cuts cut = cut_all(*s, b, page_end(b, len));
    errno = saved;
    void* r = call();
    const int err = errno;
    after_unmap_all(*s, cut, b, page_end(b, len), r != MAP_FAILED);
    if (r != MAP_FAILED && wanted) {
      if (const std::size_t n = gguf_bytes(fd, off, len)) track(r, n);
    }
    errno = err;
    return r;
  }

  void* r = call();
  if (r == MAP_FAILED || !wanted) return r;
  HookScope hook;
  ErrnoKeeper keep;  // what the real mmap left
  const std::size_t n = gguf_bytes(fd, off, len);
  if (n == 0) return r;
  std::lock_guard<std::mutex> lock(g_mu);
  track(r, n);
  return r;
}

int unmap_hook(void* addr, std::size_t len) noexcept {
  if (in_hook()) return next_munmap(addr, len);
  Session* s = active_session();
  const auto b = reinterpret_cast<std::uintptr_t>(addr);
  const std::uintptr_t e = page_end(b, len);
  if (s == nullptr || len == 0 || !tracked(*s, b, e)) return next_munmap(addr, len);
  HookScope hook;
  const int saved = errno;
  std::lock_guard<std::mutex> lock(g_mu);
  const Cuts cut = cut_all(*s, b, e);
  errno = saved;
  const int r = next_munmap(addr, len);
  const int err = errno;
  after_unmap_all(*s, cut, b, e, r == 0);
  errno = err;
  return r;
}

std::int32_t decode_hook(Entry which, llama_context* ctx, llama_batch batch) {
  const DecodeFn next = which == Entry::decode ? next_llama_decode() : next_llama_encode();
  if (next == nullptr) {
    // Only reachable when something calls the preload's definition directly: libllama's is
    // not behind it. There is nothing to forward to.
    if (!g_warned_no_decode.exchange(true)) {
      ErrnoKeeper keep;
      warn(std::string(which == Entry::decode ? "llama_decode" : "llama_encode") +
           " was called, but no library behind the preload defines it; returning -1");
    }
    return -1;
  }
  // Device memory (CUDA builds) is awake for the call; a no-op where none is routed.
  DeviceDecodeScope device(ctx);
  Session* s = in_hook() ? nullptr : active_session();
  if (s == nullptr) return next(ctx, batch);
  // Buffers ggml made since the last flush (a compute buffer that grew): registered first.
  if (s->buffers.has_pending())
    with_session([](Session& session) { flush_buffers(session, "buffers made since the last decode"); });
  // This decode wires what was released: the engine memory is snapshot again after it, not wired
  // as it was (part of it may be unmapped since).
  if (s->holds_between_calls && !s->manager->wants_resident())
    with_session([](Session& session) { drop_engine_memory(session); });
  {
    ErrnoKeeper keep;
    HookScope hook;
    s->manager->begin_call();  // lock-free while resident; re-wires when the keep-alive released it
  }
  const std::int32_t r = next(ctx, batch);
  {
    ErrnoKeeper keep;
    HookScope hook;
    s->manager->end_call(&synchronize_context, ctx);
  }
  if (s->holds_between_calls) {
    const std::uint32_t n = s->decodes_since_wire.fetch_add(1, std::memory_order_relaxed) + 1;
    if (n <= 64 && (n & (n - 1)) == 0)
      with_session([n](Session& session) {
        if (session.buffers.holds_weights() && session.manager->wants_resident())
          session.memory.snapshot(held_extents(session), n == 1 ? "after a decode" : "after more decodes");
      });
  }
  return r;
}

void synchronize_context(void* ctx) noexcept {
  if (const SynchronizeFn sync = next_llama_synchronize()) sync(static_cast<llama_context*>(ctx));
}

void buffer_created_hook(ggml_backend_buffer_t b, bool from_ptr) noexcept {
  if (b == nullptr || in_hook() || g_state.load(std::memory_order_acquire) == kPassThrough) return;
  ErrnoKeeper keep;
  HookScope hook;
  std::lock_guard<std::mutex> lock(g_mu);
  if (Session* s = session_locked()) s->buffers.created(b, from_ptr);
}

void tensor_alloc_hook(ggml_backend_buffer_t b, const struct ggml_tensor* t, const void* addr) noexcept {
  Session* s = active_session();
  if (s == nullptr || !s->buffers.is_from_ptr(b)) return;  // lock-free for every other buffer
  with_session([&](Session& session) { session.buffers.tensor_placed(b, t, addr); });
}

void buffer_usage_hook(ggml_backend_buffer_t b, enum ggml_backend_buffer_usage usage) noexcept {
  with_session([&](Session& s) { s.buffers.usage_set(b, usage); });
}

void buffer_free_hook(ggml_backend_buffer_t b) noexcept {
  if (b == nullptr) return;
  with_session([&](Session& s) {
    // llama.cpp frees buffers when it frees a context or a model, or grows a compute buffer: the
    // heap changes with them (dropped first, so that the room the buffer leaves never wires a
    // piece of it that is gone), and the next decodes take the engine memory's snapshot again.
    drop_engine_memory(s);
    s.buffers.freeing(b);
    // The last model's weights are gone: so is the reason to hold the engine's code.
    if (s.code.registered() && !s.buffers.holds_weights()) s.code.unregister();
  });
}

void model_loaded_hook(const llama_model* model) noexcept {
  if (model == nullptr) return;
  with_session([](Session& s) {
    flush_buffers(s, "model loaded", /*model_loaded=*/true);
    give_back_unread_file_pages(s);
  });
}

void context_made_hook(const llama_context* ctx) noexcept {
  if (ctx != nullptr) with_session([](Session& s) { flush_buffers(s, "context made"); });
}

}  // namespace residency::preload
