// SPDX-License-Identifier: MIT
// Kernels that write and check a reproducible pattern in device memory, for the cuda
// backend's tests and the sleep/wake benchmark: a wake that restored the wrong bytes, a byte
// of an odd-sized tail, or a chunk copied to the wrong offset shows up as a mismatch count.
// Word i of a buffer filled with `seed` holds mix(seed + i); tail byte j (past the last whole
// word) holds the low byte of mix(~seed + j). Built to a fatbin and embedded (CMakeLists.txt).
typedef unsigned long long u64;

// splitmix64's finaliser: every input bit changes about half of the output bits, so a
// shifted, duplicated or zeroed chunk never matches by accident.
__device__ __forceinline__ u64 mix(u64 x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

__device__ __forceinline__ u64 global_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ void fill_body(unsigned char* p, u64 size, u64 seed) {
  const u64 words = size / 8;
  u64* w = reinterpret_cast<u64*>(p);
  const u64 stride = static_cast<u64>(gridDim.x) * blockDim.x;
  for (u64 i = static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x; i < words; i += stride) w[i] = mix(seed + i);
  if (blockIdx.x == 0 && threadIdx.x < size - words * 8)
    p[words * 8 + threadIdx.x] = static_cast<unsigned char>(mix(~seed + threadIdx.x));
}

extern "C" __global__ void fill_pattern(unsigned char* p, u64 size, u64 seed) { fill_body(p, size, seed); }

// Waits until `wait_ns` have passed on the GPU's clock, then fills: a kernel that is still
// running when the host asks for a release.
extern "C" __global__ void wait_then_fill(unsigned char* p, u64 size, u64 seed, u64 wait_ns) {
  const u64 start = global_ns();
  while (global_ns() - start < wait_ns) {
  }
  fill_body(p, size, seed);
}

// Adds to *mismatches the number of words and tail bytes that differ from the pattern.
extern "C" __global__ void count_mismatches(const unsigned char* p, u64 size, u64 seed, u64* mismatches) {
  const u64 words = size / 8;
  const u64* w = reinterpret_cast<const u64*>(p);
  const u64 stride = static_cast<u64>(gridDim.x) * blockDim.x;
  u64 bad = 0;
  for (u64 i = static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x; i < words; i += stride)
    bad += w[i] != mix(seed + i);
  if (blockIdx.x == 0 && threadIdx.x < size - words * 8)
    bad += p[words * 8 + threadIdx.x] != static_cast<unsigned char>(mix(~seed + threadIdx.x));
  if (bad != 0) atomicAdd(mismatches, bad);
}
