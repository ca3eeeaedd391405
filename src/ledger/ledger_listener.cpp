// SPDX-License-Identifier: MIT
// The ledger's listener (ledger.hpp, "Asking"): the thread of a holder that sleeps on its slot's
// ask word, answers a live ask by giving back what it can (OnAsked), and how it is stopped without
// a store into the ledger.
#include "ledger.hpp"

#include "ledger_file.hpp"

#if RESIDENCY_LEDGER_LINUX

#include <cerrno>
#include <cstddef>

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include "ledger_lock.hpp"

namespace residency::ledger {

namespace {
// A listener asleep on an ask word whose page is gone (the file truncated by another member)
// cannot be woken; after this many failed wakes, 1 ms apart, it is detached instead of joined.
constexpr int kStopWakeTries = 20;
}  // namespace

// Tells the listener to stop and waits until it has, without a store into the ledger: a wake
// needs none (the kernel wakes whoever sleeps on the word's key, whatever the word holds). The
// listener may be between its look at `stopping` and its wait, so it is woken again until it says
// it is done. Returns false (the thread is detached, not joined) only when it sleeps on its ask
// word and that word's page is gone (another member truncated the file: the wake fails with
// EFAULT): nothing can wake it then, and once woken (if the file regains its size and someone
// wakes the word) it looks at its own ListenerState first and returns without touching this object.
bool Ledger::tell_listener_to_stop() {
  ListenerState& st = *listener_state_;
  st.stopping.store(true, std::memory_order_release);
  st.stop_word.store(1, std::memory_order_release);
  futex_wake(st.stop_word, 1);         // a listener that found the ledger corrupt sleeps there
  auto& ask = shm_->slots[slot_].ask;  // its address only
  int gone = 0;
  while (st.done.load(std::memory_order_acquire) == 0) {
    const bool faulted = futex_wake(ask, INT32_MAX) < 0 && errno == EFAULT;
    gone = faulted && st.on_ask_word.load(std::memory_order_acquire) ? gone + 1 : 0;
    if (gone >= kStopWakeTries) return false;
    const timespec ms{0, 1'000'000};
    futex_wait(st.done, 0, &ms);
  }
  return true;
}

void Ledger::end_listener() {
  if (!listener_.joinable()) return;
  if (listener_.get_id() == std::this_thread::get_id()) {  // exit() from on_asked_: it returns after it
    listener_state_->stopping.store(true, std::memory_order_release);
    return;
  }
  if (tell_listener_to_stop()) listener_.join();
  else listener_.detach();
}

void Ledger::listen(OnAsked on_asked) {
  if (listener_.joinable() || !shm_) return;
  on_asked_ = std::move(on_asked);
  listener_ = std::thread([this, st = listener_state_] {
    listen_loop(*st);
    st->done.store(1, std::memory_order_release);
    futex_wake(st->done, 1);
  });
}

void Ledger::stop_listening() {
  if (!listener_.joinable()) return;
  if (!mine()) {  // a fork child: the thread is the parent's
    listener_.detach();
    return;
  }
  end_listener();
}

void Ledger::listen_loop(ListenerState& st) {
  // Signals go to the process's other threads: this one only ever wakes when asked.
  sigset_t all;
  sigfillset(&all);
  ::pthread_sigmask(SIG_BLOCK, &all, nullptr);
  ::pthread_setname_np(::pthread_self(), "residency-ask");
  auto& ask = shm_->slots[slot_].ask;  // its address, for the kernel's compare; never loaded here
  // The ask this thread saw last and could not clear (the lock was not obtained): it sleeps while
  // the word still holds it, so that an ask it could not answer does not spin it; the asker
  // withdraws it, or the next asker writes its own and wakes it.
  std::uint32_t seen = 0;
  for (;;) {
    if (st.stopping.load(std::memory_order_acquire)) return;
    if (broken_.load(std::memory_order_acquire)) {  // the ledger is not touched again: wait to be stopped
      futex_wait(st.stop_word, 0, nullptr);
      continue;
    }
    st.on_ask_word.store(true, std::memory_order_release);
    const long w = futex_wait(ask, seen, nullptr);
    const int e = errno;
    st.on_ask_word.store(false, std::memory_order_release);
    // Before anything of this object: a thread detached while it slept here (end_listener) returns.
    if (st.stopping.load(std::memory_order_acquire)) return;
    if (w != 0 && e == EFAULT) {
      broken_.store(true, std::memory_order_release);  // truncated under us
      continue;
    }
    // Answered only if it is still a live ask: the word unchanged, the asker alive, its wait not
    // over. Checked under the lock; without the lock it cannot be checked and is declined.
    std::uint32_t v = 0;
    int asker = 0;
    {
      Lock lock(fd_, local_, shm_, kAnswerLockWait);
      if (found_broken(lock)) continue;
      if (!lock.ok()) {  // cannot be read: wait for the next wake, unless the word is still 0
        std::uint32_t now = 0;
        seen = ::pread(fd_, &now, sizeof now, own_offset(offsetof(Slot, ask))) == static_cast<ssize_t>(sizeof now) ? now
                                                                                                                   : 0;
        continue;
      }
      const Slot& mine = lock.table().slots[slot_];
      v = mine.ask.load(std::memory_order_relaxed);
      seen = 0;
      if (v == 0) continue;  // spurious, or withdrawn
      const int pid = mine.asker_pid.load(std::memory_order_relaxed);
      if (monotonic_ns() < mine.ask_deadline.load(std::memory_order_relaxed) &&
          holder_alive(pid, mine.asker_start.load(std::memory_order_relaxed)))
        asker = pid;
    }
    if (asker != 0 && on_asked_) on_asked_(asker);
    {
      Lock lock(fd_, local_, shm_, kAnswerLockWait);
      if (found_broken(lock, OwnSlot::skip)) continue;
      if (!lock.ok()) {  // not cleared: the asker withdraws it; meanwhile this thread sleeps while it stays
        seen = v;
        continue;
      }
      const Shared& t = lock.table();
      if (t.slots[slot_].ask.load(std::memory_order_relaxed) == v) lock.put(t.slots[slot_].ask, std::uint32_t{0});
      bump(lock);
    }
  }
}

}  // namespace residency::ledger

#endif  // RESIDENCY_LEDGER_LINUX
