// SPDX-License-Identifier: MIT
// residency posix backend: reading what Linux says about memory, locks and pressure.
//
// Every figure the backend and `residency stat` report comes from a few /proc and cgroup files.
// Parsing is kept apart from reading, as pure functions from text to values, so that each
// format (and each way it can be malformed: a truncated line, a missing field, a number that
// is not one) is tested on fixed strings, without depending on the machine the tests run on.
// The readers are thin: read the file, call the parser, say which file failed.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "residency/backends/posix.hpp"
#include "residency/status.hpp"

namespace residency::posix {

// /proc/meminfo, in bytes (the file says "kB", which is KiB).
struct MemInfo {
  std::uint64_t mem_total = 0;
  std::optional<std::uint64_t> mem_available;  // absent before Linux 3.14
  std::optional<std::uint64_t> mlocked;        // absent without CONFIG_MMU
  std::optional<std::uint64_t> swap_total;     // 0: no swap
};
// Requires MemTotal; every field that is read must be "<name>: <number> kB".
Result<MemInfo> parse_meminfo(std::string_view text);

// /proc/<pid>/status: the lines the backend uses.
struct ProcStatus {
  std::optional<std::uint64_t> vm_lck;   // bytes; absent for kernel threads
  std::optional<std::uint64_t> cap_eff;  // effective capability mask
};
Result<ProcStatus> parse_proc_status(std::string_view text);

// CAP_IPC_LOCK is capability 14 (linux/capability.h): lets mlock ignore RLIMIT_MEMLOCK.
inline constexpr unsigned kCapIpcLock = 14;
inline bool has_cap_ipc_lock(std::uint64_t cap_eff) { return ((cap_eff >> kCapIpcLock) & 1U) != 0; }

// A PSI file (/proc/pressure/memory, <cgroup>/memory.pressure): a "some" line and, since
// Linux 5.13 for every resource (before: not for cpu), a "full" line.
struct PressureText {
  std::string some_line, full_line;
  PressureReading some;
  std::optional<PressureReading> full;
};
Result<PressureText> parse_pressure(std::string_view text);

// /proc/self/cgroup: the cgroup v2 path (the "0::<path>" entry), or nullopt when the process
// is not in a cgroup v2 hierarchy (pure cgroup v1). Malformed lines are an error.
Result<std::optional<std::string>> parse_cgroup_v2_path(std::string_view text);

// /proc/self/mountinfo: where the cgroup v2 hierarchy is mounted and the root of that mount,
// or nullopt when it is not mounted. Octal escapes (\040 for a space) are decoded.
struct CgroupMount {
  std::string mount_point;
  std::string root;  // "/" unless the mount shows a sub-tree (cgroup namespaces, bind mounts)
};
Result<std::optional<CgroupMount>> parse_cgroup2_mount(std::string_view text);

// The directory of a cgroup v2 path under its mount: mount_point + (path without the mount's
// root). nullopt when the path lies outside the mounted sub-tree.
std::optional<std::string> cgroup_dir(const CgroupMount& mount, std::string_view cgroup_path);

// cgroup v2 memory.max: a byte count, or "max" (nullopt: no limit).
Result<std::optional<std::uint64_t>> parse_memory_max(std::string_view text);

// cgroup v1: the path of this process in the hierarchy that has the memory controller (the
// "N:...memory...:<path>" entry of /proc/self/cgroup), or nullopt when none has it.
Result<std::optional<std::string>> parse_cgroup_v1_memory_path(std::string_view text);
// /proc/self/mountinfo: where the cgroup v1 hierarchy with the memory controller is mounted.
Result<std::optional<CgroupMount>> parse_cgroup_v1_memory_mount(std::string_view text);
// cgroup v1 memory.limit_in_bytes: a byte count; the kernel's "no limit" (2^63 - 1 rounded down
// to a page, i.e. >= 2^62 here) is nullopt.
Result<std::optional<std::uint64_t>> parse_memory_limit_v1(std::string_view text);

// The PSI trigger text the kernel expects: "some <stall us> <window us>". Validated as the
// kernel does (window 500 ms..10 s, 0 < stall <= window); `privileged` (CAP_SYS_RESOURCE)
// lifts the kernel's rule that the window be a multiple of 2 s.
Result<std::string> make_psi_trigger(Nanos stall, Nanos window, bool privileged);

// Readers. Each returns io_error naming the path and errno text when the file cannot be read.
Result<std::string> read_text_file(const std::string& path);
Result<MemInfo> read_meminfo();         // /proc/meminfo
Result<ProcStatus> read_proc_status();  // /proc/thread-self/status (caps are per
                                        // thread), else /proc/self/status
// The cgroup v2 directory of this process ("" root cgroup included), or an error saying why
// none was found.
struct CgroupLocation {
  std::string cgroup_path;  // as /proc/self/cgroup shows it, e.g. "/" or "/system.slice/x"
  std::string dir;          // e.g. "/sys/fs/cgroup/system.slice/x"
};
Result<CgroupLocation> find_cgroup_v2();
// The cgroup whose memory controller governs this process: the cgroup v1 hierarchy that has it
// (a machine can have cgroup v1's memory controller beside an unrelated v2 mount, as some VM
// guests do), else the v2 hierarchy. Errors say why none was found.
struct MemoryCgroup {
  int version = 0;          // 1 or 2
  std::string cgroup_path;  // "/" = the root
  std::string dir;
};
Result<MemoryCgroup> find_memory_cgroup();
// The memory cgroup's limit (v1 memory.limit_in_bytes, v2 memory.max); nullopt: none.
std::optional<std::uint64_t> memory_cgroup_limit(const MemoryCgroup& cg);
// The same, telling "no limit" (nullopt) from a limit that could not be read: the file is missing
// (not_found) or unreadable or holds no byte count (io_error); the message names the file.
Result<std::optional<std::uint64_t>> read_memory_cgroup_limit(const MemoryCgroup& cg);
// One "<key> <bytes>" line of a cgroup's memory.stat (v1 "total_inactive_file", v2
// "inactive_file"); nullopt when absent or not a number.
std::optional<std::uint64_t> parse_memory_stat_value(std::string_view text, std::string_view key);
// What the memory cgroup and every limited cgroup above it leave this process to take without
// reclaiming others' memory: the least over them of limit - usage + file pages on the LRU lists
// (page cache the kernel can drop; unlocked model pages among them). nullopt: no cgroup on the
// way has a limit, or none could be read.
std::optional<std::uint64_t> memory_cgroup_headroom(const MemoryCgroup& cg);
PressureInfo read_pressure(const std::string& path);

}  // namespace residency::posix
