// SPDX-License-Identifier: MIT
// Per-page lock counts: a page shared by two regions (or two sets) must stay locked until
// the last holder lets go, because one munlock undoes every mlock of a page.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "backends/posix/lock_table.hpp"

namespace residency::posix {
namespace {

using V = std::vector<AddrRange>;

TEST(LockTable, FirstAcquireLocksEverythingAndLastReleaseUnlocksEverything) {
  LockTable t;
  EXPECT_EQ(t.acquire({0x1000, 0x5000}), (V{{0x1000, 0x5000}}));
  EXPECT_EQ(t.held_bytes(), 0x4000u);
  EXPECT_EQ(t.release({0x1000, 0x5000}), (V{{0x1000, 0x5000}}));
  EXPECT_EQ(t.held_bytes(), 0u);
  EXPECT_EQ(t.boundaries(), 0u);
}

TEST(LockTable, SharedPageStaysLockedUntilBothRegionsRelease) {
  LockTable t;
  // Region A covers pages [1,3), region B pages [2,4): page 2 is shared.
  EXPECT_EQ(t.acquire({0x1000, 0x3000}), (V{{0x1000, 0x3000}}));
  EXPECT_EQ(t.acquire({0x2000, 0x4000}), (V{{0x3000, 0x4000}}));  // only the new page
  EXPECT_EQ(t.held_bytes(), 0x3000u);
  EXPECT_EQ(t.release({0x1000, 0x3000}), (V{{0x1000, 0x2000}}));  // page 2 is still B's
  EXPECT_EQ(t.held_bytes(), 0x2000u);
  EXPECT_EQ(t.release({0x2000, 0x4000}), (V{{0x2000, 0x4000}}));
  EXPECT_EQ(t.held_bytes(), 0u);
}

TEST(LockTable, SameRegionInTwoSetsIsLockedOnceAndUnlockedOnce) {
  LockTable t;
  EXPECT_EQ(t.acquire({0x10000, 0x20000}).size(), 1u);
  EXPECT_TRUE(t.acquire({0x10000, 0x20000}).empty());
  EXPECT_TRUE(t.release({0x10000, 0x20000}).empty());
  EXPECT_EQ(t.release({0x10000, 0x20000}), (V{{0x10000, 0x20000}}));
}

TEST(LockTable, AcquireAcrossAGapReturnsOnlyTheGapsAndReleaseMergesNeighbours) {
  LockTable t;
  t.acquire({0x1000, 0x2000});
  t.acquire({0x4000, 0x5000});
  EXPECT_EQ(t.acquire({0x0000, 0x6000}), (V{{0x0000, 0x1000}, {0x2000, 0x4000}, {0x5000, 0x6000}}));
  EXPECT_EQ(t.release({0x0000, 0x6000}), (V{{0x0000, 0x1000}, {0x2000, 0x4000}, {0x5000, 0x6000}}));
  EXPECT_EQ(t.release({0x1000, 0x2000}), (V{{0x1000, 0x2000}}));
  EXPECT_EQ(t.release({0x4000, 0x5000}), (V{{0x4000, 0x5000}}));
  EXPECT_EQ(t.boundaries(), 0u);
}

TEST(LockTable, ReleasingWhatIsNotHeldChangesNothing) {
  LockTable t;
  EXPECT_TRUE(t.release({0x1000, 0x2000}).empty());
  t.acquire({0x1000, 0x2000});
  EXPECT_TRUE(t.release({0x3000, 0x4000}).empty());
  EXPECT_TRUE(t.acquire({0x1000, 0x1000}).empty());  // empty range
  EXPECT_EQ(t.held_bytes(), 0x1000u);
}

// Against a per-page model: random acquires and matching releases in random order.
TEST(LockTable, MatchesAPerPageModel) {
  constexpr int kPages = 64;
  constexpr std::uintptr_t kPage = 0x1000;
  std::mt19937 rng(12345);
  for (int round = 0; round < 50; ++round) {
    LockTable t;
    std::vector<int> model(kPages, 0);
    std::vector<AddrRange> held;
    for (int step = 0; step < 200; ++step) {
      const bool do_release = !held.empty() && (rng() % 2 == 0);
      if (do_release) {
        const std::size_t i = rng() % held.size();
        const AddrRange r = held[i];
        held.erase(held.begin() + static_cast<std::ptrdiff_t>(i));
        std::vector<bool> expect_freed(kPages, false);
        for (auto p = r.begin / kPage; p < r.end / kPage; ++p) expect_freed[p] = (--model[p] == 0);
        std::vector<bool> got(kPages, false);
        for (auto f : t.release(r))
          for (auto p = f.begin / kPage; p < f.end / kPage; ++p) got[p] = true;
        ASSERT_EQ(got, expect_freed) << "round " << round << " step " << step;
      } else {
        const auto b = rng() % kPages;
        const auto e = b + 1 + rng() % (kPages - b);
        const AddrRange r{b * kPage, e * kPage};
        held.push_back(r);
        std::vector<bool> expect_new(kPages, false);
        for (auto p = b; p < e; ++p) expect_new[p] = (model[p]++ == 0);
        std::vector<bool> got(kPages, false);
        for (auto f : t.acquire(r))
          for (auto p = f.begin / kPage; p < f.end / kPage; ++p) got[p] = true;
        ASSERT_EQ(got, expect_new) << "round " << round << " step " << step;
      }
      std::uint64_t held_pages = 0;
      for (int c : model) held_pages += c > 0 ? 1 : 0;
      ASSERT_EQ(t.held_bytes(), held_pages * kPage);
    }
  }
}

}  // namespace
}  // namespace residency::posix
