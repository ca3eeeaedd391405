// SPDX-License-Identifier: MIT
// Shared set-up for the cuda tests: a backend on device 0 and the pattern kernels, or a
// GTEST_SKIP that says why there is none (no driver, no device), so that the same binaries
// run green on CI machines without a GPU and test for real on a GPU machine.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <optional>
#include <string>

#include "backends/cuda/cuda_backend.hpp"
#include "backends/cuda/pattern/pattern.hpp"

namespace residency::cuda::testing {

constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;
constexpr std::uint64_t kGiB = std::uint64_t{1} << 30;

inline CUdeviceptr dptr(const void* p) { return static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p)); }

// The host twin of pattern_kernels.cu's mix(): fills host memory with the same pattern.
inline std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// MemTotal and MemAvailable from /proc/meminfo, in bytes. Pinned host memory comes out of
// MemAvailable. Comparisons are only meaningful while MemTotal stays the same (some VMs grow
// their memory as it is used).
struct HostMemory {
  std::uint64_t total = 0;
  std::uint64_t available = 0;
};
inline std::optional<HostMemory> host_memory() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  std::uint64_t kib = 0;
  std::string unit;
  HostMemory m;
  while (f >> key >> kib >> unit) {
    if (key == "MemTotal:") m.total = kib * 1024;
    if (key == "MemAvailable:") m.available = kib * 1024;
  }
  if (m.total == 0 || m.available == 0) return std::nullopt;
  return m;
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto made = CudaBackend::create({});
    if (!made) GTEST_SKIP() << "no usable CUDA device, skipping: " << made.message();
    backend_ = std::move(made.value());
    auto k = PatternKernels::load(backend_->driver(), backend_->context());
    ASSERT_TRUE(k) << k.message();
    kernels_.emplace(std::move(k.value()));
  }

  const Driver& d() const { return backend_->driver(); }

  // Device free bytes as the driver reports them.
  std::uint64_t device_free() {
    ContextScope scope(d(), backend_->context());
    std::size_t free_b = 0;
    std::size_t total_b = 0;
    EXPECT_EQ(d().cuMemGetInfo(&free_b, &total_b), CUDA_SUCCESS);
    return free_b;
  }

  void sync() {
    ContextScope scope(d(), backend_->context());
    ASSERT_EQ(d().cuCtxSynchronize(), CUDA_SUCCESS);
  }

  // Allocates through `b` and fills with the pattern of `seed`.
  void* allocate_filled(CudaBackend& b, std::size_t size, RegionClass cls, std::uint64_t seed) {
    auto p = b.allocate(size, cls);
    EXPECT_TRUE(p) << p.message();
    if (!p) return nullptr;
    EXPECT_TRUE(kernels_->fill(dptr(*p), size, seed));
    sync();
    return *p;
  }

  std::uint64_t mismatches(const void* p, std::size_t size, std::uint64_t seed) {
    auto n = kernels_->mismatches(dptr(p), size, seed);
    EXPECT_TRUE(n) << n.message();
    return n ? *n : ~std::uint64_t{0};
  }

  static RegionDesc device_region(RegionId id, void* p, std::size_t size, RegionClass cls) {
    RegionDesc r;
    r.id = id;
    r.base = p;
    r.size = size;
    r.cls = cls;
    r.backend_allocated = true;
    return r;
  }

  // One set holding `r`, with residency requested.
  void resident_set(CudaBackend& b, SetId set, const RegionDesc& r) {
    ASSERT_TRUE(b.create_set(set, r.size));
    b.add_region(set, r);
    ASSERT_TRUE(b.commit(set).ok());
    auto out = b.request_residency(set);
    ASSERT_TRUE(out.ok()) << out.status.message();
  }

  std::shared_ptr<CudaBackend> backend_;
  std::optional<PatternKernels> kernels_;
};

}  // namespace residency::cuda::testing
