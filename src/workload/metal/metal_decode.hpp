// SPDX-License-Identifier: MIT
// The decode-equivalent pass as a Metal compute kernel, for `residency idle --backend metal`.
//
// The CPU pass (workload/decode_pass.hpp) and the CUDA pass (workload/cuda/gpu_decode.hpp) read
// every weight byte of a GGUF model once per "token"; so does this one: one matrix-vector
// product per 2-D weight tensor, in the model's own types (F32, F16, BF16, Q8_0, Q4_0) and
// layout. On Apple Silicon the GPU reads the weights where llama.cpp's Metal backend does: in
// the mmap'd file itself, through no-copy buffers (MetalHostViews), so an idle pause costs what
// it costs llama.cpp: the re-wire of those buffers when the OS has unwired them. Each tensor is
// read from the first view that holds it whole; one dispatch per view, all in one command buffer.
//
// The kernel's source (kMetalDecodeSource, in metal_decode.cpp) is compiled by Metal at run time
// (newLibraryWithSource): no offline Metal toolchain is needed to build the project.
//
// Apple platforms only; compile-checked on Linux by scripts/metal-check.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "residency/backends/metal.hpp"
#include "residency/status.hpp"
#include "workload/gguf.hpp"

namespace residency::workload {

class MetalDecodePass {
 public:
  // `views` wraps `file` (the mapping whose data section holds the weights) and must outlive the
  // pass. Errors: a weight type the pass does not compute (as DecodePass::check), a tensor that
  // lies whole in no view, the kernel failing to compile (Metal's message), no memory for the
  // table, inputs and outputs.
  static Result<std::unique_ptr<MetalDecodePass>> create(void* device, const GgufModel& model, const MetalHostViews& views);
  ~MetalDecodePass();
  MetalDecodePass(const MetalDecodePass&) = delete;
  MetalDecodePass& operator=(const MetalDecodePass&) = delete;

  // One pass: encodes one dispatch per view, commits, waits; returns the sum of all outputs.
  // Errors: the command buffer failed (Metal's message).
  Result<double> run();
  // Compares the outputs of the last run with a double-precision CPU computation over the same
  // bytes (`file`, the mapping) for the first, middle and last row of every matrix.
  Status verify(const std::uint8_t* file) const;

  std::uint64_t bytes() const { return bytes_; }  // weight bytes read per pass
  std::size_t matrix_count() const { return matrices_.size(); }

  struct Matrix {          // mirrors Matrix in the kernel source (the layout is the ABI)
    std::uint64_t offset;  // bytes from the start of its view
    std::uint64_t rows, row_length, row_bytes;
    std::uint64_t row_start;     // first global row (outputs index)
    std::uint64_t input_offset;  // first float of its input vector
    std::uint32_t type, pad;
  };
  struct Dispatch {  // the matrices [first, first + count) of one view
    std::size_t view = 0;
    std::uint32_t first = 0, count = 0;
    std::uint64_t row_begin = 0, rows = 0;
  };

  struct Impl;

 private:
  MetalDecodePass() = default;
  std::unique_ptr<Impl> impl_;
  std::vector<Matrix> matrices_;             // grouped by view, in Dispatch order
  std::vector<std::uint64_t> file_offsets_;  // per matrix: where its first row is in the file
  std::vector<Dispatch> dispatches_;
  std::vector<float> inputs_;
  std::uint64_t total_rows_ = 0;
  std::uint64_t bytes_ = 0;
};

}  // namespace residency::workload
