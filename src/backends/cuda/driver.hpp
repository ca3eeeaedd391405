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

#include <string>

#include "residency/status.hpp"

namespace residency::cuda {

// Every driver function the backend, its tests and its benchmarks call. One line each:
// X(name) declares a member `name` with the prototype <cuda.h> gives that name.
#define RESIDENCY_CUDA_DRIVER_FUNCTIONS(X) \
  X(cuInit)                                \
  X(cuDriverGetVersion)                    \
  X(cuGetErrorName)                        \
  X(cuGetErrorString)                      \
  X(cuDeviceGetCount)                      \
  X(cuDeviceGet)                           \
  X(cuDeviceGetName)                       \
  X(cuDeviceGetAttribute)                  \
  X(cuDeviceTotalMem)                      \
  X(cuDevicePrimaryCtxRetain)              \
  X(cuDevicePrimaryCtxRelease)             \
  X(cuCtxPushCurrent)                      \
  X(cuCtxPopCurrent)                       \
  X(cuCtxSynchronize)                      \
  X(cuMemGetInfo)                          \
  X(cuMemAddressReserve)                   \
  X(cuMemAddressFree)                      \
  X(cuMemCreate)                           \
  X(cuMemRelease)                          \
  X(cuMemMap)                              \
  X(cuMemUnmap)                            \
  X(cuMemSetAccess)                        \
  X(cuMemGetAllocationGranularity)         \
  X(cuMemHostAlloc)                        \
  X(cuMemFreeHost)                         \
  X(cuMemHostRegister)                     \
  X(cuMemHostUnregister)                   \
  X(cuMemAlloc)                            \
  X(cuMemFree)                             \
  X(cuMemcpyHtoD)                          \
  X(cuMemcpyDtoH)                          \
  X(cuMemcpyHtoDAsync)                     \
  X(cuMemcpyDtoHAsync)                     \
  X(cuMemsetD8)                            \
  X(cuStreamCreate)                        \
  X(cuStreamDestroy)                       \
  X(cuStreamSynchronize)                   \
  X(cuEventCreate)                         \
  X(cuEventDestroy)                        \
  X(cuEventRecord)                         \
  X(cuEventSynchronize)                    \
  X(cuEventElapsedTime)                    \
  X(cuModuleLoadData)                      \
  X(cuModuleUnload)                        \
  X(cuModuleGetFunction)                   \
  X(cuLaunchKernel)

// The resolved entry points. Obtained with Driver::get(); lives for the whole process (the
// library is never dlclose'd: other code in the process may hold the same handle).
struct Driver {
#define RESIDENCY_CUDA_DECLARE(name) decltype(&::name) name = nullptr;
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
