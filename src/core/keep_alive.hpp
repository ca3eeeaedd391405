// SPDX-License-Identifier: MIT
// KeepAlive state: when the policy wants the memory resident, and the hot path that keeps it so.
//
// One fact, one representation: `resident_` says whether the policy currently wants the memory
// wired (the manager makes the sets' state follow it). touch() reads it without a lock, so it is
// an atomic; it is only written with the manager's mutex held.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#if defined(__linux__)
#include <time.h>
#endif

#include "asymmetric_fence.hpp"
#include "residency/clock.hpp"
#include "residency/config.hpp"

namespace residency::core {

// Called with each new time of last use (a shared budget's ledger writes it into its slot, so
// that other processes see how long this one has been idle); at most once per tick of the coarse
// clock from touch().
struct LastUsePublisher {
  void (*fn)(void* ctx, std::int64_t last_use) noexcept = nullptr;
  void* ctx = nullptr;
};

// The hot path is touch(): a coarse clock read (a memory load from the vDSO, not a timer read),
// a relaxed store of the time of use, a compiler-only fence and a relaxed load of `resident_`.
// The release protocol pairs with it through an asymmetric fence (asymmetric_fence.hpp): the
// releaser stores resident_ = false, runs the heavy fence, and then reads the time of last use;
// if a use arrived it restores resident_ and keeps the memory. Either touch() sees that the
// memory is being released and re-wires, or the releaser sees the use: no use is ever lost.
//
// Precision: uses are stamped with the coarse clock, which lags the precise one by at most one
// timer tick (Linux: 1-4 ms, clock_getres(CLOCK_MONOTONIC_COARSE)). The expiry adds that tick,
// so memory is never released early; it is released at most one tick late.
class KeepAliveState {
 public:
  using Publisher = LastUsePublisher;
  KeepAliveState(const KeepAlive& policy, Clock& clock, Publisher publish = {});

  // The policy in effect (KeepAlive::in_effect()), asked through the same predicates as KeepAlive's.
  bool managing() const { return kind_ != KeepAlive::Kind::off; }
  // Duration and forever keep memory between uses, so a use after a release re-wires it; 0 wires
  // only inside use scopes, off never.
  bool rewires_on_use() const { return kind_ == KeepAlive::Kind::duration || kind_ == KeepAlive::Kind::forever; }
  bool wires_only_in_use() const { return kind_ == KeepAlive::Kind::zero; }
  bool expires() const { return kind_ == KeepAlive::Kind::duration; }

  // The coarse time, without a virtual call for the real clock (the common case).
  std::int64_t now_coarse() const noexcept {
#if defined(__linux__) && defined(CLOCK_MONOTONIC_COARSE)
    if (steady_) {
      timespec ts;
      ::clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
      return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
    }
#endif
    return clock_.now_coarse().count();
  }

  // Lock-free; true when the caller must re-wire (take the slow path).
  bool touch() noexcept { return touch_at(now_coarse()); }
  bool touch_at(std::int64_t t) noexcept {
    // Skip the store when the stamp is already current: no cache-line write per call when
    // several threads decode at once.
    if (use_->load(std::memory_order_relaxed) != t) {
      use_->store(t, std::memory_order_relaxed);
      if (publish_.fn) publish_.fn(publish_.ctx, t);
    }
    light_fence();
    return rewires_on_use_ && !resident_.load(std::memory_order_relaxed);
  }
  // A use on a slow path (registration, a use scope's begin and end, prefetch): stamped with the
  // precise clock. Under load the coarse clock was seen lagging by more than its resolution (a
  // registration stamped coarse let a keep-alive expire early; docs/measurements.md); only the
  // lock-free touch() keeps the coarse stamp, expiry() adding the resolution.
  void note_use() noexcept {
    const std::int64_t t = clock_.now().count();
    use_->store(t, std::memory_order_relaxed);
    if (publish_.fn) publish_.fn(publish_.ctx, t);
  }
  std::int64_t last_use() const noexcept { return use_->load(std::memory_order_relaxed); }

  // What the policy wants (Stats::resident is what the backend holds: wired bytes > 0).
  bool wants_resident() const noexcept { return resident_.load(std::memory_order_relaxed); }
  // With the manager's mutex held.
  void set_wants_resident(bool r) noexcept { resident_.store(r, std::memory_order_relaxed); }

  // When the keep-alive expires for a last use at `last_use` (duration policy only).
  Nanos expiry(std::int64_t last_use) const { return Nanos(last_use) + duration_ + clock_.coarse_resolution(); }
  // The release half of the protocol, with the manager's mutex held: marks the memory as
  // released unless a use arrived after `seen_last_use` or a call is in flight. False: the use
  // won, the memory stays.
  bool begin_release_unless_used(std::int64_t seen_last_use) noexcept;

  // Engine calls and use scopes in flight (Manager::begin_call() to end_call(), use()): the
  // keep-alive never expires and nothing is released while one is open. Lock-free under a duration
  // or forever (the decode's path); under 0 changed with the manager's mutex held.
  void call_began() noexcept { calls_.fetch_add(1, std::memory_order_relaxed); }
  // Returns the calls still open (never below 0; a stray Manager::end_call(), on a thread that
  // holds no call open, is stopped before it comes here: thread_calls.hpp).
  int call_ended() noexcept {
    int n = calls_.load(std::memory_order_relaxed);
    while (n > 0 && !calls_.compare_exchange_weak(n, n - 1, std::memory_order_relaxed)) {
    }
    return n > 0 ? n - 1 : 0;
  }
  int calls() const noexcept { return calls_.load(std::memory_order_relaxed); }

 private:
  Clock& clock_;
  const bool steady_;  // clock_ is SteadyClock: its coarse time is read inline
  const KeepAlive::Kind kind_;
  const Nanos duration_;
  const bool rewires_on_use_;
  std::atomic<std::int64_t>* const use_;  // &last_use_
  const Publisher publish_;
  // On their own cache lines: every use writes last_use_, every touch() reads resident_.
  alignas(64) std::atomic<std::int64_t> last_use_{0};
  alignas(64) std::atomic<bool> resident_{false};
  alignas(64) std::atomic<int> calls_{0};  // written per call, not per touch()
};

}  // namespace residency::core
