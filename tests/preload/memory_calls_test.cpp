// SPDX-License-Identifier: MIT
// The preload forwards every C library memory call it interposes exactly as the C library reads
// it (docs/design.md, "The engine session": a program's own calls do what they would without the
// preload). memory_calls.c runs each hooked call (mmap, mmap64, munmap, madvise, mprotect, mremap,
// mlock, mlock2, munlock, mlockall) over the flag combinations it takes, valid and invalid, and
// prints one line per case with the result and errno; the lines with and without LD_PRELOAD must be
// the same. Once as a plain program (the preload's session never starts), once after the program
// loaded a llama.cpp model and decoded a token (the session runs and holds the model while the
// table runs).
//
// mremap(MREMAP_MAYMOVE | MREMAP_DONTUNMAP) failed with EINVAL under the preload until its hook
// forwarded new_address for DONTUNMAP too: glibc read a leftover register in its place. Which
// register value is left depends on the path through the hook: at 92b9934 (GCC 12) the session's
// path left an unaligned pointer there and TheSameWhileTheSessionHoldsAModel failed, while the
// path without a session still held the caller's NULL and passed.
#include <gtest/gtest.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "support/child_process.hpp"
#include "support/memlock_privileges.hpp"
#include "support/synthetic_model.hpp"
#include "support/temp_dir.hpp"

namespace {

using residency::testing::ChildProcess;
using residency::testing::ChildSpec;

constexpr std::uint64_t kMiB = 1024 * 1024;
constexpr std::uint64_t kModelBytes = 16 * kMiB;
// memory_calls.c prints 152 cases on Linux 6.18 with glibc 2.36; fewer means the table was cut
// short (a crash, or a case list that lost its cases).
constexpr std::size_t kMinCases = 140;

struct Output {
  int status = -1;
  std::vector<std::string> cases;     // "NAME RESULT ERRNO"
  std::vector<std::string> comments;  // "# ..." lines
  std::string out, err;
};

bool linux_at_least(int major, int minor) {
  utsname u{};
  int ma = 0, mi = 0;
  return ::uname(&u) == 0 && std::sscanf(u.release, "%d.%d", &ma, &mi) == 2 &&
         (ma > major || (ma == major && mi >= minor));
}

class MemoryCallsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::string error;
    dir_ = residency::testing::make_disk_temp_dir("preload-memory-calls", error);
    if (dir_.empty()) {
      setup_error_ = error;
      return;
    }
    model_ = dir_ + "/model-f16.gguf";
    setup_error_ = residency::testing::write_f16_model(model_, kModelBytes);
  }
  static void TearDownTestSuite() {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  void SetUp() override {
    if (!setup_error_.empty()) GTEST_SKIP() << setup_error_;
  }

  // `without_cap_ipc_lock`: the program runs without CAP_IPC_LOCK under RLIMIT_MEMLOCK 8 MiB (what
  // a service without privileges gets), where the session's locks count against the program's.
  static Output run(std::vector<std::string> args, bool preload, const std::string& name,
                    bool without_cap_ipc_lock = false) {
    ChildSpec s;
    if (without_cap_ipc_lock)
      s.before_exec = [] {
        residency::testing::drop_cap_ipc_lock();
        residency::testing::set_memlock_limit(8U << 20);
        return true;
      };
    s.argv = {MEMORY_CALLS_PATH};
    s.argv.insert(s.argv.end(), args.begin(), args.end());
    s.drop_env_prefixes = {"RESIDENCY_", "LD_PRELOAD"};
    s.env = {"TMPDIR=" + dir_};  // the program's scratch file, unlinked once open
    if (preload) {
      s.env.push_back(std::string("LD_PRELOAD=") + PRELOAD_PATH);
      s.env.push_back("RESIDENCY_LOG=warn");
      s.env.push_back("RESIDENCY_KEEP_ALIVE=5m");  // the model stays held while the table runs
    }
    s.stderr_path = dir_ + "/" + name + (preload ? "-preload" : "-plain") + ".err";
    ChildProcess c(s);
    Output r;
    if (!c.started()) return r;
    r.status = c.finish(120);
    r.out = c.stdout_text();
    r.err = c.stderr_text();
    std::stringstream ss(r.out);
    for (std::string l; std::getline(ss, l);) (l.rfind("#", 0) == 0 ? r.comments : r.cases).push_back(l);
    return r;
  }

  // Both runs finished the table, and every case printed the same line.
  static void expect_same_lines(const Output& plain, const Output& with) {
    ASSERT_EQ(plain.status, 0) << plain.out << plain.err;
    ASSERT_GE(plain.cases.size(), kMinCases) << plain.out << plain.err;
    if (linux_at_least(5, 7)) {  // the case the preload broke must have worked without it
      EXPECT_EQ(line_of(plain, "mremap_maymove_dontunmap"), "mremap_maymove_dontunmap moved,data,old_zero 0");
    }
    EXPECT_EQ(with.status, 0) << with.out << with.err;
    for (std::size_t i = 0; i < plain.cases.size(); ++i) {
      const std::string got = i < with.cases.size() ? with.cases[i] : "(missing)";
      EXPECT_EQ(got, plain.cases[i]) << "case " << i << ": with the preload (expected: without it)";
    }
    EXPECT_EQ(with.cases.size(), plain.cases.size()) << with.out << with.err;
  }

  static std::string line_of(const Output& r, const std::string& name) {
    for (const auto& l : r.cases)
      if (l.rfind(name + " ", 0) == 0) return l;
    return "(no line " + name + ")";
  }

  static std::string dir_, model_, setup_error_;
};
std::string MemoryCallsTest::dir_, MemoryCallsTest::model_, MemoryCallsTest::setup_error_;

TEST_F(MemoryCallsTest, EveryHookedCallGivesTheSameResultAndErrnoAsWithoutThePreload) {
  const Output plain = run({}, false, "plain");
  const Output with = run({}, true, "plain");
  expect_same_lines(plain, with);
}

TEST_F(MemoryCallsTest, TheSameWhileTheSessionHoldsAModel) {
  const Output plain = run({model_}, false, "model");
  const Output with = run({model_}, true, "model");
  expect_same_lines(plain, with);
  // The session ran: it held the model's weights (the program locked nothing before the line).
  long locked_kb = -1;
  for (const auto& c : with.comments) std::sscanf(c.c_str(), "# vm_lck_kb %ld", &locked_kb);
  EXPECT_GE(locked_kb, static_cast<long>(kModelBytes / 2 / 1024))
      << "the preload's session held the model before the table ran\n"
      << with.out << with.err;
}

// Without CAP_IPC_LOCK the session's locks count against the program's RLIMIT_MEMLOCK: a lock of
// the program's that fails on it makes the session step aside (the program's locks come first),
// so the table is the same as without the preload (92b9934 and the round-4 change before this:
// mmap(MAP_LOCKED) failed with EAGAIN and mlock with ENOMEM only under the preload).
TEST_F(MemoryCallsTest, TheSameWithoutCapIpcLockWhereTheSessionsLocksCountAgainstTheProgramsLimit) {
  const Output plain = run({model_}, false, "nocap", true);
  const Output with = run({model_}, true, "nocap", true);
  expect_same_lines(plain, with);
}

}  // namespace
