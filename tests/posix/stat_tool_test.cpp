// `residency stat` as a user runs it: human text with the figures named, --json with raw
// bytes, exit 0 even where PSI is unavailable, exit 2 for a bad option.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <string>

#include "backends/posix/proc_info.hpp"
#include "backends/posix/system_info.hpp"
#include "residency/backends/posix.hpp"

#ifndef RESIDENCY_TOOL_PATH
#error "RESIDENCY_TOOL_PATH must name the residency binary (tests/posix/CMakeLists.txt)"
#endif

namespace {

struct ToolRun {
  int exit_code = -1;
  std::string out;
};

ToolRun run_tool(const std::string& args) {
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

TEST(StatTool, PrintsEveryFigureWithAlignedColumns) {
  const ToolRun r = run_tool("stat");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  for (const char* key : {"MemTotal", "MemAvailable", "Mlocked (system)", "VmLck (this process)", "RLIMIT_MEMLOCK",
                          "CAP_IPC_LOCK", "recommended working set", "PSI memory", "backends"}) {
    EXPECT_NE(r.out.find(key), std::string::npos) << "missing " << key << " in:\n" << r.out;
  }
  EXPECT_NE(r.out.find("posix"), std::string::npos) << r.out;
  // Sizes are formatted (no raw byte counts) and the value column starts at one offset.
  EXPECT_NE(r.out.find("iB"), std::string::npos) << r.out;
  const auto value_column = [&](const std::string& key) {
    const auto line = r.out.find(key);
    const auto eol = r.out.find('\n', line);
    const auto value = r.out.find_first_not_of(' ', line + key.size());
    EXPECT_LT(value, eol) << key;
    return value - line;
  };
  EXPECT_EQ(value_column("MemTotal"), value_column("RLIMIT_MEMLOCK"));
  // The soft limit the tool shows is this process's (the child inherits it).
  const auto lim = residency::posix::read_memlock_limit();
  EXPECT_NE(r.out.find("soft " + residency::posix::format_limit(lim.soft)), std::string::npos) << r.out;
  const residency::PressureInfo psi = residency::posix::read_pressure("/proc/pressure/memory");
  if (psi.available) {
    EXPECT_NE(r.out.find("some avg10="), std::string::npos) << r.out;
  } else {
    EXPECT_NE(r.out.find("unavailable: "), std::string::npos) << r.out;
  }
}

TEST(StatTool, JsonHasRawByteValues) {
  const ToolRun r = run_tool("stat --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  for (const char* key : {"\"mem_total\"", "\"mem_available\"", "\"mlocked\"", "\"vm_lck\"", "\"rlimit_memlock\"",
                          "\"soft\"", "\"hard\"", "\"cap_ipc_lock\"", "\"psi_memory\"", "\"backends\"",
                          "\"recommended_working_set\""}) {
    EXPECT_NE(r.out.find(key), std::string::npos) << "missing " << key << " in:\n" << r.out;
  }
  const auto info = residency::read_posix_system_info();
  ASSERT_TRUE(info.mem_total.has_value());
  EXPECT_NE(r.out.find("\"mem_total\": " + std::to_string(*info.mem_total)), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"cap_ipc_lock\": " + std::string(info.cap_ipc_lock ? "true" : "false")), std::string::npos)
      << r.out;
}

TEST(StatTool, BadOptionExitsTwo) {
  const ToolRun r = run_tool("stat --no-such-option");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("no-such-option"), std::string::npos) << r.out;
}

}  // namespace
