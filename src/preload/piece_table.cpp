// SPDX-License-Identifier: MIT
#include "piece_table.hpp"

#include <algorithm>
#include <string>

#include "buffer_plan.hpp"
#include "residency/text.hpp"

namespace residency::preload {

bool PieceTable::overlaps(std::uintptr_t begin, std::uintptr_t end) const noexcept {
  const std::size_t used = used_.load(std::memory_order_acquire);
  for (std::size_t i = 0; i < used; ++i) {
    const Slot& s = slots_[i];
    const std::uintptr_t e = s.end.load(std::memory_order_acquire);
    if (e == 0) continue;
    const std::uintptr_t b = s.begin.load(std::memory_order_relaxed);
    if (begin < e && b < end) return true;
  }
  return false;
}

bool PieceTable::add(std::uintptr_t begin, std::uintptr_t end, RegionClass cls, std::uint64_t owner) noexcept {
  if (end <= begin) return false;
  if (exclude_ == nullptr || !exclude_->overlaps(begin, end)) return add_one(begin, end, cls, owner);
  // Whole pages of what is excluded (a lock covers whole pages) are left out.
  try {
    const std::uintptr_t page = system_page_size();
    std::uintptr_t at = begin;
    bool any = false;
    for (const Piece& x : exclude_->pieces()) {
      const std::uintptr_t xb = x.begin & ~(page - 1), xe = (x.end + page - 1) & ~(page - 1);
      if (xe <= at || xb >= end) continue;
      if (xb > at) any = add_one(at, xb, cls, owner) || any;
      at = std::max(at, xe);
    }
    if (at < end) any = add_one(at, end, cls, owner) || any;
    return any;
  } catch (...) {
    return false;
  }
}

std::size_t PieceTable::excluded_bytes(std::uintptr_t begin, std::uintptr_t end) const noexcept {
  if (exclude_ == nullptr || end <= begin || !exclude_->overlaps(begin, end)) return 0;
  try {
    const std::uintptr_t page = system_page_size();
    std::uintptr_t at = begin;
    std::size_t n = 0;
    for (const Piece& x : exclude_->pieces()) {  // sorted by address, as add() walks them
      const std::uintptr_t xb = std::max(x.begin & ~(page - 1), at), xe = std::min((x.end + page - 1) & ~(page - 1), end);
      if (xe <= xb) continue;
      n += xe - xb;
      at = xe;
    }
    return n;
  } catch (...) {
    return 0;
  }
}

bool PieceTable::add_one(std::uintptr_t begin, std::uintptr_t end, RegionClass cls, std::uint64_t owner) noexcept {
  if (merge_ && manager_ == nullptr) {
    const std::size_t used = used_.load(std::memory_order_relaxed);
    for (std::size_t i = 0; i < used; ++i) {
      Slot& s = slots_[i];
      const std::uintptr_t e = s.end.load(std::memory_order_relaxed);
      if (e == 0 || s.owner != owner || s.cls != cls) continue;
      const std::uintptr_t b = s.begin.load(std::memory_order_relaxed);
      if (begin > e || end < b) continue;
      // Only ever grown: a lock-free reader sees the piece as it was, as it is, or in between,
      // each of which covers what it covered before.
      if (begin < b) s.begin.store(begin, std::memory_order_relaxed);
      if (end > e) s.end.store(end, std::memory_order_release);
      return true;
    }
  }
  Slot* free_slot = nullptr;
  for (Slot& s : slots_) {
    if (s.end.load(std::memory_order_relaxed) == 0) {
      free_slot = &s;
      break;
    }
  }
  try {
    if (free_slot == nullptr) {
      if (defer_warnings_) full_unsaid_.store(true, std::memory_order_relaxed);
      else if (!warned_full_.exchange(true, std::memory_order_relaxed))
        log_->warn("more than " + std::to_string(kMaxPieces) + " pieces of " + what_ +
                   " at once; the ones made from now on stay unmanaged");
      return false;
    }
    RegionId id = 0;
    if (manager_ != nullptr) {
      auto r = manager_->register_region(reinterpret_cast<void*>(begin), end - begin, cls);
      if (!r) {
        if (!warned_register_) {
          warned_register_ = true;
          log_->warn(std::string(what_) + ": " + format_size(end - begin) + " stay unmanaged: " + r.message());
        }
        return false;
      }
      id = *r;
    }
    free_slot->id = id;
    free_slot->cls = cls;
    free_slot->owner = owner;
    free_slot->begin.store(begin, std::memory_order_relaxed);
    free_slot->end.store(end, std::memory_order_release);
    const auto index = static_cast<std::size_t>(free_slot - slots_.data()) + 1;
    if (index > used_.load(std::memory_order_relaxed)) used_.store(index, std::memory_order_release);
    return true;
  } catch (...) {
    return false;  // out of memory while building a message or registering: stays unmanaged
  }
}

void PieceTable::clear(Slot& s) noexcept {
  if (manager_ != nullptr && s.id != 0) {
    try {
      (void)manager_->unregister_region(s.id);  // only fails for an unknown id
    } catch (...) {
    }
  }
  s.end.store(0, std::memory_order_release);
  s.begin.store(0, std::memory_order_relaxed);
  s.id = 0;
  s.owner = 0;
}

PieceTable::Cut PieceTable::cut(std::uintptr_t begin, std::uintptr_t end) noexcept {
  Cut c;
  for (Slot& s : slots_) {
    const std::uintptr_t e = s.end.load(std::memory_order_relaxed);
    if (e == 0) continue;
    const std::uintptr_t b = s.begin.load(std::memory_order_relaxed);
    if (!(begin < e && b < end)) continue;
    try {
      c.push_back(Piece{b, e, s.id, s.cls, s.owner});
    } catch (...) {
      continue;  // out of memory: the piece stays tracked (and registered) rather than half-known
    }
    clear(s);
  }
  return c;
}

void PieceTable::after_unmap(const Cut& cut, std::uintptr_t begin, std::uintptr_t end, bool unmapped) noexcept {
  for (const Piece& p : cut) {
    if (!unmapped) {
      add(p.begin, p.end, p.cls, p.owner);
      continue;
    }
    if (p.begin < begin) add(p.begin, begin, p.cls, p.owner);
    if (end < p.end) add(end, p.end, p.cls, p.owner);
  }
}

void PieceTable::say_deferred_warnings() noexcept {
  if (!full_unsaid_.exchange(false, std::memory_order_relaxed) || warned_full_.exchange(true, std::memory_order_relaxed))
    return;
  log_->warn("more than " + std::to_string(kMaxPieces) + " pieces of " + what_ +
             " at once; the ones made from now on stay unmanaged");
}

void PieceTable::subtract(std::uintptr_t begin, std::uintptr_t end) noexcept {
  for (Slot& s : slots_) {
    const std::uintptr_t e = s.end.load(std::memory_order_relaxed);
    if (e == 0) continue;
    const std::uintptr_t b = s.begin.load(std::memory_order_relaxed);
    if (!(begin < e && b < end)) continue;
    const RegionClass cls = s.cls;
    const std::uint64_t owner = s.owner;
    clear(s);  // no manager: nothing to unregister
    // The slot just freed takes the first part left, so this never runs out of slots.
    if (b < begin) add_one(b, begin, cls, owner);
    if (end < e) add_one(end, e, cls, owner);
  }
}

void PieceTable::remove_owner(std::uint64_t owner) noexcept {
  for (Slot& s : slots_) {
    if (s.end.load(std::memory_order_relaxed) != 0 && s.owner == owner) clear(s);
  }
}

std::vector<PieceTable::Piece> PieceTable::pieces() const {
  std::vector<Piece> out;
  for (const Slot& s : slots_) {
    const std::uintptr_t e = s.end.load(std::memory_order_relaxed);
    if (e != 0) out.push_back(Piece{s.begin.load(std::memory_order_relaxed), e, s.id, s.cls, s.owner});
  }
  std::sort(out.begin(), out.end(), [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
  return out;
}

}  // namespace residency::preload
