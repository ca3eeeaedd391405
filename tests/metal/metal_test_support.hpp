// SPDX-License-Identifier: MIT
// What the Metal tests share: the skip when residency sets do not work here, page-aligned host
// memory, and the system's wired memory (host_statistics64 wire_count x page size, what
// `top -l 1` shows as "wired"), which is what these tests assert on: what a user of the Mac
// would notice, not the library's own counters.
//
// Wired memory is system-wide, so other processes move it too; every assertion compares a
// change of hundreds of MiB against a tolerance (kSlack) that such noise stays well inside.
#pragma once

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include "residency/backends/metal.hpp"

namespace residency::metal_test {

inline constexpr std::uint64_t kMiB = 1024ull * 1024;
// What one test wires: large against the system's background changes, small for any Mac.
inline constexpr std::uint64_t kRegionBytes = 512 * kMiB;
// Background noise allowed on top of the expected change.
inline constexpr std::uint64_t kSlack = 96 * kMiB;
// llama.cpp's criterion for its issue 25937: at least 75 % of what was wired is given back
// within 10 s of the release.
inline constexpr double kGiveBackShare = 0.75;
inline constexpr std::chrono::seconds kGiveBackWithin{10};

// Skips the test with the reason when this machine cannot run it (macOS < 15, no Metal3 GPU).
#define RESIDENCY_METAL_REQUIRE()                                                          \
  do {                                                                                     \
    const ::residency::MetalSupport s_ = ::residency::metal_residency_support();           \
    if (!s_.available) GTEST_SKIP() << "use residency sets = false (" << s_.reason << ")"; \
  } while (0)

inline std::uint64_t wired_now() {
  std::string why;
  const auto w = apple_wired_bytes(&why);
  EXPECT_TRUE(w.has_value()) << why;
  return w.value_or(0);
}

// Polls `pred` every 100 ms for up to `within`; true as soon as it holds.
inline bool eventually(std::chrono::milliseconds within, const std::function<bool()>& pred) {
  const auto until = std::chrono::steady_clock::now() + within;
  for (;;) {
    if (pred()) return true;
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

// Anonymous, page-aligned, every page written (so it is in RAM, not yet wired), unmapped at the
// end: the shape of an mmap'd model.
class HostMemory {
 public:
  explicit HostMemory(std::uint64_t bytes) : size_(bytes) {
    void* p = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_ANON | MAP_PRIVATE, -1, 0);
    if (p == MAP_FAILED) return;
    base_ = p;
    std::memset(base_, 0x5a, size_);
  }
  ~HostMemory() {
    if (base_ != nullptr) munmap(base_, size_);
  }
  HostMemory(const HostMemory&) = delete;
  HostMemory& operator=(const HostMemory&) = delete;
  void* base() const { return base_; }
  std::uint64_t size() const { return size_; }
  bool ok() const { return base_ != nullptr; }

 private:
  void* base_ = nullptr;
  std::uint64_t size_;
};

// What the tests expect after wiring `bytes`: growth of about that much.
inline ::testing::AssertionResult grew_by_about(std::uint64_t before, std::uint64_t after, std::uint64_t bytes) {
  const double grown = static_cast<double>(after) - static_cast<double>(before);
  if (grown >= 0.9 * static_cast<double>(bytes) - static_cast<double>(kSlack) &&
      grown <= static_cast<double>(bytes + kSlack)) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "system wired memory grew by " << grown / static_cast<double>(kMiB)
                                       << " MiB; expected about " << bytes / kMiB << " MiB (before " << before / kMiB
                                       << " MiB, after " << after / kMiB << " MiB)";
}

// Waits until wired memory is back below `peak - share x growth`; the assertion says how much
// came back.
inline ::testing::AssertionResult gives_back(std::uint64_t before, std::uint64_t peak, double share,
                                             std::chrono::seconds within) {
  const double growth = static_cast<double>(peak) - static_cast<double>(before);
  std::uint64_t now = peak;
  const bool ok = eventually(within, [&] {
    now = wired_now();
    return static_cast<double>(peak) - static_cast<double>(now) >= share * growth;
  });
  if (ok) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "within " << within.count() << " s of the release, wired memory went from "
                                       << peak / kMiB << " to " << now / kMiB
                                       << " MiB: " << (static_cast<double>(peak) - static_cast<double>(now)) / growth * 100
                                       << " % of the " << growth / static_cast<double>(kMiB)
                                       << " MiB growth given back, " << share * 100 << " % expected";
}

}  // namespace residency::metal_test
