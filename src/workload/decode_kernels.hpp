// SPDX-License-Identifier: MIT
// Matrix-vector kernels of the decode-equivalent pass, and the plain sum it is measured against.
//
// A decode step of a language model is memory-bound: every weight is read once and used for one
// multiply-add. For the idle benchmark to measure what a pause costs, the pass must read the model
// about as fast as the memory system delivers it; otherwise the re-read after a pause would hide
// behind arithmetic. So each kernel is written to be limited by loads, not by conversions: a
// portable version with independent accumulators that compilers vectorise (no -ffast-math
// needed), and on x86-64 an AVX2/FMA/F16C version chosen at run time where the CPU has it (no
// -march flag, so one binary runs on any x86-64 machine).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "workload/gguf.hpp"

namespace residency::workload {

enum class DecodeIsa : std::uint8_t {
  generic,  // portable C++ (vectorised by the compiler for the build's baseline ISA)
  avx2,     // x86-64 with AVX2, FMA and F16C, chosen at run time
};
std::string_view to_string(DecodeIsa isa) noexcept;

// An activation vector of n elements. Q8_0 and Q4_0 weights are multiplied with its Q8_0
// quantisation in integer arithmetic, as ggml does (Q8_0 is the vec_dot_type of both; a decode
// reads each weight once, and converting 32 weights to floats per block would make the pass slower
// than memory); `x` then holds exactly the values the quantisation represents, so every kernel,
// and the tests' reference, compute with the same vector.
struct MatvecInput {
  const float* x = nullptr;         // n floats
  const std::int8_t* q8 = nullptr;  // n int8 in blocks of 32 (only for Q8_0 and Q4_0 weights)
  const float* q8_scale = nullptr;  // n / 32 block scales: x[i] == q8_scale[i / 32] * q8[i]
};

// Quantises x (n a multiple of 32) to Q8_0 blocks: scale = max|x| / 127, q = round(x / scale), and
// replaces x by the values the blocks represent.
void quantize_input_q8_0(float* x, std::size_t n, std::int8_t* q8, float* q8_scale);

// The AVX2 matvec kernels compute four rows at a time, one from each quarter of the rows they are
// given, so that each thread keeps four sequential streams in flight in different pages (one
// stream per thread cannot draw its share of memory bandwidth; see decode_kernels.cpp).
// y[r] = dot(row r, x) for `rows` rows of `n` elements starting at `w`, rows `row_bytes` apart.
// `w` may have any alignment. A row's y does not depend on `rows` or on where the call starts.
using MatvecFn = void (*)(const std::uint8_t* w, std::size_t row_bytes, std::size_t n, std::size_t rows,
                          const MatvecInput& in, float* y);
// Sum of the n bytes at p read as little-endian 64-bit words (the tail as bytes): the fastest
// plain read of the same memory, the bandwidth baseline (the AVX2 sum reads four streams, as the
// matvec kernels do). bench_decode reports the pass's bandwidth as a ratio of the faster of this
// sum's over the same bytes and llama.cpp's own decode of the same file, measured in the same run.
using SumFn = std::uint64_t (*)(const std::uint8_t* p, std::size_t n);

struct DecodeKernels {
  DecodeIsa isa;
  MatvecFn f32, f16, bf16, q8_0, q4_0;
  SumFn sum;
  // The kernel for `t`, or nullptr for a type the pass does not compute.
  MatvecFn for_type(GgmlType t) const;
};

// The ISAs this CPU can run (generic always, first the best).
std::vector<DecodeIsa> available_isas();
// Kernels for `isa`; the caller checks that the CPU supports it (available_isas()).
const DecodeKernels& decode_kernels(DecodeIsa isa);

// A straightforward scalar reference in double precision, for tests and the GPU passes' checks
// (x: the MatvecInput's floats). `magnitude`, when given, receives the sum of |w x|: what float
// rounding of the sum is relative to.
double reference_dot(GgmlType t, const std::uint8_t* row, std::size_t n, const float* x, double* magnitude = nullptr);

}  // namespace residency::workload
