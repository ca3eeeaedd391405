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
// holder's process sleeps on a futex word of its slot (zero wake-ups while nobody asks); an asker
// that does not fit wakes the holder idle longest, which gives its memory back if it is really
// idle (how an ask is made and answered: above class Ledger).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include <sys/types.h>

#include "platform/thread_annotations.hpp"
#include "residency/shared_budget.hpp"
#include "residency/status.hpp"

namespace residency::ledger {

class Lock;  // the ledger's lock and its copy of the table (ledger_lock.hpp)

// Holders per ledger: a machine runs a handful of inference servers, each with a few models; 64
// is far above that and keeps the ledger in 3 pages.
inline constexpr std::uint32_t kMaxHolders = 64;
// The ledger's format; a ledger of another version is refused (the message names both).
// 2: the lock is the file's (OFD), not a mutex in it; 3: strict waits queue in order of arrival.
inline constexpr std::uint32_t kFormatVersion = 3;
// A holder of host memory is asked only when its last use is at least this old: longer than any
// pause between two graph computes of a decoding engine (tens to hundreds of ms per token), so that
// a decoding process is never asked and two busy processes never take the budget from each other
// per token. Host memory that does not fit waits unwired, so waiting for this costs no budget.
// Device memory cannot wait (a decode reads it): there any holder not inside a call is asked,
// however short its idle, the least recently used first (docs/design.md, "The GPU budget"), since a
// minimum idle would only push the waker over the budget. kNoMinimumIdle says so.
inline constexpr std::chrono::nanoseconds kIdleBeforeAsked = std::chrono::seconds(1);
inline constexpr std::chrono::nanoseconds kNoMinimumIdle{0};
// How long an asker waits for asked holders to give back before it wires what fits.
inline constexpr std::chrono::nanoseconds kAskWait = std::chrono::seconds(2);
// How long attach() waits for the ledger's lock before it fails with a message naming the ledger
// and the process that holds the lock. Other waits for the lock are shorter (ledger_lock.hpp): a
// decode's acquire() gives up after milliseconds and the caller goes on unwired (problem()).
inline constexpr std::chrono::nanoseconds kJoinWait = std::chrono::seconds(3);

// "/dev/shm/residency-budget-NAME".
std::string ledger_path(const std::string& name);

// Identity of a process: pid and start time (clock ticks after boot, /proc/PID/stat field 22).
// Returns 0 when the process does not exist or is a zombie (its memory is gone already).
std::uint64_t process_start_time(int pid);
// True when `pid` is alive and is the process that started at `start_time` (not a reuse).
bool holder_alive(int pid, std::uint64_t start_time);
// The process that took the lock of the ledger at `path` last, as the ledger records it (0 when
// unlocked or unknown). A hint written by whoever locks, for messages about a lock held too long.
int lock_owner(const std::string& path);

struct AttachOptions {
  std::string name;
  std::uint64_t budget = 0;  // bytes; a ledger that exists keeps its own (the caller is told)
  std::string group;         // "": 0600; else 0660 for this group
  int priority = 0;
};

// Asking: each holder has a futex word in the ledger; a thread of the holder's process sleeps on
// it with no timeout (zero wake-ups while nobody asks). An asker that does not fit picks the holder idle
// longest among those of priority <= its own (last use >= kIdleBeforeAsked ago for host memory; any
// for device memory, one inside a call declining so that the next is asked), writes its
// slot's word and FUTEX_WAKEs it; that process gives its memory back if it is really idle (as
// its keep-alive would have, early) and answers by bumping the ledger's generation word, on
// which the asker waits a bounded time. An ask carries an id, the asker's identity and the end
// of its wait; it is answered only while all three hold (a holder stopped while asked, continued
// after the asker gave up or died, gives back to nobody), and the asker withdraws it when done.
//
// The lock is the kernel's: an exclusive OFD lock (fcntl F_OFD_SETLK) on the whole ledger file.
// The kernel drops it when its owner dies (SIGKILL, OOM kill), and nothing of it lives in the
// shared bytes (a process-shared mutex there would let any member write through the robust-list
// pointers of another member's process). The next locker repairs: holders whose process is gone
// are dropped, identity being pid + start time (/proc/PID/stat field 22), so a reused pid is not
// mistaken for the dead holder. Every field a holder writes under the lock is one aligned word,
// and `used` is never stored (it is the sum of the table), so a holder killed mid-update leaves
// nothing to undo. Every wait for the lock is bounded (kJoinWait to join, milliseconds on a
// decode's path): a holder stopped inside it (SIGSTOP, a paused container, a debugger) costs the
// others their share, never their progress.
//
// Trust: everyone who may write the file (its user; with a group, the group's members) may deny
// the others budget, never corrupt their processes. Nothing in the shared bytes is a lock or a
// pointer, and no instruction of this process loads or stores through the mapping: under the lock
// the ledger is read whole with pread() into a copy (a short read: corrupt) and validated before
// use (size, header, slots, pids, the sum of the reservations, this holder's own slot), and each
// change is one word written by the kernel (process_vm_writev into the mapping: EFAULT, never
// SIGBUS, when another member truncated the file, and the file's size never changes). The mapping
// serves the futex words, which the kernel compares and wakes (EFAULT again). A ledger that fails
// is an error with a message ("ledger PATH is corrupt: ..."); its holders keep what they have
// wired, wire nothing more under it, and never write or resize it again (their listener is
// stopped by a wake alone, no store; docs/design-notes.md).
//
// Ownership: created 0600 for its user, or 0660 for a named group, under a temporary name and
// link()ed into place, so nobody ever opens a half-written ledger. Opening checks owner, mode,
// size, magic and format version, and refuses anything else with a message. The last holder to
// leave (after reclaiming the dead) marks the ledger retired and unlinks it under the lock; a
// process that opened it just before finds it retired once it has the lock and opens afresh.
// A ledger removed from outside while held (rm, RemoveIPC) is noticed under the lock at the next
// reservation (the path no longer names our file): nothing more is taken under it, so that its
// holders and those of a new ledger at the path never each have the whole budget; and a holder
// unlinks the path only while it names its own file.
//
// Linux only (futexes, OFD locks, /proc); elsewhere attach() returns `unsupported` with a message.
// Processes that share a budget must share /dev/shm and a pid namespace.
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
  std::uint64_t held() const { return held_.load(std::memory_order_relaxed); }
  // The budget the caller asked for, when the ledger existed with another one (else 0).
  std::uint64_t requested_budget() const { return requested_budget_; }

  // Reserves up to `bytes` more for this holder. When the ledger is full, asks idle holders to
  // give back and waits at most `wait` for them; then takes what is free (all of `bytes` unless
  // `partial`). Returns the bytes reserved. `now` is the caller's time at the call (nanoseconds, on
  // the clock whose last uses it publishes, a test's manual one included): a holder is asked only
  // if its last use is at least kIdleBeforeAsked before `now`. Bounds on waiting (for the lock, for
  // an answer, an ask's deadline that the asked process reads) are real time, CLOCK_MONOTONIC,
  // whatever the caller's clock.
  // `min_idle`: kIdleBeforeAsked for host memory, kNoMinimumIdle for device memory.
  std::uint64_t acquire(std::uint64_t bytes, std::int64_t now, std::chrono::nanoseconds wait, bool partial,
                        std::chrono::nanoseconds min_idle = kIdleBeforeAsked);
  // A strict wait for `bytes` more (device memory under RESIDENCY_BUDGET_WAIT): in order of
  // arrival across the ledger's processes. It takes a ticket; while another holder's ticket is
  // older, it waits (any acquire() of a holder without a ticket yields to the queue too); once its
  // ticket is the oldest it asks the holders (those inside a call decline, and are asked again
  // once their call has ended) and takes `bytes` as soon as they are free. Returns `bytes`, or 0
  // when `wait` passed first (the ticket is withdrawn either way), or the ledger could not be
  // used (problem() says why). `now`: as for acquire(), advanced by the real time waited.
  std::uint64_t acquire_in_turn(std::uint64_t bytes, std::int64_t now, std::chrono::nanoseconds wait,
                                std::chrono::nanoseconds min_idle);
  // Asks the other holders to give back until `bytes` of theirs were given back, nobody is left
  // to ask, or `wait` is over, whatever the budget says: for memory the device itself lacks (an
  // allocation that failed for want of GPU memory, though the budget had room). Returns the bytes
  // the others gave back meanwhile.
  // `asked`, when given, says whether any holder was asked (false: nobody holds anything this
  // holder may ask for).
  std::uint64_t ask_to_free(std::uint64_t bytes, std::int64_t now, std::chrono::nanoseconds wait,
                            std::chrono::nanoseconds min_idle, bool* asked = nullptr);
  // Reserves `bytes` more even past the budget: for memory that is in use whatever the ledger says
  // (a GPU's memory is awake while a decode needs it; it cannot wait unwired as host memory can).
  // The others then find the ledger full and ask. Returns the bytes reserved (0: the lock was not
  // obtained, or the ledger is corrupt; problem() says why).
  std::uint64_t take_over_budget(std::uint64_t bytes);
  // Gives back `bytes` (at most what is held) and wakes waiting askers.
  void release(std::uint64_t bytes);
  // How much of what this holder holds no ask can get back (a GPU context:
  // docs/design.md, "The GPU budget"): askers and the repayment of a debt pass a holder that holds
  // no more than this. Kept in MiB.
  void set_floor(std::uint64_t bytes);
  // What this holder's bytes are when they are the same memory as other holders' (the host tier:
  // the page cache of one model file, which every server of that file registers): holders of one
  // nonzero key count once in the sum, as the largest of them. 0 (the default): its own bytes.
  void set_shared_key(std::uint64_t key);
  // The debt of a wake over the budget (docs/design.md, "The GPU budget"): how far the holders' sum
  // exceeds the budget now, read from a copy of the ledger (pread: no lock, nothing of the mapping
  // touched), so that a holder may look at every end of a call. 0 when within it, or unreadable.
  std::uint64_t over_budget() const;
  // Who holds the budget now, for a message: "pid 123 holds 12.0 GiB (priority 0), pid 456 ...",
  // this holder left out; read from a copy (pread: no lock). Empty when nobody else holds any.
  std::string others_holding() const;
  // True when no other process holds anything an ask could get back (this process's other holders
  // may): a strict wait then never waits long for itself.
  bool only_this_process_holds() const;
  // Whose turn it is to repay the debt, decided under the lock: the holder of bytes of the lowest
  // priority, least recently used first. True when it is this holder (the caller sleeps); else
  // that holder is asked, without waiting for its answer (it sleeps unless it is inside a call,
  // and the next end of a call looks again), and false is returned. False also when the sum fits.
  bool repay_turn();
  // Why the last acquire() granted nothing for a reason other than a full budget (the lock was
  // not obtained within its bound, or the ledger is corrupt); empty when it took the lock.
  std::string problem() const;
  // False once the ledger is not used again by this process: found corrupt, or removed from
  // /dev/shm while held (problem() says which); acquire() grants nothing from then on.
  bool usable() const;

  // Records this holder's time of last use (CLOCK_MONOTONIC nanoseconds) in its slot, so that
  // askers and `residency stat` read real idle times; called by the manager's touch() at most once
  // per coarse clock tick. The word is written by the kernel (process_vm_writev), not stored
  // through the mapping: the hot path takes no lock, and a store into a file another process
  // truncated would fault (SIGBUS).
  static void publish_last_use(void* ledger, std::int64_t last_use) noexcept;

  std::uint64_t asks_sent() const { return asks_sent_.load(std::memory_order_relaxed); }

  struct Shared;  // the layout in shared memory (ledger_file.hpp)

 private:
  // What the listener thread and its stopper share. Owned by the thread too: a thread that could
  // not be woken (its ask word's page is gone) is detached and, if it ever wakes, reads only this.
  struct ListenerState {
    std::atomic<bool> stopping{false};
    std::atomic<std::uint32_t> stop_word{0};  // futex word (private): a listener of a broken ledger sleeps on it
    std::atomic<std::uint32_t> done{0};       // futex word (private): 1 once the thread returned
    std::atomic<bool> on_ask_word{false};     // it sleeps (or is about to) on its ask word
  };
  Ledger() = default;
  void listen_loop(ListenerState& st);
  // `as_head`: ask only while this holder's ticket is the oldest (a strict wait).
  int ask_until(const std::function<bool(Lock&)>& done, std::int64_t now, std::chrono::nanoseconds wait,
                std::chrono::nanoseconds min_idle, bool as_head = false);
  bool set_ticket(bool waiting);
  void leave() RESIDENCY_EXCLUDES(local_);
  bool tell_listener_to_stop();
  void end_listener();
  bool covers_mapping() const;
  bool own_slot_sound(const Shared& table) const;
  // The checks a section runs once it has taken the lock, each written once (ledger.cpp says what
  // each checks): begin_section() before reserving, asking or repaying; found_broken() before
  // writing only this holder's own slot (giving back, leaving, answering an ask).
  enum class Section { grant, repay };
  bool begin_section(Lock& lock, Section section) RESIDENCY_REQUIRES(local_);
  enum class OwnSlot { check, skip };
  bool found_broken(const Lock& lock, OwnSlot own_slot = OwnSlot::check) RESIDENCY_REQUIRES(local_);
  // A word of our own slot (`field`: its offset in a Slot), written by write_word() without the lock.
  template <typename T>
  void put_own(std::size_t field, T value) const;
  off_t own_offset(std::size_t field) const;
  std::uint64_t lock_not_obtained(const std::string& why);
  std::uint64_t corrupt(const std::string& what);
  std::uint64_t removed();

  std::string name_, path_;
  int fd_ = -1;
  Shared* shm_ = nullptr;
  std::uint32_t slot_ = 0;
  // Mirror of our slot's bytes; changed only by this object's owner, read by the listener too.
  std::atomic<std::uint64_t> held_{0};
  std::uint64_t requested_budget_ = 0;
  int priority_ = 0;
  OnAsked on_asked_;
  std::thread listener_;
  std::shared_ptr<ListenerState> listener_state_ = std::make_shared<ListenerState>();
  // Written by acquire(), which may run on two threads of the owner at once (one under the
  // manager's lock, one waiting for room without it).
  mutable Mutex problem_mu_;
  std::string problem_ RESIDENCY_GUARDED_BY(problem_mu_);
  void set_problem(std::string p);
  // The ledger failed a check (its size, its table, our slot): it is not touched again.
  std::atomic<bool> broken_{false};
  // The file at path_ is not ours any more (removed from outside): nothing more is taken under it.
  std::atomic<bool> removed_{false};
  std::uint64_t self_start_ = 0, budget_ = 0;
  // The lock is an OFD lock on fd_, shared by this object's threads: they take this one first.
  Mutex local_;
  bool detached_ = false;  // detach_at_exit() ran: the slot is not ours any more
  // The process that attached. A fork child inherits the mapping and this object but not the
  // slot: in any other process every method leaves the ledger alone (llama-server, Python and
  // shells fork, and a child that calls exit() would otherwise free its parent's slot).
  int owner_pid_ = 0;
  bool mine() const;
  std::atomic<std::uint64_t> asks_sent_{0};
};

}  // namespace residency::ledger
