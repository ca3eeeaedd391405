// SPDX-License-Identifier: MIT
// libfakeext.so: a library that uses CUDA through the runtime (libfakecudart.so, its dependency), as
// PyTorch's extension does through libcudart; fake_cuda_host loads it with RTLD_LOCAL, as Python
// loads an extension, so its runtime is in no global scope. run_program() makes the calls a
// program makes and reports what it got back, and how many calls the runtime saw.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

struct Dim3 {
  unsigned x, y, z;
};
extern "C" {
int cudaGetDevice(int*);
int cudaMalloc(void**, std::size_t);
int cudaFree(void*);
int cudaMemcpy(void*, const void*, std::size_t, int);
int cudaLaunchKernel(const void*, Dim3, Dim3, void**, std::size_t, void*);
int cudaMallocManaged(void**, std::size_t, unsigned);
int cudaIpcGetMemHandle(void*, void*);
int fake_cudart_calls(int);
int fake_cudart_id();
}

namespace {

// Sums the buffer into its first 8 bytes.
void sum_kernel(void** args) {
  auto* buf = *static_cast<unsigned char**>(args[0]);
  const std::size_t n = *static_cast<std::size_t*>(args[1]);
  unsigned long long s = 0;
  for (std::size_t i = 0; i < n; ++i) s += buf[i];
  std::memcpy(buf, &s, sizeof s);
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int run_program(char* out, std::size_t out_bytes) {
  std::string r = "runtime " + std::to_string(fake_cudart_id()) + ": ";
  const std::size_t n = std::size_t{64} << 20;
  void* d = nullptr;
  r += "malloc=" + std::to_string(cudaMalloc(&d, n));
  std::vector<unsigned char> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<unsigned char>(i * 7);
  r += " htod=" + std::to_string(cudaMemcpy(d, host.data(), n, 1));
  std::size_t len = n;
  void* args[] = {&d, &len};
  r += " launch=" + std::to_string(cudaLaunchKernel(reinterpret_cast<const void*>(&sum_kernel), Dim3{3, 1, 1},
                                                    Dim3{32, 1, 1}, args, 0, nullptr));
  unsigned long long sum = 0;
  r += " dtoh=" + std::to_string(cudaMemcpy(&sum, d, sizeof sum, 2));
  r += " sum=" + std::to_string(sum);
  char handle[64] = {};
  r += " ipc=" + std::to_string(cudaIpcGetMemHandle(handle, d));
  r += " free=" + std::to_string(cudaFree(d));
  void* small = nullptr;
  r += " small=" + std::to_string(cudaMalloc(&small, 4096)) + "," + std::to_string(cudaFree(small));
  void* managed = nullptr;
  r += " managed=" + std::to_string(cudaMallocManaged(&managed, n, 1)) + "," + std::to_string(cudaFree(managed));
  r += " calls=";
  for (int i = 0; i < 7; ++i) r += std::to_string(fake_cudart_calls(i)) + (i < 6 ? "," : "");
  std::snprintf(out, out_bytes, "%s", r.c_str());
  return 0;
}
