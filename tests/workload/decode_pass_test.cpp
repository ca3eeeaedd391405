// SPDX-License-Identifier: MIT
// The decode-equivalent pass computes the right matrix-vector products for every supported type,
// with every kernel set this CPU has, whatever the thread count; it refuses other types clearly.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "workload/decode_pass.hpp"
#include "workload/half.hpp"
#include "workload_test_util.hpp"

namespace residency::workload {
namespace {

GgufBuilder mixed_builder() {
  GgufBuilder b;
  // Row lengths chosen to exercise every tail: not multiples of 8, 16 or 32 where the type allows.
  b.add_tensor({"f32.a", GgmlType::f32, {40, 7}});
  b.add_tensor({"f32.b", GgmlType::f32, {1000, 33}});
  b.add_tensor({"f16.a", GgmlType::f16, {43, 5}});
  b.add_tensor({"f16.b", GgmlType::f16, {512, 300}});
  b.add_tensor({"norm", GgmlType::f32, {512}});
  b.add_tensor({"bf16.a", GgmlType::bf16, {9, 3}});
  b.add_tensor({"bf16.b", GgmlType::bf16, {640, 129}});
  b.add_tensor({"q8.a", GgmlType::q8_0, {32, 3}});
  b.add_tensor({"q8.b", GgmlType::q8_0, {96, 50}});
  b.add_tensor({"q8.c", GgmlType::q8_0, {2048, 70}});
  b.add_tensor({"q4.a", GgmlType::q4_0, {32, 5}});
  b.add_tensor({"q4.b", GgmlType::q4_0, {96, 50}});  // shares q8.b's input
  b.add_tensor({"q4.c", GgmlType::q4_0, {4096, 37}});
  b.add_tensor({"f16.3d", GgmlType::f16, {64, 3, 2}});
  return b;
}

struct Fixture {
  std::vector<std::uint8_t> bytes;
  GgufModel model;
};

Fixture make_fixture() {
  Fixture f;
  f.bytes = testing::file_bytes(mixed_builder(), 3);
  auto m = parse_gguf(f.bytes, "mixed");
  EXPECT_TRUE(m.is_ok()) << m.message();
  f.model = *m;
  return f;
}

TEST(DecodePass, MatchesTheReferenceForEveryTypeAndKernelSet) {
  const Fixture fx = make_fixture();
  for (DecodeIsa isa : available_isas()) {
    SCOPED_TRACE(std::string(to_string(isa)));
    auto pass = DecodePass::create(fx.model, fx.bytes.data(), {2, isa});
    ASSERT_TRUE(pass.is_ok()) << pass.message();
    EXPECT_EQ((*pass)->matrix_count(), 13u);  // every tensor but the 1-D norm
    EXPECT_EQ((*pass)->bytes(), fx.model.tensor_bytes() - 512 * 4);
    (*pass)->run();
    for (std::size_t m = 0; m < (*pass)->matrix_count(); ++m) {
      const DecodeMatrix& mx = (*pass)->matrix(m);
      const auto out = (*pass)->output(m);
      const auto x = (*pass)->input(m);
      ASSERT_EQ(out.size(), mx.rows);
      for (std::uint64_t r = 0; r < mx.rows; ++r) {
        const std::uint8_t* row = mx.data + r * mx.row_bytes;
        const double ref = reference_dot(mx.tensor->type, row, mx.row_length, x.data());
        // Tolerance: float accumulation over n terms of magnitude <= |w||x|.
        double mag = 0;
        std::vector<float> one(x.size(), 0.0f);
        for (std::size_t k = 0; k < x.size(); ++k) {
          one[k] = std::fabs(x[k]);
        }
        mag = std::fabs(reference_dot(mx.tensor->type, row, mx.row_length, one.data())) + 1e-6;
        EXPECT_NEAR(out[r], ref, 1e-5 * mag * std::sqrt(static_cast<double>(mx.row_length)) + 1e-6)
            << mx.tensor->name << " row " << r;
      }
    }
  }
}

// The reference the GPU passes check against also reports the sum of |w x|, which their rounding
// tolerance is relative to.
TEST(DecodePass, ReferenceReportsTheMagnitudeOfItsTerms) {
  const float w[3] = {1.0f, -2.0f, 3.0f};
  const float x[3] = {1.0f, 1.0f, -1.0f};
  std::uint8_t row[sizeof w];
  std::memcpy(row, w, sizeof w);
  double magnitude = -1;
  EXPECT_DOUBLE_EQ(reference_dot(GgmlType::f32, row, 3, x, &magnitude), -4.0);
  EXPECT_DOUBLE_EQ(magnitude, 6.0);
  EXPECT_DOUBLE_EQ(reference_dot(GgmlType::f32, row, 3, x), -4.0);
}

// The Q4_0 kernels against a product computed here in double precision from the layout itself
// (byte j of a block: weight j in the low nibble, weight j + 16 in the high one, value
// d * (nibble - 8)) and the float input, not its Q8_0 quantisation: the kernels differ from it by
// the input's quantisation, at most half a Q8_0 step (max|x| / 254) per element, times |w|.
TEST(DecodePass, Q4_0AgreesWithAFloatProduct) {
  constexpr std::size_t n = 256, rows = 9, blocks = n / 32, row_bytes = blocks * 18;
  std::vector<std::uint8_t> w(rows * row_bytes);
  std::vector<double> wf(rows * n);
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t b = 0; b < blocks; ++b) {
      std::uint8_t* blk = w.data() + r * row_bytes + b * 18;
      const float d = 0.01f * static_cast<float>(1 + (r + 3 * b) % 7) * (b % 2 ? -1.0f : 1.0f);
      const std::uint16_t dh = f32_to_f16(d);
      std::memcpy(blk, &dh, 2);
      for (std::size_t j = 0; j < 16; ++j) blk[2 + j] = static_cast<std::uint8_t>((r * 31 + b * 17 + j * 7) % 256);
      for (std::size_t k = 0; k < 32; ++k) {
        const unsigned nibble = k < 16 ? blk[2 + k] & 0x0fu : blk[2 + k - 16] >> 4;
        wf[r * n + b * 32 + k] = static_cast<double>(f16_to_f32(dh)) * (static_cast<int>(nibble) - 8);
      }
    }
  }
  std::vector<float> x(n);
  for (std::size_t k = 0; k < n; ++k) {
    x[k] = std::sin(static_cast<float>(k) * 0.37f) * (1.0f + static_cast<float>(k % 5));
  }
  std::vector<float> xq(x);
  std::vector<std::int8_t> q8(n);
  std::vector<float> q8s(blocks);
  quantize_input_q8_0(xq.data(), n, q8.data(), q8s.data());
  const MatvecInput in{xq.data(), q8.data(), q8s.data()};
  std::vector<float> generic(rows);
  decode_kernels(DecodeIsa::generic).q4_0(w.data(), row_bytes, n, rows, in, generic.data());
  for (DecodeIsa isa : available_isas()) {
    SCOPED_TRACE(std::string(to_string(isa)));
    std::vector<float> y(rows);
    decode_kernels(isa).for_type(GgmlType::q4_0)(w.data(), row_bytes, n, rows, in, y.data());
    for (std::size_t r = 0; r < rows; ++r) {
      double exact = 0, input_err = 0, mag = 0;
      for (std::size_t k = 0; k < n; ++k) {
        const double wk = wf[r * n + k];
        exact += wk * x[k];
        input_err += std::fabs(wk) * q8s[k / 32] / 2;
        mag += std::fabs(wk * x[k]);
      }
      EXPECT_NEAR(y[r], exact, input_err * 1.01 + 1e-5 * mag) << "row " << r;
      // With the quantised input the product is exact but for float rounding.
      EXPECT_NEAR(y[r], reference_dot(GgmlType::q4_0, w.data() + r * row_bytes, n, xq.data()), 1e-5 * mag) << "row " << r;
      EXPECT_NEAR(y[r], generic[r], 1e-5 * mag) << "row " << r << ": the kernel sets disagree";
    }
  }
}

TEST(DecodePass, OutputsDoNotDependOnTheThreadCount) {
  const Fixture fx = make_fixture();
  auto one = DecodePass::create(fx.model, fx.bytes.data(), {1, std::nullopt});
  auto three = DecodePass::create(fx.model, fx.bytes.data(), {3, std::nullopt});
  ASSERT_TRUE(one.is_ok() && three.is_ok());
  EXPECT_EQ((*three)->threads(), 3u);
  const double a = (*one)->run();
  const double b = (*three)->run();
  EXPECT_EQ(a, b);
  EXPECT_EQ(a, (*three)->run()) << "a second pass gave another result";
  for (std::size_t m = 0; m < (*one)->matrix_count(); ++m) {
    const auto x = (*one)->output(m);
    const auto y = (*three)->output(m);
    EXPECT_EQ(0, std::memcmp(x.data(), y.data(), x.size_bytes())) << (*one)->matrix(m).tensor->name;
  }
  EXPECT_EQ((*one)->plain_sum(), (*three)->plain_sum());
}

// The AVX2 kernels compute four rows at a time (rows from four groups of a piece, walked side by
// side); each row keeps the arithmetic of the one-row kernel, so a row's output is the same
// whether it was computed in a group of four, as a leftover, or alone.
TEST(DecodePass, ARowsOutputDoesNotDependOnItsGrouping) {
  const Fixture fx = make_fixture();
  for (DecodeIsa isa : available_isas()) {
    SCOPED_TRACE(std::string(to_string(isa)));
    auto pass = DecodePass::create(fx.model, fx.bytes.data(), {1, isa});
    ASSERT_TRUE(pass.is_ok()) << pass.message();
    (*pass)->run();
    const DecodeKernels& k = decode_kernels(isa);
    for (std::size_t m = 0; m < (*pass)->matrix_count(); ++m) {
      const DecodeMatrix& mx = (*pass)->matrix(m);
      const auto x = (*pass)->input(m);
      std::vector<float> xs(x.begin(), x.end());
      std::vector<std::int8_t> q8(xs.size());
      std::vector<float> q8s(xs.size() / 32 + 1);
      if (mx.tensor->type == GgmlType::q8_0 || mx.tensor->type == GgmlType::q4_0) {
        quantize_input_q8_0(xs.data(), xs.size(), q8.data(), q8s.data());
      }
      const MatvecInput in{xs.data(), q8.data(), q8s.data()};
      const auto rows = static_cast<std::size_t>(mx.rows);
      std::vector<float> together(rows), alone(rows), split(rows);
      k.for_type(mx.tensor->type)(mx.data, mx.row_bytes, mx.row_length, rows, in, together.data());
      for (std::size_t r = 0; r < rows; ++r) {
        k.for_type(mx.tensor->type)(mx.data + r * mx.row_bytes, mx.row_bytes, mx.row_length, 1, in, &alone[r]);
      }
      const std::size_t half = rows / 2;  // two calls: other groups, other leftovers
      k.for_type(mx.tensor->type)(mx.data, mx.row_bytes, mx.row_length, half, in, split.data());
      k.for_type(mx.tensor->type)(mx.data + half * mx.row_bytes, mx.row_bytes, mx.row_length, rows - half, in,
                                  split.data() + half);
      EXPECT_EQ(0, std::memcmp(together.data(), alone.data(), rows * sizeof(float))) << mx.tensor->name;
      EXPECT_EQ(0, std::memcmp(together.data(), split.data(), rows * sizeof(float))) << mx.tensor->name;
      // And the pass computed the same.
      EXPECT_EQ(0, std::memcmp(together.data(), (*pass)->output(m).data(), rows * sizeof(float))) << mx.tensor->name;
    }
  }
}

TEST(DecodePass, KernelSetsAgreeOnThePlainSum) {
  std::vector<std::uint8_t> bytes(5000);
  for (std::size_t k = 0; k < bytes.size(); ++k) bytes[k] = static_cast<std::uint8_t>(k * 131 + 7);
  for (std::size_t start : {0u, 1u, 7u}) {
    for (std::size_t n : {0u, 5u, 64u, 127u, 129u, 4000u}) {
      // Reference: 8-byte little-endian words in whole 64-byte groups, then the tail bytes.
      std::uint64_t ref = 0;
      std::size_t i = 0;
      for (; i + 64 <= n; i += 64) {
        for (std::size_t k = 0; k < 64; k += 8) {
          std::uint64_t w;
          std::memcpy(&w, bytes.data() + start + i + k, 8);
          ref += w;
        }
      }
      for (; i < n; ++i) ref += bytes[start + i];
      EXPECT_EQ(decode_kernels(DecodeIsa::generic).sum(bytes.data() + start, n), ref) << start << " " << n;
      for (DecodeIsa isa : available_isas()) {
        // The AVX2 sum reads 128-byte strides: equal to the generic one modulo the word grouping
        // of the tail, so compare it to the generic result on whole strides only.
        const std::size_t whole = n / 128 * 128;
        EXPECT_EQ(decode_kernels(isa).sum(bytes.data() + start, whole),
                  decode_kernels(DecodeIsa::generic).sum(bytes.data() + start, whole));
      }
    }
  }
}

TEST(DecodePass, RefusesTypesItDoesNotCompute) {
  GgufBuilder b;
  b.add_tensor({"ok", GgmlType::f16, {32, 2}});
  b.add_tensor({"blk.0.ffn_up.weight", GgmlType::q4_k, {256, 2}});
  const auto bytes = testing::file_bytes(b);
  auto m = parse_gguf(bytes, "q4k");
  ASSERT_TRUE(m.is_ok());
  auto pass = DecodePass::create(*m, bytes.data());
  ASSERT_FALSE(pass.is_ok());
  EXPECT_EQ(pass.message(),
            "tensor 'blk.0.ffn_up.weight' is Q4_K; the decode pass computes F32, F16, BF16, Q8_0 and Q4_0 weights "
            "only (make a model of one of these types with `residency make-model --type f16|q8_0|q4_0|bf16|f32`)");

  GgufBuilder only_norms;
  only_norms.add_tensor({"norm", GgmlType::f32, {64}});
  const auto nb = testing::file_bytes(only_norms);
  auto nm = parse_gguf(nb, "norms");
  ASSERT_TRUE(nm.is_ok());
  EXPECT_NE(DecodePass::check(*nm).message().find("no weight matrix"), std::string::npos);
}

}  // namespace
}  // namespace residency::workload
