// IdleTarget: where `residency idle` runs its decodes, one implementation per backend.
//
// The idle benchmark (idle_benchmark.hpp) is llama.cpp's llama-idle: pause, decode one token,
// repeat, under several residency policies measured in the same run. What a "decode" and a
// "pause" are depends on the backend: on posix the model is a read-only file mapping, a decode is
// the CPU decode-equivalent pass, a pause is real time with optional memory pressure; on sim a
// decode's cost is modelled and a pause advances a virtual clock; on cuda the weights live in
// device memory allocated through Manager::allocate and a decode is a GPU kernel. The benchmark
// only sees this interface, so the schedule, interleaving, statistics and output are the same for
// all of them.
//
// Contract, in call order (the benchmark calls from one thread, never concurrently):
//   check_pressure(p)  before anything is created: can this target apply pressure p? An error here
//                      is bad input (the tool exits 2).
//   prepare(model)     once: load the model (map, copy to the device, size the simulation).
//   activate(policy)   make `policy` the one in force: a fresh residency::Manager with that
//                      KeepAlive over the model's memory, through the real backend. Whatever the
//                      previous policy held must be given back first, so that no policy benefits
//                      from another's residency.
//   pause(d, p)        stay idle for d on clock(), then apply pressure p (not for d == 0), and
//                      report how much of the model was still resident afterwards.
//   decode()           one decode as an engine does it under the policy: keep-alive, forever and
//                      off call Manager::touch() first, policy 0 opens Manager::use() around the
//                      pass; the elapsed time includes any re-wire, and ends when the pass's result
//                      is available (after the device synchronises), before a policy-0 release.
//   deactivate()       destroy the manager (residency given back).
//
// Adding a target (sim, cuda): implement this class in your own file (e.g.
// src/workload/sim/idle_sim.cpp), declare its factory in idle_target.cpp under
// `#if RESIDENCY_IDLE_HAVE_<NAME>` and add a line to make_idle_target() and idle_backends()
// there; your folder's CMakeLists adds the sources with target_sources(residency_workload ...)
// and target_compile_definitions(residency_workload PRIVATE RESIDENCY_IDLE_HAVE_<NAME>=1).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "residency/clock.hpp"
#include "residency/config.hpp"
#include "residency/residency.hpp"
#include "residency/status.hpp"
#include "workload/gguf.hpp"
#include "workload/pressure.hpp"

namespace residency::workload {

// One column of the benchmark's table.
struct IdlePolicy {
  enum class Kind : std::uint8_t { off, keep_alive, zero, forever };
  Kind kind = Kind::off;
  KeepAlive keep_alive = KeepAlive::off();  // what the Manager is configured with
  std::string id;    // as --policies spells it: "off", "keep-alive", "0", "forever"
  std::string name;  // for tables and plots: "off", "keep-alive 2 s", "0", "forever"
};

// A comma-separated list of policy ids (each at most once): off, keep-alive, 0, forever.
// `keep_alive` is the duration of the keep-alive policy (must be > 0).
Result<std::vector<IdlePolicy>> parse_policies(std::string_view list, Nanos keep_alive);

struct PauseOutcome {
  Nanos idle{0};            // time from the call to the end of the pressure, on clock()
  Nanos pressure_time{0};   // part of it spent applying pressure
  double resident_before = -1;  // fraction of the model resident after the pause; < 0 unknown
};

struct DecodeOutcome {
  Nanos elapsed{0};  // on clock()
  double checksum = 0;
};

class IdleTarget {
 public:
  virtual ~IdleTarget() = default;
  // One line for the run's header: backend, threads, device, kernel set ...
  virtual std::string describe() const = 0;
  // The clock every pause and decode is timed on (and the managers use).
  virtual Clock& clock() = 0;
  virtual Status check_pressure(const Pressure& pressure) const = 0;
  virtual Status prepare(const GgufFile& model) = 0;
  virtual Status activate(const IdlePolicy& policy) = 0;
  virtual void deactivate() = 0;
  virtual Result<PauseOutcome> pause(Nanos duration, const Pressure& pressure) = 0;
  virtual Result<DecodeOutcome> decode() = 0;
};

struct IdleTargetOptions {
  unsigned threads = 0;  // decode threads; 0 = one per core
  // Receives the managers' log lines (filtered by log_level) and the target's warnings.
  LogCallback log;
  LogLevel log_level = LogLevel::warn;
  // sim only: the machine-and-model profile ("" = the default) and the macOS 26 mode in which
  // residency requests decay unless refreshed.
  std::string sim_profile;
  bool sim_decaying_requests = false;
};

// The names --backend accepts in this build, default first.
std::vector<std::string> idle_backends();
// Errors: an unknown name (lists the accepted ones), or a backend that cannot start here.
Result<std::unique_ptr<IdleTarget>> make_idle_target(std::string_view backend, const IdleTargetOptions& options);

// What every target's Manager starts from in activate(): the policy's keep-alive, the user's log
// and level, the target's backend. The target adds what is its own (layout, clock, scheduler).
ManagerOptions policy_manager_options(const IdlePolicy& policy, const IdleTargetOptions& options,
                                      std::shared_ptr<Backend> backend);

// The posix target (idle_posix.cpp).
Result<std::unique_ptr<IdleTarget>> make_posix_idle_target(const IdleTargetOptions& options);

}  // namespace residency::workload
