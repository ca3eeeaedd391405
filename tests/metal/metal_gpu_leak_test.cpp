// SPDX-License-Identifier: MIT
// The Metal bug the backend's 1-byte blit works around (llama.cpp issue 25937): in a process
// that has run no GPU work, ended residency stays wired until the process exits. Its own
// executable, because the condition is "no GPU work in this process": the suite next to it
// runs kernels and blits.
//
// The backend is made with MetalOptions::test_no_gpu_work (no blit at initialisation, none after
// a release). The test passes when less than 75 % of the wired growth comes back within 10 s
// (the leak, shown), and skips with the macOS version when it all comes back (the bug is fixed
// there, and the blit is no longer needed). Compile-checked on Linux; not run on a Mac yet.
#include <gtest/gtest.h>

#include <cstdio>

#include "metal/metal_test_support.hpp"

namespace residency {
namespace {

using namespace std::chrono_literals;
using metal_test::eventually;
using metal_test::grew_by_about;
using metal_test::HostMemory;
using metal_test::kGiveBackShare;
using metal_test::kGiveBackWithin;
using metal_test::kMiB;
using metal_test::kRegionBytes;
using metal_test::wired_now;

TEST(MetalGpuLeak, EndedResidencyStaysWiredWithoutGpuWork) {
  RESIDENCY_METAL_REQUIRE();
  MetalOptions o;
  o.test_no_gpu_work = true;
  auto made = make_metal_backend(o);
  ASSERT_TRUE(made) << made.message();
  auto backend = *made;
  HostMemory mem(kRegionBytes);
  ASSERT_TRUE(mem.ok());
  RegionDesc d;
  d.id = 1;
  d.base = mem.base();
  d.size = mem.size();
  ASSERT_TRUE(backend->create_set(1, mem.size()));
  backend->add_region(1, d);
  ASSERT_TRUE(backend->commit(1).ok());

  const std::uint64_t before = wired_now();
  ASSERT_TRUE(backend->request_residency(1).ok());
  std::uint64_t peak = before;
  ASSERT_TRUE(eventually(10s, [&] {
    peak = wired_now();
    return static_cast<bool>(grew_by_about(before, peak, mem.size()));
  })) << grew_by_about(before, peak, mem.size()).message();

  ASSERT_TRUE(backend->end_residency(1));
  backend->after_release();  // does nothing under test_no_gpu_work
  const double growth = static_cast<double>(peak) - static_cast<double>(before);
  std::uint64_t now = peak;
  const bool given_back = eventually(kGiveBackWithin, [&] {
    now = wired_now();
    return static_cast<double>(peak) - static_cast<double>(now) >= kGiveBackShare * growth;
  });
  const double share = (static_cast<double>(peak) - static_cast<double>(now)) / growth * 100;
  if (given_back) {
    GTEST_SKIP() << "this macOS gave back " << share << " % of " << growth / static_cast<double>(kMiB)
                 << " MiB of ended residency within 10 s without any GPU work in the process: the bug of "
                    "llama.cpp issue 25937 is fixed here (the backend's 1-byte blit is harmless but unneeded)";
  }
  std::printf("leak shown: %.1f %% of %.0f MiB given back within 10 s without GPU work\n", share,
              growth / static_cast<double>(kMiB));
  EXPECT_TRUE(backend->destroy_set(1));
}

}  // namespace
}  // namespace residency
