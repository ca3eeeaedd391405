// SPDX-License-Identifier: MIT
// The decode-equivalent pass: one matrix-vector product per 2-D weight tensor of a GGUF model.
//
// A real decode step reads every weight of the model once (each weight matrix multiplies the
// current token's activation vector), and so does this pass, with the model's own tensors, types
// and layout, spread over a persistent pool of threads. That is all the idle benchmark needs: the
// time of a decode after a pause is the time to read the model again, from wherever the pause has
// left it (wired, in the page cache, or on disk). The activations are fixed vectors, not a real
// forward pass; nothing depends on what the numbers mean.
//
// Work is cut into pieces of consecutive rows of about kPieceBytes, taken by the threads from an
// atomic counter, with one synchronisation per pass (not one per tensor). Every row is computed
// by exactly one thread with the same kernel, so the outputs do not depend on the thread count.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "residency/status.hpp"
#include "workload/decode_kernels.hpp"
#include "workload/gguf.hpp"
#include "workload/worker_pool.hpp"

namespace residency::workload {

struct DecodeMatrix {
  const GgufTensor* tensor = nullptr;
  const std::uint8_t* data = nullptr;  // inside the caller's mapping
  std::uint64_t rows = 0, row_length = 0, row_bytes = 0;
  std::size_t input = 0;         // index of the input vector (one per distinct row length)
  std::size_t output_first = 0;  // first of its `rows` outputs
};

class DecodePass {
 public:
  struct Options {
    unsigned threads = 0;          // 0 = one per core
    std::optional<DecodeIsa> isa;  // default: the best this CPU has
  };

  // Every non-empty tensor of 2 or more dims is a weight matrix (ne[0] = row length, the rest
  // rows); 1-D tensors (norms, biases) are skipped. Errors (invalid_argument): a weight matrix of a type the
  // pass does not compute (names the tensor, its type and the accepted types), a model without
  // any weight matrix, an ISA this CPU lacks.
  static Status check(const GgufModel& model);
  static Result<std::unique_ptr<DecodePass>> create(const GgufModel& model, const std::uint8_t* file_base, Options options);
  static Result<std::unique_ptr<DecodePass>> create(const GgufModel& model, const std::uint8_t* file_base) {
    return create(model, file_base, Options{});
  }

  // One decode-equivalent pass over every weight matrix; returns the sum of all outputs (so the
  // work cannot be optimised away, and a test can compare runs).
  double run();
  // The bandwidth baseline: a plain multithreaded sum over exactly the same bytes and pieces.
  std::uint64_t plain_sum();

  std::uint64_t bytes() const { return bytes_; }  // weight bytes read per pass
  std::size_t matrix_count() const { return matrices_.size(); }
  const DecodeMatrix& matrix(std::size_t i) const { return matrices_[i]; }
  std::span<const float> output(std::size_t i) const {
    return {outputs_.data() + matrices_[i].output_first, static_cast<std::size_t>(matrices_[i].rows)};
  }
  // The activation vector matrix i is multiplied with (for Q8_0 and Q4_0 weights: the values its
  // Q8_0 quantisation represents, see MatvecInput).
  std::span<const float> input(std::size_t i) const { return inputs_[matrices_[i].input].x; }
  unsigned threads() const { return pool_->size(); }
  DecodeIsa isa() const { return kernels_->isa; }

 private:
  struct Piece {
    std::size_t matrix;
    std::uint64_t first_row, rows;
  };
  DecodePass() = default;

  const DecodeKernels* kernels_ = nullptr;
  std::vector<DecodeMatrix> matrices_;
  std::vector<MatvecFn> fns_;  // per matrix
  struct Input {
    std::vector<float> x;
    std::vector<std::int8_t> q8;  // for Q8_0 and Q4_0 weights of this row length
    std::vector<float> q8_scale;
    MatvecInput view;  // pointers into the vectors above
  };
  std::vector<Input> inputs_;
  std::vector<float> outputs_;
  std::vector<Piece> pieces_;
  std::uint64_t bytes_ = 0;
  std::unique_ptr<WorkerPool> pool_;
};

}  // namespace residency::workload
