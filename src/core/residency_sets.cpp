// SPDX-License-Identifier: MIT
#include "residency_sets.hpp"

#include <algorithm>
#include <atomic>

namespace residency::core {

namespace {
std::atomic<SetId> g_next_set_id{1};
}  // namespace

ResidencySets::ResidencySets(Backend& backend, SetLayout layout, const LogSink& log)
    : backend_(backend), layout_(std::move(layout)), log_(log) {}

ResidencySets::SetState& ResidencySets::state(std::uint32_t slot) {
  if (slot >= sets_.size()) sets_.resize(slot + 1);
  return sets_[slot];
}

Result<std::uint32_t> ResidencySets::add(const RegionDesc& r, std::uint64_t bytes) {
  const auto p = layout_.place(bytes);
  if (p.created) {
    const SetId id = g_next_set_id.fetch_add(1, std::memory_order_relaxed);
    const std::uint64_t cap = layout_.cap_bytes() == UINT64_MAX ? bytes : layout_.cap_bytes();
    Status s = backend_.create_set(id, cap);
    if (!s) {
      layout_.remove(p.set, bytes);
      return Status(s.code(), "could not create residency set " + std::to_string(p.set) + ": " + s.message());
    }
    state(p.set) = SetState{id, false};
    if (log_.enabled(LogLevel::debug))
      log_(LogLevel::debug,
           "created residency set " + std::to_string(p.set) + " (max_bytes_per_set = " +
               (layout_.cap_bytes() == UINT64_MAX ? std::string("unlimited") : mib(layout_.cap_bytes())) + ")");
  }
  backend_.add_region(state(p.set).backend_id, r);
  dirty_[p.set] += static_cast<std::int64_t>(bytes);
  return p.set;
}

void ResidencySets::remove(std::uint32_t slot, const RegionDesc& r, std::uint64_t bytes) {
  SetState& st = state(slot);
  if (layout_.remove(slot, bytes)) {
    Status s = backend_.destroy_set(st.backend_id);
    if (!s) log_(LogLevel::warn, "destroying residency set " + std::to_string(slot) + " failed: " + s.message());
    st = SetState{};
    dirty_.erase(slot);
  } else {
    backend_.remove_region(st.backend_id, r.id);
    dirty_[slot] -= static_cast<std::int64_t>(bytes);
  }
}

ResidencySets::Released ResidencySets::end_all() {
  Released out;
  for (std::uint32_t slot : layout_.live_set_ids()) {
    SetState& st = state(slot);
    if (!st.requested) continue;
    Status s = backend_.end_residency(st.backend_id);
    if (!s) {
      ++out.failed;
      if (out.status) out.status = std::move(s);
      continue;
    }
    st.requested = false;
    out.bytes += layout_.set_bytes(slot);
    ++out.sets;
  }
  return out;
}

Status ResidencySets::destroy_all() {
  Status first;
  for (std::uint32_t slot : layout_.live_set_ids()) {
    Status s = backend_.destroy_set(state(slot).backend_id);
    if (!s && first) first = std::move(s);
    state(slot) = SetState{};
  }
  return first;
}

std::uint64_t ResidencySets::requested_bytes() const {
  std::uint64_t b = 0;
  for (std::uint32_t slot : layout_.live_set_ids())
    if (slot < sets_.size() && sets_[slot].requested) b += layout_.set_bytes(slot);
  return b;
}

}  // namespace residency::core
