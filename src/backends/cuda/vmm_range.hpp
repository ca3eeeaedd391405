// SPDX-License-Identifier: MIT
// An allocation's device address range and the physical memory behind it. The range
// (cuMemAddressReserve) lives from allocate() to deallocate() and never moves; the physical memory
// comes and goes in chunks of DeviceLink::chunk (cuMemCreate + cuMemMap), so that a wake's copies
// of early chunks overlap the mapping of later ones.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <functional>
#include <vector>

#include "backends/cuda/device_link.hpp"
#include "residency/status.hpp"

namespace residency::cuda {

struct VmmRange {
  CUdeviceptr va = 0;
  std::size_t size = 0;                              // what the engine asked for
  std::size_t reserved = 0;                          // size rounded up to the granularity
  std::vector<CUmemGenericAllocationHandle> chunks;  // one physical handle per chunk while mapped
  bool mapped = false;

  // Reserves addresses for `bytes` (rounded up to the granularity); nothing is mapped yet.
  Status reserve(const DeviceLink& link, std::size_t bytes);
  // Gives the addresses back (unmapped first if mapped).
  void free(const DeviceLink& link);

  // Why a map() failed: the driver's result, the call and how far it got. Everything mapped by the
  // call was unmapped again.
  struct MapFailure {
    CUresult result = CUDA_SUCCESS;
    const char* call = "";
    std::size_t offset = 0;
  };
  // Maps the physical memory chunk by chunk. Before each chunk `before(len)` runs (a paced wake's
  // gate), after it `fill(i, off, len)` may issue the chunk's copy (a failure rolls back as well).
  // On success `mapped` is true.
  using BeforeChunk = std::function<void(std::size_t len)>;
  using FillChunk = std::function<CUresult(std::size_t i, std::size_t off, std::size_t len)>;
  bool map(const DeviceLink& link, const BeforeChunk& before, const FillChunk& fill, MapFailure& failure);
  // Unmaps and releases the physical memory (after every copy that may target it: the streams are
  // synchronized first).
  void unmap(const DeviceLink& link);
};

}  // namespace residency::cuda
