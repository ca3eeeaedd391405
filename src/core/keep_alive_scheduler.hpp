// SPDX-License-Identifier: MIT
// KeepAliveScheduler: the heartbeat, without the polling.
//
// llama.cpp's heartbeat thread wakes every 5 ms for the life of the process, 200 times a
// second, even when nothing is wired. This one sleeps on a condition variable until the next
// deadline its owner reports (a keep-alive expiry, a backend refresh) and, when there is none,
// until it is woken: zero wake-ups while idle. Shutdown is immediate (a notify, not a timeout).
// Time and waiting come from the injected Clock, so tests drive it with a ManualClock.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

#include "residency/clock.hpp"

namespace residency::core {

class KeepAliveScheduler {
 public:
  // `due` runs with `mutex` held by the lock it is given: it does what is due now and returns the
  // next deadline (nullopt: sleep until woken). It may release the lock for a while (to wait on
  // another process) and must hold it again when it returns.
  using Due = std::function<std::optional<Nanos>(std::unique_lock<std::mutex>&)>;
  KeepAliveScheduler(Clock& clock, std::mutex& mutex, Due due);
  ~KeepAliveScheduler();  // stops
  KeepAliveScheduler(const KeepAliveScheduler&) = delete;
  KeepAliveScheduler& operator=(const KeepAliveScheduler&) = delete;

  void start();
  // Stops and joins the thread. Must be called without `mutex` held.
  void stop();
  // Makes the thread re-evaluate its deadline. Call with `mutex` held.
  void wake_locked() { cv_.notify_all(); }
  std::uint64_t wakeups() const { return wakeups_.load(std::memory_order_relaxed); }

 private:
  void loop();
  Clock& clock_;
  std::mutex& mutex_;
  Due due_;
  std::condition_variable cv_;
  bool stop_ = false;  // guarded by mutex_
  std::atomic<std::uint64_t> wakeups_{0};
  std::thread thread_;
};

}  // namespace residency::core
