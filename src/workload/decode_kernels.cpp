// Kernels of the decode-equivalent pass (see decode_kernels.hpp). Compiled with -O3.
#include "workload/decode_kernels.hpp"

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
constexpr std::size_t kQ8Block = 32;     // elements per Q8_0 block
constexpr std::size_t kQ8BlockBytes = 34;  // f16 scale + 32 int8

float reduce(const float (&acc)[kLanes]) {
  float s = 0;
  for (float a : acc) s += a;
  return s;
}

// ---- portable kernels ------------------------------------------------------------------------

float dot_f32_generic(const std::uint8_t* w, std::size_t n, const float* x) {
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

template <float (*Convert)(std::uint16_t)>
float dot_half_generic(const std::uint8_t* w, std::size_t n, const float* x) {
  float acc[kLanes] = {};
  std::size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    std::uint16_t h[kLanes];
    std::memcpy(h, w + 2 * i, sizeof(h));
    for (std::size_t j = 0; j < kLanes; ++j) acc[j] += Convert(h[j]) * x[i + j];
  }
  float s = reduce(acc);
  for (; i < n; ++i) {
    std::uint16_t h;
    std::memcpy(&h, w + 2 * i, 2);
    s += Convert(h) * x[i];
  }
  return s;
}

float dot_q8_0_generic(const std::uint8_t* w, std::size_t n, const float* x) {
  float acc[kLanes] = {};
  for (std::size_t b = 0; b < n / kQ8Block; ++b) {
    const std::uint8_t* blk = w + b * kQ8BlockBytes;
    std::uint16_t dh;
    std::memcpy(&dh, blk, 2);
    const float d = f16_to_f32(dh);
    std::int8_t q[kQ8Block];
    std::memcpy(q, blk + 2, kQ8Block);
    const float* xb = x + b * kQ8Block;
    float part[kLanes];
    for (std::size_t j = 0; j < kLanes; ++j) {
      part[j] = static_cast<float>(q[j]) * xb[j] + static_cast<float>(q[j + kLanes]) * xb[j + kLanes];
    }
    for (std::size_t j = 0; j < kLanes; ++j) acc[j] += d * part[j];
  }
  return reduce(acc);
}

template <float (*Dot)(const std::uint8_t*, std::size_t, const float*)>
void matvec(const std::uint8_t* w, std::size_t row_bytes, std::size_t n, std::size_t rows,
            const float* x, float* y) {
  for (std::size_t r = 0; r < rows; ++r) y[r] = Dot(w + r * row_bytes, n, x);
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

RESIDENCY_AVX2 float hsum(__m256 v) {
  const __m128 lo = _mm256_castps256_ps128(v);
  const __m128 hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

RESIDENCY_AVX2 float dot_f32_avx2(const std::uint8_t* w, std::size_t n, const float* x) {
  const auto* wf = reinterpret_cast<const float*>(w);  // loadu: any alignment
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wf + i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(wf + i + 8), _mm256_loadu_ps(x + i + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(wf + i + 16), _mm256_loadu_ps(x + i + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(wf + i + 24), _mm256_loadu_ps(x + i + 24), a3);
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wf + i), _mm256_loadu_ps(x + i), a0);
  float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < n; ++i) {
    float v;
    std::memcpy(&v, w + 4 * i, 4);
    s += v * x[i];
  }
  return s;
}

RESIDENCY_AVX2 inline __m256 load_f16x8(const std::uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
RESIDENCY_AVX2 inline __m256 load_bf16x8(const std::uint8_t* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

template <bool kBf16>
RESIDENCY_AVX2 inline __m256 load_halfx8(const std::uint8_t* p) {
  return kBf16 ? load_bf16x8(p) : load_f16x8(p);
}

template <bool kBf16>
RESIDENCY_AVX2 float dot_half_avx2(const std::uint8_t* w, std::size_t n, const float* x) {
  constexpr auto load = load_halfx8<kBf16>;
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_fmadd_ps(load(w + 2 * i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(load(w + 2 * i + 16), _mm256_loadu_ps(x + i + 8), a1);
    a2 = _mm256_fmadd_ps(load(w + 2 * i + 32), _mm256_loadu_ps(x + i + 16), a2);
    a3 = _mm256_fmadd_ps(load(w + 2 * i + 48), _mm256_loadu_ps(x + i + 24), a3);
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(load(w + 2 * i), _mm256_loadu_ps(x + i), a0);
  float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < n; ++i) {
    std::uint16_t h;
    std::memcpy(&h, w + 2 * i, 2);
    s += (kBf16 ? bf16_to_f32(h) : f16_to_f32(h)) * x[i];
  }
  return s;
}

RESIDENCY_AVX2 inline __m256 q8x8(const std::uint8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}

// acc + d * (q . x) for one Q8_0 block.
RESIDENCY_AVX2 inline __m256 q8_0_block(const std::uint8_t* blk, const float* xb, __m256 acc) {
  std::uint16_t dh;
  std::memcpy(&dh, blk, 2);
  const __m256 d = _mm256_set1_ps(_cvtsh_ss(dh));
  const std::uint8_t* q = blk + 2;
  __m256 s = _mm256_mul_ps(q8x8(q), _mm256_loadu_ps(xb));
  s = _mm256_fmadd_ps(q8x8(q + 8), _mm256_loadu_ps(xb + 8), s);
  s = _mm256_fmadd_ps(q8x8(q + 16), _mm256_loadu_ps(xb + 16), s);
  s = _mm256_fmadd_ps(q8x8(q + 24), _mm256_loadu_ps(xb + 24), s);
  return _mm256_fmadd_ps(d, s, acc);
}

RESIDENCY_AVX2 float dot_q8_0_avx2(const std::uint8_t* w, std::size_t n, const float* x) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  const std::size_t blocks = n / kQ8Block;
  std::size_t b = 0;
  constexpr auto block = q8_0_block;
  for (; b + 2 <= blocks; b += 2) {
    acc0 = block(w + b * kQ8BlockBytes, x + b * kQ8Block, acc0);
    acc1 = block(w + (b + 1) * kQ8BlockBytes, x + (b + 1) * kQ8Block, acc1);
  }
  if (b < blocks) acc0 = block(w + b * kQ8BlockBytes, x + b * kQ8Block, acc0);
  return hsum(_mm256_add_ps(acc0, acc1));
}

template <float (*Dot)(const std::uint8_t*, std::size_t, const float*)>
RESIDENCY_AVX2 void matvec_avx2(const std::uint8_t* w, std::size_t row_bytes, std::size_t n,
                                std::size_t rows, const float* x, float* y) {
  for (std::size_t r = 0; r < rows; ++r) y[r] = Dot(w + r * row_bytes, n, x);
}

RESIDENCY_AVX2 std::uint64_t sum_avx2(const std::uint8_t* p, std::size_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256(), a2 = _mm256_setzero_si256(), a3 = _mm256_setzero_si256();
  std::size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  const __m256i s4 = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
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
                             matvec<dot_half_generic<f16_to_f32>>,
                             matvec<dot_half_generic<bf16_to_f32>>,
                             matvec<dot_q8_0_generic>,
                             sum_generic};
#if RESIDENCY_DECODE_X86
const DecodeKernels kAvx2{DecodeIsa::avx2,
                          matvec_avx2<dot_f32_avx2>,
                          matvec_avx2<dot_half_avx2<false>>,
                          matvec_avx2<dot_half_avx2<true>>,
                          matvec_avx2<dot_q8_0_avx2>,
                          sum_avx2};
#endif

}  // namespace

std::string_view to_string(DecodeIsa isa) noexcept {
  return isa == DecodeIsa::avx2 ? "avx2" : "generic";
}

MatvecFn DecodeKernels::for_type(GgmlType t) const {
  switch (t) {
    case GgmlType::f32: return f32;
    case GgmlType::f16: return f16;
    case GgmlType::bf16: return bf16;
    case GgmlType::q8_0: return q8_0;
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

double reference_dot(GgmlType t, const std::uint8_t* row, std::size_t n, const float* x) {
  double s = 0;
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
        std::uint16_t dh;
        std::memcpy(&dh, blk, 2);
        w = static_cast<double>(f16_to_f32(dh)) * static_cast<std::int8_t>(blk[2 + i % kQ8Block]);
        break;
      }
      default: return 0;
    }
    s += w * x[i];
  }
  return s;
}

}  // namespace residency::workload
