// SPDX-License-Identifier: MIT
// residency: keep an inference engine's model memory resident while requests flow, give it
// back after an idle keep-alive or under memory pressure, never exceed a budget.
//
// The Manager tracks regions (weights, KV cache, scratch), groups them into sets that a
// Backend makes resident as a unit, admits into those sets only what fits the wired budget,
// and drives residency by a keep-alive policy. The one design decision that shapes it: the
// engine's hot path is touch(), a coarse clock read, one relaxed store and one relaxed load
// (a few nanoseconds), and all the timing work is done by a scheduler thread that sleeps until
// its next deadline, so an idle process is woken zero times (llama.cpp's heartbeat wakes 200
// times a second, forever).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>

#include "residency/backend.hpp"
#include "residency/clock.hpp"
#include "residency/config.hpp"
#include "residency/stats_fields.h"
#include "residency/status.hpp"

namespace residency {

using LogCallback = std::function<void(LogLevel level, std::string_view message)>;
// Writes "residency[<pid>]: <level>: <message>" lines to stderr, each with one write(2), so that
// lines of several threads or processes never interleave. With `with_time` (RESIDENCY_LOG_TIME=1)
// the local time follows the pid: "residency[1234]: YYYY-MM-DD hh:mm:ss.mmm info: ...". A line starts
// on a fresh line where that can be known: when stderr is a regular file whose last byte is not a
// newline (a host program's partial line), a newline goes first. On a terminal or a pipe what
// others wrote last cannot be read back, so there a line follows a partial one on the same line.
void log_to_stderr(LogLevel level, std::string_view message);
void log_to_stderr(LogLevel level, std::string_view message, bool with_time);

struct ManagerOptions {
  Config config;
  std::shared_ptr<Backend> backend;  // required; shared so it outlives every manager using it
  Clock* clock = nullptr;            // default: SteadyClock::instance(); must outlive the manager
  LogCallback log;                   // default: log_to_stderr (with config.log_time), filtered by config.log_level
  bool start_scheduler = true;       // false: nothing runs on its own; call run_due() (tests)
};

// The manager's statistics: one member per field of residency/stats_fields.h (the list the C
// struct residency_stats is made from too; there each field's meaning). In C++ the flag is a bool
// and rewire_time a Nanos (the C struct's rewire_time_ns); pressure_cap starts at UINT64_MAX (none).
struct Stats {
#define RESIDENCY_STATS_CPP_TYPE_U64 std::uint64_t
#define RESIDENCY_STATS_CPP_TYPE_U32 std::uint32_t
#define RESIDENCY_STATS_CPP_TYPE_FLAG bool
#define RESIDENCY_STATS_CPP_TYPE_NS Nanos
#define RESIDENCY_STATS_CPP_FIELD_(TYPE, name, cpp_default) RESIDENCY_STATS_CPP_TYPE_##TYPE name{cpp_default};
  RESIDENCY_STATS_FIELDS(RESIDENCY_STATS_CPP_FIELD_)
#undef RESIDENCY_STATS_CPP_FIELD_
#undef RESIDENCY_STATS_CPP_TYPE_U64
#undef RESIDENCY_STATS_CPP_TYPE_U32
#undef RESIDENCY_STATS_CPP_TYPE_FLAG
#undef RESIDENCY_STATS_CPP_TYPE_NS
};

class Manager;

// RAII use of the memory: resident from construction to destruction. At destruction the
// caller's synchronize function runs first (wait for the GPU), then, under keep-alive 0, the
// memory is released when the last scope ends. Under other policies a scope counts as a use
// that lasts as long as the scope. The manager must outlive its scopes.
class UseScope {
 public:
  UseScope() = default;
  UseScope(UseScope&& o) noexcept;
  UseScope& operator=(UseScope&& o) noexcept;
  UseScope(const UseScope&) = delete;
  UseScope& operator=(const UseScope&) = delete;
  ~UseScope();
  // Status of the wiring done when the scope began (ok when the memory is resident).
  const Status& status() const { return status_; }

 private:
  friend class Manager;
  UseScope(Manager* m, std::function<void()> sync, Status st);
  void end();
  Manager* manager_ = nullptr;
  std::function<void()> synchronize_;
  Status status_;
};

// RAII batch: membership changes made while a batch is open are committed once per touched
// set when the (outermost) batch ends, instead of once per call.
class Batch {
 public:
  Batch(Batch&& o) noexcept : manager_(o.manager_) { o.manager_ = nullptr; }
  Batch(const Batch&) = delete;
  Batch& operator=(const Batch&) = delete;
  Batch& operator=(Batch&&) = delete;
  ~Batch();

 private:
  friend class Manager;
  explicit Batch(Manager* m) : manager_(m) {}
  Manager* manager_ = nullptr;
};

struct Allocation {
  RegionId id = 0;
  void* ptr = nullptr;
};

// Thread safety: every method may be called from any thread. A manager's state is guarded by one
// mutex; touch() and touch(id) take it only when memory must be re-wired. Several managers in one
// process (two models in one server) share the process's backend and its limits: a page two of
// them lock stays locked until both let it go, and RLIMIT_MEMLOCK is split between them.
class Manager {
 public:
  // Validates the configuration against the backend (a wired limit above the recommended
  // working set is an error), logs the start-up lines and starts the scheduler.
  static Result<std::unique_ptr<Manager>> create(ManagerOptions options);
  // Stops the scheduler at once, releases every set and reports regions still registered
  // as a warning. Never aborts.
  ~Manager();
  Manager(const Manager&) = delete;
  Manager& operator=(const Manager&) = delete;

  // Tracks [base, base+size). Admitted into a set if it fits the wired budget, else pending.
  // Registration counts as a use (the engine is loading the model). Errors: size 0, overlap
  // with a tracked region, tracked bytes over the memory limit.
  Result<RegionId> register_region(void* base, std::size_t size, RegionClass cls = RegionClass::weights,
                                   int priority = 0, void* backend_object = nullptr);
  // Allocates backend memory (e.g. CUDA device memory at a stable address) and registers it.
  Result<Allocation> allocate(std::size_t size, RegionClass cls = RegionClass::weights, int priority = 0);
  // Stops tracking (and frees, for allocate()d regions). Pending regions that now fit are
  // promoted into sets.
  Status unregister_region(RegionId id);
  // The same, for the region that starts at `base` (what an engine that keeps pointers has).
  Status unregister_address(void* base);
  // Frees memory that allocate() returned, by its pointer. Error for any other pointer.
  Status deallocate(void* ptr);
  // Write tracking for memory that allocate() returned (Backend::track_writes): an engine that
  // sees every write into the allocation at `ptr` says so once, then reports each write before it
  // happens with written(). A release then copies back only what was written since the last one
  // (for weights: nothing), where the backend can. Without it every wake counts as a write of the
  // whole allocation. Both take no lock of the manager's; unknown addresses are ignored.
  void track_writes(void* ptr) noexcept;
  void written(const void* addr, std::size_t bytes) noexcept;
  // A write whose source is the bytes at `offset` of the file open as `fd` (borrowed): where the
  // backend can, that range's backup is the file itself (Backend::filled_from_file). No lock.
  void filled_from_file(const void* addr, std::size_t bytes, int fd, std::uint64_t offset) noexcept;

  // Changes the budget: adds what now fits (highest priority, then most recently used) or
  // removes until under it (lowest priority, least recently used first); one commit per
  // touched set. Above the recommended working set is an error.
  Status set_wired_limit(std::uint64_t bytes);
  std::uint64_t wired_limit() const;

  // The hot path, once per graph compute: lock-free, no system call while the memory is
  // resident; re-wires synchronously when it was released. Uses are stamped with a coarse clock:
  // the keep-alive expires at most one timer tick (1-4 ms on Linux) late, never early.
  void touch() noexcept;
  // touch(), and marks one region as just used, so that when the budget must choose, the least
  // recently used regions are the engine's real ones. Lock-free; an unknown id only counts as
  // touch().
  void touch(RegionId id) noexcept;
  // Around one engine call (a decode, a graph compute): begin_call() before it, end_call() after.
  // This is the one entry the preload (host and device memory) and use scopes go through, so that
  // every policy is decided here. Duration and forever: a use at both ends (the keep-alive counts
  // from the end of the last call and never expires during one), lock-free while resident, and a
  // synchronous re-wire at the start when the memory was released. 0: resident from the first
  // begin to the last end, then released, after `synchronize(ctx)` has waited for the device
  // (called only under 0). Off: nothing. Every begin_call() needs one end_call(), on the same
  // thread: an end_call() on a thread that holds no call of this manager open (more ends than
  // begins there) is a stray end, ignored with one warning, even while other threads' calls are in
  // flight. A use scope (use()) may end on any thread.
  void begin_call() noexcept;
  void end_call(void (*synchronize)(void* ctx) = nullptr, void* ctx = nullptr) noexcept;
  // A use of the memory outside a call (an upload before the decode that reads it): a use under a
  // duration or forever; under 0, resident from now until the end of the next call.
  void access() noexcept;
  // Lock-free: whether the keep-alive holds the memory now. False after a release (the keep-alive
  // expired, pressure, another process asked, release_now()) until a use wires it again, and
  // always under keep-alive 0 and off. An engine whose registered memory may have changed while
  // released (memory it does not allocate itself) refreshes it when this is false, before the
  // call that wires it.
  bool wants_resident() const noexcept;
  // Asks for the memory to be wired again in the background (on the scheduler thread) and
  // returns at once: call it when a request arrives, before tokenizing, so that the re-wire
  // overlaps work the engine does anyway; the touch() before the first compute then finds it
  // done (or finishes it). No-op when resident or when the policy wires only in scopes.
  void prefetch() noexcept;
  // Resident for the scope's life; see UseScope.
  UseScope use(std::function<void()> synchronize = {});
  // The system reports memory pressure: with release_on_pressure, give back one step (scratch,
  // then kv_cache, then weights by priority and least recent use) down to the configured floor,
  // except while a use scope is open. The reduced budget stays until no pressure has been
  // reported for Config::pressure_quiet; then what was given back is wired again.
  void notify_memory_pressure();
  // Gives residency back now, whatever the policy (an engine going to sleep).
  void release_now();
  // ok when everything tracked is wired (for memory the backend allocated, a GPU's: mapped and
  // awake); else what is not, and why. An engine must not compute on device memory that is not.
  Status unwired_status() const;

  Batch batch();
  // The same without RAII (the C API): every begin_batch() needs one end_batch(); an end
  // without a begin is an error.
  void begin_batch();
  Status end_batch();

  // For start_scheduler == false: does what is due at clock->now() (expiry, refresh) and
  // returns the next deadline, or nullopt when nothing is scheduled.
  std::optional<Nanos> run_due();

  Stats stats() const;
  const Config& config() const;
  Capabilities backend_capabilities() const;
  Backend& backend();

  struct Impl;

 private:
  friend class UseScope;
  friend class Batch;
  explicit Manager(std::unique_ptr<Impl> impl);
  // end_call() without its thread's check: a use scope's end, on whichever thread ends it.
  void end_counted_call(void (*synchronize)(void* ctx), void* ctx) noexcept;
  std::unique_ptr<Impl> impl_;
};

}  // namespace residency
