// SPDX-License-Identifier: MIT
// The ledger's protocol (ledger.hpp, "Asking"): reserving and giving back, asking holders to give
// back when the budget is full, and whose turn it is to repay a debt over the budget.
#include "ledger.hpp"

#include "ledger_file.hpp"

#if RESIDENCY_LEDGER_LINUX

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <vector>

#include <unistd.h>

#include "ledger_lock.hpp"

namespace residency::ledger {

namespace {

constexpr Nanos kCancelPoll = std::chrono::milliseconds(50);  // the ask wait checks for cancellation this often
// A strict wait asks in rounds of at most this, and between two rounds sleeps at most kRoundPause
// (woken at once when anything is given back): a holder that declined inside a call is asked
// again soon after its call ends.
constexpr Nanos kRoundWait = std::chrono::milliseconds(500);
constexpr Nanos kRoundPause = std::chrono::milliseconds(10);

// Whether an ask could get anything back from the holder: it holds more than its floor.
bool askable(const Slot& sl) {
  return sl.bytes.load(std::memory_order_relaxed) > (std::uint64_t{sl.floor_mib.load(std::memory_order_relaxed)} << 20);
}

// Which holders the choice may fall on, besides holding more than their floor (askable()). The
// defaults leave none out: whose turn it is to repay a debt is decided among all the holders.
struct Candidates {
  std::uint32_t except = kMaxHolders;  // never this slot (an asker's own)
  int max_priority = INT32_MAX;        // only holders of this priority or a lower one (an asker's)
  // Only holders whose last use is at most this: the asker's `now - min_idle`, min_idle being
  // kIdleBeforeAsked for host memory (a decoding process is never asked) and kNoMinimumIdle for
  // device memory (any holder is asked, and one inside a call declines: ledger.hpp says why).
  std::int64_t idle_before = INT64_MAX;
  bool unasked_only = false;  // only holders with no ask in their word already
  std::uint64_t passed = 0;   // bit i: slot i was asked already in this wait, and is passed over
};
static_assert(kMaxHolders <= 64, "Candidates::passed has a bit per slot");

// The holder choice (docs/design.md, "The ledger protocol"), for asking and for repaying: among the
// occupied holders that hold more than their floor and are candidates, the one of the lowest
// priority, then the one idle longest (least recently used); the lowest slot on a tie. Returns
// kMaxHolders when there is none.
std::uint32_t choose_holder(const Shared& s, const Candidates& c) {
  std::uint32_t best = kMaxHolders;
  for (std::uint32_t i = 0; i < kMaxHolders; ++i) {
    const Slot& sl = s.slots[i];
    if (i == c.except || !sl.occupied.load(std::memory_order_relaxed) || !askable(sl) ||
        (c.unasked_only && sl.ask.load(std::memory_order_relaxed) != 0) ||
        sl.priority.load(std::memory_order_relaxed) > c.max_priority ||
        sl.last_use.load(std::memory_order_relaxed) > c.idle_before || ((c.passed >> i) & 1) != 0)
      continue;
    if (best == kMaxHolders) {
      best = i;
      continue;
    }
    const Slot& b = s.slots[best];
    const int pa = sl.priority.load(std::memory_order_relaxed), pb = b.priority.load(std::memory_order_relaxed);
    if (pa < pb || (pa == pb && sl.last_use.load(std::memory_order_relaxed) < b.last_use.load(std::memory_order_relaxed)))
      best = i;
  }
  return best;
}

// The holder whose strict wait is oldest (the lowest ticket among the occupied slots), or
// kMaxHolders when nobody waits.
std::uint32_t head_waiter(const Shared& s) {
  std::uint32_t head = kMaxHolders;
  std::uint64_t lowest = UINT64_MAX;
  for (std::uint32_t i = 0; i < kMaxHolders; ++i) {
    const Slot& sl = s.slots[i];
    const std::uint64_t t = sl.wait_ticket.load(std::memory_order_relaxed);
    if (t == 0 || !sl.occupied.load(std::memory_order_relaxed) || t >= lowest) continue;
    lowest = t;
    head = i;
  }
  return head;
}

// Writes an ask into holder `i`'s word and wakes its listener (under the lock). Returns its id.
std::uint32_t ask_holder(Lock& lock, std::uint32_t i, int self, std::uint64_t self_start, std::int64_t deadline) {
  const Shared& s = lock.table();
  const Slot& v = s.slots[i];
  std::uint32_t id = s.ask_serial.load(std::memory_order_relaxed) + 1;
  if (id == 0 || id == kStopWord) id = 1;  // 0 means "nothing asked"
  lock.put(s.ask_serial, id);
  lock.put(v.asker_pid, std::int32_t{self});
  lock.put(v.asker_start, self_start);
  lock.put(v.ask_deadline, deadline);
  lock.put(v.ask, id);  // last: the listener reads the rest under the lock once woken
  futex_wake(lock.mapped(v.ask), 1);
  return id;
}

}  // namespace

// Asks the other holders, one at a time, until `done` (run under the lock, on a sound ledger)
// says so, nobody is left to ask, or `wait` is over. The holder to ask: choose_holder() among those
// of priority <= ours, idle at least `min_idle` at `now`, not asked already.
// One inside a call declines (its answer clears the word at once) and the next is asked. The asks
// still in their holders' words are withdrawn before it returns. Returns 1 when done said so, 0
// when not, -1 when the ledger could not be used (problem() says why).
int Ledger::ask_until(const std::function<bool(Lock&)>& done, std::int64_t now, Nanos wait, Nanos min_idle, bool as_head) {
  if (detached_ || !mine()) return -1;
  if (broken_.load(std::memory_order_acquire)) {
    if (problem().empty())
      set_problem("its ledger " + path_ + " was found corrupt; this process wires nothing more under it");
    return -1;
  }
  if (removed_.load(std::memory_order_acquire)) return -1;  // problem() says so still
  const int self = ::getpid();
  const std::uint64_t self_start = self_start_;
  const std::int64_t deadline = monotonic_ns() + wait.count();
  struct Asked {
    std::uint32_t slot;
    std::uint32_t id;
  };
  std::vector<Asked> asked;
  // Under the lock: the asks still in their holders' words are withdrawn (this wait is over).
  auto withdraw = [&](Lock& lock) {
    for (const Asked& a : asked) {
      const Slot& sl = lock.table().slots[a.slot];
      if (sl.ask.load(std::memory_order_relaxed) == a.id) lock.put(sl.ask, std::uint32_t{0});
    }
    asked.clear();
  };
  for (bool first = true;; first = false) {
    std::uint32_t gen = 0;
    bool outstanding = false, asked_now = false;
    {
      Lock lock(fd_, local_, shm_, kUseLockWait);
      if (!begin_section(lock, Section::grant)) return -1;  // the asks expire at their deadline
      if (done(lock)) {
        withdraw(lock);
        return 1;
      }
      if (!first && (wait.count() <= 0 || monotonic_ns() >= deadline)) {
        withdraw(lock);
        return 0;
      }
      const Shared& s = lock.table();
      for (const Asked& a : asked)
        if (s.slots[a.slot].ask.load(std::memory_order_relaxed) == a.id) outstanding = true;
      // A strict wait behind an older one asks nobody: the head asks, and this one waits its turn.
      const bool behind = as_head && head_waiter(s) != slot_;
      if (!outstanding && wait.count() > 0 && !behind) {
        Candidates c;
        c.except = slot_;
        c.max_priority = priority_;
        c.idle_before = now - min_idle.count();
        c.unasked_only = true;
        for (const Asked& a : asked) c.passed |= std::uint64_t{1} << a.slot;
        const std::uint32_t best = choose_holder(s, c);
        if (best != kMaxHolders) {
          asked.push_back({best, ask_holder(lock, best, self, self_start, deadline)});
          asks_sent_.fetch_add(1, std::memory_order_relaxed);
          asked_now = true;
        }
      }
      if (!outstanding && !asked_now && !behind) {  // nobody left to ask
        withdraw(lock);
        return 0;
      }
      gen = s.generation.load(std::memory_order_relaxed);
    }
    // In slices, so that cancel_shared_budget_waits() (a signal to the process) ends it soon.
    const std::int64_t left = std::min<std::int64_t>(deadline - monotonic_ns(), kCancelPoll.count());
    if (g_joins_cancelled.load(std::memory_order_acquire)) wait = Nanos(0);  // the next pass is the last
    if (left > 0 && wait.count() > 0) {
      const timespec ts{static_cast<time_t>(left / 1'000'000'000), static_cast<long>(left % 1'000'000'000)};
      futex_wait(shm_->generation, gen, &ts);  // the kernel compares: nothing of the mapping is loaded
    }
  }
}

std::uint64_t Ledger::acquire(std::uint64_t bytes, std::int64_t now, Nanos wait, bool partial, Nanos min_idle) {
  if (bytes == 0) return 0;
  std::uint64_t got = 0;
  auto take = [&](Lock& lock, std::uint64_t n) {
    const Slot& mine = lock.table().slots[slot_];
    lock.put(mine.bytes, mine.bytes.load(std::memory_order_relaxed) + n);
    held_.fetch_add(n, std::memory_order_relaxed);
    got = n;
  };
  // The whole of it once it fits; what is free if `partial`, without a wait or after it.
  auto fit = [&](Lock& lock, bool final) {
    const Shared& s = lock.table();
    if (head_waiter(s) != kMaxHolders) return false;  // strict waits come first, in order of arrival
    // (the sum after taking `bytes`: a holder that shares its key with a larger one adds nothing)
    if (used_bytes(s, slot_, bytes) <= s.budget) return take(lock, bytes), true;
    const std::uint64_t used = used_bytes(s), free = used < s.budget ? s.budget - used : 0;
    if (final && partial && free > 0) return take(lock, free), true;
    return false;
  };
  const int r = ask_until([&](Lock& lock) { return fit(lock, wait.count() <= 0); }, now, wait, min_idle);
  if (r != 0 || wait.count() <= 0) return got;
  return ask_until([&](Lock& lock) { return fit(lock, true); }, now, Nanos(0), min_idle) > 0 ? got : 0;
}

bool Ledger::set_ticket(bool waiting) {
  if (detached_ || !mine() || !usable()) return false;
  Lock lock(fd_, local_, shm_, kUseLockWait);
  if (!waiting) {  // withdrawn even where the ledger is in doubt: our own slot is ours to write
    if (found_broken(lock)) return false;
    if (lock.ok()) {
      lock.put(lock.table().slots[slot_].wait_ticket, std::uint64_t{0});
      bump(lock);  // the next in the queue looks again
      return true;
    }
    put_own(offsetof(Slot, wait_ticket), std::uint64_t{0});
    futex_wake(shm_->generation, INT32_MAX);
    return true;
  }
  if (!begin_section(lock, Section::grant)) return false;
  const Shared& s = lock.table();
  const std::uint64_t ticket = s.ticket_serial.load(std::memory_order_relaxed) + 1;
  lock.put(s.ticket_serial, ticket);
  lock.put(s.slots[slot_].wait_ticket, ticket);
  return true;
}

std::uint64_t Ledger::acquire_in_turn(std::uint64_t bytes, std::int64_t now, Nanos wait, Nanos min_idle) {
  if (bytes == 0 || !set_ticket(true)) return 0;
  struct Withdraw {
    Ledger& l;
    ~Withdraw() { (void)l.set_ticket(false); }
  } withdraw{*this};
  std::uint64_t got = 0;
  std::uint32_t gen = 0;  // the generation last seen under the lock (in the copy: never the mapping)
  // Ours once our ticket is the oldest and the room is free; the ticket goes in the same section.
  auto fit = [&](Lock& lock) {
    const Shared& s = lock.table();
    gen = s.generation.load(std::memory_order_relaxed);
    if (head_waiter(s) != slot_) return false;
    const std::uint64_t used = used_bytes(s), free = used < s.budget ? s.budget - used : 0;
    if (free < bytes) return false;
    const Slot& mine = s.slots[slot_];
    lock.put(mine.bytes, mine.bytes.load(std::memory_order_relaxed) + bytes);
    held_.fetch_add(bytes, std::memory_order_relaxed);
    got = bytes;
    return true;
  };
  const std::int64_t start = monotonic_ns(), deadline = start + wait.count();
  for (;;) {
    // Rounds: one asks every holder that may give way (or waits behind the head); a holder that
    // declined, inside a call, is asked again in the next round, after its call may have ended.
    const std::int64_t left = deadline - monotonic_ns();
    const int r = ask_until(fit, now + (monotonic_ns() - start),
                            Nanos(std::min<std::int64_t>(left, kRoundWait.count())), min_idle, /*as_head=*/true);
    if (r > 0) return got;
    // The ledger given up (corrupt, removed, this holder gone) ends the wait; its lock busy for
    // longer than kUseLockWait (another holder inside its section, a loaded machine) does not: the
    // wait is for room within `wait`, and the next round takes the lock again.
    if (r < 0 && (!usable() || detached_ || !mine())) return 0;
    if (monotonic_ns() >= deadline || g_joins_cancelled.load(std::memory_order_acquire)) return 0;
    const std::int64_t pause = std::min<std::int64_t>(deadline - monotonic_ns(), kRoundPause.count());
    if (pause > 0) {
      const timespec ts{0, static_cast<long>(pause)};
      futex_wait(shm_->generation, gen, &ts);
    }
  }
}

std::uint64_t Ledger::ask_to_free(std::uint64_t bytes, std::int64_t now, Nanos wait, Nanos min_idle, bool* asked) {
  const std::uint64_t asks_before = asks_sent_.load(std::memory_order_relaxed);
  struct Said {
    bool* asked;
    const std::atomic<std::uint64_t>& sent;
    std::uint64_t before;
    ~Said() {
      if (asked) *asked = sent.load(std::memory_order_relaxed) != before;
    }
  } said{asked, asks_sent_, asks_before};
  if (bytes == 0 || !shm_) return 0;
  std::uint64_t others_before = 0, others_now = 0;
  bool measured = false;
  auto others = [&](const Shared& s) { return used_bytes(s) - s.slots[slot_].bytes.load(std::memory_order_relaxed); };
  (void)ask_until(
      [&](Lock& lock) {
        others_now = others(lock.table());
        if (!measured) {
          measured = true;
          others_before = others_now;
        }
        return others_before - std::min(others_before, others_now) >= bytes;
      },
      now, wait, min_idle);
  return others_before - std::min(others_before, others_now);
}

std::uint64_t Ledger::take_over_budget(std::uint64_t bytes) {
  if (bytes == 0 || detached_ || !mine() || !usable()) return 0;
  Lock lock(fd_, local_, shm_, kUseLockWait);
  if (!begin_section(lock, Section::grant)) return 0;
  const Slot& mine = lock.table().slots[slot_];
  lock.put(mine.bytes, mine.bytes.load(std::memory_order_relaxed) + bytes);
  held_.fetch_add(bytes, std::memory_order_relaxed);
  return bytes;
}

std::uint64_t Ledger::over_budget() const {
  if (!shm_ || detached_ || !mine() || broken_.load(std::memory_order_acquire) || removed_.load(std::memory_order_acquire))
    return 0;
  // A copy, as `residency stat` reads it: a few kB, no lock.
  Shared copy;  // on the stack: read at every end of a device holder's call, no allocation
  if (::pread(fd_, static_cast<void*>(&copy), sizeof(Shared), 0) != static_cast<ssize_t>(sizeof(Shared)) ||
      !check_table(copy).empty())
    return 0;
  const std::uint64_t used = used_bytes(copy);
  return used > copy.budget ? used - copy.budget : 0;
}

std::string Ledger::others_holding() const {
  if (!shm_ || detached_ || !mine()) return {};
  Shared copy;
  if (::pread(fd_, static_cast<void*>(&copy), sizeof(Shared), 0) != static_cast<ssize_t>(sizeof(Shared)) ||
      !check_table(copy).empty())
    return {};
  std::string out;
  for (std::uint32_t i = 0; i < kMaxHolders; ++i) {
    const Slot& sl = copy.slots[i];
    if (i == slot_ || !sl.occupied.load(std::memory_order_relaxed) || sl.bytes.load(std::memory_order_relaxed) == 0)
      continue;
    char line[96];
    std::snprintf(line, sizeof line, "%spid %d holds %.1f MiB (priority %d)", out.empty() ? "" : ", ",
                  static_cast<int>(sl.pid.load(std::memory_order_relaxed)),
                  static_cast<double>(sl.bytes.load(std::memory_order_relaxed)) / (1024.0 * 1024.0),
                  static_cast<int>(sl.priority.load(std::memory_order_relaxed)));
    out += line;
  }
  return out;
}

bool Ledger::only_this_process_holds() const {
  if (!shm_ || detached_ || !mine()) return false;
  Shared copy;
  if (::pread(fd_, static_cast<void*>(&copy), sizeof(Shared), 0) != static_cast<ssize_t>(sizeof(Shared)) ||
      !check_table(copy).empty())
    return false;
  const int self = ::getpid();
  for (const Slot& sl : copy.slots)
    if (sl.occupied.load(std::memory_order_relaxed) && askable(sl) && sl.pid.load(std::memory_order_relaxed) != self)
      return false;
  return true;
}

bool Ledger::repay_turn() {
  if (!shm_ || detached_ || !mine() || !usable()) return false;
  Lock lock(fd_, local_, shm_, kUseLockWait);
  if (!begin_section(lock, Section::repay)) return false;  // the next end of a call looks again
  const Shared& s = lock.table();
  if (used_bytes(s) <= s.budget) return false;
  const std::uint32_t turn = choose_holder(s, Candidates{});  // among all holders, this one included
  if (turn == slot_) return true;
  if (turn != kMaxHolders && s.slots[turn].ask.load(std::memory_order_relaxed) == 0) {
    (void)ask_holder(lock, turn, ::getpid(), self_start_, monotonic_ns() + kAskWait.count());
    asks_sent_.fetch_add(1, std::memory_order_relaxed);
  }
  return false;
}

void Ledger::set_floor(std::uint64_t bytes) {
  if (!shm_ || detached_ || !mine() || !usable()) return;
  const auto mib = static_cast<std::uint32_t>(std::min<std::uint64_t>(bytes >> 20, UINT32_MAX));
  Lock lock(fd_, local_, shm_, kUseLockWait);
  if (lock.corrupt() || !lock.ok() || !own_slot_sound(lock.table())) return;  // a hint: the next change writes it
  lock.put(lock.table().slots[slot_].floor_mib, mib);
}

void Ledger::set_shared_key(std::uint64_t key) {
  if (!shm_ || detached_ || !mine() || !usable()) return;
  Lock lock(fd_, local_, shm_, kUseLockWait);
  if (lock.corrupt() || !lock.ok() || !own_slot_sound(lock.table())) return;
  lock.put(lock.table().slots[slot_].shared_key, key);
  bump(lock);  // the sum may have fallen: waiters look again
}

void Ledger::release(std::uint64_t bytes) {
  bytes = std::min(bytes, held_.load(std::memory_order_relaxed));
  if (bytes == 0 || detached_ || !mine()) return;
  if (broken_.load(std::memory_order_acquire)) {  // only our own count; the ledger is not touched
    held_.fetch_sub(bytes, std::memory_order_relaxed);
    return;
  }
  {
    // Even if the lock could not be taken, our own slot is ours to write (once the file is known
    // to cover it).
    Lock lock(fd_, local_, shm_, kUseLockWait);
    if (found_broken(lock)) {
      held_.fetch_sub(bytes, std::memory_order_relaxed);
      return;
    }
    const std::uint64_t left = held_.load(std::memory_order_relaxed) - bytes;
    if (lock.ok()) {
      lock.put(lock.table().slots[slot_].bytes, left);
      held_.fetch_sub(bytes, std::memory_order_relaxed);
      bump(lock);
      return;
    }
    put_own(offsetof(Slot, bytes), left);
    held_.fetch_sub(bytes, std::memory_order_relaxed);
  }
  futex_wake(shm_->generation, INT32_MAX);
}

}  // namespace residency::ledger

#endif  // RESIDENCY_LEDGER_LINUX
