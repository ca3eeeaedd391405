// SPDX-License-Identifier: MIT
// residency cuda backend: the CUDA driver, loaded at run time.
//
// The library, the tool and every test must start on a machine that has no NVIDIA driver
// (CI runners, laptops, the posix-only servers), so nothing here links libcuda or libcudart.
// The driver is opened with dlopen("libcuda.so.1") the first time a CUDA backend is asked
// for, and every entry point is resolved through the driver's own cuGetProcAddress, which
// hands back the ABI version of each function that matches the <cuda.h> we compiled against
// (so `cuMemGetInfo` really is cuMemGetInfo_v2). <cuda.h> is used for its types only.
// Where the driver is missing the loader returns a Status that says so; the backend factory
// forwards it and "auto" falls through to the next backend.
//
// The issue text names runtime calls (cudaHostRegister, cudaMemGetInfo); the driver API
// equivalents used here are cuMemHostRegister and cuMemGetInfo.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <memory>
#include <string>

#include "residency/status.hpp"

namespace residency::cuda {

// Every driver function the backend, its tests and its benchmarks call. One line each:
// X(name, version) declares a member `name` of type PFN_<name>_v<version> (cudaTypedefs.h)
// and asks the driver for exactly that ABI version. The version is explicit on purpose: the
// driver hands out the newest variant at or below the version asked for, and some names
// changed their prototype without <cuda.h> renaming them (cuCtxSynchronize takes a context
// from CUDA 13.0 on), so asking for "the header's version" would return a function whose
// arguments do not match the prototype we call it with.
#define RESIDENCY_CUDA_DRIVER_FUNCTIONS(X) \
  X(cuInit, 2000)                          \
  X(cuDriverGetVersion, 2020)              \
  X(cuGetErrorName, 6000)                  \
  X(cuGetErrorString, 6000)                \
  X(cuDeviceGetCount, 2000)                \
  X(cuDeviceGet, 2000)                     \
  X(cuDeviceGetName, 2000)                 \
  X(cuDeviceGetUuid, 11040)                \
  X(cuDeviceGetAttribute, 2000)            \
  X(cuDeviceTotalMem, 3020)                \
  X(cuDevicePrimaryCtxRetain, 7000)        \
  X(cuDevicePrimaryCtxRelease, 11000)      \
  X(cuCtxPushCurrent, 4000)                \
  X(cuCtxPopCurrent, 4000)                 \
  X(cuCtxSynchronize, 2000)                \
  X(cuMemGetInfo, 3020)                    \
  X(cuMemAddressReserve, 10020)            \
  X(cuMemAddressFree, 10020)               \
  X(cuMemCreate, 10020)                    \
  X(cuMemRelease, 10020)                   \
  X(cuMemMap, 10020)                       \
  X(cuMemUnmap, 10020)                     \
  X(cuMemSetAccess, 10020)                 \
  X(cuMemGetAllocationGranularity, 10020)  \
  X(cuMemHostAlloc, 2020)                  \
  X(cuMemFreeHost, 2000)                   \
  X(cuMemHostRegister, 6050)               \
  X(cuMemHostUnregister, 4000)             \
  X(cuMemAlloc, 3020)                      \
  X(cuMemFree, 3020)                       \
  X(cuMemcpyHtoD, 3020)                    \
  X(cuMemcpyDtoH, 3020)                    \
  X(cuMemcpyHtoDAsync, 3020)               \
  X(cuMemcpyDtoHAsync, 3020)               \
  X(cuMemsetD8, 3020)                      \
  X(cuStreamCreate, 2000)                  \
  X(cuStreamDestroy, 4000)                 \
  X(cuStreamSynchronize, 2000)             \
  X(cuEventCreate, 2000)                   \
  X(cuEventDestroy, 4000)                  \
  X(cuEventRecord, 2000)                   \
  X(cuEventSynchronize, 2000)              \
  X(cuEventElapsedTime, 2000)              \
  X(cuModuleLoadData, 2000)                \
  X(cuModuleUnload, 2000)                  \
  X(cuModuleGetFunction, 2000)             \
  X(cuLaunchKernel, 4000)

// The resolved entry points. Obtained with Driver::get(); lives for the whole process (the
// library is never dlclose'd: other code in the process may hold the same handle).
struct Driver {
#define RESIDENCY_CUDA_DECLARE(name, version) PFN_##name##_v##version name = nullptr;
  RESIDENCY_CUDA_DRIVER_FUNCTIONS(RESIDENCY_CUDA_DECLARE)
#undef RESIDENCY_CUDA_DECLARE
  int driver_version = 0;  // e.g. 13000 for CUDA 13.0
  std::string library;     // the file that was opened

  // Loads the driver once per process (thread-safe) and calls cuInit. Later calls return
  // the same result, failure included. Errors: the library is missing (no NVIDIA driver),
  // an entry point is missing (driver older than CUDA 12.0), cuInit failed (no device,
  // driver/kernel-module mismatch).
  static Result<const Driver*> get();
  // Loads from an explicit file; not cached. For tests of the failure messages.
  static Result<const Driver*> load(const char* library_name);
  // Opens `library_name`, resolves every entry point and calls cuInit (CudaProcess keeps what
  // get() and load() open).
  static Result<std::unique_ptr<Driver>> open(const char* library_name);

  // "CUDA_ERROR_OUT_OF_MEMORY (out of memory)".
  std::string describe(CUresult r) const;
  // A Status for a failed call: "cuda: <what>: <call> failed: <describe(r)>". Out-of-memory
  // results map to ErrorCode::out_of_memory, everything else to backend_error.
  Status error(CUresult r, const std::string& what, const char* call) const;
};

// Makes a context current for the scope (push/pop), so the caller's own current context is
// left as it was.
class ContextScope {
 public:
  ContextScope(const Driver& d, CUcontext ctx) : d_(d) { pushed_ = d_.cuCtxPushCurrent(ctx) == CUDA_SUCCESS; }
  ~ContextScope() {
    if (pushed_) {
      CUcontext popped = nullptr;
      (void)d_.cuCtxPopCurrent(&popped);
    }
  }
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;
  bool ok() const { return pushed_; }

 private:
  const Driver& d_;
  bool pushed_ = false;
};

}  // namespace residency::cuda
