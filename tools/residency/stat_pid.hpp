// SPDX-License-Identifier: MIT
// residency stat --pid PID (stat_pid.cpp): what another process holds, as the kernel, its
// residency managers and its GPU driver see it.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace residency::tool {

// Prints the process's report (or JSON with raw byte values). Exit status: 0; 1 when the
// process belongs to another user and this one may not read its mappings; a pid that names no
// process throws BadInput (exit 2).
int run_stat_pid(int pid, bool json);

// What a holder of a shared or GPU budget says of itself in its state file (the manager whose
// share of budget `budget` it is): for the budget's rows of `residency stat`. Empty fields where
// there is no such file (another user's process, RESIDENCY_STATE_FILE=0, not Linux).
struct HolderFacts {
  std::string program;   // /proc/PID/comm
  std::string state;     // "awake"/"asleep" (a GPU's memory), "resident"/"released" (host memory)
  std::string switches;  // wakes or re-wires so far, decimal
  std::string last_switch_ms;
  std::string pinned_host_bytes;
  std::string registered_file_bytes;  // model files registered with the GPU (pinned page cache)
};
HolderFacts holder_facts(int pid, const std::string& budget);

// A manager's state in one word, from its state file's `backend` and `resident`: "awake"/"asleep"
// for a GPU's memory (backend cuda), "resident"/"released" for host memory.
std::string state_word(const std::string& backend, bool resident);

// The VmLck row's words: `vm_lck` bytes locked in the process, `held` of them by residency's host
// managers (their wired bytes). Past 1 MiB more than residency holds, the rest is the program's own
// lock (llama.cpp's --load-mode mlock or mmap+mlock, --mlock), which residency leaves alone.
std::string lock_breakdown(std::uint64_t vm_lck, std::uint64_t held);

// A process as /proc/PID/status says (for `residency ps`): nullopt when there is no such process.
struct ProcBrief {
  std::string name;
  unsigned uid = 0;
  std::optional<std::uint64_t> vm_lck;
};
std::optional<ProcBrief> proc_brief(int pid);

// What a child writes to `fd` until it closes it (at most about `max_bytes`), or until `limit` has
// passed (`timed_out` then says so): no child can hang the tool.
std::string read_child_output(int fd, std::chrono::milliseconds limit, std::size_t max_bytes, bool& timed_out);

}  // namespace residency::tool
