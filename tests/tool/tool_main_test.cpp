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
  for (const char* name : {"doctor", "hold", "idle", "make-model", "stat"})
    EXPECT_NE(r.output.find(name), std::string::npos) << r.output;
}

TEST(ToolMain, AnUnknownSubcommandIsNamedWithTheAcceptedOnes) {
  const ToolRun r = run_tool("idel");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.output.find(
                "unknown command 'idel'; accepted: doctor, hold, idle, llama-idle, make-model, ps, stat, help"),
            std::string::npos)
      << r.output;
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

// The conventions operators expect of a command-line tool (issue 30): --version, `help [COMMAND]`,
// placeholders that say what a value is, an unknown option named.
TEST(ToolMain, VersionAndHelpCommandFollowTheConventions) {
  const ToolRun v = run_tool("--version");
  EXPECT_EQ(v.status, 0);
  EXPECT_EQ(v.output.rfind("residency 0.", 0), 0u) << v.output;
  EXPECT_EQ(std::count(v.output.begin(), v.output.end(), '\n'), 1) << v.output;
  const ToolRun h = run_tool("help");
  EXPECT_EQ(h.status, 0);
  EXPECT_NE(h.output.find("Usage: residency"), std::string::npos) << h.output;
  EXPECT_NE(h.output.find("residency help COMMAND"), std::string::npos) << h.output;
  const ToolRun hs = run_tool("help stat");
  EXPECT_EQ(hs.status, 0);
  EXPECT_NE(hs.output.find("Usage: residency stat [OPTIONS]"), std::string::npos) << hs.output;
  EXPECT_EQ(hs.output, run_tool("stat --help").output) << "help stat is stat --help";
  const ToolRun bad = run_tool("help nope");
  EXPECT_EQ(bad.status, 2);
  EXPECT_NE(bad.output.find("residency help: unknown command 'nope'; accepted: one of doctor, hold, idle"), std::string::npos)
      << bad.output;
  const ToolRun opt = run_tool("stat --bogus");
  EXPECT_EQ(opt.status, 2);
  EXPECT_NE(opt.output.find("--bogus"), std::string::npos) << opt.output;
}

TEST(ToolMain, EveryPlaceholderSaysWhatItTakes) {
  for (const char* cmd : {"doctor", "hold", "idle", "llama-idle", "make-model", "ps", "stat"}) {
    const ToolRun r = run_tool(std::string(cmd) + " --help");
    if (r.status != 0) continue;  // llama-idle: Linux only
    for (const char* word : {" TEXT", " INT", " UINT", " FLOAT", "{false}", "{true}"})
      EXPECT_EQ(r.output.find(word), std::string::npos) << cmd << ": '" << word << "' in\n" << r.output;
  }
}
