// SPDX-License-Identifier: MIT
// Kernels of the decode-equivalent pass (see decode_kernels.hpp). Compiled with -O3.
#include "workload/decode_kernels.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "workload/half.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define RESIDENCY_DECODE_X86 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define RESIDENCY_DECODE_X86 0
#endif

namespace residency::workload {
namespace {

// Independent accumulators per kernel: enough to hide the latency of a multiply-add chain and to
// give the vectoriser whole vectors (16 floats = 4 SSE or 2 AVX registers).
constexpr std::size_t kLanes = 16;
constexpr std::size_t kQ8Block = 32;       // elements per Q8_0 block, and per Q4_0 block
constexpr std::size_t kQ8BlockBytes = 34;  // f16 scale + 32 int8
constexpr std::size_t kQ4BlockBytes = 18;  // f16 scale + 16 bytes, two 4-bit weights each

float reduce(const float (&acc)[kLanes]) {
  float s = 0;
  for (float a : acc) s += a;
  return s;
}

float q8_scale_of(const std::uint8_t* block) {
  std::uint16_t dh;
  std::memcpy(&dh, block, 2);
  return f16_to_f32(dh);
}

// ---- portable kernels ------------------------------------------------------------------------

float dot_f32_generic(const std::uint8_t* w, std::size_t n, const MatvecInput& in) {
  const float* x = in.x;
  float acc[kLanes] = {};
  std::size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    float v[kLanes];
    std::memcpy(v, w + 4 * i, sizeof(v));
    for (std::size_t j = 0; j < kLanes; ++j) acc[j] += v[j] * x[i + j];
  }
  float s = reduce(acc);
  for (; i < n; ++i) {
    float v;
    std::memcpy(&v, w + 4 * i, 4);
    s += v * x[i];
  }
  return s;
}

inline float bf16_bits_to_f32(std::uint16_t h) { return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16); }

template <bool kBf16>
float dot_half_generic(const std::uint8_t* w, std::size_t n, const MatvecInput& in) {
  const float* x = in.x;
  float acc[kLanes] = {};
  std::size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    std::uint16_t h[kLanes];
    std::memcpy(h, w + 2 * i, sizeof(h));
    if constexpr (kBf16) {
      for (std::size_t j = 0; j < kLanes; ++j) acc[j] += bf16_bits_to_f32(h[j]) * x[i + j];
    } else {
      for (std::size_t j = 0; j < kLanes; ++j) acc[j] += f16_to_f32(h[j]) * x[i + j];
    }
  }
  float s = reduce(acc);
  for (; i < n; ++i) {
    std::uint16_t h;
    std::memcpy(&h, w + 2 * i, 2);
    s += (kBf16 ? bf16_bits_to_f32(h) : f16_to_f32(h)) * x[i];
  }
  return s;
}

float dot_q8_0_generic(const std::uint8_t* w, std::size_t n, const MatvecInput& in) {
  float s = 0;
  for (std::size_t b = 0; b < n / kQ8Block; ++b) {
    const std::uint8_t* blk = w + b * kQ8BlockBytes;
    std::int8_t q[kQ8Block];
    std::memcpy(q, blk + 2, kQ8Block);
    const std::int8_t* qx = in.q8 + b * kQ8Block;
    std::int32_t dot = 0;
    for (std::size_t k = 0; k < kQ8Block; ++k) dot += static_cast<std::int32_t>(q[k]) * qx[k];
    s += q8_scale_of(blk) * in.q8_scale[b] * static_cast<float>(dot);
  }
  return s;
}

// Q4_0 times the input's Q8_0 blocks: byte j of a block holds weight j in its low nibble and
// weight j + 16 in its high one, each standing for (nibble - 8) times the block's scale.
float dot_q4_0_generic(const std::uint8_t* w, std::size_t n, const MatvecInput& in) {
  float s = 0;
  for (std::size_t b = 0; b < n / kQ8Block; ++b) {
    const std::uint8_t* blk = w + b * kQ4BlockBytes;
    const std::int8_t* qx = in.q8 + b * kQ8Block;
    std::int32_t dot = 0;
    for (std::size_t j = 0; j < kQ8Block / 2; ++j) {
      const std::uint8_t byte = blk[2 + j];
      dot += (static_cast<std::int32_t>(byte & 0x0f) - 8) * qx[j];
      dot += (static_cast<std::int32_t>(byte >> 4) - 8) * qx[j + kQ8Block / 2];
    }
    s += q8_scale_of(blk) * in.q8_scale[b] * static_cast<float>(dot);
  }
  return s;
}

template <float (*Dot)(const std::uint8_t*, std::size_t, const MatvecInput&)>
void matvec(const std::uint8_t* w, std::size_t row_bytes, std::size_t n, std::size_t rows, const MatvecInput& in, float* y) {
  for (std::size_t r = 0; r < rows; ++r) y[r] = Dot(w + r * row_bytes, n, in);
}

std::uint64_t sum_generic(const std::uint8_t* p, std::size_t n) {
  constexpr std::size_t kWords = 8;
  std::uint64_t acc[kWords] = {};
  std::size_t i = 0;
  for (; i + 8 * kWords <= n; i += 8 * kWords) {
    std::uint64_t v[kWords];
    std::memcpy(v, p + i, sizeof(v));
    for (std::size_t j = 0; j < kWords; ++j) acc[j] += v[j];
  }
  std::uint64_t s = 0;
  for (auto a : acc) s += a;
  for (; i < n; ++i) s += p[i];
  return s;
}

// ---- x86-64 AVX2 + FMA + F16C kernels --------------------------------------------------------
#if RESIDENCY_DECODE_X86
#define RESIDENCY_AVX2 __attribute__((target("avx2,fma,f16c")))

// Why the kernels below walk several rows side by side (docs/measurements.md has the figures): one
// thread reading one sequential stream gets far
// less than its share of memory bandwidth, because the number of cache misses it has in flight is
// limited by what the hardware prefetcher runs ahead of a single stream, and that prefetcher stops
// at every 4 KiB page (the model is a file mapping: 4 KiB pages scattered in physical memory). A
// plain read is markedly faster as four streams per thread than as one. The old kernels read one
// row (Q8_0, F32) or two adjacent rows (F16, BF16) at a time: one or two streams, hence slower than
// llama.cpp, whose single-token matmul computes four rows per step. So every AVX2 kernel here
// computes kStreams rows at a time, taken from kStreams
// equal groups of consecutive rows of the piece (row r of each group): the streams are a quarter
// of a piece apart, in different pages whatever the row length, and each one walks its own group
// sequentially. Each row keeps its own accumulators, with exactly the arithmetic of the one-row
// kernel that computes the rows left over, so a row's output does not depend on how it was grouped.
constexpr std::size_t kStreams = 4;

// Software prefetch distance, per stream: asks for the line this far ahead of each stream, past
// the 4 KiB boundary where the hardware prefetcher stops.
constexpr std::size_t kPrefetchBytes = 4096;

RESIDENCY_AVX2 inline void prefetch(const std::uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}

RESIDENCY_AVX2 inline float hsum(__m256 v) {
  const __m128 lo = _mm256_castps256_ps128(v);
  const __m128 hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// R rows at once: w[k] is row k's first byte, y[k] its output.
template <std::size_t R>
RESIDENCY_AVX2 void rows_f32_avx2(const std::uint8_t* const (&w)[R], std::size_t n, const MatvecInput& in,
                                  float* const (&y)[R]) {
  const float* x = in.x;
  __m256 a0[R], a1[R];
  for (std::size_t k = 0; k < R; ++k) a0[k] = a1[k] = _mm256_setzero_ps();
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {  // 128 bytes (two lines) of each row per step
    for (std::size_t k = 0; k < R; ++k) {
      prefetch(w[k] + 4 * i + kPrefetchBytes);
      prefetch(w[k] + 4 * i + kPrefetchBytes + 64);
    }
    const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
    for (std::size_t k = 0; k < R; ++k) {
      const auto* wf = reinterpret_cast<const float*>(w[k] + 4 * i);  // loadu: any alignment
      a0[k] = _mm256_fmadd_ps(_mm256_loadu_ps(wf), x0, a0[k]);
      a1[k] = _mm256_fmadd_ps(_mm256_loadu_ps(wf + 8), x1, a1[k]);
    }
    const __m256 x2 = _mm256_loadu_ps(x + i + 16), x3 = _mm256_loadu_ps(x + i + 24);
    for (std::size_t k = 0; k < R; ++k) {
      const auto* wf = reinterpret_cast<const float*>(w[k] + 4 * i);
      a0[k] = _mm256_fmadd_ps(_mm256_loadu_ps(wf + 16), x2, a0[k]);
      a1[k] = _mm256_fmadd_ps(_mm256_loadu_ps(wf + 24), x3, a1[k]);
    }
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    for (std::size_t k = 0; k < R; ++k) {
      a0[k] = _mm256_fmadd_ps(_mm256_loadu_ps(reinterpret_cast<const float*>(w[k] + 4 * i)), xv, a0[k]);
    }
  }
  for (std::size_t k = 0; k < R; ++k) {
    float s = hsum(_mm256_add_ps(a0[k], a1[k]));
    for (std::size_t j = i; j < n; ++j) {
      float v;
      std::memcpy(&v, w[k] + 4 * j, 4);
      s += v * x[j];
    }
    *y[k] = s;
  }
}

template <bool kBf16>
RESIDENCY_AVX2 inline __m256 load_halfx8(const std::uint8_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (kBf16) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_cvtph_ps(h);
  }
}

template <bool kBf16, std::size_t R>
RESIDENCY_AVX2 void rows_half_avx2(const std::uint8_t* const (&w)[R], std::size_t n, const MatvecInput& in,
                                   float* const (&y)[R]) {
  const float* x = in.x;
  constexpr auto load = load_halfx8<kBf16>;
  __m256 a0[R], a1[R];
  for (std::size_t k = 0; k < R; ++k) a0[k] = a1[k] = _mm256_setzero_ps();
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {  // 64 bytes (one line) of each row per step
    for (std::size_t k = 0; k < R; ++k) prefetch(w[k] + 2 * i + kPrefetchBytes);
    const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
    for (std::size_t k = 0; k < R; ++k) {
      a0[k] = _mm256_fmadd_ps(load(w[k] + 2 * i), x0, a0[k]);
      a1[k] = _mm256_fmadd_ps(load(w[k] + 2 * i + 16), x1, a1[k]);
    }
    const __m256 x2 = _mm256_loadu_ps(x + i + 16), x3 = _mm256_loadu_ps(x + i + 24);
    for (std::size_t k = 0; k < R; ++k) {
      a0[k] = _mm256_fmadd_ps(load(w[k] + 2 * i + 32), x2, a0[k]);
      a1[k] = _mm256_fmadd_ps(load(w[k] + 2 * i + 48), x3, a1[k]);
    }
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    for (std::size_t k = 0; k < R; ++k) a0[k] = _mm256_fmadd_ps(load(w[k] + 2 * i), xv, a0[k]);
  }
  for (std::size_t k = 0; k < R; ++k) {
    float s = hsum(_mm256_add_ps(a0[k], a1[k]));
    for (std::size_t j = i; j < n; ++j) {
      std::uint16_t h;
      std::memcpy(&h, w[k] + 2 * j, 2);
      s += (kBf16 ? bf16_to_f32(h) : f16_to_f32(h)) * x[j];
    }
    *y[k] = s;
  }
}

// acc + (d_w * d_x) * (q_w . q_x) for one Q8_0 block, in integers: |q_w| (unsigned) times q_x
// with q_w's sign (signed) in pairs (maddubs), pairs summed to 32 bits (madd). |q_w| <= 128 and
// |q_x| <= 127, so the 16-bit pair sums (at most 2 * 128 * 127) never saturate.
RESIDENCY_AVX2 inline __m256 q8_0_block(const std::uint8_t* blk, __m256i xv, float dx, __m256 acc) {
  std::uint16_t dh;
  std::memcpy(&dh, blk, 2);
  const __m256i qw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(xv, qw));
  const __m256i sums = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
  return _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(dh) * dx), _mm256_cvtepi32_ps(sums), acc);
}

template <std::size_t R>
RESIDENCY_AVX2 void rows_q8_0_avx2(const std::uint8_t* const (&w)[R], std::size_t n, const MatvecInput& in,
                                   float* const (&y)[R]) {
  __m256 a0[R], a1[R];
  for (std::size_t k = 0; k < R; ++k) a0[k] = a1[k] = _mm256_setzero_ps();
  const std::size_t blocks = n / kQ8Block;
  std::size_t b = 0;
  for (; b + 2 <= blocks; b += 2) {  // 68 bytes of each row per step
    for (std::size_t k = 0; k < R; ++k) prefetch(w[k] + b * kQ8BlockBytes + kPrefetchBytes);
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.q8 + b * kQ8Block));
    const float d0 = in.q8_scale[b];
    for (std::size_t k = 0; k < R; ++k) a0[k] = q8_0_block(w[k] + b * kQ8BlockBytes, x0, d0, a0[k]);
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.q8 + (b + 1) * kQ8Block));
    const float d1 = in.q8_scale[b + 1];
    for (std::size_t k = 0; k < R; ++k) a1[k] = q8_0_block(w[k] + (b + 1) * kQ8BlockBytes, x1, d1, a1[k]);
  }
  if (b < blocks) {
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.q8 + b * kQ8Block));
    for (std::size_t k = 0; k < R; ++k) a0[k] = q8_0_block(w[k] + b * kQ8BlockBytes, x0, in.q8_scale[b], a0[k]);
  }
  for (std::size_t k = 0; k < R; ++k) *y[k] = hsum(_mm256_add_ps(a0[k], a1[k]));
}

// Q4_0 two blocks at a time, so that the nibble unpacking and the madd serve two blocks (one
// block per step, as Q8_0 does, read well below the plain sum's bandwidth; docs/measurements.md
// has bench_decode's figures with RESIDENCY_BENCH_TYPES=q4_0): the 16 weight bytes of
// blocks b and b + 1 in one register, whose low nibbles are weights 0-15 of b, then of b + 1,
// and high nibbles weights 16-31 of each; the input's blocks rearranged to match, once for all
// rows. The nibbles (0 to 15) are maddubs's unsigned operand as they are, and the 8 is taken off
// afterwards: (nibble - 8) . q_x = nibble . q_x - 8 . q_x, the last a property of the input. The
// 16-bit sums of two pairs stay within 4 * 15 * 127, far from saturating. Lanes 0-3 of the 32-bit
// sums are block b's, lanes 4-7 block b + 1's, scaled by a vector of the two blocks' scales. A
// last odd block is the portable kernel's.
template <std::size_t R>
RESIDENCY_AVX2 void rows_q4_0_avx2(const std::uint8_t* const (&w)[R], std::size_t n, const MatvecInput& in,
                                   float* const (&y)[R]) {
  const __m256i nibble = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), eight = _mm256_set1_epi8(8);
  const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  __m256 acc[R];
  for (std::size_t k = 0; k < R; ++k) acc[k] = _mm256_setzero_ps();
  const std::size_t blocks = n / kQ8Block;
  std::size_t b = 0;
  for (; b + 2 <= blocks; b += 2) {  // 36 bytes of each row per step
    for (std::size_t k = 0; k < R; ++k) prefetch(w[k] + b * kQ4BlockBytes + kPrefetchBytes);
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.q8 + b * kQ8Block));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.q8 + (b + 1) * kQ8Block));
    const __m256i xlo = _mm256_permute2x128_si256(x0, x1, 0x20), xhi = _mm256_permute2x128_si256(x0, x1, 0x31);
    const __m256i eight_x =
        _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(eight, xlo), _mm256_maddubs_epi16(eight, xhi)), ones);
    const __m128 dx = _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in.q8_scale + b)));
    for (std::size_t k = 0; k < R; ++k) {
      const std::uint8_t* p = w[k] + b * kQ4BlockBytes;
      const __m256i q =
          _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2))),
                                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kQ4BlockBytes + 2)), 1);
      const __m256i lo = _mm256_and_si256(q, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), nibble);
      const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
      const __m256i sums = _mm256_sub_epi32(_mm256_madd_epi16(pairs, ones), eight_x);
      std::uint16_t d0, d1;
      std::memcpy(&d0, p, 2);
      std::memcpy(&d1, p + kQ4BlockBytes, 2);
      const __m128 dw = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(d0 | (static_cast<std::uint32_t>(d1) << 16))));
      const __m256 scale = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_mul_ps(dw, dx)), spread);
      acc[k] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums), acc[k]);
    }
  }
  const MatvecInput last{in.x + b * kQ8Block, in.q8 + b * kQ8Block, in.q8_scale + b};
  for (std::size_t k = 0; k < R; ++k) {
    *y[k] = hsum(acc[k]) + (b < blocks ? dot_q4_0_generic(w[k] + b * kQ4BlockBytes, kQ8Block, last) : 0.0f);
  }
}

// The piece's rows in kStreams groups of q consecutive rows, row r of every group computed
// together; the rows % kStreams left over one at a time, with the same per-row arithmetic.
template <template <std::size_t> class Rows>
RESIDENCY_AVX2 void matvec_streams_avx2(const std::uint8_t* w, std::size_t row_bytes, std::size_t n, std::size_t rows,
                                        const MatvecInput& in, float* y) {
  const std::size_t q = rows / kStreams;
  for (std::size_t r = 0; r < q; ++r) {
    const std::uint8_t* const ws[kStreams] = {w + r * row_bytes, w + (q + r) * row_bytes, w + (2 * q + r) * row_bytes,
                                              w + (3 * q + r) * row_bytes};
    float* const ys[kStreams] = {y + r, y + q + r, y + 2 * q + r, y + 3 * q + r};
    Rows<kStreams>::run(ws, n, in, ys);
  }
  for (std::size_t r = kStreams * q; r < rows; ++r) {
    const std::uint8_t* const ws[1] = {w + r * row_bytes};
    float* const ys[1] = {y + r};
    Rows<1>::run(ws, n, in, ys);
  }
}
static_assert(kStreams == 4, "matvec_streams_avx2 lists the streams");

template <std::size_t R>
struct RowsF32 {
  RESIDENCY_AVX2 static void run(const std::uint8_t* const (&w)[R], std::size_t n, const MatvecInput& in,
                                 float* const (&y)[R]) {
    rows_f32_avx2<R>(w, n, in, y);
  }
};
template <std::size_t R>
struct RowsF16 {
  RESIDENCY_AVX2 static void run(const std::uint8_t* const (&w)[R], std::size_t n, const MatvecInput& in,
                                 float* const (&y)[R]) {
    rows_half_avx2<false, R>(w, n, in, y);
  }
};
template <std::size_t R>
struct RowsBf16 {
  RESIDENCY_AVX2 static void run(const std::uint8_t* const (&w)[R], std::size_t n, const MatvecInput& in,
                                 float* const (&y)[R]) {
    rows_half_avx2<true, R>(w, n, in, y);
  }
};
template <std::size_t R>
struct RowsQ8 {
  RESIDENCY_AVX2 static void run(const std::uint8_t* const (&w)[R], std::size_t n, const MatvecInput& in,
                                 float* const (&y)[R]) {
    rows_q8_0_avx2<R>(w, n, in, y);
  }
};
template <std::size_t R>
struct RowsQ4 {
  RESIDENCY_AVX2 static void run(const std::uint8_t* const (&w)[R], std::size_t n, const MatvecInput& in,
                                 float* const (&y)[R]) {
    rows_q4_0_avx2<R>(w, n, in, y);
  }
};

// The baseline read loop, written as well as the kernels: kStreams streams (quarters of the
// range, whole 128-byte strides each) with the same prefetch; what is left after them (less than
// kStreams * 128 bytes) in 128-byte strides, then bytes. The sum of 64-bit words does not depend on
// the order in which they are added, so this is the same sum as one stream's.
RESIDENCY_AVX2 inline __m256i add128(__m256i acc, const std::uint8_t* p) {
  const __m256i a = _mm256_add_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                                     _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
  const __m256i b = _mm256_add_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64)),
                                     _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 96)));
  return _mm256_add_epi64(acc, _mm256_add_epi64(a, b));
}

RESIDENCY_AVX2 std::uint64_t sum_avx2(const std::uint8_t* p, std::size_t n) {
  const std::size_t len = n / (kStreams * 128) * 128;  // bytes per stream
  __m256i acc[kStreams];
  for (auto& a : acc) a = _mm256_setzero_si256();
  for (std::size_t i = 0; i < len; i += 128) {
    for (std::size_t k = 0; k < kStreams; ++k) {
      const std::uint8_t* q = p + k * len + i;
      prefetch(q + kPrefetchBytes);
      prefetch(q + kPrefetchBytes + 64);
      acc[k] = add128(acc[k], q);
    }
  }
  std::size_t i = kStreams * len;
  for (; i + 128 <= n; i += 128) acc[0] = add128(acc[0], p + i);
  __m256i s4 = acc[0];
  for (std::size_t k = 1; k < kStreams; ++k) s4 = _mm256_add_epi64(s4, acc[k]);
  alignas(32) std::uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), s4);
  std::uint64_t s = lanes[0] + lanes[1] + lanes[2] + lanes[3];
  return s + sum_generic(p + i, n - i);
}

// CPUID directly: not every compiler's __builtin_cpu_supports knows "f16c" (clang 14 does not).
bool cpu_has_avx2() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  const bool fma = c & (1u << 12), osxsave = c & (1u << 27), avx = c & (1u << 28), f16c = c & (1u << 29);
  if (!(fma && osxsave && avx && f16c)) return false;
  unsigned xcr0_lo = 0, xcr0_hi = 0;
  __asm__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  if ((xcr0_lo & 6u) != 6u) return false;  // the OS saves the SSE and AVX register state
  if (__get_cpuid_max(0, nullptr) < 7) return false;
  __cpuid_count(7, 0, a, b, c, d);
  return (b & (1u << 5)) != 0;  // AVX2
}
#endif

const DecodeKernels kGeneric{DecodeIsa::generic,
                             matvec<dot_f32_generic>,
                             matvec<dot_half_generic<false>>,
                             matvec<dot_half_generic<true>>,
                             matvec<dot_q8_0_generic>,
                             matvec<dot_q4_0_generic>,
                             sum_generic};
#if RESIDENCY_DECODE_X86
const DecodeKernels kAvx2{DecodeIsa::avx2,
                          matvec_streams_avx2<RowsF32>,
                          matvec_streams_avx2<RowsF16>,
                          matvec_streams_avx2<RowsBf16>,
                          matvec_streams_avx2<RowsQ8>,
                          matvec_streams_avx2<RowsQ4>,
                          sum_avx2};
#endif

}  // namespace

std::string_view to_string(DecodeIsa isa) noexcept { return isa == DecodeIsa::avx2 ? "avx2" : "generic"; }

void quantize_input_q8_0(float* x, std::size_t n, std::int8_t* q8, float* q8_scale) {
  for (std::size_t b = 0; b < n / kQ8Block; ++b) {
    float* v = x + b * kQ8Block;
    float amax = 0;
    for (std::size_t k = 0; k < kQ8Block; ++k) amax = std::max(amax, std::fabs(v[k]));
    const float d = amax / 127.0f;
    const float id = d > 0 ? 1.0f / d : 0.0f;
    q8_scale[b] = d;
    for (std::size_t k = 0; k < kQ8Block; ++k) {
      const float q = std::clamp(std::nearbyint(v[k] * id), -127.0f, 127.0f);
      q8[b * kQ8Block + k] = static_cast<std::int8_t>(q);
      v[k] = d * q;
    }
  }
}

MatvecFn DecodeKernels::for_type(GgmlType t) const {
  switch (t) {
    case GgmlType::f32: return f32;
    case GgmlType::f16: return f16;
    case GgmlType::bf16: return bf16;
    case GgmlType::q8_0: return q8_0;
    case GgmlType::q4_0: return q4_0;
    default: return nullptr;
  }
}

std::vector<DecodeIsa> available_isas() {
  std::vector<DecodeIsa> isas;
#if RESIDENCY_DECODE_X86
  if (cpu_has_avx2()) isas.push_back(DecodeIsa::avx2);
#endif
  isas.push_back(DecodeIsa::generic);
  return isas;
}

const DecodeKernels& decode_kernels(DecodeIsa isa) {
#if RESIDENCY_DECODE_X86
  if (isa == DecodeIsa::avx2) return kAvx2;
#endif
  (void)isa;
  return kGeneric;
}

double reference_dot(GgmlType t, const std::uint8_t* row, std::size_t n, const float* x, double* magnitude) {
  double s = 0;
  if (magnitude != nullptr) *magnitude = 0;
  for (std::size_t i = 0; i < n; ++i) {
    double w = 0;
    switch (t) {
      case GgmlType::f32: {
        float v;
        std::memcpy(&v, row + 4 * i, 4);
        w = v;
        break;
      }
      case GgmlType::f16:
      case GgmlType::bf16: {
        std::uint16_t h;
        std::memcpy(&h, row + 2 * i, 2);
        w = t == GgmlType::f16 ? f16_to_f32(h) : bf16_to_f32(h);
        break;
      }
      case GgmlType::q8_0: {
        const std::uint8_t* blk = row + (i / kQ8Block) * kQ8BlockBytes;
        w = static_cast<double>(q8_scale_of(blk)) * static_cast<std::int8_t>(blk[2 + i % kQ8Block]);
        break;
      }
      case GgmlType::q4_0: {
        const std::uint8_t* blk = row + (i / kQ8Block) * kQ4BlockBytes;
        const std::size_t j = i % kQ8Block;
        const unsigned nibble = j < kQ8Block / 2 ? blk[2 + j] & 0x0fu : blk[2 + j - kQ8Block / 2] >> 4;
        w = static_cast<double>(q8_scale_of(blk)) * (static_cast<int>(nibble) - 8);
        break;
      }
      default: return 0;
    }
    s += w * x[i];
    if (magnitude != nullptr) *magnitude += std::fabs(w * x[i]);
  }
  return s;
}

}  // namespace residency::workload
