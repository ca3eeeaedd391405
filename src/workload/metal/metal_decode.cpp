// SPDX-License-Identifier: MIT
// The Metal decode-equivalent pass; see metal_decode.hpp.
#include "workload/metal/metal_decode.hpp"

#include <Foundation/Foundation.hpp>
#include <Metal/Metal.hpp>

#include "backends/metal/metal_util.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include "workload/decode_kernels.hpp"
#include "workload/decode_pass.hpp"

namespace residency::workload {
namespace {

using metal::describe;

// Compiled by Metal at run time. One SIMD group (32 threads on every Apple GPU) computes whole
// rows: global row g belongs to the matrix whose [row_start, row_start + rows) holds it (binary
// search over this dispatch's slice of the table); lanes stride over the row, simd_sum adds.
// Memory-bound by design: every weight byte is read once.
constexpr const char* kMetalDecodeSource = R"msl(
#include <metal_stdlib>
using namespace metal;

struct Matrix {
  ulong offset;
  ulong rows, row_length, row_bytes;
  ulong row_start;
  ulong input_offset;
  uint type;
  uint pad;
};

static float bf16_to_float(ushort h) { return as_type<float>(uint(h) << 16); }

static float row_dot(device const uchar* row, uint type, ulong n, device const float* x, uint lane) {
  float acc = 0.0f;
  if (type == 0) {
    device const float* w = (device const float*)row;
    for (ulong i = lane; i < n; i += 32) acc += w[i] * x[i];
  } else if (type == 1) {
    device const half* w = (device const half*)row;
    for (ulong i = lane; i < n; i += 32) acc += float(w[i]) * x[i];
  } else if (type == 30) {
    device const ushort* w = (device const ushort*)row;
    for (ulong i = lane; i < n; i += 32) acc += bf16_to_float(w[i]) * x[i];
  } else if (type == 8) {
    // Q8_0: blocks of 32 weights, {fp16 scale, 32 x int8}, 34 bytes; lane j takes weight j.
    const ulong blocks = n / 32;
    for (ulong b = 0; b < blocks; ++b) {
      device const uchar* blk = row + b * 34;
      const half d = as_type<half>(ushort(blk[0]) | (ushort(blk[1]) << 8));
      const char q = as_type<char>(blk[2 + lane]);
      acc += float(d) * float(q) * x[b * 32 + lane];
    }
  } else if (type == 2) {
    // Q4_0: blocks of 32 weights, {fp16 scale, 16 bytes}, 18 bytes; byte j holds weight j in its
    // low nibble and weight j + 16 in its high one, each (nibble - 8); lane j takes weight j.
    const ulong blocks = n / 32;
    for (ulong b = 0; b < blocks; ++b) {
      device const uchar* blk = row + b * 18;
      const half d = as_type<half>(ushort(blk[0]) | (ushort(blk[1]) << 8));
      const uchar byte = blk[2 + (lane & 15)];
      const int q = int(lane < 16 ? (byte & 15) : (byte >> 4)) - 8;
      acc += float(d) * float(q) * x[b * 32 + lane];
    }
  }
  return simd_sum(acc);
}

kernel void decode_pass(device const uchar* weights [[buffer(0)]],
                        device const Matrix* mats [[buffer(1)]],
                        constant uint& n_mats [[buffer(2)]],
                        constant ulong& row_begin [[buffer(3)]],
                        constant ulong& n_rows [[buffer(4)]],
                        device const float* inputs [[buffer(5)]],
                        device float* outputs [[buffer(6)]],
                        uint group [[threadgroup_position_in_grid]],
                        uint groups [[threadgroups_per_grid]],
                        uint simd [[simdgroup_index_in_threadgroup]],
                        uint simds [[simdgroups_per_threadgroup]],
                        uint lane [[thread_index_in_simdgroup]]) {
  for (ulong k = ulong(group) * simds + simd; k < n_rows; k += ulong(groups) * simds) {
    const ulong g = row_begin + k;
    uint lo = 0, hi = n_mats - 1;  // last matrix with row_start <= g
    while (lo < hi) {
      const uint mid = (lo + hi + 1) / 2;
      if (mats[mid].row_start <= g) lo = mid; else hi = mid - 1;
    }
    const Matrix m = mats[lo];
    const ulong r = g - m.row_start;
    const float v = row_dot(weights + m.offset + r * m.row_bytes, m.type, m.row_length, inputs + m.input_offset, lane);
    if (lane == 0) outputs[g] = v;
  }
}
)msl";

// 8 SIMD groups per threadgroup; enough threadgroups in flight to keep every core's loads busy
// (the grid-stride loop covers any model).
constexpr NS::UInteger kThreadsPerGroup = 256;
constexpr std::uint64_t kMaxGroups = 16384;
// Float rounding of a dot product of n terms relative to the sum of |w x|, as the CUDA pass.
constexpr double kTolerance = 1e-3;

float input_value(std::uint64_t i) {
  return static_cast<float>(static_cast<double>((i * 2654435761ull) % 2001ull) / 1000.0 - 1.0);
}

}  // namespace

static_assert(sizeof(MetalDecodePass::Matrix) == 56, "must match Matrix in kMetalDecodeSource");

struct MetalDecodePass::Impl {
  NS::SharedPtr<MTL::Device> device;
  NS::SharedPtr<MTL::CommandQueue> queue;
  NS::SharedPtr<MTL::ComputePipelineState> pipeline;
  NS::SharedPtr<MTL::Buffer> table, inputs, outputs;
  const MetalHostViews* views = nullptr;
  NS::UInteger threads = kThreadsPerGroup;
};

MetalDecodePass::~MetalDecodePass() {
  metal::AutoreleasePool pool;
  impl_.reset();
}

Result<std::unique_ptr<MetalDecodePass>> MetalDecodePass::create(void* device, const GgufModel& model,
                                                                 const MetalHostViews& views) {
  if (Status st = DecodePass::check(model); !st) return st;
  if (device == nullptr) return Status(ErrorCode::invalid_argument, "metal decode pass: device is null");
  metal::AutoreleasePool pool;
  std::unique_ptr<MetalDecodePass> p(new MetalDecodePass());
  p->impl_ = std::make_unique<Impl>();
  Impl& m = *p->impl_;
  m.device = NS::RetainPtr(static_cast<MTL::Device*>(device));
  m.views = &views;

  // Each weight matrix goes to the first view that holds it whole, grouped by view.
  const std::vector<View>& vs = views.views();
  std::vector<std::vector<const GgufTensor*>> by_view(vs.size());
  for (const auto& t : model.tensors) {
    if (t.n_dims < 2 || t.n_bytes == 0) continue;
    const auto v = find_view(vs, Extent{t.file_offset, t.n_bytes});
    if (!v) {
      return Status(ErrorCode::invalid_argument, "metal decode pass: tensor " + t.name + " lies whole in no view");
    }
    by_view[*v].push_back(&t);
  }
  std::map<std::uint64_t, std::uint64_t> input_of_length;
  for (std::size_t vi = 0; vi < by_view.size(); ++vi) {
    if (by_view[vi].empty()) continue;
    Dispatch d;
    d.view = vi;
    d.first = static_cast<std::uint32_t>(p->matrices_.size());
    d.row_begin = p->total_rows_;
    for (const GgufTensor* t : by_view[vi]) {
      auto [it, fresh] = input_of_length.emplace(t->row_length(), p->inputs_.size());
      if (fresh) {
        for (std::uint64_t i = 0; i < t->row_length(); ++i) p->inputs_.push_back(input_value(i));
        while (p->inputs_.size() % 4 != 0) p->inputs_.push_back(0.f);
      }
      Matrix mx{};
      mx.offset = t->file_offset - vs[vi].offset;
      mx.rows = t->rows();
      mx.row_length = t->row_length();
      mx.row_bytes = t->row_bytes();
      mx.row_start = p->total_rows_;
      mx.input_offset = it->second;
      mx.type = static_cast<std::uint32_t>(t->type);
      p->matrices_.push_back(mx);
      p->file_offsets_.push_back(t->file_offset);
      p->total_rows_ += mx.rows;
      p->bytes_ += t->n_bytes;
    }
    d.count = static_cast<std::uint32_t>(p->matrices_.size()) - d.first;
    d.rows = p->total_rows_ - d.row_begin;
    p->dispatches_.push_back(d);
  }

  NS::Error* error = nullptr;
  MTL::CompileOptions* options = MTL::CompileOptions::alloc()->init();
  options->setLanguageVersion(MTL::LanguageVersion3_0);
  NS::SharedPtr<MTL::Library> library = NS::TransferPtr(
      m.device->newLibrary(NS::String::string(kMetalDecodeSource, NS::UTF8StringEncoding), options, &error));
  options->release();
  if (!library)
    return Status(ErrorCode::backend_error, "metal decode pass: the kernel did not compile: " + describe(error));
  NS::SharedPtr<MTL::Function> fn = NS::TransferPtr(
      library->newFunction(NS::String::string("decode_pass", NS::UTF8StringEncoding)));
  if (!fn) return Status(ErrorCode::backend_error, "metal decode pass: the library has no decode_pass");
  m.pipeline = NS::TransferPtr(m.device->newComputePipelineState(fn.get(), &error));
  if (!m.pipeline) return Status(ErrorCode::backend_error, "metal decode pass: no pipeline: " + describe(error));
  m.threads = std::min<NS::UInteger>(kThreadsPerGroup, m.pipeline->maxTotalThreadsPerThreadgroup() / 32 * 32);
  if (m.threads == 0)
    return Status(ErrorCode::backend_error, "metal decode pass: the pipeline allows less than 32 threads");
  m.queue = NS::TransferPtr(m.device->newCommandQueue());

  auto buffer = [&](const void* bytes, std::size_t n) {
    MTL::Buffer* b = bytes != nullptr
                         ? m.device->newBuffer(bytes, static_cast<NS::UInteger>(n), MTL::ResourceStorageModeShared)
                         : m.device->newBuffer(static_cast<NS::UInteger>(n), MTL::ResourceStorageModeShared);
    return NS::TransferPtr(b);
  };
  m.table = buffer(p->matrices_.data(), p->matrices_.size() * sizeof(Matrix));
  m.inputs = buffer(p->inputs_.data(), p->inputs_.size() * sizeof(float));
  m.outputs = buffer(nullptr, std::max<std::uint64_t>(1, p->total_rows_) * sizeof(float));
  if (!m.queue || !m.table || !m.inputs || !m.outputs) {
    return Status(ErrorCode::out_of_memory,
                  "metal decode pass: no command queue or no memory for its table, inputs and outputs");
  }
  return p;
}

Result<double> MetalDecodePass::run() {
  metal::AutoreleasePool pool;
  Impl& m = *impl_;
  MTL::CommandBuffer* cb = m.queue->commandBuffer();
  if (cb == nullptr) return Status(ErrorCode::backend_error, "metal decode pass: no command buffer");
  MTL::ComputeCommandEncoder* enc = cb->computeCommandEncoder();
  if (enc == nullptr) return Status(ErrorCode::backend_error, "metal decode pass: no compute encoder");
  enc->setComputePipelineState(m.pipeline.get());
  enc->setBuffer(m.inputs.get(), 0, 5);
  enc->setBuffer(m.outputs.get(), 0, 6);
  const std::uint64_t simds = m.threads / 32;
  for (const Dispatch& d : dispatches_) {
    enc->setBuffer(static_cast<const MTL::Buffer*>(m.views->buffer(d.view)), 0, 0);
    enc->setBuffer(m.table.get(), d.first * sizeof(Matrix), 1);
    enc->setBytes(&d.count, sizeof d.count, 2);
    enc->setBytes(&d.row_begin, sizeof d.row_begin, 3);
    enc->setBytes(&d.rows, sizeof d.rows, 4);
    const std::uint64_t groups = std::min(kMaxGroups, (d.rows + simds - 1) / simds);
    enc->dispatchThreadgroups(MTL::Size::Make(static_cast<NS::UInteger>(groups), 1, 1), MTL::Size::Make(m.threads, 1, 1));
  }
  enc->endEncoding();
  cb->commit();
  cb->waitUntilCompleted();
  if (cb->status() != MTL::CommandBufferStatusCompleted) {
    return Status(ErrorCode::backend_error, "metal decode pass: the command buffer failed: " + describe(cb->error()));
  }
  const auto* out = static_cast<const float*>(m.outputs->contents());
  double sum = 0;
  for (std::uint64_t i = 0; i < total_rows_; ++i) sum += out[i];
  return sum;
}

Status MetalDecodePass::verify(const std::uint8_t* file) const {
  const auto* out = static_cast<const float*>(impl_->outputs->contents());
  for (std::size_t mi = 0; mi < matrices_.size(); ++mi) {
    const Matrix& mx = matrices_[mi];
    for (std::uint64_t row : {std::uint64_t{0}, mx.rows / 2, mx.rows - 1}) {
      const std::uint8_t* w = file + file_offsets_[mi] + row * mx.row_bytes;
      double magnitude = 0;
      const double ref = reference_dot(static_cast<GgmlType>(mx.type), w, mx.row_length,
                                       inputs_.data() + mx.input_offset, &magnitude);
      const double got = out[mx.row_start + row];
      if (!(std::fabs(got - ref) <= kTolerance * magnitude + 1e-6)) {
        return Status(ErrorCode::backend_error, "the Metal decode pass computed " + std::to_string(got) + " for row " +
                                                    std::to_string(row) + " of matrix " + std::to_string(mi) +
                                                    "; the CPU reference is " + std::to_string(ref));
      }
    }
  }
  return {};
}

}  // namespace residency::workload
