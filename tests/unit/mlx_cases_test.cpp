// SPDX-License-Identifier: MIT
// MLX's ten residency test cases (mlx/tests: "limit 0 wires nothing" ... "full budget"),
// restated for our manager. The tenth is changed on purpose: freeing a wired allocation
// promotes the pending one (MLX leaves it unwired until the limit is set again).
#include <gtest/gtest.h>

#include "support/manager_fixture.hpp"

using namespace residency;
using namespace residency::testing;

namespace {
Config limit(std::uint64_t bytes, double pct = 5.0) {
  Config c;
  c.wired_limit = WiredLimit{false, bytes, 0};
  c.set_max_pct = pct;
  c.keep_alive = KeepAlive::forever();  // MLX keeps a standing request: no expiry
  return c;
}
}  // namespace

class MlxCases : public ManagerTest {};

TEST_F(MlxCases, Case1_LimitZeroWiresNothing) {
  auto m = make(limit(0));
  for (int i = 0; i < 4; ++i) reg(*m, 10 * MiB);
  EXPECT_EQ(fake->resident_bytes(), 0u);
  EXPECT_EQ(m->stats().wired_bytes, 0u);
  EXPECT_EQ(m->stats().tracked_bytes, 40 * MiB);
}

TEST_F(MlxCases, Case2_NeverMoreThanTheLimit) {
  auto m = make(limit(25 * MiB));
  for (int i = 0; i < 10; ++i) {
    reg(*m, 10 * MiB);
    EXPECT_LE(fake->resident_bytes(), 25 * MiB);
  }
  EXPECT_EQ(fake->resident_bytes(), 20 * MiB);
}

TEST_F(MlxCases, Case3_RaisingTheLimitWiresExistingBuffers) {
  auto m = make(limit(0));
  for (int i = 0; i < 4; ++i) reg(*m, 10 * MiB);
  ASSERT_TRUE(m->set_wired_limit(100 * MiB).is_ok());
  EXPECT_EQ(fake->resident_bytes(), 40 * MiB);
}

TEST_F(MlxCases, Case4_LoweringToZeroUnwiresAllAndRaisingRewires) {
  auto m = make(limit(100 * MiB));
  for (int i = 0; i < 4; ++i) reg(*m, 10 * MiB);
  ASSERT_TRUE(m->set_wired_limit(0).is_ok());
  EXPECT_EQ(fake->resident_bytes(), 0u);
  ASSERT_TRUE(m->set_wired_limit(100 * MiB).is_ok());
  EXPECT_EQ(fake->resident_bytes(), 40 * MiB);
}

TEST_F(MlxCases, Case5_ExactAccountingOver32AllocFreeCycles) {
  auto m = make(limit(1 * GiB));
  std::vector<RegionId> ids;
  std::uint64_t expect = 0;
  for (int cycle = 0; cycle < 32; ++cycle) {
    const std::uint64_t sz = (1 + cycle % 7) * MiB + 4096 * cycle;
    ids.push_back(reg(*m, sz));
    expect += sz;
    if (cycle % 3 == 2) {
      const RegionId victim = ids[ids.size() / 2];
      std::uint64_t vsz = 0;
      for (auto& [sid, s] : fake->sets)
        if (s.members.count(victim)) vsz = s.members.at(victim).size;
      ASSERT_TRUE(m->unregister_region(victim).is_ok());
      ids.erase(ids.begin() + static_cast<long>(ids.size() / 2));
      expect -= vsz;
    }
    EXPECT_EQ(m->stats().wired_bytes, expect);
    EXPECT_EQ(fake->resident_bytes(), expect);
  }
  for (RegionId id : ids) ASSERT_TRUE(m->unregister_region(id).is_ok());
  EXPECT_EQ(m->stats().tracked_bytes, 0u);
  EXPECT_EQ(fake->resident_bytes(), 0u);
}

TEST_F(MlxCases, Case6_SetCountGrowsWithSmallCapsButNotOnReuse) {
  fake->recommended = 100 * GiB;  // 0.0625% -> 64 MiB (the floor)
  fake->physical = 200 * GiB;
  auto m = make(limit(100 * GiB, 0.0625));
  std::vector<RegionId> ids;
  for (int i = 0; i < 4; ++i) ids.push_back(reg(*m, 60 * MiB));
  EXPECT_EQ(fake->live_sets(), 4);
  ASSERT_TRUE(m->unregister_region(ids[1]).is_ok());
  reg(*m, 60 * MiB);  // fits the emptied set
  EXPECT_EQ(fake->live_sets(), 4);
}

TEST_F(MlxCases, Case7_AtMost32Sets) {
  fake->recommended = 100 * GiB;
  fake->physical = 200 * GiB;
  fake->max_sets = 32;  // what the metal backend says when it attaches sets to queues, as MLX does
  auto m = make(limit(100 * GiB, 0.0625));
  for (int i = 0; i < 40; ++i) reg(*m, 60 * MiB);
  EXPECT_EQ(fake->live_sets(), 32);
  EXPECT_EQ(fake->resident_bytes(), 40 * 60 * MiB);
}

// The cap is the backend's to state: the core names no platform's limit.
TEST_F(MlxCases, Case7b_NoSetLimitWhenTheBackendStatesNone) {
  fake->recommended = 100 * GiB;
  fake->physical = 200 * GiB;
  fake->max_sets = 0;
  auto m = make(limit(100 * GiB, 0.0625));
  for (int i = 0; i < 40; ++i) reg(*m, 60 * MiB);
  EXPECT_EQ(fake->live_sets(), 40);
}

TEST_F(MlxCases, Case8_AnAllocationAboveTheCapIsStillWired) {
  fake->recommended = 10 * GiB;  // cap 512 MiB
  auto m = make(limit(10 * GiB));
  RegionId big = reg(*m, 2 * GiB);
  EXPECT_TRUE(fake->is_resident(big));
}

TEST_F(MlxCases, Case9_CapZeroKeepsOneSet) {
  fake->recommended = 10 * GiB;
  fake->physical = 100 * GiB;
  auto m = make(limit(10 * GiB, 0));
  for (int i = 0; i < 10; ++i) reg(*m, 600 * MiB);
  EXPECT_EQ(fake->live_sets(), 1);
}

TEST_F(MlxCases, Case10_FullBudgetLeavesTheNextTrackedAndFreeingPromotesIt) {
  auto m = make(limit(30 * MiB));
  RegionId a = reg(*m, 10 * MiB);
  reg(*m, 10 * MiB);
  reg(*m, 10 * MiB);
  RegionId next = reg(*m, 10 * MiB);
  EXPECT_FALSE(fake->is_resident(next));
  EXPECT_EQ(m->stats().pending_bytes, 10 * MiB);
  ASSERT_TRUE(m->unregister_region(a).is_ok());
  EXPECT_TRUE(fake->is_resident(next));  // MLX: still unwired. Ours: promoted.
  EXPECT_EQ(fake->resident_bytes(), 30 * MiB);
}
