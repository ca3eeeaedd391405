// SPDX-License-Identifier: MIT
// What a new user meets first: `residency` alone, `residency --help`, a mistyped subcommand.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <string>

namespace {
struct ToolRun {
  int status = -1;
  std::string output;
};
ToolRun run_tool(const std::string& args) {
  ToolRun r;
  const std::string cmd = std::string("'") + RESIDENCY_TOOL_PATH + "' " + args + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  const int st = ::pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}
}  // namespace

TEST(ToolMain, WithoutASubcommandItShowsTheSubcommandsAndExits2) {
  const ToolRun r = run_tool("");
  EXPECT_EQ(r.status, 2);
  for (const char* name : {"hold", "idle", "make-model", "stat"}) EXPECT_NE(r.output.find(name), std::string::npos) << r.output;
}

TEST(ToolMain, AnUnknownSubcommandIsNamedWithTheAcceptedOnes) {
  const ToolRun r = run_tool("idel");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.output.find("unknown subcommand 'idel'; accepted: hold, idle, llama-idle, make-model, stat"), std::string::npos) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << "one line: " << r.output;
}

TEST(ToolMain, HelpExits0) {
  const ToolRun r = run_tool("--help");
  EXPECT_EQ(r.status, 0);
  EXPECT_NE(r.output.find("Usage: residency"), std::string::npos) << r.output;
}

// hold's help says what it really listens to (PSI or cgroup v1 memory.pressure_level, as `stat`
// shows) and from when its keep-alive counts (the start: hold cannot see other readers).
TEST(ToolMain, HoldHelpNamesBothPressureSourcesAndWhenTheKeepAliveCounts) {
  const ToolRun r = run_tool("hold --help");
  EXPECT_EQ(r.status, 0);
  std::string help;  // CLI11 wraps long descriptions: compare with the line breaks folded
  for (char c : r.output) {
    if (c == '\n' || c == ' ') {
      if (!help.empty() && help.back() != ' ') help += ' ';
    } else {
      help += c;
    }
  }
  EXPECT_NE(help.find("memory.pressure_level"), std::string::npos) << r.output;
  EXPECT_NE(help.find("PSI"), std::string::npos) << r.output;
  EXPECT_NE(help.find("counted from the start"), std::string::npos) << r.output;
}
