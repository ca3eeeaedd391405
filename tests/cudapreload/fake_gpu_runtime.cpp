// SPDX-License-Identifier: MIT
// libfakegpuruntime.so: the CUDA runtime calls fake_gpu_program makes, over the driver (the fake
// libcuda.so.1), as libcudart does: it finds the driver's entry points through cuGetProcAddress,
// makes the primary context current on each thread, and runs a "kernel" (a host function of the
// program's) on the device memory's host addresses, so that a kernel on memory put to sleep would
// fault as it does on a GPU.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>

#include <cstddef>

namespace {

struct Dim3 {
  unsigned x, y, z;
};

template <class Fn>
Fn entry(const char* name) {
  static void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  static auto get = reinterpret_cast<PFN_cuGetProcAddress_v12000>(lib ? ::dlsym(lib, "cuGetProcAddress_v2") : nullptr);
  void* f = nullptr;
  if (get != nullptr) (void)get(name, &f, 12000, 0, nullptr);
  return reinterpret_cast<Fn>(f);
}

// The primary context, current on this thread (the runtime's lazy initialisation).
int on_device() {
  thread_local bool current = false;
  if (current) return 0;
  static auto retain = entry<PFN_cuDevicePrimaryCtxRetain_v7000>("cuDevicePrimaryCtxRetain");
  static auto push = entry<PFN_cuCtxPushCurrent_v4000>("cuCtxPushCurrent");
  static auto init = entry<PFN_cuInit_v2000>("cuInit");
  CUcontext ctx = nullptr;
  if (init == nullptr || init(0) != CUDA_SUCCESS || retain(&ctx, 0) != CUDA_SUCCESS || push(ctx) != CUDA_SUCCESS)
    return 3;
  current = true;
  return 0;
}

}  // namespace

extern "C" {
__attribute__((visibility("default"))) int cudaGetDevice(int* d) {
  *d = 0;
  return on_device();
}
__attribute__((visibility("default"))) int cudaMalloc(void** p, std::size_t n) {
  if (int e = on_device()) return e;
  static auto alloc = entry<PFN_cuMemAlloc_v3020>("cuMemAlloc");
  CUdeviceptr d = 0;
  if (alloc(&d, n) != CUDA_SUCCESS) return 2;
  *p = reinterpret_cast<void*>(d);
  return 0;
}
__attribute__((visibility("default"))) int cudaFree(void* p) {
  if (int e = on_device()) return e;
  static auto free_ = entry<PFN_cuMemFree_v3020>("cuMemFree");
  return free_(reinterpret_cast<CUdeviceptr>(p)) == CUDA_SUCCESS ? 0 : 1;
}
// kind 1: host to device, 2: device to host.
__attribute__((visibility("default"))) int cudaMemcpy(void* dst, const void* src, std::size_t n, int kind) {
  if (int e = on_device()) return e;
  static auto htod = entry<PFN_cuMemcpyHtoD_v3020>("cuMemcpyHtoD");
  static auto dtoh = entry<PFN_cuMemcpyDtoH_v3020>("cuMemcpyDtoH");
  CUresult r = CUDA_ERROR_INVALID_VALUE;
  if (kind == 1) r = htod(reinterpret_cast<CUdeviceptr>(dst), src, n);
  if (kind == 2) r = dtoh(dst, reinterpret_cast<CUdeviceptr>(src), n);
  return r == CUDA_SUCCESS ? 0 : 1;
}
// The driver's entry points, as libcudart hands them out (PyTorch's expandable segments get theirs so).
__attribute__((visibility("default"))) int cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned,
                                                                            unsigned long long, int* status) {
  if (int e = on_device()) return e;
  *fn = entry<void*>(symbol);
  if (status != nullptr) *status = *fn != nullptr ? 0 : 1;
  return *fn != nullptr ? 0 : 500;
}
__attribute__((visibility("default"))) int cudaLaunchKernel(const void* f, Dim3, Dim3, void** args, std::size_t, void*) {
  if (int e = on_device()) return e;
  reinterpret_cast<void (*)(void**)>(const_cast<void*>(f))(args);
  return 0;
}
}
