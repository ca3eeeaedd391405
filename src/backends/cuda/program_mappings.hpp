// SPDX-License-Identifier: MIT
// residency cuda backend, second kind: device memory a program maps itself with the driver's
// virtual memory calls (cuMemCreate, cuMemMap, cuMemSetAccess: PyTorch's expandable_segments),
// which the CUDA preload tells it about (docs/design.md, "Any CUDA program").
//
// The program keeps its address range and its handle; what comes and goes is the physical memory.
// A sleep waits for the device, copies each mapping to pinned host memory, unmaps it and releases
// the physical memory; a wake creates physical memory with the same properties, maps it at the
// same address with the same access, and copies the bytes back. The program's handle stays its
// name for the memory: ProgramMappings knows which physical handle stands behind it now, and the
// preload translates every call that takes a handle (real_handle(), released()).
//
// Only a mapping of a whole handle at offset 0 is put to sleep (PyTorch maps each handle so); any
// other is left mapped and never registered with a manager. Regions are the mappings' ranges.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backends/cuda/driver.hpp"
#include "platform/thread_annotations.hpp"
#include "residency/backend.hpp"

namespace residency::cuda {

class ProgramMappings final : public Backend {
 public:
  // On device `device` (its primary context), through `driver`'s entry points (the real ones).
  static Result<std::shared_ptr<ProgramMappings>> create(const Driver& driver, int device);
  ~ProgramMappings() override;
  ProgramMappings(const ProgramMappings&) = delete;
  ProgramMappings& operator=(const ProgramMappings&) = delete;

  // ---- What the program did (the preload's hooks, after the real call worked) ----
  // cuMemCreate made `handle` of `size` bytes with `prop`.
  void created(CUmemGenericAllocationHandle handle, std::size_t size, const CUmemAllocationProp& prop);
  // The physical handle standing behind the program's `handle` now (itself until a first sleep);
  // `handle` when it is not one the program made.
  CUmemGenericAllocationHandle real_handle(CUmemGenericAllocationHandle handle) const;
  // The program's name for a physical handle (cuMemRetainAllocationHandle's answer).
  CUmemGenericAllocationHandle program_handle(CUmemGenericAllocationHandle real) const;
  // cuMemMap mapped `handle` at [va, va + size) from `offset`: true when the mapping can sleep
  // (a whole handle at offset 0), which the caller then registers with a manager.
  bool mapped(CUdeviceptr va, std::size_t size, std::size_t offset, CUmemGenericAllocationHandle handle);
  // cuMemSetAccess on [va, va + size): remembered for the mappings inside, to set again at a wake.
  void access_set(CUdeviceptr va, std::size_t size, const CUmemAccessDesc* desc, std::size_t count);
  // cuMemUnmap of [va, va + size) (made awake): the mappings inside are forgotten; their starts.
  std::vector<CUdeviceptr> unmapped(CUdeviceptr va, std::size_t size);
  // The program releases `handle`: the physical handle to release now, or 0 when there is none (it
  // sleeps: released already; a wake then releases the new one as soon as it is mapped).
  CUmemGenericAllocationHandle released(CUmemGenericAllocationHandle handle);
  // The properties `handle` was made with (for cuMemGetAllocationPropertiesFromHandle while it
  // sleeps).
  std::optional<CUmemAllocationProp> properties(CUmemGenericAllocationHandle handle) const;

  // Mappings asleep now, and bytes copied by sleeps and wakes (tests, figures).
  std::size_t asleep() const;
  std::uint64_t bytes_slept() const;

  // ---- Backend ----
  Capabilities capabilities() const override;
  MemoryInfo memory_info() override;
  Status create_set(SetId set, std::uint64_t capacity_bytes) override;
  Status destroy_set(SetId set) override;
  void add_region(SetId set, const RegionDesc& region) override;
  void remove_region(SetId set, RegionId region) override;
  SetOutcome commit(SetId set) override;
  SetOutcome request_residency(SetId set) override;
  Status end_residency(SetId set) override;

 private:
  struct Handle {
    std::size_t size = 0;
    CUmemAllocationProp prop{};
    CUmemGenericAllocationHandle real = 0;  // 0 while its mapping sleeps
    bool released_by_program = false;       // the program released it while mapped
  };
  struct Mapping {
    std::size_t size = 0;
    CUmemGenericAllocationHandle handle = 0;  // the program's name
    std::vector<CUmemAccessDesc> access;
    bool awake = true;
    void* backup = nullptr;  // pinned host memory while asleep
  };
  struct SetRec {
    std::map<RegionId, CUdeviceptr> regions;  // by region: the mapping's start
    bool requested = false;
  };

  ProgramMappings(const Driver& d, CUdevice dev, CUcontext ctx, std::string uuid, std::uint64_t total);
  Status sleep_locked(CUdeviceptr va, Mapping& m) RESIDENCY_REQUIRES(mu_);
  Status wake_locked(CUdeviceptr va, Mapping& m) RESIDENCY_REQUIRES(mu_);

  const Driver& d_;
  const CUdevice dev_;
  const CUcontext ctx_;
  const std::string uuid_;
  const std::uint64_t total_;
  mutable Mutex mu_;
  std::map<CUmemGenericAllocationHandle, Handle> handles_ RESIDENCY_GUARDED_BY(mu_);  // by the program's name
  std::map<CUdeviceptr, Mapping> mappings_ RESIDENCY_GUARDED_BY(mu_);                 // sleepable ones, by start
  std::map<SetId, SetRec> sets_ RESIDENCY_GUARDED_BY(mu_);
  std::uint64_t bytes_slept_ RESIDENCY_GUARDED_BY(mu_) = 0;
};

}  // namespace residency::cuda
