#include "gguf_mappings.hpp"

#include <string>

namespace residency::preload {

bool GgufMappings::overlaps(std::uintptr_t begin, std::uintptr_t end) const noexcept {
  for (const Slot& s : slots_) {
    const std::uintptr_t e = s.end.load(std::memory_order_acquire);
    if (e == 0) continue;
    const std::uintptr_t b = s.begin.load(std::memory_order_relaxed);
    if (begin < e && b < end) return true;
  }
  return false;
}

void GgufMappings::add(std::uintptr_t begin, std::uintptr_t end) noexcept {
  if (end <= begin) return;
  Slot* free_slot = nullptr;
  for (Slot& s : slots_) {
    if (s.end.load(std::memory_order_relaxed) == 0) {
      free_slot = &s;
      break;
    }
  }
  try {
    if (free_slot == nullptr) {
      if (!warned_full_) {
        warned_full_ = true;
        warn_("more than " + std::to_string(kMaxPieces) +
              " pieces of GGUF mappings at once; the mappings made from now on stay unmanaged");
      }
      return;
    }
    auto id = manager_.register_region(reinterpret_cast<void*>(begin), end - begin, RegionClass::weights);
    if (!id) {
      if (!warned_register_) {
        warned_register_ = true;
        warn_("a GGUF mapping of " + format_size(end - begin) + " stays unmanaged: " + id.message());
      }
      return;
    }
    free_slot->id = *id;
    free_slot->begin.store(begin, std::memory_order_relaxed);
    free_slot->end.store(end, std::memory_order_release);
  } catch (...) {
    // Out of memory while building a message or registering: the mapping stays unmanaged.
  }
}

GgufMappings::Cut GgufMappings::cut(std::uintptr_t begin, std::uintptr_t end) noexcept {
  Cut c;
  for (Slot& s : slots_) {
    const std::uintptr_t e = s.end.load(std::memory_order_relaxed);
    if (e == 0) continue;
    const std::uintptr_t b = s.begin.load(std::memory_order_relaxed);
    if (!(begin < e && b < end)) continue;
    try {
      (void)manager_.unregister_region(s.id);  // only fails for an unknown id
    } catch (...) {
    }
    c.pieces[c.count++] = Piece{b, e, s.id};
    s.end.store(0, std::memory_order_release);
    s.begin.store(0, std::memory_order_relaxed);
    s.id = 0;
  }
  return c;
}

void GgufMappings::after_unmap(const Cut& cut, std::uintptr_t begin, std::uintptr_t end, bool unmapped) noexcept {
  for (std::size_t i = 0; i < cut.count; ++i) {
    const Piece& p = cut.pieces[i];
    if (!unmapped) {
      add(p.begin, p.end);
      continue;
    }
    if (p.begin < begin) add(p.begin, begin);
    if (end < p.end) add(end, p.end);
  }
}

std::size_t GgufMappings::pieces() const noexcept {
  std::size_t n = 0;
  for (const Slot& s : slots_) n += s.end.load(std::memory_order_relaxed) != 0 ? 1 : 0;
  return n;
}

}  // namespace residency::preload
