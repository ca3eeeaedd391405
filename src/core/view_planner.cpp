// SPDX-License-Identifier: MIT
// The view planner: see include/residency/view_planner.hpp. Overflow-safe for any 64-bit
// input (the fuzz target feeds it arbitrary values): every sum is checked before it is formed,
// and the number of views is computed before any is allocated.
#include "residency/view_planner.hpp"

#include <algorithm>
#include <string>

namespace residency {
namespace {

std::uint64_t round_down(std::uint64_t x, std::uint64_t page) { return x & ~(page - 1); }

std::string bytes(std::uint64_t n) { return std::to_string(n) + " bytes"; }

}  // namespace

Result<std::vector<View>> plan_views(std::uint64_t size, std::uint64_t max_len, std::uint64_t page,
                                     std::span<const Extent> tensors, std::uint32_t max_views) {
  if (size == 0) {
    return Status(ErrorCode::invalid_argument, "plan_views: the mapping is empty (size 0); map at least one page");
  }
  if (page == 0 || (page & (page - 1)) != 0) {
    return Status(ErrorCode::invalid_argument, "plan_views: page size " + std::to_string(page) +
                                                   " is not a power of two; pass the system page size (getpagesize())");
  }
  if (max_len < page) {
    return Status(ErrorCode::invalid_argument, "plan_views: the maximum view length (" + bytes(max_len) +
                                                   ") is smaller than one page (" + bytes(page) + ")");
  }
  std::uint64_t largest = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const Extent& t = tensors[i];
    if (t.offset > size || t.size > size - t.offset) {
      return Status(ErrorCode::invalid_argument, "plan_views: tensor " + std::to_string(i) + " (offset " +
                                                     std::to_string(t.offset) + ", " + bytes(t.size) +
                                                     ") ends past the end of the mapping (" + bytes(size) + ")");
    }
    largest = std::max(largest, t.size);
  }
  if (max_views == 0) {
    return Status(ErrorCode::limit_exceeded, "plan_views: the backend accepts no views (max_views 0)");
  }

  // Fits in one buffer: one view, whatever the tensors.
  if (size <= max_len) return std::vector<View>{View{0, size}};

  // Every view leaves room for an overlap of round_up(largest, page) + page and a step of at
  // least one page: round_up(largest, page) <= max_len - 2 pages, i.e.
  // largest <= round_down(max_len - 2 pages, page).
  if (max_len / page < 2) {
    return Status(ErrorCode::limit_exceeded, "plan_views: a mapping of " + bytes(size) +
                                                 " needs several views, and a view of "
                                                 "at most " +
                                                 bytes(max_len) + " is shorter than two pages (" + bytes(2 * page) +
                                                 "), which leaves no room to step");
  }
  const std::uint64_t room = round_down(max_len - 2 * page, page);
  if (largest > room) {
    return Status(ErrorCode::limit_exceeded, "plan_views: a tensor of " + bytes(largest) +
                                                 " cannot lie entirely inside one view: views hold at most " +
                                                 bytes(max_len) + ", which leaves room for tensors of up to " + bytes(room) +
                                                 " (two pages go to alignment); split the tensor or use a backend with "
                                                 "longer buffers");
  }
  const std::uint64_t overlap = (largest == 0 ? 0 : round_down(largest + (page - 1), page)) + page;
  const std::uint64_t step = round_down(max_len - overlap, page);  // >= page by the check above

  // Views i = 0 .. n-1 at i x step; the last is the first that reaches the end:
  // n - 1 = ceil((size - max_len) / step).
  const std::uint64_t beyond = size - max_len;
  const std::uint64_t n = beyond / step + (beyond % step != 0 ? 1 : 0) + 1;
  if (n > max_views) {
    return Status(ErrorCode::limit_exceeded, "plan_views: a mapping of " + bytes(size) + " needs " + std::to_string(n) +
                                                 " views of at most " + bytes(max_len) + " (overlap " + bytes(overlap) +
                                                 "), more than the " + std::to_string(max_views) +
                                                 " the backend accepts; map the model in smaller pieces");
  }
  std::vector<View> views;
  views.reserve(static_cast<std::size_t>(n));
  for (std::uint64_t i = 0; i < n; ++i) {
    const std::uint64_t offset = i * step;
    views.push_back(View{offset, std::min(max_len, size - offset)});
  }
  return views;
}

std::optional<std::size_t> find_view(std::span<const View> views, Extent tensor) {
  for (std::size_t i = 0; i < views.size(); ++i) {
    const View& v = views[i];
    if (tensor.offset >= v.offset && tensor.offset - v.offset <= v.length &&
        tensor.size <= v.length - (tensor.offset - v.offset)) {
      return i;
    }
  }
  return std::nullopt;
}

}  // namespace residency
