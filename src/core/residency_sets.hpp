// SPDX-License-Identifier: MIT
// ResidencySets: the manager's sets as the backend holds them.
//
// SetLayout decides which set a region goes into; this unit turns those decisions into backend
// calls and remembers, per set, the one thing the backend's answers tell us: whether the set's
// residency is requested there now. It stages membership changes and commits each touched set
// once per batch, shrinking sets first, so that the backend never holds more than the larger of
// the old and new budget, even for a moment.
//
// Invariants: a slot's backend set exists exactly while the layout says the slot exists;
// `requested` is what the backend last confirmed (a failed end_residency leaves it true).
// Backend set ids are drawn from one process-wide counter, so managers sharing a backend never
// collide. Lock rule: with the manager's mutex held.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "log.hpp"
#include "residency/backend.hpp"
#include "set_layout.hpp"

namespace residency::core {

class ResidencySets {
 public:
  ResidencySets(Backend& backend, SetLayout layout, const LogSink& log);

  // Puts a region into a set, creating the set if the layout says so; `bytes` is what the region
  // is charged (Admission::charge), which the sets' sizes count. Returns the slot, or the
  // backend's error (the region then stays pending).
  Result<std::uint32_t> add(const RegionDesc& region, std::uint64_t bytes);
  // Takes a region out of its set (destroying a per_buffer set with it).
  void remove(std::uint32_t slot, const RegionDesc& region, std::uint64_t bytes);

  // Commits every touched set once, most shrinking first; with `request` set, also requests the
  // residency of sets that hold regions and are not yet requested. Each outcome that is not ok
  // goes to `on_failure` (which may remove regions: that touches their sets again, and those
  // are committed in a further round).
  template <typename OnFailure>
  void flush(bool request, OnFailure&& on_failure);

  // Requests the residency of every set that holds regions and is not requested. Returns the
  // bytes and sets requested.
  template <typename OnFailure>
  std::pair<std::uint64_t, std::uint32_t> request_all(OnFailure&& on_failure);
  // Ends the residency of every requested set. Sets whose release failed stay requested; the
  // first error comes back in `status`.
  struct Released {
    std::uint64_t bytes = 0;
    std::uint32_t sets = 0;
    std::uint32_t failed = 0;
    Status status;
  };
  Released end_all();
  // Destroys every set (teardown). Returns the first error.
  Status destroy_all();

  // Repeats the residency requests of every requested set (backends whose requests decay).
  template <typename OnFailure>
  void refresh_all(OnFailure&& on_failure);

  std::uint64_t requested_bytes() const;
  std::uint32_t live_sets() const { return layout_.live_sets(); }
  std::uint64_t commits() const { return commits_; }
  std::uint64_t requests() const { return requests_; }

 private:
  struct SetState {
    SetId backend_id = 0;
    bool requested = false;
  };
  SetState& state(std::uint32_t slot);
  Backend& backend_;
  SetLayout layout_;
  const LogSink& log_;
  std::vector<SetState> sets_;  // by layout slot
  // Touched slots and their net change in bytes since the last flush.
  std::map<std::uint32_t, std::int64_t> dirty_;
  std::uint64_t commits_ = 0;
  std::uint64_t requests_ = 0;
};

// --- templates ------------------------------------------------------------------------------

template <typename OnFailure>
void ResidencySets::flush(bool request, OnFailure&& on_failure) {
  for (int round = 0; round < 3 && !dirty_.empty(); ++round) {
    std::vector<std::pair<std::int64_t, std::uint32_t>> order;
    for (auto [slot, delta] : dirty_) order.emplace_back(delta, slot);
    dirty_.clear();
    std::sort(order.begin(), order.end());
    for (auto [delta, slot] : order) {
      if (!layout_.exists(slot)) continue;
      SetState& st = state(slot);
      SetOutcome out = backend_.commit(st.backend_id);
      ++commits_;
      if (!out.ok()) on_failure(out, "wiring newly added memory");
      if (request && !st.requested && layout_.set_bytes(slot) > 0) {
        SetOutcome req = backend_.request_residency(st.backend_id);
        ++requests_;
        st.requested = true;
        if (!req.ok()) on_failure(req, "requesting residency");
      }
    }
  }
}

template <typename OnFailure>
std::pair<std::uint64_t, std::uint32_t> ResidencySets::request_all(OnFailure&& on_failure) {
  std::uint64_t bytes = 0;
  std::uint32_t n = 0;
  for (std::uint32_t slot : layout_.live_set_ids()) {
    SetState& st = state(slot);
    if (st.requested || layout_.set_bytes(slot) == 0) continue;
    bytes += layout_.set_bytes(slot);
    ++n;
    SetOutcome out = backend_.request_residency(st.backend_id);
    ++requests_;
    st.requested = true;
    if (!out.ok()) on_failure(out, "re-wiring");
  }
  return {bytes, n};
}

template <typename OnFailure>
void ResidencySets::refresh_all(OnFailure&& on_failure) {
  for (std::uint32_t slot : layout_.live_set_ids()) {
    SetState& st = state(slot);
    if (!st.requested) continue;
    SetOutcome out = backend_.refresh(st.backend_id);
    ++requests_;
    if (!out.ok()) on_failure(out, "refreshing residency");
  }
}

}  // namespace residency::core
