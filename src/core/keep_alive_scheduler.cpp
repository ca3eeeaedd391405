// SPDX-License-Identifier: MIT
#include "keep_alive_scheduler.hpp"

namespace residency::core {

KeepAliveScheduler::KeepAliveScheduler(Clock& clock, Mutex& mutex, Due due)
    : clock_(clock), mutex_(mutex), due_(std::move(due)) {}

KeepAliveScheduler::~KeepAliveScheduler() { stop(); }

void KeepAliveScheduler::start() {
  if (thread_.joinable()) return;
  {
    MutexLock g(mutex_);
    stop_ = false;
  }
  thread_ = std::thread([this] { loop(); });
}

void KeepAliveScheduler::stop() {
  if (!thread_.joinable()) return;
  {
    MutexLock g(mutex_);
    stop_ = true;
    cv_.notify_all();
  }
  thread_.join();
}

void KeepAliveScheduler::loop() {
  MutexLock lock(mutex_);
  while (!stop_) {
    const std::optional<Nanos> next = due_();
    if (stop_) break;
    clock_.wait_until(lock.native(), cv_, next);
    wakeups_.fetch_add(1, std::memory_order_relaxed);
  }
}

}  // namespace residency::core
