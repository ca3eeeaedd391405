// SPDX-License-Identifier: MIT
// The residency manager: a facade that locks and delegates. Each decision lives in its unit:
//
//   Admission       which regions are in a set, under every budget (admission.hpp): RegionTable,
//                   WiredBudget, ResidencySets, Limits
//   BudgetShare     this manager's share of a machine-wide budget, the one unit that talks to the
//                   ledger (budget_share.hpp); Admission owns it, the manager asks through its Room
//   ResidencyCycle  when the sets are wired and given back: keep-alive, engine calls, pressure,
//                   asks from other processes (residency_cycle.hpp)
//   ManagerReport   Stats and the state file `residency stat --pid` reads (manager_report.hpp)
//   KeepAliveState  what the policy wants now, and the lock-free hot path (keep_alive.hpp)
//   KeepAliveScheduler  the heartbeat that sleeps until its deadline (keep_alive_scheduler.hpp)
//
// Lock rule: one mutex (`mu`) guards everything but the atomics of KeepAliveState and the stamps
// of RegionTable; the units it guards say so (RESIDENCY_GUARDED_BY), and clang checks it. The
// backend is called with it held (the backend locks for itself as well: it is shared with the
// other managers of the process). It is never held while waiting on another process: a
// reservation in the shared budget is tried under it with no wait, and when the budget is full
// the other holders are asked, and waited for, with it released (make_room(), BudgetShare::Room,
// whose waiting calls do not compile with it held).
#include "residency/residency.hpp"

#include <unistd.h>

#include <chrono>
#include <mutex>
#include <thread>

#include "admission.hpp"
#include "budget_share.hpp"
#include "exit_hooks.hpp"
#include "host_tier.hpp"
#include "keep_alive.hpp"
#include "keep_alive_scheduler.hpp"
#include "limits.hpp"
#include "log.hpp"
#include "manager_report.hpp"
#include "platform/thread_annotations.hpp"
#include "residency_cycle.hpp"
#include "set_layout.hpp"
#include "thread_calls.hpp"

namespace residency {

using core::Region;

// How many times an allocation that failed for want of device memory asks the other holders of its
// budget to sleep and tries again.
constexpr int kOutOfMemoryRetries = 3;

struct Manager::Impl {
  Impl(ManagerOptions& o, Clock& clk, const Capabilities& c, core::Limits limits, const MemoryInfo& mem,
       core::BudgetShare::Joined joined, std::uint64_t pressure_floor)
      : config(o.config),
        backend(std::move(o.backend)),
        caps(c),
        clock(&clk),
        log(o.log ? std::move(o.log) : core::stderr_log(o.config), o.config.log_level),
        host(c.registers_files && o.config.keep_alive.manages() ? core::HostTier::join(o.config, clk, log) : nullptr),
        last_use{core::BudgetShare::publisher(joined), host ? host->publisher() : core::LastUsePublisher{}},
        ka(o.config.keep_alive, *clock, last_use.publisher()),
        room(core::BudgetShare::room(joined, *clock)),
        adm(*backend, log, ka, std::move(limits),
            core::SetLayout(o.config.layout, o.config.set_max_pct, mem.recommended_working_set, c.max_sets),
            joined ? std::make_unique<core::BudgetShare>(std::move(joined), o.config.shared_priority, c.paced_wake,
                                                         *clock, log, o.config.budget_wait)
                   : nullptr),
        cycle(config, caps, *clock, log, ka, adm, *backend, pressure_floor),
        report(config, caps, *this->backend, *clock, log, ka, adm, cycle) {
    adm.on_change([this] {
      mu.assert_held();  // Admission calls it from a flush, and the admission is guarded by mu
      if (report.changed()) wake_scheduler();
    });
    cycle.on_published([this] {
      mu.assert_held();  // the cycle calls it after a release or a re-wire, and the cycle is guarded by mu
      report.publish();
    });
  }

  // Immutable after create().
  const Config config;
  const std::shared_ptr<Backend> backend;
  const Capabilities caps;
  Clock* const clock;
  const core::LogSink log;
  const int owner_pid = ::getpid();  // the process that made the manager (exit_release)
  // The host tier (docs/design.md, "The host tier"): the model files the backend keeps registered
  // count against a host budget; null when the backend registers none or the tier is off. The
  // backend's host gate shares it.
  const std::shared_ptr<core::HostTier> host;
  // The time of last use goes into each ledger this manager holds a slot of.
  struct LastUse {
    core::LastUsePublisher share, host;
    static void both(void* ctx, std::int64_t t) noexcept {
      const LastUse& u = *static_cast<const LastUse*>(ctx);
      if (u.share.fn) u.share.fn(u.share.ctx, t);
      if (u.host.fn) u.host.fn(u.host.ctx, t);
    }
    core::LastUsePublisher publisher() {
      if (!host.fn) return share;
      if (!share.fn) return host;
      return {&LastUse::both, this};
    }
  } last_use;

  core::KeepAliveState ka;  // atomics; written under mu
  // The waiting face of adm's share of a shared budget (none without one): asks the other holders
  // with mu released.
  const std::optional<core::BudgetShare::Room> room;
  mutable Mutex mu;
  core::Admission adm RESIDENCY_GUARDED_BY(mu);
  core::ResidencyCycle cycle RESIDENCY_GUARDED_BY(mu);
  core::ManagerReport report RESIDENCY_GUARDED_BY(mu);
  // Which calls are whose (core::ThreadCalls): this manager's number there, the calls begun on a
  // thread that had no slot left, and whether a stray end_call() was said already.
  const std::uint64_t serial = next_serial();
  std::atomic<int> untracked_calls{0};
  std::atomic<bool> said_stray_end{false};
  static std::uint64_t next_serial() noexcept {
    static std::atomic<std::uint64_t> last{0};
    return last.fetch_add(1, std::memory_order_relaxed) + 1;
  }
  void call_began_on_this_thread() noexcept {
    if (!core::ThreadCalls::began(serial)) untracked_calls.fetch_add(1, std::memory_order_relaxed);
  }
  // False: this thread holds no call of this manager open (and no untracked one is left).
  bool call_ended_on_this_thread() noexcept {
    if (core::ThreadCalls::ended(serial)) return true;
    int n = untracked_calls.load(std::memory_order_relaxed);
    while (n > 0 && !untracked_calls.compare_exchange_weak(n, n - 1, std::memory_order_relaxed)) {
    }
    return n > 0;
  }

  // Set by create() before any thread that uses them starts; not changed afterwards.
  std::unique_ptr<core::KeepAliveScheduler> scheduler;
  std::optional<PressureWatchId> pressure_watch;

  // At its end (once the caller's result is made), if a reservation came back short because the
  // shared budget is full, the other holders are asked and waited for (boundedly) with mu
  // released, and what waits is admitted again (make_room()).
  struct MakeRoomAtEnd {
    Impl& m;
    ~MakeRoomAtEnd() { m.make_room(); }
  };
  // mu for one call of the API, with make_room() at its end. Every call that may admit or wire
  // holds one.
  class RESIDENCY_SCOPED_CAPABILITY Locked {
   public:
    explicit Locked(Impl& m) RESIDENCY_ACQUIRE(m.mu) : lock_(m.mu), room_{m} {}
    ~Locked() RESIDENCY_RELEASE() {}
    Locked(const Locked&) = delete;
    Locked& operator=(const Locked&) = delete;

   private:
    MutexLock lock_;
    MakeRoomAtEnd room_;  // destroyed first: make_room() runs with mu held
  };
  // A wake that found the device full asks again while the holders asked give memory back (another
  // waker of a burst may take it first), for at most kOutOfMemoryRetries rounds.
  void make_room() noexcept RESIDENCY_REQUIRES(mu) {
    if (!room) return;
    for (int round = 1;; ++round) {
      // This call's: another thread may run meanwhile.
      const core::BudgetShare::RoomWanted want = adm.share()->take_room_wanted();
      if (!want.any()) break;
      std::uint64_t freed = 0;
      const Nanos asked_at = clock->now();
      mu.unlock();
      try {
        freed = room->make(want, mu);
      } catch (...) {  // out of memory: nothing more is admitted
      }
      mu.lock();
      if (log.enabled(LogLevel::debug))  // the switch's timeline: the ask, and what it got
        log(LogLevel::debug,
            "timeline: asked the holders of " + adm.share()->name() + " for " + core::mib(want.bytes) + " of room" +
                (want.device_full != 0 ? " and " + core::mib(want.device_full) + " the device lacked" : std::string()) +
                (want.in_turn ? ", waiting its turn" : "") + " (round " + std::to_string(round) + "): answered in " +
                core::ms(clock->now() - asked_at) +
                (want.device_full != 0 ? ", " + core::mib(freed) + " of device memory given back" : std::string()));
      try {
        cycle.retry(/*keep_asking=*/freed != 0 && round < kOutOfMemoryRetries);
      } catch (...) {
      }
    }
    adm.end_call();
  }
  // The scheduler's mutex is mu, which the caller holds; the analysis cannot see that they are one.
  void wake_scheduler() RESIDENCY_REQUIRES(mu) RESIDENCY_NO_THREAD_SAFETY_ANALYSIS {
    if (scheduler) scheduler->wake_locked();
  }

  Result<RegionId> register_locked(const RegionDesc& d, int priority) RESIDENCY_REQUIRES(mu) {
    adm.open_batch();
    auto r = adm.track(d, priority, ka.now_coarse());
    if (r && ka.managing()) {
      ka.note_use();  // registration is a use: the engine is loading the model
      if (ka.rewires_on_use()) cycle.rewire(core::ResidencyCycle::WireReason::new_region);
      cycle.wake_scheduler();
    }
    adm.close_batch();
    if (!r) return r.status();
    return (*r)->desc.id;
  }

  // The slow path of touch(): the memory was released, or is being released; wire it again before
  // the caller computes. A release still running is asked to stop first (the backend may keep
  // the memory it has not yet given back), so that the caller does not wait for it and a wake.
  [[gnu::noinline]] void rewire(core::ResidencyCycle::WireReason why) noexcept {
    backend->interrupt_release();
    try {
      Locked g(*this);
      cycle.rewire(why);
    } catch (...) {
    }
  }

  // Another process needs room (on the ledger's thread). A busy manager declines; a short wait
  // rides out a stats() or a brief call.
  void on_asked(int asker) {
    if (!try_lock_for(20)) return;
    MutexLock g(mu, std::adopt_lock);
    cycle.give_back_if_idle(asker,
                            core::BudgetShare::idle_before_giving_back(device_holder.load(std::memory_order_relaxed)));
  }

  // The host budget needs room (on the host tier's ledger thread): the model files' registration
  // is given back, whatever this holder's state (a registration serves only the next wake).
  void on_host_asked(int asker) {
    if (!try_lock_for(20)) return;
    MutexLock g(mu, std::adopt_lock);
    const std::uint64_t n = backend->drop_file_registrations();
    host->give_back_spare();
    if (n != 0)
      log(LogLevel::info, "host budget " + host->name() + ": gave back the registration of " + core::mib(n) +
                              " of model files (asked by pid " + std::to_string(asker) +
                              "); the kernel may evict their pages, and the next wake reads them through the "
                              "staging buffers (host tier 2)");
  }

  // The backend's allocation. When the device itself is full (the budget had room, or processes
  // outside it hold the memory), the other holders are asked to sleep and it is tried again,
  // boundedly; it fails only when nobody could give way.
  Result<void*> allocate_locked(std::size_t size, RegionClass cls) RESIDENCY_REQUIRES(mu) {
    Result<void*> p = backend->allocate(size, cls);
    for (int i = 0; i < kOutOfMemoryRetries && !p && p.status().code() == ErrorCode::out_of_memory && room; ++i) {
      mu.unlock();
      std::uint64_t freed = 0;
      try {
        freed = room->free_device_memory(size, mu);
      } catch (...) {
      }
      mu.lock();
      if (freed == 0) break;  // nobody could give way
      log(LogLevel::info, "out of device memory for " + core::mib(size) + ": the holders asked gave back " +
                              core::mib(freed) + "; allocating again");
      p = backend->allocate(size, cls);
    }
    return p;
  }

  // Device memory under a shared budget (docs/design.md, "The GPU budget"): set by the first allocate(). Such a holder
  // is asked however short its idle, and at the end of each call it looks whether the budget is
  // over (a wake over it, when every other holder was inside a call) and repays: the least
  // recently used holder sleeps until the sum fits (repay()).
  std::atomic<bool> device_holder{false};
  // At the end of a call (no call left open): a pread of the ledger; the lock only when over.
  void repay_if_over() noexcept {
    if (!device_holder.load(std::memory_order_relaxed) || ka.calls() != 0 || !ka.wants_resident()) return;
    try {
      if (room->over_budget() == 0) return;
      Locked g(*this);
      if (ka.calls() != 0 || !ka.wants_resident() || !adm.share()->repay_turn()) return;
      cycle.repay_debt(room->over_budget());
    } catch (...) {
    }
  }
  bool try_lock_for(int ms) RESIDENCY_TRY_ACQUIRE(true, mu) {
    for (int i = 0; i < ms; ++i) {
      if (mu.try_lock()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return false;
  }

  // At exit, for a manager nobody destroyed (the preload leaks its own on purpose): unwire, give
  // the share back and leave the ledger, so that the last holder to exit removes it. If the
  // manager is busy, the slot stays and the next process that takes the ledger's lock reclaims it
  // once this one is gone. A fork child that calls exit() inherits the hooks: the manager and its
  // share are the parent's, and nothing of them is touched there.
  static void exit_release(void* self) {
    Impl& m = *static_cast<Impl*>(self);
    if (::getpid() != m.owner_pid) return;
    if (!m.try_lock_for(100)) return;
    MutexLock g(m.mu, std::adopt_lock);
    if (m.room) {
      m.cycle.release_at_exit(m.adm.holds_backend_memory());
      m.adm.share()->detach_at_exit();
    }
    if (m.host) m.host->detach_at_exit();
  }

  std::optional<Nanos> due() RESIDENCY_REQUIRES(mu) {
    std::optional<Nanos> next;
    {
      MakeRoomAtEnd at_end{*this};
      next = cycle.due();
    }
    if (const auto state = report.due()) next = next ? std::min(*next, *state) : *state;
    return next;
  }

  // The stamps of touch(id) are atomics in slots that never move, written without mu by design
  // (region_table.hpp); so is the access flag read by access() (residency_cycle.hpp).
  core::RegionTable& lock_free_stamps() RESIDENCY_NO_THREAD_SAFETY_ANALYSIS { return adm.regions(); }
  bool lock_free_access_held() const RESIDENCY_NO_THREAD_SAFETY_ANALYSIS { return cycle.access_held(); }
};

// ------------------------------------------------------------------------------------------

Manager::Manager(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<Manager>> Manager::create(ManagerOptions o) {
  if (!o.backend)
    return Status(ErrorCode::invalid_argument, "ManagerOptions::backend is null; pass make_backend(\"auto\")");
  const Capabilities caps = o.backend->capabilities();
  const MemoryInfo mem = o.backend->memory_info();
  const bool managing = o.config.keep_alive.manages();
  const core::LogSink early(o.log ? o.log : core::stderr_log(o.config), o.config.log_level);
  auto limits = core::Limits::resolve(o.config, mem, caps.name, managing, early);
  if (!limits) return limits.status();
  Clock& clock = o.clock ? *o.clock : SteadyClock::instance();
  auto joined = managing ? core::BudgetShare::join(o.config, mem, caps.name) : core::BudgetShare::Joined();
  if (!joined) return joined.status();
  const std::uint64_t floor = o.config.pressure_floor ? o.config.pressure_floor->resolve(limits->initial_wired_limit())
                                                      : 0;
  auto impl = std::make_unique<Impl>(o, clock, caps, std::move(*limits), mem, std::move(*joined), floor);
  Impl& m = *impl;
  m.ka.set_wants_resident(m.ka.rewires_on_use());
  {
    MutexLock g(m.mu);  // nothing else runs yet; taken because the report is guarded by it
    m.report.log_start(managing);
  }

  if (m.room) {
    Impl* raw = &m;
    m.room->listen([raw](int asker) { raw->on_asked(asker); });
  }
  if (m.host) {
    Impl* raw = &m;
    m.backend->set_host_gate(m.host->gate());
    {
      MutexLock g(m.mu);  // the report is guarded by it
      m.report.set_host_budget(m.host->name());
    }
    m.host->listen([raw](int asker) { raw->on_host_asked(asker); });
    m.log(LogLevel::info, "host tier: the model files kept registered for fast wakes count against the host budget " +
                              m.host->name() + " (" + core::mib(m.host->budget()) +
                              "); beyond it the least recently used model wakes from its file (RESIDENCY_HOST_BUDGET)");
  }
  if (m.room || m.host) core::add_exit_hook(&m, &Impl::exit_release);
  if (o.start_scheduler && managing) {
    Impl* raw = &m;
    m.scheduler = std::make_unique<core::KeepAliveScheduler>(*m.clock, m.mu, [raw] {
      raw->mu.assert_held();  // the scheduler calls it with its mutex, mu, held
      return raw->due();
    });
    {
      MutexLock g(m.mu);
      m.cycle.set_scheduler(m.scheduler.get());
      m.report.set_scheduler(m.scheduler.get());
    }
    m.scheduler->start();
  }
  auto mgr = std::unique_ptr<Manager>(new Manager(std::move(impl)));
  std::string pressure_src;
  if (m.config.release_on_pressure && managing) {
    Manager* self = mgr.get();
    auto id = m.backend->watch_pressure([self] { self->notify_memory_pressure(); });
    if (id) {
      m.pressure_watch = *id;
      pressure_src = m.backend->pressure_source();
      if (!pressure_src.empty()) m.log(LogLevel::info, "watching memory pressure: " + pressure_src);
    } else {
      m.log(LogLevel::warn,
            "release_on_pressure is set but " + id.message() + "; call notify_memory_pressure() yourself");
    }
  }
  if (m.config.state_file) {
    MutexLock g(m.mu);
    m.report.start_state_file(pressure_src);
  }
  return mgr;
}

Manager::~Manager() {
  Impl& m = *impl_;
  if (m.room || m.host) core::remove_exit_hook(&m);
  if (m.room) m.room->stop_listening(m.mu);  // no ask is answered from here on
  if (m.host) m.host->stop_listening();
  if (m.pressure_watch) m.backend->stop_pressure_watch(*m.pressure_watch);
  if (m.scheduler) m.scheduler->stop();
  m.cycle.stop_preparation();  // its `stop` reads this manager's keep-alive state
  MutexLock g(m.mu);
  m.adm.teardown();
  if (m.host) m.backend->set_host_gate({});  // the tier's ledger is left once the backend drops the gate
  m.report.stop_state_file();                // removes the file
}

Result<RegionId> Manager::register_region(void* base, std::size_t size, RegionClass cls, int priority,
                                          void* backend_object) {
  const RegionDesc d{0, base, size, cls, /*backend_allocated=*/false, backend_object};
  Impl::Locked g(*impl_);
  return impl_->register_locked(d, priority);
}

Result<Allocation> Manager::allocate(std::size_t size, RegionClass cls, int priority) {
  Impl& m = *impl_;
  if (size == 0) return Status(ErrorCode::invalid_argument, "allocate: size is 0");
  if (m.room) {
    // Room first (docs/design.md, "The GPU budget"): reserved in the shared budget, the others asked at the end of this
    // scope when it is full, and only then allocated.
    m.device_holder.store(true, std::memory_order_relaxed);
    Impl::Locked g(m);
    (void)m.adm.reserve_ahead(size);
  }
  struct Ahead {  // the reservation ends with this call, taken over by the region or not
    Impl& m;
    std::size_t size;
    ~Ahead() RESIDENCY_NO_THREAD_SAFETY_ANALYSIS {
      m.adm.end_ahead(size);  // mu is held: Ahead is destroyed before g
    }
  };
  Impl::Locked g(m);
  Ahead ahead{m, size};
  // A strict budget: no room within the wait, no allocation (a full GPU is never overcommitted).
  if (!m.adm.ahead_covered()) return Status(ErrorCode::out_of_memory, m.adm.share()->refusal(size));
  Result<void*> p = m.allocate_locked(size, cls);
  if (!p) return p.status();
  auto id = m.register_locked(RegionDesc{0, *p, size, cls, /*backend_allocated=*/true, nullptr}, priority);
  if (!id) {
    m.backend->deallocate(*p);
    return id.status();
  }
  return Allocation{*id, *p};
}

Status Manager::unregister_region(RegionId id) {
  Impl::Locked g(*impl_);
  return impl_->adm.untrack_id(id);
}

Status Manager::unregister_address(void* base) {
  Impl::Locked g(*impl_);
  return impl_->adm.untrack_address(base);
}

Status Manager::deallocate(void* ptr) {
  Impl::Locked g(*impl_);
  return impl_->adm.untrack_allocation(ptr);
}

void Manager::track_writes(void* ptr) noexcept {
  if (ptr != nullptr) impl_->backend->track_writes(ptr);
}

void Manager::written(const void* addr, std::size_t bytes) noexcept {
  if (addr != nullptr && bytes != 0) impl_->backend->written(addr, bytes);
}

void Manager::filled_from_file(const void* addr, std::size_t bytes, int fd, std::uint64_t offset) noexcept {
  if (addr != nullptr && bytes != 0) impl_->backend->filled_from_file(addr, bytes, fd, offset);
}

Status Manager::set_wired_limit(std::uint64_t bytes) {
  Impl& m = *impl_;
  Impl::Locked g(m);
  auto limit = m.adm.limits().check_wired_limit(bytes, m.backend->memory_info(), m.log);
  if (!limit) return limit.status();
  m.adm.set_limit(*limit);
  return {};
}

std::uint64_t Manager::wired_limit() const {
  MutexLock g(impl_->mu);
  return impl_->adm.budget().limit();
}

void Manager::touch() noexcept {
  Impl& m = *impl_;
  if (m.ka.touch()) m.rewire(core::ResidencyCycle::WireReason::touch);
}

void Manager::touch(RegionId id) noexcept {
  Impl& m = *impl_;
  const std::int64_t t = m.ka.now_coarse();  // one clock read for both stamps
  m.lock_free_stamps().touch(id, t);
  if (m.ka.touch_at(t)) m.rewire(core::ResidencyCycle::WireReason::touch);
}

// Lock-free under a duration or forever while resident; under 0 counted with the lock.
void Manager::begin_call() noexcept {
  Impl& m = *impl_;
  m.call_began_on_this_thread();
  if (m.ka.rewires_on_use()) {
    m.ka.call_began();
    if (m.ka.touch()) m.rewire(core::ResidencyCycle::WireReason::touch);
    return;
  }
  if (!m.ka.managing()) return;
  try {
    Impl::Locked g(m);
    m.cycle.begin_call(core::ResidencyCycle::WireReason::use_scope);
  } catch (...) {  // out of memory building a log line: the call goes on
  }
}

// A stray end (this thread holds no call of this manager open: more ends than begins here) is
// ignored, whatever other threads hold open; said once per manager.
void Manager::end_call(void (*synchronize)(void*), void* ctx) noexcept {
  Impl& m = *impl_;
  if (m.call_ended_on_this_thread()) return end_counted_call(synchronize, ctx);
  if (m.said_stray_end.exchange(true, std::memory_order_relaxed)) return;
  try {
    m.log(LogLevel::warn,
          "end_call() on a thread that holds no call of this manager open (more ends than begins there): ignored; a "
          "call's begin_call() and end_call() belong on one thread (a use scope may end on any; said once)");
  } catch (...) {
  }
}

// The end of a call that was counted: end_call()'s own, or a use scope's from any thread.
void Manager::end_counted_call(void (*synchronize)(void*), void* ctx) noexcept {
  Impl& m = *impl_;
  if (m.ka.rewires_on_use()) {
    // The use lasted until now: the keep-alive counts from the end of the call.
    if (m.ka.touch()) m.rewire(core::ResidencyCycle::WireReason::touch);
    if (m.ka.call_ended() == 0) m.repay_if_over();
    return;
  }
  if (!m.ka.managing()) return;
  // The GPU may still be reading: wait for it before anything can be released.
  if (synchronize) synchronize(ctx);
  try {
    Impl::Locked g(m);
    m.cycle.end_call();
  } catch (...) {
  }
}

bool Manager::wants_resident() const noexcept { return impl_->ka.wants_resident(); }

void Manager::access() noexcept {
  Impl& m = *impl_;
  if (m.ka.rewires_on_use()) {
    touch();
    return;
  }
  if (!m.ka.managing() || m.lock_free_access_held()) return;
  try {
    Impl::Locked g(m);
    m.cycle.access();
  } catch (...) {
  }
}

void Manager::prefetch() noexcept {
  Impl& m = *impl_;
  m.ka.note_use();
  if (!m.ka.rewires_on_use() || m.ka.wants_resident()) return;
  MutexLock g(m.mu);
  if (!m.ka.wants_resident()) m.cycle.request_prefetch();
}

UseScope Manager::use(std::function<void()> synchronize) {
  Impl& m = *impl_;
  if (!m.ka.managing()) return UseScope(this, std::move(synchronize), Status());
  begin_call();
  (void)m.call_ended_on_this_thread();  // the scope holds the call now, and may end it on any thread
  MutexLock g(m.mu);
  return UseScope(this, std::move(synchronize), m.adm.unwired_status());
}

void Manager::notify_memory_pressure() {
  MutexLock g(impl_->mu);
  impl_->cycle.on_pressure();
}

void Manager::release_now() {
  MutexLock g(impl_->mu);
  (void)impl_->cycle.release_by_engine();
}

Status Manager::unwired_status() const {
  MutexLock g(impl_->mu);
  return impl_->adm.unwired_status();
}

Batch Manager::batch() {
  begin_batch();
  return Batch(this);
}

void Manager::begin_batch() {
  MutexLock g(impl_->mu);
  impl_->adm.open_batch();
}

Status Manager::end_batch() {
  Impl::Locked g(*impl_);
  if (impl_->adm.batch_depth() == 0)
    return Status(ErrorCode::invalid_argument, "end_batch: no batch is open (begin_batch first)");
  impl_->adm.close_batch();
  return {};
}

std::optional<Nanos> Manager::run_due() {
  MutexLock g(impl_->mu);
  return impl_->due();
}

Stats Manager::stats() const {
  MutexLock g(impl_->mu);
  return impl_->report.stats();
}

const Config& Manager::config() const { return impl_->config; }
Capabilities Manager::backend_capabilities() const { return impl_->caps; }
Backend& Manager::backend() { return *impl_->backend; }

}  // namespace residency
