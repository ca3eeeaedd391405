// SPDX-License-Identifier: MIT
// residency posix backend: per-page lock counts, because the kernel keeps none.
//
// mlock and munlock are not reference-counted: one munlock unlocks a page however many
// mlocks covered it. Regions are rounded out to whole pages, so two regions (in one set or in
// two) can share a page, and a region can be in two sets; munlock-ing one region must not
// unlock the other's pages. LockTable counts, per page range, how many holders want it
// locked, and tells the caller exactly which sub-ranges changed between "nobody" and
// "somebody": those, and only those, are what must be mlock-ed or munlock-ed.
//
// Pure bookkeeping (no system calls), so every overlap case is unit-tested. Not thread-safe:
// the backend calls it under its own mutex.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

namespace residency::posix {

struct AddrRange {
  std::uintptr_t begin = 0;
  std::uintptr_t end = 0;  // exclusive
  std::uint64_t size() const { return end - begin; }
  bool operator==(const AddrRange&) const = default;
};

class LockTable {
 public:
  // Adds one hold on every byte of [begin, end). Returns the maximal sub-ranges that had no
  // hold before (now to be locked), in address order. An empty range changes nothing.
  std::vector<AddrRange> acquire(AddrRange r);
  // Removes one hold from every byte of [begin, end). Returns the maximal sub-ranges that
  // have no hold left (now to be unlocked). Bytes without a hold are ignored (never negative).
  std::vector<AddrRange> release(AddrRange r);
  // Bytes with at least one hold.
  std::uint64_t held_bytes() const;
  // Number of stored boundaries (tests: neighbours with equal counts are merged).
  std::size_t boundaries() const { return counts_.size(); }

 private:
  // Ensures a boundary at `a` and returns it.
  std::map<std::uintptr_t, std::uint32_t>::iterator split(std::uintptr_t a);
  // Merges boundaries in [first, last] whose count equals their predecessor's.
  void merge_around(std::uintptr_t first, std::uintptr_t last);

  // Invariant: each key starts a segment that runs to the next key and whose bytes all have
  // the mapped hold count; the last key always maps to 0 (the end of the held space), and no
  // two neighbouring keys map to the same count.
  std::map<std::uintptr_t, std::uint32_t> counts_;
};

}  // namespace residency::posix
