// SPDX-License-Identifier: MIT
// The shared-memory ledger (ledger.hpp): a holder's life in it (attach, leave, detach at exit), and
// what this holder knows of the ledger's state (its own slot, corrupt, removed, the last problem).
// The file is ledger_file.cpp, its lock ledger_lock.cpp, reserving and asking ledger_protocol.cpp,
// answering asks ledger_listener.cpp, `residency stat`'s listing ledger_listing.cpp.
#include "ledger.hpp"

#include "ledger_file.hpp"

#if RESIDENCY_LEDGER_LINUX

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <thread>

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ledger_lock.hpp"

namespace residency::ledger {

namespace {

// Under the lock: claims the first free slot for this process. Returns it, or kMaxHolders when
// every slot is taken (nothing is written then).
std::uint32_t claim_slot(Lock& lock, int self, std::uint64_t self_start, int priority) {
  const Shared& t = lock.table();
  std::uint32_t slot = kMaxHolders;
  for (std::uint32_t i = 0; i < kMaxHolders; ++i)
    if (!t.slots[i].occupied.load(std::memory_order_relaxed)) {
      slot = i;
      break;
    }
  if (slot == kMaxHolders) return slot;
  const Slot& sl = t.slots[slot];
  lock.put(sl.ask, std::uint32_t{0});
  lock.put(sl.pid, std::int32_t{self});
  lock.put(sl.start_time, self_start);
  lock.put(sl.priority, std::int32_t{priority});
  lock.put(sl.bytes, std::uint64_t{0});
  lock.put(sl.last_use, std::int64_t{0});
  lock.put(sl.floor_mib, std::uint32_t{0});
  lock.put(sl.wait_ticket, std::uint64_t{0});
  lock.put(sl.occupied, std::uint32_t{1});  // last: the slot is whole when it counts
  return slot;
}

}  // namespace

Result<std::unique_ptr<Ledger>> Ledger::attach(const AttachOptions& o) {
  const std::string path = ledger_path(o.name);
  long group = -1;
  if (!o.group.empty()) {
    auto g = group_id(o.group);
    if (!g) return g.status();
    group = static_cast<long>(*g);
  }
  const int self = ::getpid();
  const std::uint64_t self_start = process_start_time(self);
  if (self_start == 0)
    return Status(ErrorCode::io_error, "shared budget: cannot read this process's start time from /proc/" +
                                           std::to_string(self) + "/stat (is /proc mounted?)");
  // Each retry means another process created or retired the ledger just now. Two processes that
  // join and leave in turn can meet that way many times in a row, so the retries are bounded by
  // the join's time (kJoinWait), not a count, and each waits a little longer (their timing parts).
  const auto give_up = std::chrono::steady_clock::now() + kJoinWait;
  int attempt = 0;
  for (;; ++attempt) {
    if (attempt > 0) {
      if (std::chrono::steady_clock::now() >= give_up || g_joins_cancelled.load(std::memory_order_acquire)) break;
      std::this_thread::sleep_for(std::chrono::microseconds(10 * std::min(attempt, 100)));
    }
    auto opened = open_ledger(path, o.name, o.budget, group, o.group);
    if (!opened) return opened.status();
    if (*opened < 0) continue;  // another process linked its ledger first: open that one
    const int fd = *opened;
    Shared* s = map_ledger(fd);
    if (!s) {
      const int e = errno;
      ::close(fd);
      return Status(ErrorCode::io_error, "cannot map " + path + ": " + errno_text(e));
    }
    std::unique_ptr<Ledger> l(new Ledger);
    l->name_ = o.name;
    l->path_ = path;
    l->fd_ = fd;
    l->shm_ = s;
    l->priority_ = o.priority;
    l->owner_pid_ = self;
    {
      Lock lock(fd, l->local_, s, kJoinWait, /*cancellable=*/true);
      if (lock.corrupt()) {
        l->shm_ = nullptr;
        ::munmap(s, sizeof(Shared));
        return Status(ErrorCode::invalid_argument,
                      "the shared budget ledger " + path + " is corrupt: " + lock.why() +
                          "; its holders keep their memory but cannot share it: remove the "
                          "file (or use another budget name)");
      }
      if (!lock.ok()) {
        l->shm_ = nullptr;  // nothing of ours is in it
        ::munmap(s, sizeof(Shared));
        return Status(ErrorCode::io_error, "cannot join the shared budget " + o.name + ": the lock of its ledger " +
                                               path + " was not obtained: " + lock.why());
      }
      const Shared& t = lock.table();
      if (t.retired.load(std::memory_order_relaxed)) {
        // Its last holder removed it after we opened it: open (or create) the one in place now.
        // Unlocked before the unmap (unlocking writes the locker word in the mapping).
        lock.unlock();
        l->shm_ = nullptr;
        ::munmap(s, sizeof(Shared));
        continue;
      }
      reclaim(lock, self, self_start);
      const std::uint32_t slot = claim_slot(lock, self, self_start, o.priority);
      if (slot == kMaxHolders) {
        lock.unlock();
        l->shm_ = nullptr;
        ::munmap(s, sizeof(Shared));
        return Status(ErrorCode::limit_exceeded,
                      "the shared budget " + o.name + " has " + std::to_string(kMaxHolders) +
                          " holders already (the most a ledger keeps); use another budget name");
      }
      l->slot_ = slot;
      l->self_start_ = self_start;
      l->budget_ = t.budget;
      if (t.budget != o.budget) l->requested_budget_ = o.budget;
    }
    return l;
  }
  return Status(ErrorCode::io_error, "could not open the shared budget ledger " + path + " after " +
                                         std::to_string(attempt) + " tries in " +
                                         std::to_string(kJoinWait.count() / 1'000'000) +
                                         " ms (other processes keep creating and removing it)");
}

bool Ledger::mine() const { return ::getpid() == owner_pid_; }

// Frees our slot, reclaims the dead, and retires + unlinks the ledger when no holder is left
// (under the lock, so that an opener waiting for it sees `retired`).
void Ledger::leave() {
  if (broken_.load(std::memory_order_acquire)) return;  // nothing of a corrupt ledger is touched
  const int self = ::getpid();
  // Bounded: a lock stopped elsewhere costs this process its exit time, at most this long. Not
  // obtained, our slot is still ours to clear; reclaiming the dead and retiring wait for the next.
  Lock lock(fd_, local_, shm_, kLeaveLockWait, /*cancellable=*/true);
  if (found_broken(lock)) return;
  if (!lock.ok()) {  // our own words (no copy was read); the next locker sees the slot free
    put_own(offsetof(Slot, bytes), std::uint64_t{0});
    put_own(offsetof(Slot, ask), std::uint32_t{0});
    put_own(offsetof(Slot, occupied), std::uint32_t{0});
    futex_wake(shm_->generation, INT32_MAX);
    return;
  }
  const Shared& t = lock.table();
  const Slot& sl = t.slots[slot_];
  lock.put(sl.bytes, std::uint64_t{0});
  lock.put(sl.ask, std::uint32_t{0});
  lock.put(sl.occupied, std::uint32_t{0});
  reclaim(lock, self, self_start_);
  bool anyone = false;
  for (const Slot& o : t.slots) anyone = anyone || o.occupied.load(std::memory_order_relaxed) != 0;
  if (!anyone) {
    lock.put(t.retired, std::uint32_t{1});
    if (path_is_ours(fd_, path_)) ::unlink(path_.c_str());
  }
  bump(lock);
}

template <typename T>
void Ledger::put_own(std::size_t field, T value) const {
  (void)write_word(fd_, shm_, static_cast<std::size_t>(own_offset(field)), &value, sizeof value);
}
// The words of a slot its holder writes without the lock (ledger_protocol.cpp's release() too).
template void Ledger::put_own(std::size_t, std::uint64_t) const;
template void Ledger::put_own(std::size_t, std::uint32_t) const;
template void Ledger::put_own(std::size_t, std::int64_t) const;

bool Ledger::covers_mapping() const {
  struct stat st {};
  return ::fstat(fd_, &st) == 0 && st.st_size == static_cast<off_t>(sizeof(Shared));
}

// Under the lock (`t` is its copy): our slot still names us and what we hold (only we write it).
bool Ledger::own_slot_sound(const Shared& t) const {
  const Slot& sl = t.slots[slot_];
  return sl.occupied.load(std::memory_order_relaxed) == 1 && sl.pid.load(std::memory_order_relaxed) == owner_pid_ &&
         sl.start_time.load(std::memory_order_relaxed) == self_start_ &&
         sl.bytes.load(std::memory_order_relaxed) == held_.load(std::memory_order_relaxed);
}

// The preamble of a section that reserves, asks or repays, run as soon as `lock` was taken.
// Returns whether the section may go on: the lock was obtained on a sound ledger and our slot
// still names us and what we hold. A ledger found corrupt, or our slot overwritten, is not used
// again (corrupt()). Then the slots of dead holders are reclaimed. Section::grant (acquire,
// ask_to_free, take_over_budget) also keeps problem() about why nothing was granted: a lock not
// obtained is recorded (lock_not_obtained()), a path that no longer names our file ends the
// ledger's use (removed(): taking more under a removed file would split the budget), and a section
// that goes on clears the record. Section::repay (repay_turn(), at every end of a call) records
// nothing for a lock not obtained (the next end of a call looks again), and neither checks the
// path nor clears problem().
bool Ledger::begin_section(Lock& lock, Section section) {
  const bool grant = section == Section::grant;
  if (lock.corrupt()) return corrupt(lock.why()), false;
  if (!lock.ok()) {
    if (grant) lock_not_obtained(lock.why());
    return false;
  }
  if (!own_slot_sound(lock.table()))
    return corrupt("the slot of this process (" + std::to_string(slot_) + ") was overwritten"), false;
  if (grant) {
    if (!path_is_ours(fd_, path_)) return removed(), false;
    set_problem({});
  }
  reclaim(lock, ::getpid(), self_start_);
  return true;
}

// The check of a section that writes only this holder's own slot (release(), leave(), the
// listener's answer). True when the ledger must be given up, and then marks it broken (nothing of
// it is touched again): the lock found it corrupt; or was not obtained, and the file no longer
// covers our mapping; or was obtained, and our slot no longer names us or what we hold
// (OwnSlot::skip leaves this last check out: the listener's clearing of an ask it answered, as it
// always has). A lock not obtained on a file of the right size is no failure: our own slot is ours
// to write without it (put_own()).
bool Ledger::found_broken(const Lock& lock, OwnSlot own_slot) {
  if (lock.corrupt() || (!lock.ok() && !covers_mapping()) ||
      (own_slot == OwnSlot::check && lock.ok() && !own_slot_sound(lock.table()))) {
    broken_.store(true, std::memory_order_release);
    return true;
  }
  return false;
}

// The reason a lock taken for this holder cannot be used, recorded for problem(); the ledger is
// not used again.
std::uint64_t Ledger::corrupt(const std::string& what) {
  broken_.store(true, std::memory_order_release);
  set_problem("its ledger " + path_ + " is corrupt: " + what +
              "; this process wires nothing more under it (remove the file " + "once its holders are gone)");
  return 0;
}

void Ledger::set_problem(std::string p) {
  MutexLock g(problem_mu_);
  problem_ = std::move(p);
}

std::string Ledger::problem() const {
  MutexLock g(problem_mu_);
  return problem_;
}

// Our file is not the ledger at our path any more: removed from outside (rm, systemd-logind's
// RemoveIPC=yes, a cleanup script), and the processes that join now share a new one. Taking more
// under the old one would split the budget (the old file's holders and the new one's would each
// have all of it), so nothing more is taken; what is held stays held until it is given back.
std::uint64_t Ledger::removed() {
  removed_.store(true, std::memory_order_release);
  set_problem(
      "its ledger " + path_ +
      " was removed while this process held it (rm, systemd-logind's RemoveIPC=yes, a "
      "cleanup script), and the processes that join the budget now share a new one; so as not to split the budget "
      "this process wires nothing more under it (restart it to share the budget again)");
  return 0;
}

bool Ledger::usable() const {
  return !broken_.load(std::memory_order_acquire) && !removed_.load(std::memory_order_acquire);
}

std::uint64_t Ledger::lock_not_obtained(const std::string& why) {
  set_problem("the lock of its ledger " + path_ + " was not obtained at once: " + why);
  return 0;
}

Ledger::~Ledger() {
  if (!mine()) {
    // A fork child: the listener thread is the parent's (it does not run here) and the slot too.
    if (listener_.joinable()) listener_.detach();
    if (shm_) ::munmap(shm_, sizeof(Shared));
    if (fd_ >= 0) ::close(fd_);
    return;
  }
  stop_listening();
  if (!shm_) {  // attach() gave up on this ledger before claiming a slot
    if (fd_ >= 0) ::close(fd_);
    return;
  }
  if (!detached_) leave();
  ::munmap(shm_, sizeof(Shared));
  ::close(fd_);
}

void Ledger::detach_at_exit() {
  if (!shm_ || detached_ || held_.load() != 0 || !mine()) return;
  // The listener returns at once now: joined, so that nothing of ours runs past exit (and no
  // thread is left unjoined for a sanitizer to report).
  end_listener();
  detached_ = true;
  leave();
}

std::uint64_t Ledger::budget() const { return budget_; }

void Ledger::publish_last_use(void* ledger, std::int64_t last_use) noexcept {
  auto* l = static_cast<Ledger*>(ledger);
  if (!l->shm_ || l->detached_ || l->broken_.load(std::memory_order_relaxed) || !l->mine()) return;
  // Failing (a file cut short or gone) costs nothing but the idle time others see.
  l->put_own(offsetof(Slot, last_use), last_use);
}

off_t Ledger::own_offset(std::size_t field) const {
  return static_cast<off_t>(offsetof(Shared, slots) + slot_ * sizeof(Slot) + field);
}

}  // namespace residency::ledger

#endif  // RESIDENCY_LEDGER_LINUX
