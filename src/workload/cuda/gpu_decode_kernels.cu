// SPDX-License-Identifier: MIT
// The decode-equivalent pass on the GPU: one matrix-vector product per weight matrix of a GGUF
// model held in device memory, all matrices in one launch (a model has hundreds of matrices;
// one launch each would cost more in launch overhead than the pass itself on a fast GPU).
// Each warp computes whole rows: global row g belongs to the matrix whose [row_start,
// row_start + rows) holds it (binary search over the table). Memory-bound by design: every
// weight byte is read once, as in a real decode step.
#include <cuda_fp16.h>

typedef unsigned long long u64;

struct GpuMatrix {  // mirrors GpuDecodePass::Matrix in gpu_decode.cpp
  u64 offset;       // bytes from the start of the weights
  u64 rows, row_length, row_bytes;
  u64 row_start;     // first global row
  u64 input_offset;  // first float of its input vector
  unsigned type;     // GgmlType: 0 f32, 1 f16, 2 q4_0, 8 q8_0, 30 bf16
  unsigned pad;
};

__device__ __forceinline__ float bf16_to_float(unsigned short h) {
  return __uint_as_float(static_cast<unsigned>(h) << 16);
}

__device__ float row_dot(const unsigned char* row, unsigned type, u64 n, const float* x, unsigned lane) {
  float acc = 0.f;
  // Fast path: 16-byte loads (8 halves or 4 floats per lane per step) where the row allows it.
  const bool wide = (reinterpret_cast<u64>(row) % 16 == 0) && (reinterpret_cast<u64>(x) % 16 == 0);
  if ((type == 1 || type == 30) && wide && n % 8 == 0) {
    const uint4* w = reinterpret_cast<const uint4*>(row);
    const float4* xv = reinterpret_cast<const float4*>(x);
    for (u64 i = lane; i < n / 8; i += 32) {
      const uint4 v = w[i];
      const unsigned words[4] = {v.x, v.y, v.z, v.w};
      const float4 x0 = xv[2 * i], x1 = xv[2 * i + 1];
      const float xs[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const unsigned short lo = static_cast<unsigned short>(words[k] & 0xffffu);
        const unsigned short hi = static_cast<unsigned short>(words[k] >> 16);
        const float a = type == 1 ? __half2float(__ushort_as_half(lo)) : bf16_to_float(lo);
        const float b = type == 1 ? __half2float(__ushort_as_half(hi)) : bf16_to_float(hi);
        acc += a * xs[2 * k] + b * xs[2 * k + 1];
      }
    }
  } else if (type == 0 && wide && n % 4 == 0) {
    const float4* w = reinterpret_cast<const float4*>(row);
    const float4* xv = reinterpret_cast<const float4*>(x);
    for (u64 i = lane; i < n / 4; i += 32) {
      const float4 a = w[i], b = xv[i];
      acc += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
    }
  } else if (type == 0) {
    const float* w = reinterpret_cast<const float*>(row);
    for (u64 i = lane; i < n; i += 32) acc += w[i] * x[i];
  } else if (type == 1) {
    const __half* w = reinterpret_cast<const __half*>(row);
    for (u64 i = lane; i < n; i += 32) acc += __half2float(w[i]) * x[i];
  } else if (type == 30) {
    const unsigned short* w = reinterpret_cast<const unsigned short*>(row);
    for (u64 i = lane; i < n; i += 32) acc += bf16_to_float(w[i]) * x[i];
  } else if (type == 8) {
    // Q8_0: blocks of 32 weights, {fp16 scale, 32 x int8}, 34 bytes; a warp reads one block
    // per step, lane j taking weight j.
    const u64 blocks = n / 32;
    for (u64 b = 0; b < blocks; ++b) {
      const unsigned char* blk = row + b * 34;
      const float d = __half2float(*reinterpret_cast<const __half*>(blk));
      const signed char q = static_cast<signed char>(blk[2 + lane]);
      acc += d * static_cast<float>(q) * x[b * 32 + lane];
    }
  } else if (type == 2) {
    // Q4_0: blocks of 32 weights, {fp16 scale, 16 bytes}, 18 bytes; byte j holds weight j in its
    // low nibble and weight j + 16 in its high one, each (nibble - 8); lane j takes weight j.
    const u64 blocks = n / 32;
    for (u64 b = 0; b < blocks; ++b) {
      const unsigned char* blk = row + b * 18;
      const float d = __half2float(__ushort_as_half(static_cast<unsigned short>(blk[0] | (blk[1] << 8))));
      const unsigned byte = blk[2 + (lane & 15u)];
      const int q = static_cast<int>(lane < 16 ? (byte & 15u) : (byte >> 4)) - 8;
      acc += d * static_cast<float>(q) * x[b * 32 + lane];
    }
  }
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
  return acc;
}

extern "C" __global__ void decode_pass(const unsigned char* weights, const GpuMatrix* mats, unsigned n_mats,
                                       u64 total_rows, const float* inputs, float* outputs, double* sum) {
  const unsigned lane = threadIdx.x & 31u;
  const u64 warp = (static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const u64 warps = (static_cast<u64>(gridDim.x) * blockDim.x) >> 5;
  double local = 0;
  for (u64 g = warp; g < total_rows; g += warps) {
    unsigned lo = 0, hi = n_mats - 1;  // last matrix with row_start <= g
    while (lo < hi) {
      const unsigned mid = (lo + hi + 1) / 2;
      if (mats[mid].row_start <= g) lo = mid;
      else hi = mid - 1;
    }
    const GpuMatrix m = mats[lo];
    const u64 r = g - m.row_start;
    const float v = row_dot(weights + m.offset + r * m.row_bytes, m.type, m.row_length, inputs + m.input_offset, lane);
    if (lane == 0) {
      outputs[g] = v;
      local += v;
    }
  }
  if (lane == 0 && local != 0) atomicAdd(sum, local);
}
