// SPDX-License-Identifier: MIT
// What of the engine's own code the preload holds with the model (src/preload/engine_code.hpp):
// the read-only segments of libllama, libggml*, libgomp, the C/C++ runtimes and the preload, whole pages, never a
// writable segment, never a GPU backend's device code; and the dynamic loader's list it reads.
#include "preload/engine_code.hpp"

#include <gtest/gtest.h>

#include <cstdint>

namespace {

using namespace residency::preload;

constexpr std::size_t kPage = 4096;
constexpr std::uint64_t kMax = 64ULL << 20;

TEST(EngineCode, TheEnginesLibrariesAreKnownByTheirFileNames) {
  for (const char* p :
       {"/opt/llama/lib/libllama.so", "libllama.so.0", "/usr/lib/libggml-base.so", "/x/libggml-cpu-haswell.so",
        "/x/libggml-cuda.so", "/usr/lib/x86_64-linux-gnu/libgomp.so.1", "/usr/local/lib/libresidency_preload.so",
        "libggml.so", "/usr/lib/x86_64-linux-gnu/libc.so.6", "/lib/libc-2.36.so", "/usr/lib/x86_64-linux-gnu/libm.so.6",
        "/usr/lib/x86_64-linux-gnu/libstdc++.so.6"})
    EXPECT_TRUE(is_engine_object(p)) << p;
  for (const char* p : {"", "/usr/bin/llama-server", "/opt/libllama/libcurl.so.4", "/usr/lib/libcuda.so.1",
                        "/usr/lib/libcrypto.so.3", "/usr/lib/libmvec.so.1", "linux-vdso.so.1", "/x/mylibggml.so"})
    EXPECT_FALSE(is_engine_object(p)) << p;
}

TEST(EngineCode, ReadOnlySegmentsOfEngineObjectsAreWholePagesAndNothingElse) {
  const std::vector<LoadedSegment> segs = {
      {"/x/libllama.so", 0x10000, 0x10000 + 3 * kPage + 17, false},    // r--: headers, rodata
      {"/x/libllama.so", 0x14000 + 100, 0x14000 + 8 * kPage, false},   // r-x, not page aligned
      {"/x/libllama.so", 0x20000, 0x20000 + 2 * kPage, true},          // rw-: never
      {"/usr/lib/libcurl.so.4", 0x40000, 0x40000 + 4 * kPage, false},  // not the engine
      {"", 0x50000, 0x50000 + 4 * kPage, false},                       // the main program
      {"/x/libggml-cpu.so", 0x60000, 0x60000 + kPage, false},
  };
  const CodePlan p = plan_engine_code(segs, kPage, kMax);
  ASSERT_EQ(p.ranges.size(), 2U);
  // libllama's r-- [0x10000, 0x14000) and r-x [0x14000, 0x1c000) touch: one range.
  EXPECT_EQ(p.ranges[0].begin, 0x10000U);
  EXPECT_EQ(p.ranges[0].end, 0x1c000U);
  EXPECT_EQ(p.ranges[1].begin, 0x60000U);
  EXPECT_EQ(p.ranges[1].end, 0x61000U);
  EXPECT_EQ(p.bytes, 12 * kPage + kPage);
  EXPECT_EQ(p.left_out, 0U);
  EXPECT_EQ(p.objects, (std::vector<std::string>{"libllama.so", "libggml-cpu.so"}));
}

TEST(EngineCode, ASegmentOverTheCapIsLeftOutAndCounted) {
  const std::vector<LoadedSegment> segs = {
      {"/x/libggml-cuda.so", 0x100000, 0x100000 + 16 * kPage, false},          // host code
      {"/x/libggml-cuda.so", 0x10000000, 0x10000000 + (kMax + kPage), false},  // device code (fatbin)
  };
  const CodePlan p = plan_engine_code(segs, kPage, kMax);
  ASSERT_EQ(p.ranges.size(), 1U);
  EXPECT_EQ(p.bytes, 16 * kPage);
  EXPECT_EQ(p.left_out, kMax + kPage);
}

TEST(EngineCode, EmptyAndOverflowingSegmentsAreSafe) {
  const std::vector<LoadedSegment> segs = {
      {"/x/libllama.so", 0x10000, 0x10000, false},
      {"/x/libllama.so", UINTPTR_MAX - 100, UINTPTR_MAX, false},
  };
  const CodePlan p = plan_engine_code(segs, kPage, kMax);
  for (const Extent& r : p.ranges) EXPECT_LT(r.begin, r.end);
  EXPECT_TRUE(plan_engine_code({}, kPage, kMax).ranges.empty());
}

// The dynamic loader's list, read in this process: this test's own code is a read-only segment
// that holds the address of one of its functions, and some segment is writable (its data).
TEST(EngineCode, TheLoadersListHoldsThisProgramsCode) {
  const auto here = reinterpret_cast<std::uintptr_t>(&plan_engine_code);
  bool in_code = false, some_writable = false;
  for (const LoadedSegment& s : loaded_segments()) {
    if (!s.writable && here >= s.begin && here < s.end) in_code = true;
    some_writable = some_writable || s.writable;
  }
  EXPECT_TRUE(in_code);
  EXPECT_TRUE(some_writable);
}

}  // namespace
