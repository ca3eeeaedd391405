// SPDX-License-Identifier: MIT
// Fuzz target for the view planner: arbitrary 64-bit sizes, view lengths, page sizes, view
// limits and tensor extents. The planner must never crash, overflow (UBSan) or allocate an
// absurd plan (ASan's allocation limit), and every plan it returns must keep its promises:
// views on pages, none longer than the maximum, covering the mapping, at most max_views, and
// every tensor entirely inside one view.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "residency/view_planner.hpp"

namespace {

struct Reader {
  const std::uint8_t* data;
  std::size_t left;
  std::uint64_t u64() {
    std::uint64_t v = 0;
    const std::size_t n = left < sizeof v ? left : sizeof v;
    std::memcpy(&v, data, n);
    data += n;
    left -= n;
    return v;
  }
};

void check(bool ok) {
  if (!ok) std::abort();  // the fuzzer reports the input that broke a promise
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Reader r{data, size};
  const std::uint64_t map_size = r.u64();
  const std::uint64_t max_len = r.u64();
  // Mostly powers of two (the valid case), sometimes anything.
  const std::uint64_t page_raw = r.u64();
  const std::uint64_t page = (page_raw & 0x100) != 0 ? page_raw : std::uint64_t{1} << (page_raw % 64);
  // Backends accept tens of views (Metal: 64); a limit of billions would make a legitimate plan
  // of billions of views, which measures the allocator, not the planner.
  const auto max_views = static_cast<std::uint32_t>(r.u64() % 4097);
  std::vector<residency::Extent> tensors;
  while (r.left >= 16 && tensors.size() < 4096) {
    const std::uint64_t offset = r.u64();
    tensors.push_back({offset, r.u64()});
  }
  auto plan = residency::plan_views(map_size, max_len, page, tensors, max_views);
  if (!plan) return 0;
  const auto& v = *plan;
  check(!v.empty() && v.size() <= max_views);
  check(v.front().offset == 0 && v.back().offset + v.back().length == map_size);
  for (std::size_t i = 0; i < v.size(); ++i) {
    check(v[i].length > 0 && v[i].length <= max_len && v[i].offset % page == 0);
    if (i > 0) check(v[i].offset > v[i - 1].offset && v[i].offset <= v[i - 1].offset + v[i - 1].length);
  }
  for (const auto& t : tensors) {
    auto at = residency::find_view(v, t);
    check(at.has_value());
    check(v[*at].offset <= t.offset && t.offset - v[*at].offset + t.size <= v[*at].length);
  }
  return 0;
}
