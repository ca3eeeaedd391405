// SPDX-License-Identifier: MIT
// residency cuda backend: reproducible patterns in device memory, for tests and benchmarks.
//
// "Nothing lost" is only a claim until every byte is checked after every wake. These kernels
// (pattern_kernels.cu, embedded in the executable) fill a buffer with a pattern that depends
// on the seed and on each word's offset, and count the words that differ, so a test or a
// benchmark can check gigabytes in a millisecond on the device instead of copying them back.
// Not part of the library: linked into the cuda tests and tools only.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "backends/cuda/driver.hpp"
#include "backends/cuda/module.hpp"

namespace residency::cuda {

class PatternKernels {
 public:
  static Result<PatternKernels> load(const Driver& d, CUcontext ctx);

  // Each enqueues on `stream` (nullptr: the context's default stream) and returns at once.
  Status fill(CUdeviceptr p, std::uint64_t size, std::uint64_t seed, CUstream stream = nullptr) const;
  // Busy-waits `wait_ns` on the GPU clock, then fills: a kernel still in flight for that long.
  Status wait_then_fill(CUdeviceptr p, std::uint64_t size, std::uint64_t seed, std::uint64_t wait_ns,
                        CUstream stream = nullptr) const;
  // Synchronous: the number of words and tail bytes that differ from the pattern.
  Result<std::uint64_t> mismatches(CUdeviceptr p, std::uint64_t size, std::uint64_t seed) const;

 private:
  PatternKernels(const Driver& d, CUcontext ctx, Module m) : d_(&d), ctx_(ctx), module_(std::move(m)) {}
  Status launch(CUfunction f, void** args, CUstream stream, const char* name) const;
  const Driver* d_;
  CUcontext ctx_;
  Module module_;
  CUfunction fill_ = nullptr;
  CUfunction wait_fill_ = nullptr;
  CUfunction count_ = nullptr;
};

}  // namespace residency::cuda
