// SPDX-License-Identifier: MIT
// `residency idle` as a library call: one request, given as values, then run, with the results
// written where they are announced.
//
// The subcommand (tools/residency/idle.cpp) reads its command line once into an IdleOptions
// (tools/residency/idle_options.hpp: every text field checked there, an error is bad input, one
// line, the tool exits 2) and prints; nothing here parses the user's text again. The rest is here,
// in two steps that keep bad input apart from failures: IdleRun::create() (an error is bad input
// too) and IdleRun::run() (an error is a failure, exit 1).
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

// One request, as values: what the command line asked for, read once by the tool
// (tools/residency/idle_options.hpp). Nothing in it is parsed again.
struct IdleOptions {
  std::string backend;
  IdleTargetOptions target;
  IdleBenchmarkOptions benchmark;  // schedule, policies, pressure, log level (no log callback yet)
  std::string pressure_text;       // as given, for messages
  std::string model_path;          // empty: `synthetic`
  std::optional<LlamaShape> synthetic;
  // The result directory is the one given, or else a new temporary directory
  // (residency-idle-XXXXXX, on disk where possible: $TMPDIR, /var/tmp, /tmp), never the current
  // directory: a synthetic model is written there and removed after the run.
  std::string out_dir;  // empty: a new temporary directory
  bool plot = true;
  // What was read from the environment or left unused, one line each, for the user to see
  // ("RESIDENCY_RELEASE_ON_PRESSURE is not used: ...").
  std::vector<std::string> notes;
};

// Where a run reports to. Lines and warnings come from the calling thread; log() may also come
// from the managers' scheduler threads.
class IdleReporter : public IdleObserver {
 public:
  virtual void line(const std::string& text) = 0;                // for the user (stdout), without newline
  virtual void warning(const std::string& text) = 0;             // one line
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
  // What the machine must allow, still before anything is created: the backend starts, the model
  // file opens and its types are decoded, the pressure fits the target, a synthetic model fits on
  // disk, --out can be written (read-only, full, no permission: found here, before the run).
  // Errors: bad input (see the top of this file); nothing has been created.
  static Result<std::unique_ptr<IdleRun>> create(IdleOptions options);
  ~IdleRun();
  IdleRun(const IdleRun&) = delete;
  IdleRun& operator=(const IdleRun&) = delete;

  // Once: writes the synthetic model (if any), runs the benchmark, writes idle.json, idle.csv and
  // idle.png into the result directory and returns their paths. Errors: a failure while running;
  // every file it created is removed, on errors and on the signals that end a run
  // (workload/cleanup.hpp).
  Result<IdleOutcome> run(IdleReporter& reporter);

 private:
  IdleRun() = default;
  IdleOptions options_;
  std::unique_ptr<IdleTarget> target_;
  std::optional<GgufFile> user_model_;
  std::string model_parent_;    // synthetic model only
  std::string results_parent_;  // no out_dir only
  std::string tmpfs_warning_;
};

}  // namespace residency::workload
