// SPDX-License-Identifier: MIT
// Loading libcuda at run time; see driver.hpp.
#include "backends/cuda/driver.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "backends/cuda/cuda_process.hpp"

namespace residency::cuda {
namespace {

// cuGetProcAddress_v2 appeared with CUDA 12.0; older drivers lack it and are refused with a
// message that says so rather than resolved through older, differently versioned names.
constexpr int kMinimumDriverVersion = 12000;

using GetProcAddressFn = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
using DriverGetVersionFn = CUresult (*)(int*);

}  // namespace

Result<std::unique_ptr<Driver>> Driver::open(const char* library_name) {
  const std::string name = library_name;
  void* handle = dlopen(library_name, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    return Status(ErrorCode::unsupported, "cuda: " + name + " not found (no NVIDIA driver on this machine): " +
                                              (why != nullptr ? why : "dlopen failed") +
                                              "; install the NVIDIA driver or choose another backend (posix)");
  }
  auto get_version = reinterpret_cast<DriverGetVersionFn>(dlsym(handle, "cuDriverGetVersion"));
  auto get_proc = reinterpret_cast<GetProcAddressFn>(dlsym(handle, "cuGetProcAddress_v2"));
  int version = 0;
  if (get_version == nullptr || get_version(&version) != CUDA_SUCCESS || get_proc == nullptr ||
      version < kMinimumDriverVersion) {
    dlclose(handle);
    return Status(ErrorCode::unsupported,
                  "cuda: the driver in " + name + " reports CUDA " + std::to_string(version / 1000) + "." +
                      std::to_string((version % 1000) / 10) +
                      "; this build needs a driver for CUDA 12.0 or newer (update the NVIDIA driver)");
  }
  auto d = std::make_unique<Driver>();
  d->driver_version = version;
  d->library = name;
  // Each function at the ABI version its member's type names (see driver.hpp).
  std::string missing;
#define RESIDENCY_CUDA_RESOLVE(fn, version)                                                          \
  {                                                                                                  \
    void* p = nullptr;                                                                               \
    CUdriverProcAddressQueryResult q = CU_GET_PROC_ADDRESS_SUCCESS;                                  \
    if (get_proc(#fn, &p, version, CU_GET_PROC_ADDRESS_DEFAULT, &q) == CUDA_SUCCESS && p != nullptr) \
      d->fn = reinterpret_cast<decltype(d->fn)>(p);                                                  \
    else missing += (missing.empty() ? "" : ", ") + std::string(#fn);                                \
  }
  RESIDENCY_CUDA_DRIVER_FUNCTIONS(RESIDENCY_CUDA_RESOLVE)
#undef RESIDENCY_CUDA_RESOLVE
  if (!missing.empty()) {
    dlclose(handle);
    return Status(ErrorCode::unsupported, "cuda: the driver in " + name + " lacks entry points this build needs: " +
                                              missing + "; update the NVIDIA driver");
  }
  const CUresult r = d->cuInit(0);
  if (r != CUDA_SUCCESS) {
    Status s = d->error(r, "initialising the driver", "cuInit");
    return Status(ErrorCode::unsupported,
                  s.message() + (r == CUDA_ERROR_NO_DEVICE ? " (no CUDA device on this machine)" : ""));
  }
  return d;
}

Result<const Driver*> Driver::get() { return CudaProcess::instance().driver(); }

// Deliberately kept on success: a loaded driver stays for the life of the process.
Result<const Driver*> Driver::load(const char* library_name) {
  return CudaProcess::instance().load_driver(library_name);
}

std::string Driver::describe(CUresult r) const {
  const char* name = nullptr;
  const char* text = nullptr;
  if (cuGetErrorName != nullptr) (void)cuGetErrorName(r, &name);
  if (cuGetErrorString != nullptr) (void)cuGetErrorString(r, &text);
  std::string out = name != nullptr ? name : "CUDA error " + std::to_string(static_cast<int>(r));
  if (text != nullptr) out += std::string(" (") + text + ")";
  return out;
}

Status Driver::error(CUresult r, const std::string& what, const char* call) const {
  const ErrorCode code = r == CUDA_ERROR_OUT_OF_MEMORY ? ErrorCode::out_of_memory : ErrorCode::backend_error;
  return Status(code, "cuda: " + what + ": " + call + " failed: " + describe(r));
}

}  // namespace residency::cuda
