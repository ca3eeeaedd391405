// SPDX-License-Identifier: MIT
// IdleTarget: where `residency idle` runs its decodes, one implementation per backend.
//
// The idle benchmark (idle_benchmark.hpp) is llama.cpp's llama-idle: pause, decode one token,
// repeat, under several residency policies measured in the same run. What a "decode" and a
// "pause" are depends on the backend (see make_idle_target()).
//
// The one design decision: the data flows one way, benchmark -> target -> backend. The benchmark
// owns the residency policy: it creates each policy's residency::Manager, has the target place
// the model's memory under it, calls touch() (or opens use() for policy 0) around every decode
// and destroys the manager between policies. A target never holds a manager and never decides
// when memory is used; it only provides what differs between backends, below.
#pragma once

#include <functional>
#include <memory>
#include <optional>
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
  std::string id;                    // as --policies spells it: "off", "keep-alive", "pressure-aware", "0", "forever"
  std::string name;                  // for tables and plots: "off", "keep-alive 2 s", "0", "forever"
  bool release_on_pressure = false;  // pressure-aware: the keep-alive, given back under pressure
};

// A comma-separated list of policy ids (each at most once): off, keep-alive, pressure-aware
// (keep-alive with graded release under memory pressure), 0, forever.
// `keep_alive` is the duration of the keep-alive policy (must be > 0).
Result<std::vector<IdlePolicy>> parse_policies(std::string_view list, Nanos keep_alive);
// Gives the keep-alive policies among `policies` (keep-alive, pressure-aware) the duration
// `keep_alive` (> 0), and the name that says it: for a caller that reads the list before it
// knows the duration, so that the list is read once.
void set_keep_alive(std::vector<IdlePolicy>& policies, Nanos keep_alive);

// How time passes during one policy's block. On real time, pass() waits on the clock. On virtual
// time (IdleTarget::virtual_clock()) it advances the clock itself, stopping at every deadline
// the policy's manager reports (refresh, keep-alive expiry) to run what is due then, as the
// manager's scheduler thread would wake. Made by the benchmark for each policy; a target uses it
// for pauses and for work whose duration it models.
class IdleTime {
 public:
  // `manager` runs without a scheduler thread when `virtual_clock` is given; it must outlive this.
  IdleTime(Clock& clock, ManualClock* virtual_clock, Manager& manager)
      : clock_(clock), virtual_(virtual_clock), manager_(manager) {}
  Nanos now() const { return clock_.now(); }
  void pass(Nanos d);

 private:
  Clock& clock_;
  ManualClock* virtual_;
  Manager& manager_;
};

// Contract, in call order (the benchmark calls from one thread, never concurrently):
//   check_pressure(p)  before anything is created: can this target apply pressure p? An error here
//                      is bad input (the tool exits 2). Called once, by whoever validates input.
//   prepare(model)     once: load the model (map it, pin a copy for the device, size the simulation).
//   per policy:
//     policy_backend()   the backend the policy's manager drives.
//     place_model(m)     put the model's memory under manager m; the benchmark unregisters the
//                        returned regions before it destroys m.
//     per decode: decode_starts(), then (touch() or use(synchronize())), decode_pass(time).
//     per pause:  time.pass(d), apply_pressure(p) (only for d > 0 and p not none),
//                 resident_fraction().
class IdleTarget {
 public:
  virtual ~IdleTarget() = default;
  // One line for the run's header: backend, threads, device, kernel set ...
  virtual std::string describe() const = 0;
  // The clock every pause and decode is timed on, and every policy's manager runs on.
  virtual Clock& clock() = 0;
  // Non-null for virtual time: clock() is this ManualClock, which only the benchmark advances
  // (through IdleTime); managers then run without a scheduler thread.
  virtual ManualClock* virtual_clock() { return nullptr; }
  // Can this target apply `pressure`? The error says what to use instead.
  virtual Status check_pressure(const Pressure& pressure) const = 0;
  virtual Status prepare(const GgufFile& model) = 0;

  // The backend for the next policy's manager: the same one each time, or a fresh one where a
  // policy could otherwise inherit another's state (sim: a fresh process).
  virtual Result<std::shared_ptr<Backend>> policy_backend() = 0;
  // The set layout the model's memory needs; nullopt: the configuration's default.
  virtual std::optional<Layout> layout() const { return std::nullopt; }
  // Places the model's memory under `manager`: registers the host memory the target mapped, or
  // allocates device memory through it and fills it. Returns every region it registered.
  virtual Result<std::vector<RegionId>> place_model(Manager& manager) = 0;
  // True when the first release of the placed memory pays a one-time set-up (cuda pins its host
  // backup): the benchmark then releases and re-wires it once before timing anything.
  virtual bool first_release_sets_up() const { return false; }
  // True when a decode cannot run on memory that is not resident (device memory): a use scope
  // that could not wire is then an error, not a warning.
  virtual bool decode_needs_residency() const { return false; }
  // Waits for the work a decode submitted (policy 0 runs it before releasing); empty: nothing.
  virtual std::function<void()> synchronize() { return {}; }

  // A decode starts, before the benchmark's touch() or use(): a target that accounts the
  // decode's cost itself (sim: the re-wire time its backend models) notes where it stands.
  virtual void decode_starts() {}
  // One decode pass over the placed memory; returns when its result is available (after the
  // device synchronises) with the pass's checksum. Modelled work passes on `time`.
  virtual Result<double> decode_pass(IdleTime& time) = 0;
  // Applies `pressure` (never none) at the end of a pause.
  virtual Status apply_pressure(const Pressure& pressure) = 0;
  // What the last hog:SIZE pressure got (how long it waited for its memory); nullopt when the
  // target ran none.
  virtual std::optional<HogRun> last_hog() const { return std::nullopt; }
  // Fraction (0..1) of the placed memory resident now; < 0 unknown.
  virtual double resident_fraction() = 0;
};

struct IdleTargetOptions {
  unsigned threads = 0;  // decode threads; 0 = one per core
  // sim only: the machine-and-model profile ("" = the default) and the macOS 26 mode in which
  // residency requests decay unless refreshed.
  std::string sim_profile;
  bool sim_decaying_requests = false;
};

// On posix the model is a read-only file mapping, a decode is the CPU decode-equivalent pass, a
// pause is real time with optional memory pressure; on sim a decode's cost is modelled and a
// pause advances a virtual clock; on cuda the weights live in device memory allocated through
// Manager::allocate and a decode is a GPU kernel.
//
// Adding a target (sim, cuda): implement this class in your own file (e.g.
// src/workload/sim/idle_sim.cpp), declare its factory in idle_target.cpp under
// `#if RESIDENCY_IDLE_HAVE_<NAME>` and add a line to make_idle_target() and idle_backends()
// there; your folder's CMakeLists adds the sources with target_sources(residency_workload ...)
// and target_compile_definitions(residency_workload PRIVATE RESIDENCY_IDLE_HAVE_<NAME>=1).

// The names --backend accepts in this build, default first.
std::vector<std::string> idle_backends();
// Errors: an unknown name (lists the accepted ones), or a backend that cannot start here.
Result<std::unique_ptr<IdleTarget>> make_idle_target(std::string_view backend, const IdleTargetOptions& options);

// The posix target (idle_posix.cpp).
Result<std::unique_ptr<IdleTarget>> make_posix_idle_target(const IdleTargetOptions& options);

}  // namespace residency::workload
