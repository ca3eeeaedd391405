// SPDX-License-Identifier: MIT
// residency posix backend: per-page lock counts (see lock_table.hpp).
#include "backends/posix/lock_table.hpp"

#include <iterator>

namespace residency::posix {

std::map<std::uintptr_t, std::uint32_t>::iterator LockTable::split(std::uintptr_t a) {
  auto it = counts_.lower_bound(a);
  if (it != counts_.end() && it->first == a) return it;
  const std::uint32_t count = (it == counts_.begin()) ? 0 : std::prev(it)->second;
  return counts_.emplace_hint(it, a, count);
}

void LockTable::merge_around(std::uintptr_t first, std::uintptr_t last) {
  auto it = counts_.lower_bound(first);
  if (it != counts_.begin()) --it;
  while (it != counts_.end() && it->first <= last) {
    auto next = std::next(it);
    const std::uint32_t prev_count = (it == counts_.begin()) ? 0 : std::prev(it)->second;
    if (it->second == prev_count) {
      counts_.erase(it);
    }
    it = next;
  }
}

namespace {
void append(std::vector<AddrRange>& out, std::uintptr_t b, std::uintptr_t e) {
  if (!out.empty() && out.back().end == b) {
    out.back().end = e;
  } else {
    out.push_back({b, e});
  }
}
}  // namespace

std::vector<AddrRange> LockTable::acquire(AddrRange r) {
  std::vector<AddrRange> fresh;
  if (r.end <= r.begin) return fresh;
  auto it = split(r.begin);
  split(r.end);
  it = counts_.find(r.begin);
  while (it != counts_.end() && it->first < r.end) {
    auto next = std::next(it);
    if (it->second == 0) append(fresh, it->first, next->first);
    ++it->second;
    it = next;
  }
  merge_around(r.begin, r.end);
  return fresh;
}

std::vector<AddrRange> LockTable::release(AddrRange r) {
  std::vector<AddrRange> freed;
  if (r.end <= r.begin) return freed;
  split(r.begin);
  split(r.end);
  auto it = counts_.find(r.begin);
  while (it != counts_.end() && it->first < r.end) {
    auto next = std::next(it);
    if (it->second > 0) {
      --it->second;
      if (it->second == 0) append(freed, it->first, next->first);
    }
    it = next;
  }
  merge_around(r.begin, r.end);
  return freed;
}

std::uint64_t LockTable::held_bytes() const {
  std::uint64_t total = 0;
  for (auto it = counts_.begin(); it != counts_.end(); ++it) {
    auto next = std::next(it);
    if (it->second > 0 && next != counts_.end()) total += next->first - it->first;
  }
  return total;
}

}  // namespace residency::posix
