// SPDX-License-Identifier: MIT
// What a test does after it SIGKILLs a child that may run a residency manager: no exit handler
// ran, so the child's state files (src/core/state_file.hpp) are left in /dev/shm; remove them
// as `residency stat --pid` would, so that no test leaves a file behind.
#pragma once

#include <dirent.h>
#include <sys/types.h>
#include <unistd.h>

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

}  // namespace residency::testing
