// SPDX-License-Identifier: MIT
// The ledger's file (ledger_file.hpp): its checks, opening and creating it, and word access.
#include "ledger_file.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <vector>

#include "platform/proc_stat.hpp"

#if RESIDENCY_LEDGER_LINUX
#include <fcntl.h>
#include <grp.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>
#endif

namespace residency::ledger {

std::string ledger_path(const std::string& name) { return std::string(kDir) + "/" + kPrefix + name; }

#if RESIDENCY_LEDGER_LINUX

std::int64_t monotonic_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

namespace {
auto* word(std::atomic<std::uint32_t>& a) { return reinterpret_cast<std::uint32_t*>(&a); }
}  // namespace

long futex_wake(std::atomic<std::uint32_t>& a, int n) {
  return ::syscall(SYS_futex, word(a), FUTEX_WAKE, n, nullptr, nullptr, 0);
}

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

std::uint64_t used_bytes(const Shared& s, std::uint32_t with, std::uint64_t extra) {
  auto bytes_of = [&](std::uint32_t i) {
    return s.slots[i].bytes.load(std::memory_order_relaxed) + (i == with ? extra : 0);
  };
  std::uint64_t sum = 0;
  for (std::uint32_t i = 0; i < kMaxHolders; ++i) {
    const Slot& sl = s.slots[i];
    if (!sl.occupied.load(std::memory_order_relaxed)) continue;
    const std::uint64_t key = sl.shared_key.load(std::memory_order_relaxed);
    if (key == 0) {
      sum += bytes_of(i);
      continue;
    }
    // One of a key: counted by its first holder (the largest of them), the others not at all.
    bool first = true;
    std::uint64_t most = 0;
    for (std::uint32_t j = 0; j < kMaxHolders && first; ++j) {
      const Slot& o = s.slots[j];
      if (!o.occupied.load(std::memory_order_relaxed) || o.shared_key.load(std::memory_order_relaxed) != key) continue;
      if (j < i) first = false;
      most = std::max(most, bytes_of(j));
    }
    if (first) sum += most;
  }
  return sum;
}

int locker_of(int fd) {
  std::int32_t pid = 0;
  if (::pread(fd, &pid, sizeof pid, offsetof(Shared, locker)) != static_cast<ssize_t>(sizeof pid)) return 0;
  return pid > 0 ? pid : 0;
}

namespace {

bool in_group(gid_t gid) {
  if (::getegid() == gid) return true;
  const int n = ::getgroups(0, nullptr);
  if (n <= 0) return false;
  std::vector<gid_t> g(static_cast<std::size_t>(n));
  const int m = ::getgroups(n, g.data());
  return m > 0 && std::find(g.begin(), g.begin() + m, gid) != g.begin() + m;
}

}  // namespace

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

namespace {

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

}  // namespace

std::string not_a_ledger(const std::string& path, mode_t mode) {
  return path + " is " + file_kind(mode) + ", not a ledger; remove it";
}

int open_in_shm(const std::string& path, int access) {
  return ::open(path.c_str(), access | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
}

Status check_file(int fd, const std::string& path, long group, const std::string& group_name) {
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

Shared* map_ledger(int fd) {
  void* p = ::mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return p == MAP_FAILED ? nullptr : static_cast<Shared*>(p);
}

namespace {

// Creates a ledger under a temporary name and links it into place. Returns the descriptor, -1
// when another process linked one first (open that), or an error. The errors name the ledger's
// path, never the temporary name: that file is removed before the error is returned, and the path
// is what a user can look for in /dev/shm.
Result<int> create_ledger(const std::string& path, const std::string& name, std::uint64_t budget, long group,
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

Result<int> open_ledger(const std::string& path, const std::string& name, std::uint64_t budget, long group,
                        const std::string& group_name) {
  int fd = open_in_shm(path, O_RDWR);
  if (fd < 0 && errno == ENOENT) {
    auto made = create_ledger(path, name, budget, group, group_name);
    if (!made) return made.status();
    if (*made < 0) return -1;  // another process linked its ledger first: open that one
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
  if (Status st = check_file(fd, path, group, group_name); !st) {
    ::close(fd);
    return st;
  }
  return fd;
}

bool path_is_ours(int fd, const std::string& path) {
  struct stat held {
  }, at{};
  return ::fstat(fd, &held) == 0 && ::stat(path.c_str(), &at) == 0 && held.st_dev == at.st_dev && held.st_ino == at.st_ino;
}

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

#endif  // RESIDENCY_LEDGER_LINUX

}  // namespace residency::ledger
