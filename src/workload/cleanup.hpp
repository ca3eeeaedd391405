// Files the benchmark creates are removed on every way out: normal return, error, exception,
// and SIGINT / SIGTERM / SIGHUP.
//
// A 1 GiB model left in /tmp by an interrupted benchmark is the kind of mess a user finds weeks
// later. RAII covers returns and exceptions; a signal needs a handler, and a handler may only make
// async-signal-safe calls. So the paths to remove are copied into fixed slots up front, and the
// handler does nothing but unlink()/rmdir() those slots (newest first: files before their
// directory), kill() a child the benchmark is waiting for (the memory hog), then re-raise the
// signal with its default action, so the exit status still says "killed by SIGINT".
#pragma once

#include <sys/types.h>

#include <string>
#include <utility>
#include <vector>

#include "residency/status.hpp"

namespace residency::workload {

class CleanupRegistry {
 public:
  // Installs the handlers once (idempotent); they stay for the life of the process and do nothing
  // while no slot is in use.
  static void install_signal_handlers();
  // Registers a path (file or empty-at-exit directory) for removal on a signal. Returns a slot id,
  // or -1 when every slot is taken or the path is too long (RAII removal still happens).
  static int add(const std::string& path);
  // Forgets a slot (the path was removed or must be kept).
  static void forget(int slot);
  // The child process to kill on a signal (0: none).
  static void set_child(pid_t pid);
};

// A directory made with mkdtemp, removed with its contents when the object dies, unless keep()
// is called. Files created inside should be announced with track() so a signal removes them too.
class TempDir {
 public:
  // Creates <parent>/<prefix>XXXXXX.
  static Result<TempDir> create(const std::string& parent, const std::string& prefix);
  TempDir(TempDir&& o) noexcept;
  TempDir& operator=(TempDir&&) = delete;
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir();

  const std::string& path() const { return path_; }
  // The path of `name` inside the directory, registered for removal on a signal.
  std::string track(const std::string& name);
  // Removes one tracked file now.
  void remove(const std::string& name);
  // Keep the directory and what is in it; nothing is removed any more.
  void keep();

 private:
  TempDir() = default;
  std::string path_;
  std::vector<std::pair<std::string, int>> tracked_;  // (full path, slot)
  int dir_slot_ = -1;
  bool keep_ = false;
};

}  // namespace residency::workload
