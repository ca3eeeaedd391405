// SPDX-License-Identifier: MIT
// ThreadCalls: the engine calls (Manager::begin_call() to end_call()) each thread holds open, per
// manager, so that a stray end_call() is told apart from the end of the thread's own call.
//
// The manager counts the calls in flight (KeepAliveState::calls()), and a count cannot tell a
// stray end on one thread from the end of a call in flight on another: under keep-alive 0 such an
// end released the memory while the call still read it. One engine call begins and ends on one
// thread (the preload's llama_decode hook, an engine's decode loop), so each thread keeps its own
// count: an end on a thread that holds no call of that manager open is stray, and ignored. A use
// scope is its own token (it may end on another thread) and does not go through here.
//
// Fixed slots of plain data: no allocation and no thread-exit destructor in a library that is
// loaded into someone else's program. A thread that holds calls of more than kSlots managers at
// once is not tracked for the extra ones: began() says so, and the manager counts them instead
// (its ends are then taken from that count, as before there was any tracking).
#pragma once

#include <cstdint>

namespace residency::core {

class ThreadCalls {
 public:
  // Managers whose calls one thread holds open at once: the preload's host manager and one per
  // GPU are the most that exist.
  static constexpr int kSlots = 16;

  // A call of manager `serial` (never 0) began on this thread. False: no slot is free (untracked).
  static bool began(std::uint64_t serial) noexcept {
    Slot* free_slot = nullptr;
    for (Slot& s : slots_) {
      if (s.serial == serial) {
        ++s.open;
        return true;
      }
      if (s.serial == 0 && free_slot == nullptr) free_slot = &s;
    }
    if (free_slot == nullptr) return false;
    *free_slot = Slot{serial, 1};
    return true;
  }
  // A call of manager `serial` ended on this thread: true when this thread held one open (and
  // now holds one fewer), false when it held none (a stray end, or an untracked call).
  static bool ended(std::uint64_t serial) noexcept {
    for (Slot& s : slots_) {
      if (s.serial != serial) continue;
      if (--s.open == 0) s.serial = 0;  // invariant: a slot with a serial holds at least one call
      return true;
    }
    return false;
  }

 private:
  struct Slot {
    std::uint64_t serial;  // 0: free
    int open;              // calls of that manager open on this thread, > 0 while serial != 0
  };
  static inline thread_local Slot slots_[kSlots] = {};
};

}  // namespace residency::core
