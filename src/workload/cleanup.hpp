// SPDX-License-Identifier: MIT
// Files the benchmark creates are removed on every way out: normal return, error, exception,
// and every signal whose default action ends the process and that a handler can catch (SIGINT,
// SIGTERM, SIGHUP, SIGQUIT, SIGPIPE from kill, SIGUSR1, SIGALRM, ...). What SIGKILL (or a
// crash) leaves is recognised by its name, which carries its owner (pid and start time), and
// removed by the next run once that owner is gone.
//
// A 1 GiB model left in /tmp by an interrupted benchmark is the kind of mess a user finds weeks
// later. RAII covers returns and exceptions; a signal needs a handler, and a handler may only make
// async-signal-safe calls. So the paths to remove are copied into fixed slots up front, and the
// handler does nothing but unlink()/rmdir() those slots (newest first: files before their
// directory), kill() a child the benchmark is waiting for (the memory hog), then re-raise the
// signal with its default action, so the exit status still says "killed by SIGINT".
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "residency/status.hpp"

namespace residency::workload {

class CleanupRegistry {
 public:
  // Installs the handlers once (idempotent); they stay for the life of the process and do nothing
  // while no slot is in use. The one exception to "remove, then re-raise" is the SIGPIPE the
  // kernel raises for this process's own write to a closed pipe: the handler ignores it, so that
  // the write fails with EPIPE and the program ends through its normal path (a shared-budget
  // ledger is only removed there); a SIGPIPE another process sends is caught like the rest.
  static void install_signal_handlers();
  // Registers a path (file or empty-at-exit directory) for removal on a signal. Returns a slot id,
  // or -1 when every slot is taken or the path is too long (RAII removal still happens).
  static int add(const std::string& path);
  // Forgets a slot (the path was removed or must be kept).
  static void forget(int slot);
  // The child process to kill on a signal (0: none).
  static void set_child(pid_t pid);
  // In a child after fork(): every signal the handlers catch back to its default action.
  static void reset_signals_in_child();
  // The signals the handlers catch.
  static const std::vector<int>& signals();
};

// This process as temporary names carry it: "<pid>.<start time>" (clock ticks after boot, from
// /proc/self/stat), so that a later run can tell a dead owner from a live one, and a reused pid
// from the process that made the name.
std::string owner_tag();
// Whether the process `tag` names (an owner_tag() of some process) is still running. Unsure
// (no /proc) counts as running.
bool owner_alive(std::string_view tag);
// The owner tag at the start of `name` ("<pid>.<start>" followed by '-' or the end), if any.
std::optional<std::string> owner_tag_in(std::string_view name);
// Removes, inside `parent`, the leftovers of dead runs: directories named <prefix><tag>-* and
// files named <prefix><tag>-* whose owner is dead and that belong to this user. A directory's
// plain files are removed with it (never anything below a subdirectory, never through a symbolic
// link). Returns how many were removed.
int remove_dead_leftovers(const std::string& parent, const std::string& prefix);

// rename(from, to) that never replaces an existing `to` (EEXIST instead): renameat2
// RENAME_NOREPLACE on Linux, renamex_np RENAME_EXCL on Apple, else link + unlink. 0 or -1 (errno).
int rename_no_replace(const char* from, const char* to);

// Whether `dir` (an existing directory) takes `bytes` of new files: a probe file of that size is
// written, synced and removed, so that a read-only filesystem (EROFS), a full one (ENOSPC) or a
// directory without permission (EACCES, also for root on a root-squashed mount) is found before a
// long run rather than after it. The error names `what` (e.g. "--out DIR"), the reason and errno's
// name.
Status check_writable(const std::string& dir, std::uint64_t bytes, const std::string& what);

// A directory made with mkdtemp, removed with its contents when the object dies, unless keep()
// is called. Files created inside should be announced with track() so a signal removes them too.
class TempDir {
 public:
  // Creates <parent>/<prefix><owner tag>-XXXXXX, after removing what dead runs left there under
  // the same prefix.
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
  // Keep the directory and what is in it; nothing is removed any more. The directory loses its
  // owner tag (renamed to <prefix>XXXXXX), so that no later run mistakes it for a leftover:
  // path() changes.
  void keep();

 private:
  TempDir() = default;
  std::string path_;
  std::string parent_, prefix_;
  std::vector<std::pair<std::string, int>> tracked_;  // (full path, slot)
  int dir_slot_ = -1;
  bool keep_ = false;
};

}  // namespace residency::workload
