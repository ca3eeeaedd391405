// See decode_reference.hpp.
#include "workload/decode_reference.hpp"

#include <cmath>
#include <cstring>

#include "workload/half.hpp"

namespace residency::workload {
namespace {

double weight(const std::uint8_t* row, GgmlType type, std::uint64_t i) {
  std::uint16_t h = 0;
  switch (type) {
    case GgmlType::f32: {
      float f;
      std::memcpy(&f, row + 4 * i, 4);
      return f;
    }
    case GgmlType::f16:
      std::memcpy(&h, row + 2 * i, 2);
      return f16_to_f32(h);
    case GgmlType::bf16:
      std::memcpy(&h, row + 2 * i, 2);
      return bf16_to_f32(h);
    case GgmlType::q8_0: {  // blocks of {fp16 scale, 32 x int8}
      const std::uint8_t* blk = row + (i / 32) * 34;
      std::memcpy(&h, blk, 2);
      return f16_to_f32(h) * static_cast<double>(static_cast<std::int8_t>(blk[2 + i % 32]));
    }
    default:
      return 0;
  }
}

}  // namespace

RowReference reference_row(const std::uint8_t* row, GgmlType type, std::uint64_t n, const float* x) {
  RowReference r;
  for (std::uint64_t i = 0; i < n; ++i) {
    const double term = weight(row, type, i) * x[i];
    r.value += term;
    r.magnitude += std::fabs(term);
  }
  return r;
}

}  // namespace residency::workload
