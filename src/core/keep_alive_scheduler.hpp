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
#include <optional>
#include <thread>

#include "platform/thread_annotations.hpp"
#include "residency/clock.hpp"

namespace residency::core {

class KeepAliveScheduler {
 public:
  // `due` runs with `mutex` held: it does what is due now and returns the next deadline (nullopt:
  // sleep until woken). It may release `mutex` for a while (to wait on another process) and must
  // hold it again when it returns.
  using Due = std::function<std::optional<Nanos>()>;
  KeepAliveScheduler(Clock& clock, Mutex& mutex, Due due);
  ~KeepAliveScheduler();  // stops
  KeepAliveScheduler(const KeepAliveScheduler&) = delete;
  KeepAliveScheduler& operator=(const KeepAliveScheduler&) = delete;

  void start() RESIDENCY_EXCLUDES(mutex_);
  // Stops and joins the thread.
  void stop() RESIDENCY_EXCLUDES(mutex_);
  // Makes the thread re-evaluate its deadline.
  void wake_locked() RESIDENCY_REQUIRES(mutex_) { cv_.notify_all(); }
  std::uint64_t wakeups() const { return wakeups_.load(std::memory_order_relaxed); }

 private:
  void loop();
  Clock& clock_;
  Mutex& mutex_;
  Due due_;
  std::condition_variable cv_;
  bool stop_ RESIDENCY_GUARDED_BY(mutex_) = false;
  std::atomic<std::uint64_t> wakeups_{0};
  std::thread thread_;
};

}  // namespace residency::core
