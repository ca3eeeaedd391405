// SPDX-License-Identifier: MIT
#include "wired_budget.hpp"

#include <algorithm>

namespace residency::core {

namespace {
// Admission order: highest priority, then most recent use, then the later registration.
bool admits_before(const BudgetEntry& a, const BudgetEntry& b) {
  if (a.priority != b.priority) return a.priority > b.priority;
  if (a.last_use != b.last_use) return a.last_use > b.last_use;
  return a.id > b.id;  // same instant: the later registration (ids only grow)
}
}  // namespace

// Greedy in admission order, taking each entry that fits what is left, is the same as picking,
// again and again, the first entry in admission order that fits the room left: entries skipped
// before it did not fit a larger room. A free makes room for a few regions: one pass each over
// what waits, no sort. When many are admitted at once (the limit rose), sorting is cheaper.
std::vector<RegionId> choose_promotions(std::span<const BudgetEntry> entries, std::uint64_t admitted_bytes,
                                        std::uint64_t limit) {
  constexpr int kPassesBeforeSorting = 8;
  std::vector<RegionId> out;
  std::uint64_t room = limit > admitted_bytes ? limit - admitted_bytes : 0;
  std::vector<bool> taken(entries.size(), false);
  for (int pass = 0; pass < kPassesBeforeSorting; ++pass) {
    std::size_t best = entries.size();
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const BudgetEntry& e = entries[i];
      if (taken[i] || e.admitted || !e.eligible || e.bytes > room) continue;
      if (best == entries.size() || admits_before(e, entries[best])) best = i;
    }
    if (best == entries.size()) return out;
    taken[best] = true;
    out.push_back(entries[best].id);
    room -= entries[best].bytes;
  }
  std::vector<const BudgetEntry*> rest;
  for (std::size_t i = 0; i < entries.size(); ++i)
    if (!taken[i] && !entries[i].admitted && entries[i].eligible) rest.push_back(&entries[i]);
  std::sort(rest.begin(), rest.end(), [](const BudgetEntry* a, const BudgetEntry* b) { return admits_before(*a, *b); });
  for (const auto* e : rest) {
    if (e->bytes <= room) {
      out.push_back(e->id);
      room -= e->bytes;
    }
  }
  return out;
}

std::vector<RegionId> choose_evictions(std::span<const BudgetEntry> entries, std::uint64_t admitted_bytes,
                                       std::uint64_t limit, bool by_class, std::uint64_t floor) {
  std::vector<const BudgetEntry*> cand;
  for (const auto& e : entries)
    if (e.admitted) cand.push_back(&e);
  // Discardable classes go first under pressure: scratch is rebuilt per graph, a KV cache is
  // recomputed from the prompt, weights must be read back.
  auto rank = [](RegionClass c) { return c == RegionClass::scratch ? 0 : c == RegionClass::kv_cache ? 1 : 2; };
  std::sort(cand.begin(), cand.end(), [&](const BudgetEntry* a, const BudgetEntry* b) {
    if (by_class && rank(a->cls) != rank(b->cls)) return rank(a->cls) < rank(b->cls);
    if (a->priority != b->priority) return a->priority < b->priority;
    if (a->last_use != b->last_use) return a->last_use < b->last_use;
    return a->id < b->id;  // same instant: the earlier registration
  });
  std::vector<RegionId> out;
  for (const auto* e : cand) {
    if (admitted_bytes <= limit) break;
    if (admitted_bytes - e->bytes < floor) continue;  // what the floor keeps, pressure never takes
    out.push_back(e->id);
    admitted_bytes -= e->bytes;
  }
  return out;
}

}  // namespace residency::core
