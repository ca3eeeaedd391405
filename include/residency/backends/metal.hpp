// SPDX-License-Identifier: MIT
// residency: the metal backend (macOS 15+, iOS 18+), one MTL::ResidencySet per set.
//
// Why it exists: on Apple Silicon the OS unwires GPU memory about a second after its last use
// and the next request pays a re-wire that grows with model size; a residency set with a
// standing requestResidency keeps it wired. This backend is the Metal half of what llama.cpp
// and MLX each do in Objective-C/C++, written once in C++ against Apple's metal-cpp headers.
//
// The one design decision that shapes it: the sequences are llama.cpp's, with its bug fixed.
//   set init:  addAllocation (each view) -> commit -> requestResidency;
//   set free:  endResidency -> removeAllAllocations -> commit -> release;
//   backend init: one 1-byte blit, so that ended residency is really given back (without GPU
//   work in the process, Metal keeps ended sets wired until exit: llama.cpp issue 25937).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "residency/backend.hpp"
#include "residency/status.hpp"
#include "residency/view_planner.hpp"

namespace residency {

// Building: the user points CMake at metal-cpp with RESIDENCY_METAL_CPP_DIR (the project does
// not ship it). The backend is built only on Apple platforms; on Linux it is compile-checked with
// scripts/metal-check. This header does not include metal-cpp: Metal objects cross it as void*.
struct MetalOptions {
  // MTL::Device*; nullptr: MTL::CreateSystemDefaultDevice(). Retained by the backend.
  void* device = nullptr;
  // Sets can also be attached to every command queue the engine registers (MLX does this,
  // llama.cpp does not): Metal fixes a command buffer's residency when it is committed, so a set
  // is attached as soon as it is created, before any later commit.
  //
  // Attach every set to every queue registered with add_command_queue() (MLX). A queue accepts
  // a limited number of sets, so capabilities().max_sets is then kMetalMaxSetsPerQueue.
  bool attach_to_queues = false;
  // Residency requests decay about 1 s after use from macOS 26 (llama.cpp added its heartbeat
  // for this); nullopt: refresh on macOS 26 and later only.
  std::optional<bool> needs_refresh;
  // Label of each MTLResidencySet (what Instruments and the Metal debugger show).
  std::string label = "residency";
  // Longest no-copy view of host memory; 0: the device's maxBufferLength (rounded down to a
  // page). Lower it to bind smaller buffers, or to split a small mapping in a test.
  std::uint64_t max_view_length = 0;
  // While the system's memory-pressure level stays at warn or critical, the pressure watch
  // reports it again every this long (the dispatch source reports only changes of level; PSI,
  // on Linux, reports once per 2 s window while stalls go on, and graded release gives back
  // one step per report).
  Nanos pressure_repeat = std::chrono::seconds(2);
  // Test only: no GPU work at all from the backend (no 1-byte blit at initialisation, none
  // after a release), to show the Metal bug it works around (llama.cpp issue 25937). Never set
  // this in an engine: ended residency then stays wired until the process exits.
  bool test_no_gpu_work = false;
};

// Most residency sets one command queue accepts (MLX's kMaxSets, from Metal's limit on sets
// attached to a queue); enforced when attach_to_queues is on.
inline constexpr std::uint32_t kMetalMaxSetsPerQueue = 32;
// Most no-copy views of one region (llama.cpp's limit for one mapping, which it never checks;
// here a region that would need more is refused with the count).
inline constexpr std::uint32_t kMetalMaxViews = 64;

// Whether residency sets work here: macOS 15 / iOS 18 / tvOS 18 / visionOS 2 or later and a
// device of the MTLGPUFamilyMetal3 family. `reason` says why not, for the
// "use residency sets = false (...)" line.
struct MetalSupport {
  bool available = false;
  std::string reason;
};
MetalSupport metal_residency_support(void* device = nullptr);

// Host memory (an mmap'd model) is wrapped in no-copy buffers; a region longer than the
// device's maxBufferLength is split into views by the view planner. A region registered with
// an MTL::Buffer* (or any MTL::Allocation*) as its backend_object is added as is; one registered
// with an NS::Array* of them (the overlapping views an engine made of one mapping, as llama.cpp
// does: MetalHostViews below) has every allocation of the array added, so one region stands
// for all its views (regions may not overlap, views do).
class MetalBackend final : public Backend {
 public:
  ~MetalBackend() override;
  MetalBackend(const MetalBackend&) = delete;
  MetalBackend& operator=(const MetalBackend&) = delete;

  Capabilities capabilities() const override;
  // physical = the host's RAM (NSProcessInfo physicalMemory), recommended_working_set = the
  // device's recommendedMaxWorkingSetSize, no hard limit (Metal states none). What is allocated
  // and wired the manager counts itself (its Stats); currentAllocatedSize is read only for
  // `residency stat` (read_metal_device_info below).
  MemoryInfo memory_info() override;
  Status create_set(SetId set, std::uint64_t capacity_bytes) override;
  Status destroy_set(SetId set) override;
  void add_region(SetId set, const RegionDesc& region) override;
  void remove_region(SetId set, RegionId region) override;
  SetOutcome commit(SetId set) override;
  SetOutcome request_residency(SetId set) override;
  Status end_residency(SetId set) override;
  void after_release() override;
  // Memory pressure comes from the dispatch memory-pressure source (warn, critical, normal),
  // repeated while the level stays above normal (backends/metal/pressure_source.hpp).
  // One dispatch memory-pressure source for the backend; each manager adds a watcher.
  Result<PressureWatchId> watch_pressure(std::function<void()> on_pressure) override;
  void stop_pressure_watch(PressureWatchId id) override;

  // Registers an MTL::CommandQueue* (retained). With attach_to_queues every existing and
  // future set is attached to it; limit_exceeded when that would pass kMetalMaxSetsPerQueue.
  Status add_command_queue(void* queue);
  // Detaches every set from the queue and releases it.
  Status remove_command_queue(void* queue);
  // The MTL::Device* in use (not retained for the caller).
  void* device() const;

  struct Impl;

 private:
  friend Result<std::shared_ptr<MetalBackend>> make_metal_backend(MetalOptions options);
  explicit MetalBackend(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The backend on the system default device (what make_backend("metal") gives). Where
// residency sets are unavailable: unsupported, with the message
// "use residency sets = false (<reason>)".
Result<std::shared_ptr<Backend>> make_metal_backend();
Result<std::shared_ptr<MetalBackend>> make_metal_backend(MetalOptions options);

// No-copy MTL::Buffer views of page-aligned host memory (an mmap'd model file), planned by the
// view planner so that every extent in `tensors` lies whole in one view (where an engine binds
// it), each at most `max_length` bytes (0: the device's maxBufferLength), at most
// kMetalMaxViews. The views wrap the memory and never own it: it must outlive them. Register
// the memory once with array() as its backend object, and the residency set holds exactly the
// buffers the engine's kernels read.
class MetalHostViews {
 public:
  // Errors: invalid_argument for a base that is not page-aligned or a null device,
  // limit_exceeded from the planner (too many views, a tensor longer than a view),
  // backend_error when Metal refuses a buffer.
  static Result<MetalHostViews> make(void* device, void* base, std::uint64_t size, std::span<const Extent> tensors,
                                     std::uint64_t max_length = 0);
  MetalHostViews(MetalHostViews&&) noexcept;
  MetalHostViews& operator=(MetalHostViews&&) noexcept;
  ~MetalHostViews();

  const std::vector<View>& views() const;
  // The MTL::Buffer* of views()[i]; valid while this object lives.
  void* buffer(std::size_t i) const;
  // An NS::Array* of every buffer, for register_region(base, size, cls, priority, array()).
  void* array() const;

  struct Impl;

 private:
  explicit MetalHostViews(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// What the default (or given) Metal device reports, for `residency stat`.
struct MetalDeviceInfo {
  bool found = false;                         // a device exists
  std::string name;                           // MTLDevice.name
  std::uint64_t recommended_working_set = 0;  // recommendedMaxWorkingSetSize
  std::uint64_t current_allocated = 0;        // currentAllocatedSize (this process)
  std::uint64_t max_buffer_length = 0;        // maxBufferLength
  bool unified_memory = false;                // hasUnifiedMemory
  MetalSupport residency_sets;                // whether this backend starts here, and why not
};
MetalDeviceInfo read_metal_device_info(void* device = nullptr);

// The macOS figures `residency stat` shows and the Metal tests measure with. Each is nullopt
// when it could not be read; `problems` says why.
struct AppleSystemInfo {
  std::optional<std::uint64_t> physical;  // hw.memsize
  // The system's wired memory: host_statistics64 wire_count x host page size, what `top -l 1`
  // shows as "wired" and what a residency set's requestResidency adds to.
  std::optional<std::uint64_t> wired;
  // sysctl iogpu.wired_limit_mb: how much the GPU may wire; 0 = the system's default (about
  // 2/3 to 3/4 of RAM).
  std::optional<std::int64_t> iogpu_wired_limit_mb;
  // sysctl iogpu.disable_wired_collector: 1 = the collector that unwires idle GPU memory is off.
  std::optional<std::int64_t> iogpu_disable_wired_collector;
  // kern.memorystatus_vm_pressure_level: "normal", "warn" or "critical".
  std::optional<std::string> pressure_level;
  std::vector<std::string> problems;
};
AppleSystemInfo read_apple_system_info();
// Only the wired bytes (cheap: for polling). nullopt and `why` when unreadable.
std::optional<std::uint64_t> apple_wired_bytes(std::string* why = nullptr);

}  // namespace residency
