// SPDX-License-Identifier: MIT
// The sim idle target: `residency idle --backend sim` on virtual time.
//
// Why it exists: the idle penalty this project is about was measured once, on a Mac (llama-idle,
// PR 10119). The sim target replays that experiment against the sim backend's model of macOS
// (collector, re-wire cost, decaying requests), with a real residency::Manager per policy, so
// that every policy's column can be compared with the published `off` figures on any machine,
// in milliseconds of wall time: the target's clock is virtual (a ManualClock the benchmark
// advances, stopping at each of the manager's deadlines, as its scheduler thread would wake), and
// a decode's time is the modelled re-wire plus the profile's compute time.
//
// The model decoded is the profile's (e.g. Llama-3.1-8B F16, 16.07 GB), at a fixed address the
// sim only compares: the GGUF file the benchmark prepares is not read. Each policy gets a fresh
// SimBackend (a fresh process), so no policy inherits another's wired memory.
#pragma once

#include <memory>
#include <string>

#include "residency/status.hpp"
#include "workload/idle_target.hpp"

namespace residency::workload {

struct SimIdleOptions {
  std::string profile;             // a sim_profile_names() entry; "" = the default profile
  bool decaying_requests = false;  // the macOS 26 behaviour (requests lapse unless refreshed)
};

// Errors: an unknown profile (the message lists the accepted names).
Result<std::unique_ptr<IdleTarget>> make_sim_idle_target(const SimIdleOptions& sim = {});

}  // namespace residency::workload
