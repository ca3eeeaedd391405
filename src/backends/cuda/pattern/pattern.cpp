// SPDX-License-Identifier: MIT
// Launching the pattern kernels; see pattern.hpp.
#include "backends/cuda/pattern/pattern.hpp"

namespace residency::cuda {
namespace embedded {
extern const unsigned char pattern_kernels[];
extern const std::size_t pattern_kernels_size;
}  // namespace embedded

namespace {
// Grid-stride loops: 1024 blocks of 256 threads, a few per multiprocessor even on the largest
// GPUs, is plenty to saturate memory bandwidth; every thread handles many words.
constexpr unsigned kBlocks = 1024;
constexpr unsigned kThreads = 256;
}  // namespace

Result<PatternKernels> PatternKernels::load(const Driver& d, CUcontext ctx) {
  auto m = Module::load(d, ctx, embedded::pattern_kernels, "pattern");
  if (!m) return m.status();
  PatternKernels k(d, ctx, std::move(m.value()));
  auto f = k.module_.function("fill_pattern");
  auto w = k.module_.function("wait_then_fill");
  auto c = k.module_.function("count_mismatches");
  if (!f) return f.status();
  if (!w) return w.status();
  if (!c) return c.status();
  k.fill_ = *f;
  k.wait_fill_ = *w;
  k.count_ = *c;
  return k;
}

Status PatternKernels::launch(CUfunction f, void** args, CUstream stream, const char* name) const {
  ContextScope scope(*d_, ctx_);
  const CUresult r = d_->cuLaunchKernel(f, kBlocks, 1, 1, kThreads, 1, 1, 0, stream, args, nullptr);
  if (r != CUDA_SUCCESS) return d_->error(r, std::string("launching ") + name, "cuLaunchKernel");
  return {};
}

Status PatternKernels::fill(CUdeviceptr p, std::uint64_t size, std::uint64_t seed, CUstream stream) const {
  void* args[] = {&p, &size, &seed};
  return launch(fill_, args, stream, "fill_pattern");
}

Status PatternKernels::wait_then_fill(CUdeviceptr p, std::uint64_t size, std::uint64_t seed, std::uint64_t wait_ns,
                                      CUstream stream) const {
  void* args[] = {&p, &size, &seed, &wait_ns};
  return launch(wait_fill_, args, stream, "wait_then_fill");
}

Result<std::uint64_t> PatternKernels::mismatches(CUdeviceptr p, std::uint64_t size, std::uint64_t seed) const {
  ContextScope scope(*d_, ctx_);
  CUdeviceptr counter = 0;
  CUresult r = d_->cuMemAlloc(&counter, sizeof(std::uint64_t));
  if (r != CUDA_SUCCESS) return d_->error(r, "allocating a counter", "cuMemAlloc");
  std::uint64_t result = 0;
  r = d_->cuMemcpyHtoD(counter, &result, sizeof result);
  Status st;
  if (r == CUDA_SUCCESS) {
    void* args[] = {&p, &size, &seed, &counter};
    st = launch(count_, args, nullptr, "count_mismatches");
    if (st) {
      r = d_->cuMemcpyDtoH(&result, counter, sizeof result);  // waits for the kernel
      if (r != CUDA_SUCCESS) st = d_->error(r, "reading the mismatch count", "cuMemcpyDtoH");
    }
  } else {
    st = d_->error(r, "clearing the mismatch counter", "cuMemcpyHtoD");
  }
  (void)d_->cuMemFree(counter);
  if (!st) return st;
  return result;
}

}  // namespace residency::cuda
