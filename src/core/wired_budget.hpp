// WiredBudget: which regions may be resident when not all fit.
//
// The budget is the most bytes that may be wired at once. Regions beyond it are tracked but
// kept out of every set. When room appears (the limit rises, a wired region is freed) the
// most valuable pending regions are admitted first: highest priority, then most recently
// used. When the limit falls, the least valuable wired regions leave first: lowest priority,
// then least recently used. MLX picks victims in hash order (arbitrary) and never promotes on
// free; these two rules are the difference. Pure functions over a snapshot; no backend calls.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "residency/backend.hpp"

namespace residency::core {

struct BudgetEntry {
  RegionId id = 0;
  std::uint64_t bytes = 0;
  int priority = 0;
  std::uint64_t last_use = 0;  // a sequence number: larger = more recent
  bool admitted = false;       // inside a set now
  bool eligible = true;        // may be admitted (false after the backend failed to wire it)
};

// Pending, eligible entries to admit, in admission order, taken greedily while they fit in
// `limit - admitted_bytes` (an entry too large is skipped; smaller ones after it may fit).
std::vector<RegionId> choose_promotions(std::span<const BudgetEntry> entries,
                                        std::uint64_t admitted_bytes, std::uint64_t limit);
// Admitted entries to remove, in eviction order, until admitted bytes are at most `limit`.
std::vector<RegionId> choose_evictions(std::span<const BudgetEntry> entries,
                                       std::uint64_t admitted_bytes, std::uint64_t limit);

}  // namespace residency::core
