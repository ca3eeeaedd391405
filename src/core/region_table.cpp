// SPDX-License-Identifier: MIT
#include "region_table.hpp"

#include <string>

namespace residency::core {

namespace {
// One counter for the process: ids never repeat across managers.
std::atomic<std::uint64_t> g_region_serial{1};
}  // namespace

RegionTable::RegionTable() = default;

RegionTable::~RegionTable() {
  for (auto& c : chunks_) delete[] c.load(std::memory_order_relaxed);
}

Result<Region*> RegionTable::insert(const RegionDesc& in, int priority, std::int64_t now) {
  if (in.size == 0)
    return Status(ErrorCode::invalid_argument, "register_region: size is 0; a region needs at least one byte");
  if (in.base == nullptr) return Status(ErrorCode::invalid_argument, "register_region: base is null");
  const auto b = reinterpret_cast<std::uintptr_t>(in.base);
  if (b + in.size < b)
    return Status(ErrorCode::invalid_argument, "register_region: base + size wraps around the address space");
  auto next = by_address_.lower_bound(b);
  if (next != by_address_.end() && next->first < b + in.size)
    return Status(ErrorCode::invalid_argument, "register_region: [" + std::to_string(b) + ", +" +
                                                   std::to_string(in.size) + ") overlaps region " +
                                                   std::to_string(next->second) + " already tracked");
  if (next != by_address_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + regions_.at(prev->second).desc.size > b)
      return Status(ErrorCode::invalid_argument,
                    "register_region: region overlaps region " + std::to_string(prev->second) + " already tracked");
  }
  std::uint32_t index;
  if (!free_slots_.empty()) {
    index = free_slots_.back();
    free_slots_.pop_back();
  } else {
    if (next_slot_ >= (1u << kSlotBits))
      return Status(ErrorCode::limit_exceeded,
                    "register_region: a manager tracks at most " + std::to_string(1u << kSlotBits) + " regions at once");
    index = next_slot_++;
    auto& chunk = chunks_[index / kChunkSlots];
    if (!chunk.load(std::memory_order_relaxed)) chunk.store(new Slot[kChunkSlots], std::memory_order_release);
  }
  const RegionId id = (g_region_serial.fetch_add(1, std::memory_order_relaxed) << kSlotBits) | index;
  Slot* s = slot(index);
  s->last_use.store(now, std::memory_order_relaxed);
  s->id.store(id, std::memory_order_release);

  Region r;
  r.desc = in;
  r.desc.id = id;
  r.priority = priority;
  tracked_ += in.size;
  by_address_[b] = id;
  return &regions_.emplace(id, r).first->second;
}

void RegionTable::erase(RegionId id) {
  auto it = regions_.find(id);
  if (it == regions_.end()) return;
  by_address_.erase(reinterpret_cast<std::uintptr_t>(it->second.desc.base));
  tracked_ -= it->second.desc.size;
  const auto index = static_cast<std::uint32_t>(id & ((1u << kSlotBits) - 1));
  slot(index)->id.store(0, std::memory_order_release);
  free_slots_.push_back(index);
  regions_.erase(it);
}

Region* RegionTable::find(RegionId id) {
  auto it = regions_.find(id);
  return it == regions_.end() ? nullptr : &it->second;
}

Region* RegionTable::find_address(const void* base) {
  auto it = by_address_.find(reinterpret_cast<std::uintptr_t>(base));
  return it == by_address_.end() ? nullptr : find(it->second);
}

std::int64_t RegionTable::last_use(const Region& r) const noexcept {
  const auto index = static_cast<std::uint32_t>(r.desc.id & ((1u << kSlotBits) - 1));
  return slot(index)->last_use.load(std::memory_order_relaxed);
}

}  // namespace residency::core
