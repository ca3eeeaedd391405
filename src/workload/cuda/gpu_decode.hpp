// SPDX-License-Identifier: MIT
// The decode-equivalent pass as a CUDA kernel (gpu_decode_kernels.cu), for `residency idle`
// on the cuda backend.
//
// The CPU pass (workload/decode_pass.hpp) shows what an idle pause costs a model in host
// memory; on a GPU the weights live in device memory, and a pause costs nothing unless the
// residency policy put the memory to sleep, in which case the next decode pays the wake. So
// the pass is the same: one matrix-vector product per 2-D weight tensor, every weight byte read
// once, the model's own types (F32, F16, BF16, Q8_0, Q4_0) and layout; only where it runs
// differs.
// The weights are expected in device memory laid out exactly as the file's data section, so a
// tensor's device address is the section's base plus the tensor's offset.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "backends/cuda/driver.hpp"
#include "backends/cuda/module.hpp"
#include "residency/status.hpp"
#include "workload/gguf.hpp"

namespace residency::workload {

class GpuDecodePass {
 public:
  // Errors: a weight type the pass does not compute (as DecodePass::check), no weight matrix,
  // no device memory for the table, inputs and outputs (small: a float per row).
  static Result<std::unique_ptr<GpuDecodePass>> create(const cuda::Driver& d, CUcontext ctx, const GgufModel& model);
  ~GpuDecodePass();
  GpuDecodePass(const GpuDecodePass&) = delete;
  GpuDecodePass& operator=(const GpuDecodePass&) = delete;

  // One pass over the weights at `weights` (device address of the data section), on `stream`;
  // waits for it and returns the sum of all outputs.
  Result<double> run(CUdeviceptr weights, CUstream stream = nullptr);
  // Compares the outputs of the last run with a double-precision CPU computation over
  // `data_section` (a host copy of the same bytes) for the first, middle and last row of every
  // matrix. Error naming the first row that differs by more than float rounding allows.
  Status verify(const std::uint8_t* data_section) const;

  std::uint64_t bytes() const { return bytes_; }  // weight bytes read per pass
  std::size_t matrix_count() const { return matrices_.size(); }

  struct Matrix {  // mirrors GpuMatrix in gpu_decode_kernels.cu (the layout is the ABI)
    std::uint64_t offset, rows, row_length, row_bytes, row_start, input_offset;
    std::uint32_t type, pad;
  };

 private:
  GpuDecodePass() = default;
  const cuda::Driver* d_ = nullptr;
  CUcontext ctx_ = nullptr;
  cuda::Module module_;
  CUfunction fn_ = nullptr;
  std::vector<Matrix> matrices_;
  std::vector<float> inputs_;  // every input vector, each 16-byte aligned
  std::uint64_t total_rows_ = 0;
  std::uint64_t bytes_ = 0;
  CUdeviceptr d_table_ = 0, d_inputs_ = 0, d_outputs_ = 0, d_sum_ = 0;
};

}  // namespace residency::workload
