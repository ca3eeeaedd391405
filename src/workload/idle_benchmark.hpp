// SPDX-License-Identifier: MIT
// The idle benchmark: llama.cpp's llama-idle (pause, decode one token, repeat), with several
// residency policies measured side by side in one run.
//
// llama-idle shows what an idle pause costs the next token; it cannot show what a residency
// policy buys back, because one process runs one policy. Here every policy runs on the same model
// in the same run, interleaved so that whatever drifts on the machine (page-cache state, other
// load, thermal state) hits all of them alike: the run is a sequence of blocks, one per (pause,
// policy), in pause order, with the order of the policies rotated from one pause to the next.
// The targets (idle_target.hpp) only provide what differs between backends; this loop is the
// only place that drives a manager.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "residency/status.hpp"
#include "workload/idle_target.hpp"
#include "workload/pressure.hpp"

namespace residency::workload {

struct IdleSchedule {
  std::vector<Nanos> pauses;
  int iters = 3;
};

// llama-idle's: pauses 0 to 4000 ms in steps of 800, 3 iterations each.
IdleSchedule llama_idle_schedule();

// "0,800,1600" (milliseconds, or with a unit: "500ms", "2s"), each >= 0 and at most one hour.
Result<std::vector<Nanos>> parse_pauses(std::string_view text);

struct IdleSample {
  std::size_t policy = 0;  // index into IdleResults::policies
  std::size_t pause = 0;   // index into the schedule's pauses
  int iter = 0;
  double decode_ms = 0;
  double idle_ms = 0;  // measured pause, pressure included
  double pressure_ms = 0;
  double resident_before = -1;  // fraction of the model resident before the decode; < 0 unknown
  std::optional<HogRun> hog;    // hog:SIZE: what the hog got and how long it waited
};

struct IdleWarmup {
  std::size_t policy = 0;
  std::size_t pause = 0;
  double decode_ms = 0;
};

struct IdleCell {
  int n = 0;
  double mean_ms = 0;
  double sd_ms = 0;             // sample standard deviation (n - 1), as llama-idle prints it
  double resident_before = -1;  // mean over the samples; < 0 unknown
};

struct IdleResults {
  std::vector<IdlePolicy> policies;
  IdleSchedule schedule;
  Pressure pressure;
  std::vector<IdleSample> samples;  // in the order they were taken
  std::vector<IdleWarmup> warmups;
  double wall_seconds = 0;

  IdleCell cell(std::size_t policy, std::size_t pause) const;
};

// Receives progress as the run goes (for printing and progress bars). Every method has a default.
class IdleObserver {
 public:
  virtual ~IdleObserver() = default;
  // Block `block` of `blocks` starts: `policy` at pause index `pause`.
  virtual void block_start(const IdleResults&, std::size_t /*policy*/, std::size_t /*pause*/, std::size_t /*block*/,
                           std::size_t /*blocks*/) {}
  virtual void warmup(const IdleResults&, const IdleWarmup&) {}
  // An iteration's pause begins (for progress bars during long pauses).
  virtual void pausing(const IdleResults&, std::size_t /*policy*/, std::size_t /*pause*/, int /*iter*/) {}
  virtual void sample(const IdleResults&, const IdleSample&) {}
  virtual void block_end(const IdleResults&, std::size_t /*policy*/, std::size_t /*pause*/) {}
  // Non-empty: why the run must stop now (its output cannot be written: a `| head` that has
  // exited); asked after each call above, and the run returns it as an io_error.
  virtual std::string stop_reason() const { return {}; }
};

struct IdleBenchmarkOptions {
  IdleSchedule schedule;
  std::vector<IdlePolicy> policies;
  Pressure pressure;  // one the target accepts (IdleTarget::check_pressure)
  // Receives the managers' log lines (filtered by log_level) and the benchmark's warnings (a
  // policy that could not wire the model); empty: stderr.
  LogCallback log;
  LogLevel log_level = LogLevel::warn;
  // What every policy's manager starts from (the RESIDENCY_* environment: wired limit, layout, set
  // cap, pressure floor and quiet, memory limit). Each policy sets keep_alive and
  // release_on_pressure; log_level above sets the log level; the target may fix the layout.
  Config config;
};

// A block creates its policy's residency::Manager over the target's backend and has the target
// place the model's memory under it, decodes once to warm up (as llama-idle does once at start;
// here it also makes the block's first pause start right after a decode under the block's own
// policy), then runs `iters` iterations of pause + pressure + decode, and destroys the manager,
// so that no policy benefits from another's residency. Every decode is what an engine does under
// the policy: keep-alive, forever and off call Manager::touch() first, policy 0 opens
// Manager::use() around the pass; its time includes any re-wire and ends when the pass's result
// is available, before a policy-0 release.
//
// Runs the whole schedule for every policy on `target` (already prepared). Errors from the target
// or a manager stop the run and are returned (the block's manager is destroyed first).
Result<IdleResults> run_idle_benchmark(IdleTarget& target, const IdleBenchmarkOptions& options,
                                       IdleObserver* observer = nullptr);

// How long the schedule will take at least (pauses only) and with `decode_ms` per decode.
double estimate_seconds(const IdleSchedule& schedule, std::size_t policies, double decode_ms);

// Output follows llama-idle's per-iteration and per-pause lines exactly, so that its users can
// compare; the table, CSV and JSON add what it cannot show.
//
// llama-idle's lines: "  - decode time: %8.2f ms" and
// "iters: %4d, pause: %5d ms, avg decode time: %8.2f +/- %4.2f ms".
std::string format_decode_line(double ms);
std::string format_summary_line(const IdleCell& cell, Nanos pause);

// One table, pause x policy, "mean +/- sd" in ms; aligned Markdown, readable in a terminal.
std::string format_idle_table(const IdleResults& results);
// hog:SIZE: how long the hog waited for its memory under each policy (mean over the pauses it
// ran in, and how often it never got it); empty when no sample has a hog.
std::string format_hog_waits(const IdleResults& results);
// One line that says what the keep-alive did, for a run with the policies off and keep-alive: after
// the longest pause shorter than the keep-alive, its decode time against off's, and after the
// longest pause past it, whether the memory was given back as set ("verdict: ..."). Empty when the
// run has no such pair or no pause shorter than the keep-alive but 0.
std::string format_idle_verdict(const IdleResults& results);
// One row per sample: policy,pause_ms,iter,decode_ms,idle_ms,pressure_ms,resident_before_pct.
std::string format_idle_csv(const IdleResults& results);

}  // namespace residency::workload
