// SPDX-License-Identifier: MIT
// The ledger's lock (ledger_lock.hpp): taking it with a bounded wait, reading and checking the
// copy, and the changes to the table that every section may make.
#include "ledger_lock.hpp"

#if RESIDENCY_LEDGER_LINUX

#include <algorithm>
#include <cerrno>
#include <thread>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace residency::ledger {

std::atomic<bool> g_joins_cancelled{false};

Lock::Lock(int fd, Mutex& local, Shared* s, Nanos bound, bool cancellable)
    : fd_(fd), local_(local.native(), std::defer_lock), s_(s) {
  take(bound, cancellable);
  if (!ok_) return;
  struct stat st {};
  std::string bad;
  if (::fstat(fd_, &st) != 0) bad = "cannot stat it: " + errno_text(errno);
  else if (st.st_size != static_cast<off_t>(sizeof(Shared)))
    bad = "it is " + std::to_string(st.st_size) + " bytes long, a ledger is " + std::to_string(sizeof(Shared)) +
          " (another process truncated or extended it)";
  else if (const ssize_t got = ::pread(fd_, static_cast<void*>(&table_), sizeof(Shared), 0);
           got != static_cast<ssize_t>(sizeof(Shared)))
    bad = got < 0 ? "cannot read it: " + errno_text(errno)
                  : "it is " + std::to_string(got) + " bytes long, a ledger is " + std::to_string(sizeof(Shared)) +
                        " (another process truncated it)";
  else bad = check_table(table_);
  if (!bad.empty()) {
    release_file_lock();
    ok_ = false;
    corrupt_ = true;
    why_ = bad;
    return;
  }
  put(table_.locker, static_cast<std::int32_t>(::getpid()));
}

void Lock::take(Nanos bound, bool cancellable) {
  // This process's threads first, without a bound: each holds it only for a section of this
  // file, whose wait for the file lock is bounded itself. It stays held until the Lock goes,
  // also when the file lock was not obtained, so that the writes a holder may still make to its
  // own slot then are ordered with its other threads.
  local_.lock();
  const auto deadline = std::chrono::steady_clock::now() + bound;
  auto pause = std::chrono::microseconds(50);
  for (;;) {
    struct flock fl {};
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;  // l_start = l_len = 0: the whole file
    if (::fcntl(fd_, F_OFD_SETLK, &fl) == 0) break;
    const int e = errno;
    const bool cancelled = cancellable && g_joins_cancelled.load(std::memory_order_acquire);
    if ((e != EAGAIN && e != EACCES && e != EINTR) || cancelled || std::chrono::steady_clock::now() >= deadline) {
      if (cancelled) why_ = "cancelled (the process is ending)";
      else if (e != EAGAIN && e != EACCES && e != EINTR) why_ = "fcntl(F_OFD_SETLK) failed: " + errno_text(e);
      else
        why_ = "it has been held" + holder_text() + " for more than " + std::to_string(bound.count() / 1'000'000) +
               " ms (a process stopped inside it: SIGSTOP, a paused container, a debugger)";
      return;
    }
    std::this_thread::sleep_for(
        std::min<std::chrono::steady_clock::duration>(pause, deadline - std::chrono::steady_clock::now()));
    pause = std::min(pause * 2, std::chrono::microseconds(5000));
  }
  ok_ = true;
}

void Lock::release_file_lock() {
  struct flock fl {};
  fl.l_type = F_UNLCK;
  fl.l_whence = SEEK_SET;
  ::fcntl(fd_, F_OFD_SETLK, &fl);
}

void Lock::unlock() {
  if (ok_) {
    put(table_.locker, std::int32_t{0});
    release_file_lock();
    ok_ = false;
  }
  if (local_.owns_lock()) local_.unlock();
}

std::string Lock::holder_text() const {
  const int pid = locker_of(fd_);
  return pid > 0 ? " by process " + std::to_string(pid) : "";
}

void bump(Lock& lock) {
  const Shared& s = lock.table();
  lock.put(s.generation, s.generation.load(std::memory_order_relaxed) + 1);
  futex_wake(lock.mapped(s.generation), INT32_MAX);
}

std::uint64_t reclaim(Lock& lock, int self_pid, std::uint64_t self_start) {
  std::uint64_t freed = 0;
  bool any = false;
  for (const Slot& sl : lock.table().slots) {
    if (!sl.occupied.load(std::memory_order_relaxed)) continue;
    const int pid = sl.pid.load(std::memory_order_relaxed);
    const std::uint64_t start = sl.start_time.load(std::memory_order_relaxed);
    if (pid == self_pid && start == self_start) continue;
    if (holder_alive(pid, start)) continue;
    freed += sl.bytes.load(std::memory_order_relaxed);
    lock.put(sl.bytes, std::uint64_t{0});
    lock.put(sl.ask, std::uint32_t{0});
    lock.put(sl.wait_ticket, std::uint64_t{0});
    lock.put(sl.occupied, std::uint32_t{0});
    any = true;
  }
  if (any) bump(lock);
  return freed;
}

}  // namespace residency::ledger

namespace residency {

void cancel_shared_budget_waits() noexcept { ledger::g_joins_cancelled.store(true, std::memory_order_release); }

}  // namespace residency

#endif  // RESIDENCY_LEDGER_LINUX
