// SPDX-License-Identifier: MIT
// What of a ggml buffer the preload registers (src/preload/buffer_plan.hpp), for the layouts
// llama.cpp makes on each CPU, on any machine: the AMX and CPU_REPACK layout is tested on an AMD
// or ARM machine too, and the file-mapped one on an AMX machine.
#include "preload/buffer_plan.hpp"

#include <gtest/gtest.h>

namespace {

using residency::RegionClass;
using namespace residency::preload;

constexpr std::size_t kPage = 4096;

std::size_t bytes(const std::vector<Extent>& r) {
  std::size_t n = 0;
  for (auto& e : r) n += e.end - e.begin;
  return n;
}

// A model mapping of 64 pages at 0x100000: llama.cpp's CPU_Mapped buffer spans the tensors it
// kept (token embeddings at the start, two norms between repacked matrices, the output norm at
// the end), and the repacked matrices' file ranges lie between them.
BufferFacts mapped_with_repacked_matrices() {
  BufferFacts f;
  f.base = 0x100000 + 100;  // the first kept tensor's offset in the file
  f.size = 64 * kPage - 200;
  f.is_host = true;
  f.device = DeviceKind::none;  // ggml's CPU_Mapped buffer type has no device
  f.from_ptr = true;
  f.usage = BufferUsage::weights;
  f.tensors = {{0x100000 + 100, 0x100000 + 8 * kPage},                      // token_embd
               {0x100000 + 20 * kPage + 16, 0x100000 + 20 * kPage + 2064},  // a norm, inside one page
               {0x100000 + 40 * kPage - 8, 0x100000 + 40 * kPage + 100},    // a norm across a page boundary
               {0x100000 + 64 * kPage - 1000, 0x100000 + 64 * kPage - 100}};
  return f;
}

TEST(BufferPlan, AFileMappedBufferIsThePagesOfItsTensorsNotItsWholeRange) {
  const BufferPlan p = plan_buffer(mapped_with_repacked_matrices(), kPage);
  EXPECT_TRUE(p.not_managed.empty());
  EXPECT_EQ(p.cls, RegionClass::weights);
  ASSERT_EQ(p.ranges.size(), 4U);
  EXPECT_EQ(p.ranges[0].begin, 0x100000U);
  EXPECT_EQ(p.ranges[0].end, 0x100000U + 8 * kPage);
  EXPECT_EQ(p.ranges[1].end - p.ranges[1].begin, kPage);
  EXPECT_EQ(p.ranges[2].end - p.ranges[2].begin, 2 * kPage);
  EXPECT_EQ(bytes(p.ranges), 12 * kPage) << "the repacked matrices' 52 pages of the file are not registered";
  EXPECT_EQ(p.registered_bytes, 12 * kPage);
  for (auto& r : p.ranges) {
    EXPECT_EQ(r.begin % kPage, 0U);
    EXPECT_EQ(r.end % kPage, 0U);
  }
}

TEST(BufferPlan, TensorsThatShareOrTouchAPageMergeIntoOneRange) {
  BufferFacts f = mapped_with_repacked_matrices();
  f.tensors = {{0x200000 + 10, 0x200000 + 100},
               {0x200000 + 200, 0x200000 + kPage + 1},
               {0x200000 + 2 * kPage, 0x200000 + 3 * kPage}};
  f.base = 0x200000;
  f.size = 3 * kPage;
  const BufferPlan p = plan_buffer(f, kPage);
  ASSERT_EQ(p.ranges.size(), 1U);
  EXPECT_EQ(p.ranges[0].begin, 0x200000U);
  EXPECT_EQ(p.ranges[0].end, 0x200000U + 3 * kPage);
}

TEST(BufferPlan, AnAmxOrRepackBufferIsRegisteredWholeAsWeightsThoughGgmlSaysItIsNotHost) {
  BufferFacts f;
  f.base = 0x7000'0000'0040;  // heap memory, not page aligned
  f.size = 50 * kPage + 123;
  f.is_host = false;  // AMX and CPU_REPACK buffer types have no is_host
  f.device = DeviceKind::cpu;
  f.usage = BufferUsage::weights;
  const BufferPlan p = plan_buffer(f, kPage);
  ASSERT_EQ(p.ranges.size(), 1U);
  EXPECT_EQ(p.ranges[0].begin, f.base) << "exact: two heap buffers may share a page";
  EXPECT_EQ(p.ranges[0].end, f.base + f.size);
  EXPECT_EQ(p.cls, RegionClass::weights);
}

TEST(BufferPlan, UsageDecidesTheClass) {
  BufferFacts f;
  f.base = 0x10000;
  f.size = kPage;
  f.is_host = true;
  f.usage = BufferUsage::compute;
  EXPECT_EQ(plan_buffer(f, kPage).cls, RegionClass::scratch);
  f.usage = BufferUsage::any;  // the KV cache, recurrent state, the output buffer
  EXPECT_EQ(plan_buffer(f, kPage).cls, RegionClass::kv_cache);
  f.device = DeviceKind::accel;  // BLAS: host memory
  EXPECT_EQ(plan_buffer(f, kPage).ranges.size(), 1U);
}

TEST(BufferPlan, DeviceMemoryAndAGpusPinnedHostBuffersAreNotRegistered) {
  BufferFacts f;
  f.base = 0x10000;
  f.size = kPage;
  f.device = DeviceKind::gpu;
  f.is_host = false;
  BufferPlan p = plan_buffer(f, kPage);
  EXPECT_TRUE(p.ranges.empty());
  EXPECT_EQ(p.not_managed, "device memory");
  f.is_host = true;  // CUDA_Host: pinned by the driver
  p = plan_buffer(f, kPage);
  EXPECT_TRUE(p.ranges.empty());
  EXPECT_NE(p.not_managed.find("pinned"), std::string::npos) << p.not_managed;
  f.device = DeviceKind::igpu;
  EXPECT_TRUE(plan_buffer(f, kPage).ranges.empty());
}

TEST(BufferPlan, EmptyBuffersAndFileBuffersWithoutTensorsRegisterNothing) {
  BufferFacts f;
  f.is_host = true;
  EXPECT_TRUE(plan_buffer(f, kPage).ranges.empty());
  f.base = 0x10000;
  f.size = kPage;
  f.from_ptr = true;
  const BufferPlan p = plan_buffer(f, kPage);
  EXPECT_TRUE(p.ranges.empty());
  EXPECT_FALSE(p.not_managed.empty());
}

TEST(BufferPlan, TensorsOutsideTheBufferAreClipped) {
  BufferFacts f;
  f.is_host = true;
  f.from_ptr = true;
  f.base = 0x10000;
  f.size = 2 * kPage;
  f.tensors = {{0x8000, 0x11000}, {0x11800, 0x40000}};
  const BufferPlan p = plan_buffer(f, kPage);
  ASSERT_EQ(p.ranges.size(), 1U);
  EXPECT_EQ(p.ranges[0].begin, 0x10000U);
  EXPECT_EQ(p.ranges[0].end, 0x12000U);
}

TEST(BufferPlan, PageGapsAreWhatOfAMappingNoRunCoversRoundedIn) {
  const std::vector<Extent> runs = {{0x2000, 0x3000}, {0x6000, 0x7000}};
  const auto gaps = page_gaps(0x1000, 0x9800, runs, kPage);
  ASSERT_EQ(gaps.size(), 3U);
  EXPECT_EQ(gaps[0].begin, 0x1000U);
  EXPECT_EQ(gaps[0].end, 0x2000U);
  EXPECT_EQ(gaps[1].begin, 0x3000U);
  EXPECT_EQ(gaps[1].end, 0x6000U);
  EXPECT_EQ(gaps[2].begin, 0x7000U);
  EXPECT_EQ(gaps[2].end, 0x9000U) << "the partial last page is not given back";
  EXPECT_TRUE(page_gaps(0x2000, 0x3000, runs, kPage).empty());
  EXPECT_EQ(page_gaps(0x1000, 0x2000, {}, kPage).size(), 1U);
}

}  // namespace
