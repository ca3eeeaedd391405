// SPDX-License-Identifier: MIT
// WiredBudget: which regions may be resident when not all fit.
//
// The budget is the most bytes that may be wired at once. Regions beyond it are tracked but
// kept out of every set. When room appears (the limit rises, a wired region is freed) the
// most valuable pending regions are admitted first: highest priority, then most recently
// used. When the limit falls, the least valuable wired regions leave first: lowest priority,
// then least recently used. MLX picks victims in hash order (arbitrary) and never promotes on
// free; these two rules are the difference.
//
// Cost: the choice runs over the candidates only (pending regions to promote, admitted ones to
// evict), so freeing a region when nothing waits costs nothing here, however many regions are
// tracked. No backend calls.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_set>
#include <vector>

#include "residency/backend.hpp"

namespace residency::core {

struct BudgetEntry {
  RegionId id = 0;
  std::uint64_t bytes = 0;
  int priority = 0;
  std::int64_t last_use = 0;  // time of last use: larger = more recent
  bool admitted = false;      // inside a set now
  bool eligible = true;       // may be admitted (false after the backend failed to wire it)
  RegionClass cls = RegionClass::weights;
};

// Pending, eligible entries to admit, in admission order, taken greedily while they fit in
// `limit - admitted_bytes` (an entry too large is skipped; smaller ones after it may fit).
std::vector<RegionId> choose_promotions(std::span<const BudgetEntry> entries, std::uint64_t admitted_bytes,
                                        std::uint64_t limit);
// Admitted entries to remove, in eviction order, until admitted bytes are at most `limit`.
// by_class (memory pressure): scratch first, then kv_cache, then weights, each by priority and
// recency; otherwise (a lower limit) by priority and recency alone. `floor` (memory pressure): an
// entry whose removal would take admitted bytes below it is skipped (a smaller one later in the
// order may still go), so the limit may stay unmet rather than the floor be crossed.
std::vector<RegionId> choose_evictions(std::span<const BudgetEntry> entries, std::uint64_t admitted_bytes,
                                       std::uint64_t limit, bool by_class = false, std::uint64_t floor = 0);

// The budget's state: the limit, the bytes admitted under it, and which regions wait.
// Invariant: admitted() <= limit() except just after the limit fell, until the caller has
// evicted what choose_evictions() named. Lock rule: with the manager's mutex held.
class WiredBudget {
 public:
  std::uint64_t limit() const { return limit_; }  // as configured (set_wired_limit)
  void set_limit(std::uint64_t bytes) { limit_ = bytes; }
  // A lower cap in force for a while (memory pressure); UINT64_MAX: none.
  void set_cap(std::uint64_t bytes) { cap_ = bytes; }
  std::uint64_t cap() const { return cap_; }
  std::uint64_t effective_limit() const { return limit_ < cap_ ? limit_ : cap_; }
  std::uint64_t admitted() const { return admitted_; }
  bool fits(std::uint64_t bytes) const {
    const std::uint64_t l = effective_limit();
    return bytes <= l && admitted_ <= l - bytes;
  }
  void admitted_region(RegionId id, std::uint64_t bytes) {
    admitted_ += bytes;
    pending_.erase(id);
  }
  void evicted_region(RegionId id, std::uint64_t bytes) {
    admitted_ -= bytes;
    pending_.insert(id);
  }
  void add_pending(RegionId id) { pending_.insert(id); }
  void forget(RegionId id) { pending_.erase(id); }
  const std::unordered_set<RegionId>& pending() const { return pending_; }

 private:
  std::uint64_t limit_ = 0;
  std::uint64_t cap_ = UINT64_MAX;
  std::uint64_t admitted_ = 0;
  std::unordered_set<RegionId> pending_;  // tracked regions in no set
};

}  // namespace residency::core
