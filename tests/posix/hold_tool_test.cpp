// SPDX-License-Identifier: MIT
// `residency hold FILE...` as a user runs it: the kernel holds the file's pages locked in the
// hold process (its VmLck), pageout from another process evicts none of them (the page cache is
// shared), SIGTERM and SIGHUP unlock and exit 0, a keep-alive ends the hold by itself, and each bad
// input is one line and exit status 2.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <thread>

#include "ledger/ledger.hpp"
#include "posix_test_support.hpp"
#include "support/state_files.hpp"

#ifndef RESIDENCY_TOOL_PATH
#error "RESIDENCY_TOOL_PATH must name the residency binary (tests/posix/CMakeLists.txt)"
#endif

namespace {

using namespace residency::posix_test;
using namespace std::chrono_literals;

// The temporary file is unlinked; another process opens it through our descriptor.
std::string path_of(const TempMappedFile& f) {
  return "/proc/" + std::to_string(::getpid()) + "/fd/" + std::to_string(f.fd());
}

// A child running `residency hold ARGS` with stdout and stderr in files, `env` (NAME=VALUE) added
// to its environment and `in_child` run just before the exec.
struct Hold {
  pid_t pid = -1;
  std::string out_path, err_path;
  explicit Hold(const std::vector<std::string>& args, const std::string& dir, std::vector<std::string> env = {},
                const std::function<void()>& in_child = {}) {
    // Names of their own: a file left by an earlier run must not be mistaken for this one's.
    static int serial = 0;
    const std::string stem = dir + "/residency-hold-test-" + std::to_string(::getpid()) + "-" + std::to_string(serial++);
    out_path = stem + ".out";
    err_path = stem + ".err";
    std::remove(out_path.c_str());
    std::remove(err_path.c_str());
    pid = ::fork();
    if (pid == 0) {
      std::freopen(out_path.c_str(), "w", stdout);
      std::freopen(err_path.c_str(), "w", stderr);
      for (auto& e : env) ::putenv(e.data());
      if (in_child) in_child();
      std::vector<char*> argv;
      argv.push_back(const_cast<char*>(RESIDENCY_TOOL_PATH));
      argv.push_back(const_cast<char*>("hold"));
      for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv(RESIDENCY_TOOL_PATH, argv.data());
      ::_exit(127);
    }
  }
  std::string out() const { return slurp(out_path); }
  std::string err() const { return slurp(err_path); }
  static std::string slurp(const std::string& p) {
    std::ifstream f(p);
    return std::string(std::istreambuf_iterator<char>(f), {});
  }
  std::uint64_t vm_lck() const {
    std::ifstream f("/proc/" + std::to_string(pid) + "/status");
    std::string line;
    while (std::getline(f, line))
      if (line.rfind("VmLck:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
    return 0;
  }
  // Waits up to `limit` for the child to exit; its exit status, or -1.
  int wait_exit(std::chrono::milliseconds limit) {
    const auto t0 = std::chrono::steady_clock::now();
    while (std::chrono::steady_clock::now() - t0 < limit) {
      int st = 0;
      if (::waitpid(pid, &st, WNOHANG) == pid) {
        pid = -1;
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      }
      std::this_thread::sleep_for(10ms);
    }
    return -1;
  }
  // Sends `sig` to the child while it runs; false once it has been reaped (pid -1: kill(-1, sig)
  // would signal every process this user may signal).
  bool signal(int sig) const { return pid > 0 && ::kill(pid, sig) == 0; }
  bool wait_for_output(const std::string& needle, std::chrono::milliseconds limit) const {
    const auto t0 = std::chrono::steady_clock::now();
    while (std::chrono::steady_clock::now() - t0 < limit) {
      if (out().find(needle) != std::string::npos) return true;
      std::this_thread::sleep_for(10ms);
    }
    return false;
  }
  ~Hold() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
      residency::testing::remove_state_files_of(pid);
    }
    std::remove(out_path.c_str());
    std::remove(err_path.c_str());
  }
};

TEST(HoldTool, HoldsAFileAgainstPageoutFromAnotherProcessUntilSigterm) {
  if (auto why = pageout_unsupported_reason()) GTEST_SKIP() << *why;
  constexpr std::size_t kSize = 64 * MiB;
  TempMappedFile model(kSize);
  ASSERT_TRUE(model.ok()) << model.error();
  model.touch_all();
  const std::string dir = ::testing::TempDir();
  Hold h({path_of(model), "--keep-alive", "forever"}, dir);
  ASSERT_GT(h.pid, 0);
  ASSERT_TRUE(h.wait_for_output("holding", 10s)) << h.out() << h.err();
  EXPECT_NE(h.out().find("holding 64 MiB of 64 MiB in 1 file(s)"), std::string::npos) << h.out() << h.err();
  EXPECT_EQ(h.vm_lck(), kSize) << "the hold process locks the whole file";
  // Pressure made repeatable, from this process: reclaim every page of our own mapping of the
  // same file. The hold process's locks keep the shared page-cache pages.
  model.page_out();
  EXPECT_EQ(model.resident_fraction(), 1.0) << "pageout evicted pages the hold process locks";
  ASSERT_EQ(::kill(h.pid, SIGTERM), 0);
  EXPECT_EQ(h.wait_exit(5s), 0) << h.out() << h.err();
  EXPECT_NE(h.out().find("unlocking and exiting"), std::string::npos) << h.out();
  // Unlocked: pageout takes the pages now.
  model.page_out();
  EXPECT_LT(model.resident_fraction(), 0.10);
}

// SIGHUP, what hold gets when the terminal it was started from closes, ends it as SIGTERM does:
// through the clean path, exit 0 (129 would be death by the signal), the file unlocked (pageout
// from this process takes its pages), and its share of a shared budget given back: as the last
// holder it removes the ledger, which a process killed by the signal leaves in /dev/shm.
TEST(HoldTool, SighupEndsTheHoldAsSigtermDoes) {
  constexpr std::size_t kSize = 4 * MiB;  // within a non-root user's default 8 MiB RLIMIT_MEMLOCK
  TempMappedFile model(kSize);
  ASSERT_TRUE(model.ok()) << model.error();
  model.touch_all();
  const std::string name = "hold-sighup-" + std::to_string(::getpid());
  const std::string ledger = residency::ledger::ledger_path(name);
  Hold h({path_of(model), "--keep-alive", "forever"}, ::testing::TempDir(), {"RESIDENCY_SHARED_BUDGET=" + name + ":8MiB"},
         [] { ::signal(SIGHUP, SIG_DFL); });  // not ignored, even where this test runs under nohup
  ASSERT_GT(h.pid, 0);
  ASSERT_TRUE(h.wait_for_output("holding", 10s)) << h.out() << h.err();
  EXPECT_EQ(h.vm_lck(), kSize) << "the hold process locks the whole file";
  EXPECT_EQ(::access(ledger.c_str(), F_OK), 0) << "the hold holds a share of the budget " << name;
  ASSERT_TRUE(h.signal(SIGHUP));
  EXPECT_EQ(h.wait_exit(5s), 0) << h.out() << h.err();
  EXPECT_NE(h.out().find("residency hold: SIGHUP: unlocking and exiting"), std::string::npos) << h.out();
  EXPECT_NE(::access(ledger.c_str(), F_OK), 0) << "the ledger outlived its only holder: its share was not given back";
  if (auto why = pageout_unsupported_reason()) {
    std::printf("not checked by pageout: %s\n", why->c_str());
  } else {
    model.page_out();
    EXPECT_LT(model.resident_fraction(), 0.10) << "the pages are still locked";
  }
  ::unlink(ledger.c_str());  // only if a failure above left it
}

// `nohup residency hold FILE`: a SIGHUP ignored when hold starts stays ignored (before: hold's
// signalfd took it anyway, since a blocked signal is queued whatever its disposition, and the hold
// ended with the terminal). SIGTERM still ends it through the clean path.
TEST(HoldTool, UnderNohupSighupIsIgnoredAndTheHoldGoesOn) {
  constexpr std::size_t kSize = 4 * MiB;
  TempMappedFile model(kSize);
  ASSERT_TRUE(model.ok()) << model.error();
  model.touch_all();
  Hold h({path_of(model), "--keep-alive", "forever"}, ::testing::TempDir(), {},
         [] { ::signal(SIGHUP, SIG_IGN); });  // what nohup does before it runs the command
  ASSERT_GT(h.pid, 0);
  ASSERT_TRUE(h.wait_for_output("holding", 10s)) << h.out() << h.err();
  ASSERT_EQ(h.vm_lck(), kSize);
  ASSERT_TRUE(h.signal(SIGHUP));
  ASSERT_EQ(h.wait_exit(500ms), -1) << "SIGHUP ended a hold that had it ignored: " << h.out() << h.err();
  EXPECT_EQ(h.vm_lck(), kSize) << "still holding the whole file";
  EXPECT_EQ(h.out().find("SIGHUP"), std::string::npos) << h.out();
  ASSERT_TRUE(h.signal(SIGTERM));
  EXPECT_EQ(h.wait_exit(5s), 0) << h.out() << h.err();
  EXPECT_NE(h.out().find("SIGTERM: unlocking and exiting"), std::string::npos) << h.out();
}

TEST(HoldTool, AKeepAliveEndsTheHoldByItself) {
  TempMappedFile model(4 * MiB);
  ASSERT_TRUE(model.ok()) << model.error();
  const auto t0 = std::chrono::steady_clock::now();
  Hold h({path_of(model), "--keep-alive", "500ms", "--quiet"}, ::testing::TempDir());
  EXPECT_EQ(h.wait_exit(5s), 0) << h.out() << h.err();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(s, 0.5);
  EXPECT_LT(s, 3.0);
  EXPECT_NE(h.out().find("keep-alive 500 ms expired); exiting"), std::string::npos) << h.out();
  EXPECT_EQ(h.err(), "") << "--quiet: no info lines";
}

TEST(HoldTool, BadInputIsOneLineAndExitStatus2) {
  TempMappedFile model(1 * MiB);
  ASSERT_TRUE(model.ok()) << model.error();
  const std::string dir = ::testing::TempDir();
  struct Case {
    std::vector<std::string> args;
    const char* says;
  };
  const Case cases[] = {
      {{}, "FILE is required"},
      {{"/nonexistent/model.gguf"}, "cannot open '/nonexistent/model.gguf'"},
      {{"/tmp"}, "is not a regular file"},
      {{"/dev/null"}, "is not a regular file"},
      {{path_of(model), "--keep-alive", "0"}, "hold has no uses"},
      {{path_of(model), "--keep-alive", "soon"}, "--keep-alive: "},
      {{path_of(model), "--wired-limit", "lots"}, "--wired-limit: "},
      // 0 and 0% are one limit, 0 bytes, which wires nothing (before: exit 1 after starting).
      {{path_of(model), "--wired-limit", "0"},
       "--wired-limit '0': a wired limit of 0 wires nothing, and hold only wires"},
      {{path_of(model), "--wired-limit", "0%"}, "--wired-limit '0%': a wired limit of 0 wires nothing"},
  };
  for (const auto& c : cases) {
    Hold h(c.args, dir);
    EXPECT_EQ(h.wait_exit(5s), 2) << c.says;
    const std::string err = h.err();
    EXPECT_NE(err.find(c.says), std::string::npos) << err;
    EXPECT_LE(std::count(err.begin(), err.end(), '\n'), 2) << err;  // the line (+ CLI11's hint)
    EXPECT_EQ(h.out(), "");
  }
}

TEST(HoldTool, AWiredLimitOf0FromTheEnvironmentIsBadInputNamingTheVariable) {
  TempMappedFile model(1 * MiB);
  ASSERT_TRUE(model.ok()) << model.error();
  Hold h({path_of(model)}, ::testing::TempDir(), {"RESIDENCY_WIRED_LIMIT=0%"});
  EXPECT_EQ(h.wait_exit(5s), 2) << h.out() << h.err();
  EXPECT_NE(h.err().find("RESIDENCY_WIRED_LIMIT='0%': a wired limit of 0 wires nothing"), std::string::npos) << h.err();
}

// Under a small RLIMIT_MEMLOCK without CAP_IPC_LOCK (a container's default), what did not fit is
// blamed on that limit, with its value and how to raise it, not on --wired-limit or
// RESIDENCY_WIRED_LIMIT, which nobody gave. As root the capability is dropped from the bounding
// set too, so that the exec'd tool does not get it back.
TEST(HoldTool, UnderASmallMemlockLimitTheMessageNamesThatLimit) {
  TempMappedFile model(4 * MiB);
  ASSERT_TRUE(model.ok()) << model.error();
  Hold h({path_of(model), "--keep-alive", "1s"}, ::testing::TempDir(), {}, [] {
    if (::getuid() == 0 && ::prctl(PR_CAPBSET_DROP, CAP_IPC_LOCK, 0, 0, 0) != 0) ::_exit(77);
    if (!drop_cap_ipc_lock().empty() && ::getuid() == 0) ::_exit(77);
    if (!set_memlock_limit(1 * MiB).empty()) ::_exit(77);
  });
  const int rc = h.wait_exit(10s);
  if (rc == 77) GTEST_SKIP() << "cannot drop CAP_IPC_LOCK or lower RLIMIT_MEMLOCK here";
  const std::string out = h.out();
  EXPECT_EQ(rc, 1) << out << h.err();  // nothing could be wired
  EXPECT_NE(out.find("4 MiB is not wired: over the wired limit of 1 MiB (the process's RLIMIT_MEMLOCK = 1 MiB; "
                     "to wire more: raise RLIMIT_MEMLOCK: `ulimit -l unlimited`"),
            std::string::npos)
      << out;
  EXPECT_EQ(out.find("--wired-limit"), std::string::npos) << out;
  EXPECT_EQ(out.find("RESIDENCY_WIRED_LIMIT"), std::string::npos) << out;
}

// A held file that is deleted, shrinks or grows, with real files under a real name: what the
// kernel holds (the hold process's VmLck) follows the file within a few seconds, each change is
// said once, touching nothing past a shrunk file's end (no SIGBUS), and hold ends by itself
// (exit 0) once no file is left.
TEST(HoldTool, FollowsAHeldFileThatIsDeletedShrinksOrGrows) {
  const std::string dir = ::testing::TempDir();
  const std::string a = dir + "/residency-hold-follow-a-" + std::to_string(::getpid());
  const std::string b = dir + "/residency-hold-follow-b-" + std::to_string(::getpid());
  auto write_file = [](const std::string& path, std::size_t size) {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f << std::string(size, 'x');
  };
  write_file(a, 4 * MiB);
  write_file(b, 2 * MiB);
  Hold h({a, b, "--keep-alive", "forever", "--quiet"}, dir);
  ASSERT_GT(h.pid, 0);
  ASSERT_TRUE(h.wait_for_output("holding", 10s)) << h.out() << h.err();
  EXPECT_EQ(h.vm_lck(), 6 * MiB);
  const auto wait_for_lck = [&](std::uint64_t bytes) {
    for (int i = 0; i < 500 && h.vm_lck() != bytes; ++i) std::this_thread::sleep_for(10ms);
    return h.vm_lck();
  };

  ASSERT_EQ(::unlink(a.c_str()), 0);
  ASSERT_TRUE(h.wait_for_output("was deleted", 5s)) << h.out() << h.err();
  EXPECT_EQ(wait_for_lck(2 * MiB), 2 * MiB) << "the deleted file is unlocked";
  std::this_thread::sleep_for(2500ms);  // two more checks: said once
  const std::string out = h.out();
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n') - 1, 1) << "one line for the deletion:\n" << out;
  EXPECT_NE(out.find("'" + a + "' was deleted: released its 4 MiB"), std::string::npos) << out;

  ASSERT_EQ(::truncate(b.c_str(), 1 * MiB), 0);
  ASSERT_TRUE(h.wait_for_output("shrank", 5s)) << h.out() << h.err();
  EXPECT_EQ(wait_for_lck(1 * MiB), 1 * MiB) << "held at its new length";
  EXPECT_NE(h.out().find("'" + b + "' shrank from 2 MiB to 1 MiB"), std::string::npos) << h.out();

  ASSERT_EQ(::truncate(b.c_str(), 3 * MiB), 0);
  ASSERT_TRUE(h.wait_for_output("grew", 5s)) << h.out() << h.err();
  EXPECT_EQ(wait_for_lck(3 * MiB), 3 * MiB) << "the grown file is held whole";
  EXPECT_NE(h.out().find("'" + b + "' grew from 1 MiB to 3 MiB"), std::string::npos) << h.out();

  ASSERT_EQ(::unlink(b.c_str()), 0);
  EXPECT_EQ(h.wait_exit(5s), 0) << "ends once no file is left (not SIGBUS: 128 + 7)\n" << h.out() << h.err();
  EXPECT_NE(h.out().find("none of the files is left to hold; exiting"), std::string::npos) << h.out();
  EXPECT_EQ(h.err(), "") << "--quiet: nothing on stderr";
}

// A file that had no name already when hold opened it (an unlinked file, through /proc/PID/fd/N)
// is held as any other, not taken for a file deleted since.
TEST(HoldTool, AFileUnlinkedBeforeTheStartIsHeldNotReleased) {
  TempMappedFile model(2 * MiB);
  ASSERT_TRUE(model.ok()) << model.error();
  Hold h({path_of(model), "--keep-alive", "forever", "--quiet"}, ::testing::TempDir());
  ASSERT_TRUE(h.wait_for_output("holding", 10s)) << h.out() << h.err();
  std::this_thread::sleep_for(2500ms);  // two checks of the file
  EXPECT_EQ(h.vm_lck(), 2 * MiB) << h.out();
  EXPECT_EQ(h.out().find("deleted"), std::string::npos) << h.out();
  ASSERT_EQ(::kill(h.pid, SIGTERM), 0);
  EXPECT_EQ(h.wait_exit(5s), 0) << h.out() << h.err();
}

}  // namespace
