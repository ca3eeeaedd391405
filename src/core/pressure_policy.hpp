// SPDX-License-Identifier: MIT
// PressurePolicy: give memory back gradually under pressure, and take it again only after the
// pressure has been quiet for a while, and then only as much as the machine has room for.
//
// llama.cpp keeps everything wired (latency wins), MLX wires only while generating (RAM for other
// applications wins), and releasing everything at the first pressure event turns a brief spike
// into a full re-wire (decode 0.24 -> 9.31 tok/s in an MLX user's report). So each pressure event
// lowers a cap on what may stay wired by one step, releasing in order scratch, kv_cache, then
// weights by priority and least recent use, never below the floor; and the cap stays until no
// pressure event has come for `quiet`, so a flapping signal costs one release and one re-wire, not
// one per flap.
//
// Pure bookkeeping: no backend calls. Lock rule: the manager's mutex.
#pragma once

#include <cstdint>
#include <optional>

#include "residency/clock.hpp"

namespace residency::core {

// The step: a quarter of what is wired above the floor when the event comes, and at least 64 MiB.
// A PSI trigger fires at most once per window (2 s here) while pressure lasts, so sustained
// pressure reaches the floor in a few windows, and a short spike costs a quarter. The quiet period
// defaults to 30 s: three times PSI's shortest average (avg10), long enough that the pressure
// that caused the release has ended, short enough that a server is back to full speed within the
// first minute after it.
inline constexpr std::uint64_t kMinPressureStep = 64ull << 20;
// Quiet does not mean the memory is free again: the program that caused the pressure may still
// hold what it took (a hog that got its 1.5 GiB keeps it). Wiring everything back at once inside
// a tight memory cgroup would then make the kernel kill someone. So when the quiet period ends,
// the manager asks the backend what is available (Backend::memory_available()) and raises the cap
// only to what is wired plus that, less kLiftHeadroom; the rest follows after further quiet
// periods as memory frees up. Where the backend cannot tell, the cap lifts entirely.
//
// Left free when the cap is raised to what is available, so that the re-wire itself does not
// bring the pressure back (four of the smallest steps).
inline constexpr std::uint64_t kLiftHeadroom = 4 * kMinPressureStep;

class PressurePolicy {
 public:
  PressurePolicy(std::uint64_t floor_bytes, Nanos quiet) : floor_(floor_bytes), quiet_(quiet) {}

  // A pressure event at `now` with `wired` bytes admitted: returns the new cap (at least the floor).
  std::uint64_t on_pressure(Nanos now, std::uint64_t wired);
  // The cap in force (UINT64_MAX: none).
  std::uint64_t cap() const { return cap_; }
  bool capped() const { return cap_ != UINT64_MAX; }
  // When the cap lifts if no further event comes (nullopt when there is no cap).
  std::optional<Nanos> lifts_at() const;
  // Whether a cap is in force and pressure has been quiet long enough at `now` to raise it.
  bool quiet_at(Nanos now) const { return capped() && now >= last_event_ + quiet_; }
  // Lifts the cap entirely.
  void lift() { cap_ = UINT64_MAX; }
  // Raises the cap to `cap` (what the machine has room for now, when that is less than
  // everything) and waits another quiet period before the next step.
  void raise_to(std::uint64_t cap, Nanos now);
  std::uint64_t floor() const { return floor_; }
  Nanos quiet() const { return quiet_; }

 private:
  std::uint64_t floor_;
  Nanos quiet_;
  std::uint64_t cap_ = UINT64_MAX;
  Nanos last_event_{0};
};

}  // namespace residency::core
