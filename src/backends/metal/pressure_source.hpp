// SPDX-License-Identifier: MIT
// residency metal backend: the system's memory-pressure reports, from libdispatch.
//
// macOS tells a process about memory pressure through a dispatch source
// (DISPATCH_SOURCE_TYPE_MEMORYPRESSURE): one event when the system's level changes to warn or
// critical, one when it returns to normal. Linux PSI, which the posix backend watches, reports
// once per window for as long as tasks keep stalling, and the manager's graded release gives
// back one step per report. So that both platforms step alike, this source repeats the report
// every `repeat` (a dispatch timer) while the level stays at warn or critical, and stops
// repeating at the normal event (or when kern.memorystatus_vm_pressure_level reads normal, in
// case that event is missed). Nothing runs while there is no pressure: no thread wakes.
//
// Apple platforms only (compile-checked on Linux by scripts/metal-check, never run there).
#pragma once

#include <functional>
#include <memory>

#include "residency/clock.hpp"
#include "residency/status.hpp"

namespace residency::metal {

enum class PressureLevel { normal, warn, critical };
const char* to_string(PressureLevel level) noexcept;

class PressureSource {
 public:
  PressureSource() = default;
  PressureSource(const PressureSource&) = delete;
  PressureSource& operator=(const PressureSource&) = delete;
  ~PressureSource() { stop(); }

  // Starts the source on a private serial queue; `on_pressure` is called there at each warn or
  // critical event and every `repeat` after it until the level is normal again. Errors:
  // invalid_argument for a repeat <= 0, backend_error when libdispatch made no queue or source.
  // A running source is stopped first.
  Status start(Nanos repeat, std::function<void(PressureLevel)> on_pressure);
  // Stops the source: on_pressure is not running and is not called after this returns. Must
  // not be called from inside on_pressure (it waits for a call in flight). Safe when stopped.
  void stop();
  bool running() const { return state_ != nullptr; }

  struct State;  // shared with the dispatch handlers, which may outlive a stop() by a moment

 private:
  std::shared_ptr<State> state_;
};

}  // namespace residency::metal
