// SPDX-License-Identifier: MIT
#include "residency/clock.hpp"

#include <algorithm>
#if defined(__linux__)
#include <time.h>
#endif

namespace residency {

Nanos SteadyClock::now() const noexcept {
  return std::chrono::duration_cast<Nanos>(std::chrono::steady_clock::now().time_since_epoch());
}

Nanos SteadyClock::now_coarse() const noexcept {
#if defined(__linux__) && defined(CLOCK_MONOTONIC_COARSE)
  // libstdc++'s steady_clock is CLOCK_MONOTONIC; the coarse clock is the same time line.
  timespec ts;
  if (::clock_gettime(CLOCK_MONOTONIC_COARSE, &ts) == 0)
    return Nanos(static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec);
#endif
  return now();
}

Nanos SteadyClock::coarse_resolution() const noexcept {
#if defined(__linux__) && defined(CLOCK_MONOTONIC_COARSE)
  static const Nanos res = [] {
    timespec ts;
    if (::clock_getres(CLOCK_MONOTONIC_COARSE, &ts) != 0) return Nanos(0);
    return Nanos(static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec);
  }();
  return res;
#else
  return Nanos(0);
#endif
}

void SteadyClock::wait_until(std::unique_lock<std::mutex>& lock, std::condition_variable& cv,
                             std::optional<Nanos> deadline) {
  if (!deadline) {
    cv.wait(lock);
    return;
  }
  cv.wait_until(lock, std::chrono::steady_clock::time_point(
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(*deadline)));
}

// Never destroyed: a manager nobody destroyed (the preload leaks its own on purpose) keeps its
// scheduler thread, which may read the clock while exit() runs the static destructors.
SteadyClock& SteadyClock::instance() {
  static SteadyClock* const clock = new SteadyClock;
  return *clock;
}

Nanos ManualClock::now() const noexcept { return Nanos(now_ns_.load(std::memory_order_acquire)); }

void ManualClock::wait_until(std::unique_lock<std::mutex>& lock, std::condition_variable& cv,
                             std::optional<Nanos> deadline) {
  if (deadline && now() >= *deadline) return;
  auto w = std::make_shared<Waiter>(Waiter{lock.mutex(), &cv, deadline});
  {
    std::lock_guard<std::mutex> g(m_);
    waiters_.push_back(w);
  }
  // A deadline passed between the check above and the registration: advance() may have
  // looked before we registered, so look again.
  if (!(deadline && now() >= *deadline)) cv.wait(lock);
  std::lock_guard<std::mutex> g(m_);
  waiters_.erase(std::remove(waiters_.begin(), waiters_.end(), w), waiters_.end());
}

void ManualClock::advance(Nanos d) {
  now_ns_.fetch_add(d.count(), std::memory_order_acq_rel);
  wake_due();
}

void ManualClock::set(Nanos t) {
  std::int64_t cur = now_ns_.load(std::memory_order_acquire);
  while (cur < t.count() && !now_ns_.compare_exchange_weak(cur, t.count(), std::memory_order_acq_rel)) {
  }
  wake_due();
}

int ManualClock::waiters() const {
  std::lock_guard<std::mutex> g(m_);
  return static_cast<int>(std::count_if(waiters_.begin(), waiters_.end(), [](const auto& w) { return !w->woken; }));
}

void ManualClock::wake_due() {
  std::vector<std::shared_ptr<Waiter>> due;
  {
    std::lock_guard<std::mutex> g(m_);
    const Nanos t = now();
    for (auto& w : waiters_) {
      if (!w->woken && w->deadline && *w->deadline <= t) {
        w->woken = true;
        due.push_back(w);
      }
    }
  }
  // Taking the waiter's mutex orders this notify after its cv.wait began (it registered with
  // that mutex held and releases it only inside wait), so the wake-up cannot be lost. And a
  // waiter that has already returned (woken by its owner meanwhile) is not notified: its owner
  // may be waiting again, on a later deadline or none, and would see a wake-up that time did
  // not cause. Lock order, as in wait_until: the waiter's mutex, then m_.
  for (auto& w : due) {
    std::lock_guard<std::mutex> g(*w->mutex);
    bool still_waiting = false;
    {
      std::lock_guard<std::mutex> gm(m_);
      still_waiting = std::find(waiters_.begin(), waiters_.end(), w) != waiters_.end();
    }
    if (still_waiting) w->cv->notify_all();
  }
}

}  // namespace residency
