// SPDX-License-Identifier: MIT
// The shared-memory ledger (ledger.hpp): layout, lock, holders, reclamation, asking.
#include "ledger.hpp"

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <vector>

#include "platform/proc_stat.hpp"

#if defined(__linux__) && !defined(RESIDENCY_LEDGER_UNSUPPORTED)
#define RESIDENCY_LEDGER_LINUX 1
#include <dirent.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#endif

namespace residency::ledger {

using Nanos = std::chrono::nanoseconds;

namespace {
constexpr const char* kDir = "/dev/shm";
constexpr const char* kPrefix = "residency-budget-";
}  // namespace

std::string ledger_path(const std::string& name) { return std::string(kDir) + "/" + kPrefix + name; }

#if RESIDENCY_LEDGER_LINUX

// --- the layout in shared memory ------------------------------------------------------------

namespace {
constexpr std::uint64_t kMagic = 0x5245444752444c52ULL;  // "RLDRGDER" little-endian: residency ledger
// Never given out as an ask id: builds before 2027-01 wrote it into their own ask word to stop
// their listener (the same format), and such a listener must not take an ask for it.
constexpr std::uint32_t kStopWord = 0xffffffffu;

// One holder. Invariant: `occupied` is 1 exactly while pid/start_time name a holder; `bytes` is what
// that holder has reserved. Each is one aligned word, written under the ledger's lock (last_use
// also without it, by the holder's touch(); its own ask word too, by its stop and when it cannot
// take the lock to answer).
//
// An ask has an identity and an end: `ask` holds its id (Shared::ask_serial, never 0 or
// kStopWord), asker_pid/asker_start name the asking process and ask_deadline is when it stops
// waiting. The asked holder gives back only for an ask that is still the one in its word, whose
// asker is alive and whose deadline has not passed (a holder stopped while asked, continued after
// the asker gave up, gives back to nobody); the asker withdraws its asks when it stops waiting.
struct alignas(64) Slot {
  std::atomic<std::uint32_t> ask;  // futex word: 0 nothing asked; else the ask's id
  std::atomic<std::uint32_t> occupied;
  std::atomic<std::int32_t> pid;
  std::atomic<std::int32_t> priority;
  std::atomic<std::uint64_t> start_time;
  std::atomic<std::uint64_t> bytes;
  std::atomic<std::int64_t> last_use;  // CLOCK_MONOTONIC ns of the last use; 0: none yet
  std::atomic<std::int32_t> asker_pid;
  std::atomic<std::uint32_t> floor_mib;  // MiB of `bytes` that no ask gets back (Ledger::set_floor)
  std::atomic<std::uint64_t> asker_start;
  std::atomic<std::int64_t> ask_deadline;  // CLOCK_MONOTONIC ns
};
static_assert(sizeof(Slot) == 64, "one cache line per holder");
// Whether an ask could get anything back from the holder: it holds more than its floor.
bool askable(const Slot& sl) {
  return sl.bytes.load(std::memory_order_relaxed) > (std::uint64_t{sl.floor_mib.load(std::memory_order_relaxed)} << 20);
}
static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "the ledger needs lock-free 64-bit atomics");
}  // namespace

struct Ledger::Shared {
  // The trust model: every process that may open the file (its user, or the members of its
  // group) may deny the others budget, never corrupt their processes. So nothing here is a lock or
  // a pointer: the lock is the kernel's (an OFD lock on the file), and every field is checked
  // before it is used (check_table(), and the file's size, under the lock). A ledger that fails
  // the check is an error with a message; its holders stop using it and keep their processes.
  //
  // Fixed header: magic and version stay at these offsets in every format version, so that a
  // reader can name the version it found.
  std::uint64_t magic;
  std::uint32_t version;
  std::uint32_t layout_size;  // sizeof(Shared) of the creator: another layout is another format
  std::uint64_t budget;
  std::atomic<std::uint32_t> generation;  // futex word: bumped whenever bytes are given back
  std::atomic<std::uint32_t> retired;     // 1: unlinked by the last holder; open afresh
  char name[72];
  // The pid that took the lock last (0: unlocked): only for the message of a wait that timed out.
  std::atomic<std::int32_t> locker;
  std::atomic<std::uint32_t> ask_serial;  // the last ask id given out
  alignas(64) Slot slots[kMaxHolders];
};

namespace {

using Shared = Ledger::Shared;

std::int64_t monotonic_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

auto* word(std::atomic<std::uint32_t>& a) { return reinterpret_cast<std::uint32_t*>(&a); }

// Returns the number woken, or -1 with errno (EFAULT: the page is gone, the file was truncated).
long futex_wake(std::atomic<std::uint32_t>& a, int n) {
  return ::syscall(SYS_futex, word(a), FUTEX_WAKE, n, nullptr, nullptr, 0);
}
// Sleeps while `a` holds `expected`, at most `timeout` (nullptr: no limit).
// Returns 0 when woken (or spuriously), else -1 with errno: EAGAIN (the word differed), ETIMEDOUT,
// EINTR, or EFAULT (the page is gone: the file was truncated). The kernel compares the word, so
// waiting needs no load of it from a mapping.
long futex_wait(std::atomic<std::uint32_t>& a, std::uint32_t expected, const timespec* timeout) {
  return ::syscall(SYS_futex, word(a), FUTEX_WAIT, expected, timeout, nullptr, 0);
}

std::string errno_text(int e) { return std::strerror(e); }

// Writes `size` bytes at offset `at` of a ledger: one word of it. Not a store through the mapping
// (a page another member cut off by truncating the file would fault it: SIGBUS), not pwrite()
// either (a write past the end of a file that another member truncated meanwhile grows it again):
// process_vm_writev() of this process into the mapping, which the kernel answers with EFAULT when
// the page is gone and which never changes the file's size. Where a sandbox refuses the call
// (seccomp: EPERM or ENOSYS) it falls back to pwrite(), whose one flaw is that growth, back to at
// most this word's end with zeros before it, which every check finds corrupt (the magic is gone).
// Returns false when nothing was written.
bool write_word(int fd, void* mapping, std::size_t at, const void* value, std::size_t size) {
  static std::atomic<bool> vm_write_refused{false};
  if (!vm_write_refused.load(std::memory_order_relaxed)) {
    iovec local{const_cast<void*>(value), size}, remote{static_cast<char*>(mapping) + at, size};
    const ssize_t n = ::process_vm_writev(::getpid(), &local, 1, &remote, 1, 0);
    if (n == static_cast<ssize_t>(size)) return true;
    if (n >= 0 || (errno != EPERM && errno != ENOSYS)) return false;  // EFAULT: cut off
    vm_write_refused.store(true, std::memory_order_relaxed);
  }
  return ::pwrite(fd, value, size, static_cast<off_t>(at)) == static_cast<ssize_t>(size);
}

// What is wrong with a ledger's bytes ("" when nothing is). Every field another process may have
// written is read here before it is used: the header, the retired word, each slot's `occupied`, pid
// and start time, and the sum of the reservations against the budget (which acquire() keeps).
std::string check_table(const Shared& s) {
  if (s.magic != kMagic) return "its magic number was overwritten";
  if (s.version != kFormatVersion || s.layout_size != sizeof(Shared))
    return "its format version or layout size was overwritten (" + std::to_string(s.version) + ", " +
           std::to_string(s.layout_size) + ")";
  if (s.retired.load(std::memory_order_relaxed) > 1) return "its retired word is " + std::to_string(s.retired.load());
  if (std::memchr(s.name, 0, sizeof s.name) == nullptr) return "its name is not terminated";
  std::uint64_t sum = 0;
  for (std::uint32_t i = 0; i < kMaxHolders; ++i) {
    const Slot& sl = s.slots[i];
    const std::uint32_t occupied = sl.occupied.load(std::memory_order_relaxed);
    if (occupied > 1) return "slot " + std::to_string(i) + " has occupied = " + std::to_string(occupied);
    if (occupied == 0) continue;
    if (sl.pid.load(std::memory_order_relaxed) <= 0 || sl.start_time.load(std::memory_order_relaxed) == 0)
      return "slot " + std::to_string(i) + " names pid " + std::to_string(sl.pid.load()) + " with start time " +
             std::to_string(sl.start_time.load());
    const std::uint64_t b = sl.bytes.load(std::memory_order_relaxed);
    // Above the budget is allowed (take_over_budget(): device memory that is awake whatever the
    // ledger says); a sum past 2^63 is not a reservation.
    if (b > (std::uint64_t{1} << 63) - sum) return "its holders reserve more than 2^63 bytes";
    sum += b;
  }
  return "";
}

// The ledger's locker word, read with pread (a mapping may not be touched without the lock).
int locker_of(int fd) {
  std::int32_t pid = 0;
  if (::pread(fd, &pid, sizeof pid, offsetof(Shared, locker)) != static_cast<ssize_t>(sizeof pid)) return 0;
  return pid > 0 ? pid : 0;
}

// Set by cancel_shared_budget_waits(): every wait of this process for a ledger ends at once (the
// process is ending). Sticky.
std::atomic<bool> g_joins_cancelled{false};
// How long each kind of wait for the lock may last. The lock is held for microseconds; a longer
// wait means its owner is stopped, paused or hostile.
constexpr Nanos kUseLockWait = std::chrono::milliseconds(10);  // acquire, release, answering: a decode may be waiting
constexpr Nanos kLeaveLockWait = std::chrono::milliseconds(300);  // destruction and exit
// The listener (a thread of its own, nobody waits on it): the asker holds the lock while it wakes
// it, so a decode's 10 ms would make it decline asks whenever the ledger is busy.
constexpr Nanos kAnswerLockWait = std::chrono::milliseconds(300);
constexpr Nanos kCancelPoll = std::chrono::milliseconds(50);  // the ask wait checks for cancellation this often
// A listener asleep on an ask word whose page is gone (the file truncated by another member)
// cannot be woken; after this many failed wakes, 1 ms apart, it is detached instead of joined.
constexpr int kStopWakeTries = 20;

}  // namespace

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
  Lock(int fd, Mutex& local, Shared* s, Nanos bound, bool cancellable = false) RESIDENCY_ACQUIRE(local)
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

 private:
  void take(Nanos bound, bool cancellable) {
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
  void release_file_lock() {
    struct flock fl {};
    fl.l_type = F_UNLCK;
    fl.l_whence = SEEK_SET;
    ::fcntl(fd_, F_OFD_SETLK, &fl);
  }

 public:
  ~Lock() RESIDENCY_RELEASE() { unlock(); }
  void unlock() RESIDENCY_RELEASE() {
    if (ok_) {
      put(table_.locker, std::int32_t{0});
      release_file_lock();
      ok_ = false;
    }
    if (local_.owns_lock()) local_.unlock();
  }
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
  // "by process N" when the ledger names the locker (read with pread: only the lock owner may
  // touch the mapping, and the word is a hint, written by whoever took the lock last).
  std::string holder_text() const {
    const int pid = locker_of(fd_);
    return pid > 0 ? " by process " + std::to_string(pid) : "";
  }
  int fd_;
  std::unique_lock<std::mutex> local_;  // Ledger::local_, held from take() until unlock()
  Shared* s_;
  bool ok_ = false, corrupt_ = false;
  std::string why_;
  Shared table_;
};

namespace {

std::uint64_t used_bytes(const Shared& s) {
  std::uint64_t sum = 0;
  for (const Slot& sl : s.slots)
    if (sl.occupied.load(std::memory_order_relaxed)) sum += sl.bytes.load(std::memory_order_relaxed);
  return sum;
}

// With the lock held: bumps the generation word and wakes whoever waits on it.
void bump(Lock& lock) {
  const Shared& s = lock.table();
  lock.put(s.generation, s.generation.load(std::memory_order_relaxed) + 1);
  futex_wake(lock.mapped(s.generation), INT32_MAX);
}

// With the lock held: drops every holder whose process is gone. Returns the bytes reclaimed.
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
    lock.put(sl.occupied, std::uint32_t{0});
    any = true;
  }
  if (any) bump(lock);
  return freed;
}

bool in_group(gid_t gid) {
  if (::getegid() == gid) return true;
  const int n = ::getgroups(0, nullptr);
  if (n <= 0) return false;
  std::vector<gid_t> g(static_cast<std::size_t>(n));
  const int m = ::getgroups(n, g.data());
  return m > 0 && std::find(g.begin(), g.begin() + m, gid) != g.begin() + m;
}

Result<gid_t> group_id(const std::string& group) {
  std::vector<char> buf(16384);
  for (;;) {
    struct group gr {};
    struct group* out = nullptr;
    const int r = ::getgrnam_r(group.c_str(), &gr, buf.data(), buf.size(), &out);
    if (r == ERANGE && buf.size() < (1u << 20)) {
      buf.resize(buf.size() * 4);
      continue;
    }
    if (r != 0 || out == nullptr)
      return Status(ErrorCode::invalid_argument,
                    "RESIDENCY_SHARED_BUDGET: the group '" + group +
                        "' does not exist on this machine; name an existing group "
                        "(getent group) or leave the group out for a ledger private to this user");
    return out->gr_gid;
  }
}

// The name of group `gid`, or its number when it has none.
std::string group_name_of(gid_t gid) {
  std::vector<char> buf(16384);
  struct group gr {};
  struct group* out = nullptr;
  if (::getgrgid_r(gid, &gr, buf.data(), buf.size(), &out) == 0 && out != nullptr) return out->gr_name;
  return std::to_string(gid);
}

// What a file that is not a regular file is, for messages: "a FIFO", "a socket", ...
std::string file_kind(mode_t mode) {
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return S_ISREG(mode) ? "a regular file" : "not a regular file";
}

// The message for a path in /dev/shm that is not a regular file (any user may make one there).
std::string not_a_ledger(const std::string& path, mode_t mode) {
  return path + " is " + file_kind(mode) + ", not a ledger; remove it";
}

// Opens a path in /dev/shm (world-writable: anyone may put a FIFO, a socket or a link there)
// without ever blocking: O_NONBLOCK, so that opening a FIFO returns at once (ENXIO for a socket),
// and O_NOFOLLOW. The caller checks the file's type with fstat before it reads a byte.
int open_in_shm(const std::string& path, int access) {
  return ::open(path.c_str(), access | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
}

// Checks an open ledger: a regular file of this user (or of our group with mode 0660), mode
// 0600 or 0660, magic, format version, layout size. `group`: the gid configured, or -1.
Status check_file(int fd, const std::string& path, long group, const std::string& group_name = "") {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return Status(ErrorCode::io_error, "cannot stat " + path + ": " + errno_text(errno));
  if (!S_ISREG(st.st_mode)) return Status(ErrorCode::permission_denied, not_a_ledger(path, st.st_mode));
  const unsigned mode = st.st_mode & 07777;
  if (st.st_uid != ::geteuid()) {
    const bool group_ledger = group >= 0 && mode == 0660 && st.st_gid == static_cast<gid_t>(group);
    if (group_ledger && !in_group(st.st_gid))
      return Status(ErrorCode::permission_denied,
                    path + " is the ledger of group " +
                        (group_name.empty() ? std::to_string(st.st_gid) : "'" + group_name + "'") +
                        " (mode 0660, owner uid " + std::to_string(st.st_uid) + "), and this process (uid " +
                        std::to_string(::geteuid()) +
                        ") is not a member of that group; membership decides, for root "
                        "too: add the user to the group, or use another budget name");
    if (group >= 0 && !group_ledger) {
      char m[16];
      std::snprintf(m, sizeof m, "%04o", mode);
      return Status(ErrorCode::permission_denied,
                    path + " belongs to uid " + std::to_string(st.st_uid) + " with gid " + std::to_string(st.st_gid) +
                        " and mode " + m + ", not to the group '" + group_name +
                        "' with mode 0660 that this budget names; " + "use another budget name, or run as uid " +
                        std::to_string(st.st_uid));
    }
    if (!group_ledger && group < 0 && mode == 0660)
      return Status(ErrorCode::permission_denied,
                    path + " is the ledger of group '" + group_name_of(st.st_gid) + "' (mode 0660, owner uid " +
                        std::to_string(st.st_uid) + "), and this budget names no group; to share it, name the group: " +
                        "NAME:SIZE:" + group_name_of(st.st_gid) + " (as a member of it), or use another budget name");
    if (!group_ledger)
      return Status(ErrorCode::permission_denied,
                    path + " belongs to uid " + std::to_string(st.st_uid) + " (this process runs as uid " +
                        std::to_string(::geteuid()) +
                        "); a shared budget is private to the user who created it unless it names a group "
                        "(NAME:SIZE:GROUP, mode 0660): use another budget name, or run as that user");
  }
  if (mode != 0600 && mode != 0660) {
    char m[16];
    std::snprintf(m, sizeof m, "%04o", mode);
    return Status(ErrorCode::permission_denied, path + " has mode " + m +
                                                    "; a ledger must be 0600 (its user) or 0660 (a named group), "
                                                    "or another user could corrupt it: remove it");
  }
  std::uint64_t head[2] = {0, 0};
  if (st.st_size < static_cast<off_t>(sizeof head) ||
      ::pread(fd, head, sizeof head, 0) != static_cast<ssize_t>(sizeof head))
    return Status(ErrorCode::invalid_argument,
                  path + " is too short to be a residency ledger (" + std::to_string(st.st_size) + " bytes); remove it");
  if (head[0] != kMagic)
    return Status(ErrorCode::invalid_argument, path + " is not a residency ledger (wrong magic); remove it");
  const auto version = static_cast<std::uint32_t>(head[1] & 0xffffffffu);
  const auto layout = static_cast<std::uint32_t>(head[1] >> 32);
  if (version != kFormatVersion)
    return Status(ErrorCode::invalid_argument,
                  path + " has ledger format version " + std::to_string(version) + "; this library reads version " +
                      std::to_string(kFormatVersion) +
                      ": processes of another residency release hold this budget; use another budget name, or "
                      "stop them and the ledger goes away with its last holder");
  if (layout != sizeof(Shared))
    return Status(ErrorCode::invalid_argument, path + " has version " + std::to_string(version) + " but a layout of " +
                                                   std::to_string(layout) + " bytes; this build expects " +
                                                   std::to_string(sizeof(Shared)) +
                                                   ": a build for another C library or ABI holds it; use another name");
  if (st.st_size != static_cast<off_t>(sizeof(Shared)))
    return Status(ErrorCode::invalid_argument,
                  path + " is " + std::to_string(st.st_size) + " bytes long where its header says " +
                      std::to_string(layout) +
                      ": another process truncated or extended it, so it is corrupt; its holders keep their memory but "
                      "cannot share it: remove the file (or use another budget name)");
  return {};
}

// The mapping gives the futex words their address and write_word() its target; nothing is loaded
// from it or stored into it by this process's instructions (Lock's comment), so a truncation by
// another member can never fault this process.
Shared* map(int fd) {
  void* p = ::mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return p == MAP_FAILED ? nullptr : static_cast<Shared*>(p);
}

// Creates a ledger under a temporary name and links it into place. Returns the descriptor, -1
// when another process linked one first (open that), or an error. The errors name the ledger's
// path, never the temporary name: that file is removed before the error is returned, and the path
// is what a user can look for in /dev/shm.
Result<int> create(const std::string& path, const std::string& name, std::uint64_t budget, long group,
                   const std::string& group_name) {
  static std::atomic<unsigned> serial{0};
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(serial++);
  const int fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0)
    return Status(ErrorCode::io_error, "cannot create the ledger " + path + ": " + errno_text(errno) +
                                           " (is /dev/shm mounted and writable?)");
  auto fail = [&](const std::string& what) {
    const int e = errno;
    ::unlink(tmp.c_str());
    ::close(fd);
    return Status(ErrorCode::io_error, what + " the new ledger " + path + ": " + errno_text(e));
  };
  if (::ftruncate(fd, sizeof(Shared)) != 0) return fail("cannot set the size of");
  if (group >= 0 && ::fchown(fd, static_cast<uid_t>(-1), static_cast<gid_t>(group)) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    ::close(fd);
    return Status(e == EPERM ? ErrorCode::permission_denied : ErrorCode::io_error,
                  "cannot give the new ledger " + path + " to the group '" + group_name + "': " + errno_text(e) +
                      (e == EPERM
                           ? " (a user may give a file only to a group it is a member of: add the user to the group)"
                           : ""));
  }
  if (::fchmod(fd, group >= 0 ? 0660 : 0600) != 0) return fail("cannot set the mode of");
  // Written with pwrite (the file is still ours alone, under its temporary name): zero-filled,
  // every atomic and slot starts at 0 (free), and the lock is the file's.
  auto image = std::make_unique<Shared>();
  std::memset(static_cast<void*>(image.get()), 0, sizeof(Shared));
  image->budget = budget;
  std::snprintf(image->name, sizeof image->name, "%s", name.c_str());
  image->version = kFormatVersion;
  image->layout_size = sizeof(Shared);
  image->magic = kMagic;
  if (::pwrite(fd, static_cast<const void*>(image.get()), sizeof(Shared), 0) != static_cast<ssize_t>(sizeof(Shared)))
    return fail("cannot write");
  if (::link(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    ::close(fd);
    if (e == EEXIST) return -1;
    return Status(ErrorCode::io_error, "cannot link " + path + ": " + errno_text(e));
  }
  ::unlink(tmp.c_str());
  return fd;
}

}  // namespace

std::uint64_t process_start_time(int pid) {
  const auto stat = platform::read_proc_stat(pid);
  return stat && !stat->gone() ? stat->start_time : 0;
}

int lock_owner(const std::string& path) {
  const int fd = open_in_shm(path, O_RDONLY);
  if (fd < 0) return 0;
  const int pid = locker_of(fd);
  ::close(fd);
  return pid;
}

bool holder_alive(int pid, std::uint64_t start_time) {
  if (pid <= 0 || start_time == 0) return false;
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  return process_start_time(pid) == start_time;
}

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
    int fd = open_in_shm(path, O_RDWR);
    if (fd < 0 && errno == ENOENT) {
      auto made = create(path, o.name, o.budget, group, o.group);
      if (!made) return made.status();
      if (*made < 0) continue;  // another process linked its ledger first: open that one
      fd = *made;
    } else if (fd < 0 && errno == ELOOP) {
      return Status(ErrorCode::permission_denied,
                    path + " is a symbolic link; a ledger must be a regular file in " + kDir +
                        " (a link could point anywhere, it is never followed): remove it, or use another budget name");
    } else if (fd < 0 && errno == ENXIO) {  // a socket (or a FIFO without a reader, opened to write)
      struct stat st {};
      if (::lstat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
        return Status(ErrorCode::permission_denied, not_a_ledger(path, st.st_mode));
      return Status(ErrorCode::io_error, "cannot open the shared budget ledger " + path + ": " + errno_text(ENXIO));
    } else if (fd < 0) {
      const int e = errno;
      return Status(e == EACCES ? ErrorCode::permission_denied : ErrorCode::io_error,
                    "cannot open the shared budget ledger " + path + ": " + errno_text(e) +
                        (e == EACCES ? " (it belongs to another user; use another budget name)" : ""));
    }
    if (Status st = check_file(fd, path, group, o.group); !st) {
      ::close(fd);
      return st;
    }
    Shared* s = map(fd);
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
      std::uint32_t slot = kMaxHolders;
      for (std::uint32_t i = 0; i < kMaxHolders; ++i)
        if (!t.slots[i].occupied.load(std::memory_order_relaxed)) {
          slot = i;
          break;
        }
      if (slot == kMaxHolders) {
        lock.unlock();
        l->shm_ = nullptr;
        ::munmap(s, sizeof(Shared));
        return Status(ErrorCode::limit_exceeded,
                      "the shared budget " + o.name + " has " + std::to_string(kMaxHolders) +
                          " holders already (the most a ledger keeps); use another budget name");
      }
      const Slot& sl = t.slots[slot];
      lock.put(sl.ask, std::uint32_t{0});
      lock.put(sl.pid, std::int32_t{self});
      lock.put(sl.start_time, self_start);
      lock.put(sl.priority, std::int32_t{o.priority});
      lock.put(sl.bytes, std::uint64_t{0});
      lock.put(sl.last_use, std::int64_t{0});
      lock.put(sl.floor_mib, std::uint32_t{0});
      lock.put(sl.occupied, std::uint32_t{1});  // last: the slot is whole when it counts
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

namespace {
// With nothing held: frees our slot, reclaims the dead, and retires + unlinks the ledger when no
// holder is left (under the lock, so that an opener waiting for it sees `retired`).
// Whether the file at `path` is the one open as `fd` (a ledger removed from outside, rm or
// systemd's RemoveIPC, may have been replaced by another process's new one: that one is not ours
// to remove).
bool path_is_ours(int fd, const std::string& path) {
  struct stat held {
  }, at{};
  return ::fstat(fd, &held) == 0 && ::stat(path.c_str(), &at) == 0 && held.st_dev == at.st_dev && held.st_ino == at.st_ino;
}

}  // namespace

bool Ledger::mine() const { return ::getpid() == owner_pid_; }

// Frees our slot, reclaims the dead, and retires + unlinks the ledger when no holder is left
// (under the lock, so that an opener waiting for it sees `retired`).
void Ledger::leave() {
  if (broken_.load(std::memory_order_acquire)) return;  // nothing of a corrupt ledger is touched
  const int self = ::getpid();
  // Bounded: a lock stopped elsewhere costs this process its exit time, at most this long. Not
  // obtained, our slot is still ours to clear; reclaiming the dead and retiring wait for the next.
  Lock lock(fd_, local_, shm_, kLeaveLockWait, /*cancellable=*/true);
  if (lock.corrupt() || (!lock.ok() && !covers_mapping()) || (lock.ok() && !own_slot_sound(lock.table()))) {
    broken_.store(true, std::memory_order_release);
    return;
  }
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

void Ledger::detach_at_exit() {
  if (!shm_ || detached_ || held_.load() != 0 || !mine()) return;
  // The listener returns at once now: joined, so that nothing of ours runs past exit (and no
  // thread is left unjoined for a sanitizer to report).
  end_listener();
  detached_ = true;
  leave();
}

std::uint64_t Ledger::budget() const { return budget_; }

namespace {
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

void Ledger::publish_last_use(void* ledger, std::int64_t last_use) noexcept {
  auto* l = static_cast<Ledger*>(ledger);
  if (!l->shm_ || l->detached_ || l->broken_.load(std::memory_order_relaxed) || !l->mine()) return;
  // Failing (a file cut short or gone) costs nothing but the idle time others see.
  l->put_own(offsetof(Slot, last_use), last_use);
}

off_t Ledger::own_offset(std::size_t field) const {
  return static_cast<off_t>(offsetof(Shared, slots) + slot_ * sizeof(Slot) + field);
}

// Asks the other holders, one at a time, until `done` (run under the lock, on a sound ledger)
// says so, nobody is left to ask, or `wait` is over. The holder to ask: priority <= ours, idle at
// least `min_idle` at `now`, holding bytes; the lowest priority first, then the one idle longest.
// One inside a call declines (its answer clears the word at once) and the next is asked. The asks
// still in their holders' words are withdrawn before it returns. Returns 1 when done said so, 0
// when not, -1 when the ledger could not be used (problem() says why).
int Ledger::ask_until(const std::function<bool(Lock&)>& done, std::int64_t now, Nanos wait, Nanos min_idle) {
  if (detached_ || !mine()) return -1;
  if (broken_.load(std::memory_order_acquire)) {
    if (problem().empty())
      set_problem("its ledger " + path_ + " was found corrupt; this process wires nothing more under it");
    return -1;
  }
  if (removed_.load(std::memory_order_acquire)) return -1;  // problem() says so still
  const int self = ::getpid();
  const std::uint64_t self_start = self_start_;
  // Whether a lock just taken may be used; else problem() says why and nothing is granted.
  auto usable = [&](const Lock& lock) {
    if (lock.corrupt()) return corrupt(lock.why()), false;
    if (!lock.ok()) return lock_not_obtained(lock.why()), false;
    if (!own_slot_sound(lock.table()))
      return corrupt("the slot of this process (" + std::to_string(slot_) + ") was overwritten"), false;
    if (!path_is_ours(fd_, path_)) return removed(), false;
    set_problem({});
    return true;
  };
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
      if (!usable(lock)) return -1;  // the asks expire at their deadline
      reclaim(lock, self, self_start);
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
      if (!outstanding && wait.count() > 0) {
        const std::int64_t idle_before = now - min_idle.count();
        std::uint32_t best = kMaxHolders;
        for (std::uint32_t i = 0; i < kMaxHolders; ++i) {
          const Slot& sl = s.slots[i];
          if (i == slot_ || !sl.occupied.load(std::memory_order_relaxed) || !askable(sl) ||
              sl.ask.load(std::memory_order_relaxed) != 0 || sl.priority.load(std::memory_order_relaxed) > priority_ ||
              sl.last_use.load(std::memory_order_relaxed) > idle_before)
            continue;
          if (std::any_of(asked.begin(), asked.end(), [&](const Asked& a) { return a.slot == i; })) continue;
          if (best == kMaxHolders) {
            best = i;
            continue;
          }
          const Slot& b = s.slots[best];
          const int pa = sl.priority.load(std::memory_order_relaxed), pb = b.priority.load(std::memory_order_relaxed);
          if (pa < pb ||
              (pa == pb && sl.last_use.load(std::memory_order_relaxed) < b.last_use.load(std::memory_order_relaxed)))
            best = i;
        }
        if (best != kMaxHolders) {
          asked.push_back({best, ask_holder(lock, best, self, self_start, deadline)});
          asks_sent_.fetch_add(1, std::memory_order_relaxed);
          asked_now = true;
        }
      }
      if (!outstanding && !asked_now) {  // nobody left to ask
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
    const std::uint64_t used = used_bytes(s), free = used < s.budget ? s.budget - used : 0;
    if (free >= bytes) return take(lock, bytes), true;
    if (final && partial && free > 0) return take(lock, free), true;
    return false;
  };
  const int r = ask_until([&](Lock& lock) { return fit(lock, wait.count() <= 0); }, now, wait, min_idle);
  if (r != 0 || wait.count() <= 0) return got;
  return ask_until([&](Lock& lock) { return fit(lock, true); }, now, Nanos(0), min_idle) > 0 ? got : 0;
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
  if (lock.corrupt()) return corrupt(lock.why());
  if (!lock.ok()) return lock_not_obtained(lock.why());
  if (!own_slot_sound(lock.table()))
    return corrupt("the slot of this process (" + std::to_string(slot_) + ") was overwritten");
  if (!path_is_ours(fd_, path_)) return removed();
  set_problem({});
  reclaim(lock, ::getpid(), self_start_);
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

bool Ledger::repay_turn() {
  if (!shm_ || detached_ || !mine() || !usable()) return false;
  Lock lock(fd_, local_, shm_, kUseLockWait);
  if (lock.corrupt()) return corrupt(lock.why()), false;
  if (!lock.ok()) return false;  // the next end of a call looks again
  if (!own_slot_sound(lock.table()))
    return corrupt("the slot of this process (" + std::to_string(slot_) + ") was overwritten"), false;
  const int self = ::getpid();
  reclaim(lock, self, self_start_);
  const Shared& s = lock.table();
  if (used_bytes(s) <= s.budget) return false;
  std::uint32_t turn = kMaxHolders;
  for (std::uint32_t i = 0; i < kMaxHolders; ++i) {
    const Slot& sl = s.slots[i];
    if (!sl.occupied.load(std::memory_order_relaxed) || !askable(sl)) continue;
    if (turn == kMaxHolders) {
      turn = i;
      continue;
    }
    const Slot& b = s.slots[turn];
    const int pa = sl.priority.load(std::memory_order_relaxed), pb = b.priority.load(std::memory_order_relaxed);
    if (pa < pb || (pa == pb && sl.last_use.load(std::memory_order_relaxed) < b.last_use.load(std::memory_order_relaxed)))
      turn = i;
  }
  if (turn == slot_) return true;
  if (turn != kMaxHolders && s.slots[turn].ask.load(std::memory_order_relaxed) == 0) {
    (void)ask_holder(lock, turn, self, self_start_, monotonic_ns() + kAskWait.count());
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
    if (lock.corrupt() || (!lock.ok() && !covers_mapping()) || (lock.ok() && !own_slot_sound(lock.table()))) {
      broken_.store(true, std::memory_order_release);
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
      if (lock.corrupt() || (!lock.ok() && !covers_mapping()) || (lock.ok() && !own_slot_sound(lock.table()))) {
        broken_.store(true, std::memory_order_release);
        continue;
      }
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
      if (lock.corrupt() || (!lock.ok() && !covers_mapping())) {
        broken_.store(true, std::memory_order_release);
        continue;
      }
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

// --- reading for `residency stat` -------------------------------------------------------------

}  // namespace residency::ledger

namespace residency {

void cancel_shared_budget_waits() noexcept { ledger::g_joins_cancelled.store(true, std::memory_order_release); }

std::vector<SharedBudgetInfo> list_shared_budgets() {
  using namespace ledger;
  std::vector<SharedBudgetInfo> out;
  DIR* d = ::opendir(kDir);
  if (!d) return out;
  const std::string prefix = kPrefix;
  while (dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n.rfind(prefix, 0) != 0 || n.find(".tmp-") != std::string::npos) continue;
    SharedBudgetInfo info;
    info.name = n.substr(prefix.size());
    info.path = std::string(kDir) + "/" + n;
    // Anyone may make a FIFO, a socket or a link under this name: it is listed as what it is, and
    // never opened in a way that blocks (open_in_shm; an open of a FIFO without O_NONBLOCK waits
    // for a writer, forever).
    struct stat lst {};
    if (::lstat(info.path.c_str(), &lst) != 0) continue;  // gone meanwhile
    if (!S_ISREG(lst.st_mode)) {
      info.mode = lst.st_mode & 07777;
      info.error = not_a_ledger(info.path, lst.st_mode);
      out.push_back(std::move(info));
      continue;
    }
    const int fd = open_in_shm(info.path, O_RDONLY);
    if (fd < 0) continue;  // not readable by this user: not listed
    struct stat st {};
    if (::fstat(fd, &st) == 0) info.mode = st.st_mode & 07777;
    // A reader may look at a group's ledger it is not the owner of: check as a member would.
    const long group = st.st_uid != ::geteuid() ? static_cast<long>(st.st_gid) : -1;
    if (Status s = check_file(fd, info.path, group); !s) {
      info.error = s.message();
      ::close(fd);
      out.push_back(std::move(info));
      continue;
    }
    // A copy read with pread, not a mapping: another process may truncate the file meanwhile
    // (a mapping would fault), and every field is checked before it is shown.
    auto copy = std::make_unique<Shared>();
    const ssize_t got = ::pread(fd, static_cast<void*>(copy.get()), sizeof(Shared), 0);
    const int read_errno = errno;
    ::close(fd);
    const Shared* s = copy.get();
    std::string bad = got < 0 ? std::string("cannot read it: ") + std::strerror(read_errno)
                      : got != static_cast<ssize_t>(sizeof(Shared))
                          ? "it is " + std::to_string(got) + " bytes long, a ledger is " + std::to_string(sizeof(Shared))
                          : check_table(*s);
    if (!bad.empty()) {
      info.error = "the ledger " + info.path + " is corrupt: " + bad;
      out.push_back(std::move(info));
      continue;
    }
    info.size = s->budget;
    const std::int64_t now = monotonic_ns();
    for (const Slot& sl : s->slots) {
      if (!sl.occupied.load(std::memory_order_acquire)) continue;
      SharedBudgetHolder h;
      h.pid = sl.pid.load(std::memory_order_relaxed);
      h.bytes = sl.bytes.load(std::memory_order_relaxed);
      h.unmanaged = std::min<std::uint64_t>(h.bytes, std::uint64_t{sl.floor_mib.load(std::memory_order_relaxed)} << 20);
      h.priority = sl.priority.load(std::memory_order_relaxed);
      const std::int64_t lu = sl.last_use.load(std::memory_order_relaxed);
      if (lu > 0) h.idle = Nanos(std::max<std::int64_t>(0, now - lu));
      h.alive = holder_alive(h.pid, sl.start_time.load(std::memory_order_relaxed));
      const std::uint32_t ask = sl.ask.load(std::memory_order_relaxed);
      h.asked = ask != 0 && ask != kStopWord;
      info.used += h.bytes;
      info.holders.push_back(h);
    }
    out.push_back(std::move(info));
  }
  ::closedir(d);
  std::sort(out.begin(), out.end(), [](const SharedBudgetInfo& a, const SharedBudgetInfo& b) { return a.name < b.name; });
  return out;
}

}  // namespace residency

#else  // not Linux: shared budgets are refused with a message

struct Ledger::Shared {};

std::uint64_t process_start_time(int) { return 0; }
int lock_owner(const std::string&) { return 0; }
bool holder_alive(int, std::uint64_t) { return false; }

Result<std::unique_ptr<Ledger>> Ledger::attach(const AttachOptions&) {
  return Status(ErrorCode::unsupported,
                "RESIDENCY_SHARED_BUDGET: shared budgets between processes need Linux (a futex per holder, "
                "/proc for process identity); this build's platform has neither: unset it");
}
Ledger::~Ledger() = default;
void Ledger::listen(OnAsked) {}
bool Ledger::mine() const { return true; }
void Ledger::stop_listening() {}
void Ledger::detach_at_exit() {}
std::uint64_t Ledger::budget() const { return 0; }
void Ledger::publish_last_use(void*, std::int64_t) noexcept {}
std::uint64_t Ledger::acquire(std::uint64_t, std::int64_t, Nanos, bool, Nanos) { return 0; }
std::uint64_t Ledger::ask_to_free(std::uint64_t, std::int64_t, Nanos, Nanos, bool*) { return 0; }
std::uint64_t Ledger::over_budget() const { return 0; }
bool Ledger::repay_turn() { return false; }
void Ledger::set_floor(std::uint64_t) {}
std::uint64_t Ledger::take_over_budget(std::uint64_t) { return 0; }
std::string Ledger::problem() const { return {}; }
bool Ledger::usable() const { return false; }
void Ledger::release(std::uint64_t) {}
void Ledger::listen_loop(ListenerState&) {}

}  // namespace residency::ledger

namespace residency {
void cancel_shared_budget_waits() noexcept {}
std::vector<SharedBudgetInfo> list_shared_budgets() { return {}; }
}  // namespace residency

#endif
