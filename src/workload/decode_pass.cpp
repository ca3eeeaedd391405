// SPDX-License-Identifier: MIT
// DecodePass (see decode_pass.hpp).
#include "workload/decode_pass.hpp"

#include <algorithm>
#include <atomic>
#include <map>

namespace residency::workload {
namespace {

// Rows are handed out in pieces of about this many bytes: large enough that taking a piece (one
// atomic add) costs nothing next to reading it, small enough (a 1 GiB model gives ~4000 pieces)
// that threads finish together.
constexpr std::uint64_t kPieceBytes = 256 * 1024;

}  // namespace

Status DecodePass::check(const GgufModel& model) {
  std::size_t matrices = 0;
  for (const auto& t : model.tensors) {
    if (t.n_dims < 2 || t.n_elements == 0) continue;
    if (!decode_supported(t.type)) {
      return Status(ErrorCode::invalid_argument,
                    "tensor '" + t.name + "' is " + std::string(ggml_type_name(t.type)) +
                        "; the decode pass computes F32, F16, BF16, Q8_0 and Q4_0 weights only (make a model "
                        "of one of these types with `residency make-model --type f16|q8_0|q4_0|bf16|f32`)");
    }
    ++matrices;
  }
  if (matrices == 0) {
    return Status(ErrorCode::invalid_argument,
                  "the model has no weight matrix (no tensor of 2 or more dimensions): nothing to decode");
  }
  return {};
}

Result<std::unique_ptr<DecodePass>> DecodePass::create(const GgufModel& model, const std::uint8_t* file_base,
                                                       Options options) {
  if (Status st = check(model); !st) return st;
  const auto isas = available_isas();
  const DecodeIsa isa = options.isa.value_or(isas.front());
  if (std::find(isas.begin(), isas.end(), isa) == isas.end()) {
    return Status(ErrorCode::unsupported, "this CPU cannot run the " + std::string(to_string(isa)) + " kernels");
  }
  std::unique_ptr<DecodePass> p(new DecodePass());
  p->kernels_ = &decode_kernels(isa);
  std::map<std::uint64_t, std::size_t> input_of_length;
  std::uint64_t outputs = 0;
  for (const auto& t : model.tensors) {
    if (t.n_dims < 2 || t.n_elements == 0) continue;  // an empty tensor has nothing to read
    DecodeMatrix m;
    m.tensor = &t;
    m.data = file_base + t.file_offset;
    m.rows = t.rows();
    m.row_length = t.row_length();
    m.row_bytes = t.row_bytes();
    auto [it, inserted] = input_of_length.try_emplace(m.row_length, p->inputs_.size());
    if (inserted) {
      // A fixed activation vector: values in [-1, 1], different per position.
      Input in;
      in.x.resize(static_cast<std::size_t>(m.row_length));
      for (std::size_t k = 0; k < in.x.size(); ++k) {
        in.x[k] = static_cast<float>(static_cast<int>((k * 2654435761u) % 2001u) - 1000) / 1000.0f;
      }
      p->inputs_.push_back(std::move(in));
    }
    m.input = it->second;
    Input& in = p->inputs_[m.input];
    if ((t.type == GgmlType::q8_0 || t.type == GgmlType::q4_0) && in.q8.empty()) {
      in.q8.resize(in.x.size());
      in.q8_scale.resize(in.x.size() / 32);
      quantize_input_q8_0(in.x.data(), in.x.size(), in.q8.data(), in.q8_scale.data());
    }
    m.output_first = static_cast<std::size_t>(outputs);
    outputs += m.rows;
    p->bytes_ += t.n_bytes;
    const std::uint64_t per = std::max<std::uint64_t>(1, kPieceBytes / std::max<std::uint64_t>(1, m.row_bytes));
    for (std::uint64_t r = 0; r < m.rows; r += per) {
      p->pieces_.push_back({p->matrices_.size(), r, std::min(per, m.rows - r)});
    }
    p->fns_.push_back(p->kernels_->for_type(t.type));
    p->matrices_.push_back(m);
  }
  for (Input& in : p->inputs_) in.view = {in.x.data(), in.q8.data(), in.q8_scale.data()};
  p->outputs_.assign(static_cast<std::size_t>(outputs), 0.0f);
  p->pool_ = std::make_unique<WorkerPool>(options.threads);
  return p;
}

double DecodePass::run() {
  std::atomic<std::size_t> next{0};
  pool_->run([&](unsigned) {
    for (;;) {
      const std::size_t k = next.fetch_add(1, std::memory_order_relaxed);
      if (k >= pieces_.size()) return;
      const Piece& piece = pieces_[k];
      const DecodeMatrix& m = matrices_[piece.matrix];
      fns_[piece.matrix](m.data + piece.first_row * m.row_bytes, static_cast<std::size_t>(m.row_bytes),
                         static_cast<std::size_t>(m.row_length), static_cast<std::size_t>(piece.rows),
                         inputs_[m.input].view, outputs_.data() + m.output_first + piece.first_row);
    }
  });
  double s = 0;
  for (float y : outputs_) s += static_cast<double>(y);
  return s;
}

std::uint64_t DecodePass::plain_sum() {
  std::atomic<std::size_t> next{0};
  std::atomic<std::uint64_t> total{0};
  const SumFn sum = kernels_->sum;
  pool_->run([&](unsigned) {
    std::uint64_t local = 0;
    for (;;) {
      const std::size_t k = next.fetch_add(1, std::memory_order_relaxed);
      if (k >= pieces_.size()) break;
      const Piece& piece = pieces_[k];
      const DecodeMatrix& m = matrices_[piece.matrix];
      local += sum(m.data + piece.first_row * m.row_bytes, static_cast<std::size_t>(piece.rows * m.row_bytes));
    }
    total.fetch_add(local, std::memory_order_relaxed);
  });
  return total.load();
}

}  // namespace residency::workload
