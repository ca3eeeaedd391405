// SPDX-License-Identifier: MIT
// SetLayout: which residency set an admitted region goes into.
//
// macOS decides residency per set, so when one set loses residency only that set's regions
// must be made resident again: smaller sets mean cheaper recoveries and cheaper commits (MLX).
// But every set is attached to every command queue, and a queue accepts a limited number, so
// the count is capped by the backend. Two layouts:
//   per_buffer: one set per region (llama.cpp); the set is destroyed with its region.
//   sharded:    sets capped at set_max_pct % of the recommended working set (floor 64 MiB);
//               first fit; a region larger than the cap reuses an emptied set; at the set
//               limit the emptiest set takes it and may grow past the cap (MLX's rules).
// Pure bookkeeping: no backend calls. The manager turns its decisions into create_set /
// add_region / remove_region / destroy_set calls.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "residency/backend.hpp"
#include "residency/config.hpp"

namespace residency::core {

// Sharded sets are never capped below 64 MiB, so small working sets do not explode into
// many tiny sets (MLX's floor).
inline constexpr std::uint64_t kMinSetCapBytes = 64ull << 20;

// A set's place in the layout: an index into its table, dense from 0 and reused (per_buffer).
// Not the backend's id for the set (LayoutSlot), which is process-wide (residency_sets.hpp).
using LayoutSlot = std::uint32_t;

class SetLayout {
 public:
  // `backend_max_sets`: Capabilities::max_sets (0 = none). The limit is the backend's to state
  // (Metal: 32 per command queue); the layout names no platform.
  SetLayout(Layout layout, double set_max_pct, std::uint64_t recommended_working_set, std::uint32_t backend_max_sets);

  struct Placement {
    LayoutSlot set;
    bool created;  // the caller must create_set() it before adding
  };
  // Chooses the set for a region of `bytes` and accounts it there.
  Placement place(std::uint64_t bytes);
  // Takes a region of `bytes` out of `set`. Returns true when the set must be destroyed now
  // (per_buffer: its region is gone).
  bool remove(LayoutSlot set, std::uint64_t bytes);

  std::uint64_t cap_bytes() const { return cap_; }  // UINT64_MAX: no cap (one set)
  std::uint32_t live_sets() const;
  std::uint64_t set_bytes(LayoutSlot set) const { return set < sets_.size() ? sets_[set].bytes : 0; }
  bool exists(LayoutSlot set) const { return set < sets_.size() && sets_[set].exists; }
  std::vector<LayoutSlot> live_set_ids() const;

 private:
  struct SetRecord {
    bool exists = false;
    std::uint64_t bytes = 0;
    std::uint32_t regions = 0;
  };
  LayoutSlot create();
  LayoutSlot emptiest() const;
  Layout layout_;
  std::uint64_t cap_;
  std::uint32_t max_sets_;
  std::vector<SetRecord> sets_;  // index = LayoutSlot; destroyed per_buffer slots are reused
};

}  // namespace residency::core
