// SPDX-License-Identifier: MIT
// State files: what a running manager publishes for `residency stat --pid PID`.
//
// Why a file per manager in /dev/shm, not the ledger: most processes have no shared budget (no
// ledger), a process may run several managers (the preload: host + one per GPU), and the ledger's
// slots are fixed-size records other processes write. A small text file per manager needs no
// coordination between managers and no format shared with other processes' writers.
//
//   /dev/shm/residency-state.<uid>.<pid>.<n>   (n: the manager's number in its process, from 0)
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace residency::core {

// Mode 0600, owned by the process's user: no other user (root aside) can read it; the reader
// also refuses a file whose owner is not the uid its name and the process carry, or that any
// other user could read or write. Written whole to a temporary file (O_CREAT|O_EXCL|O_NOFOLLOW)
// and renamed over the old one: a reader sees the previous snapshot or the next, never half of
// one. Content: `residency-state 1` (the format version), then key=value lines; `pid` and
// `start_time` (field 22 of /proc/PID/stat) tell a live file from one of a dead process or of a
// reused pid, which the reader reports as stale and removes if it may.
inline constexpr const char* kStateDir = "/dev/shm";
inline constexpr const char* kStatePrefix = "residency-state.";
inline constexpr const char* kStateHeader = "residency-state 1";

// Field 22 of /proc/PID/stat (clock ticks after boot); nullopt where there is none (not Linux,
// no such process).
std::optional<std::uint64_t> process_start_time(int pid);

// Removes this process's state files and stops all publishing (the atexit handler).
void remove_state_files_at_exit();

// What this process's managers serve, as the code that found it says: the preload sets the path of
// the libllama whose llama_decode it drives, as the dynamic loader gave it. Every snapshot written
// from then on carries it as `engine=` (newlines replaced), so that `residency doctor PID` can say
// which llama.cpp the preload serves; unset (empty): no such line.
void set_state_engine(const std::string& engine);

// Written on state changes only (registration, wire, release, budget changes), under the
// manager's mutex; never on touch()'s fast path. Removed when the manager is destroyed and at
// exit (an atexit handler: the preload never destroys its managers); a fork child never
// writes or removes its parent's files (the owner pid is checked).
//
// One manager's file. Nothing is created until the first publish(); a failure to write is
// reported once through `why_not()` and publishing stops (it never fails the manager).
class StateFile {
 public:
  StateFile();   // takes the next number of this process
  ~StateFile();  // removes the file (only in the process that wrote it)
  StateFile(const StateFile&) = delete;
  StateFile& operator=(const StateFile&) = delete;

  // Writes the header, pid, start_time, uid, manager and `updated`, then `body` (key=value
  // lines, each ending in '\n'). False if nothing was written (the process is exiting, a fork
  // child, or the write failed: then why_not() says why, once).
  bool publish(const std::string& body);
  std::string why_not();  // the failure not yet reported, then ""
  const std::string& path() const { return path_; }

 private:
  void remove();
  const int owner_pid_;
  const std::optional<std::uint64_t> start_time_;  // the owner's, read once
  const std::string path_, tmp_;
  bool failed_ = false, written_ = false;
  std::string why_not_;
  friend void remove_state_files_at_exit();
};

// What the reader found for a pid.
struct StateFileRead {
  std::string path;
  std::map<std::string, std::string> fields;  // empty unless read
  std::string error;                          // not read (and why), or a bad file
  bool stale = false;                         // its process is gone or its pid was reused
  bool removed = false;                       // stale and removed
};

// Every state file of `pid` in kStateDir. `owner_uid`: the uid the process runs as (files of any
// other owner are not read); `start_time`: the process's, nullopt if it is not running.
std::vector<StateFileRead> read_state_files(int pid, uid_t owner_uid, std::optional<std::uint64_t> start_time,
                                            const std::string& dir = kStateDir);

}  // namespace residency::core
