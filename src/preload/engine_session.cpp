// SPDX-License-Identifier: MIT
#include "engine_session.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <linux/futex.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <utility>

#include "manager_start.hpp"
#include "platform/proc_stat.hpp"

#include "residency/text.hpp"

namespace residency::preload {

namespace {

constexpr const char* kWithout = "; the program runs without residency";
constexpr const char* kWithoutDevice = "; device memory stays the CUDA runtime's (no sleep)";

std::string device_name(int device) { return "CUDA device " + std::to_string(device); }

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

std::int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string ms_between(std::int64_t from_ns, std::int64_t to_ns) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f ms", static_cast<double>(to_ns - from_ns) / 1e6);
  return buf;
}

std::string took_since(std::chrono::steady_clock::time_point t0) {
  char took[32];
  std::snprintf(took, sizeof took, "%.2f ms",
                std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  return took;
}

}  // namespace

bool SessionRules::may_be_model_file(int prot, int flags, int fd, std::size_t len) noexcept {
  const bool file = (flags & MAP_ANONYMOUS) == 0 && fd >= 0;
  return file && len > 0 && (prot & PROT_READ) != 0 && (prot & PROT_WRITE) == 0;
}

std::size_t SessionRules::gguf_bytes(int fd, off64_t off, std::size_t len) noexcept {
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || off < 0 || off >= st.st_size) return 0;
  char magic[4] = {};
  if (::pread(fd, magic, sizeof magic, 0) != static_cast<ssize_t>(sizeof magic) || std::memcmp(magic, "GGUF", 4) != 0)
    return 0;
  const auto avail = static_cast<std::uint64_t>(st.st_size - off);
  return static_cast<std::size_t>(avail < len ? avail : len);
}

EngineSession::EngineSession(Options options)
    : options_(std::move(options)),
      log_(options_.config.log_level, options_.config.log_time, options_.log),
      holds_between_calls_(options_.config.keep_alive.holds_between_uses()),
      files_(nullptr, log_, "GGUF mappings"),
      engine_made_(nullptr, log_, "the engine's mappings"),
      program_locked_(nullptr, log_, "the program's locked ranges") {
  program_locked_.defer_warnings();  // changed by hooks, which must not build a message
  program_locked_.merge_touching();
}

// Parts first, then the managers they registered with (members go in reverse order; this says so).
EngineSession::~EngineSession() {
  // The worker first, without the lock (it takes it to apply events).
  std::thread worker;
  {
    MutexLock lock(mu_);
    worker = std::move(worker_);
  }
  if (worker.joinable()) {
    stop_worker_.store(true, std::memory_order_release);
    wake_.fetch_add(1, std::memory_order_release);
    ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&wake_), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
    worker.join();
  }
  MutexLock lock(mu_);
  for (FileOfMapping& f : file_of_mapping_)
    if (f.fd >= 0) ::close(f.fd);
  file_of_mapping_.clear();
  host_parts_ready_.store(nullptr, std::memory_order_release);
  host_parts_.reset();
  routed_.clear();
}

std::unique_ptr<Manager> EngineSession::start_manager(int where) {
  const bool host = where == kHost;
  if (!host && !options_.config.keep_alive.manages()) return nullptr;  // residency off: no device to manage
  return start_session_manager(where, options_.config, options_.backends, options_.clock, options_.start_schedulers,
                               log_, host ? kWithout : kWithoutDevice);
}

EngineSession::Host* EngineSession::host_locked() {
  if (host_state_ == Side::active) return host_parts_.get();
  if (host_state_ == Side::pass_through || program_locks_all_ || forked_.load(std::memory_order_relaxed))
    return nullptr;
  host_state_ = Side::pass_through;  // unless everything below works
  if (!options_.host_unavailable.empty() || options_.buffers == nullptr) {
    log_.warn(options_.host_unavailable + kWithout);
    return nullptr;
  }
  std::unique_ptr<Manager> m = start_manager(kHost);
  if (!m) return nullptr;
  try {
    host_parts_ = std::make_unique<Host>(*m, *options_.buffers, log_,
                                         options_.config.release_on_pressure && !options_.machine_has_swap);
  } catch (...) {
    return nullptr;
  }
  // What the program locked itself is never registered: the session would unlock it.
  for (PieceTable* t : {&host_parts_->buffers.pieces(), &host_parts_->code.pieces(), &host_parts_->memory.pieces()})
    t->exclude(&program_locked_);
  try {
    lock_limit_applies_.store(m->backend().memory_info().hard_limit != 0, std::memory_order_relaxed);
  } catch (...) {
    lock_limit_applies_.store(true, std::memory_order_relaxed);  // as before it was asked
  }
  host_owner_ = std::move(m);
  host_.store(host_owner_.get(), std::memory_order_release);
  host_parts_ready_.store(host_parts_.get(), std::memory_order_release);
  host_state_ = Side::active;
  if (options_.start_schedulers) start_worker();
  return host_parts_.get();
}

EngineSession::Host* EngineSession::active_host() const noexcept {
  if (forked_.load(std::memory_order_relaxed)) return nullptr;
  return host_parts_ready_.load(std::memory_order_acquire);
}

EngineSession::Host* EngineSession::active_locked() const {
  if (forked_.load(std::memory_order_relaxed) || host_state_ != Side::active || program_locks_all_) return nullptr;
  return host_parts_.get();
}

Manager* EngineSession::device_locked(int device) {
  Device& d = devices_[static_cast<std::size_t>(device)];
  const Side state = d.state.load(std::memory_order_relaxed);
  if (state == Side::active) return d.manager.load(std::memory_order_relaxed);
  if (state == Side::pass_through) return nullptr;
  d.state.store(Side::pass_through, std::memory_order_relaxed);  // unless everything below works
  std::unique_ptr<Manager> m = start_manager(device);
  if (!m) return nullptr;
  try {
    device_owners_.push_back(std::move(m));
  } catch (...) {
    return nullptr;
  }
  Manager* raw = device_owners_.back().get();
  d.manager.store(raw, std::memory_order_release);
  d.state.store(Side::active, std::memory_order_release);
  active_devices_.fetch_add(1, std::memory_order_release);
  return raw;
}

Manager* EngineSession::device_manager(int device) const noexcept {
  if (device < 0 || device >= SessionRules::kMaxDevices) return nullptr;
  const Device& d = devices_[static_cast<std::size_t>(device)];
  return d.state.load(std::memory_order_acquire) == Side::active ? d.manager.load(std::memory_order_acquire) : nullptr;
}

template <class F>
void EngineSession::for_each_device(F&& f) noexcept {
  if (active_devices_.load(std::memory_order_acquire) == 0) return;
  for (Device& d : devices_) {
    if (d.state.load(std::memory_order_acquire) != Side::active) continue;
    if (Manager* m = d.manager.load(std::memory_order_acquire)) f(*m);
  }
}

// ---- Host mappings ----

void EngineSession::file_mapped(void* addr, std::size_t bytes, int fd, std::uint64_t offset) noexcept {
  if (addr == nullptr || bytes == 0) return;
  MutexLock lock(mu_);
  drain_locked();
  if (host_locked() == nullptr) return;
  const auto b = reinterpret_cast<std::uintptr_t>(addr);
  std::uint64_t owner = 0;
  try {
    // Descriptors of mappings that are wholly gone are closed (a server that loads many models).
    const std::vector<PieceTable::Piece> now = files_.pieces();
    for (std::size_t i = 0; i < file_of_mapping_.size(); ++i) {
      FileOfMapping& f = file_of_mapping_[i];
      if (f.fd < 0) continue;
      const bool left = std::any_of(now.begin(), now.end(), [i](const PieceTable::Piece& p) { return p.owner == i + 1; });
      if (!left) {
        ::close(f.fd);
        f.fd = -1;
      }
    }
    const int own = fd < 0 ? -1 : ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own >= 0) {
      file_of_mapping_.push_back(FileOfMapping{b, own, offset});
      owner = file_of_mapping_.size();
    }
  } catch (...) {
    // no file record: its tensors count as written, as without one
  }
  files_.add(b, b + bytes, RegionClass::weights, owner);
}

void EngineSession::device_filled(std::uintptr_t begin, std::uintptr_t end, std::uintptr_t src) noexcept {
  if (begin >= end || !tracks_device_writes()) return;
  const Tracked* in = nullptr;
  for (const Tracked& t : tracked_) {
    const std::uintptr_t b = t.begin.load(std::memory_order_acquire);
    if (b != 0 && begin >= b && end <= t.end.load(std::memory_order_relaxed)) in = &t;
  }
  if (in == nullptr) return device_written(begin, end);
  Manager* m = device_manager(in->device.load(std::memory_order_relaxed));
  if (m == nullptr) return;
  {
    MutexLock lock(mu_);
    drain_locked();
    try {
      for (const PieceTable::Piece& p : files_.pieces()) {
        if (src < p.begin || src + (end - begin) > p.end || p.owner == 0 || p.owner > file_of_mapping_.size()) continue;
        const FileOfMapping& f = file_of_mapping_[p.owner - 1];
        if (f.fd < 0) break;
        // The descriptor stays open while the lock is held.
        m->filled_from_file(reinterpret_cast<const void*>(begin), end - begin, f.fd, f.offset + (src - f.begin));
        return;
      }
    } catch (...) {
      // counted as a write below
    }
  }
  device_written(begin, end);
}

bool EngineSession::tracks(std::uintptr_t begin, std::uintptr_t end) const noexcept {
  const Host* h = active_host();
  if (h == nullptr) return false;
  return h->buffers.pieces().overlaps(begin, end) || h->code.pieces().overlaps(begin, end) ||
         h->memory.pieces().overlaps(begin, end) || files_.overlaps(begin, end) || engine_made_.overlaps(begin, end);
}

EngineSession::Cuts EngineSession::cut_locked(std::uintptr_t b, std::uintptr_t e) noexcept {
  Host* h = active_locked();
  if (h == nullptr) return {};
  return Cuts{h->buffers.pieces().cut(b, e), h->code.pieces().cut(b, e), h->memory.pieces().cut(b, e), files_.cut(b, e),
              engine_made_.cut(b, e)};
}

void EngineSession::after_unmap_locked(const Cuts& c, std::uintptr_t b, std::uintptr_t e, bool gone) noexcept {
  Host* h = active_locked();
  if (h == nullptr) return;
  h->buffers.pieces().after_unmap(c.buffers, b, e, gone);
  h->code.pieces().after_unmap(c.code, b, e, gone);
  h->memory.pieces().after_unmap(c.memory, b, e, gone);
  files_.after_unmap(c.files, b, e, gone);
  engine_made_.after_unmap(c.made, b, e, gone);
}

void EngineSession::let_go_of_everything_locked(const char* why) noexcept {
  Host* h = active_locked();
  if (h == nullptr) return;
  // Released first: unregistering a wired region promotes regions that waited for room, which a
  // released manager only admits, never locks (the program's next lock must find the limit free).
  if (Manager* m = host_.load(std::memory_order_relaxed)) m->release_now();
  host_parts_ready_.store(nullptr, std::memory_order_release);  // lock-free readers see no host side
  drop_engine_memory_locked();
  (void)cut_locked(0, UINTPTR_MAX);
  program_locks_all_ = true;
  log_.info(std::string(why) + ": residency lets go of the memory it held and holds none from now on");
}

// ---- The program's memory calls ----

void EngineSession::queue(MemoryEvents::Event e) noexcept {
  if (forked_.load(std::memory_order_relaxed)) return;
  events_.push(e);  // a full ring is said by lost(): the worker then checks everything it tracks
  wake_.fetch_add(1, std::memory_order_release);
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&wake_), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
}

void EngineSession::memory_gone(std::uintptr_t begin, std::uintptr_t end) noexcept {
  if (begin < end) queue({MemoryEvents::Kind::gone, begin, end});
}

void EngineSession::engine_mapped(std::uintptr_t begin, std::uintptr_t end) noexcept {
  if (begin < end && active_host() != nullptr) queue({MemoryEvents::Kind::engine_mapped, begin, end});
}

void EngineSession::program_locked_all(int flags) noexcept {
  if (active_host() != nullptr) queue({MemoryEvents::Kind::program_locks_all, static_cast<std::uintptr_t>(flags), 0});
}

bool EngineSession::step_aside_for_program_lock() noexcept {
  const Host* h = active_host();
  // Nothing registered, or no limit that the session's locks count against: the failure is not
  // the session's doing.
  if (h == nullptr || !lock_limit_applies_.load(std::memory_order_relaxed) ||
      !(h->buffers.pieces().overlaps(0, UINTPTR_MAX) || h->code.pieces().overlaps(0, UINTPTR_MAX) ||
        h->memory.pieces().overlaps(0, UINTPTR_MAX)))
    return false;
  unlock_before_take_back(0, UINTPTR_MAX);
  queue({MemoryEvents::Kind::program_needs_limit, 0, 0});
  return true;
}

// System calls only: the registered tables' pieces inside [begin, end), less what the program
// locked itself, are unlocked (munlock of what is not locked does nothing). The manager still
// counts them until the event is applied.
void EngineSession::unlock_before_take_back(std::uintptr_t begin, std::uintptr_t end) const noexcept {
  const Host* h = active_host();
  if (h == nullptr || begin >= end) return;
  const std::uintptr_t page = system_page_size();
  MutexLock lock(program_mu_);
  auto unlock = [&](std::uintptr_t b, std::uintptr_t e) {
    b &= ~(page - 1);
    e = (e + page - 1) & ~(page - 1);
    // Around what the program locked (whole pages of it), in order.
    std::uintptr_t at = b;
    while (at < e) {
      std::uintptr_t next_locked = e, locked_end = e;
      program_locked_.for_each_overlap(at, e, [&](std::uintptr_t pb, std::uintptr_t pe) {
        pb &= ~(page - 1);
        if (pb < next_locked) {
          next_locked = std::max(pb, at);
          locked_end = (pe + page - 1) & ~(page - 1);
        }
      });
      if (next_locked > at) ::syscall(SYS_munlock, at, next_locked - at);
      at = std::max(next_locked, locked_end);
      if (next_locked == e) break;
    }
  };
  for (const PieceTable* t : {&h->buffers.pieces(), &h->code.pieces(), &h->memory.pieces()})
    t->for_each_overlap(begin, end, unlock);
}

void EngineSession::settle() noexcept {
  MutexLock lock(mu_);
  drain_locked();
}

void EngineSession::drain_locked() noexcept {
  if (events_.take_lost()) check_tracked_against_maps_locked();
  MemoryEvents::Event e;
  while (events_.pop(e)) apply_locked(e);
  program_locked_.say_deferred_warnings();
}

void EngineSession::apply_locked(const MemoryEvents::Event& e) noexcept {
  switch (e.kind) {
    case MemoryEvents::Kind::gone: {
      const Cuts cut = cut_locked(e.begin, e.end);
      after_unmap_locked(cut, e.begin, e.end, /*gone=*/true);
      return;
    }
    case MemoryEvents::Kind::engine_mapped:
      if (active_locked() != nullptr) engine_made_.add(e.begin, e.end, RegionClass::scratch, 0);
      return;
    case MemoryEvents::Kind::program_locked: {
      // Unregistering what the session held there unlocked it, the program's lock with it: the
      // program's lock is made again, as it stands now (a munlock since then is kept).
      const Cuts cut = cut_locked(e.begin, e.end);
      after_unmap_locked(cut, e.begin, e.end, /*gone=*/true);
      MutexLock lock(program_mu_);
      program_locked_.for_each_overlap(e.begin, e.end,
                                       [](std::uintptr_t b, std::uintptr_t en) { ::syscall(SYS_mlock, b, en - b); });
      return;
    }
    case MemoryEvents::Kind::program_needs_limit:
      if (active_locked() == nullptr) return;
      let_go_of_everything_locked(
          "the program's own lock failed on RLIMIT_MEMLOCK, which what residency locked counts against (no "
          "CAP_IPC_LOCK); the program's locks come first");
      return;
    case MemoryEvents::Kind::program_locks_all:
      if (active_locked() == nullptr) return;
      let_go_of_everything_locked("the program locks all its memory itself (mlockall)");
      ::syscall(SYS_mlockall, static_cast<int>(e.begin));  // what the let-go unlocked, locked again
      return;
  }
}

// Events were lost (the ring was full): whatever may be stale is found by the process's
// mappings. A tracked piece not wholly inside mappings of the process is forgotten (its memory may
// be gone or the program's now), and so is the engine memory, snapshot again after the next decode.
void EngineSession::check_tracked_against_maps_locked() noexcept {
  Host* h = active_locked();
  if (h == nullptr) return;
  log_.warn(std::string("more than ") + std::to_string(MemoryEvents::kCapacity) +
            " of the program's memory calls on tracked memory came at once; what residency tracks is checked "
            "against the process's mappings instead");
  drop_engine_memory_locked();
  try {
    const std::vector<MapsEntry> maps = parse_maps(read_own_maps());
    auto mapped = [&](std::uintptr_t b, std::uintptr_t e) {
      for (const MapsEntry& m : maps) {  // sorted, adjacent mappings may cover a piece together
        if (m.end <= b) continue;
        if (m.begin > b) return false;
        b = m.end;
        if (b >= e) return true;
      }
      return false;
    };
    std::vector<Extent> stale;
    for (const PieceTable* t : {&h->buffers.pieces(), &h->code.pieces(), &files_, &engine_made_})
      for (const PieceTable::Piece& p : t->pieces())
        if (!mapped(p.begin, p.end)) stale.push_back({p.begin, p.end});
    for (const Extent& x : stale) {
      const Cuts cut = cut_locked(x.begin, x.end);
      after_unmap_locked(cut, x.begin, x.end, /*gone=*/true);
    }
  } catch (...) {
    (void)cut_locked(0, UINTPTR_MAX);  // out of memory: nothing is held rather than something stale
  }
}

void EngineSession::start_worker() noexcept {
  if (worker_.joinable()) return;
  try {
    worker_ = std::thread([this] { worker_loop(); });
  } catch (...) {
    // No thread: events are applied at the session's next event instead.
  }
}

void EngineSession::worker_loop() noexcept {
  if (options_.worker_init != nullptr) options_.worker_init();
  for (;;) {
    const std::uint32_t seen = wake_.load(std::memory_order_acquire);
    if (stop_worker_.load(std::memory_order_acquire)) return;
    if (!events_.empty()) {
      settle();
      continue;
    }
    ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&wake_), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
  }
}

// ---- Buffers ----

void EngineSession::buffer_created(BufferId b, bool from_ptr) noexcept {
  if (b == 0) return;
  MutexLock lock(mu_);
  drain_locked();
  if (Host* h = host_locked()) h->buffers.created(b, from_ptr);
}

bool EngineSession::wants_tensor_placements(BufferId b) const noexcept {
  const Host* h = active_host();
  return h != nullptr && h->buffers.is_from_ptr(b);
}

void EngineSession::tensor_placed(BufferId b, std::uintptr_t begin, std::uintptr_t end) noexcept {
  MutexLock lock(mu_);
  drain_locked();
  if (Host* h = active_locked()) h->buffers.tensor_placed(b, begin, end);
}

void EngineSession::buffer_usage(BufferId b, BufferUsage usage) noexcept {
  MutexLock lock(mu_);
  drain_locked();
  if (Host* h = active_locked()) h->buffers.usage_set(b, usage);
}

void EngineSession::buffer_freed(BufferId b) noexcept {
  if (b == 0) return;
  MutexLock lock(mu_);
  drain_locked();
  Host* h = active_locked();
  if (h == nullptr) return;
  // llama.cpp frees buffers when it frees a context or a model, or grows a compute buffer: the
  // heap changes with them (dropped first, so that the room the buffer leaves never wires a piece
  // of it that is gone), and the next decodes take the engine memory's snapshot again.
  drop_engine_memory_locked();
  h->buffers.freeing(b);
  // The last model's weights are gone: so is the reason to hold the engine's code.
  if (h->code.registered() && !h->buffers.holds_weights()) h->code.unregister();
}

void EngineSession::model_loaded() noexcept {
  MutexLock lock(mu_);
  drain_locked();
  if (active_locked() == nullptr) return;
  flush_locked("model loaded", /*model_loaded=*/true);
  give_back_unread_file_pages_locked();
}

void EngineSession::context_made() noexcept {
  MutexLock lock(mu_);
  drain_locked();
  if (active_locked() != nullptr) flush_locked("context made", /*model_loaded=*/false);
}

// The engine memory is dropped (before buffers are registered, which may lie where freed heap
// memory was, and before a decode wires again what may have been unmapped since), and its
// snapshots start over after the next decode.
void EngineSession::drop_engine_memory_locked() noexcept {
  if (Host* h = active_locked()) h->memory.unregister();
  decodes_since_wire_.store(0, std::memory_order_relaxed);
}

// What is registered besides the engine memory (llama.cpp's buffers, the engine's code), sorted,
// disjoint: what a snapshot leaves out.
std::vector<Extent> EngineSession::held_extents_locked() const {
  std::vector<Extent> held;
  const Host* h = active_locked();
  if (h == nullptr) return held;
  for (const PieceTable* t : {&h->buffers.pieces(), &h->code.pieces()})
    for (const PieceTable::Piece& p : t->pieces()) held.push_back({p.begin, p.end});
  std::sort(held.begin(), held.end(), [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
  return held;
}

// Registers what changed (GgmlBuffers::flush: one summary line), and once a model with weights
// is loaded the engine's code, then says what that wired and how long it took ("wired 131.7 MiB
// in 12.30 ms (model loaded)"), and, once, warns when the wired limit the user set left part of it
// unwired: without that a limit below the model wires nothing and only a debug line says so.
void EngineSession::flush_locked(const char* why, bool model_loaded) noexcept {
  Host* h = active_locked();
  Manager* m = host_.load(std::memory_order_relaxed);
  if (h == nullptr || m == nullptr) return;
  try {
    const Stats before = m->stats();
    const auto t0 = std::chrono::steady_clock::now();
    drop_engine_memory_locked();
    h->buffers.flush();
    // Only for a model with weights: llama-server first loads one without (its vocabulary). Also
    // at a later flush point: a program that loads the model past the preload (dlsym) has no
    // "model loaded" event.
    (void)model_loaded;
    if (h->buffers.holds_weights()) h->code.register_once();
    const Stats after = m->stats();
    if (after.wired_bytes > before.wired_bytes || after.tracked_bytes > before.tracked_bytes) {
      // What is really locked: registered is not held when a limit leaves part of it unwired.
      std::string line = "wired " + format_size(after.wired_bytes - std::min(after.wired_bytes, before.wired_bytes)) +
                         " in " + took_since(t0) + " (" + why + ")";
      if (after.pending_bytes > 0) {
        // The limit that left it out, by the order admission applies them: the process's wired
        // limit (RLIMIT_MEMLOCK when it is enforced and lower: no CAP_IPC_LOCK), then the shared
        // budget. A server run as root under a full shared budget was once told "over the wired
        // limit of 17.7 GiB (RLIMIT_MEMLOCK is 8 MiB)": neither applied.
        const MemoryInfo mem = m->backend().memory_info();
        const std::uint64_t wanted = after.admitted_bytes + after.pending_bytes;
        const auto& shared = m->config().shared_budget;
        const auto cause = [&]() -> std::string {
          if (mem.hard_limit != 0 && wanted > mem.hard_limit && after.wired_limit >= mem.hard_limit)
            return "over " + mem.hard_limit_name + ", " + format_size(mem.hard_limit) + " (no CAP_IPC_LOCK)";
          if (wanted > after.wired_limit) return "over the wired limit of " + format_size(after.wired_limit);
          if (after.pressure_cap != UINT64_MAX && wanted > after.pressure_cap)
            return "over the wired limit, lowered to " + format_size(after.pressure_cap) + " by memory pressure";
          if (after.shared_budget > 0 && shared)
            return "the shared budget " + shared->name + " (" + format_size(after.shared_budget) +
                   ") is full: this process holds " + format_size(after.shared_held) +
                   " of it, other processes the rest (`residency stat` lists them)";
          return "the backend refused it (its warning says why)";
        };
        line += "; " + format_size(after.pending_bytes) + " of the " + format_size(after.tracked_bytes) +
                " registered is not locked: " + cause();
      }
      log_.info(line);
    }
    // Only for a limit the user set: a limit clamped to RLIMIT_MEMLOCK or over the recommended
    // working set has its own warning from the manager, and so has a full shared budget.
    const Config& c = options_.config;
    if (after.pending_bytes > 0 && after.wired_limit < after.tracked_bytes && c.wired_limit && !warned_unwired_) {
      warned_unwired_ = true;
      log_.warn(format_size(after.pending_bytes) + " of the " + format_size(after.tracked_bytes) +
                " llama.cpp registered stays unwired: it is over the wired limit of " + format_size(after.wired_limit) +
                " (RESIDENCY_WIRED_LIMIT=" + c.wired_limit->to_string() +
                ", or RLIMIT_MEMLOCK where that is lower); that part can be paged out");
    }
  } catch (...) {
  }
}

// Once a model is loaded: the pages of the GGUF mappings that no buffer reads (their tensors were
// copied into AMX, CPU_REPACK or GPU buffers, or they are the header) are given back to the
// kernel. They are never wired, and keeping them would hold the model twice.
void EngineSession::give_back_unread_file_pages_locked() noexcept {
  Host* h = active_locked();
  if (h == nullptr) return;
  try {
    const std::size_t page = system_page_size();
    const std::vector<Extent> runs = h->buffers.from_ptr_runs();
    std::uint64_t unread = 0, before = 0, after = 0;
    for (const PieceTable::Piece& f : files_.pieces()) {
      for (const Extent& g : page_gaps(f.begin, f.end, runs, page)) {
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
      log_.info("model file pages no buffer reads: " + format_size(unread) + " mapped, " + format_size(before) +
                " of them resident before, " + format_size(after) + " after giving them back (not wired)");
  } catch (...) {
  }
}

std::uint64_t EngineSession::engine_memory_bytes() const noexcept {
  MutexLock lock(mu_);
  const Host* h = active_locked();
  return h != nullptr ? h->memory.bytes() : 0;
}

// ---- Decodes ----

namespace {

// Whether thread `tid` of this process still runs (a thread id is reused only after the thread
// ended and its stack was given back; a reused one names a live thread whose stack is elsewhere,
// which the stack point's mapping then does not hold).
bool thread_lives(int tid) noexcept {
  return tid > 0 && (::syscall(SYS_tgkill, ::getpid(), tid, 0) == 0 || errno != ESRCH);
}

}  // namespace

EngineOwned EngineSession::engine_owned_locked() const {
  EngineOwned owned;
  owned.heap = false;  // the heap is the program's; what the engine grew of it is in engine_made_
  for (const PieceTable::Piece& p : engine_made_.pieces()) owned.made.push_back({p.begin, p.end});
  for (std::size_t i = 0; i < kMaxStacks; ++i) {
    const std::uintptr_t at = stacks_[i].load(std::memory_order_relaxed);
    if (at == 0) continue;
    if (!thread_lives(stack_threads_[i].load(std::memory_order_relaxed))) continue;
    owned.stack_points.push_back(at);
  }
  return owned;
}

// One address per stack the engine's calls ran on: a point within 1 MiB of a known one is on the
// same stack (thread stacks are 8 MiB apart at least, with guard pages between). A slot whose
// thread ended is taken again.
void EngineSession::note_stack(std::uintptr_t stack) noexcept {
  constexpr std::uintptr_t kSameStack = std::uintptr_t{1} << 20;
  // The thread's id, asked of the kernel once per thread (this runs before every decode).
  static thread_local const int tid = static_cast<int>(::syscall(SYS_gettid));
  for (std::size_t i = 0; i < kMaxStacks; ++i) {
    const std::uintptr_t at = stacks_[i].load(std::memory_order_relaxed);
    if (at != 0 && (at > stack ? at - stack : stack - at) < kSameStack &&
        stack_threads_[i].load(std::memory_order_relaxed) == tid)
      return;
  }
  MutexLock lock(mu_);
  drain_locked();
  std::size_t free_slot = kMaxStacks;
  for (std::size_t i = 0; i < kMaxStacks; ++i) {
    const std::uintptr_t at = stacks_[i].load(std::memory_order_relaxed);
    const int owner = stack_threads_[i].load(std::memory_order_relaxed);
    // The same stack under another thread (a thread ended, its stack reused by a new one), or a
    // dead thread's stack: the slot is this stack's now.
    if (at == 0 || (at > stack ? at - stack : stack - at) < kSameStack || !thread_lives(owner)) {
      free_slot = i;
      if (at != 0) break;
    }
  }
  if (free_slot == kMaxStacks) return;
  stack_threads_[free_slot].store(tid, std::memory_order_relaxed);
  stacks_[free_slot].store(stack, std::memory_order_relaxed);
}

void EngineSession::decodes_seen_as_graph_computes() noexcept {
  if (said_graph_computes_.exchange(true)) return;
  log_.info(
      "llama_decode is called past the preload (a pointer from dlsym, as ctypes bindings do): ggml's graph "
      "computes count as the engine's calls instead");
}

EngineSession::DecodeScope EngineSession::decode_began(std::uintptr_t stack) noexcept {
  DecodeScope scope;
  if (forked_.load(std::memory_order_relaxed)) return scope;
  if (stack != 0 && holds_between_calls_ && options_.engine_memory) note_stack(stack);
  // Device memory is awake for the call (one engine call on each device's manager).
  if (active_devices_.load(std::memory_order_acquire) > 0) {
    scope.devices = true;
    if (log_.enabled(LogLevel::debug)) scope.began_ns = steady_ns();
    timed_device_wake("the decode's begin", [&] {
      for_each_device([&](Manager& m) {
        m.begin_call();
        if (Status st = m.unwired_status(); !st) {
          scope.device_asleep = true;
          if (!warned_device_asleep_.exchange(true, std::memory_order_relaxed))
            log_.warn("device memory could not be woken (" + st.message() +
                      "): the decode is refused with an error rather than run on unmapped memory; the next one tries "
                      "again (said once)");
        }
      });
    });
  }
  Host* h = active_host();
  Manager* m = host_.load(std::memory_order_acquire);
  if (h == nullptr || m == nullptr) return scope;
  // Buffers ggml made since the last flush (a compute buffer that grew): registered first.
  if (h->buffers.has_pending()) {
    MutexLock lock(mu_);
    drain_locked();
    flush_locked("buffers made since the last decode", false);
  }
  // This decode wires what was released: the engine memory is snapshot again after it, not
  // wired as it was (part of it may be unmapped since).
  if (holds_between_calls_ && !m->wants_resident()) {
    MutexLock lock(mu_);
    drain_locked();
    drop_engine_memory_locked();
  }
  // What the program's memory calls changed is applied before anything is wired again.
  if (!events_.empty()) settle();
  m->begin_call();  // lock-free while resident; re-wires when the keep-alive released it
  scope.host = true;
  return scope;
}

void EngineSession::decode_ended(DecodeScope scope, void* ctx) noexcept {
  if (scope.host) {
    Manager* m = host_.load(std::memory_order_acquire);
    // Under keep-alive 0 the manager waits for the decode (llama_synchronize) before it releases.
    m->end_call(ctx != nullptr ? options_.synchronize : nullptr, ctx);
    if (holds_between_calls_) {
      const std::uint32_t n = decodes_since_wire_.fetch_add(1, std::memory_order_relaxed) + 1;
      if (SessionRules::snapshot_after(n)) {
        MutexLock lock(mu_);
        Host* h = active_locked();
        if (h != nullptr && options_.engine_memory && h->buffers.holds_weights() && m->wants_resident()) {
          // From here every new mapping is reported: what the snapshot reads of the maps and
          // then locks must not have become the program's meanwhile (applied after it).
          snapshotting_.store(true, std::memory_order_seq_cst);
          drain_locked();
          h->memory.snapshot(held_extents_locked(), engine_owned_locked(),
                             n == 1 ? "after a decode" : "after more decodes");
          drain_locked();
          snapshotting_.store(false, std::memory_order_seq_cst);
          snapshots_.fetch_add(1, std::memory_order_relaxed);
        } else {
          drain_locked();
        }
      }
    }
  }
  // Under keep-alive 0 the manager waits for the decode's kernels before the memory goes (the
  // backend also synchronizes the device before it unmaps).
  if (scope.devices && scope.began_ns != 0) {
    const std::int64_t woke = device_woke_ns_.exchange(0, std::memory_order_relaxed);
    if (woke != 0) {
      const std::int64_t now = steady_ns();
      log_.debug("timeline: the first decode after the wake returned " + ms_between(woke, now) +
                 " after the wake ended (" + ms_between(scope.began_ns, now) + " after the decode began)");
    }
  }
  if (scope.devices)
    for_each_device([&](Manager& dm) {
      dm.end_call(ctx != nullptr ? options_.synchronize : nullptr, ctx);
      // What could not wake is tried again at the next decode: released now, so that it wakes.
      if (scope.device_asleep) dm.release_now();
    });
}

// ---- Device memory ----

void EngineSession::device_access() noexcept {
  if (forked_.load(std::memory_order_relaxed)) return;
  timed_device_wake("a use outside a decode (an upload)", [&] { for_each_device([](Manager& m) { m.access(); }); });
}

template <typename F>
void EngineSession::timed_device_wake(const char* what, F&& wake) noexcept {
  if (!log_.enabled(LogLevel::debug)) {
    wake();
    return;
  }
  bool asleep = false;
  for_each_device([&](Manager& m) { asleep = asleep || !m.wants_resident(); });
  const std::int64_t t0 = steady_ns();
  wake();
  if (!asleep) return;
  const std::int64_t t1 = steady_ns();
  device_woke_ns_.store(t1, std::memory_order_relaxed);
  log_.debug(std::string("timeline: ") + what + " found device memory asleep and woke it in " + ms_between(t0, t1));
}

EngineSession::DeviceAllocation EngineSession::device_allocate(int device, std::size_t size, bool compute) noexcept {
  using Outcome = DeviceAllocation::Outcome;
  if (forked_.load(std::memory_order_relaxed) || size < SessionRules::kMinRoutedDeviceBytes || device < 0 ||
      device >= SessionRules::kMaxDevices)
    return {};
  if (devices_[static_cast<std::size_t>(device)].state.load(std::memory_order_acquire) == Side::pass_through) return {};
  MutexLock lock(mu_);
  drain_locked();
  Manager* m = device_locked(device);
  if (m == nullptr) return {};
  // ggml's graph allocator makes the compute buffers: dropped at sleep, nothing copied. The rest
  // (weights, and the KV cache a server reuses after an idle pause) is copied to the host backup.
  auto a = m->allocate(size, compute ? RegionClass::scratch : RegionClass::weights);
  if (!a) {
    if (a.status().code() == ErrorCode::out_of_memory) return {Outcome::out_of_memory, nullptr};
    if (!warned_device_refusal_) {
      warned_device_refusal_ = true;
      log_.warn(device_name(device) + ": " + a.message() + kWithoutDevice);
    }
    return {};
  }
  try {
    routed_.emplace(a->ptr, device);
  } catch (...) {
    (void)m->deallocate(a->ptr);
    return {};
  }
  return {Outcome::routed, a->ptr};
}

bool EngineSession::device_free(void* ptr) noexcept {
  if (ptr == nullptr || active_devices_.load(std::memory_order_acquire) == 0) return false;
  MutexLock lock(mu_);
  drain_locked();
  const auto it = routed_.find(ptr);
  if (it == routed_.end()) return false;
  Manager* m = devices_[static_cast<std::size_t>(it->second)].manager.load(std::memory_order_relaxed);
  routed_.erase(it);
  for (Tracked& t : tracked_) {
    if (t.begin.load(std::memory_order_relaxed) != reinterpret_cast<std::uintptr_t>(ptr)) continue;
    t.begin.store(0, std::memory_order_release);
    t.end.store(0, std::memory_order_relaxed);
    tracked_count_.fetch_sub(1, std::memory_order_acq_rel);
  }
  // Like cudaFree, waits for the device to finish with the memory first (the backend
  // synchronizes before it unmaps).
  (void)m->deallocate(ptr);
  return true;
}

void EngineSession::forked() noexcept { forked_.store(true, std::memory_order_relaxed); }

void EngineSession::device_weights_buffer(std::uintptr_t base, std::size_t size) noexcept {
  if (base == 0 || size == 0 || forked_.load(std::memory_order_relaxed) ||
      active_devices_.load(std::memory_order_acquire) == 0)
    return;
  MutexLock lock(mu_);
  drain_locked();
  const auto it = routed_.find(reinterpret_cast<void*>(base));
  if (it == routed_.end()) return;
  Manager* m = devices_[static_cast<std::size_t>(it->second)].manager.load(std::memory_order_relaxed);
  if (m == nullptr) return;
  Tracked* slot = nullptr;
  for (Tracked& t : tracked_) {
    const std::uintptr_t b = t.begin.load(std::memory_order_relaxed);
    if (b == base) return;  // tracked already
    if (b == 0 && slot == nullptr) slot = &t;
  }
  if (slot == nullptr) return;  // kMaxTracked ranges tracked: this one copies everything at each sleep
  // Reported from here on; the backend counts everything before as written.
  slot->end.store(base + size, std::memory_order_relaxed);
  slot->device.store(it->second, std::memory_order_relaxed);
  slot->begin.store(base, std::memory_order_release);
  tracked_count_.fetch_add(1, std::memory_order_acq_rel);
  m->track_writes(reinterpret_cast<void*>(base));
}

EngineSession::TrackedRanges EngineSession::tracked_ranges() const noexcept {
  TrackedRanges out;
  if (!tracks_device_writes()) return out;
  for (const Tracked& t : tracked_) {
    const std::uintptr_t b = t.begin.load(std::memory_order_acquire);
    if (b == 0) continue;
    out.r_[out.n_++] = {b, t.end.load(std::memory_order_relaxed)};
  }
  return out;
}

void EngineSession::device_written(std::uintptr_t begin, std::uintptr_t end) noexcept {
  if (begin >= end || !tracks_device_writes()) return;
  for (const Tracked& t : tracked_) {
    const std::uintptr_t b = t.begin.load(std::memory_order_acquire);
    if (b == 0) continue;
    const std::uintptr_t e = t.end.load(std::memory_order_relaxed);
    if (end <= b || begin >= e) continue;
    Manager* m = device_manager(t.device.load(std::memory_order_relaxed));
    if (m == nullptr) continue;
    const std::uintptr_t from = std::max(begin, b);
    m->written(reinterpret_cast<const void*>(from), std::min(end, e) - from);
  }
}

}  // namespace residency::preload
