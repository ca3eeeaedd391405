// SPDX-License-Identifier: MIT
#include "keep_alive_scheduler.hpp"

namespace residency::core {

KeepAliveScheduler::KeepAliveScheduler(Clock& clock, std::mutex& mutex, Due due)
    : clock_(clock), mutex_(mutex), due_(std::move(due)) {}

KeepAliveScheduler::~KeepAliveScheduler() { stop(); }

void KeepAliveScheduler::start() {
  if (thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> g(mutex_);
    stop_ = false;
  }
  thread_ = std::thread([this] { loop(); });
}

void KeepAliveScheduler::stop() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> g(mutex_);
    stop_ = true;
    cv_.notify_all();
  }
  thread_.join();
}

void KeepAliveScheduler::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    const std::optional<Nanos> next = due_(lock);
    if (stop_) break;
    clock_.wait_until(lock, cv_, next);
    wakeups_.fetch_add(1, std::memory_order_relaxed);
  }
}

}  // namespace residency::core
