// SPDX-License-Identifier: MIT
// CleanupRegistry and TempDir (see cleanup.hpp).
#include "workload/cleanup.hpp"

#include <stdio.h>  // renameat2, renamex_np

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <random>

#include "platform/proc_stat.hpp"
#include "residency/config.hpp"
#include "residency/text.hpp"

namespace residency::workload {
namespace {

// A benchmark run creates a handful of paths (a directory, a model, three result files); 32 slots
// leave room for tests that create several at once.
constexpr int kSlots = 32;
constexpr int kFree = 0, kWriting = 1, kActive = 2;

struct Slot {
  std::atomic<int> state{kFree};
  char path[PATH_MAX];
};
Slot g_slots[kSlots];
std::atomic<pid_t> g_child{0};
std::once_flag g_install_once;

// Whether `si` is the SIGPIPE the kernel raises in a thread of this process whose write met a
// pipe or socket with no reader (`| head` that has exited): it sends it as if by kill() from the
// writer itself (SI_USER, our own pid). A SIGPIPE from another process (kill -PIPE) or raise()
// (SI_TKILL) is not one.
bool own_broken_pipe(int sig, const siginfo_t* si) {
  return sig == SIGPIPE && si != nullptr && si->si_code == SI_USER && si->si_pid == getpid();
}

// Async-signal-safe only: kill, unlink, rmdir, signal, raise, getpid; errno as it was found.
//
// A write to a closed pipe is not a reason to die here: dying skips every destructor, so a
// shared-budget ledger in /dev/shm would outlive its last holder. That SIGPIPE is ignored, the
// write fails with EPIPE and the caller reports it and ends through its normal path (managers
// destroyed, ledger removed, files cleaned, one message, a non-zero exit). Every other caught
// signal, a SIGPIPE sent by someone else included, still removes the files and ends the process.
extern "C" void remove_on_signal(int sig, siginfo_t* si, void*) {
  if (own_broken_pipe(sig, si)) return;
  const int saved_errno = errno;  // the interrupted code may be about to read it
  const pid_t child = g_child.load();
  if (child > 0) kill(child, SIGKILL);
  for (int i = kSlots - 1; i >= 0; --i) {
    if (g_slots[i].state.load() == kActive) unlink(g_slots[i].path);
  }
  // Directories after files; twice so that a directory inside another one goes first.
  for (int pass = 0; pass < 2; ++pass) {
    for (int i = kSlots - 1; i >= 0; --i) {
      if (g_slots[i].state.load() == kActive) rmdir(g_slots[i].path);
    }
  }
  signal(sig, SIG_DFL);
  errno = saved_errno;
  raise(sig);  // delivered when the handler returns: the process ends as killed by `sig`
}

}  // namespace

const std::vector<int>& CleanupRegistry::signals() {
  // Every signal whose default action ends the process without a core dump, and SIGQUIT: the
  // ways a user, kill or a job controller ends a run (a closed pipe does not: own_broken_pipe). Crash signals (SIGSEGV,
  // SIGBUS, SIGABRT ...) are left to their defaults and sanitizers: the next run removes what they leave.
  static const std::vector<int> s = {SIGINT,  SIGTERM,   SIGHUP,  SIGQUIT, SIGPIPE, SIGUSR1, SIGUSR2,
                                     SIGALRM, SIGVTALRM, SIGPROF, SIGXCPU, SIGXFSZ, SIGIO};
  return s;
}

void CleanupRegistry::install_signal_handlers() {
  std::call_once(g_install_once, [] {
    for (int sig : signals()) {
      struct sigaction old {};
      if (sigaction(sig, nullptr, &old) != 0) continue;
      if (old.sa_handler == SIG_IGN) continue;  // e.g. nohup: the user asked not to be interrupted
      if (old.sa_handler != SIG_DFL) continue;  // someone else's handler (a test framework, an engine)
      struct sigaction sa {};
      sa.sa_sigaction = remove_on_signal;
      sa.sa_flags = SA_SIGINFO;
      sigemptyset(&sa.sa_mask);
      sigaction(sig, &sa, nullptr);
    }
  });
}

void CleanupRegistry::reset_signals_in_child() {
  for (int sig : signals()) {
    struct sigaction old {};
    if (sigaction(sig, nullptr, &old) == 0 && (old.sa_flags & SA_SIGINFO) != 0 && old.sa_sigaction == remove_on_signal)
      signal(sig, SIG_DFL);
  }
}

int CleanupRegistry::add(const std::string& path) {
  if (path.size() >= PATH_MAX) return -1;
  for (int i = 0; i < kSlots; ++i) {
    int expected = kFree;
    if (g_slots[i].state.compare_exchange_strong(expected, kWriting)) {
      std::memcpy(g_slots[i].path, path.c_str(), path.size() + 1);
      g_slots[i].state.store(kActive);
      return i;
    }
  }
  return -1;
}

void CleanupRegistry::forget(int slot) {
  if (slot >= 0 && slot < kSlots) g_slots[slot].state.store(kFree);
}

void CleanupRegistry::set_child(pid_t pid) { g_child.store(pid); }

namespace {

bool all_digits(std::string_view s) {
  return !s.empty() && s.size() <= 20 && s.find_first_not_of("0123456789") == std::string_view::npos;
}

}  // namespace

std::string owner_tag() {
  const std::string pid = std::to_string(getpid());
  const auto own = platform::read_own_proc_stat();
  return pid + "." + (own ? std::to_string(own->start_time) : std::string("0"));
}

std::optional<std::string> owner_tag_in(std::string_view name) {
  const std::size_t dot = name.find('.');
  if (dot == std::string_view::npos) return std::nullopt;
  std::size_t end = name.find('-', dot);
  if (end == std::string_view::npos) end = name.size();
  if (!all_digits(name.substr(0, dot)) || !all_digits(name.substr(dot + 1, end - dot - 1))) return std::nullopt;
  return std::string(name.substr(0, end));
}

bool owner_alive(std::string_view tag) {
  const std::size_t dot = tag.find('.');
  if (dot == std::string_view::npos) return true;
  const std::string pid(tag.substr(0, dot));
  if (!all_digits(pid)) return true;
  if (::access("/proc/self/stat", R_OK) != 0) {  // no /proc: only whether the pid exists
    long long n = 0;
    try {
      n = std::stoll(pid);
    } catch (...) {
      return true;
    }
    return n > 0 && n <= INT_MAX && (kill(static_cast<pid_t>(n), 0) == 0 || errno == EPERM);
  }
  // /proc names a process by its pid without leading zeros; anything else names none.
  int n = 0;
  const auto [end, ec] = std::from_chars(pid.data(), pid.data() + pid.size(), n);
  const bool named = ec == std::errc() && end == pid.data() + pid.size() && n > 0 && pid[0] != '0';
  const auto stat = named ? platform::read_proc_stat(n) : std::nullopt;
  if (!stat) return false;  // no such process
  return std::to_string(stat->start_time) == tag.substr(dot + 1);
}

int remove_dead_leftovers(const std::string& parent, const std::string& prefix) {
  const int pfd = ::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (pfd < 0) return 0;
  DIR* d = fdopendir(::dup(pfd));
  if (!d) {
    ::close(pfd);
    return 0;
  }
  std::vector<std::string> dead;
  while (const dirent* e = readdir(d)) {
    const std::string_view name = e->d_name;
    if (name.substr(0, prefix.size()) != prefix) continue;
    const auto tag = owner_tag_in(name.substr(prefix.size()));
    if (tag && !owner_alive(*tag)) dead.emplace_back(name);
  }
  closedir(d);
  int removed = 0;
  for (const auto& name : dead) {
    struct stat st {};
    if (fstatat(pfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || st.st_uid != geteuid()) continue;
    if (S_ISREG(st.st_mode)) {
      removed += unlinkat(pfd, name.c_str(), 0) == 0;
      continue;
    }
    if (!S_ISDIR(st.st_mode)) continue;
    // Opened without following a link, and checked again through the descriptor: what is removed
    // is what was checked, whatever is renamed meanwhile.
    const int dfd = openat(pfd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dfd < 0) continue;
    struct stat dst {};
    if (fstat(dfd, &dst) != 0 || dst.st_uid != geteuid() || dst.st_ino != st.st_ino) {
      ::close(dfd);
      continue;
    }
    DIR* inner = fdopendir(dfd);
    if (!inner) {
      ::close(dfd);
      continue;
    }
    while (const dirent* e = readdir(inner)) {
      const std::string_view n = e->d_name;
      if (n == "." || n == "..") continue;
      struct stat fst {};
      if (fstatat(dirfd(inner), e->d_name, &fst, AT_SYMLINK_NOFOLLOW) == 0 && !S_ISDIR(fst.st_mode)) {
        unlinkat(dirfd(inner), e->d_name, 0);
      }
    }
    closedir(inner);
    removed += unlinkat(pfd, name.c_str(), AT_REMOVEDIR) == 0;
  }
  ::close(pfd);
  return removed;
}

int rename_no_replace(const char* from, const char* to) {
#if defined(__linux__)
  const int rc = renameat2(AT_FDCWD, from, AT_FDCWD, to, RENAME_NOREPLACE);
  if (rc == 0 || (errno != EINVAL && errno != ENOSYS)) return rc;  // else: a filesystem without it
#elif defined(__APPLE__)
  const int rc = renamex_np(from, to, RENAME_EXCL);
  if (rc == 0 || (errno != ENOTSUP && errno != EINVAL)) return rc;
#endif
  if (::link(from, to) != 0) return -1;
  ::unlink(from);
  return 0;
}

Status check_writable(const std::string& dir, std::uint64_t bytes, const std::string& what) {
  auto fail = [&](int err) {
#if defined(__GLIBC__)
    const char* name = strerrorname_np(err);
#else
    const char* name = err == EROFS    ? "EROFS"
                       : err == ENOSPC ? "ENOSPC"
                       : err == EACCES ? "EACCES"
                       : err == EPERM  ? "EPERM"
                                       : nullptr;
#endif
    return Status(err == ENOSPC ? ErrorCode::limit_exceeded : ErrorCode::permission_denied,
                  what + ": cannot write there: " + std::strerror(err) + (name ? std::string(" (") + name + ")" : "") +
                      (err == ENOSPC ? "; free some space or choose another directory" : ""));
  };
  const std::string probe = dir + "/.residency-probe-" + owner_tag();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return fail(errno);
  const int slot = CleanupRegistry::add(probe);
  int err = 0;
  std::vector<char> zeros(64 << 10, 0);
  for (std::uint64_t done = 0; err == 0 && done < bytes;) {
    const ssize_t n = ::write(fd, zeros.data(),
                              static_cast<std::size_t>(std::min<std::uint64_t>(zeros.size(), bytes - done)));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) err = errno;
    else done += static_cast<std::uint64_t>(n);
  }
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  ::close(fd);
  ::unlink(probe.c_str());
  CleanupRegistry::forget(slot);
  if (err != 0) return fail(err);
  return {};
}

Result<TempDir> TempDir::create(const std::string& parent, const std::string& prefix) {
  remove_dead_leftovers(parent, prefix);
  std::string tmpl = parent + "/" + prefix + owner_tag() + "-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (mkdtemp(buf.data()) == nullptr) {
    return Status(ErrorCode::io_error, "cannot create a temporary directory in " + printable(parent) + ": " +
                                           std::strerror(errno) + " (set TMPDIR to a writable directory)");
  }
  TempDir d;
  d.path_ = buf.data();
  d.parent_ = parent;
  d.prefix_ = prefix;
  d.dir_slot_ = CleanupRegistry::add(d.path_);
  return d;
}

TempDir::TempDir(TempDir&& o) noexcept
    : path_(std::move(o.path_)),
      parent_(std::move(o.parent_)),
      prefix_(std::move(o.prefix_)),
      tracked_(std::move(o.tracked_)),
      dir_slot_(o.dir_slot_),
      keep_(o.keep_) {
  o.path_.clear();
  o.tracked_.clear();
  o.dir_slot_ = -1;
  o.keep_ = true;
}

TempDir::~TempDir() {
  if (path_.empty()) return;
  for (auto& [file, slot] : tracked_) {
    if (!keep_) unlink(file.c_str());
    CleanupRegistry::forget(slot);
  }
  if (!keep_) {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  CleanupRegistry::forget(dir_slot_);
}

std::string TempDir::track(const std::string& name) {
  std::string file = path_ + "/" + name;
  tracked_.emplace_back(file, CleanupRegistry::add(file));
  return file;
}

void TempDir::remove(const std::string& name) {
  const std::string file = path_ + "/" + name;
  for (auto it = tracked_.begin(); it != tracked_.end(); ++it) {
    if (it->first == file) {
      unlink(file.c_str());
      CleanupRegistry::forget(it->second);
      tracked_.erase(it);
      return;
    }
  }
  unlink(file.c_str());
}

void TempDir::keep() {
  if (keep_) return;
  keep_ = true;
  // Drop the owner tag from the name: <prefix>XXXXXX, never replacing anything.
  static constexpr char kChars[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  std::random_device rd;
  for (int attempt = 0; attempt < 100; ++attempt) {
    std::string name = prefix_;
    for (int i = 0; i < 6; ++i) name += kChars[rd() % (sizeof kChars - 1)];
    const std::string target = parent_ + "/" + name;
    if (rename_no_replace(path_.c_str(), target.c_str()) == 0) {
      path_ = target;
      break;
    }
    if (errno != EEXIST)
      break;  // the tagged name stays (a later run would take it for a leftover
              // once this process is gone); renaming in place does not fail so
  }
  for (auto& [file, slot] : tracked_) CleanupRegistry::forget(slot);
  tracked_.clear();
  CleanupRegistry::forget(dir_slot_);
  dir_slot_ = -1;
}

}  // namespace residency::workload
