// The decode pass's reference for one row, in double precision, for checking a GPU pass's
// outputs against the bytes of the model (the Metal pass uses it; the CUDA pass has its own copy
// in gpu_decode.cpp, which could move here).
#pragma once

#include <cstdint>

#include "workload/gguf.hpp"

namespace residency::workload {

struct RowReference {
  double value = 0;      // sum of w[i] x[i]
  double magnitude = 0;  // sum of |w[i] x[i]|: what float rounding of the sum is relative to
};
// Row of `n` weights of `type` (F32, F16, BF16, Q8_0; others give 0) times `x`.
RowReference reference_row(const std::uint8_t* row, GgmlType type, std::uint64_t n, const float* x);

}  // namespace residency::workload
