// SPDX-License-Identifier: MIT
// Ledger: one machine-wide wired budget, shared by the processes that name it.
//
// Six MLX servers on one machine wired 464 of 512 GB with nothing coordinating them. The ledger
// is that coordination: a small file in shared memory (/dev/shm/residency-budget-NAME) holding
// the budget and a table of holders, each the bytes one manager has reserved. A manager reserves
// bytes here *before* it wires them and gives them back *after* it unwired them, so the sum of
// what every holder has wired never exceeds the budget, even for a moment.
//
// The one decision that shapes it: a full ledger is resolved by asking, not by polling. Each
// holder has a futex word in the ledger; a thread of the holder's process sleeps on it with no
// timeout (zero wake-ups while nobody asks). An asker that does not fit picks the holder idle
// longest among those of priority <= its own (last use >= kIdleBeforeAsked ago), writes its
// slot's word and FUTEX_WAKEs it; that process gives its memory back if it is really idle (as
// its keep-alive would have, early) and answers by bumping the ledger's generation word, on
// which the asker waits a bounded time.
//
// The lock is a robust, process-shared pthread mutex inside the ledger: uncontended it costs no
// system call, and when a holder dies inside it (SIGKILL, OOM kill) the next locker gets
// EOWNERDEAD and repairs. Repair is the same pass that runs on every lock: holders whose process
// is gone are dropped, identity being pid + start time (/proc/PID/stat field 22), so a reused pid
// is not mistaken for the dead holder. Every field a holder writes under the lock is one aligned
// word, and `used` is never stored (it is the sum of the table), so a holder killed mid-update
// leaves nothing to undo. (A kernel file lock, flock, would also be released on death, but costs
// a system call per lock and is not reliable on every /dev/shm of the platforms we compile for.)
//
// Ownership: created 0600 for its user, or 0660 for a named group, under a temporary name and
// link()ed into place, so nobody ever opens a half-written ledger. Opening checks owner, mode,
// size, magic and format version, and refuses anything else with a message. The last holder to
// leave (after reclaiming the dead) marks the ledger retired and unlinks it under the lock; a
// process that opened it just before finds it retired once it has the lock and opens afresh.
//
// Linux only (futexes, /proc); elsewhere attach() returns `unsupported` with a message.
// Processes that share a budget must share /dev/shm and a pid namespace.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "residency/clock.hpp"
#include "residency/shared_budget.hpp"
#include "residency/status.hpp"

namespace residency::ledger {

// Holders per ledger: a machine runs a handful of inference servers, each with a few models; 64
// is far above that and keeps the ledger in 5 pages.
inline constexpr std::uint32_t kMaxHolders = 64;
// The ledger's format; a ledger of another version is refused (the message names both).
inline constexpr std::uint32_t kFormatVersion = 1;
// A holder is asked only when its last use is at least this old: longer than any pause between two
// graph computes of a decoding engine (tens to hundreds of ms per token), so that a decoding
// process is never asked and two busy processes never take the budget from each other per token.
inline constexpr Nanos kIdleBeforeAsked = std::chrono::seconds(1);
// How long an asker waits for asked holders to give back before it wires what fits.
inline constexpr Nanos kAskWait = std::chrono::seconds(2);

// "/dev/shm/residency-budget-NAME".
std::string ledger_path(const std::string& name);

// Identity of a process: pid and start time (clock ticks after boot, /proc/PID/stat field 22).
// Returns 0 when the process does not exist or is a zombie (its memory is gone already).
std::uint64_t process_start_time(int pid);
// True when `pid` is alive and is the process that started at `start_time` (not a reuse).
bool holder_alive(int pid, std::uint64_t start_time);

struct AttachOptions {
  std::string name;
  std::uint64_t budget = 0;  // bytes; a ledger that exists keeps its own (the caller is told)
  std::string group;         // "": 0600; else 0660 for this group
  int priority = 0;
};

class Ledger {
 public:
  // Called on the ledger's thread when another process asks this holder to give back; it
  // releases what it can (with release()) and returns. `asker` is the asking process's pid.
  using OnAsked = std::function<void(int asker)>;

  // Opens or creates the ledger and claims a holder slot. Errors: invalid configuration (the
  // group), a ledger of another user or format version, a full holder table, a non-Linux system.
  static Result<std::unique_ptr<Ledger>> attach(const AttachOptions& options);
  // Gives back what is held, frees the slot, and removes the ledger if nobody else holds it.
  ~Ledger();
  Ledger(const Ledger&) = delete;
  Ledger& operator=(const Ledger&) = delete;

  // Starts the thread that answers asks (call once, after the holder can answer).
  void listen(OnAsked on_asked);
  // Stops that thread; on_asked is not called after this returns. Idempotent.
  void stop_listening();
  // At process exit, for a holder that is never destroyed (a preload leaks its manager on
  // purpose): frees the slot and removes the ledger if nobody else holds it, without joining the
  // thread (it is told to stop). Only when nothing is held (the caller unwired first). The
  // ledger stays mapped; held() is 0 and acquire() grants nothing afterwards.
  void detach_at_exit();

  const std::string& name() const { return name_; }
  const std::string& path() const { return path_; }
  std::uint64_t budget() const;
  std::uint64_t held() const { return held_; }
  // The budget the caller asked for, when the ledger existed with another one (else 0).
  std::uint64_t requested_budget() const { return requested_budget_; }

  // Reserves up to `bytes` more for this holder. When the ledger is full, asks idle holders to
  // give back and waits at most `wait` for them; then takes what is free (all of `bytes` unless
  // `partial`). Returns the bytes reserved.
  std::uint64_t acquire(std::uint64_t bytes, Nanos wait, bool partial);
  // Gives back `bytes` (at most what is held) and wakes waiting askers.
  void release(std::uint64_t bytes);

  // This holder's time of last use (CLOCK_MONOTONIC nanoseconds), written by the manager's
  // touch() directly, so that askers and `residency stat` read real idle times.
  std::atomic<std::int64_t>& last_use();

  std::uint64_t asks_sent() const { return asks_sent_.load(std::memory_order_relaxed); }
  std::uint64_t asks_answered() const { return asks_answered_.load(std::memory_order_relaxed); }
  // The thread answering asks (for tests that count its wake-ups); 0 before listen().
  int listener_tid() const { return listener_tid_.load(std::memory_order_relaxed); }

  struct Shared;  // the layout in shared memory (ledger.cpp)

 private:
  Ledger() = default;
  void listen_loop();

  std::string name_, path_;
  int fd_ = -1;
  Shared* shm_ = nullptr;
  std::uint32_t slot_ = 0;
  std::uint64_t held_ = 0;  // mirror of our slot's bytes; changed only by this object's owner
  std::uint64_t requested_budget_ = 0;
  int priority_ = 0;
  OnAsked on_asked_;
  std::thread listener_;
  std::atomic<bool> stopping_{false};
  bool detached_ = false;  // detach_at_exit() ran: the slot is not ours any more
  // The process that attached. A fork child inherits the mapping and this object but not the
  // slot: in any other process every method leaves the ledger alone (llama-server, Python and
  // shells fork, and a child that calls exit() would otherwise free its parent's slot).
  int owner_pid_ = 0;
  bool mine() const;
  std::atomic<int> listener_tid_{0};
  std::atomic<std::uint64_t> asks_sent_{0}, asks_answered_{0};
};

}  // namespace residency::ledger
