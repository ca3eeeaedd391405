// The GGUF file mappings of the process, as regions of its manager.
//
// A mapping becomes one weights region. An unmap that covers part of a tracked piece (llama.cpp
// unmaps the header pages and the tail of its model mapping once the tensors are loaded) first
// unregisters the whole piece, while it is still mapped, and after the real munmap registers what
// is left of it (one or two pieces); when the munmap fails the piece is registered again whole.
//
// The pieces live in a fixed table whose bounds are atomics, so that munmap can tell without a
// lock whether a range touches a tracked piece: the allocator of a thread that holds the
// manager's mutex may unmap its own memory, and must not wait for the preload's lock (which is
// held while the manager is called). Changes are made with the preload's lock held.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "residency/residency.hpp"

namespace residency::preload {

class GgufMappings {
 public:
  // More pieces than this are left unmanaged (with one warning): llama.cpp makes one mapping
  // per model file and splits it at most in three.
  static constexpr std::size_t kMaxPieces = 64;

  struct Piece {
    std::uintptr_t begin = 0;
    std::uintptr_t end = 0;
    RegionId id = 0;
  };
  struct Cut {
    std::array<Piece, kMaxPieces> pieces{};
    std::size_t count = 0;
  };
  using Warn = void (*)(const std::string& message);

  GgufMappings(Manager& manager, Warn warn) : manager_(manager), warn_(warn) {}

  // Lock-free: whether [begin, end) overlaps a tracked piece.
  bool overlaps(std::uintptr_t begin, std::uintptr_t end) const noexcept;
  // With the lock held: registers [begin, end) as weights.
  void add(std::uintptr_t begin, std::uintptr_t end) noexcept;
  // With the lock held, before the memory is unmapped: unregisters every piece that overlaps
  // [begin, end) and returns them.
  Cut cut(std::uintptr_t begin, std::uintptr_t end) noexcept;
  // With the lock held, after the unmap: registers what is left of the cut pieces (all of them
  // when `unmapped` is false: the unmap failed and the memory is still there).
  void after_unmap(const Cut& cut, std::uintptr_t begin, std::uintptr_t end, bool unmapped) noexcept;

  std::size_t pieces() const noexcept;

 private:
  struct Slot {
    std::atomic<std::uintptr_t> begin{0};
    std::atomic<std::uintptr_t> end{0};  // 0: free
    RegionId id = 0;
  };
  Manager& manager_;
  Warn warn_;
  bool warned_full_ = false;
  bool warned_register_ = false;
  std::array<Slot, kMaxPieces> slots_{};
};

}  // namespace residency::preload
