// residency: the metal backend (macOS 15+, iOS 18+), one MTL::ResidencySet per set.
//
// Why it exists: on Apple Silicon the OS unwires GPU memory about a second after its last use
// and the next request pays a re-wire that grows with model size; a residency set with a
// standing requestResidency keeps it wired. This backend is the Metal half of what llama.cpp
// and MLX each do in Objective-C/C++, written once in C++ against Apple's metal-cpp headers
// (the user points CMake at them with RESIDENCY_METAL_CPP_DIR; the project does not ship
// them). It is built only on Apple platforms; on Linux it is compile-checked with
// scripts/metal-check.
//
// The one design decision that shapes it: the sequences are llama.cpp's, with its bug fixed.
//   set init:  addAllocation (each view) -> commit -> requestResidency;
//   set free:  endResidency -> removeAllAllocations -> commit -> release;
//   backend init: one 1-byte blit, so that ended residency is really given back (without GPU
//   work in the process, Metal keeps ended sets wired until exit: llama.cpp issue 25937).
// Sets can also be attached to every command queue the engine registers (MLX does this,
// llama.cpp does not): Metal fixes a command buffer's residency when it is committed, so a set
// is attached as soon as it is created, before any later commit.
//
// Host memory (an mmap'd model) is wrapped in no-copy buffers; a region longer than the
// device's maxBufferLength is split into views by the view planner. A region registered with
// an MTL::Buffer* (or any MTL::Allocation*) as its backend_object is added as is.
//
// The public header does not include metal-cpp: Metal objects cross it as void*.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "residency/backend.hpp"
#include "residency/status.hpp"

namespace residency {

struct MetalOptions {
  // MTL::Device*; nullptr: MTL::CreateSystemDefaultDevice(). Retained by the backend.
  void* device = nullptr;
  // Attach every set to every queue registered with add_command_queue() (MLX). A queue accepts
  // a limited number of sets, so capabilities().max_sets is then kMetalMaxSetsPerQueue.
  bool attach_to_queues = false;
  // Residency requests decay about 1 s after use from macOS 26 (llama.cpp added its heartbeat
  // for this); nullopt: refresh on macOS 26 and later only.
  std::optional<bool> needs_refresh;
  // Label of each MTLResidencySet (what Instruments and the Metal debugger show).
  std::string label = "residency";
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

class MetalBackend final : public Backend {
 public:
  ~MetalBackend() override;
  MetalBackend(const MetalBackend&) = delete;
  MetalBackend& operator=(const MetalBackend&) = delete;

  Capabilities capabilities() const override;
  // recommended_working_set = recommendedMaxWorkingSetSize, allocated = currentAllocatedSize,
  // available = their difference, 0 when over (never underflows, unlike llama.cpp's),
  // wired = the allocated size of every set whose residency is requested.
  MemoryInfo memory_info() override;
  Status create_set(SetId set, std::uint64_t capacity_bytes) override;
  Status destroy_set(SetId set) override;
  void add_region(SetId set, const RegionDesc& region) override;
  void remove_region(SetId set, RegionId region) override;
  SetOutcome commit(SetId set) override;
  SetOutcome request_residency(SetId set) override;
  Status end_residency(SetId set) override;
  void after_release() override;

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

}  // namespace residency
