// SPDX-License-Identifier: MIT
// HostGpu: a CUDA driver for tests that emulates one device in host memory, so that the cuda
// backend's own code (CudaBackend::create(options, driver) and everything under it: wake and sleep,
// pinned backups, weights that sleep in their model file, the first release prepared in the
// background, the wake gate) runs on a machine with no GPU and no libcuda, as CI is.
//
// One design decision shapes it: device memory is host memory with the same life as on a GPU. An
// address range (cuMemAddressReserve) is a PROT_NONE reservation; physical memory (cuMemCreate) is
// a memfd counted against the device's capacity and filled with 0xa5 (fresh device memory holds
// whatever it held, never zeros to rely on); cuMemMap maps it MAP_SHARED|MAP_FIXED into the
// reservation, still PROT_NONE until cuMemSetAccess; cuMemUnmap puts the reservation back. So a
// use of unmapped device memory faults, as it is an illegal address on a GPU, while the driver's
// copies check their device range first and return an error instead. Host registrations fault
// their pages in as the driver pins them (MADV_POPULATE_READ for READ_ONLY, _WRITE otherwise, so a
// read-only mapping registered writable is refused); nothing is locked in memory. Copies, host
// registrations, streams and events need a context made current on the calling thread
// (CUDA_ERROR_INVALID_CONTEXT otherwise), as with the driver. Copies and memsets are done at once
// (memcpy): there is no asynchrony to get wrong, so a missing stream synchronisation is not caught
// here. A copy whose host side is not wholly inside one host registration is counted as pageable
// (on a GPU it is staged, several times slower), which is what tests assert about wakes.
//
// The entry points are plain C functions (a Driver is a struct of function pointers), so the
// state is one process-wide object, locked for the backend's host threads (pinning workers, the
// background thread, parallel registration). Kernels are not emulated: module loading and launches
// return CUDA_ERROR_NOT_SUPPORTED, and tests fill device memory with copies instead. No NVML: the
// backend's NVML figure is unknown here, as on a machine without it.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "backends/cuda/driver.hpp"

namespace residency::cuda::testing {

class HostGpu {
 public:
  struct Config {
    // What the device holds: cuMemCreate past it fails with CUDA_ERROR_OUT_OF_MEMORY, and
    // cuMemGetInfo reports capacity less what is created.
    std::uint64_t capacity = std::uint64_t{4} << 30;
    // The allocation granularity, as current GPUs have it: reservations, physical memory and
    // mappings are whole multiples of it (CUDA_ERROR_INVALID_VALUE otherwise).
    std::size_t granularity = std::size_t{2} << 20;
  };

  // Host registrations that fail (cuMemHostRegister returns `result` and registers nothing). A call
  // counts when its flags include all of `flags` and its size is over `over_bytes`; of the calls
  // that count, the `nth` fails (1-based, counted from fail_host_register()), or every one if
  // `nth` is 0.
  struct RegisterFault {
    unsigned flags = 0;
    std::size_t over_bytes = 0;
    int nth = 0;
    CUresult result = CUDA_ERROR_OUT_OF_MEMORY;
  };

  // What the driver did since the last reset().
  struct Counters {
    std::uint64_t copies_to_device = 0;  // cuMemcpyHtoD(Async) calls that succeeded, and their bytes
    std::uint64_t bytes_to_device = 0;
    std::uint64_t copies_to_host = 0;  // cuMemcpyDtoH(Async)
    std::uint64_t bytes_to_host = 0;
    // Copies (either way) whose host side is not wholly inside one registration: staged on a GPU.
    std::uint64_t pageable_copies = 0;
    std::uint64_t pageable_bytes = 0;
    std::uint64_t failed_copies = 0;            // copies and memsets refused (device range not mapped and accessible)
    std::uint64_t mem_creates = 0;              // cuMemCreate calls that succeeded
    std::uint64_t maps = 0;                     // cuMemMap calls that succeeded
    std::uint64_t unmaps = 0;                   // cuMemUnmap calls that succeeded
    std::uint64_t registrations = 0;            // cuMemHostRegister calls that succeeded
    std::uint64_t read_only_registrations = 0;  // of them, with CU_MEMHOSTREGISTER_READ_ONLY
    std::uint64_t failed_registrations = 0;     // refused (an injected fault, an overlap, bad memory)
  };

  // The one instance (the entry points have no other way to find it).
  static HostGpu& instance();
  // The entry points, every member of Driver set; lives as long as the process.
  const Driver& driver() const { return driver_; }

  // Frees whatever a test left (reservations, physical memory, registrations, streams, events),
  // clears the counters, the faults and the hook, and starts over with `config`. Not while a
  // backend over this driver exists.
  void reset(const Config& config);
  void reset() { reset(Config{}); }
  // What is still held, one item per line ("" when nothing: every backend freed what it made).
  std::string live() const;

  void fail_host_register(const RegisterFault& fault);
  // Called before each copy to or from the device (not under the driver's lock), with its
  // direction and size; a test calls the backend from there (interrupt_release()) to land in the
  // middle of a release. Empty: none.
  using CopyHook = std::function<void(bool to_device, std::size_t bytes)>;
  void on_copy(CopyHook hook);

  Counters counters() const;
  // Bytes of physical memory created and not freed, and capacity less that.
  std::uint64_t used() const;
  std::uint64_t free_bytes() const;
  // Bytes of [p, p + bytes) that are mapped to physical memory now (readable and writable or not).
  std::uint64_t mapped_bytes(CUdeviceptr p, std::size_t bytes) const;
  // Host registrations now: how many, their bytes, and of them read-only.
  std::size_t registrations() const;
  std::uint64_t registered_bytes() const;
  std::size_t read_only_registrations() const;
  // Whether [p, p + bytes) is wholly inside one registration.
  bool registered(const void* p, std::size_t bytes) const;

  HostGpu(const HostGpu&) = delete;
  HostGpu& operator=(const HostGpu&) = delete;

 private:
  HostGpu();
  Driver driver_;
};

}  // namespace residency::cuda::testing
