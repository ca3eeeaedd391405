// SPDX-License-Identifier: MIT
// `residency stat` as a user runs it: human text with the figures named, --json with raw
// bytes, exit 0 even where PSI is unavailable, exit 2 for a bad option.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "backends/posix/proc_info.hpp"
#include "backends/posix/system_info.hpp"
#include "residency/backends.hpp"
#include "residency/backends/posix.hpp"
#include "support/proc_cgroup.hpp"
#include "support/tool_run.hpp"

namespace {

using residency::testing::run_tool;
using residency::testing::ToolRun;

TEST(StatTool, PrintsEveryFigureWithAlignedColumns) {
  const ToolRun r = run_tool("stat");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  for (const char* key : {"MemTotal", "MemAvailable", "Mlocked (system)", "RLIMIT_MEMLOCK", "CAP_IPC_LOCK",
                          "recommended working set", "PSI memory", "backends"}) {
    EXPECT_NE(r.out.find(key), std::string::npos) << "missing " << key << " in:\n" << r.out;
  }
  // No VmLck line: the only process stat reads without --pid is itself, which locks nothing (the
  // line said "VmLck (this process)  0 B", read as the machine's or the shell's).
  EXPECT_EQ(r.out.find("VmLck"), std::string::npos) << r.out;
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
  for (const char* key :
       {"\"mem_total\"", "\"mem_available\"", "\"mlocked\"", "\"rlimit_memlock\"", "\"soft\"", "\"hard\"",
        "\"cap_ipc_lock\"", "\"psi_memory\"", "\"backends\"", "\"recommended_working_set\""}) {
    EXPECT_NE(r.out.find(key), std::string::npos) << "missing " << key << " in:\n" << r.out;
  }
  EXPECT_EQ(r.out.find("\"vm_lck\""), std::string::npos) << "the stat process's own VmLck: " << r.out;
  const auto info = residency::read_posix_system_info();
  ASSERT_TRUE(info.mem_total.has_value());
  EXPECT_NE(r.out.find("\"mem_total\": " + std::to_string(*info.mem_total)), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"cap_ipc_lock\": " + std::string(info.cap_ipc_lock ? "true" : "false")), std::string::npos)
      << r.out;
}

// The memory cgroup and the pressure source as the kernel files say, read here without the
// library: a cgroup v1 memory controller (beside an unrelated v2 mount, as on some VM guests)
// is reported as v1 with memory.limit_in_bytes, and the pressure watch line names its
// memory.pressure_level (there is no per-cgroup PSI under v1); the backends line lists only
// backends that start here, each other one on a line of its own with its reason.
TEST(StatTool, CgroupAndPressureWatchAreWhereTheMemoryControllerIs) {
  const ToolRun r = run_tool("stat");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const std::string v1_path = residency::testing::read_proc_self_cgroup().v1_memory;
  const auto line_of = [&](const std::string& key) {
    const auto at = r.out.find("\n" + key);
    if (at == std::string::npos) return std::string();
    return r.out.substr(at + 1, r.out.find('\n', at + 1) - at - 1);
  };
  const std::string watch = line_of("pressure watch");
  ASSERT_FALSE(watch.empty()) << r.out;
  if (!v1_path.empty()) {
    EXPECT_NE(line_of("cgroup (v1 memory)").find(v1_path + ", memory.limit_in_bytes "), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("cgroup (v2)"), std::string::npos) << "the v2 mount has no memory controller here\n" << r.out;
    if (v1_path != "/" && ::geteuid() == 0) {
      EXPECT_NE(watch.find("memory.pressure_level"), std::string::npos) << watch;
    }
  }
  const std::string backends = line_of("backends");
  ASSERT_FALSE(backends.empty()) << r.out;
  EXPECT_EQ(backends.find("not here"), std::string::npos) << backends;
  EXPECT_NE(backends.find("posix"), std::string::npos) << backends;
  for (const auto& name : residency::available_backends()) {
    const bool listed = backends.find(" " + name) != std::string::npos || backends.find(name + ",") != std::string::npos;
    const bool starts = residency::make_backend(name).is_ok();
    EXPECT_EQ(listed, starts) << name
                              << (starts ? " starts here but is not listed: " : " does not start here but is listed: ")
                              << backends;
    if (!starts) {
      bool reason = false;  // a "not here   NAME: why" line
      for (std::size_t at = r.out.find("\nnot here"); at != std::string::npos; at = r.out.find("\nnot here", at + 1)) {
        const std::string l = r.out.substr(at + 1, r.out.find('\n', at + 1) - at - 1);
        reason = reason || l.find(" " + name + ": ") != std::string::npos;
      }
      EXPECT_TRUE(reason) << "no reason given for " << name << "\n" << r.out;
    }
  }
}

TEST(StatTool, BadOptionExitsTwo) {
  const ToolRun r = run_tool("stat --no-such-option");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("no-such-option"), std::string::npos) << r.out;
}

}  // namespace
