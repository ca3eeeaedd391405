// SPDX-License-Identifier: MIT
// The ledger's lock (internal to src/ledger): an OFD lock on the whole file, the checked copy of
// the ledger it reads once taken, and the two things every section under it may do to the table
// whoever runs it (reclaim the dead, bump the generation).
//
// Why the kernel's lock and a copy: a lock in the shared bytes would let any member of the budget
// write through another member's robust-list pointers, and the kernel drops an OFD lock when its
// owner dies. Every wait for it is bounded, because a holder stopped inside it (SIGSTOP, a paused
// container, a debugger) must cost the others their share, never their progress. It is the
// innermost lock of docs/design.md, "The lock order".
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

#include "ledger_file.hpp"
#include "platform/thread_annotations.hpp"

#if RESIDENCY_LEDGER_LINUX

namespace residency::ledger {

// Set by cancel_shared_budget_waits(): every wait of this process for a ledger ends at once (the
// process is ending). Sticky.
extern std::atomic<bool> g_joins_cancelled;
// How long each kind of wait for the lock may last. The lock is held for microseconds; a longer
// wait means its owner is stopped, paused or hostile.
inline constexpr Nanos kUseLockWait = std::chrono::milliseconds(10);  // acquire, release, answering: a decode may be waiting
inline constexpr Nanos kLeaveLockWait = std::chrono::milliseconds(300);  // destruction and exit
// The listener (a thread of its own, nobody waits on it): the asker holds the lock while it wakes
// it, so a decode's 10 ms would make it decline asks whenever the ledger is busy.
inline constexpr Nanos kAnswerLockWait = std::chrono::milliseconds(300);

// The ledger's lock: an exclusive OFD lock (fcntl F_OFD_SETLK) on the whole file, owned by the
// kernel. Nothing of it lives in the shared bytes, so a member that scribbles on the ledger can
// make a holder's view of the table wrong, never its process; and the kernel drops it when the
// owner dies (the last descriptor of the open file description closes). An OFD lock belongs to
// the open file description, which the threads of this Ledger share: `local` orders them first.
// Every wait is bounded (a holder that is SIGSTOPped, paused by a container runtime or a
// debugger inside the lock, or hostile, must not stall another process): the lock is polled
// with a short backoff until `bound` has passed, and then not taken, with the reason in why().
//
// Taken, it holds a copy of the ledger read with pread (table()), checked whole, and every change
// is one word written by write_word() (put()): no load or store of this process's instructions
// ever goes through the mapping, which serves the kernel only (futex words, write_word's target).
// Another member may truncate the file at any moment: a read then comes back short (corrupt,
// never a fault), a write fails with EFAULT, and the next check finds the ledger corrupt
// (docs/design-notes.md, "a ledger's bytes are never touched through its mapping").
class RESIDENCY_SCOPED_CAPABILITY Lock {
 public:
  Lock(int fd, Mutex& local, Shared* s, Nanos bound, bool cancellable = false) RESIDENCY_ACQUIRE(local);
  ~Lock() RESIDENCY_RELEASE() { unlock(); }
  void unlock() RESIDENCY_RELEASE();
  Lock(const Lock&) = delete;
  Lock& operator=(const Lock&) = delete;
  // Taken, and the ledger's size and table are sound: table() and put() may be used until unlock().
  bool ok() const { return ok_; }
  // Not taken because the ledger is corrupt (why() says what); never becomes usable again.
  bool corrupt() const { return corrupt_; }
  // Why the lock was not taken (empty when it was).
  const std::string& why() const { return why_; }
  // The ledger as read when the lock was taken, with this holder's writes since (ok() only). The
  // words other holders write without the lock (their last use) may be a little old.
  const Shared& table() const { return table_; }
  // Writes `field` (a word of table()) to the ledger (write_word), and to table(). A write that
  // fails (the file was cut short meanwhile) is found by the next check.
  template <typename T>
  void put(const std::atomic<T>& field, T value) {
    const auto at = reinterpret_cast<const char*>(&field) - reinterpret_cast<const char*>(&table_);
    (void)write_word(fd_, s_, static_cast<std::size_t>(at), &value, sizeof value);
    const_cast<std::atomic<T>&>(field).store(value, std::memory_order_relaxed);
  }
  // The address of `field` (a word of table()) in the mapping: for the futex calls only, which the
  // kernel answers with EFAULT, never a fault, when the page is gone.
  std::atomic<std::uint32_t>& mapped(const std::atomic<std::uint32_t>& field) const {
    const auto at = reinterpret_cast<const char*>(&field) - reinterpret_cast<const char*>(&table_);
    return *reinterpret_cast<std::atomic<std::uint32_t>*>(reinterpret_cast<char*>(s_) + at);
  }

 private:
  void take(Nanos bound, bool cancellable);
  void release_file_lock();
  // "by process N" when the ledger names the locker (read with pread: only the lock owner may
  // touch the mapping, and the word is a hint, written by whoever took the lock last).
  std::string holder_text() const;

  int fd_;
  std::unique_lock<std::mutex> local_;  // Ledger::local_, held from take() until unlock()
  Shared* s_;
  bool ok_ = false, corrupt_ = false;
  std::string why_;
  Shared table_;
};

// With the lock held: bumps the generation word and wakes whoever waits on it.
void bump(Lock& lock);
// With the lock held: drops every holder whose process is gone. Returns the bytes reclaimed.
std::uint64_t reclaim(Lock& lock, int self_pid, std::uint64_t self_start);

}  // namespace residency::ledger

#endif  // RESIDENCY_LEDGER_LINUX
