// SPDX-License-Identifier: MIT
// What the cuda backends of one process share, in one object that lives as long as the process
// (it is never destroyed: a backend may be torn down by an exit handler after static
// destructors ran):
//   - the driver, loaded once (Driver::get()), and the drivers tests load from other files;
//   - NVML, opened once (what the process holds on a GPU, as nvidia-smi shows it);
//   - whether the kernel has MADV_POPULATE_WRITE (found out at the first pinning);
//   - per device, the physical memory the awake allocations of all of them map, and which of them
//     carries the rest of the process's memory on the device (the context) in a GPU budget. NVML
//     reports a process, however many backends it has on a device, so both are the process's.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "backends/cuda/driver.hpp"
#include "backends/cuda/nvml.hpp"
#include "platform/thread_annotations.hpp"
#include "residency/status.hpp"

namespace residency::cuda {

class CudaProcess {
 public:
  static CudaProcess& instance();

  // libcuda.so.1, loaded and initialised once; later calls return the same result, failure included.
  Result<const Driver*> driver();
  // A driver from an explicit file, kept for the life of the process; not cached (tests of the
  // failure messages).
  Result<const Driver*> load_driver(const char* library_name);
  // libnvidia-ml.so.1, opened at the first call (nvml.hpp; its `problem` says why it is not usable).
  const Nvml& nvml();
  // MADV_POPULATE_WRITE works (Linux 5.14): true until a call says EINVAL (fault_in()).
  std::atomic<bool> populate_write{true};

  // The device's mapped bytes, as each backend maps and unmaps (lock-free).
  void note_mapped(CUdevice dev, std::uint64_t bytes, bool added);
  std::uint64_t mapped(CUdevice dev) const;
  // The first backend made for a device carries the process's unmanaged memory on it until it is
  // destroyed; `backend` identifies it.
  void claim_carrier(CUdevice dev, const void* backend);
  void leave_carrier(CUdevice dev, const void* backend);
  bool carries(CUdevice dev, const void* backend) const;

 private:
  CudaProcess() = default;
  static constexpr std::size_t kMaxDevices = 64;
  static std::size_t slot(CUdevice dev) { return static_cast<std::size_t>(dev) % kMaxDevices; }

  std::once_flag driver_once_, nvml_once_;
  const Nvml* nvml_ = nullptr;      // set once, under nvml_once_; never freed
  std::unique_ptr<Driver> driver_;  // set once, under driver_once_
  Status driver_failure_;           // likewise
  Mutex loaded_mu_;
  std::vector<std::unique_ptr<Driver>> loaded_ RESIDENCY_GUARDED_BY(loaded_mu_);
  std::atomic<std::uint64_t> mapped_[kMaxDevices] = {};
  std::atomic<const void*> carrier_[kMaxDevices] = {};
};

}  // namespace residency::cuda
