// SPDX-License-Identifier: MIT
// residency: injected time.
//
// Every keep-alive rule depends on time, and a rule that can only be tested by sleeping is
// a rule that is not tested. So the manager never calls std::chrono directly: it asks a
// Clock for the time and asks the same Clock to wait for a deadline. SteadyClock is the real
// one; ManualClock is moved by hand (tests, the sim backend's virtual time) and wakes a
// waiter only when its deadline has been passed, exactly as a timed wait would.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace residency {

// Nanoseconds on a monotonic time line. Only differences mean anything.
using Nanos = std::chrono::nanoseconds;

class Clock {
 public:
  virtual ~Clock() = default;
  // The current time.
  virtual Nanos now() const noexcept = 0;
  // The current time, possibly up to coarse_resolution() behind now() and never ahead of it:
  // what touch() reads on the hot path, where a few milliseconds of precision buy a clock read
  // that costs a memory load instead of a timer read. Default: now().
  virtual Nanos now_coarse() const noexcept { return now(); }
  // How far now_coarse() may lag now() (0: not at all).
  virtual Nanos coarse_resolution() const noexcept { return Nanos(0); }
  // Blocks until `deadline` has passed (nullopt: no deadline) or `cv` is notified.
  // `lock` holds the mutex that `cv` is used with. Spurious returns are allowed: the caller
  // re-checks its state after every return.
  virtual void wait_until(std::unique_lock<std::mutex>& lock, std::condition_variable& cv,
                          std::optional<Nanos> deadline) = 0;
};

// std::chrono::steady_clock (CLOCK_MONOTONIC; read through the vDSO, no system call).
// now_coarse() is CLOCK_MONOTONIC_COARSE on Linux (the time of the last timer tick, read from
// the vDSO's data page: one tick, 1-4 ms, of lag), else steady_clock.
class SteadyClock final : public Clock {
 public:
  Nanos now() const noexcept override;
  Nanos now_coarse() const noexcept override;
  Nanos coarse_resolution() const noexcept override;
  void wait_until(std::unique_lock<std::mutex>& lock, std::condition_variable& cv, std::optional<Nanos> deadline) override;
  // One instance shared by every manager that is not given a clock.
  static SteadyClock& instance();
};

// Time that moves only when advance() or set() is called. Thread-safe. A waiter whose
// deadline is passed by advance() is woken; a waiter without a deadline is not (it would not
// be woken by time either), so a test can count the wake-ups that real time would cause.
class ManualClock final : public Clock {
 public:
  explicit ManualClock(Nanos start = Nanos(0)) : now_ns_(start.count()) {}
  Nanos now() const noexcept override;
  void wait_until(std::unique_lock<std::mutex>& lock, std::condition_variable& cv, std::optional<Nanos> deadline) override;
  void advance(Nanos d);
  void set(Nanos t);  // never moves backwards: a smaller t is ignored
  // Number of threads currently blocked in wait_until (tests use it to know that the
  // scheduler has gone back to sleep).
  int waiters() const;

 private:
  struct Waiter {
    std::mutex* mutex;  // the waiter's own mutex, held while notifying so no wake-up is lost
    std::condition_variable* cv;
    std::optional<Nanos> deadline;
    bool woken = false;
  };
  void wake_due();
  std::atomic<std::int64_t> now_ns_;
  mutable std::mutex m_;  // guards waiters_; never held while taking a waiter's mutex
  std::vector<std::shared_ptr<Waiter>> waiters_;
};

}  // namespace residency
