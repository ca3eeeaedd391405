// SPDX-License-Identifier: MIT
// What a killed process leaves in /dev/shm, removed by the tests so that none is left behind:
// - after a test SIGKILLs a child that may run a residency manager, no exit handler ran, so the
//   child's state files (src/core/state_file.hpp) are left; removed as `residency stat --pid` would;
// - a test process that died inside a test (a sanitizer's halt_on_error, a crash) leaves the
//   ledgers of the budgets it named after its pid; the next run of that test removes them.
#pragma once

#include <dirent.h>
#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <string>

namespace residency::testing {

inline void remove_state_files_of(pid_t pid) {
  const std::string prefix = "residency-state." + std::to_string(::getuid()) + "." + std::to_string(pid) + ".";
  DIR* d = ::opendir("/dev/shm");
  if (d == nullptr) return;
  while (dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n.rfind(prefix, 0) == 0) ::unlink(("/dev/shm/" + n).c_str());
  }
  ::closedir(d);
}

// Ledgers of budgets named `<prefix><pid>-...` or `<prefix><pid>` (the file /dev/shm/residency-budget-
// <name>) whose pid no longer runs. A live process's (a test running in parallel) are left alone.
inline void remove_ledgers_of_dead_runs(const std::string& prefix) {
  const std::string file_prefix = "residency-budget-" + prefix;
  DIR* d = ::opendir("/dev/shm");
  if (d == nullptr) return;
  while (dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n.rfind(file_prefix, 0) != 0) continue;
    const std::size_t digits = n.find_first_not_of("0123456789", file_prefix.size());
    const std::string pid = n.substr(file_prefix.size(),
                                     digits == std::string::npos ? std::string::npos : digits - file_prefix.size());
    if (pid.empty() || pid.size() > 9 || (digits != std::string::npos && n[digits] != '-' && n[digits] != '.'))
      continue;
    if (::kill(static_cast<pid_t>(std::stol(pid)), 0) != 0 && errno == ESRCH) ::unlink(("/dev/shm/" + n).c_str());
  }
  ::closedir(d);
}

}  // namespace residency::testing
