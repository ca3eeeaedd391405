// SPDX-License-Identifier: MIT
// The dispatch memory-pressure source; see pressure_source.hpp.
#include "backends/metal/pressure_source.hpp"

#include <dispatch/dispatch.h>

#include <cstdint>
#include <utility>

#include "backends/metal/system_info.hpp"
#include "platform/thread_annotations.hpp"

namespace residency::metal {

const char* to_string(PressureLevel level) noexcept {
  switch (level) {
    case PressureLevel::normal: return "normal";
    case PressureLevel::warn: return "warn";
    case PressureLevel::critical: return "critical";
  }
  return "unknown";
}

// Everything the handlers touch, guarded by `mu`, which is also held while on_pressure runs (so
// that stop() waits for a call in flight and no call starts after it).
struct PressureSource::State {
  Mutex mu;
  bool stopped RESIDENCY_GUARDED_BY(mu) = false;
  std::function<void(PressureLevel)> on_pressure RESIDENCY_GUARDED_BY(mu);
  Nanos repeat RESIDENCY_GUARDED_BY(mu) = Nanos(0);
  PressureLevel level RESIDENCY_GUARDED_BY(mu) = PressureLevel::normal;
  dispatch_queue_t queue RESIDENCY_GUARDED_BY(mu) = nullptr;
  dispatch_source_t source RESIDENCY_GUARDED_BY(mu) = nullptr;  // the memory-pressure source
  dispatch_source_t timer RESIDENCY_GUARDED_BY(mu) = nullptr;   // the repeat, while the level is above normal
  std::weak_ptr<State> self RESIDENCY_GUARDED_BY(mu);           // for the timer's handler, made on the queue

  void cancel_timer_locked() RESIDENCY_REQUIRES(mu) {
    if (timer == nullptr) return;
    dispatch_source_cancel(timer);
    dispatch_release(timer);
    timer = nullptr;
  }

  // On the queue: a report of the current level, from the source (`flags`) or the timer.
  void on_event(unsigned long flags) {
    MutexLock lock(mu);
    if (stopped) return;
    if ((flags & DISPATCH_MEMORYPRESSURE_CRITICAL) != 0) {
      level = PressureLevel::critical;
    } else if ((flags & DISPATCH_MEMORYPRESSURE_WARN) != 0) {
      level = PressureLevel::warn;
    } else if ((flags & DISPATCH_MEMORYPRESSURE_NORMAL) != 0) {
      level = PressureLevel::normal;
    }
    if (level == PressureLevel::normal) {
      cancel_timer_locked();
      return;
    }
    on_pressure(level);
    if (timer == nullptr) start_timer_locked();
  }

  void on_tick() {
    MutexLock lock(mu);
    if (stopped || timer == nullptr) return;
    // The normal event may be lost if the level dropped while a previous handler ran; the
    // kernel's own reading settles it.
    if (const auto now = read_memory_pressure_level(); now && *now == PressureLevel::normal) {
      level = PressureLevel::normal;
      cancel_timer_locked();
      return;
    }
    on_pressure(level);
  }

  void start_timer_locked() RESIDENCY_REQUIRES(mu);
};

namespace {
// The handlers hold the state, not the PressureSource: a handler already queued when stop()
// runs finds `stopped` and returns, and the state goes with the last handler.
void set_handler(dispatch_source_t src, std::shared_ptr<PressureSource::State> st, bool is_timer) {
  if (is_timer) {
    dispatch_source_set_event_handler(src, ^{
      st->on_tick();
    });
  } else {
    dispatch_source_set_event_handler(src, ^{
      st->on_event(dispatch_source_get_data(src));
    });
  }
}
}  // namespace

void PressureSource::State::start_timer_locked() {
  timer = dispatch_source_create(DISPATCH_SOURCE_TYPE_TIMER, 0, 0, queue);
  if (timer == nullptr) return;  // the event itself was delivered; only the repeat is lost
  const auto ns = static_cast<std::uint64_t>(repeat.count());
  dispatch_source_set_timer(timer, dispatch_time(DISPATCH_TIME_NOW, static_cast<std::int64_t>(ns)), ns, ns / 10);
  // A handler that refers to this state keeps it alive; it is the timer's own, released with it.
  set_handler(timer, self.lock(), /*is_timer=*/true);
  dispatch_resume(timer);
}

// The new state is this function's alone until set_handler and dispatch_resume hand it to the
// queue at the end, so its fields are set without `mu`, as a constructor's would be (the analysis
// skips constructors, not this).
Status PressureSource::start(Nanos repeat,
                             std::function<void(PressureLevel)> on_pressure) RESIDENCY_NO_THREAD_SAFETY_ANALYSIS {
  stop();
  if (repeat.count() <= 0) {
    return Status(ErrorCode::invalid_argument, "metal: the memory-pressure repeat period must be above 0");
  }
  auto st = std::make_shared<State>();
  st->self = st;
  st->on_pressure = std::move(on_pressure);
  st->repeat = repeat;
  st->queue = dispatch_queue_create("residency.memory-pressure", DISPATCH_QUEUE_SERIAL);
  if (st->queue == nullptr) return Status(ErrorCode::backend_error, "metal: dispatch_queue_create failed");
  st->source = dispatch_source_create(DISPATCH_SOURCE_TYPE_MEMORYPRESSURE, 0,
                                      DISPATCH_MEMORYPRESSURE_NORMAL | DISPATCH_MEMORYPRESSURE_WARN |
                                          DISPATCH_MEMORYPRESSURE_CRITICAL,
                                      st->queue);
  if (st->source == nullptr) {
    dispatch_release(st->queue);
    return Status(ErrorCode::backend_error,
                  "metal: dispatch_source_create(DISPATCH_SOURCE_TYPE_MEMORYPRESSURE) failed");
  }
  set_handler(st->source, st, /*is_timer=*/false);
  dispatch_resume(st->source);
  state_ = std::move(st);
  return Status::ok();
}

void PressureSource::stop() {
  if (!state_) return;
  {
    MutexLock lock(state_->mu);  // waits for a call in flight
    state_->stopped = true;
    state_->on_pressure = nullptr;
    state_->cancel_timer_locked();
    dispatch_source_cancel(state_->source);
    dispatch_release(state_->source);
    state_->source = nullptr;
    dispatch_release(state_->queue);  // the queue lives on while a cancelled handler still runs
    state_->queue = nullptr;
  }
  state_.reset();
}

}  // namespace residency::metal
