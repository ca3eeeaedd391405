// SPDX-License-Identifier: MIT
// RegionTable: the regions a manager tracks, found by id or by address, and when each was last used.
//
// Engines with a caching allocator register and free thousands of blocks, and an engine that
// knows which tensors a graph reads can say so per region with touch(id) on its hot path. So a
// region's last-use stamp lives in a slot that never moves (chunks allocated once, never
// reallocated) and touch(id) finds it from the id alone, without a lock: the id carries its slot
// index in its low bits. The high bits come from one process-wide counter, so ids are unique
// across the managers of a process (a shared backend keys its books by them) and a stale id
// never matches a reused slot.
//
// Invariants: tracked ranges never overlap; `tracked_bytes()` is the sum of their sizes; a slot
// holds the id of its region while it is registered and 0 otherwise. Lock rule: every method but
// touch() is called with the manager's mutex held.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <unordered_map>
#include <vector>

#include "residency/backend.hpp"
#include "residency/status.hpp"

namespace residency::core {

struct Region {
  RegionDesc desc;
  int priority = 0;
  bool admitted = false;          // in a set (within the wired budget)
  std::uint32_t layout_slot = 0;  // the SetLayout slot of its set, when admitted
  bool eligible = true;           // false after the backend failed to wire it, until the limit changes
};

class RegionTable {
  struct Slot {
    std::atomic<RegionId> id{0};
    std::atomic<std::int64_t> last_use{0};
  };

 public:
  // Slots per chunk and chunks: up to 1 Mi regions per manager (16 KiB per chunk of stamps).
  static constexpr std::uint32_t kSlotBits = 20;
  static constexpr std::uint32_t kChunkSlots = 1024;
  static constexpr std::uint32_t kChunks = (1u << kSlotBits) / kChunkSlots;

  RegionTable();
  ~RegionTable();
  RegionTable(const RegionTable&) = delete;
  RegionTable& operator=(const RegionTable&) = delete;

  // Validates (size 0, null, wrap-around, overlap, slot exhaustion), assigns the id, stamps the
  // region as used at `now`. The returned pointer is valid until erase().
  Result<Region*> insert(const RegionDesc& desc, int priority, std::int64_t now);
  void erase(RegionId id);
  Region* find(RegionId id);
  Region* find_address(const void* base);  // the region that starts exactly at base

  // Lock-free, from any thread: stamps the region as used at `now`. False for an id that is not
  // registered (never registered, or unregistered since). Inline: it is on touch(id)'s hot path.
  bool touch(RegionId id, std::int64_t now) noexcept {
    const auto index = static_cast<std::uint32_t>(id & ((1u << kSlotBits) - 1));
    Slot* s = slot(index);
    if (s == nullptr || s->id.load(std::memory_order_acquire) != id) return false;
    if (s->last_use.load(std::memory_order_relaxed) != now) s->last_use.store(now, std::memory_order_relaxed);
    return true;
  }
  std::int64_t last_use(const Region& r) const noexcept;

  std::uint64_t tracked_bytes() const { return tracked_; }
  std::size_t size() const { return regions_.size(); }
  template <typename F>
  void for_each(F&& f) {
    for (auto& [id, r] : regions_) f(r);
  }
  template <typename F>
  void for_each(F&& f) const {
    for (const auto& [id, r] : regions_) f(r);
  }

 private:
  Slot* slot(std::uint32_t index) const noexcept {
    Slot* chunk = chunks_[index / kChunkSlots].load(std::memory_order_acquire);
    return chunk ? &chunk[index % kChunkSlots] : nullptr;
  }

  std::array<std::atomic<Slot*>, kChunks> chunks_{};
  std::uint32_t next_slot_ = 0;
  std::vector<std::uint32_t> free_slots_;
  std::unordered_map<RegionId, Region> regions_;
  std::map<std::uintptr_t, RegionId> by_address_;
  std::uint64_t tracked_ = 0;
};

}  // namespace residency::core
