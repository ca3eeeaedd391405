// SPDX-License-Identifier: MIT
// residency posix backend: the machine-level figures the backend and `residency stat` share.
//
// memory_info() and `residency stat` must agree on what RLIMIT_MEMLOCK is, whether it applies
// (it does not with CAP_IPC_LOCK), how to raise it, and which PSI file describes this
// process's memory pressure (posix_pressure_source, in posix.hpp); so those rules live here once, on top of proc_info's readers.
#pragma once

#include <cstdint>
#include <string>

namespace residency::posix {

// How to raise RLIMIT_MEMLOCK, for every message that mentions it.
inline constexpr const char* kMemlockFix =
    "raise RLIMIT_MEMLOCK: `ulimit -l unlimited` in the shell that starts the process (raising the hard "
    "limit needs root), `LimitMEMLOCK=infinity` in its systemd unit, `docker run --ulimit memlock=-1` "
    "or `--cap-add IPC_LOCK` for a container; or give the process CAP_IPC_LOCK";

struct MemlockLimit {
  static constexpr std::uint64_t kUnlimited = UINT64_MAX;
  std::uint64_t soft = kUnlimited;  // bytes
  std::uint64_t hard = kUnlimited;
  bool cap_ipc_lock = false;  // effective in the calling thread
  // True when mlock is held to `soft`: no CAP_IPC_LOCK and a finite soft limit.
  bool enforced() const { return !cap_ipc_lock && soft != kUnlimited; }
};
MemlockLimit read_memlock_limit();
// "unlimited" or a size ("8 MiB").
std::string format_limit(std::uint64_t bytes);
// Raises the soft RLIMIT_MEMLOCK to the hard one (no privilege needed). Returns false if the
// kernel refused.
bool raise_memlock_soft_limit();

struct MemoryFigures {
  std::uint64_t physical = 0;    // MemTotal, else sysconf pages x page size
  std::uint64_t available = 0;   // MemAvailable; 0 = unknown
  std::uint64_t vm_lck = 0;      // this process's locked bytes; 0 when unknown
  std::uint64_t limit_base = 0;  // min(physical, cgroup v2 memory.max): what the working set is a share of
};
MemoryFigures read_memory_figures();

}  // namespace residency::posix
