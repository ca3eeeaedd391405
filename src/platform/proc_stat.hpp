// SPDX-License-Identifier: MIT
// /proc/PID/stat, read in one place: a process's state and its start time.
//
// Why it exists: a process is named by its pid and its start time (field 22, clock ticks after
// boot), so that a reused pid is not taken for the process that died. The shared-budget ledger
// (its holders), the state files (`residency stat --pid`) and the benchmark's temporary files
// (their owner tag) all need that identity; each used to parse the line itself. This is the floor
// below the ledger and the core: it knows nothing of either, only the platform, so every layer
// may use it without an arrow pointing up.
//
// The line is "PID (COMM) STATE ...": COMM is what the process named itself (prctl PR_SET_NAME)
// and may hold spaces, ')' and newlines of its own, so the whole file is read (not one line) and
// fields are counted from its last ')'.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace residency::platform {

struct ProcStat {
  char state = '?';              // field 3: R, S, D, Z (zombie), X (dead), ...
  std::uint64_t start_time = 0;  // field 22: clock ticks after boot
  // A zombie or dead process: its pid is still taken, but its memory is gone.
  bool gone() const { return state == 'Z' || state == 'X' || state == 'x'; }
};

// The text of /proc/PID/stat (one line, unless COMM holds a newline); nullopt when it does not
// have 22 fields or field 22 is not a decimal number.
std::optional<ProcStat> parse_proc_stat(std::string_view line);

// /proc/PID/stat of process `pid` (> 0); nullopt when there is no such process, no /proc, or this
// is not Linux.
std::optional<ProcStat> read_proc_stat(int pid);
// /proc/self/stat: this process, as its own pid namespace's /proc shows it.
std::optional<ProcStat> read_own_proc_stat();

}  // namespace residency::platform
