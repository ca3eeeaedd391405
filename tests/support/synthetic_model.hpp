// SPDX-License-Identifier: MIT
// A llama-shaped F16 GGUF model of about `bytes` that llama.cpp loads and decodes, written at `path`
// (F16: no CPU repacks it, so every machine runs the same layout). Empty on success, else why not.
#pragma once

#include <cstdint>
#include <string>

#include "workload/gguf_writer.hpp"

namespace residency::testing {

inline std::string write_f16_model(const std::string& path, std::uint64_t bytes) {
  auto shape = workload::plan_llama_shape(bytes, workload::GgmlType::f16);
  if (!shape) return shape.message();
  if (auto st = workload::write_synthetic_model(path, *shape, workload::kSyntheticSeed, 2); !st) return st.message();
  return {};
}

}  // namespace residency::testing
