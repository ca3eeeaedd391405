// CleanupRegistry and TempDir (see cleanup.hpp).
#include "workload/cleanup.hpp"

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <mutex>

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

// Async-signal-safe only: kill, unlink, rmdir, signal, raise; errno as it was found.
extern "C" void remove_on_signal(int sig) {
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

void CleanupRegistry::install_signal_handlers() {
  std::call_once(g_install_once, [] {
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
      struct sigaction old {};
      if (sigaction(sig, nullptr, &old) != 0) continue;
      if (old.sa_handler == SIG_IGN) continue;  // e.g. nohup: the user asked not to be interrupted
      struct sigaction sa {};
      sa.sa_handler = remove_on_signal;
      sigemptyset(&sa.sa_mask);
      sigaction(sig, &sa, nullptr);
    }
  });
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

Result<TempDir> TempDir::create(const std::string& parent, const std::string& prefix) {
  std::string tmpl = parent + "/" + prefix + "XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (mkdtemp(buf.data()) == nullptr) {
    return Status(ErrorCode::io_error,
                  "cannot create a temporary directory in " + parent + ": " + std::strerror(errno) +
                      " (set TMPDIR to a writable directory)");
  }
  TempDir d;
  d.path_ = buf.data();
  d.dir_slot_ = CleanupRegistry::add(d.path_);
  return d;
}

TempDir::TempDir(TempDir&& o) noexcept
    : path_(std::move(o.path_)), tracked_(std::move(o.tracked_)), dir_slot_(o.dir_slot_), keep_(o.keep_) {
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
  keep_ = true;
  for (auto& [file, slot] : tracked_) CleanupRegistry::forget(slot);
  tracked_.clear();
  CleanupRegistry::forget(dir_slot_);
  dir_slot_ = -1;
}

}  // namespace residency::workload
