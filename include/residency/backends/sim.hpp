// SPDX-License-Identifier: MIT
// residency: the sim backend, a deterministic model of a unified-memory OS (macOS on Apple
// Silicon) with injected time.
//
// Why it exists: the behaviour the library is built against (memory unwired about 1 s after its
// last GPU use, a re-wire cost that grows with model size, and the other rules SimProfile and
// SimOptions list) can only be observed on a Mac, slowly and noisily. The sim makes each one an
// explicit rule over a Clock, so that the manager is tested against them in virtual time, in
// milliseconds, on any machine, and `residency idle --backend sim` reproduces llama-idle's figures.
//
// The one design decision that shapes it: the model is evaluated lazily. Nothing runs in the
// background; every call first advances the model to clock.now(), replaying the wired-memory
// collector over that interval event by event. So a ManualClock gives fully deterministic
// results and a SteadyClock gives a real-time simulation, with the same code.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "residency/backend.hpp"
#include "residency/clock.hpp"
#include "residency/status.hpp"

namespace residency {

// A machine plus the model the idle benchmark runs on it. The machine half drives the
// backend; the model half (model_bytes, decode_compute) is what `residency idle --backend
// sim` decodes. Every number and its source is in the definition of the named profiles
// (src/backends/sim/sim_profiles.cpp), with the derivation from the published figures.
struct SimProfile {
  std::string name;
  std::string description;
  std::uint64_t physical = 0;                 // unified memory, bytes
  std::uint64_t recommended_working_set = 0;  // recommendedMaxWorkingSetSize, bytes
  // The wired-memory collector: starts on memory `collector_delay` after its last GPU use
  // (when no live residency request covers it) and unwires `collector_rate` bytes per second,
  // least recently used first.
  Nanos collector_delay{std::chrono::seconds(1)};
  double collector_rate = 0;  // bytes per second
  // Re-wiring costs 1 / rewire_rate seconds per byte, paid by whatever wires it (a residency
  // request, or the GPU work that needs it).
  double rewire_rate = 0;  // bytes per second
  // The model: bytes of weights one decode step reads, and the step's time when every byte
  // is wired.
  std::uint64_t model_bytes = 0;
  Nanos decode_compute{0};
};

// Names of the built-in profiles ("m2-ultra-8b-f16", "m2-ultra-8b-q8_0", "m2-ultra-8b-q4_0").
std::vector<std::string> sim_profile_names();
// The named profile, or an error listing the accepted names.
Result<SimProfile> sim_profile(std::string_view name);
// The profile used when none is given: m2-ultra-8b-f16.
SimProfile default_sim_profile();

struct SimOptions {
  SimProfile profile = default_sim_profile();
  // Time source; must outlive the backend. nullptr: SteadyClock::instance(), a real-time
  // simulation consistent with a Manager on its default clock. Give a ManualClock (the
  // manager's own) for virtual time.
  Clock* clock = nullptr;

  // macOS 26 behaviour: a residency request decays `request_decay` after the later of the
  // request and the set's last GPU use unless it is repeated (llama.cpp's heartbeat exists
  // for this: on macOS 26.1 memory was unwired 1 s after use even with residency sets).
  // When on, capabilities() reports needs_refresh with `refresh_period`.
  bool decaying_requests = false;
  Nanos request_decay{std::chrono::seconds(1)};
  // Half the decay, so that one late refresh never lets a request lapse; it is also the
  // 500 ms period llama.cpp's heartbeat used until mid-2026.
  Nanos refresh_period{std::chrono::milliseconds(500)};

  // Sets one command queue accepts (MLX's kMaxSets = 32: "a command queue accepts a limited
  // number and every set is attached to every queue"). attach_set() beyond it fails.
  std::uint32_t queue_set_limit = 32;
  // Attach every new set to every queue (MLX's attach_new_sets). Then create_set() fails at
  // the queue limit and capabilities().max_sets reports the limit.
  bool attach_new_sets = false;

  // Bug 25937 (Apple FB23959296): in a process that has never run a GPU operation, memory of
  // sets whose residency was ended stays wired (until the first GPU operation, or exit).
  bool ended_set_leak = true;
  // after_release() runs one tiny GPU operation (llama.cpp's fix: a 1-byte blit), which ends
  // the leak above. false: after_release() does nothing, to show the leak.
  bool after_release_gpu_op = true;
};

// Vocabulary. A *buffer* is a piece of process memory the sim knows, identified by its base
// address (the sim never reads or writes it: any non-null address will do, so tests model a
// 16 GB model without allocating it). Regions added to sets are buffers; so is memory a
// command buffer uses. *Wired* bytes are bytes the OS holds in physical memory for the GPU;
// a GPU use or a residency request of unwired bytes pays the re-wire cost. A buffer is
// *protected* from the collector while it is in a set with a live residency request, within
// `collector_delay` of its last GPU use, or leaked (see SimOptions::ended_set_leak).
//
// Thread safety: every method takes the backend's own mutex, so the manager's scheduler
// thread and a test driving GPU work may call it concurrently.
class SimBackend final : public Backend {
 public:
  using QueueId = std::uint32_t;

  // A piece of memory a command buffer reads or writes (identified by its base address).
  struct GpuBuffer {
    const void* base = nullptr;
    std::uint64_t size = 0;
  };
  // A committed command buffer. Its residency is fixed at commit (Metal attaches all of a
  // queue's residency sets to a command buffer when it is committed): `resident_buffers` are
  // the members, at that moment, of the sets then attached to its queue; a set created or
  // attached later does not count for it.
  struct CommandBuffer {
    std::uint64_t id = 0;
    QueueId queue = 0;
    Nanos committed_at{0};
    Nanos compute{0};                         // GPU time when everything it needs is wired
    std::vector<GpuBuffer> uses;              // memory it uses directly
    std::vector<SetId> resident_sets;         // sets attached to the queue at commit
    std::vector<GpuBuffer> resident_buffers;  // their members at commit
  };
  struct Stats {
    std::uint64_t requests = 0;         // request_residency calls
    std::uint64_t refreshes = 0;        // refresh calls
    std::uint64_t commits = 0;          // Backend::commit calls
    std::uint64_t gpu_operations = 0;   // command buffers executed + tiny operations
    std::uint64_t rewired_bytes = 0;    // bytes wired again by requests and GPU work
    Nanos request_wire_time{0};         // re-wire time paid inside residency requests
    Nanos gpu_wire_time{0};             // re-wire time paid inside GPU work
    std::uint64_t collected_bytes = 0;  // bytes the collector unwired
    std::uint64_t misuse = 0;           // calls naming an unknown set/queue (see last_error)
  };

  // Made by make_sim_backend(options), which checks the options first.
  ~SimBackend() override;
  SimBackend(const SimBackend&) = delete;
  SimBackend& operator=(const SimBackend&) = delete;

  // Backend.
  Capabilities capabilities() const override;
  MemoryInfo memory_info() override;
  Status create_set(SetId set, std::uint64_t capacity_bytes) override;
  Status destroy_set(SetId set) override;
  void add_region(SetId set, const RegionDesc& region) override;
  void remove_region(SetId set, RegionId region) override;
  SetOutcome commit(SetId set) override;
  SetOutcome request_residency(SetId set) override;
  Status end_residency(SetId set) override;
  SetOutcome refresh(SetId set) override;
  void after_release() override;

  // Sim only: the GPU side an engine drives.
  // Registers a command queue; with attach_new_sets every existing set is attached to it
  // (error past queue_set_limit, and the queue is not added).
  Result<QueueId> add_queue();
  // Attaches a set to a queue. limit_exceeded when the queue already holds queue_set_limit.
  Status attach_set(QueueId queue, SetId set);
  Status detach_set(QueueId queue, SetId set);
  std::vector<SetId> queue_sets(QueueId queue) const;
  // Commits a command buffer at clock.now(), fixing its residency (see CommandBuffer).
  Result<CommandBuffer> commit_command_buffer(QueueId queue, std::vector<GpuBuffer> uses, Nanos compute);
  // Executes a committed command buffer at clock.now(): wires its used and resident buffers
  // (paying the re-wire cost of the bytes that were not wired), marks them used at the end of
  // the execution and returns its duration (compute + re-wire). The caller advances the clock.
  Result<Nanos> execute(const CommandBuffer& cb);
  // commit_command_buffer + execute.
  Result<Nanos> run_command_buffer(QueueId queue, std::vector<GpuBuffer> uses, Nanos compute);
  // One tiny GPU operation (a 1-byte blit): takes no modelled time and ends the ended-set leak.
  void gpu_operation();

  // Observations at clock.now().
  std::uint64_t wired_bytes();                  // all buffers
  std::uint64_t wired_bytes(const void* base);  // one buffer (0 if unknown)
  std::uint64_t allocated_bytes() const;        // bytes of the buffers the sim tracks
  std::uint32_t live_sets() const;              // sets created and not destroyed
  bool residency_requested(SetId set);          // requested, not ended, not decayed
  Stats stats() const;
  // The message of the last call the sim could not honour (unknown set, bad region), or "".
  std::string last_error() const;
  const SimOptions& options() const { return options_; }

 private:
  // The modelled machine (buffers, sets, queues, the collector's progress, the counters, the
  // mutex that guards them): src/backends/sim/sim_backend.cpp.
  struct State;
  friend Result<std::shared_ptr<SimBackend>> make_sim_backend(SimOptions options);
  explicit SimBackend(SimOptions options);

  const SimOptions options_;
  const std::unique_ptr<State> state_;
};

// The backend with the default profile on the SteadyClock (what make_backend("sim") gives).
Result<std::shared_ptr<Backend>> make_sim_backend();
// The backend with the given options; errors for values that cannot model anything
// (non-positive rates, a zero queue limit, a zero refresh period with decaying requests).
Result<std::shared_ptr<SimBackend>> make_sim_backend(SimOptions options);

}  // namespace residency
