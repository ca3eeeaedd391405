#include "wired_budget.hpp"

#include <algorithm>

namespace residency::core {

std::vector<RegionId> choose_promotions(std::span<const BudgetEntry> entries,
                                        std::uint64_t admitted_bytes, std::uint64_t limit) {
  std::vector<const BudgetEntry*> cand;
  for (const auto& e : entries)
    if (!e.admitted && e.eligible) cand.push_back(&e);
  std::sort(cand.begin(), cand.end(), [](const BudgetEntry* a, const BudgetEntry* b) {
    if (a->priority != b->priority) return a->priority > b->priority;
    if (a->last_use != b->last_use) return a->last_use > b->last_use;
    return a->id > b->id;  // same instant: the later registration (ids only grow)
  });
  std::vector<RegionId> out;
  std::uint64_t room = limit > admitted_bytes ? limit - admitted_bytes : 0;
  for (const auto* e : cand) {
    if (e->bytes <= room) {
      out.push_back(e->id);
      room -= e->bytes;
    }
  }
  return out;
}

std::vector<RegionId> choose_evictions(std::span<const BudgetEntry> entries,
                                       std::uint64_t admitted_bytes, std::uint64_t limit) {
  std::vector<const BudgetEntry*> cand;
  for (const auto& e : entries)
    if (e.admitted) cand.push_back(&e);
  std::sort(cand.begin(), cand.end(), [](const BudgetEntry* a, const BudgetEntry* b) {
    if (a->priority != b->priority) return a->priority < b->priority;
    if (a->last_use != b->last_use) return a->last_use < b->last_use;
    return a->id < b->id;  // same instant: the earlier registration
  });
  std::vector<RegionId> out;
  for (const auto* e : cand) {
    if (admitted_bytes <= limit) break;
    out.push_back(e->id);
    admitted_bytes -= e->bytes;
  }
  return out;
}

}  // namespace residency::core
