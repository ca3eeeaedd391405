// SPDX-License-Identifier: MIT
// llama-idle side by side: the real, unmodified llama-idle of llama.cpp, run as child processes in
// several configurations, with pressure applied from outside.
//
// `residency idle` measures our own decode pass; this measures llama.cpp itself, with the tool
// the seed's figures come from. llama-idle runs a fixed schedule in one process (a warm-up decode,
// then pauses 0 to 4000 ms in steps of 800, 3 decodes each, printing "  - decode time: X ms"), so
// configurations cannot be interleaved inside a run; they are interleaved by run instead: each
// round runs every configuration once, the order rotated from round to round, so that whatever
// drifts on the machine hits all alike.
#pragma once

#include <string>
#include <vector>

#include "residency/clock.hpp"
#include "residency/status.hpp"
#include "workload/idle_benchmark.hpp"
#include "workload/pressure.hpp"

namespace residency::workload {

// The configurations:
//   mmap        llama.cpp's default: the model file mapped, nothing locked
//   mlock       llama.cpp's --load-mode mlock (what --mlock, now deprecated, means): the model
//               read into memory and locked at load, until exit
//   keep-alive  residency through the preload (LD_PRELOAD=libresidency_preload.so), keep-alive K
//   pressure-aware  the same with RESIDENCY_RELEASE_ON_PRESSURE=1 (graded release on PSI events;
//               real pressure, hog:SIZE, makes them: pageout alone stalls nobody)
//   0           residency through the preload, keep-alive 0 (locked only inside each decode)
//   no-mmap     llama.cpp's --load-mode none (the deprecated --no-mmap): the model read into
//               anonymous memory
//   engine      examples/llama_engine, the linked example, on the same schedule (its own threads)
struct LlamaIdleConfig {
  std::string id;    // mmap, mlock, keep-alive, 0, no-mmap, engine
  std::string name;  // for tables: "mmap (default)", "residency keep-alive 2 s", ...
};

struct LlamaIdleOptions {
  std::string llama_idle;            // the llama-idle binary
  std::string preload;               // libresidency_preload.so; needed by keep-alive and 0
  std::string engine;                // the llama_engine example; needed by engine
  std::string model;                 // GGUF file
  std::vector<std::string> configs;  // ids, in the order of the table
  Nanos keep_alive = std::chrono::seconds(2);
  // Pressure, from outside, at the end of each pause (150 ms before its end, for pauses > 0):
  // pageout = process_madvise(MADV_PAGEOUT) over the child's mappings of the model file and its
  // anonymous mappings (the weights llama.cpp repacked at load live there; with swap on they are
  // swapped out), then POSIX_FADV_DONTNEED on the file (the kernel skips locked pages);
  // hog:SIZE = a second process touching SIZE bytes during the pause.
  Pressure pressure;
  int rounds = 1;
  // llama.cpp's extra buffer types (AMX, CPU_REPACK) off in every configuration: -nr.
  bool no_repack = false;
  int engine_threads = 2;
  // Children get this process's RESIDENCY_* variables (except those each configuration sets:
  // RESIDENCY_KEEP_ALIVE, RESIDENCY_RELEASE_ON_PRESSURE); false: none of them.
  bool pass_environment = false;
};

// llama-idle's schedule, which the binary fixes: pauses 0..4000 ms step 800, 3 iterations each.
IdleSchedule llama_idle_fixed_schedule();
// The configurations a list names ("mmap,mlock,keep-alive,0,no-mmap,engine"). Errors name the
// unknown id and the accepted ones.
Result<std::vector<LlamaIdleConfig>> parse_llama_idle_configs(const std::string& list, Nanos keep_alive);
// Checks before anything runs: the binaries exist and are executable, the preload or engine is
// there when a configuration needs it, the model opens and has a BOS token, the keep-alive fits
// the last pause, the pressure is possible. Errors are bad input. `check_model` false: all but the
// model (which may not be written yet).
Status check_llama_idle_options(const LlamaIdleOptions& options, bool check_model = true);

// What a configuration still held near the end of the last pause: read 300 ms before the end of
// the last 4 s pause (so 3.7 s after a decode, past a keep-alive of up to 3.5 s): the child's
// VmLck, RssAnon and VmSwap, and the fraction of the model file's pages resident (mincore).
struct LlamaIdleHeld {
  std::uint64_t vm_lck = 0;  // bytes
  // Anonymous memory in RAM and swapped out, bytes: where llama.cpp keeps weights it repacked at
  // load (AMX, CPU_REPACK), its KV cache and compute buffers.
  std::uint64_t rss_anon = 0;
  std::uint64_t vm_swap = 0;
  double resident_fraction = -1;  // of the model's pages; < 0 unknown
};

struct LlamaIdleOutcome {
  IdleResults results;                    // one "policy" per configuration
  std::vector<LlamaIdleHeld> held;        // per configuration (the last round's)
  std::vector<std::string> stderr_tails;  // per configuration: the last lines a child wrote there
};

class LlamaIdleObserver {
 public:
  virtual ~LlamaIdleObserver() = default;
  // A child starts (configuration index, round) and prints one of llama-idle's lines.
  virtual void child_starts(const LlamaIdleConfig&, int /*round*/) {}
  virtual void child_line(const LlamaIdleConfig&, const std::string& /*line*/) {}
};

// Runs every round; an error stops the run (a child that failed, with its stderr's last lines).
// Decodes that fail are noticed: llama-idle prints its times even when llama_decode fails (a
// model without a BOS token: 0.02 ms "decodes"), so a run whose decodes are implausibly fast, or
// whose stderr reports a failed decode, or that does not print the whole schedule, is an error.
Result<LlamaIdleOutcome> run_llama_idle(const LlamaIdleOptions& options, LlamaIdleObserver* observer = nullptr);

// One held-memory table: configuration, VmLck, resident share of the model.
std::string format_llama_idle_held(const LlamaIdleOutcome& outcome);

}  // namespace residency::workload
