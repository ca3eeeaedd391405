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
  // Lock-free: f(b, e) for the part of each tracked piece inside [begin, end). A piece changed
  // meanwhile may be seen as it was: callers use this only to let go of memory early.
  template <class F>
  void for_each_overlap(std::uintptr_t begin, std::uintptr_t end, F&& f) const noexcept {
    const std::size_t used = used_.load(std::memory_order_acquire);
    for (std::size_t i = 0; i < used; ++i) {
      const Slot& s = slots_[i];
      const std::uintptr_t e = s.end.load(std::memory_order_acquire);
      if (e == 0) continue;
      const std::uintptr_t b = s.begin.load(std::memory_order_relaxed);
      if (begin < e && b < end) f(b > begin ? b : begin, e < end ? e : end);
    }
  }
  // For a table without a manager, from a hook (with the table's lock held): what it tracks of
  // [begin, end) is no longer tracked. Allocates nothing and logs nothing.
  void subtract(std::uintptr_t begin, std::uintptr_t end) noexcept;
  // A table a hook changes (without a manager) says that it is full later, from the session's
  // lock: a hook must not build a message (it may run inside the program's allocator).
  void defer_warnings() noexcept { defer_warnings_ = true; }
  void say_deferred_warnings() noexcept;
  // Ranges this table never tracks (whole pages of them): the program's own locks, which the
  // preload must never unlock. Set once, before the first add().
  void exclude(const PieceTable* other) noexcept { exclude_ = other; }
  // The bytes of [begin, end) that add() leaves out: whole pages of the excluded table's pieces.
  std::size_t excluded_bytes(std::uintptr_t begin, std::uintptr_t end) const noexcept;
  // For a table without a manager, set before the first add(): a range that touches or overlaps
  // a piece of the same owner and class grows that piece instead of taking a slot. The program's
  // locks need it: llama.cpp's mmap+mlock load mode locks its file mapping one tensor at a time
  // (llama_mlock::grow_to), more calls than kMaxPieces for a model of over 2048 tensors.
  void merge_touching() noexcept { merge_ = true; }
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
  bool defer_warnings_ = false;
  bool merge_ = false;
  std::atomic<bool> full_unsaid_{false};
  std::atomic<bool> warned_full_{false};
  bool warned_register_ = false;
  std::array<Slot, kMaxPieces> slots_{};
  // 1 + the highest slot ever used: lock-free readers look no further (a hook of every munmap asks).
  std::atomic<std::size_t> used_{0};
};

}  // namespace residency::preload
