// SPDX-License-Identifier: MIT
#include "residency_cycle.hpp"

#include <algorithm>
#include <chrono>
#include <string_view>

#include "budget_share.hpp"

namespace residency::core {

namespace {
double wall_now() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }
}  // namespace

ResidencyCycle::ResidencyCycle(const Config& config, const Capabilities& caps, Clock& clock, const LogSink& log,
                               KeepAliveState& ka, Admission& admission, Backend& backend, std::uint64_t pressure_floor)
    : config_(config),
      caps_(caps),
      clock_(clock),
      log_(log),
      ka_(ka),
      adm_(admission),
      backend_(backend),
      pressure_(pressure_floor, config.pressure_quiet) {}

// --- engine events ------------------------------------------------------------------------

const char* ResidencyCycle::words(WireReason why) {
  switch (why) {
    case WireReason::new_region: return "new region";
    case WireReason::touch: return "touch after release";
    case WireReason::use_scope: return "use scope";
    case WireReason::access: return "access outside a call";
    case WireReason::prefetch: return "prefetch";
  }
  return "wire";
}

void ResidencyCycle::begin_call(WireReason why) {
  if (!ka_.wires_only_in_use()) {
    rewire(why);
    return;
  }
  ka_.call_began();
  ka_.note_use();
  if (!ka_.wants_resident()) wire(why);
  adm_.limits().warn_if_scope_large(adm_.budget().admitted(), log_);
}

void ResidencyCycle::end_call() {
  int left = ka_.call_ended();
  ka_.note_use();
  if (access_held() && left == 1) {  // only the access's hold is left: it ends with this call
    access_held_.store(false, std::memory_order_relaxed);
    left = ka_.call_ended();
  }
  if (left == 0 && ka_.wants_resident()) {
    release_now({ReleaseKind::engine, "end of use (keep_alive = 0)"});
  } else {
    wake_scheduler();
  }
}

void ResidencyCycle::access() {
  if (access_held()) return;
  access_held_.store(true, std::memory_order_relaxed);
  ka_.call_began();
  ka_.note_use();
  if (!ka_.wants_resident()) wire(WireReason::access);
}

// --- wiring and releasing -----------------------------------------------------------------

void ResidencyCycle::wire(WireReason why, std::optional<Nanos> began) {
  const Nanos t0 = clock_.now();
  ka_.set_wants_resident(true);
  if (!adm_.reserve_for_wire()) {
    // Device memory waits for room: not resident yet (a touch() in flight takes the slow path and
    // waits too), tried again by retry() once the others were asked.
    ka_.set_wants_resident(false);
    deferred_why_ = why;
    deferred_at_ = began.value_or(t0);
    return;
  }
  const Nanos t_reserved = clock_.now();
  // What waits may fit now: another manager of the process may have given back its share of
  // the hard limit since.
  adm_.promote();
  const Nanos t_promoted = clock_.now();
  const auto [bytes, n] = adm_.request_all();
  const Nanos t_requested = clock_.now();
  const std::uint64_t paced_head = adm_.take_paced_head();
  adm_.flush();
  next_refresh_ = clock_.now() + caps_.refresh_period;
  if (ever_released_ && n > 0) {  // memory that had been given back was asked for again
    const Nanos start = began.value_or(t0);
    const Nanos dt = clock_.now() - start;
    if (log_.enabled(LogLevel::debug))
      log_(LogLevel::debug, "timeline: the wake of " + mib(bytes) + ": " + ms(t0 - start) +
                                " waiting for room (the holders asked), " + ms(t_reserved - t0) + " reserving, " +
                                ms(t_promoted - t_reserved) + " admitting, " + ms(t_requested - t_promoted) +
                                " waking the sets (the backend maps and copies, pacing included), " +
                                ms(clock_.now() - t_requested) + " flushing");
    ++counters_.rewires;
    counters_.rewire_time += dt;
    const double secs = std::chrono::duration<double>(dt).count();
    std::size_t b = 0;
    while (b + 1 < Counters::kRewireBucketCount && secs > Counters::kRewireBuckets[b]) ++b;
    ++counters_.rewire_buckets[b];
    counters_.last_rewire_at = wall_now();
    counters_.last_rewire_dt = dt;
    counters_.last_rewire_bytes = bytes;
    log_(LogLevel::info, "re-wired " + mib(bytes) + " in " + std::to_string(n) + " set(s) in " + ms(dt) + " (" +
                             words(why) + (t0 > start ? "; " + ms(t0 - start) + " of it waiting for room" : "") +
                             (paced_head != 0 ? "; the first " + mib(paced_head) +
                                                    " in the budget's room while the holders asked made the rest"
                                              : "") +
                             ")");
    if (publish_) publish_();  // flush() published before the re-wire was counted
  }
  wake_scheduler();
}

void ResidencyCycle::retry(bool keep_asking) {
  adm_.begin_retry(keep_asking);
  if (deferred_why_) {
    const WireReason why = *deferred_why_;
    deferred_why_.reset();
    if (!ka_.wants_resident()) wire(why, deferred_at_);
    return;
  }
  adm_.open_batch();
  adm_.promote();
  adm_.close_batch();
}

// Gives the sets back; the caller has already marked the memory as not resident. The line is
// logged before the share goes back to a shared budget, so that a process let in by this release
// logs after it (a reader of both logs sees the release first).
void ResidencyCycle::release(const ReleaseReason& reason) {
  const char* why = reason.words.c_str();
  const Nanos t0 = clock_.now();
  const auto r = adm_.end_all();
  if (r.sets > 0) backend_.after_release();
  ever_released_ = true;
  counters_.last_release_at = wall_now();
  counters_.last_release_reason = why;
  if (r.sets > 0 || r.failed == 0) {
    switch (reason.kind) {
      case ReleaseKind::keep_alive: ++counters_.releases_keep_alive; break;
      case ReleaseKind::asked: ++counters_.releases_asked; break;
      case ReleaseKind::engine: ++counters_.releases_engine; break;
      case ReleaseKind::exit: break;
    }
  }
  if (r.failed == 0) {
    ++counters_.releases;
    log_(LogLevel::info, "released " + mib(r.bytes) + " in " + std::to_string(r.sets) + " set(s) in " +
                             ms(clock_.now() - t0) + " (" + why + ")");
  } else if (r.status.code() == ErrorCode::interrupted) {
    // A call began meanwhile (its touch asked the backend to stop): what was not given back stays
    // resident and that call's re-wire finds it in place. Not a failure. What was given back keeps
    // its share of a shared budget: that call wires it again at once, and a holder inside a call
    // may not wait for room (under a strict budget it would be refused).
    if (r.sets > 0) ++counters_.releases;
    log_(LogLevel::info, "release stopped after " + ms(clock_.now() - t0) + " (" + why + "): a call began; " +
                             mib(adm_.sets().requested_bytes()) + " stay wired" +
                             (r.bytes > 0 ? ", " + mib(r.bytes) + " released (its share of the budget kept for the call)"
                                          : std::string()));
    if (publish_) publish_();
    return;
  } else {
    ++counters_.release_failures;
    if (r.sets > 0) ++counters_.releases;
    log_(LogLevel::warn, "could not release " + std::to_string(r.failed) + " set(s) (" + why + "): " + r.status.message() +
                             "; " + mib(adm_.sets().requested_bytes()) + " stay wired, " + mib(r.bytes) + " released");
  }
  adm_.settle();
  if (publish_) publish_();
}

// A release the policy did not time (pressure, the engine's request, the end of a 0 call).
void ResidencyCycle::release_now(const ReleaseReason& why) {
  ka_.set_wants_resident(false);
  heavy_fence();  // a touch() in flight either sees it and re-wires, or is already past
  release(why);
}

bool ResidencyCycle::awake_or_wanted() const { return ka_.wants_resident() || adm_.sets().requested_bytes() > 0; }

bool ResidencyCycle::release_by_engine() {
  if (!ka_.managing() || !awake_or_wanted()) return true;
  if (ka_.calls() > 0) {
    log_(LogLevel::warn,
         "release_now: " + std::to_string(ka_.calls()) + " call(s) or use scope(s) still open; not releasing");
    return false;
  }
  release_now({ReleaseKind::engine, "asked by the engine"});
  return true;
}

bool ResidencyCycle::give_back_if_idle(int asker, Nanos idle_before_asked) {
  ++counters_.asks_received;
  const Nanos idle = Nanos(ka_.now_coarse() - ka_.last_use());
  if (!ka_.managing() || ka_.calls() > 0 || !awake_or_wanted() || idle < idle_before_asked) {
    adm_.settle();
    return false;
  }
  ++counters_.shared_gave_back;
  release_now({ReleaseKind::asked, adm_.share()->why_asked(asker, idle)});
  return true;
}

void ResidencyCycle::repay_debt(std::uint64_t over) {
  ++counters_.shared_gave_back;
  release_now({ReleaseKind::asked, adm_.share()->why_repaying(over)});
}

void ResidencyCycle::release_at_exit(bool device_memory) {
  adm_.begin_exit();
  if (!device_memory && adm_.sets().requested_bytes() > 0) {
    ka_.set_wants_resident(false);
    heavy_fence();
    release({ReleaseKind::exit, "the process is exiting"});
  }
  adm_.settle();
}

// --- memory pressure ----------------------------------------------------------------------

void ResidencyCycle::on_pressure() {
  if (!config_.release_on_pressure) {
    log_(LogLevel::debug, "memory pressure reported; release_on_pressure is off, keeping residency");
    return;
  }
  if (!ka_.managing() || ka_.calls() > 0) return;
  pressure_step();
}

// One step of graded release (see pressure_policy.hpp).
void ResidencyCycle::pressure_step() {
  WiredBudget& budget = adm_.budget();
  std::uint64_t cap = pressure_.on_pressure(clock_.now(), budget.admitted());
  budget.set_cap(cap);
  adm_.open_batch();
  const std::uint64_t released = adm_.shrink_to_limit(/*by_class=*/true, pressure_.floor());
  adm_.close_batch();
  // Regions are released whole: when the next one would cross the floor the cap is not met,
  // and the budget holds at what stays (so that no later eviction for the cap crosses it).
  if (budget.admitted() > cap) {
    cap = budget.admitted();
    budget.set_cap(cap);
  }
  if (released == 0) {
    log_(LogLevel::debug, "memory pressure: nothing more to give back (" + mib(budget.admitted()) + " wired, floor " +
                              mib(pressure_.floor()) + ")");
  } else {
    ++counters_.pressure_releases;
    log_(LogLevel::info,
         "released " + mib(released) + " under memory pressure (scratch, then kv_cache, then weights); " +
             mib(budget.admitted()) + " stay wired (floor " + mib(pressure_.floor()) + "); the budget stays at " +
             mib(cap) + " until pressure has been quiet for " + KeepAlive::after(pressure_.quiet()).to_string());
  }
  wake_scheduler();  // the cap's lift is a deadline now
}

// After a quiet period the cap rises: entirely when the machine has room for everything (or
// the backend cannot tell), else to what is admitted plus what is available less a headroom,
// the rest after further quiet periods (pressure_policy.hpp). What waits is admitted (and
// wired, if resident) again.
void ResidencyCycle::lift_pressure_cap_if_quiet(Nanos now) {
  if (!pressure_.quiet_at(now)) return;
  WiredBudget& budget = adm_.budget();
  const std::uint64_t before = budget.admitted();
  const std::uint64_t wanted = std::min(adm_.regions().tracked_bytes(), budget.limit());
  const std::optional<std::uint64_t> avail = wanted > before ? backend_.memory_available() : std::nullopt;
  const std::uint64_t room = avail ? (*avail > kLiftHeadroom ? *avail - kLiftHeadroom : 0) : UINT64_MAX;
  const bool all = room >= wanted - std::min(wanted, before);
  if (all) {
    pressure_.lift();
    budget.set_cap(UINT64_MAX);
  } else {
    pressure_.raise_to(before + room, now);
    budget.set_cap(pressure_.cap());
  }
  adm_.open_batch();
  adm_.promote();
  adm_.close_batch();
  if (all) {
    ++counters_.pressure_restores;
    log_(LogLevel::info, "memory pressure has been quiet: the budget is back to " + mib(budget.limit()) + ", " +
                             mib(budget.admitted() - before) + " admitted again");
  } else {
    // Once per change, not once per quiet period while the other program keeps its memory.
    log_(budget.admitted() > before ? LogLevel::info : LogLevel::debug,
         "memory pressure has been quiet, but only " + mib(avail.value_or(0)) +
             " is available: " + mib(budget.admitted() - before) + " admitted again, " + mib(budget.admitted()) +
             " of " + mib(wanted) + " wired; the rest when memory allows (checked every " +
             KeepAlive::after(pressure_.quiet()).to_string() + ")");
  }
}

// --- the scheduler ------------------------------------------------------------------------

std::optional<Nanos> ResidencyCycle::due() {
  if (prefetch_requested_) {
    prefetch_requested_ = false;
    if (ka_.rewires_on_use()) rewire(WireReason::prefetch);
  }
  lift_pressure_cap_if_quiet(clock_.now());
  const std::optional<Nanos> lift = pressure_.lifts_at();
  auto next = residency_due();
  if (lift) next = next ? std::min(*next, *lift) : *lift;
  return next;
}

std::optional<Nanos> ResidencyCycle::residency_due() {
  if (!ka_.managing() || !ka_.wants_resident()) return std::nullopt;
  const Nanos now = clock_.now();
  std::optional<Nanos> next;
  next = prepare_due(now);
  if (ka_.expires()) {
    const std::int64_t lu = ka_.last_use();
    const Nanos expiry = ka_.expiry(lu);
    if (ka_.calls() > 0) {
      const Nanos later = std::max(expiry, ka_.expiry(now.count()));  // a call is open: look again one keep-alive later
      next = next ? std::min(*next, later) : later;
    } else if (now >= expiry) {
      if (ka_.begin_release_unless_used(lu)) {
        release({ReleaseKind::keep_alive, "keep-alive " + config_.keep_alive.to_string() + " expired"});
        return std::nullopt;  // nothing scheduled until the next use: zero wake-ups
      }
      // A use won (expire a keep-alive after it), or a call began just now (look again later).
      return ka_.last_use() != lu ? ka_.expiry(ka_.last_use()) : ka_.expiry(now.count());
    } else {
      next = next ? std::min(*next, expiry) : expiry;
    }
  }
  if (caps_.needs_refresh && caps_.refresh_period.count() > 0) {
    if (now >= next_refresh_) {
      adm_.refresh_all();
      adm_.flush();
      next_refresh_ = now + caps_.refresh_period;
    }
    next = next ? std::min(*next, next_refresh_) : next_refresh_;
  }
  return next;
}

// The first release, prepared (docs/design.md): a holder whose memory may be released (its keep-alive
// expires, or a shared budget may ask it) and never was, idle for kPrepareAfterIdle, asks its
// backend to do that release's slow part now, in the background. A use stops the work (the backend
// polls `stop`); while the backend has work left, it is asked again after each kPrepareAfterIdle of idle (to go
// on where it stopped, or to hear that it is done), and never again once it says nothing is left.
std::optional<Nanos> ResidencyCycle::prepare_due(Nanos now) {
  if (!caps_.prepares_release || ever_released_ || !(ka_.expires() || adm_.share() != nullptr)) return std::nullopt;
  const std::uint64_t size = adm_.admitted_size();
  if (size == 0 || size == prepared_size_) return std::nullopt;  // nothing (left) to prepare
  const std::int64_t lu = ka_.last_use();
  const Nanos at = Nanos(lu) + kPrepareAfterIdle;
  if (ka_.calls() > 0) return std::max(at, now + kPrepareAfterIdle);
  if (now < at) return at;
  KeepAliveState& ka = ka_;
  const Backend::Preparation p = backend_.prepare_release(
      [&ka, lu] { return ka.calls() > 0 || ka.last_use() != lu || !ka.wants_resident(); });
  if (p == Backend::Preparation::nothing) {
    prepared_size_ = size;
    return std::nullopt;
  }
  return now + kPrepareAfterIdle;
}

}  // namespace residency::core
