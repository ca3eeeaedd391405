// SPDX-License-Identifier: MIT
// `residency idle`'s command line, read once: the text the user gave (IdleRequest) becomes the
// typed request the library runs (workload::IdleOptions: durations, sizes, policies, pressure and
// the RESIDENCY_* configuration as values).
//
// Why here and not in the library: the library (workload/idle_run.hpp) takes only values, so
// nothing below the tool parses the user's text again. Every text field is checked in this one
// function, in a fixed order, and a bad one is one line (the tool exits 2). What the machine must
// allow (the model file, the backend, --out) is the library's IdleRun::create to check.
#pragma once

#include <chrono>
#include <optional>
#include <string>

#include "residency/config.hpp"
#include "residency/status.hpp"
#include "workload/idle_run.hpp"

namespace residency::tool {

// What the user asked for, as typed. Defaults are the command line's. An optional field that is
// empty was not given; given, even as "", it is checked (never silently read as "not given").
struct IdleRequest {
  std::string model;  // GGUF file; empty: a synthetic llama-shaped model
  std::string backend = "posix";
  std::string policies = "off,keep-alive,0,forever";
  // The keep-alive policy's duration. Not given: the environment's (RESIDENCY_KEEP_ALIVE or its
  // aliases), else keep_alive_default.
  std::optional<std::string> keep_alive;
  Nanos keep_alive_default = std::chrono::seconds(180);
  std::optional<std::string> pressure;  // not given: pageout on posix, none elsewhere (a posix notion)
  std::optional<std::string> pauses;    // not given: llama-idle's
  int iters = 3;
  std::string out;  // result directory; empty: a new temporary directory
  // The synthetic model's size and type; refused with a MODEL. Not given: 1 GiB (16 MiB for
  // --backend sim, which models its own size), f16.
  std::optional<std::string> model_size;
  std::optional<std::string> type;
  std::string profile;             // --backend sim only
  bool decaying_requests = false;  // --backend sim only
  unsigned threads = 0;
  bool plot = true;
  bool verbose = false;  // also the managers' info lines (each release and re-wire)
  // Where the RESIDENCY_* configuration comes from (Config::from_env): what the fields above do
  // not set (wired limit, layout, set cap, pressure floor and quiet, log level, the keep-alive's
  // duration). The tool passes the process environment; empty: none, the library's defaults.
  Config::EnvLookup env;
};

// The accepted ranges of IdleRequest::iters (1 to this) and ::threads (0 = one per core, to this).
inline constexpr int kIdleMaxIters = 1000;
inline constexpr unsigned kIdleMaxThreads = 1024;

// The no-argument demonstration: keep-alive 2 s against `off`, short enough that the default
// pauses (up to 4 s) cross it, so one run shows both sides of it.
// The demonstration (policies off and keep-alive, the keep-alive 2 s unless the environment sets
// it) over `base`, whose output choices it keeps (--out, --no-plot, -v, --iters, --threads).
IdleRequest idle_demo_request(IdleRequest base = {});
// Whether an option of `residency idle` (its names as CLI11 lists them) is about the output only,
// so that giving it still runs the demonstration.
bool idle_option_keeps_demo(const std::string& names);

// The request checked and read into values: nothing in the result is parsed again. Errors are
// bad input, one line naming the option (or variable), the value and what is accepted.
Result<workload::IdleOptions> parse_idle_options(const IdleRequest& request);

}  // namespace residency::tool
