// SPDX-License-Identifier: MIT
// What /proc/self/cgroup says, read without the library: the tests compare the library's choice
// of memory cgroup and pressure source against it.
#pragma once

#include <fstream>
#include <sstream>
#include <string>

namespace residency::testing {

struct ProcCgroup {
  std::string v1_memory;  // the path in the cgroup v1 hierarchy with the memory controller; "" none
  std::string v2;         // the "0::" path; "" none
};

inline ProcCgroup read_proc_self_cgroup() {
  ProcCgroup out;
  std::ifstream in("/proc/self/cgroup");
  for (std::string line; std::getline(in, line);) {
    const auto c1 = line.find(':');
    const auto c2 = c1 == std::string::npos ? c1 : line.find(':', c1 + 1);
    if (c2 == std::string::npos) continue;
    if (("," + line.substr(c1 + 1, c2 - c1 - 1) + ",").find(",memory,") != std::string::npos)
      out.v1_memory = line.substr(c2 + 1);
    if (line.rfind("0::", 0) == 0) out.v2 = line.substr(3);
  }
  return out;
}

}  // namespace residency::testing
