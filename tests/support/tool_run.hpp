// SPDX-License-Identifier: MIT
// Runs the residency tool (RESIDENCY_TOOL_PATH, set by the test's CMakeLists) through a shell with
// ARGS, stdout and stderr together, and returns its exit status and output.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <string>

#ifndef RESIDENCY_TOOL_PATH
#error "RESIDENCY_TOOL_PATH must name the residency binary (the test's CMakeLists.txt)"
#endif

namespace residency::testing {

struct ToolRun {
  int exit_code = -1;  // -1: it did not exit normally (or could not start)
  std::string out;     // stdout and stderr
};

inline ToolRun run_tool(const std::string& args) {
  ToolRun r;
  const std::string cmd = std::string("'") + RESIDENCY_TOOL_PATH + "' " + args + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  std::size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int status = ::pclose(p);
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  return r;
}

}  // namespace residency::testing
