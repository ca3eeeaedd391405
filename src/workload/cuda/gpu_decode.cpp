// SPDX-License-Identifier: MIT
// The GPU decode-equivalent pass; see gpu_decode.hpp.
#include "workload/cuda/gpu_decode.hpp"

#include <cmath>
#include <cstring>
#include <map>
#include <string>

#include "workload/decode_pass.hpp"
#include "workload/half.hpp"

namespace residency::cuda::embedded {
extern const unsigned char gpu_decode_kernels[];
extern const std::size_t gpu_decode_kernels_size;
}  // namespace residency::cuda::embedded

namespace residency::workload {
namespace {

static_assert(sizeof(GpuDecodePass::Matrix) == 56, "must match GpuMatrix in gpu_decode_kernels.cu");

// 8 warps per block, and 16 blocks for each of 132 SMs (the largest GPU the pass was sized on):
// enough loads in flight to be memory-bound there; the grid-stride loop covers any model and GPU.
constexpr unsigned kThreads = 256;
constexpr unsigned kBlocks = 132 * 16;
// Float rounding of a dot product of n terms, relative to the sum of |w x|: 1e-3 is far above
// float's error for the row lengths of real models (< 1e5) and far below any wrong byte.
constexpr double kTolerance = 1e-3;

// The activation vector: fixed values in [-1, 1] (what they are does not matter, only that they
// are the same for every run and not zero).
float input_value(std::uint64_t i) {
  return static_cast<float>(static_cast<double>((i * 2654435761ull) % 2001ull) / 1000.0 - 1.0);
}

double weight(const std::uint8_t* row, GgmlType type, std::uint64_t i) {
  switch (type) {
    case GgmlType::f32: {
      float f;
      std::memcpy(&f, row + 4 * i, 4);
      return f;
    }
    case GgmlType::f16: {
      std::uint16_t h;
      std::memcpy(&h, row + 2 * i, 2);
      return f16_to_f32(h);
    }
    case GgmlType::bf16: {
      std::uint16_t h;
      std::memcpy(&h, row + 2 * i, 2);
      return bf16_to_f32(h);
    }
    case GgmlType::q8_0: {
      const std::uint8_t* blk = row + (i / 32) * 34;
      std::uint16_t h;
      std::memcpy(&h, blk, 2);
      return f16_to_f32(h) * static_cast<double>(static_cast<std::int8_t>(blk[2 + i % 32]));
    }
    case GgmlType::q4_0: {
      const std::uint8_t* blk = row + (i / 32) * 18;
      std::uint16_t h;
      std::memcpy(&h, blk, 2);
      const unsigned nibble = i % 32 < 16 ? blk[2 + i % 32] & 0x0fu : blk[2 + i % 32 - 16] >> 4;
      return f16_to_f32(h) * static_cast<double>(static_cast<int>(nibble) - 8);
    }
    default: return 0;
  }
}

}  // namespace

Result<std::unique_ptr<GpuDecodePass>> GpuDecodePass::create(const cuda::Driver& d, CUcontext ctx, const GgufModel& model) {
  if (Status st = DecodePass::check(model); !st) return st;
  std::unique_ptr<GpuDecodePass> p(new GpuDecodePass());
  p->d_ = &d;
  p->ctx_ = ctx;
  auto m = cuda::Module::load(d, ctx, cuda::embedded::gpu_decode_kernels, "decode");
  if (!m) return m.status();
  p->module_ = std::move(m.value());
  auto f = p->module_.function("decode_pass");
  if (!f) return f.status();
  p->fn_ = *f;

  std::map<std::uint64_t, std::uint64_t> input_of_length;
  for (const auto& t : model.tensors) {
    if (t.n_dims < 2) continue;
    auto [it, fresh] = input_of_length.emplace(t.row_length(), p->inputs_.size());
    if (fresh) {
      for (std::uint64_t i = 0; i < t.row_length(); ++i) p->inputs_.push_back(input_value(i));
      while (p->inputs_.size() % 4 != 0) p->inputs_.push_back(0.f);  // keep each vector 16-byte aligned
    }
    Matrix mx{};
    mx.offset = t.offset;
    mx.rows = t.rows();
    mx.row_length = t.row_length();
    mx.row_bytes = t.row_bytes();
    mx.row_start = p->total_rows_;
    mx.input_offset = it->second;
    mx.type = static_cast<std::uint32_t>(t.type);
    p->matrices_.push_back(mx);
    p->total_rows_ += mx.rows;
    p->bytes_ += t.n_bytes;
  }

  cuda::ContextScope scope(d, ctx);
  auto alloc = [&](CUdeviceptr* out, std::size_t bytes, const char* what) -> Status {
    const CUresult r = d.cuMemAlloc(out, bytes);
    if (r != CUDA_SUCCESS) return d.error(r, std::string("allocating the decode pass's ") + what, "cuMemAlloc");
    return {};
  };
  const std::size_t table_bytes = p->matrices_.size() * sizeof(Matrix);
  if (Status st = alloc(&p->d_table_, table_bytes, "matrix table"); !st) return st;
  if (Status st = alloc(&p->d_inputs_, p->inputs_.size() * sizeof(float), "inputs"); !st) return st;
  if (Status st = alloc(&p->d_outputs_, p->total_rows_ * sizeof(float), "outputs"); !st) return st;
  if (Status st = alloc(&p->d_sum_, sizeof(double), "sum"); !st) return st;
  CUresult r = d.cuMemcpyHtoD(p->d_table_, p->matrices_.data(), table_bytes);
  if (r == CUDA_SUCCESS) r = d.cuMemcpyHtoD(p->d_inputs_, p->inputs_.data(), p->inputs_.size() * sizeof(float));
  if (r != CUDA_SUCCESS) return d.error(r, "uploading the decode pass's table and inputs", "cuMemcpyHtoD");
  return p;
}

GpuDecodePass::~GpuDecodePass() {
  if (d_ == nullptr) return;
  cuda::ContextScope scope(*d_, ctx_);
  for (CUdeviceptr p : {d_table_, d_inputs_, d_outputs_, d_sum_})
    if (p != 0) (void)d_->cuMemFree(p);
}

Result<double> GpuDecodePass::run(CUdeviceptr weights, CUstream stream) {
  cuda::ContextScope scope(*d_, ctx_);
  double sum = 0;
  CUresult r = d_->cuMemcpyHtoDAsync(d_sum_, &sum, sizeof sum, stream);
  if (r != CUDA_SUCCESS) return d_->error(r, "clearing the decode sum", "cuMemcpyHtoDAsync");
  auto n_mats = static_cast<unsigned>(matrices_.size());
  void* args[] = {&weights, &d_table_, &n_mats, &total_rows_, &d_inputs_, &d_outputs_, &d_sum_};
  r = d_->cuLaunchKernel(fn_, kBlocks, 1, 1, kThreads, 1, 1, 0, stream, args, nullptr);
  if (r != CUDA_SUCCESS) return d_->error(r, "launching the decode pass", "cuLaunchKernel");
  r = d_->cuMemcpyDtoHAsync(&sum, d_sum_, sizeof sum, stream);
  if (r == CUDA_SUCCESS) r = d_->cuStreamSynchronize(stream);
  if (r != CUDA_SUCCESS) return d_->error(r, "running the decode pass", "cuStreamSynchronize");
  return sum;
}

Status GpuDecodePass::verify(const std::uint8_t* data_section) const {
  cuda::ContextScope scope(*d_, ctx_);
  std::vector<float> out(total_rows_);
  const CUresult r = d_->cuMemcpyDtoH(out.data(), d_outputs_, out.size() * sizeof(float));
  if (r != CUDA_SUCCESS) return d_->error(r, "reading the decode outputs", "cuMemcpyDtoH");
  for (std::size_t mi = 0; mi < matrices_.size(); ++mi) {
    const Matrix& m = matrices_[mi];
    for (std::uint64_t row : {std::uint64_t{0}, m.rows / 2, m.rows - 1}) {
      const std::uint8_t* w = data_section + m.offset + row * m.row_bytes;
      double ref = 0, mag = 0;
      for (std::uint64_t i = 0; i < m.row_length; ++i) {
        const double term = weight(w, static_cast<GgmlType>(m.type), i) * inputs_[m.input_offset + i];
        ref += term;
        mag += std::fabs(term);
      }
      const double got = out[m.row_start + row];
      if (!(std::fabs(got - ref) <= kTolerance * mag + 1e-6)) {
        return Status(ErrorCode::backend_error, "the GPU decode pass computed " + std::to_string(got) + " for row " +
                                                    std::to_string(row) + " of matrix " + std::to_string(mi) +
                                                    "; the CPU reference is " + std::to_string(ref));
      }
    }
  }
  return {};
}

}  // namespace residency::workload
