// SPDX-License-Identifier: MIT
// Helpers shared by the sim tests: round-number profiles, fake buffer addresses and a loop
// that advances virtual time while letting a Manager do what is due.
#pragma once

#include <cstdint>
#include <optional>

#include "residency/backends/sim.hpp"
#include "residency/clock.hpp"
#include "residency/residency.hpp"

namespace residency::simtest {

using namespace std::chrono_literals;

constexpr std::uint64_t kGB = 1'000'000'000ULL;

// A machine with round numbers, so that expected values can be worked out by hand:
// the collector starts 1 s after the last use and unwires 1 GB/s; re-wiring costs 1 ms per MB.
inline SimProfile round_profile() {
  SimProfile p;
  p.name = "round";
  p.physical = 64 * kGB;
  p.recommended_working_set = 48 * kGB;
  p.collector_delay = 1s;
  p.collector_rate = 1e9;
  p.rewire_rate = 1e9;
  p.model_bytes = 4 * kGB;
  p.decode_compute = 10ms;
  return p;
}

// Buffer addresses the sim only compares (it never touches the memory).
inline void* fake_base(std::uintptr_t n) { return reinterpret_cast<void*>(n << 32); }

// A sim on `clock`. Options left at the default profile get round_profile() instead, so that
// tests state only the switches they are about.
inline std::shared_ptr<SimBackend> make_sim(ManualClock& clock, SimOptions o = {}) {
  o.clock = &clock;
  if (o.profile.name == default_sim_profile().name) o.profile = round_profile();
  auto sim = make_sim_backend(std::move(o));
  return sim ? sim.value() : nullptr;
}

// Advances the clock to `until`, stopping at every deadline the manager reports on the way
// and running what is due there: the manager's scheduler thread, in virtual time.
inline void advance_with(Manager& m, ManualClock& clock, Nanos until) {
  // Bounded, so that a manager that stopped moving its deadlines fails a test, not hangs it.
  for (int i = 0; i < 1'000'000; ++i) {
    const std::optional<Nanos> next = m.run_due();
    if (!next || *next > until) break;
    clock.set(*next);
  }
  clock.set(until);
  m.run_due();
}

}  // namespace residency::simtest
