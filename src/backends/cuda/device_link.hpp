// SPDX-License-Identifier: MIT
// The device a cuda backend serves as every part of it sees it: the driver, the device and its
// primary context, the allocation granularity, the copy chunk, and the copy streams. Set once
// when the backend is made; the streams are used by one thread at a time (the backend's lock, or
// the first sleep's pinning pipeline, which the lock also covers).
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "backends/cuda/driver.hpp"
#include "residency/status.hpp"

namespace residency::cuda {

struct DeviceLink {
  const Driver* d = nullptr;
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  std::size_t granularity = 0;  // of physical memory (2 MiB on current GPUs)
  std::size_t chunk = 0;        // the unit of mapping, copying and pinning: a multiple of granularity
  std::vector<CUstream> streams;

  // The stream of the i-th chunk or piece of a copy (round robin).
  CUstream stream(std::size_t i) const { return streams[i % streams.size()]; }
  // Copy chunks of `bytes`.
  std::size_t chunks_of(std::size_t bytes) const { return (bytes + chunk - 1) / chunk; }
  // Waits for every stream; the first failure, if any.
  Status sync() const;
};

// "0x7f00...", for messages.
std::string hex(std::uintptr_t p);
std::size_t round_up(std::size_t v, std::size_t unit);
// Physical memory of the device, pinned (cuMemCreate).
CUmemAllocationProp device_prop(CUdevice dev);
// The device's UUID as nvidia-smi names it ("GPU-f4ce0000-..."); empty when the driver does not say.
std::string device_uuid(const Driver& d, CUdevice dev);

}  // namespace residency::cuda
