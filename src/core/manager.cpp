// SPDX-License-Identifier: MIT
// The residency manager: a thin facade that composes the concerns below, each in its own unit.
//
//   RegionTable     regions by id and address, lock-free last-use stamps (region_table.hpp)
//   WiredBudget     the limit, the bytes admitted under it, who waits (wired_budget.hpp)
//   ResidencySets   the sets as the backend holds them, batched commits (residency_sets.hpp)
//   Limits          the backend's memory limits and the peers' warnings (limits.hpp)
//   PressurePolicy  graded release under pressure and its hysteresis (pressure_policy.hpp)
//   KeepAliveState  what the policy wants now, and touch()'s hot path (keep_alive.hpp)
//   KeepAliveScheduler  the heartbeat that sleeps until its deadline (keep_alive_scheduler.hpp)
//   ledger::Ledger  this manager's share of a machine-wide budget (src/ledger/ledger.hpp)
//   StateFile       what `residency stat --pid` reads: a snapshot per state change (state_file.hpp)
//
// Shared budget rule: the ledger holds at least what the backend has wired, plus what is about to
// be: bytes are reserved there before a commit or request can wire them (admit(), wire()) and
// given back after the backend unwired them (settle_shared() after every flush and release).
//
// Lock rule: one mutex (`mu`) guards everything but the atomics of KeepAliveState and the
// stamps of RegionTable; the backend is called with it held (the backend locks for itself as
// well: it is shared with the other managers of the process).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <thread>

#include "keep_alive.hpp"
#include "keep_alive_scheduler.hpp"
#include "ledger/ledger.hpp"
#include "limits.hpp"
#include "log.hpp"
#include "pressure_policy.hpp"
#include "region_table.hpp"
#include "residency/residency.hpp"
#include "residency_sets.hpp"
#include "set_layout.hpp"
#include "state_file.hpp"
#include "wired_budget.hpp"

namespace residency {

using core::KeepAliveScheduler;
using core::Region;

namespace {
// Managers with a shared budget that are alive, for the exit handler. Never destroyed: exit()
// may run it after other statics are gone.
std::mutex& exit_mu() {
  static auto* m = new std::mutex;
  return *m;
}
std::set<Manager::Impl*>& exit_registry() {
  static auto* s = new std::set<Manager::Impl*>;
  return *s;
}
void release_shared_at_exit();
}  // namespace

struct Manager::Impl {
  Impl(ManagerOptions& o, const Capabilities& c, core::Limits l, const MemoryInfo& mem,
       std::unique_ptr<ledger::Ledger> shared_ledger)
      : config(o.config),
        backend(std::move(o.backend)),
        caps(c),
        clock(o.clock ? o.clock : &SteadyClock::instance()),
        log(o.log ? std::move(o.log) : core::stderr_log(o.config), o.config.log_level),
        limits(std::move(l)),
        shared(std::move(shared_ledger)),
        ka(o.config.keep_alive, *clock,
           shared ? core::KeepAliveState::Publisher{&ledger::Ledger::publish_last_use, shared.get()}
                  : core::KeepAliveState::Publisher{}),
        sets(*backend, core::SetLayout(o.config.layout, o.config.set_max_pct, mem.recommended_working_set, c.max_sets),
             log),
        pressure(o.config.pressure_floor ? o.config.pressure_floor->resolve(limits.initial_wired_limit()) : 0,
                 o.config.pressure_quiet) {
    budget.set_limit(limits.initial_wired_limit());
  }

  // Immutable after create().
  const Config config;
  const std::shared_ptr<Backend> backend;
  const Capabilities caps;
  Clock* const clock;
  const core::LogSink log;
  core::Limits limits;  // its warn-once flags change under mu
  // The machine-wide budget, if configured; its calls are made under mu (held() is ours).
  const std::unique_ptr<ledger::Ledger> shared;

  core::KeepAliveState ka;  // atomics; written under mu

  mutable std::mutex mu;
  // Everything below is guarded by mu.
  core::RegionTable regions;
  core::WiredBudget budget;
  core::ResidencySets sets;
  core::PressurePolicy pressure;
  int batch_depth = 0;
  bool ever_released = false;
  bool prefetch_requested = false;  // prefetch(): wire on the scheduler thread
  bool warned_reserve = false;
  bool warned_shared = false, warned_shared_problem = false;
  bool shared_full = false;  // an acquire came back short in this call: do not ask again until flush
  bool exiting = false;      // the process is exiting (exit_release ran): nothing is wired again
  const int owner_pid = ::getpid();  // the process that made the manager (exit_release: see there)
  std::uint64_t shared_gave_back = 0, shared_short = 0;
  Nanos next_refresh{0};
  std::uint64_t releases = 0, rewires = 0, wire_failures = 0, release_failures = 0, pressure_releases = 0,
                pressure_restores = 0;
  Nanos rewire_time{0};
  // For the state file: the last release and re-wire, in wall-clock seconds (0: none yet).
  double last_release_at = 0, last_rewire_at = 0;
  std::string last_release_reason;
  Nanos last_rewire_dt{0};
  std::uint64_t last_rewire_bytes = 0;
  std::string pressure_src;  // what release on pressure watches, if it does
  std::unique_ptr<core::StateFile> state;  // config.state_file: published on state changes
  // A change other than a release or a re-wire (a registration, a limit) is written at most once
  // per kStateCoalesce, by the scheduler: an engine that registers 10,000 regions writes a few
  // snapshots, not 10,000 (each one visits every region and renames a file).
  static constexpr Nanos kStateCoalesce = std::chrono::milliseconds(50);
  bool state_dirty = false;
  Nanos state_due{0};
  std::optional<Nanos> state_written;
  std::unique_ptr<KeepAliveScheduler> scheduler;
  std::optional<PressureWatchId> pressure_watch;

  // --- membership -------------------------------------------------------------------------

  // Puts a region into a set if it fits the budget and the backend's hard limit. False: it
  // stays pending.
  bool admit(Region& r) {
    if (r.admitted || !budget.fits(r.desc.size)) return false;
    if (!reserve_shared(r.desc.size)) {
      note_shared_short(r.desc.size);
      return false;
    }
    if (Status s = backend->reserve_wired(r.desc.size); !s) {
      log(warned_reserve ? LogLevel::debug : LogLevel::warn,
          "region " + std::to_string(r.desc.id) + " (" + core::mib(r.desc.size) + ") stays tracked but unwired: " + s.message());
      warned_reserve = true;
      return false;
    }
    auto slot = sets.add(r.desc);
    if (!slot) {
      backend->unreserve_wired(r.desc.size);
      log(LogLevel::warn, slot.message() + "; the region stays tracked but unwired");
      r.eligible = false;
      return false;
    }
    r.admitted = true;
    r.set_slot = *slot;
    budget.admitted_region(r.desc.id, r.desc.size);
    return true;
  }

  void evict(Region& r) {
    if (!r.admitted) return;
    sets.remove(r.set_slot, r.desc);
    backend->unreserve_wired(r.desc.size);
    budget.evicted_region(r.desc.id, r.desc.size);
    r.admitted = false;
  }

  std::vector<core::BudgetEntry> entries_of(bool admitted) {
    std::vector<core::BudgetEntry> v;
    auto add = [&](Region& r) {
      v.push_back({r.desc.id, r.desc.size, r.priority, regions.last_use(r), r.admitted, r.eligible, r.desc.cls});
    };
    if (admitted) {
      regions.for_each([&](Region& r) {
        if (r.admitted) add(r);
      });
    } else {
      for (RegionId id : budget.pending())
        if (Region* r = regions.find(id)) add(*r);
    }
    return v;
  }

  void promote() {
    if (!ka.managing() || budget.pending().empty()) return;
    const auto entries = entries_of(false);
    for (RegionId id : core::choose_promotions(entries, budget.admitted(), budget.effective_limit()))
      if (Region* r = regions.find(id)) admit(*r);
  }

  // Evicts until admitted bytes fit the effective limit; returns the bytes evicted.
  // Under pressure (by_class) scratch goes first, then kv_cache, then weights, and nothing that
  // would take the admitted bytes below `floor`.
  std::uint64_t shrink_to_limit(bool by_class = false, std::uint64_t floor = 0) {
    if (budget.admitted() <= budget.effective_limit()) return 0;
    const std::uint64_t before = budget.admitted();
    const auto entries = entries_of(true);
    for (RegionId id : core::choose_evictions(entries, budget.admitted(), budget.effective_limit(), by_class, floor))
      if (Region* r = regions.find(id)) evict(*r);
    return before - budget.admitted();
  }

  // One step of graded release (see pressure_policy.hpp).
  void pressure_step() {
    std::uint64_t cap = pressure.on_pressure(clock->now(), budget.admitted());
    budget.set_cap(cap);
    std::uint64_t released = 0;
    {
      Guard batch(*this);
      released = shrink_to_limit(/*by_class=*/true, pressure.floor());
    }
    // Regions are released whole: when the next one would cross the floor the cap is not met,
    // and the budget holds at what stays (so that no later eviction for the cap crosses it).
    if (budget.admitted() > cap) {
      cap = budget.admitted();
      budget.set_cap(cap);
    }
    if (released == 0) {
      log(LogLevel::debug, "memory pressure: nothing more to give back (" + core::mib(budget.admitted()) +
                               " wired, floor " + core::mib(pressure.floor()) + ")");
    } else {
      ++pressure_releases;
      log(LogLevel::info, "released " + core::mib(released) + " under memory pressure (scratch, then kv_cache, then weights); " +
                              core::mib(budget.admitted()) + " stay wired (floor " + core::mib(pressure.floor()) +
                              "); the budget stays at " + core::mib(cap) + " until pressure has been quiet for " +
                              KeepAlive::after(pressure.quiet()).to_string());
    }
    if (scheduler) scheduler->wake_locked();  // the cap's lift is a deadline now
  }

  // After a quiet period the cap rises: entirely when the machine has room for everything (or
  // the backend cannot tell), else to what is admitted plus what is available less a headroom,
  // the rest after further quiet periods (pressure_policy.hpp). What waits is admitted (and
  // wired, if resident) again.
  void lift_pressure_cap_if_quiet(Nanos now) {
    if (!pressure.quiet_at(now)) return;
    const std::uint64_t before = budget.admitted();
    const std::uint64_t wanted = std::min(regions.tracked_bytes(), budget.limit());
    const std::optional<std::uint64_t> avail = wanted > before ? backend->memory_available() : std::nullopt;
    const std::uint64_t room = avail ? (*avail > core::kLiftHeadroom ? *avail - core::kLiftHeadroom : 0) : UINT64_MAX;
    const bool all = room >= wanted - std::min(wanted, before);
    if (all) {
      pressure.lift();
      budget.set_cap(UINT64_MAX);
    } else {
      pressure.raise_to(before + room, now);
      budget.set_cap(pressure.cap());
    }
    {
      Guard batch(*this);
      promote();
    }
    if (all) {
      ++pressure_restores;
      log(LogLevel::info, "memory pressure has been quiet: the budget is back to " + core::mib(budget.limit()) + ", " +
                              core::mib(budget.admitted() - before) + " admitted again");
    } else {
      // Once per change, not once per quiet period while the other program keeps its memory.
      log(budget.admitted() > before ? LogLevel::info : LogLevel::debug,
          "memory pressure has been quiet, but only " + core::mib(avail.value_or(0)) + " is available: " +
                              core::mib(budget.admitted() - before) + " admitted again, " +
                              core::mib(budget.admitted()) + " of " + core::mib(wanted) +
                              " wired; the rest when memory allows (checked every " +
                              KeepAlive::after(pressure.quiet()).to_string() + ")");
    }
  }

  // Regions the backend could not wire leave their set and wait, out of the budget's way.
  void on_failure(const SetOutcome& out, const char* what) {
    std::uint64_t bytes = 0;
    for (RegionId id : out.failed) {
      Region* r = regions.find(id);
      if (!r) continue;
      bytes += r->desc.size;
      evict(*r);
      r->eligible = false;
    }
    wire_failures += out.failed.size();
    std::string msg = std::string(what) + " failed";
    if (!out.failed.empty())
      msg += " for " + std::to_string(out.failed.size()) + " region(s), " + core::mib(bytes) +
             "; they stay tracked but unwired and the process goes on";
    if (!out.status.is_ok()) msg += ": " + out.status.message();
    log(LogLevel::warn, msg);
  }

  void flush() {
    if (batch_depth > 0) return;
    sets.flush(ka.resident(), [this](const SetOutcome& o, const char* w) { on_failure(o, w); });
    settle_shared();
    shared_full = false;
    state_changed();
  }

  // Under mu: the snapshot is out of date. With a scheduler it is written within
  // kStateCoalesce; without one, now if the last write is that old, else at a later change.
  void state_changed() {
    if (!state) return;
    const Nanos now = clock->now();
    if (scheduler) {
      if (state_dirty) return;
      state_dirty = true;
      state_due = now + kStateCoalesce;
      scheduler->wake_locked();  // due() writes it at state_due
      return;
    }
    state_dirty = true;
    if (!state_written || now - *state_written >= kStateCoalesce) publish_state();
  }

  // --- state file -------------------------------------------------------------------------

  static double wall_now() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  }

  // Writes the snapshot `residency stat --pid` shows (state_file.hpp). Under mu, after a change
  // of membership, residency or budget: never from touch()'s fast path.
  void publish_state() {
    if (!state) return;
    state_dirty = false;
    state_written = clock->now();
    std::uint64_t tracked[3] = {0, 0, 0}, wired[3] = {0, 0, 0};
    const bool requested = sets.requested_bytes() > 0;
    regions.for_each([&](Region& r) {
      const auto c = static_cast<std::size_t>(r.desc.cls);
      if (c >= 3) return;
      tracked[c] += r.desc.size;
      if (r.admitted && requested) wired[c] += r.desc.size;
    });
    std::string b;
    auto put = [&b](const char* k, const std::string& v) {
      std::string line = v;
      for (char& ch : line)
        if (ch == '\n' || ch == '\r') ch = ' ';
      b += std::string(k) + "=" + line + "\n";
    };
    auto num = [&](const char* k, std::uint64_t v) { put(k, std::to_string(v)); };
    auto secs = [&](const char* k, double v) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.3f", v);
      put(k, buf);
    };
    put("backend", caps.name);
    put("keep_alive", config.keep_alive.to_string());
    num("resident", ka.resident() ? 1 : 0);
    put("wired_limit", budget.limit() == UINT64_MAX ? std::string("unlimited") : std::to_string(budget.limit()));
    num("wired_bytes", sets.requested_bytes());
    num("tracked_bytes", regions.tracked_bytes());
    num("admitted_bytes", budget.admitted());
    num("regions", regions.size());
    for (std::size_t c = 0; c < 3; ++c) {
      const std::string cls = to_string(static_cast<RegionClass>(c));
      put(("tracked." + cls).c_str(), std::to_string(tracked[c]));
      put(("wired." + cls).c_str(), std::to_string(wired[c]));
    }
    num("releases", releases);
    num("rewires", rewires);
    num("wire_failures", wire_failures);
    if (last_release_at > 0) {
      secs("last_release_at", last_release_at);
      put("last_release_reason", last_release_reason);
    }
    if (last_rewire_at > 0) {
      secs("last_rewire_at", last_rewire_at);
      secs("last_rewire_ms", std::chrono::duration<double, std::milli>(last_rewire_dt).count());
      num("last_rewire_bytes", last_rewire_bytes);
    }
    num("release_on_pressure", config.release_on_pressure ? 1 : 0);
    if (!pressure_src.empty()) put("pressure_source", pressure_src);
    if (budget.cap() != UINT64_MAX) num("pressure_cap", budget.cap());
    if (shared) {
      put("shared_budget", shared->name());
      num("shared_budget_size", shared->budget());
      num("shared_held", shared->held());
      put("shared_priority", std::to_string(config.shared_priority));
    }
    if (!state->publish(b))
      if (std::string why = state->why_not(); !why.empty()) log(LogLevel::warn, why);
  }

  // --- shared budget ----------------------------------------------------------------------

  // What the ledger must hold for this manager now: while the policy wants the memory resident,
  // everything admitted (wired, or wired at the next commit); otherwise what the backend still has.
  std::uint64_t shared_needed() const {
    const std::uint64_t requested = sets.requested_bytes();
    return ka.resident() ? std::max(budget.admitted(), requested) : requested;
  }

  // Reserves room for `more` bytes on top of what is needed, before they can be wired. Asks idle
  // holders (and waits for them, boundedly) once per call; false: the region must wait.
  bool reserve_shared(std::uint64_t more) {
    if (!shared || !ka.resident()) return true;
    if (exiting) return false;
    const std::uint64_t target = shared_needed() + more;
    if (shared->held() >= target) return true;
    const std::uint64_t need = target - shared->held();
    if (shared->acquire(need, shared_full ? Nanos(0) : ledger::kAskWait, /*partial=*/false) == need) return true;
    shared_full = true;
    return false;
  }

  // After the backend unwired: gives back what is no longer needed.
  void settle_shared() {
    if (!shared) return;
    const std::uint64_t need = shared_needed();
    if (shared->held() > need) shared->release(shared->held() - need);
  }

  void note_shared_short(std::uint64_t bytes) {
    ++shared_short;
    const std::uint64_t used_by_us = shared->held();
    if (!shared->problem().empty()) {  // not full: the ledger could not be used just now
      log(warned_shared_problem ? LogLevel::debug : LogLevel::warn,
          "shared budget " + shared->name() + ": " + shared->problem() + "; " + core::mib(bytes) +
              " stays tracked but unwired (this process holds " + core::mib(used_by_us) +
              " of the budget); it is wired at a later use once the ledger answers");
      warned_shared_problem = true;
      return;
    }
    log(warned_shared ? LogLevel::debug : LogLevel::warn,
        "shared budget " + shared->name() + " (" + core::mib(shared->budget()) + ") is full: " + core::mib(bytes) +
            " stays tracked but unwired (this process holds " + core::mib(used_by_us) +
            " of it; no idle holder of priority <= " + std::to_string(config.shared_priority) +
            " could give back). It is wired at the next use after room appears; `residency stat` lists the holders");
    warned_shared = true;
  }

  // wire(): reserves what is admitted before requesting it; what the ledger cannot give leaves
  // the sets (least valuable first) and waits, as over a local wired limit.
  void reserve_shared_for_wire() {
    if (!shared) return;
    const std::uint64_t need = budget.admitted();
    if (shared->held() >= need) return;
    if (!exiting) shared->acquire(need - shared->held(), shared_full ? Nanos(0) : ledger::kAskWait, /*partial=*/true);
    if (shared->held() >= need) return;
    shared_full = true;
    const std::uint64_t before = budget.admitted();
    const auto entries = entries_of(true);
    for (RegionId id : core::choose_evictions(entries, budget.admitted(), shared->held()))
      if (Region* r = regions.find(id)) evict(*r);
    // Commit the removals now, before request_all(): a backend requests what a set holds as
    // committed, and would lock the regions just evicted until the next commit.
    sets.flush(/*request=*/false, [this](const SetOutcome& o, const char* w) { on_failure(o, w); });
    note_shared_short(before - budget.admitted());
  }

  // Another process needs room (on the ledger's thread): give everything back if this manager is
  // really idle (no scope open, no use for ledger::kIdleBeforeAsked), as its keep-alive would.
  void on_asked(int asker) {
    std::unique_lock<std::mutex> g(mu, std::defer_lock);
    // A busy manager (in a call) declines; a short wait rides out a stats() or a brief call.
    for (int i = 0; i < 20 && !g.try_lock(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (!g.owns_lock()) return;
    const Nanos idle = Nanos(ka.now_coarse() - ka.last_use());
    if (!ka.managing() || ka.scopes > 0 || !ka.resident() || idle < ledger::kIdleBeforeAsked) {
      settle_shared();
      return;
    }
    ++shared_gave_back;
    release_now(("asked by process " + std::to_string(asker) + ": shared budget " + shared->name() + " is full; idle for " +
                 core::ms(idle) + "; the next use wires it again")
                    .c_str());
  }

  // At exit, for a manager nobody destroyed (the preload leaks its own on purpose): unwire, give
  // the share back and leave the ledger, so that the last holder to exit removes it. Device
  // memory (backend allocations) is left to the driver: ending its residency would copy it out.
  // If the manager is busy, or device memory is held, the slot stays and the next process that
  // takes the ledger's lock reclaims it once this one is gone.
  void exit_release() {
    // A fork child that calls exit() inherits this registry: the manager and its share are the
    // parent's, and nothing of them is touched here (no release, no false "released" line).
    if (::getpid() != owner_pid) return;
    std::unique_lock<std::mutex> g(mu, std::defer_lock);
    for (int i = 0; i < 100 && !g.try_lock(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (!g.owns_lock()) return;
    exiting = true;
    bool device = false;
    regions.for_each([&](Region& r) { device = device || r.desc.backend_allocated; });
    if (!device && sets.requested_bytes() > 0) {
      ka.set_resident(false);
      core::heavy_fence();
      release("the process is exiting");
    }
    settle_shared();
    shared->detach_at_exit();
  }

  // --- residency --------------------------------------------------------------------------

  void wire(const char* why) {
    const Nanos t0 = clock->now();
    ka.set_resident(true);
    reserve_shared_for_wire();
    // What waits may fit now: another manager of the process may have given back its share of
    // the hard limit since.
    promote();
    const auto [bytes, n] = sets.request_all([this](const SetOutcome& o, const char* w) { on_failure(o, w); });
    flush();
    next_refresh = clock->now() + caps.refresh_period;
    if (ever_released && n > 0) {  // memory that had been given back was asked for again
      const Nanos dt = clock->now() - t0;
      ++rewires;
      rewire_time += dt;
      last_rewire_at = wall_now();
      last_rewire_dt = dt;
      last_rewire_bytes = bytes;
      log(LogLevel::info, "re-wired " + core::mib(bytes) + " in " + std::to_string(n) + " set(s) in " + core::ms(dt) + " (" +
                              why + ")");
    }
    if (ever_released && n > 0) publish_state();  // flush() published before the re-wire was counted
    if (scheduler) scheduler->wake_locked();
  }

  // Gives the sets back; the caller has already marked the memory as not resident. A set the
  // backend could not give back stays requested (and counted as wired), and the log says so.
  void release(const char* why) {
    const Nanos t0 = clock->now();
    const auto r = sets.end_all();
    if (r.sets > 0) backend->after_release();
    settle_shared();
    ever_released = true;
    last_release_at = wall_now();
    last_release_reason = why;
    if (r.failed == 0) {
      ++releases;
      publish_state();
      log(LogLevel::info, "released " + core::mib(r.bytes) + " in " + std::to_string(r.sets) + " set(s) in " +
                              core::ms(clock->now() - t0) + " (" + why + ")");
      return;
    }
    ++release_failures;
    if (r.sets > 0) ++releases;
    publish_state();
    log(LogLevel::warn, "could not release " + std::to_string(r.failed) + " set(s) (" + why + "): " + r.status.message() + "; " +
                            core::mib(sets.requested_bytes()) + " stay wired, " + core::mib(r.bytes) + " released");
  }

  // A release the policy did not time (pressure, the engine's request, the end of a 0 scope).
  void release_now(const char* why) {
    ka.set_resident(false);
    core::heavy_fence();  // a touch() in flight either sees it and re-wires, or is already past
    release(why);
  }

  // The scheduler's work: prefetch, the pressure cap's lift, expiry and refresh. Returns the next
  // deadline.
  std::optional<Nanos> due() {
    if (prefetch_requested) {
      prefetch_requested = false;
      if (ka.rewires_on_use() && !ka.resident()) wire("prefetch");
    }
    lift_pressure_cap_if_quiet(clock->now());
    const std::optional<Nanos> lift = pressure.lifts_at();
    auto next = residency_due();
    if (lift) next = next ? std::min(*next, *lift) : *lift;
    if (state_dirty && clock->now() >= state_due) publish_state();
    if (state_dirty) next = next ? std::min(*next, state_due) : state_due;
    return next;
  }

  std::optional<Nanos> residency_due() {
    if (!ka.managing() || !ka.resident()) return std::nullopt;
    const Nanos now = clock->now();
    std::optional<Nanos> next;
    if (ka.kind() == KeepAlive::Kind::duration && ka.scopes == 0) {
      const std::int64_t lu = ka.last_use();
      const Nanos expiry = ka.expiry(lu);
      if (now >= expiry) {
        if (ka.begin_release_unless_used(lu)) {
          release(("keep-alive " + config.keep_alive.to_string() + " expired").c_str());
          return std::nullopt;  // nothing scheduled until the next use: zero wake-ups
        }
        return ka.expiry(ka.last_use());
      }
      next = expiry;
    }
    if (caps.needs_refresh && caps.refresh_period.count() > 0) {
      if (now >= next_refresh) {
        sets.refresh_all([this](const SetOutcome& o, const char* w) { on_failure(o, w); });
        flush();
        next_refresh = now + caps.refresh_period;
      }
      next = next ? std::min(*next, next_refresh) : next_refresh;
    }
    return next;
  }

  Stats stats() const {
    Stats s;
    s.tracked_bytes = regions.tracked_bytes();
    s.admitted_bytes = budget.admitted();
    s.wired_bytes = sets.requested_bytes();
    s.pending_bytes = s.tracked_bytes - s.admitted_bytes;
    s.wired_limit = budget.limit();
    s.regions = static_cast<std::uint32_t>(regions.size());
    s.sets = sets.live_sets();
    s.resident = s.wired_bytes > 0;
    s.commits = sets.commits();
    s.residency_requests = sets.requests();
    s.releases = releases;
    s.rewires = rewires;
    s.rewire_time = rewire_time;
    s.scheduler_wakeups = scheduler ? scheduler->wakeups() : 0;
    s.wire_failures = wire_failures;
    s.release_failures = release_failures;
    s.pressure_releases = pressure_releases;
    s.pressure_restores = pressure_restores;
    s.pressure_cap = budget.cap();
    if (shared) {
      s.shared_budget = shared->budget();
      s.shared_held = shared->held();
      s.shared_asks = shared->asks_sent();
      s.shared_gave_back = shared_gave_back;
      s.shared_short = shared_short;
    }
    return s;
  }

  // Opens a batch for the duration of one public call.
  struct Guard {
    Impl& impl;
    explicit Guard(Impl& i) : impl(i) { ++impl.batch_depth; }
    ~Guard() {
      if (--impl.batch_depth == 0) impl.flush();
    }
  };

  Result<RegionId> register_locked(const RegionDesc& d, int priority) {
    if (Status s = limits.check_track(regions.tracked_bytes(), d.size); !s) return s;
    auto inserted = regions.insert(d, priority, ka.now_coarse());
    if (!inserted) return inserted.status();
    Region& r = **inserted;
    if (log.enabled(LogLevel::debug)) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "allocated buffer, size = %8.2f MiB, (%8.2f / %8.2f)",
                    static_cast<double>(d.size) / (1024.0 * 1024.0),
                    static_cast<double>(regions.tracked_bytes()) / (1024.0 * 1024.0),
                    static_cast<double>(limits.recommended()) / (1024.0 * 1024.0));
      log(LogLevel::debug, buf);
    }
    limits.warn_if_over_recommended(regions.tracked_bytes(), log);
    if (!ka.managing()) return r.desc.id;
    if (!admit(r)) {
      budget.add_pending(r.desc.id);
      if (log.enabled(LogLevel::debug))
        log(LogLevel::debug, "region " + std::to_string(r.desc.id) + " (" + core::mib(d.size) + ") is over the wired limit " +
                                 core::mib(budget.limit()) + " (" + core::mib(budget.admitted()) +
                                 " admitted): tracked but not wired");
    }
    // Registration is a use: the engine is loading the model.
    ka.note_use();
    if (ka.rewires_on_use() && !ka.resident()) wire("new region");
    if (scheduler) scheduler->wake_locked();
    return r.desc.id;
  }

  Status unregister_locked(Region& r) {
    Guard batch(*this);
    // Free backend memory first: leaving the set first would make the backend end its
    // residency, i.e. copy device weights to host just before they are thrown away.
    if (r.desc.backend_allocated) backend->deallocate(r.desc.base);
    evict(r);
    budget.forget(r.desc.id);
    regions.erase(r.desc.id);
    promote();  // unlike MLX, freeing wired memory makes room for what waits
    return {};
  }
};

// ------------------------------------------------------------------------------------------

Manager::Manager(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<Manager>> Manager::create(ManagerOptions o) {
  if (!o.backend) return Status(ErrorCode::invalid_argument, "ManagerOptions::backend is null; pass make_backend(\"auto\")");
  const Capabilities caps = o.backend->capabilities();
  const MemoryInfo mem = o.backend->memory_info();
  const bool managing = o.config.keep_alive.kind != KeepAlive::Kind::off;
  const core::LogSink early(o.log ? o.log : core::stderr_log(o.config), o.config.log_level);
  auto limits = core::Limits::resolve(o.config, mem, caps.name, managing, early);
  if (!limits) return limits.status();
  std::unique_ptr<ledger::Ledger> shared;
  if (o.config.shared_budget && managing) {
    const SharedBudget& sb = *o.config.shared_budget;
    if (sb.size.is_percent && mem.physical == 0)
      return Status(ErrorCode::invalid_argument, "RESIDENCY_SHARED_BUDGET=" + sb.to_string() + ": a percent of RAM, but the " +
                                                     caps.name + " backend does not know the physical memory; give bytes");
    ledger::AttachOptions ao;
    ao.name = sb.name;
    ao.budget = sb.size.resolve(mem.physical);
    ao.group = sb.group;
    ao.priority = o.config.shared_priority;
    auto l = ledger::Ledger::attach(ao);
    if (!l) return l.status();
    shared = std::move(*l);
  }
  auto impl = std::make_unique<Impl>(o, caps, std::move(*limits), mem, std::move(shared));
  Impl& m = *impl;
  m.ka.set_resident(m.ka.rewires_on_use());

  for (const auto& note : m.config.notes) m.log(LogLevel::info, note);
  const std::uint64_t limit = m.budget.limit();
  m.log(LogLevel::info, "creating a residency set collection (keep_alive = " + m.config.keep_alive.to_string() +
                            ", layout = " + to_string(m.config.layout) + ", wired limit = " +
                            (limit == UINT64_MAX ? std::string("unlimited") : core::mib(limit)) + ", backend = " + caps.name + ")");
  if (managing && limit == 0) {
    m.log(LogLevel::info, "use residency sets = false (wired limit = 0: nothing is wired until set_wired_limit() raises it)");
  } else if (managing) {
    m.log(LogLevel::info, "use residency sets = true");
  } else {
    m.log(LogLevel::info, "use residency sets = false (keep_alive = off: residency is not managed)");
  }

  if (m.shared) {
    m.log(LogLevel::info, "shared budget " + m.shared->name() + " = " + core::mib(m.shared->budget()) + " (ledger " +
                              m.shared->path() + ", priority " + std::to_string(m.config.shared_priority) + ")");
    if (m.shared->requested_budget() != 0)
      m.log(LogLevel::warn, "shared budget " + m.shared->name() + " exists with " + core::mib(m.shared->budget()) +
                                "; this process asked for " + core::mib(m.shared->requested_budget()) +
                                ": the ledger's size stays (the first process sets it)");
    Impl* raw = &m;
    m.shared->listen([raw](int asker) { raw->on_asked(asker); });
    static std::once_flag registered;
    std::call_once(registered, [] { std::atexit(release_shared_at_exit); });
    std::lock_guard<std::mutex> g(exit_mu());
    exit_registry().insert(raw);
  }

  if (o.start_scheduler && managing) {
    Impl* raw = &m;
    m.scheduler = std::make_unique<KeepAliveScheduler>(*m.clock, m.mu, [raw] { return raw->due(); });
    m.scheduler->start();
  }
  auto mgr = std::unique_ptr<Manager>(new Manager(std::move(impl)));
  if (m.config.release_on_pressure && managing) {
    Manager* self = mgr.get();
    auto id = m.backend->watch_pressure([self] { self->notify_memory_pressure(); });
    if (id) {
      m.pressure_watch = *id;
      if (std::string src = m.backend->pressure_source(); !src.empty()) {
        m.log(LogLevel::info, "watching memory pressure: " + src);
        std::lock_guard<std::mutex> g(m.mu);
        m.pressure_src = src;
      }
    } else {
      m.log(LogLevel::warn, "release_on_pressure is set but " + id.message() + "; call notify_memory_pressure() yourself");
    }
  }
  if (m.config.state_file) {
    std::lock_guard<std::mutex> g(m.mu);
    m.state = std::make_unique<core::StateFile>();
    m.publish_state();
  }
  return mgr;
}

Manager::~Manager() {
  Impl& m = *impl_;
  if (m.shared) {
    std::lock_guard<std::mutex> g(exit_mu());
    exit_registry().erase(&m);
  }
  if (m.shared) m.shared->stop_listening();  // no ask is answered from here on
  if (m.pressure_watch) m.backend->stop_pressure_watch(*m.pressure_watch);
  if (m.scheduler) m.scheduler->stop();
  std::lock_guard<std::mutex> g(m.mu);
  if (m.regions.size() != 0) {
    m.log(LogLevel::warn, std::to_string(m.regions.size()) + " region(s), " + core::mib(m.regions.tracked_bytes()) +
                              ", still registered at teardown; releasing them (not an error)");
  }
  // Backend memory first (no pointless copy-out of device weights), then the sets.
  m.regions.for_each([&](Region& r) {
    if (r.desc.backend_allocated) m.backend->deallocate(r.desc.base);
  });
  const bool any_requested = m.sets.requested_bytes() > 0;
  if (Status s = m.sets.destroy_all(); !s) m.log(LogLevel::warn, "at teardown: " + s.message());
  if (any_requested) m.backend->after_release();
  if (m.budget.admitted() > 0) m.backend->unreserve_wired(m.budget.admitted());
  if (m.shared) m.shared->release(m.shared->held());  // after the sets are gone: nothing is wired
  m.state.reset();  // removes the file
}

Result<RegionId> Manager::register_region(void* base, std::size_t size, RegionClass cls, int priority,
                                          void* backend_object) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> g(m.mu);
  Impl::Guard batch(m);
  RegionDesc d;
  d.base = base;
  d.size = size;
  d.cls = cls;
  d.backend_object = backend_object;
  return m.register_locked(d, priority);
}

Result<Allocation> Manager::allocate(std::size_t size, RegionClass cls, int priority) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> g(m.mu);
  if (size == 0) return Status(ErrorCode::invalid_argument, "allocate: size is 0");
  Impl::Guard batch(m);
  Result<void*> p = m.backend->allocate(size, cls);
  if (!p) return p.status();
  RegionDesc d;
  d.base = *p;
  d.size = size;
  d.cls = cls;
  d.backend_allocated = true;
  auto id = m.register_locked(d, priority);
  if (!id) {
    m.backend->deallocate(*p);
    return id.status();
  }
  return Allocation{*id, *p};
}

Status Manager::unregister_region(RegionId id) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> g(m.mu);
  Region* r = m.regions.find(id);
  if (!r) return Status(ErrorCode::not_found, "unregister_region: no region with id " + std::to_string(id) + " is tracked");
  return m.unregister_locked(*r);
}

Status Manager::unregister_address(void* base) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> g(m.mu);
  Region* r = m.regions.find_address(base);
  if (!r) return Status(ErrorCode::not_found, "unregister_address: no tracked region starts at this address");
  return m.unregister_locked(*r);
}

Status Manager::deallocate(void* ptr) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> g(m.mu);
  Region* r = m.regions.find_address(ptr);
  if (!r || !r->desc.backend_allocated)
    return Status(ErrorCode::not_found, std::string("deallocate: this pointer was not returned by allocate()") +
                                            (r ? "; it is a registered region: use unregister_address()" : ""));
  return m.unregister_locked(*r);
}

Status Manager::set_wired_limit(std::uint64_t bytes) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> g(m.mu);
  auto limit = m.limits.check_wired_limit(bytes, m.backend->memory_info(), m.log);
  if (!limit) return limit.status();
  Impl::Guard batch(m);
  m.budget.set_limit(*limit);
  m.regions.for_each([](Region& r) { r.eligible = true; });  // a new limit: try again what failed
  m.shrink_to_limit();
  m.promote();
  return {};
}

std::uint64_t Manager::wired_limit() const {
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->budget.limit();
}

namespace {
void release_shared_at_exit() {
  std::lock_guard<std::mutex> g(exit_mu());
  for (Manager::Impl* m : exit_registry()) m->exit_release();
}

// The slow path of touch(): the memory was released; wire it again before the caller computes.
[[gnu::noinline]] void rewire_after_release(Manager::Impl& m);
}  // namespace

void Manager::touch() noexcept {
  Impl& m = *impl_;
  if (m.ka.touch()) rewire_after_release(m);
}

void Manager::touch(RegionId id) noexcept {
  Impl& m = *impl_;
  const std::int64_t t = m.ka.now_coarse();  // one clock read for both stamps
  m.regions.touch(id, t);
  if (m.ka.touch_at(t)) rewire_after_release(m);
}

namespace {
void rewire_after_release(Manager::Impl& m) {
  std::lock_guard<std::mutex> g(m.mu);
  if (!m.ka.resident()) m.wire("touch after release");
}
}  // namespace

void Manager::prefetch() noexcept {
  Impl& m = *impl_;
  m.ka.note_use();
  if (!m.ka.rewires_on_use() || m.ka.resident()) return;
  std::lock_guard<std::mutex> g(m.mu);
  if (m.ka.resident()) return;
  m.prefetch_requested = true;
  if (m.scheduler) m.scheduler->wake_locked();
}

UseScope Manager::use(std::function<void()> synchronize) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> g(m.mu);
  if (!m.ka.managing()) return UseScope(this, std::move(synchronize), Status());
  ++m.ka.scopes;
  m.ka.note_use();
  if (!m.ka.resident()) m.wire("use scope");
  if (m.ka.kind() == KeepAlive::Kind::zero) m.limits.warn_if_scope_large(m.budget.admitted(), m.log);
  Status st;
  const std::uint64_t tracked = m.regions.tracked_bytes(), wired = m.sets.requested_bytes();
  if (wired < tracked)
    st = Status(ErrorCode::limit_exceeded, format_size(tracked - wired) + " of " + format_size(tracked) +
                                               " tracked is not wired (over the wired limit of " + format_size(m.budget.limit()) +
                                               " or refused by the backend)");
  return UseScope(this, std::move(synchronize), std::move(st));
}

void Manager::notify_memory_pressure() {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> g(m.mu);
  if (!m.config.release_on_pressure) {
    m.log(LogLevel::debug, "memory pressure reported; release_on_pressure is off, keeping residency");
    return;
  }
  if (!m.ka.managing() || m.ka.scopes > 0) return;
  m.pressure_step();
}

void Manager::release_now() {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> g(m.mu);
  if (!m.ka.managing() || !m.ka.resident()) return;
  if (m.ka.scopes > 0) {
    m.log(LogLevel::warn, "release_now: " + std::to_string(m.ka.scopes) + " use scope(s) still open; not releasing");
    return;
  }
  m.release_now("asked by the engine");
}

Batch Manager::batch() {
  std::lock_guard<std::mutex> g(impl_->mu);
  ++impl_->batch_depth;
  return Batch(this);
}

Batch::~Batch() {
  if (manager_) (void)manager_->end_batch();
}

void Manager::begin_batch() {
  std::lock_guard<std::mutex> g(impl_->mu);
  ++impl_->batch_depth;
}

Status Manager::end_batch() {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> g(m.mu);
  if (m.batch_depth == 0) return Status(ErrorCode::invalid_argument, "end_batch: no batch is open (begin_batch first)");
  if (--m.batch_depth == 0) m.flush();
  return {};
}

std::optional<Nanos> Manager::run_due() {
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->due();
}

Stats Manager::stats() const {
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->stats();
}

const Config& Manager::config() const { return impl_->config; }
Capabilities Manager::backend_capabilities() const { return impl_->caps; }
Backend& Manager::backend() { return *impl_->backend; }

// --- UseScope ----------------------------------------------------------------------------

UseScope::UseScope(Manager* m, std::function<void()> sync, Status st)
    : manager_(m), synchronize_(std::move(sync)), status_(std::move(st)) {}

UseScope::UseScope(UseScope&& o) noexcept
    : manager_(o.manager_), synchronize_(std::move(o.synchronize_)), status_(std::move(o.status_)) {
  o.manager_ = nullptr;
}

UseScope& UseScope::operator=(UseScope&& o) noexcept {
  if (this != &o) {
    end();
    manager_ = o.manager_;
    synchronize_ = std::move(o.synchronize_);
    status_ = std::move(o.status_);
    o.manager_ = nullptr;
  }
  return *this;
}

UseScope::~UseScope() { end(); }

void UseScope::end() {
  if (!manager_) return;
  Manager* mgr = manager_;
  manager_ = nullptr;
  // The GPU may still be reading: wait for it before anything can be released (mlx-lm
  // synchronizes before restoring the wired limit for the same reason).
  if (synchronize_) synchronize_();
  Manager::Impl& m = *mgr->impl_;
  std::lock_guard<std::mutex> g(m.mu);
  if (!m.ka.managing()) return;
  if (m.ka.scopes > 0) --m.ka.scopes;
  m.ka.note_use();
  if (m.ka.scopes == 0 && m.ka.kind() == KeepAlive::Kind::zero && m.ka.resident()) {
    m.release_now("end of use (keep_alive = 0)");
  } else if (m.scheduler) {
    m.scheduler->wake_locked();
  }
}

}  // namespace residency
