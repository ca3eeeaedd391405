// SPDX-License-Identifier: MIT
#include "state_file.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <utility>

#include "platform/proc_stat.hpp"

#if defined(__linux__)
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

namespace residency::core {

std::optional<std::uint64_t> process_start_time(int pid) {
  const auto stat = platform::read_proc_stat(pid);
  if (!stat) return std::nullopt;
  return stat->start_time;
}

#if defined(__linux__)
namespace {

// The live state files of this process, for the exit handler; guarded by registry_mu(), which
// is also held for every write so that no file is written after the handler removed them all.
// Never destroyed: exit() may run the handler after other statics are gone.
std::mutex& registry_mu() {
  static auto* m = new std::mutex;
  return *m;
}
std::set<StateFile*>& registry() {
  static auto* s = new std::set<StateFile*>;
  return *s;
}
bool exiting = false;  // guarded by registry_mu()
// The process whose files the registry holds: a fork child's exit must not wait on a mutex
// another thread of the parent held at fork(), nor remove the parent's files.
std::atomic<int> registry_pid{0};

// What set_state_engine() set, written into every snapshot; guarded by registry_mu(), never
// destroyed (as the registry).
std::string& engine() {
  static auto* e = new std::string;
  return *e;
}

unsigned next_manager_number() {
  static std::atomic<unsigned> n{0};
  return n.fetch_add(1, std::memory_order_relaxed);
}

std::string name_for(unsigned n) {
  return std::string(kStatePrefix) + std::to_string(::getuid()) + "." + std::to_string(::getpid()) + "." +
         std::to_string(n);
}

// The state files this user's dead processes left (a process killed by a signal runs no exit
// handler): removed once per process, at its first publish, so that they do not pile up.
void sweep_stale_files() {
  const std::string mine = std::string(kStatePrefix) + std::to_string(::getuid()) + ".";
  std::set<int> pids;
  if (DIR* d = ::opendir(kStateDir)) {
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n.rfind(mine, 0) != 0) continue;
      const std::string rest = n.substr(mine.size());
      const auto dot = rest.find('.');
      const std::string pid = rest.substr(0, dot);
      if (dot == std::string::npos || pid.empty() || pid.size() > 9 ||
          pid.find_first_not_of("0123456789") != std::string::npos)
        continue;
      if (const int p = std::stoi(pid); p != ::getpid()) pids.insert(p);
    }
    ::closedir(d);
  }
  // Dead pids only: a reused pid's file is left to `residency stat --pid`, which names it stale.
  for (int p : pids)
    if (!process_start_time(p)) (void)read_state_files(p, ::getuid(), std::nullopt);
}

bool write_all(int fd, const std::string& s) {
  std::size_t off = 0;
  while (off < s.size()) {
    const ssize_t w = ::write(fd, s.data() + off, s.size() - off);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    off += static_cast<std::size_t>(w);
  }
  return true;
}

}  // namespace

void remove_state_files_at_exit() {
  if (registry_pid.load() != ::getpid()) return;
  std::unique_lock<std::mutex> g(registry_mu(), std::defer_lock);
  for (int i = 0; i < 100 && !g.try_lock(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (!g.owns_lock()) return;  // a writer is stuck: the reader reports the file stale later
  exiting = true;
  for (StateFile* f : registry()) f->remove();
}

StateFile::StateFile()
    : owner_pid_(::getpid()),
      start_time_(process_start_time(owner_pid_)),
      path_(std::string(kStateDir) + "/" + name_for(next_manager_number())),
      tmp_(std::string(kStateDir) + "/." + path_.substr(std::strlen(kStateDir) + 1) + ".tmp") {}

StateFile::~StateFile() {
  if (::getpid() != owner_pid_) return;
  std::lock_guard<std::mutex> g(registry_mu());
  registry().erase(this);
  remove();
}

void StateFile::remove() {
  if (written_) ::unlink(path_.c_str());
  written_ = false;
}

std::string StateFile::why_not() {
  std::lock_guard<std::mutex> g(registry_mu());
  return std::exchange(why_not_, std::string());
}

bool StateFile::publish(const std::string& body) {
  if (::getpid() != owner_pid_) return false;  // a fork child: the file is the parent's
  const auto& start = start_time_;
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  char updated[32];
  std::snprintf(updated, sizeof updated, "%.3f", now);
  const std::string head = std::string(kStateHeader) + "\npid=" + std::to_string(owner_pid_) +
                           "\nstart_time=" + (start ? std::to_string(*start) : std::string()) +
                           "\nuid=" + std::to_string(::getuid()) + "\nmanager=" + path_.substr(path_.rfind('.') + 1) +
                           "\nupdated=" + updated + "\n";

  std::lock_guard<std::mutex> g(registry_mu());
  if (exiting || failed_) return false;
  const std::string text = head + (engine().empty() ? std::string() : "engine=" + engine() + "\n") + body;
  static std::once_flag at_exit;
  std::call_once(at_exit, [] {
    std::atexit(remove_state_files_at_exit);
    sweep_stale_files();
  });
  registry_pid.store(owner_pid_);
  registry().insert(this);
  auto fail = [&](const char* what) {
    why_not_ = std::string("state file ") + path_ + ": " + what + ": " + std::strerror(errno) +
               "; `residency stat --pid` will not show this manager (RESIDENCY_STATE_FILE=0 turns this off)";
    ::unlink(tmp_.c_str());
    failed_ = true;
    return false;
  };
  constexpr int kFlags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
  int fd = ::open(tmp_.c_str(), kFlags, 0600);
  if (fd < 0 && errno == EEXIST) {  // left by a writer of this uid that died mid-write (a reused pid)
    ::unlink(tmp_.c_str());
    fd = ::open(tmp_.c_str(), kFlags, 0600);
  }
  if (fd < 0) {
    failed_ = true;  // nothing of ours to unlink
    why_not_ = std::string("state file ") + tmp_ + ": cannot create: " + std::strerror(errno) +
               "; `residency stat --pid` will not show this manager (RESIDENCY_STATE_FILE=0 turns this off)";
    return false;
  }
  const bool ok = ::fchmod(fd, 0600) == 0 && write_all(fd, text);
  if (::close(fd) != 0 || !ok) return fail("cannot write");
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) return fail("cannot rename the new snapshot over it");
  written_ = true;
  return true;
}

void set_state_engine(const std::string& value) {
  std::string line = value;
  for (char& c : line)
    if (c == '\n' || c == '\r') c = ' ';
  std::lock_guard<std::mutex> g(registry_mu());
  engine() = std::move(line);
}

std::vector<StateFileRead> read_state_files(int pid, uid_t owner_uid, std::optional<std::uint64_t> start_time,
                                            const std::string& dir) {
  std::vector<StateFileRead> out;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return out;
  const std::string suffix = "." + std::to_string(pid) + ".";
  std::vector<std::pair<std::string, unsigned long>> names;  // name, uid in the name
  while (dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n.rfind(kStatePrefix, 0) != 0) continue;
    // residency-state.<uid>.<pid>.<n>, all decimal.
    const std::string rest = n.substr(std::strlen(kStatePrefix));
    const auto dot = rest.find('.');
    if (dot == std::string::npos || dot == 0) continue;
    const std::string uid = rest.substr(0, dot), tail = rest.substr(dot);
    if (tail.rfind(suffix, 0) != 0) continue;
    const std::string num = tail.substr(suffix.size());
    auto digits = [](const std::string& s) {
      return !s.empty() && s.size() <= 10 && s.find_first_not_of("0123456789") == std::string::npos;
    };
    if (!digits(uid) || !digits(num)) continue;
    names.emplace_back(n, std::stoul(uid));
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());

  for (const auto& [name, name_uid] : names) {
    StateFileRead r;
    r.path = dir + "/" + name;
    const int fd = ::open(r.path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
      r.error = std::string("not readable: ") + std::strerror(errno);
      out.push_back(std::move(r));
      continue;
    }
    struct stat st {};
    std::string text;
    if (::fstat(fd, &st) != 0) {
      r.error = std::string("cannot stat: ") + std::strerror(errno);
    } else if (!S_ISREG(st.st_mode)) {
      r.error = "not read: not a regular file";
    } else if (st.st_uid != owner_uid || st.st_uid != name_uid) {
      // Somebody else's file carrying this process's name: never trusted, never shown.
      r.error = "not read: owned by uid " + std::to_string(st.st_uid) + ", not by the process's user (uid " +
                std::to_string(owner_uid) + ")";
    } else if ((st.st_mode & 077) != 0) {
      char mode[8];
      std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
      r.error = std::string("not read: mode ") + mode + ", other users could read or write it (a state file is 0600)";
    } else if (st.st_size > 64 * 1024) {
      r.error = "not read: larger than 64 KiB";
    } else {
      char buf[4096];
      for (;;) {
        const ssize_t n = ::read(fd, buf, sizeof buf);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0 || text.size() > 64 * 1024) break;
        text.append(buf, static_cast<std::size_t>(n));
      }
    }
    ::close(fd);
    if (r.error.empty()) {
      std::istringstream in(text);
      std::string line;
      if (!std::getline(in, line) || line != kStateHeader) {
        r.error = "not a state file of this format (first line is not '" + std::string(kStateHeader) + "')";
      } else {
        while (std::getline(in, line)) {
          const auto eq = line.find('=');
          if (eq != std::string::npos) r.fields[line.substr(0, eq)] = line.substr(eq + 1);
        }
        const auto it = r.fields.find("start_time");
        r.stale = !start_time || it == r.fields.end() || it->second != std::to_string(*start_time) ||
                  r.fields["pid"] != std::to_string(pid);
        if (r.stale && st.st_uid == ::geteuid()) r.removed = ::unlink(r.path.c_str()) == 0;
      }
    }
    out.push_back(std::move(r));
  }
  return out;
}

#else  // no /proc, no /dev/shm: nothing is published

void remove_state_files_at_exit() {}
void set_state_engine(const std::string&) {}
StateFile::StateFile() : owner_pid_(0), start_time_(std::nullopt) {}
StateFile::~StateFile() = default;
void StateFile::remove() {}
std::string StateFile::why_not() { return {}; }
bool StateFile::publish(const std::string&) { return false; }
std::vector<StateFileRead> read_state_files(int, uid_t, std::optional<std::uint64_t>, const std::string&) { return {}; }

#endif

}  // namespace residency::core
