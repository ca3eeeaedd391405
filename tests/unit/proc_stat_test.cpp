// SPDX-License-Identifier: MIT
// /proc/PID/stat is read in one place (platform/proc_stat.hpp): a command name with spaces and
// parentheses does not shift the fields, a zombie is gone, and the ledger, the state files and
// the benchmark's owner tags see the same start time.
#include <gtest/gtest.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include <string>

#include "core/state_file.hpp"
#include "ledger/ledger.hpp"
#include "platform/proc_stat.hpp"

namespace residency::platform {
namespace {

// Fields 4 to 21 of a real line, then field 22 and the rest.
std::string stat_line(const std::string& comm, const std::string& state, const std::string& start) {
  return "4242 (" + comm + ") " + state + " 1 4242 4242 0 -1 4194560 123 0 0 0 5 3 0 0 20 0 1 0 " + start +
         " 10000 100 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0";
}

TEST(ProcStat, FieldsCountFromTheLastParenthesis) {
  // A name holds what the process gave prctl(PR_SET_NAME): spaces, ')' and newlines included.
  for (const std::string comm : {"sleep", "a b", "x) S 1 2 (y", ")", "((", "hold\nA", "a) b\nc d", "\n) \n"}) {
    auto s = parse_proc_stat(stat_line(comm, "S", "987654321"));
    ASSERT_TRUE(s) << comm;
    EXPECT_EQ(s->state, 'S') << comm;
    EXPECT_EQ(s->start_time, 987654321u) << comm;
    EXPECT_FALSE(s->gone()) << comm;
  }
}

TEST(ProcStat, AZombieIsGone) {
  for (const char* state : {"Z", "X", "x"}) {
    auto s = parse_proc_stat(stat_line("server", state, "77"));
    ASSERT_TRUE(s) << state;
    EXPECT_TRUE(s->gone()) << state;
  }
}

TEST(ProcStat, ALineWithoutField22IsNone) {
  EXPECT_FALSE(parse_proc_stat(""));
  EXPECT_FALSE(parse_proc_stat("4242 sleep S 1"));  // no parentheses
  EXPECT_FALSE(parse_proc_stat("4242 (sleep) S 1 4242 4242 0 -1"));
  EXPECT_FALSE(parse_proc_stat(stat_line("sleep", "S", "12a")));
  EXPECT_FALSE(parse_proc_stat(stat_line("sleep", "S", "-1")));
  EXPECT_FALSE(parse_proc_stat(stat_line("sleep", "S", "99999999999999999999999")));
}

TEST(ProcStat, NoProcessIsNone) {
  EXPECT_FALSE(read_proc_stat(0));
  EXPECT_FALSE(read_proc_stat(-1));
}

#if defined(__linux__)
TEST(ProcStat, EveryReaderSeesThisProcessAlike) {
  const auto own = read_own_proc_stat();
  ASSERT_TRUE(own);
  EXPECT_GT(own->start_time, 0u);
  EXPECT_FALSE(own->gone());
  const auto by_pid = read_proc_stat(::getpid());
  ASSERT_TRUE(by_pid);
  EXPECT_EQ(by_pid->start_time, own->start_time);
  EXPECT_EQ(ledger::process_start_time(::getpid()), own->start_time);
  EXPECT_EQ(core::process_start_time(::getpid()), own->start_time);
}

// Issue 42, item 4: a process that names itself with a newline (and ')' and spaces) keeps its
// identity: /proc/self/stat is read whole, not up to the first newline. Before, field 22 did not
// parse, so a holder of a shared budget was taken for dead and its share reclaimed.
TEST(ProcStat, AProcessNamedWithANewlineKeepsItsStartTime) {
  const auto before = read_own_proc_stat();
  ASSERT_TRUE(before);
  char old_name[32] = {};
  ASSERT_EQ(::prctl(PR_GET_NAME, old_name), 0);
  ASSERT_EQ(::prctl(PR_SET_NAME, "hold\nA) b c"), 0);  // this test's thread: the main thread, the process's name
  const auto own = read_own_proc_stat();
  const auto by_pid = read_proc_stat(::getpid());
  const std::uint64_t ledger_view = ledger::process_start_time(::getpid());
  ::prctl(PR_SET_NAME, old_name);
  ASSERT_TRUE(own) << "/proc/self/stat with a newline in the name did not parse";
  ASSERT_TRUE(by_pid);
  EXPECT_EQ(own->start_time, before->start_time);
  EXPECT_EQ(by_pid->start_time, before->start_time);
  EXPECT_EQ(ledger_view, before->start_time);
  EXPECT_TRUE(ledger::holder_alive(::getpid(), before->start_time));
}
#endif

}  // namespace
}  // namespace residency::platform
