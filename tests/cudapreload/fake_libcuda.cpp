// SPDX-License-Identifier: MIT
// libcuda.so.1 for tests: HostGpu (tests/support/host_gpu.hpp, one device emulated in host memory)
// behind the driver's own ABI, so that a real process runs libresidency_cuda.so end to end without
// a GPU: the preload's cuda backend dlopens "libcuda.so.1" and finds this one (LD_LIBRARY_PATH),
// as a runtime does. Device memory is host memory that faults while unmapped, as an illegal address
// does on a GPU. fake_gpu_mapped() says what of a range is mapped now.
#include <cuda.h>

#include <cstring>

#include "support/host_gpu.hpp"

using residency::cuda::testing::HostGpu;

namespace {

const residency::cuda::Driver& d() { return HostGpu::instance().driver(); }

}  // namespace

extern "C" {

__attribute__((visibility("default"))) CUresult cuDriverGetVersion(int* v) { return d().cuDriverGetVersion(v); }

// Every entry point HostGpu has, by name, at any version.
__attribute__((visibility("default"))) CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int, cuuint64_t,
                                                                    CUdriverProcAddressQueryResult* found) {
  if (symbol == nullptr || pfn == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *pfn = nullptr;
#define FAKE_LIBCUDA_ENTRY(fn, version) \
  if (std::strcmp(symbol, #fn) == 0) *pfn = reinterpret_cast<void*>(d().fn);
  RESIDENCY_CUDA_DRIVER_FUNCTIONS(FAKE_LIBCUDA_ENTRY)
#undef FAKE_LIBCUDA_ENTRY
  if (found != nullptr) *found = *pfn != nullptr ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  return *pfn != nullptr ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

__attribute__((visibility("default"))) unsigned long long fake_gpu_mapped(const void* p, unsigned long long bytes) {
  return HostGpu::instance().mapped_bytes(reinterpret_cast<CUdeviceptr>(p), bytes);
}
}
