// SPDX-License-Identifier: MIT
// residency: the POSIX backend (Linux and any POSIX host): residency is mlock.
//
// An inference engine on Linux usually maps its model file (MAP_SHARED, PROT_READ). Those pages
// sit in the page cache, and under memory pressure the kernel drops them; the next request
// reads them back from disk, which is the Linux form of Metal's re-wire cost. mlock keeps them
// in RAM and munlock gives them back, so a set here is a group of host ranges whose residency
// is requested by mlock-ing every range (which also faults evicted pages back in: the re-wire)
// and ended by munlock-ing them. The one design decision that shapes the backend: mlock is not
// reference-counted by the kernel (one munlock undoes any number of mlocks of a page), so the
// backend counts locks per page itself, and a page shared by two regions, or by two sets, stays
// locked until the last of them lets it go.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "residency/backend.hpp"
#include "residency/clock.hpp"
#include "residency/status.hpp"

namespace residency {

struct PosixOptions {
  // Recommended working set as a percent of MemTotal (or of the cgroup v2 memory.max of this
  // process when that is lower). 75 % is about the share of RAM that Apple's
  // recommendedMaxWorkingSetSize gives the GPU (2/3 to 3/4, by machine), the figure the peers
  // budget against; on Linux it leaves a quarter of RAM for the kernel, the page cache of
  // everything else and other processes. Accepted: (0, 100].
  double recommended_pct = 75.0;
  // At creation, raise the soft RLIMIT_MEMLOCK to the hard limit (what `ulimit -l $(ulimit -Hl)`
  // does in a shell; no privilege needed). false leaves the process's limits alone.
  bool raise_memlock_soft_limit = true;
  // PSI trigger: report pressure when tasks stalled on memory ("some") for at least
  // `pressure_stall` within any `pressure_window`. The window must be a multiple of 2 s for a
  // process without CAP_SYS_RESOURCE (the kernel refuses other windows with EINVAL), and
  // between 500 ms and 10 s; the stall must be > 0 and <= the window. 150 ms is the threshold
  // of the kernel's PSI documentation example (there in a 1 s window; 2 s here so that any
  // process may register it). With a cgroup v1 source (memory.pressure_level) the window is the
  // least time between two events passed on to the managers.
  Nanos pressure_stall = std::chrono::milliseconds(150);
  Nanos pressure_window = std::chrono::seconds(2);
  // The pressure file to watch; empty = what posix_pressure_source() picks: the memory cgroup of
  // this process when it is not the root one (a container's limit is what it will hit first),
  // else /proc/pressure/memory. A PSI file (".../memory.pressure", "/proc/pressure/memory"), or a
  // cgroup v1 ".../memory.pressure_level" (its cgroup.event_control beside it must be writable).
  std::string pressure_file;
};

// Limits: without CAP_IPC_LOCK a process may lock at most RLIMIT_MEMLOCK bytes (8 MiB by
// default on Linux >= 5.16 and in Docker, 64 KiB before). An mlock refused by that limit is
// not an error that stops anything: the region stays tracked but not resident, and the
// Status names the limit and how to raise it. memory_info().hard_limit carries the limit so
// that the manager clamps its budget to it.
//
// Creates the backend. Fails only for invalid options; a missing /proc (non-Linux POSIX host)
// makes memory_info() report what sysconf() knows and the rest as unknown (0).
Result<std::shared_ptr<Backend>> make_posix_backend(const PosixOptions& options = {});

// What 75 % (or `pct`) of a machine with `physical` bytes recommends; the backend's rule,
// exposed for the tool and tests.
std::uint64_t posix_recommended_working_set(std::uint64_t physical, double pct = 75.0);

// A PSI line ("some avg10=0.00 avg60=0.00 avg300=0.00 total=0"), parsed.
struct PressureReading {
  double avg10 = 0;  // percent of the last 10 s some (or all) tasks stalled on memory
  double avg60 = 0;
  double avg300 = 0;
  std::uint64_t total_us = 0;  // total stall time since boot, microseconds
};

// One PSI memory file as read now.
struct PressureInfo {
  std::string path;
  bool available = false;
  std::string reason;                // why not, when !available
  std::string some_line, full_line;  // as the kernel printed them (full may be absent)
  std::optional<PressureReading> some, full;
};

// Pressure: the kernel's own source for the memory cgroup that governs this process, watched by
// one backend thread that sleeps in poll() (no wake-ups while there is no pressure): a PSI poll
// trigger on the cgroup v2 memory.pressure; in a cgroup v1 memory cgroup (PSI exists there only
// system-wide) its memory.pressure_level, registered through cgroup.event_control with an
// eventfd; else the system's /proc/pressure/memory. See posix_pressure_source().
//
// Where the posix backend's pressure watch listens, as decided on this machine now.
struct PressureSource {
  enum class Kind : std::uint8_t { none, psi, cgroup_v1_level };
  Kind kind = Kind::none;
  std::string path;    // the PSI file, or the cgroup v1 memory.pressure_level
  std::string scope;   // "system", "cgroup v2 /a/b", "cgroup v1 /a/b"
  std::string reason;  // why this one (and not a closer one), or why none
  // One line for logs and `residency stat`, e.g. "cgroup v1 memory.pressure_level 'medium' of
  // /a/b (/sys/fs/cgroup/memory/a/b/memory.pressure_level), at most one event per 2 s".
  std::string describe(const PosixOptions& options = {}) const;
};
// The level a cgroup v1 watch registers: "low" fires on every reclaim (a full cgroup reclaims
// its page cache all the time), "critical" only just before the OOM killer: too late to give back
// in steps; "medium" (reclaim is struggling: swapping, evicting active cache) is the
// counterpart of the PSI stall trigger. Critical events reach a "medium" listener too.
inline constexpr const char* kCgroupV1PressureLevel = "medium";
// Picks the pressure source for `override_file` (PosixOptions::pressure_file; empty: choose):
// this process's cgroup v2 memory.pressure when its memory cgroup is a v2 one other than the
// root; its cgroup v1 memory.pressure_level when its memory cgroup is a v1 one other than the
// root and this process may register there (cgroup.event_control writable); else the system's
// PSI; else, without PSI, the v1 root's memory.pressure_level. Kind::none with the reason when
// nothing can be watched.
PressureSource posix_pressure_source(const std::string& override_file = {});

// What this machine and process hold resident, for `residency stat` and diagnostics.
// Every figure that could not be read is nullopt and `problems` says why.
struct PosixSystemInfo {
  static constexpr std::uint64_t kUnlimited = UINT64_MAX;  // RLIM_INFINITY, as bytes

  std::uint64_t page_size = 0;
  std::optional<std::uint64_t> mem_total;      // /proc/meminfo MemTotal, bytes
  std::optional<std::uint64_t> mem_available;  // /proc/meminfo MemAvailable
  std::optional<std::uint64_t> mlocked;        // /proc/meminfo Mlocked (whole system)
  std::optional<std::uint64_t> vm_lck;         // /proc/self/status VmLck (this process)
  std::optional<std::uint64_t> cgroup_memory_max;  // the memory cgroup's limit (v1 memory.limit_in_bytes, v2 memory.max); nullopt = none
  // Non-empty: the limit could not be read (cgroup_memory_max is then nullopt, which does not
  // mean "no limit"): "missing" when the file is not there, else "unreadable"; the detail is in problems.
  std::string cgroup_memory_max_unknown;
  std::uint64_t memlock_soft = 0;  // RLIMIT_MEMLOCK, bytes or kUnlimited
  std::uint64_t memlock_hard = 0;
  bool cap_ipc_lock = false;                    // effective CAP_IPC_LOCK: RLIMIT_MEMLOCK does not apply
  std::string cgroup_path;                      // this process's memory cgroup ("/" = root), if found
  int cgroup_version = 0;                       // 1: the cgroup v1 memory controller; 2: cgroup v2
  PressureInfo system_pressure;                 // /proc/pressure/memory
  std::optional<PressureInfo> cgroup_pressure;  // <cgroup2 mount><cgroup_path>/memory.pressure
  PressureSource pressure_watch;                // what the backend's pressure watch would listen to (default options)
  std::vector<std::string> problems;
};
PosixSystemInfo read_posix_system_info();

}  // namespace residency
