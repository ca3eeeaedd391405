// SPDX-License-Identifier: MIT
// Address ranges the preload tracks, in a table munmap can read without a lock: the regions it
// registered with its manager (a buffer's pieces), or the GGUF file mappings it has seen.
//
// An unmap that covers part of a tracked piece (llama.cpp unmaps the header pages and the tail of
// its model mapping once the tensors are loaded, and whole mappings when the model is freed)
// first unregisters the whole piece, while it is still mapped, and after the real munmap
// registers what is left of it (one or two pieces, same class and owner); when the munmap fails
// the piece is registered again whole. So a region never spans memory that is not mapped.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "residency/residency.hpp"
#include "session_log.hpp"

namespace residency::preload {

// The pieces live in a fixed table whose bounds are atomics, so that munmap can tell without a
// lock whether a range touches a tracked piece: the allocator of a thread that holds the
// manager's mutex may unmap its own memory, and must not wait for the session's lock (which is
// held while the manager is called). Changes are made with the session's lock held.
class PieceTable {
 public:
  // More pieces than this are left unmanaged (with one warning). A model whose weights were
  // mostly repacked leaves two small pieces of its file per layer (the norms) and a few buffers.
  static constexpr std::size_t kMaxPieces = 2048;

  struct Piece {
    std::uintptr_t begin = 0;
    std::uintptr_t end = 0;
    RegionId id = 0;  // 0 in a table without a manager
    RegionClass cls = RegionClass::weights;
    std::uint64_t owner = 0;  // what the piece belongs to (a buffer), for remove_owner()
  };
  using Cut = std::vector<Piece>;

  // With a manager, pieces are registered with it as regions; without one they are only ranges.
  // `log` must outlive the table.
  PieceTable(Manager* manager, const SessionLog& log, const char* what) : manager_(manager), log_(&log), what_(what) {}

  // Lock-free: whether [begin, end) overlaps a tracked piece.
  bool overlaps(std::uintptr_t begin, std::uintptr_t end) const noexcept;
  // Ranges this table never tracks (whole pages of them): the program's own locks, which the
  // preload must never unlock. Set once, before the first add().
  void exclude(const PieceTable* other) noexcept { exclude_ = other; }
  // With the lock held: tracks (registers) [begin, end), but for what is excluded. False when
  // nothing of it could be (one warning).
  bool add(std::uintptr_t begin, std::uintptr_t end, RegionClass cls, std::uint64_t owner) noexcept;
  // With the lock held, before the memory is unmapped: unregisters every piece that overlaps
  // [begin, end) and returns them.
  Cut cut(std::uintptr_t begin, std::uintptr_t end) noexcept;
  // With the lock held, after the unmap: tracks what is left of the cut pieces (all of them when
  // `unmapped` is false: the unmap failed and the memory is still there).
  void after_unmap(const Cut& cut, std::uintptr_t begin, std::uintptr_t end, bool unmapped) noexcept;
  // With the lock held: unregisters every piece of `owner`.
  void remove_owner(std::uint64_t owner) noexcept;
  // With the lock held: the pieces, sorted by address.
  std::vector<Piece> pieces() const;

 private:
  struct Slot {
    std::atomic<std::uintptr_t> begin{0};
    std::atomic<std::uintptr_t> end{0};  // 0: free
    RegionId id = 0;
    RegionClass cls = RegionClass::weights;
    std::uint64_t owner = 0;
  };
  void clear(Slot& s) noexcept;
  bool add_one(std::uintptr_t begin, std::uintptr_t end, RegionClass cls, std::uint64_t owner) noexcept;
  Manager* manager_;
  const SessionLog* log_;
  const char* what_;
  const PieceTable* exclude_ = nullptr;
  bool warned_full_ = false;
  bool warned_register_ = false;
  std::array<Slot, kMaxPieces> slots_{};
};

}  // namespace residency::preload
