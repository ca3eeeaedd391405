// SPDX-License-Identifier: MIT
// The view planner (docs/design.md, "Large mappings: overlapping views"): hand-checked cases, every
// error, and properties over thousands of generated layouts (a seeded PRNG, so a failure names a
// seed that reproduces it).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "residency/view_planner.hpp"

namespace residency {
namespace {

constexpr std::uint64_t kPage = 16384;   // Apple Silicon's page
constexpr std::uint32_t kMaxViews = 64;  // llama.cpp's limit on views of one mapping

TEST(ViewPlanner, MappingThatFitsIsOneView) {
  const std::vector<Extent> tensors{{0, 100}, {100, 4000}};
  auto views = plan_views(10 * kPage, 10 * kPage, kPage, tensors, kMaxViews);
  ASSERT_TRUE(views) << views.message();
  EXPECT_EQ(*views, (std::vector<View>{{0, 10 * kPage}}));
}

TEST(ViewPlanner, HandCheckedSplit) {
  // Largest tensor 1.5 pages: overlap = 2 pages + 1 page = 3 pages; step = 10 - 3 = 7 pages.
  // 24 pages: views at 0, 7, 14 pages; the one at 14 reaches 24 (14 + 10).
  const std::vector<Extent> tensors{{6 * kPage, kPage + kPage / 2}, {20 * kPage, 100}};
  auto views = plan_views(24 * kPage, 10 * kPage, kPage, tensors, kMaxViews);
  ASSERT_TRUE(views) << views.message();
  EXPECT_EQ(*views, (std::vector<View>{{0, 10 * kPage}, {7 * kPage, 10 * kPage}, {14 * kPage, 10 * kPage}}));
  // The tensor straddling 7 pages lies inside the first view, whole.
  EXPECT_EQ(find_view(*views, tensors[0]), std::optional<std::size_t>(0));
  EXPECT_EQ(find_view(*views, tensors[1]), std::optional<std::size_t>(2));
}

TEST(ViewPlanner, LastViewIsShortened) {
  auto views = plan_views(12 * kPage + 5, 10 * kPage, kPage, {}, kMaxViews);
  ASSERT_TRUE(views) << views.message();
  // No tensors: overlap one page, step 9 pages.
  EXPECT_EQ(*views, (std::vector<View>{{0, 10 * kPage}, {9 * kPage, 3 * kPage + 5}}));
}

TEST(ViewPlanner, TensorLongerThanAViewIsAnError) {
  const std::vector<Extent> tensors{{0, 9 * kPage}};
  auto views = plan_views(30 * kPage, 10 * kPage, kPage, tensors, kMaxViews);
  ASSERT_FALSE(views);
  EXPECT_EQ(views.status().code(), ErrorCode::limit_exceeded);
  EXPECT_NE(views.message().find("cannot lie entirely inside one view"), std::string::npos) << views.message();
  // The same tensor with exactly the room a view leaves (max_len - 2 pages) is accepted.
  const std::vector<Extent> fits{{0, 8 * kPage}};
  EXPECT_TRUE(plan_views(30 * kPage, 10 * kPage, kPage, fits, kMaxViews));
}

TEST(ViewPlanner, TooManyViewsIsAnErrorNamingTheCount) {
  // 1000 pages in views of 10 pages stepping 9: 1 + ceil(990 / 9) = 111 views.
  auto views = plan_views(1000 * kPage, 10 * kPage, kPage, {}, kMaxViews);
  ASSERT_FALSE(views);
  EXPECT_EQ(views.status().code(), ErrorCode::limit_exceeded);
  EXPECT_NE(views.message().find("needs 111 views"), std::string::npos) << views.message();
  EXPECT_NE(views.message().find("64"), std::string::npos) << views.message();
  auto allowed = plan_views(1000 * kPage, 10 * kPage, kPage, {}, 111);
  ASSERT_TRUE(allowed) << allowed.message();
  EXPECT_EQ(allowed->size(), 111u);
}

TEST(ViewPlanner, BadArgumentsAreErrors) {
  const std::vector<Extent> outside{{10 * kPage, 1}};
  EXPECT_EQ(plan_views(0, kPage, kPage, {}, kMaxViews).status().code(), ErrorCode::invalid_argument);
  EXPECT_EQ(plan_views(kPage, kPage, 3000, {}, kMaxViews).status().code(), ErrorCode::invalid_argument);
  EXPECT_EQ(plan_views(kPage, kPage, 0, {}, kMaxViews).status().code(), ErrorCode::invalid_argument);
  EXPECT_EQ(plan_views(kPage, kPage / 2, kPage, {}, kMaxViews).status().code(), ErrorCode::invalid_argument);
  EXPECT_EQ(plan_views(10 * kPage, 20 * kPage, kPage, outside, kMaxViews).status().code(), ErrorCode::invalid_argument);
  EXPECT_EQ(plan_views(10 * kPage, 20 * kPage, kPage, {}, 0).status().code(), ErrorCode::limit_exceeded);
  // Splitting needs views of at least two pages.
  EXPECT_EQ(plan_views(10 * kPage, kPage, kPage, {}, kMaxViews).status().code(), ErrorCode::limit_exceeded);
}

TEST(ViewPlanner, HugeValuesDoNotOverflow) {
  constexpr std::uint64_t kMax = ~std::uint64_t{0};
  const std::vector<Extent> tensors{{kMax - 10, 10}, {0, kMax}};
  EXPECT_EQ(plan_views(kMax, kMax, 1, tensors, kMaxViews).status().code(), ErrorCode::ok);
  auto big = plan_views(kMax, std::uint64_t{1} << 62, kPage, {}, kMaxViews);
  ASSERT_TRUE(big) << big.message();
  EXPECT_EQ(big->back().offset + big->back().length, kMax);
  // 2^64 bytes in views of two pages: about 2^50 views, refused before any is allocated.
  auto many = plan_views(kMax, 2 * kPage, kPage, {}, ~std::uint32_t{0});
  ASSERT_FALSE(many);
  EXPECT_EQ(many.status().code(), ErrorCode::limit_exceeded);
}

// ---- properties over generated layouts ----------------------------------------------------

struct Layout {
  std::uint64_t size = 0, max_len = 0, page = 0;
  std::vector<Extent> tensors;
  std::uint32_t max_views = 0;
};

// A llama-shaped mapping (a header, then tensors one after another at 32-byte alignment) or
// arbitrary extents, at page sizes and view lengths of several scales.
Layout generate(std::mt19937_64& rng) {
  auto pick = [&rng](std::uint64_t lo, std::uint64_t hi) {
    return std::uniform_int_distribution<std::uint64_t>(lo, hi)(rng);
  };
  Layout l;
  static constexpr std::uint64_t kPages[] = {1, 64, 4096, 16384, 65536};
  l.page = kPages[pick(0, 4)];
  l.max_len = l.page * pick(2, 200) + (pick(0, 3) == 0 ? pick(0, l.page - 1) : 0);
  l.size = pick(1, l.max_len * pick(1, 80));
  l.max_views = static_cast<std::uint32_t>(pick(1, 128));
  const std::uint64_t tensor_cap = pick(0, 3) == 0 ? l.max_len : l.max_len / pick(2, 16);
  if (pick(0, 1) == 0) {
    std::uint64_t at = std::min(l.size, pick(0, 4096));
    while (at < l.size) {
      const std::uint64_t n = std::min(l.size - at, pick(0, std::max<std::uint64_t>(tensor_cap, 1)));
      l.tensors.push_back({at, n});
      at += n;
      at = std::min(l.size, (at + 31) / 32 * 32);
      if (l.tensors.size() > 2000) break;
    }
  } else {
    const std::uint64_t count = pick(0, 50);
    for (std::uint64_t i = 0; i < count; ++i) {
      const std::uint64_t n = pick(0, std::min(tensor_cap, l.size));
      l.tensors.push_back({pick(0, l.size - n), n});
    }
  }
  return l;
}

std::uint64_t round_up(std::uint64_t x, std::uint64_t page) { return (x + page - 1) / page * page; }

TEST(ViewPlannerProperties, GeneratedLayouts) {
  constexpr int kCases = 20000;
  int planned = 0, too_many = 0, too_long = 0;
  for (int seed = 0; seed < kCases; ++seed) {
    std::mt19937_64 rng(static_cast<std::uint64_t>(seed));
    const Layout l = generate(rng);
    SCOPED_TRACE("seed " + std::to_string(seed) + ": size " + std::to_string(l.size) + ", max_len " +
                 std::to_string(l.max_len) + ", page " + std::to_string(l.page) + ", " +
                 std::to_string(l.tensors.size()) + " tensors, max_views " + std::to_string(l.max_views));
    std::uint64_t largest = 0;
    for (const auto& t : l.tensors) largest = std::max(largest, t.size);
    auto views = plan_views(l.size, l.max_len, l.page, l.tensors, l.max_views);
    if (!views) {
      ASSERT_EQ(views.status().code(), ErrorCode::limit_exceeded) << views.message();
      if (round_up(largest, l.page) + 2 * l.page > l.max_len && l.size > l.max_len) {
        ++too_long;  // no view could hold the largest tensor with its alignment
        continue;
      }
      // Otherwise the only reason is the view count: with no limit it plans more views.
      auto unlimited = plan_views(l.size, l.max_len, l.page, l.tensors, ~std::uint32_t{0});
      ASSERT_TRUE(unlimited) << unlimited.message();
      ASSERT_GT(unlimited->size(), l.max_views);
      ++too_many;
      continue;
    }
    ++planned;
    const std::vector<View>& v = *views;
    ASSERT_FALSE(v.empty());
    ASSERT_LE(v.size(), l.max_views);
    // Views cover the mapping: start at 0, each starts inside or right after the previous,
    // the last ends at the end; none is longer than the maximum; offsets on pages.
    ASSERT_EQ(v.front().offset, 0u);
    ASSERT_EQ(v.back().offset + v.back().length, l.size);
    for (std::size_t i = 0; i < v.size(); ++i) {
      ASSERT_GT(v[i].length, 0u);
      ASSERT_LE(v[i].length, l.max_len);
      ASSERT_EQ(v[i].offset % l.page, 0u);
      if (i > 0) {
        ASSERT_GT(v[i].offset, v[i - 1].offset);
        ASSERT_LE(v[i].offset, v[i - 1].offset + v[i - 1].length);
        // Consecutive views overlap by at least the largest tensor.
        ASSERT_GE(v[i - 1].offset + v[i - 1].length - v[i].offset, largest);
      }
    }
    // Every tensor lies entirely inside a view, and find_view names one that holds it.
    for (const auto& t : l.tensors) {
      auto at = find_view(v, t);
      ASSERT_TRUE(at.has_value()) << "tensor at " << t.offset << " of " << t.size;
      const View& h = v[*at];
      ASSERT_LE(h.offset, t.offset);
      ASSERT_LE(t.offset + t.size, h.offset + h.length);
    }
    // A mapping that fits in one buffer is never split.
    if (l.size <= l.max_len) {
      ASSERT_EQ(v.size(), 1u);
    }
  }
  // The generator reaches every outcome, so each branch above was exercised.
  EXPECT_GT(planned, kCases / 4);
  EXPECT_GT(too_many, 100);
  EXPECT_GT(too_long, 100);
}

}  // namespace
}  // namespace residency
