// SPDX-License-Identifier: MIT
// ResidencyCycle: when what is admitted is wired, and when it is given back.
//
// Admission decides which regions are in the sets; this unit decides when the sets are resident:
// wired at a use after a release (touch(), an engine call, a use scope, prefetch), released when
// the keep-alive expires, when the last call ends under keep-alive 0, when the engine asks, when
// another process asks through the shared budget and this one is idle, or step by step under
// memory pressure (and admitted again once pressure has been quiet). Every residency rule of the
// library is decided here, once: the preload, the C API and the tool only report engine events
// (begin_call(), end_call(), access()).
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>

#include "admission.hpp"
#include "keep_alive.hpp"
#include "keep_alive_scheduler.hpp"
#include "log.hpp"
#include "pressure_policy.hpp"
#include "residency/backend.hpp"
#include "residency/config.hpp"

namespace residency::core {

// Invariants (guarded by the manager's mutex, but the atomics of KeepAliveState):
//   - KeepAliveState::wants_resident() is what the policy wants; the sets follow it at the end of each
//     call (wire() requests every admitted set, release() ends them all). A set the backend could
//     not give back stays requested, and the log says so.
//   - Nothing is released while a call or use scope is open (KeepAliveState::calls() > 0): not by
//     the keep-alive, not under pressure, not when asked by another process or by release_now().
//   - ever_released_: some memory has been given back, so the next wire is a re-wire (counted,
//     timed and logged); before the first release a wire is the load.
//   - access_held_: under keep-alive 0, an access outside a call (an upload) holds the memory as
//     one call until the end of the next call; it is counted in calls().
//   - The pressure cap (PressurePolicy) is in the budget's cap while in force, and lifted by due().
class ResidencyCycle {
 public:
  ResidencyCycle(const Config& config, const Capabilities& caps, Clock& clock, const LogSink& log, KeepAliveState& ka,
                 Admission& admission, Backend& backend, std::uint64_t pressure_floor);
  void set_scheduler(KeepAliveScheduler* s) { scheduler_ = s; }
  // The scheduler's mutex is the manager's, held by every caller of the cycle (manager.cpp guards
  // the cycle with it); the analysis cannot see that they are one.
  void wake_scheduler() RESIDENCY_NO_THREAD_SAFETY_ANALYSIS {
    if (scheduler_) scheduler_->wake_locked();
  }

  // Why memory is wired again: each event has its kind, and its words in the log (words()).
  enum class WireReason { new_region, touch, use_scope, access, prefetch };
  static const char* words(WireReason why);

  // --- engine events (the slow paths; the lock-free fast paths are in Manager) ---------------
  // A call begins: under 0 it is counted and the memory wired; otherwise the memory was released
  // and is wired again (`why` names the event in the log).
  void begin_call(WireReason why);
  // A call ended (the caller synchronized already): under 0 the last one releases.
  void end_call();
  // An access outside a call under 0: resident until the end of the next call.
  void access();
  // A use after a release under a duration or forever (touch(), a registration, prefetch).
  void rewire(WireReason why) {
    if (!ka_.wants_resident()) wire(why);
  }
  // After the others were asked for room (BudgetShare::take_room_wanted(), BudgetShare::Room): what waits
  // is admitted again, and a wire that waited for room is done.
  void retry(bool keep_asking = false);
  void request_prefetch() {
    prefetch_requested_ = true;
    wake_scheduler();
  }

  // --- releases ---------------------------------------------------------------------------
  // Gives residency back now unless a call is open (the engine going to sleep); false: refused.
  bool release_by_engine();
  // Memory pressure: one step of graded release, unless a call is open.
  void on_pressure();
  // Another process asks through the shared budget: gives everything back if this manager is
  // really idle (no call open, no use for `idle_before_asked`). True: it gave back.
  bool give_back_if_idle(int asker, Nanos idle_before_asked);
  // The shared budget is `over` bytes over and it is this holder's turn to repay (the least
  // recently used, no call open: Ledger::repay_turn()): it sleeps.
  void repay_debt(std::uint64_t over);
  // At exit: nothing is wired again; host memory is given back (device memory is left to the
  // driver: ending its residency would copy it out).
  void release_at_exit(bool device_memory);

  // The scheduler's work at `now`: prefetch, the pressure cap's lift, expiry and refresh. Returns
  // the next deadline.
  std::optional<Nanos> due();
  // How long a holder that has never been released must be idle before its backend prepares the
  // first release (docs/design.md, "The first release, prepared"): the work stops within a step
  // when a use comes, so it may start soon; the victim of a router's next switch has often been
  // idle only for the previous switch (about 0.3 s).
  static constexpr Nanos kPrepareAfterIdle{std::chrono::milliseconds(100)};
  // The backend's preparation has been stopped (the manager goes away).
  void stop_preparation() { backend_.stop_preparation(); }

  // --- what it did ------------------------------------------------------------------------
  struct Counters {
    std::uint64_t releases = 0, rewires = 0, release_failures = 0, pressure_releases = 0, pressure_restores = 0;
    std::uint64_t shared_gave_back = 0;  // releases asked for by another process
    // Releases by why (pressure steps are pressure_releases): the keep-alive expired, another
    // process asked (or a GPU budget's debt was repaid), the engine asked (release_now, the end of
    // a keep-alive-0 call). The rest (exit) is releases less these.
    std::uint64_t releases_keep_alive = 0, releases_asked = 0, releases_engine = 0;
    std::uint64_t asks_received = 0;  // another process asked this one to give way (given or not)
    // Re-wire (wake) durations: counts per bucket of kRewireBuckets (the last: above them all).
    static constexpr double kRewireBuckets[] = {0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
    static constexpr std::size_t kRewireBucketCount = sizeof kRewireBuckets / sizeof kRewireBuckets[0] + 1;
    std::uint64_t rewire_buckets[kRewireBucketCount] = {};
    Nanos rewire_time{0};
    // The last release and re-wire, for the state file (wall-clock seconds; 0: none yet).
    double last_release_at = 0, last_rewire_at = 0;
    std::string last_release_reason;
    Nanos last_rewire_dt{0};
    std::uint64_t last_rewire_bytes = 0;
  };
  const Counters& counters() const { return counters_; }
  const PressurePolicy& pressure() const { return pressure_; }
  // Called after a release or a re-wire (the state file is written at once).
  void on_published(std::function<void()> f) { publish_ = std::move(f); }

 private:
  // Why memory is given back: counted by its kind (Counters), said in its words (the log).
  enum class ReleaseKind { keep_alive, asked, engine, exit };
  struct ReleaseReason {
    ReleaseKind kind;
    std::string words;
  };
  // `began`: when a wire that waited for room was first tried (the wait counts in its time).
  void wire(WireReason why, std::optional<Nanos> began = std::nullopt);
  // Memory the keep-alive holds, or that is still awake although it does not (what a refused
  // wake or a stopped release left awake): either is given back when asked or told to.
  bool awake_or_wanted() const;
  void release(const ReleaseReason& why);
  void release_now(const ReleaseReason& why);
  void pressure_step();
  void lift_pressure_cap_if_quiet(Nanos now);
  std::optional<Nanos> residency_due();
  // Before the first release, once the holder has been idle for kPrepareAfterIdle: the backend is
  // asked to prepare that release in the background (Backend::prepare_release). Returns when to
  // look again.
  std::optional<Nanos> prepare_due(Nanos now);

  const Config& config_;
  const Capabilities& caps_;
  Clock& clock_;
  const LogSink& log_;
  KeepAliveState& ka_;
  Admission& adm_;
  Backend& backend_;
  KeepAliveScheduler* scheduler_ = nullptr;
  PressurePolicy pressure_;
  std::function<void()> publish_;
  bool ever_released_ = false;
  // prepare_due(): the admitted size at which the backend said nothing was left to prepare (asked
  // again only when memory is admitted or given up).
  std::uint64_t prepared_size_ = 0;
  bool prefetch_requested_ = false;
  std::optional<WireReason> deferred_why_;  // a wire waiting for room in the shared budget (its reason)
  Nanos deferred_at_{0};                    // when that wire was first tried
  // Read without the lock by Manager::access() (only to skip the lock when already held).
  std::atomic<bool> access_held_{false};
  Nanos next_refresh_{0};
  Counters counters_;

 public:
  bool access_held() const noexcept { return access_held_.load(std::memory_order_relaxed); }
};

}  // namespace residency::core
