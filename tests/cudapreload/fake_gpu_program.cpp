// SPDX-License-Identifier: MIT
// A CUDA program over the fake runtime and driver (libfakegpuruntime.so, the fake libcuda.so.1):
// 64 MiB allocated and filled, a kernel sums it, the program idles for argv[1] ms, a kernel sums it
// again. It prints both sums and how much of the allocation the "GPU" mapped while awake, while
// idle, and after the second kernel: under libresidency_cuda.so with a shorter keep-alive the idle
// figure is 0 and the second kernel must find its memory woken (on unmapped memory it would fault).
// With argv[1] "wait" it idles until a line comes on stdin instead, after saying "ready". With
// argv[2] "vmm" it makes its memory as PyTorch's expandable segments do: a reserved range, physical
// memory created and mapped by the driver calls the runtime hands out.
#include <unistd.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <cuda.h>
#include <cudaTypedefs.h>

struct Dim3 {
  unsigned x, y, z;
};
extern "C" {
int cudaMalloc(void**, std::size_t);
int cudaFree(void*);
int cudaMemcpy(void*, const void*, std::size_t, int);
int cudaLaunchKernel(const void*, Dim3, Dim3, void**, std::size_t, void*);
unsigned long long fake_gpu_mapped(const void*, unsigned long long);
int cudaGetDriverEntryPointByVersion(const char*, void**, unsigned, unsigned long long, int*);
}

namespace {

template <class Fn>
Fn driver(const char* name) {
  void* f = nullptr;
  if (cudaGetDriverEntryPointByVersion(name, &f, 12080, 0, nullptr) != 0 || f == nullptr) std::exit(1);
  return reinterpret_cast<Fn>(f);
}

// n bytes of the program's own mapping (reserve, create, map, set access), as expandable segments.
void* map_own(std::size_t n, CUmemGenericAllocationHandle& handle) {
  CUdeviceptr va = 0;
  if (driver<PFN_cuMemAddressReserve_v10020>("cuMemAddressReserve")(&va, n, 0, 0, 0) != CUDA_SUCCESS) std::exit(1);
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  if (driver<PFN_cuMemCreate_v10020>("cuMemCreate")(&handle, n, &prop, 0) != CUDA_SUCCESS) std::exit(1);
  if (driver<PFN_cuMemMap_v10020>("cuMemMap")(va, n, 0, handle, 0) != CUDA_SUCCESS) std::exit(1);
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (driver<PFN_cuMemSetAccess_v10020>("cuMemSetAccess")(va, n, &access, 1) != CUDA_SUCCESS) std::exit(1);
  return reinterpret_cast<void*>(va);
}

int unmap_own(void* p, std::size_t n, CUmemGenericAllocationHandle handle) {
  const auto va = reinterpret_cast<CUdeviceptr>(p);
  if (driver<PFN_cuMemUnmap_v10020>("cuMemUnmap")(va, n) != CUDA_SUCCESS) return 1;
  if (driver<PFN_cuMemRelease_v10020>("cuMemRelease")(handle) != CUDA_SUCCESS) return 1;
  return driver<PFN_cuMemAddressFree_v10020>("cuMemAddressFree")(va, n) == CUDA_SUCCESS ? 0 : 1;
}

// Sums the buffer's bytes into *out (runs on the device memory's host addresses).
void sum_kernel(void** args) {
  const auto* buf = *static_cast<const unsigned char**>(args[0]);
  const std::size_t n = *static_cast<std::size_t*>(args[1]);
  auto* out = *static_cast<unsigned long long**>(args[2]);
  unsigned long long s = 0;
  for (std::size_t i = 0; i < n; ++i) s += buf[i];
  *out = s;
}

unsigned long long launch_sum(void* d, std::size_t n) {
  unsigned long long s = 0;
  unsigned long long* out = &s;
  void* args[] = {&d, &n, &out};
  if (cudaLaunchKernel(reinterpret_cast<const void*>(&sum_kernel), Dim3{1, 1, 1}, Dim3{1, 1, 1}, args, 0, nullptr) != 0)
    std::exit(1);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const bool wait = argc > 1 && std::strcmp(argv[1], "wait") == 0;
  const int idle_ms = argc > 1 && !wait ? std::atoi(argv[1]) : 0;
  const bool vmm = argc > 2 && std::strcmp(argv[2], "vmm") == 0;
  const std::size_t n = std::size_t{64} << 20;
  void* d = nullptr;
  CUmemGenericAllocationHandle handle = 0;
  if (vmm) d = map_own(n, handle);
  else if (cudaMalloc(&d, n) != 0) return 1;
  std::vector<unsigned char> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<unsigned char>(i * 13 + 5);
  if (cudaMemcpy(d, host.data(), n, 1) != 0) return 1;
  const unsigned long long first = launch_sum(d, n);
  const unsigned long long awake = fake_gpu_mapped(d, n);
  if (wait) {
    std::printf("ready\n");
    std::fflush(stdout);
    char line[16];
    if (std::fgets(line, sizeof line, stdin) == nullptr) return 1;
  } else {
    ::usleep(static_cast<useconds_t>(idle_ms) * 1000);
  }
  const unsigned long long idle = fake_gpu_mapped(d, n);
  const unsigned long long second = launch_sum(d, n);
  const unsigned long long after = fake_gpu_mapped(d, n);
  std::vector<unsigned char> back(n);
  if (cudaMemcpy(back.data(), d, n, 2) != 0) return 1;
  std::printf("sum=%llu again=%llu same_bytes=%d mapped_awake=%llu mapped_idle=%llu mapped_after=%llu\n", first, second,
              std::memcmp(back.data(), host.data(), n) == 0 ? 1 : 0, awake, idle, after);
  return (vmm ? unmap_own(d, n, handle) : cudaFree(d)) == 0 ? 0 : 1;
}
