// SPDX-License-Identifier: MIT
// `residency idle` as a library call: what the command line asked for, checked once, then run,
// with the results written where they are announced.
//
// The subcommand (tools/residency/idle.cpp) only parses its command line into an IdleRequest and
// prints; everything else is here, in three steps that keep bad input apart from failures:
//   parse_idle_options(request)   every text field checked, in this one place: an error is bad
//                                 input (one line, the tool exits 2).
//   IdleRun::create(options)      what the machine must allow, still before anything is
//                                 created: the backend starts, the model file opens and its types
//                                 are decoded, the pressure fits the target, a synthetic model
//                                 fits on disk, --out can be written (read-only, full, no
//                                 permission: found here, before the run). An error is bad input too.
//   IdleRun::run(reporter)        writes the synthetic model (if any), runs the benchmark, writes
//                                 idle.json, idle.csv and idle.png into the result directory and
//                                 returns their paths. An error is a failure (exit 1); every file
//                                 created is removed on errors and on the signals that end a run
//                                 (workload/cleanup.hpp).
// The result directory is the one given, or else a new temporary directory
// (residency-idle-XXXXXX, on disk where possible: $TMPDIR, /var/tmp, /tmp), never the current
// directory: a synthetic model is written there and removed after the run.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "residency/config.hpp"
#include "residency/status.hpp"
#include "workload/gguf.hpp"
#include "workload/gguf_writer.hpp"
#include "workload/idle_benchmark.hpp"
#include "workload/idle_report.hpp"
#include "workload/idle_target.hpp"

namespace residency::workload {

// What the user asked for, as typed. Defaults are the command line's. An optional field that is
// empty was not given; given, even as "", it is checked (never silently read as "not given").
struct IdleRequest {
  std::string model;  // GGUF file; empty: a synthetic llama-shaped model
  std::string backend = "posix";
  std::string policies = "off,keep-alive,0,forever";
  // The keep-alive policy's duration. Not given: the environment's (RESIDENCY_KEEP_ALIVE or its
  // aliases), else keep_alive_default.
  std::optional<std::string> keep_alive;
  std::string keep_alive_default = "180s";
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
IdleRequest idle_demo_request();

// An IdleRequest checked: nothing in it needs checking again.
struct IdleOptions {
  std::string backend;
  IdleTargetOptions target;
  IdleBenchmarkOptions benchmark;  // schedule, policies, pressure, log level (no log callback yet)
  std::string pressure_text;       // as given, for messages
  std::string model_path;          // empty: `synthetic`
  std::optional<LlamaShape> synthetic;
  std::string out_dir;  // empty: a new temporary directory
  bool plot = true;
  // What was read from the environment or left unused, one line each, for the user to see
  // ("RESIDENCY_RELEASE_ON_PRESSURE is not used: ...").
  std::vector<std::string> notes;
};

Result<IdleOptions> parse_idle_options(const IdleRequest& request);

// Where a run reports to. Lines and warnings come from the calling thread; log() may also come
// from the managers' scheduler threads.
class IdleReporter : public IdleObserver {
 public:
  virtual void line(const std::string& text) = 0;     // for the user (stdout), without newline
  virtual void warning(const std::string& text) = 0;  // one line
  virtual void note(const std::string& text) { warning(text); }  // one line: what was done with an input
  virtual void log(LogLevel level, std::string_view message) = 0;
  // The benchmark is about to start / has ended (progress bars).
  virtual void run_starts(const IdleSchedule&, std::size_t /*policies*/) {}
  virtual void run_ends() {}
};

struct IdleOutcome {
  IdleResults results;
  IdleRunInfo info;
  std::string model_text;          // for the table's caption: "1 GiB model", "profile ..., modelled"
  std::string out_dir;             // where the results are
  std::vector<std::string> files;  // exactly the files written there: idle.json, idle.csv[, idle.png]
  bool synthetic_model_removed = false;
};

class IdleRun {
 public:
  // Errors: bad input (see the top of this file); nothing has been created.
  static Result<std::unique_ptr<IdleRun>> create(IdleOptions options);
  ~IdleRun();
  IdleRun(const IdleRun&) = delete;
  IdleRun& operator=(const IdleRun&) = delete;

  // Once. Errors: a failure while running; the files it created are removed.
  Result<IdleOutcome> run(IdleReporter& reporter);

 private:
  IdleRun() = default;
  IdleOptions options_;
  std::unique_ptr<IdleTarget> target_;
  std::optional<GgufFile> user_model_;
  std::string model_parent_;  // synthetic model only
  std::string results_parent_;  // no out_dir only
  std::string tmpfs_warning_;
};

}  // namespace residency::workload
