// SPDX-License-Identifier: MIT
// The shared-memory ledger (ledger.hpp): layout, lock, holders, reclamation, asking.
#include "ledger.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

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
#include <time.h>
#include <unistd.h>
#endif

namespace residency::ledger {

namespace {
constexpr const char* kDir = "/dev/shm";
constexpr const char* kPrefix = "residency-budget-";
}  // namespace

std::string ledger_path(const std::string& name) { return std::string(kDir) + "/" + kPrefix + name; }

#if RESIDENCY_LEDGER_LINUX

// --- the layout in shared memory ------------------------------------------------------------

namespace {
constexpr std::uint64_t kMagic = 0x5245444752444c52ULL;  // "RLDRGDER" little-endian: residency ledger
constexpr std::uint32_t kStopWord = 0xffffffffu;          // our own slot's ask word: the listener stops

// One holder. Invariant: `used` is 1 exactly while pid/start_time name a holder; `bytes` is what
// that holder has reserved. Each is one aligned word, written under the ledger's lock (last_use
// and ask also without it: last_use by the holder's touch(), ask by askers and the listener).
struct alignas(64) Slot {
  std::atomic<std::uint32_t> ask;   // futex word: 0 nothing asked; else the asker's pid
  std::atomic<std::uint32_t> used;
  std::atomic<std::int32_t> pid;
  std::atomic<std::int32_t> priority;
  std::atomic<std::uint64_t> start_time;
  std::atomic<std::uint64_t> bytes;
  std::atomic<std::int64_t> last_use;  // CLOCK_MONOTONIC ns of the last use; 0: none yet
};
static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "the ledger needs lock-free 64-bit atomics");
}  // namespace

struct Ledger::Shared {
  // Fixed header: magic and version stay at these offsets in every format version, so that a
  // reader can name the version it found.
  std::uint64_t magic;
  std::uint32_t version;
  std::uint32_t layout_size;  // sizeof(Shared) of the creator: another layout is another format
  std::uint64_t budget;
  std::atomic<std::uint32_t> generation;  // futex word: bumped whenever bytes are given back
  std::atomic<std::uint32_t> retired;     // 1: unlinked by the last holder; open afresh
  char name[72];
  alignas(64) pthread_mutex_t mutex;      // robust, process-shared
  Slot slots[kMaxHolders];
};

namespace {

using Shared = Ledger::Shared;

std::int64_t monotonic_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

auto* word(std::atomic<std::uint32_t>& a) { return reinterpret_cast<std::uint32_t*>(&a); }

void futex_wake(std::atomic<std::uint32_t>& a, int n) {
  ::syscall(SYS_futex, word(a), FUTEX_WAKE, n, nullptr, nullptr, 0);
}
// Sleeps while `a` holds `expected`, at most `timeout` (nullptr: no limit).
void futex_wait(std::atomic<std::uint32_t>& a, std::uint32_t expected, const timespec* timeout) {
  ::syscall(SYS_futex, word(a), FUTEX_WAIT, expected, timeout, nullptr, 0);
}

std::string errno_text(int e) { return std::strerror(e); }

// The ledger's lock, repaired when its owner died inside it.
class Lock {
 public:
  explicit Lock(Shared* s) : s_(s) {
    int r = ::pthread_mutex_lock(&s_->mutex);
    if (r == EOWNERDEAD) {
      // The holder died mid-update; every field is one word and `used` is a sum, so all that is
      // left to repair is the dead holder's share, which reclaim() drops.
      ::pthread_mutex_consistent(&s_->mutex);
      r = 0;
    }
    ok_ = r == 0;
  }
  ~Lock() { unlock(); }
  // Unlocks now; the ledger must still be mapped. Called before it is unmapped inside the scope.
  void unlock() {
    if (ok_) ::pthread_mutex_unlock(&s_->mutex);
    ok_ = false;
  }
  Lock(const Lock&) = delete;
  Lock& operator=(const Lock&) = delete;
  bool ok() const { return ok_; }

 private:
  Shared* s_;
  bool ok_ = false;
};

std::uint64_t used_bytes(const Shared& s) {
  std::uint64_t sum = 0;
  for (const Slot& sl : s.slots)
    if (sl.used.load(std::memory_order_relaxed)) sum += sl.bytes.load(std::memory_order_relaxed);
  return sum;
}

void bump(Shared& s) {
  s.generation.fetch_add(1, std::memory_order_release);
  futex_wake(s.generation, INT32_MAX);
}

// With the lock held: drops every holder whose process is gone. Returns the bytes reclaimed.
std::uint64_t reclaim(Shared& s, int self_pid, std::uint64_t self_start) {
  std::uint64_t freed = 0;
  bool any = false;
  for (Slot& sl : s.slots) {
    if (!sl.used.load(std::memory_order_relaxed)) continue;
    const int pid = sl.pid.load(std::memory_order_relaxed);
    const std::uint64_t start = sl.start_time.load(std::memory_order_relaxed);
    if (pid == self_pid && start == self_start) continue;
    if (holder_alive(pid, start)) continue;
    freed += sl.bytes.load(std::memory_order_relaxed);
    sl.bytes.store(0, std::memory_order_relaxed);
    sl.ask.store(0, std::memory_order_relaxed);
    sl.used.store(0, std::memory_order_release);
    any = true;
  }
  if (any) bump(s);
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
      return Status(ErrorCode::invalid_argument, "RESIDENCY_SHARED_BUDGET: the group '" + group +
                                                     "' does not exist on this machine; name an existing group "
                                                     "(getent group) or leave the group out for a ledger private to this user");
    return out->gr_gid;
  }
}

// Checks an open ledger: a regular file of this user (or of our group with mode 0660), mode
// 0600 or 0660, magic, format version, layout size. `group`: the gid configured, or -1.
Status check_file(int fd, const std::string& path, long group) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return Status(ErrorCode::io_error, "cannot stat " + path + ": " + errno_text(errno));
  if (!S_ISREG(st.st_mode))
    return Status(ErrorCode::permission_denied, path + " is not a regular file; remove it (it is not a residency ledger)");
  const unsigned mode = st.st_mode & 07777;
  if (st.st_uid != ::geteuid()) {
    const bool group_ok = group >= 0 && mode == 0660 && st.st_gid == static_cast<gid_t>(group) && in_group(st.st_gid);
    if (!group_ok)
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
  if (st.st_size < static_cast<off_t>(sizeof head) || ::pread(fd, head, sizeof head, 0) != static_cast<ssize_t>(sizeof head))
    return Status(ErrorCode::invalid_argument, path + " is too short to be a residency ledger (" +
                                                   std::to_string(st.st_size) + " bytes); remove it");
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
  if (layout != sizeof(Shared) || st.st_size != static_cast<off_t>(sizeof(Shared)))
    return Status(ErrorCode::invalid_argument, path + " has version " + std::to_string(version) + " but a layout of " +
                                                   std::to_string(layout) + " bytes (" + std::to_string(st.st_size) +
                                                   " in the file); this build expects " + std::to_string(sizeof(Shared)) +
                                                   ": a build for another C library or ABI holds it; use another name");
  return {};
}

Shared* map(int fd, bool writable) {
  void* p = ::mmap(nullptr, sizeof(Shared), writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
  return p == MAP_FAILED ? nullptr : static_cast<Shared*>(p);
}

// Creates a ledger under a temporary name and links it into place. Returns the descriptor, -1
// when another process linked one first (open that), or an error.
Result<int> create(const std::string& path, const std::string& name, std::uint64_t budget, long group) {
  static std::atomic<unsigned> serial{0};
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(serial++);
  const int fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return Status(ErrorCode::io_error, "cannot create " + tmp + ": " + errno_text(errno) + " (is /dev/shm mounted and writable?)");
  auto fail = [&](const std::string& what) {
    const int e = errno;
    ::unlink(tmp.c_str());
    ::close(fd);
    return Status(ErrorCode::io_error, what + " " + tmp + ": " + errno_text(e));
  };
  if (::ftruncate(fd, sizeof(Shared)) != 0) return fail("cannot size");
  if (group >= 0 && ::fchown(fd, static_cast<uid_t>(-1), static_cast<gid_t>(group)) != 0)
    return fail("cannot give the group to (are you a member of it?)");
  if (::fchmod(fd, group >= 0 ? 0660 : 0600) != 0) return fail("cannot set the mode of");
  Shared* s = map(fd, true);
  if (!s) return fail("cannot map");
  // The file is zero-filled: every atomic and slot starts at 0 (free). Only the mutex needs work.
  pthread_mutexattr_t a;
  ::pthread_mutexattr_init(&a);
  ::pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
  ::pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
  const int r = ::pthread_mutex_init(&s->mutex, &a);
  ::pthread_mutexattr_destroy(&a);
  s->budget = budget;
  std::snprintf(s->name, sizeof s->name, "%s", name.c_str());
  s->version = kFormatVersion;
  s->layout_size = sizeof(Shared);
  s->magic = kMagic;
  ::munmap(s, sizeof(Shared));
  if (r != 0) {
    errno = r;
    return fail("cannot initialise the lock of");
  }
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
  if (pid <= 0) return 0;
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return 0;
  const std::size_t close = line.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream fields(line.substr(close + 1));
  std::string state;
  fields >> state;  // field 3
  if (state == "Z" || state == "X" || state == "x") return 0;
  std::string f;
  for (int i = 4; i < 22 && fields >> f; ++i) {
  }
  std::uint64_t start = 0;
  if (!(fields >> start)) return 0;
  return start;
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
  constexpr int kTries = 16;  // each retry means another process created or retired it just now
  for (int attempt = 0; attempt < kTries; ++attempt) {
    int fd = ::open(path.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT) {
      auto made = create(path, o.name, o.budget, group);
      if (!made) return made.status();
      if (*made < 0) continue;  // another process linked its ledger first: open that one
      fd = *made;
    } else if (fd < 0) {
      const int e = errno;
      return Status(e == EACCES ? ErrorCode::permission_denied : ErrorCode::io_error,
                    "cannot open the shared budget ledger " + path + ": " + errno_text(e) +
                        (e == EACCES ? " (it belongs to another user; use another budget name)" : ""));
    }
    if (Status st = check_file(fd, path, group); !st) {
      ::close(fd);
      return st;
    }
    Shared* s = map(fd, true);
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
      Lock lock(s);
      if (!lock.ok()) {
        l->shm_ = nullptr;  // nothing of ours is in it
        ::munmap(s, sizeof(Shared));
        return Status(ErrorCode::backend_error, "the lock of " + path + " cannot be taken (not recoverable); remove the file");
      }
      if (s->retired.load(std::memory_order_acquire)) {
        // Its last holder removed it after we opened it: open (or create) the one in place now.
        // Unlocked before the unmap (a mutex unlocked in unmapped memory crashes, and the robust
        // list would point there: the kernel could never mark the owner dead).
        lock.unlock();
        l->shm_ = nullptr;
        ::munmap(s, sizeof(Shared));
        continue;
      }
      reclaim(*s, self, self_start);
      std::uint32_t slot = kMaxHolders;
      for (std::uint32_t i = 0; i < kMaxHolders; ++i)
        if (!s->slots[i].used.load(std::memory_order_relaxed)) {
          slot = i;
          break;
        }
      if (slot == kMaxHolders) {
        lock.unlock();
        l->shm_ = nullptr;
        ::munmap(s, sizeof(Shared));
        return Status(ErrorCode::limit_exceeded, "the shared budget " + o.name + " has " + std::to_string(kMaxHolders) +
                                                     " holders already (the most a ledger keeps); use another budget name");
      }
      Slot& sl = s->slots[slot];
      sl.ask.store(0, std::memory_order_relaxed);
      sl.pid.store(self, std::memory_order_relaxed);
      sl.start_time.store(self_start, std::memory_order_relaxed);
      sl.priority.store(o.priority, std::memory_order_relaxed);
      sl.bytes.store(0, std::memory_order_relaxed);
      sl.last_use.store(0, std::memory_order_relaxed);
      sl.used.store(1, std::memory_order_release);
      l->slot_ = slot;
      if (s->budget != o.budget) l->requested_budget_ = o.budget;
    }
    return l;
  }
  return Status(ErrorCode::io_error, "could not open the shared budget ledger " + path + " after " +
                                         std::to_string(kTries) + " tries (other processes keep creating and removing it)");
}

namespace {
// With nothing held: frees our slot, reclaims the dead, and retires + unlinks the ledger when no
// holder is left (under the lock, so that an opener waiting for it sees `retired`).
// Whether the file at `path` is the one open as `fd` (a ledger removed from outside, rm or
// systemd's RemoveIPC, may have been replaced by another process's new one: that one is not ours
// to remove).
bool path_is_ours(int fd, const std::string& path) {
  struct stat held {}, at {};
  return ::fstat(fd, &held) == 0 && ::stat(path.c_str(), &at) == 0 && held.st_dev == at.st_dev && held.st_ino == at.st_ino;
}

void leave(Shared* s, std::uint32_t slot, const std::string& path, int fd) {
  const int self = ::getpid();
  Slot& sl = s->slots[slot];
  const std::uint64_t self_start = sl.start_time.load(std::memory_order_relaxed);
  Lock lock(s);
  sl.bytes.store(0, std::memory_order_relaxed);
  sl.ask.store(0, std::memory_order_relaxed);
  sl.used.store(0, std::memory_order_release);
  if (lock.ok()) {
    reclaim(*s, self, self_start);
    bool anyone = false;
    for (const Slot& o : s->slots) anyone = anyone || o.used.load(std::memory_order_relaxed) != 0;
    if (!anyone) {
      s->retired.store(1, std::memory_order_release);
      if (path_is_ours(fd, path)) ::unlink(path.c_str());
    }
  }
  bump(*s);
}
}  // namespace

bool Ledger::mine() const { return ::getpid() == owner_pid_; }

Ledger::~Ledger() {
  if (!mine()) {
    // A fork child: the listener thread is the parent's (it does not run here) and the slot too.
    if (listener_.joinable()) listener_.detach();
    if (shm_) ::munmap(shm_, sizeof(Shared));
    if (fd_ >= 0) ::close(fd_);
    return;
  }
  stop_listening();
  if (!shm_) return;
  if (!detached_) leave(shm_, slot_, path_, fd_);
  ::munmap(shm_, sizeof(Shared));
  ::close(fd_);
}

void Ledger::detach_at_exit() {
  if (!shm_ || detached_ || held_ != 0 || !mine()) return;
  stopping_.store(true, std::memory_order_release);
  Slot& mine = shm_->slots[slot_];
  mine.ask.store(kStopWord, std::memory_order_release);
  futex_wake(mine.ask, 1);
  // The listener returns at once now: join it, so that nothing of ours runs past exit (and no
  // thread is left unjoined for a sanitizer to report).
  if (listener_.joinable() && listener_.get_id() != std::this_thread::get_id()) listener_.join();
  detached_ = true;
  leave(shm_, slot_, path_, fd_);
}

std::uint64_t Ledger::budget() const { return shm_->budget; }

std::atomic<std::int64_t>& Ledger::last_use() { return shm_->slots[slot_].last_use; }

std::uint64_t Ledger::acquire(std::uint64_t bytes, Nanos wait, bool partial) {
  if (bytes == 0 || detached_ || !mine()) return 0;
  Shared& s = *shm_;
  const int self = ::getpid();
  Slot& mine = s.slots[slot_];
  const std::uint64_t self_start = mine.start_time.load(std::memory_order_relaxed);
  auto take = [&](std::uint64_t n) {
    mine.bytes.store(mine.bytes.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
    held_ += n;
    return n;
  };
  const std::int64_t deadline = monotonic_ns() + wait.count();
  struct Asked {
    std::uint32_t slot;
    int pid;
  };
  std::vector<Asked> asked;
  while (wait.count() > 0) {
    std::uint32_t gen = 0;
    bool outstanding = false, asked_now = false;
    {
      Lock lock(&s);
      if (!lock.ok()) return 0;
      reclaim(s, self, self_start);
      const std::uint64_t used = used_bytes(s);
      if (used <= s.budget && s.budget - used >= bytes) return take(bytes);
      for (const Asked& a : asked) {
        const Slot& sl = s.slots[a.slot];
        if (sl.used.load(std::memory_order_relaxed) && sl.pid.load(std::memory_order_relaxed) == a.pid &&
            sl.ask.load(std::memory_order_relaxed) != 0)
          outstanding = true;
      }
      if (!outstanding) {
        // The holder to ask: priority <= ours, idle at least kIdleBeforeAsked, holding bytes;
        // lowest priority first, then the one idle longest.
        const std::int64_t idle_before = monotonic_ns() - kIdleBeforeAsked.count();
        std::uint32_t best = kMaxHolders;
        for (std::uint32_t i = 0; i < kMaxHolders; ++i) {
          const Slot& sl = s.slots[i];
          if (i == slot_ || !sl.used.load(std::memory_order_relaxed) || sl.bytes.load(std::memory_order_relaxed) == 0 ||
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
          if (pa < pb || (pa == pb && sl.last_use.load(std::memory_order_relaxed) < b.last_use.load(std::memory_order_relaxed)))
            best = i;
        }
        if (best != kMaxHolders) {
          Slot& v = s.slots[best];
          v.ask.store(static_cast<std::uint32_t>(self), std::memory_order_release);
          futex_wake(v.ask, 1);
          asked.push_back({best, v.pid.load(std::memory_order_relaxed)});
          asks_sent_.fetch_add(1, std::memory_order_relaxed);
          asked_now = true;
        }
      }
      gen = s.generation.load(std::memory_order_acquire);
    }
    if (!outstanding && !asked_now) break;  // nobody left to ask
    const std::int64_t left = deadline - monotonic_ns();
    if (left <= 0) break;
    const timespec ts{static_cast<time_t>(left / 1'000'000'000), static_cast<long>(left % 1'000'000'000)};
    futex_wait(s.generation, gen, &ts);
  }
  Lock lock(&s);
  if (!lock.ok()) return 0;
  reclaim(s, self, self_start);
  const std::uint64_t used = used_bytes(s);
  const std::uint64_t free = used < s.budget ? s.budget - used : 0;
  if (free >= bytes) return take(bytes);
  return partial ? take(free) : 0;
}

void Ledger::release(std::uint64_t bytes) {
  bytes = std::min(bytes, held_);
  if (bytes == 0 || detached_ || !mine()) return;
  Slot& mine = shm_->slots[slot_];
  {
    Lock lock(shm_);  // even if it could not be taken, our own slot is ours to write
    mine.bytes.store(mine.bytes.load(std::memory_order_relaxed) - bytes, std::memory_order_relaxed);
    held_ -= bytes;
    shm_->generation.fetch_add(1, std::memory_order_release);
  }
  futex_wake(shm_->generation, INT32_MAX);
}

void Ledger::listen(OnAsked on_asked) {
  if (listener_.joinable() || !shm_) return;
  on_asked_ = std::move(on_asked);
  listener_ = std::thread([this] { listen_loop(); });
}

void Ledger::stop_listening() {
  if (!listener_.joinable()) return;
  if (!mine()) {  // a fork child: the thread is the parent's
    listener_.detach();
    return;
  }
  if (detached_) {  // told to stop at exit already; the slot is not ours to write
    listener_.join();
    return;
  }
  stopping_.store(true, std::memory_order_release);
  Slot& mine = shm_->slots[slot_];
  mine.ask.store(kStopWord, std::memory_order_release);
  futex_wake(mine.ask, 1);
  listener_.join();
  mine.ask.store(0, std::memory_order_relaxed);
}

void Ledger::listen_loop() {
  // Signals go to the process's other threads: this one only ever wakes when asked.
  sigset_t all;
  sigfillset(&all);
  ::pthread_sigmask(SIG_BLOCK, &all, nullptr);
  ::pthread_setname_np(::pthread_self(), "residency-ask");
  listener_tid_.store(static_cast<int>(::syscall(SYS_gettid)), std::memory_order_relaxed);
  Slot& mine = shm_->slots[slot_];
  for (;;) {
    const std::uint32_t v = mine.ask.load(std::memory_order_acquire);
    if (stopping_.load(std::memory_order_acquire)) return;
    if (v == 0) {
      futex_wait(mine.ask, 0, nullptr);
      continue;
    }
    if (v != kStopWord && on_asked_) on_asked_(static_cast<int>(v));
    asks_answered_.fetch_add(1, std::memory_order_relaxed);
    {
      Lock lock(shm_);
      std::uint32_t expected = v;
      mine.ask.compare_exchange_strong(expected, 0, std::memory_order_acq_rel);  // kStopWord stays
      shm_->generation.fetch_add(1, std::memory_order_release);
    }
    futex_wake(shm_->generation, INT32_MAX);
  }
}

// --- reading for `residency stat` -------------------------------------------------------------

}  // namespace residency::ledger

namespace residency {

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
    const int fd = ::open(info.path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
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
    const Shared* s = map(fd, false);
    ::close(fd);
    if (!s) {
      info.error = "cannot map " + info.path + ": " + std::strerror(errno);
      out.push_back(std::move(info));
      continue;
    }
    info.size = s->budget;
    const std::int64_t now = monotonic_ns();
    for (const Slot& sl : s->slots) {
      if (!sl.used.load(std::memory_order_acquire)) continue;
      SharedBudgetHolder h;
      h.pid = sl.pid.load(std::memory_order_relaxed);
      h.bytes = sl.bytes.load(std::memory_order_relaxed);
      h.priority = sl.priority.load(std::memory_order_relaxed);
      const std::int64_t lu = sl.last_use.load(std::memory_order_relaxed);
      if (lu > 0) h.idle = Nanos(std::max<std::int64_t>(0, now - lu));
      h.alive = holder_alive(h.pid, sl.start_time.load(std::memory_order_relaxed));
      const std::uint32_t ask = sl.ask.load(std::memory_order_relaxed);
      h.asked = ask != 0 && ask != 0xffffffffu;
      info.used += h.bytes;
      info.holders.push_back(h);
    }
    ::munmap(const_cast<Shared*>(s), sizeof(Shared));
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
std::atomic<std::int64_t>& Ledger::last_use() {
  static std::atomic<std::int64_t> none{0};
  return none;
}
std::uint64_t Ledger::acquire(std::uint64_t, Nanos, bool) { return 0; }
void Ledger::release(std::uint64_t) {}
void Ledger::listen_loop() {}

}  // namespace residency::ledger

namespace residency {
std::vector<SharedBudgetInfo> list_shared_budgets() { return {}; }
}  // namespace residency

#endif
