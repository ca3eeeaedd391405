// SPDX-License-Identifier: MIT
// libfakecudart.so: the few CUDA runtime functions fake_ext calls, done in host memory, each
// counting its calls. It stands for libcudart.so behind a program on a machine without a GPU, so
// that the CUDA preload's exports are run for real: what they forward, to which definition, and
// what they say.
#include <cstdlib>
#include <cstring>

namespace {
int g_calls[8];
}

#if FAKE_CUDART_ID > 1
// Each runtime after the first has its functions 64 KiB further into its code than the one before:
// a target cached for one and called for another lands in this padding, never on a function that
// happens to sit at the same offset.
extern "C" __attribute__((used, noinline)) void fake_cudart_padding() {
  asm volatile(".skip 65536 * (" FAKE_CUDART_ID_TEXT " - 1), 0xcc");
}
#endif

struct Dim3 {
  unsigned x, y, z;
};

extern "C" {
__attribute__((visibility("default"))) int cudaGetDevice(int* d) {
  ++g_calls[0];
  *d = 0;
  return 0;
}
__attribute__((visibility("default"))) int cudaMalloc(void** p, std::size_t n) {
  ++g_calls[1];
  *p = std::malloc(n);
  return *p != nullptr ? 0 : 2;
}
__attribute__((visibility("default"))) int cudaFree(void* p) {
  ++g_calls[2];
  std::free(p);
  return 0;
}
__attribute__((visibility("default"))) int cudaMemcpy(void* d, const void* s, std::size_t n, int) {
  ++g_calls[3];
  std::memcpy(d, s, n);
  return 0;
}
// The "kernel" is a host function of the program's, called with its arguments.
__attribute__((visibility("default"))) int cudaLaunchKernel(const void* f, Dim3 g, Dim3 b, void** args, std::size_t, void*) {
  ++g_calls[4];
  if (g.x != 3 || b.x != 32) return 1;  // the launch shape arrived as the program gave it
  reinterpret_cast<void (*)(void**)>(const_cast<void*>(f))(args);
  return 0;
}
__attribute__((visibility("default"))) int cudaMallocManaged(void** p, std::size_t n, unsigned) {
  ++g_calls[5];
  *p = std::malloc(n);
  return *p != nullptr ? 0 : 2;
}
__attribute__((visibility("default"))) int cudaIpcGetMemHandle(void* h, void* p) {
  ++g_calls[6];
  std::memcpy(h, &p, sizeof p);
  return 0;
}
__attribute__((visibility("default"))) int fake_cudart_calls(int i) { return i >= 0 && i < 8 ? g_calls[i] : -1; }
// Which copy of the runtime this is (two are built: a process may hold two CUDA runtimes).
__attribute__((visibility("default"))) int fake_cudart_id() { return FAKE_CUDART_ID; }
}
