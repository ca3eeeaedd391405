// SPDX-License-Identifier: MIT
// Half-precision conversions (IEEE binary16 "F16" and bfloat16 "BF16") without any ISA extension.
//
// The decode pass and the writer need them on every machine CI may run on, so they are plain
// integer/float bit manipulation that compilers vectorise, with no table and no F16C instruction
// (the decode pass adds an F16C path of its own where the CPU has one).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace residency::workload {

// Exact for every half, subnormals, infinities and NaNs included, with no branch and no denormal
// float operand (denormal arithmetic costs a microcode assist of ~100 cycles on x86): normal
// halves are re-biased in the integer domain (+ (127 - 15) << 23), subnormal ones are their
// integer mantissa times 2^-24 (exact, and a normal float), infinities and NaNs keep their
// mantissa under a float exponent of all ones. The selects are masks, which compilers vectorise.
inline float f16_to_f32(std::uint16_t h) {
  const std::uint32_t em = h & 0x7fffu;
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t normal = (em << 13) + 0x38000000u;
  const std::uint32_t subnormal = std::bit_cast<std::uint32_t>(static_cast<float>(em) * 0x1p-24f);
  const std::uint32_t special = (em << 13) | 0x7f800000u;
  const std::uint32_t is_subnormal = 0u - static_cast<std::uint32_t>(em < 0x0400u);  // all ones or 0
  const std::uint32_t is_special = 0u - static_cast<std::uint32_t>(em >= 0x7c00u);
  const std::uint32_t bits = (subnormal & is_subnormal) | (special & is_special) | (normal & ~(is_subnormal | is_special));
  return std::bit_cast<float>(bits | sign);
}

// Round to nearest, ties to even; overflow gives infinity, NaN stays NaN.
inline std::uint16_t f32_to_f16(float f) {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t a = x & 0x7fffffffu;
  if (a >= 0x7f800000u) return static_cast<std::uint16_t>(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (a < 0x38800000u) {  // below 2^-14, the smallest normal half: a subnormal (or zero)
    const float scaled = std::bit_cast<float>(a) * 0x1p24f;  // units of the smallest subnormal
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(std::nearbyint(scaled)));
  }
  const std::uint32_t odd = (a >> 13) & 1u;
  return static_cast<std::uint16_t>(sign | ((a - 0x38000000u + 0xfffu + odd) >> 13));
}

inline float bf16_to_f32(std::uint16_t h) { return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16); }

// Round to nearest, ties to even; NaN stays NaN.
inline std::uint16_t f32_to_bf16(float f) {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);
  return static_cast<std::uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

}  // namespace residency::workload
