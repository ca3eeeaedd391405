// SPDX-License-Identifier: MIT
#include "backends/cuda/cuda_process.hpp"

namespace residency::cuda {

CudaProcess& CudaProcess::instance() {
  static CudaProcess* const p = new CudaProcess();  // never destroyed (see the header)
  return *p;
}

Result<const Driver*> CudaProcess::driver() {
  std::call_once(driver_once_, [this] {
    auto r = Driver::open("libcuda.so.1");
    if (r) driver_ = std::move(*r);
    else driver_failure_ = r.status();
  });
  if (driver_) return static_cast<const Driver*>(driver_.get());
  return driver_failure_;
}

const Nvml& CudaProcess::nvml() {
  std::call_once(nvml_once_, [this] { nvml_ = open_nvml(); });
  return *nvml_;
}

Result<const Driver*> CudaProcess::load_driver(const char* library_name) {
  auto r = Driver::open(library_name);
  if (!r) return r.status();
  const Driver* d = r->get();
  MutexLock lock(loaded_mu_);
  loaded_.push_back(std::move(*r));
  return d;
}

void CudaProcess::note_mapped(CUdevice dev, std::uint64_t bytes, bool added) {
  if (added) mapped_[slot(dev)].fetch_add(bytes, std::memory_order_relaxed);
  else mapped_[slot(dev)].fetch_sub(bytes, std::memory_order_relaxed);
}

std::uint64_t CudaProcess::mapped(CUdevice dev) const { return mapped_[slot(dev)].load(std::memory_order_relaxed); }

void CudaProcess::claim_carrier(CUdevice dev, const void* backend) {
  const void* none = nullptr;
  (void)carrier_[slot(dev)].compare_exchange_strong(none, backend);
}

void CudaProcess::leave_carrier(CUdevice dev, const void* backend) {
  (void)carrier_[slot(dev)].compare_exchange_strong(backend, nullptr);
}

bool CudaProcess::carries(CUdevice dev, const void* backend) const { return carrier_[slot(dev)].load() == backend; }

}  // namespace residency::cuda
