// SPDX-License-Identifier: MIT
// The sim's built-in profiles: an M2 Ultra running Llama-3.1-8B at three quantisations,
// calibrated to the only published measurement of the idle penalty (llama.cpp PR 10119,
// `llama-idle`: sleep, decode one token, repeat; no residency sets).
//
// Published decode times (the tables of llama.cpp PR 10119):
//   F16   29 ms up to a 1000 ms pause, 227 ms at 1200 ms, 413-472 ms from 1400 ms up
//   Q8_0  19 ms up to 1000 ms,         106 ms at 1200 ms, 225-299 ms from 1400 ms up
//   Q4_0  14 ms up to 800 ms, 24 ms at 1000 ms, 86 ms at 1200 ms, 158-216 ms from 1400 ms up
//
// The model (SimBackend): after a pause p the collector has unwired
//     u(p) = clamp((p - collector_delay) x collector_rate, 0, model_bytes)
// bytes (it starts collector_delay after the last GPU use and unwires at a constant rate),
// and the next decode takes
//     decode(p) = decode_compute + u(p) / rewire_rate.
// Four numbers per profile, fitted to each run as follows:
//   decode_compute = the short-pause time;
//   rewire_rate    = model_bytes / (midpoint of the long-pause range - decode_compute): the
//                    long-pause decode re-wires the whole model;
//   collector_delay, collector_rate from the points where the model is partly unwired
//                    (1200 ms; and 1000 ms for Q4_0, the only run with a penalty there).
// The three runs do not agree on one rate: the fitted re-wire rates are 39, 35 and 27 GB/s
// and the collector rates 38.5, 30.6 and 8.3 GB/s. The model does not try to explain that
// (the figures are averages of 3 decodes each, on one machine); each profile reproduces its
// own run, and the re-wire cost still grows with model size, as observed.
//
// Machine: the llama-idle figures were measured on an M2 Ultra with 192 GB; Metal reports
// recommendedMaxWorkingSetSize = 147456 MiB there (75 % of memory, as llama.cpp's start-up log
// prints it on that machine).
//
// Model sizes: Llama-3.1-8B has 8.03e9 parameters; GGUF files are about 16.07 GB (F16, 2 bytes
// a weight), 8.54 GB (Q8_0, 8.5 bits) and 4.66 GB (Q4_0, 4.5 bits plus a larger output layer).
#include <algorithm>
#include <string>

#include "residency/backends/sim.hpp"
#include "residency/config.hpp"
#include "residency/text.hpp"

namespace residency {
namespace {

constexpr std::uint64_t kGiB = 1024ULL * 1024 * 1024;
constexpr std::uint64_t kMiB = 1024ULL * 1024;
// M2 Ultra, 192 GB of unified memory.
constexpr std::uint64_t kM2UltraPhysical = 192 * kGiB;
// recommendedMaxWorkingSetSize on that machine (llama.cpp log: 147456.00 MB).
constexpr std::uint64_t kM2UltraRecommended = 147456 * kMiB;

using std::chrono::microseconds;
using std::chrono::milliseconds;

SimProfile m2_ultra(std::string name, std::string description) {
  SimProfile p;
  p.name = std::move(name);
  p.description = std::move(description);
  p.physical = kM2UltraPhysical;
  p.recommended_working_set = kM2UltraRecommended;
  return p;
}

std::vector<SimProfile> profiles() {
  std::vector<SimProfile> all;

  // F16: compute 29 ms. Long pauses 413-472 ms, midpoint 442.5 ms: 413.5 ms re-wires
  // 16.07 GB, rewire_rate = 16.07e9 / 0.4135 s = 38.9 GB/s. No penalty at 1000 ms and the
  // dossier's "about 1 s": collector_delay = 1.0 s. At 1200 ms, 198 ms extra = 7.70 GB
  // re-wired, unwired in 0.2 s: collector_rate = 38.5 GB/s. Check: 1400 ms gives 15.4 GB
  // unwired, 425 ms (in the published range); 2000 ms and up 442 ms.
  {
    SimProfile p = m2_ultra("m2-ultra-8b-f16", "M2 Ultra 192 GB, Llama-3.1-8B F16 (16.07 GB), llama-idle PR 10119");
    p.collector_delay = milliseconds(1000);
    p.collector_rate = 38.5e9;
    p.rewire_rate = 38.9e9;
    p.model_bytes = 16'070'000'000ULL;
    p.decode_compute = milliseconds(29);
    all.push_back(p);
  }
  // Q8_0: compute 19 ms. Long pauses 225-299 ms, midpoint 262 ms: 243 ms re-wires 8.54 GB,
  // rewire_rate = 35.1 GB/s. At 1200 ms, 87 ms extra = 3.06 GB. Its 1400 ms figure (>= 225 ms,
  // more than twice the 1200 ms penalty) needs the collector to start later than in the F16
  // run: collector_delay = 1.1 s, so 3.06 GB in 0.1 s, collector_rate = 30.6 GB/s. Check:
  // 1000 ms 19 ms; 1400 ms and up the whole model, 262 ms.
  {
    SimProfile p = m2_ultra("m2-ultra-8b-q8_0", "M2 Ultra 192 GB, Llama-3.1-8B Q8_0 (8.54 GB), llama-idle PR 10119");
    p.collector_delay = milliseconds(1100);
    p.collector_rate = 30.6e9;
    p.rewire_rate = 35.1e9;
    p.model_bytes = 8'540'000'000ULL;
    p.decode_compute = milliseconds(19);
    all.push_back(p);
  }
  // Q4_0: compute 14 ms. Long pauses 158-216 ms, midpoint 187 ms: 173 ms re-wires 4.66 GB,
  // rewire_rate = 26.9 GB/s. Extra 10 ms at 1000 ms (0.27 GB) and 72 ms at 1200 ms (1.94 GB):
  // collector_rate = (1.94 - 0.27) GB / 0.2 s = 8.34 GB/s, started 0.27 / 8.34 = 32 ms before
  // 1000 ms: collector_delay = 968 ms. Check: 800 ms 14 ms; 1400 ms 148 ms (6 % under the
  // published range, the one point this profile misses); 2000 ms and up 187 ms.
  {
    SimProfile p = m2_ultra("m2-ultra-8b-q4_0", "M2 Ultra 192 GB, Llama-3.1-8B Q4_0 (4.66 GB), llama-idle PR 10119");
    p.collector_delay = microseconds(968'000);
    p.collector_rate = 8.34e9;
    p.rewire_rate = 26.9e9;
    p.model_bytes = 4'660'000'000ULL;
    p.decode_compute = milliseconds(14);
    all.push_back(p);
  }
  return all;
}

}  // namespace

std::vector<std::string> sim_profile_names() {
  std::vector<std::string> names;
  for (const auto& p : profiles()) names.push_back(p.name);
  return names;
}

Result<SimProfile> sim_profile(std::string_view name) {
  std::string accepted;
  for (const auto& p : profiles()) {
    if (p.name == name) return p;
    accepted += (accepted.empty() ? "" : ", ") + p.name;
  }
  return Status(ErrorCode::invalid_argument, "unknown sim profile '" + printable(name) + "'; accepted: " + accepted);
}

SimProfile default_sim_profile() { return profiles().front(); }

}  // namespace residency
