// SPDX-License-Identifier: MIT
#include "set_layout.hpp"

#include <algorithm>
#include <limits>

namespace residency::core {

SetLayout::SetLayout(Layout layout, double set_max_pct, std::uint64_t recommended, std::uint32_t backend_max_sets)
    : layout_(layout) {
  std::uint32_t limit = backend_max_sets == 0 ? std::numeric_limits<std::uint32_t>::max() : backend_max_sets;
  if (layout == Layout::sharded) {
    if (set_max_pct <= 0 || set_max_pct >= 100 || recommended == 0) {
      cap_ = std::numeric_limits<std::uint64_t>::max();  // one set holds everything
      limit = 1;
    } else {
      const auto pct_bytes = static_cast<std::uint64_t>(static_cast<double>(recommended) * set_max_pct / 100.0);
      cap_ = std::max(pct_bytes, kMinSetCapBytes);
    }
  } else {
    cap_ = std::numeric_limits<std::uint64_t>::max();
  }
  max_sets_ = std::max<std::uint32_t>(limit, 1);
}

std::uint32_t SetLayout::live_sets() const {
  return static_cast<std::uint32_t>(std::count_if(sets_.begin(), sets_.end(), [](const SetRecord& s) { return s.exists; }));
}

std::vector<LayoutSlot> SetLayout::live_set_ids() const {
  std::vector<LayoutSlot> ids;
  for (LayoutSlot i = 0; i < sets_.size(); ++i)
    if (sets_[i].exists) ids.push_back(i);
  return ids;
}

LayoutSlot SetLayout::create() {
  for (LayoutSlot i = 0; i < sets_.size(); ++i) {
    if (!sets_[i].exists) {
      sets_[i] = SetRecord{true, 0, 0};
      return i;
    }
  }
  sets_.push_back(SetRecord{true, 0, 0});
  return static_cast<LayoutSlot>(sets_.size() - 1);
}

LayoutSlot SetLayout::emptiest() const {
  LayoutSlot best = 0;
  bool found = false;
  for (LayoutSlot i = 0; i < sets_.size(); ++i) {
    if (!sets_[i].exists) continue;
    if (!found || sets_[i].bytes < sets_[best].bytes) best = i, found = true;
  }
  return best;
}

SetLayout::Placement SetLayout::place(std::uint64_t bytes) {
  const bool can_create = live_sets() < max_sets_;
  Placement p{0, false};
  if (layout_ == Layout::per_buffer) {
    if (can_create) p = {create(), true};
    else p = {emptiest(), false};
  } else if (bytes > cap_) {
    // Larger than any set may be: reuse an emptied set, else a new one, else the emptiest.
    auto it = std::find_if(sets_.begin(), sets_.end(), [](const SetRecord& s) { return s.exists && s.regions == 0; });
    if (it != sets_.end()) p = {static_cast<LayoutSlot>(it - sets_.begin()), false};
    else if (can_create) p = {create(), true};
    else p = {emptiest(), false};
  } else {
    bool fitted = false;
    for (LayoutSlot i = 0; i < sets_.size(); ++i) {
      if (sets_[i].exists && sets_[i].bytes + bytes <= cap_) {
        p = {i, false};
        fitted = true;
        break;
      }
    }
    if (!fitted) {
      if (can_create) p = {create(), true};
      else p = {emptiest(), false};  // may grow past the cap
    }
  }
  sets_[p.set].bytes += bytes;
  sets_[p.set].regions += 1;
  return p;
}

bool SetLayout::remove(LayoutSlot set, std::uint64_t bytes) {
  if (set >= sets_.size() || !sets_[set].exists) return false;
  SetRecord& s = sets_[set];
  s.bytes -= std::min(s.bytes, bytes);
  if (s.regions > 0) s.regions -= 1;
  if (layout_ == Layout::per_buffer && s.regions == 0) {
    s = SetRecord{};
    return true;
  }
  return false;
}

}  // namespace residency::core
