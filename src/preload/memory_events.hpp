// SPDX-License-Identifier: MIT
// What the program's memory calls did to memory the session tracks, queued for the session.
//
// An allocator calls mmap, munmap and madvise while it holds its own lock (tcmalloc's page heap
// does), and the session allocates while it holds its lock (the manager's tables, the log, a
// snapshot's reading of /proc/self/maps). A hook of such a call that waited for the session's lock
// would close a cycle: the program's thread holds the allocator's lock and waits for the session,
// the session's thread holds its lock and waits in malloc for the allocator. So those hooks never
// wait and never allocate: they push what happened here (a fixed ring, lock-free, no system call
// but one futex wake) and the session applies it under its lock, in order, at its next event or on
// its worker thread (docs/design.md, "The preload's memory hooks").
//
// A full ring loses events; lost() says so once, and the session then checks every tracked range
// against the process's mappings instead (nothing it holds can be stale after that).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

namespace residency::preload {

class MemoryEvents {
 public:
  enum class Kind : std::uint8_t {
    gone,                 // [begin, end) no longer holds what it held: unmapped, taken back, or mapped anew
    engine_mapped,        // the engine made [begin, end) inside its call (a mapping, or heap it grew)
    program_locked,       // the program locked [begin, end) itself (mlock, mlock2)
    program_locks_all,    // mlockall(begin) succeeded: the program locks all its memory itself
    program_needs_limit,  // a lock of the program's failed on the limit the session held part of
  };
  struct Event {
    Kind kind = Kind::gone;
    std::uintptr_t begin = 0;
    std::uintptr_t end = 0;
  };
  // Events a burst of the program's calls can leave before the session applies them: one per
  // call on tracked memory (untracked memory queues nothing), applied microseconds later.
  static constexpr std::size_t kCapacity = 4096;

  MemoryEvents() noexcept {
    for (std::size_t i = 0; i < kCapacity; ++i) cells_[i].seq.store(i, std::memory_order_relaxed);
  }
  MemoryEvents(const MemoryEvents&) = delete;
  MemoryEvents& operator=(const MemoryEvents&) = delete;

  // From any thread, lock-free (a bounded multi-producer queue after D. Vyukov's): false when the
  // ring is full, and the event is counted as lost.
  bool push(Event e) noexcept {
    std::size_t pos = head_.load(std::memory_order_relaxed);
    for (;;) {
      Cell& c = cells_[pos % kCapacity];
      const std::size_t seq = c.seq.load(std::memory_order_acquire);
      const auto diff = static_cast<std::intptr_t>(seq) - static_cast<std::intptr_t>(pos);
      if (diff == 0) {
        if (head_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
          c.event = e;
          c.seq.store(pos + 1, std::memory_order_release);
          return true;
        }
      } else if (diff < 0) {
        lost_.store(true, std::memory_order_release);
        return false;
      } else {
        pos = head_.load(std::memory_order_relaxed);
      }
    }
  }
  // One consumer at a time (the session's lock): the oldest event, false when none is complete.
  bool pop(Event& out) noexcept {
    const std::size_t pos = tail_.load(std::memory_order_relaxed);
    Cell& c = cells_[pos % kCapacity];
    if (c.seq.load(std::memory_order_acquire) != pos + 1) return false;
    out = c.event;
    c.seq.store(pos + kCapacity, std::memory_order_release);
    tail_.store(pos + 1, std::memory_order_relaxed);
    return true;
  }
  bool empty() const noexcept {
    return head_.load(std::memory_order_acquire) == tail_.load(std::memory_order_acquire) &&
           !lost_.load(std::memory_order_acquire);
  }
  // Whether events were lost since the last call (and forgets it).
  bool take_lost() noexcept { return lost_.exchange(false, std::memory_order_acq_rel); }

 private:
  struct Cell {
    std::atomic<std::size_t> seq{0};
    Event event;
  };
  std::array<Cell, kCapacity> cells_;
  alignas(64) std::atomic<std::size_t> head_{0};
  alignas(64) std::atomic<std::size_t> tail_{0};
  std::atomic<bool> lost_{false};
};

}  // namespace residency::preload
