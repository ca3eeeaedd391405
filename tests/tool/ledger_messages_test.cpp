// SPDX-License-Identifier: MIT
// The messages `residency hold` prints about a shared budget's ledger and its configuration
// (issue 18, item 10), run as a user runs the tool (fork + exec, real files, real users where the
// case needs one): each says what was wrong and what is accepted, on one line, with exit status 2
// for bad input, and none misleads (a full shared budget is not "the wired limit", a truncated
// ledger is not "another C library", a root process that names the group is not told to name one).
#if defined(__linux__)
#include <fcntl.h>
#include <grp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
const std::string kTool = RESIDENCY_TOOL_PATH;

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

bool exists(const std::string& p) {
  struct stat st {};
  return ::lstat(p.c_str(), &st) == 0;
}

std::string ledger_path(const std::string& name) { return "/dev/shm/residency-budget-" + name; }

// The entries of /dev/shm that belong to the ledger of `name`: the ledger and any temporary file
// it was being made as (`NAME.tmp-PID-N`).
std::vector<std::string> shm_entries_of(const std::string& name) {
  std::vector<std::string> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/dev/shm", ec))
    if (const std::string p = e.path().string(); p == ledger_path(name) || p.rfind(ledger_path(name) + ".tmp-", 0) == 0)
      found.push_back(p);
  return found;
}

// A budget name of this test run only (other tests run at the same time).
std::string unique_name(const char* what) {
  static int n = 0;
  return std::string("msg-") + what + "-" + std::to_string(::getpid()) + "-" + std::to_string(n++);
}

struct HoldRun {
  int exit_code = -1;  // -1: killed by a signal
  std::string out, err;
};

bool one_line(const std::string& s) {
  return !s.empty() && s.back() == '\n' && std::count(s.begin(), s.end(), '\n') == 1;
}

class LedgerMessages : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/var/tmp/residency-ledger-messages-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    ::chmod(root_.c_str(), 0755);  // another user's hold reads the file
    file_ = root_ + "/model";
    std::ofstream(file_) << std::string(1 << 20, 'x');
    ::chmod(file_.c_str(), 0644);
  }
  void TearDown() override {
    for (pid_t p : running_) {
      ::kill(p, SIGKILL);
      ::waitpid(p, nullptr, 0);
    }
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  // `residency hold ARGS` with `env` added, as uid/gid `as` (-1: this user), after `in_child` (run
  // in the child just before exec); returns its pid.
  pid_t start(std::vector<std::string> args, std::vector<std::string> env, int as = -1, const std::string& tag = "run",
              const std::function<void()>& in_child = {}) {
    const std::string out = root_ + "/" + tag + ".out", err = root_ + "/" + tag + ".err";
    std::fflush(stdout);
    const pid_t pid = ::fork();
    if (pid != 0) {
      running_.push_back(pid);
      return pid;
    }
    const int o = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0666),
              e = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0666);
    ::dup2(o, 1);
    ::dup2(e, 2);
    if (as >= 0 &&
        (::setgroups(0, nullptr) != 0 || ::setgid(static_cast<gid_t>(as)) != 0 || ::setuid(static_cast<uid_t>(as)) != 0))
      ::_exit(126);
    for (const auto& kv : env) ::putenv(const_cast<char*>(kv.c_str()));
    if (in_child) in_child();
    std::vector<char*> argv{const_cast<char*>(kTool.c_str()), const_cast<char*>("hold")};
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(kTool.c_str(), argv.data());
    ::_exit(127);
  }
  HoldRun finish(pid_t pid, const std::string& tag = "run") {
    HoldRun r;
    int st = 0;
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while (::waitpid(pid, &st, WNOHANG) != pid) {
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &st, 0);
        ADD_FAILURE() << "hold did not finish within 30 s";
        break;
      }
      std::this_thread::sleep_for(5ms);
    }
    running_.erase(std::remove(running_.begin(), running_.end(), pid), running_.end());
    if (WIFEXITED(st)) r.exit_code = WEXITSTATUS(st);
    r.out = slurp(root_ + "/" + tag + ".out");
    r.err = slurp(root_ + "/" + tag + ".err");
    return r;
  }
  HoldRun hold(std::vector<std::string> args, std::vector<std::string> env, int as = -1,
               const std::function<void()>& in_child = {}) {
    return finish(start(std::move(args), std::move(env), as, "run", in_child));
  }
  bool wait_for(const std::string& tag, const std::string& text) {
    for (int i = 0; i < 2000; ++i) {
      if (slurp(root_ + "/" + tag + ".out").find(text) != std::string::npos) return true;
      std::this_thread::sleep_for(5ms);
    }
    return false;
  }
  std::string root_, file_;
  std::vector<pid_t> running_;
};

// The specific reason reaches the user (before: "is not a size or a percent" for all of them,
// and "not a number" for 1e2).
TEST_F(LedgerMessages, SizesAndNumbersSayWhatIsWrongAndWhatIsAccepted) {
  struct Case {
    std::string var, says;
  } cases[] = {
      {"RESIDENCY_SHARED_BUDGET=x:101%", "the size '101%': a percent must be from 0 to 100; accepted: NAME:SIZE"},
      {"RESIDENCY_SHARED_BUDGET=x:18446744073709551615",
       "the size '18446744073709551615': too large: more than 2^63 bytes (8 EiB); accepted: NAME:SIZE"},
      {"RESIDENCY_SHARED_BUDGET=x:1e2%", "the size '1e2%': an exponent ('e2') is not accepted; write the number out"},
      {"RESIDENCY_SET_MAX_PCT=1e2",
       "RESIDENCY_SET_MAX_PCT=\"1e2\": an exponent ('e2') is not accepted; write the number out (100, not 1e2); "
       "accepted: a "
       "decimal number"},
  };
  for (const auto& c : cases) {
    const HoldRun r = hold({file_}, {c.var});
    EXPECT_EQ(r.exit_code, 2) << c.var << ": " << r.err;
    EXPECT_TRUE(one_line(r.err)) << r.err;
    EXPECT_NE(r.err.find(c.says), std::string::npos) << r.err;
  }
}

// A ledger path that is a symbolic link (before: "Too many levels of symbolic links").
TEST_F(LedgerMessages, ASymlinkedLedgerIsNamedAsOne) {
  const std::string name = unique_name("symlink");
  ASSERT_EQ(::symlink((root_ + "/elsewhere").c_str(), ledger_path(name).c_str()), 0);
  const HoldRun r = hold({file_}, {"RESIDENCY_SHARED_BUDGET=" + name + ":8MiB"});
  ::unlink(ledger_path(name).c_str());
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(one_line(r.err)) << r.err;
  EXPECT_NE(r.err.find(ledger_path(name) + " is a symbolic link; a ledger must be a regular file in /dev/shm"), std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("Too many levels"), std::string::npos) << r.err;
}

// A truncated ledger is called that (before: "a build for another C library or ABI").
TEST_F(LedgerMessages, ATruncatedLedgerIsCalledTruncated) {
  const std::string name = unique_name("truncated");
  const std::string env = "RESIDENCY_SHARED_BUDGET=" + name + ":8MiB";
  start({file_}, {env}, -1, "first");
  ASSERT_TRUE(wait_for("first", "holding")) << slurp(root_ + "/first.err");
  ASSERT_EQ(::truncate(ledger_path(name).c_str(), 1000), 0);
  const HoldRun r = hold({file_}, {env});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(one_line(r.err)) << r.err;
  EXPECT_NE(r.err.find(" is 1000 bytes long where its header says "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("another process truncated or extended it"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("C library or ABI"), std::string::npos) << r.err;
  ::kill(running_.front(), SIGTERM);
  EXPECT_EQ(finish(running_.front(), "first").exit_code, 0) << "the first holder ends normally";
  ::unlink(ledger_path(name).c_str());
}

// A full shared budget is named as such (before: "over the wired limit" with the local limit).
TEST_F(LedgerMessages, AFullSharedBudgetIsNotCalledTheWiredLimit) {
  const std::string name = unique_name("full");
  const HoldRun r = hold({"-q", file_}, {"RESIDENCY_SHARED_BUDGET=" + name + ":512KiB"});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.out.find("1 MiB is not wired: the shared budget " + name + " (512 KiB, RESIDENCY_SHARED_BUDGET) had no room"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("over the wired limit"), std::string::npos) << r.out;
  EXPECT_FALSE(exists(ledger_path(name)));
}

// More than the memory limit: hold's advice is hold's (before: "set Config::memory_limit").
TEST_F(LedgerMessages, OverTheMemoryLimitHoldSaysWhatAHoldUserCanDo) {
  const std::string big = root_ + "/big";
  { std::ofstream f(big); }
  // Twice the physical memory: above the memory limit (at most 0.95 x physical memory) on every
  // machine, and a mapping a sanitizer build can make (a 1 TiB file could not be mapped in one
  // of CI's sanitizer builds: "Cannot allocate memory").
  const long long physical = static_cast<long long>(::sysconf(_SC_PHYS_PAGES)) * ::sysconf(_SC_PAGESIZE);
  ASSERT_GT(physical, 0);
  ASSERT_EQ(::truncate(big.c_str(), 2 * physical), 0) << "a sparse file of twice the physical memory";
  const HoldRun r = hold({"-q", big}, {});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(one_line(r.err)) << r.err;
  EXPECT_NE(r.err.find("above the memory limit of"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("; hold fewer or smaller files"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("set Config::memory_limit"), std::string::npos) << r.err;
}

// Group ledgers, with real users: root that names the group but is not a member is told that
// (before: "unless it names a group"); a user that names a group it is not a member of is told
// which ledger could not be given to which group (before: the words were out of order, then the
// file named was the temporary `.tmp-` one, gone by the time the message is read).
TEST_F(LedgerMessages, GroupLedgerMessagesNameTheGroupAndTheMembership) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root (to run a hold as uid 65534)";
  struct group* ng = ::getgrgid(65534);
  if (!ng) GTEST_SKIP() << "no group 65534 on this machine";
  const std::string group = ng->gr_name;
  if (group == "root") GTEST_SKIP() << "group 65534 is root";
  {
    const HoldRun probe = hold({"--help"}, {}, 65534);
    if (probe.exit_code != 0)
      GTEST_SKIP() << "uid 65534 cannot execute the tool (a directory above it is not searchable)";
  }
  // nobody creates a ledger for its group; root, not a member, names the same group.
  const std::string name = unique_name("group");
  const std::string env = "RESIDENCY_SHARED_BUDGET=" + name + ":8MiB:" + group;
  start({file_}, {env}, 65534, "nobody");
  ASSERT_TRUE(wait_for("nobody", "holding")) << slurp(root_ + "/nobody.err");
  const HoldRun r = hold({file_}, {env});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(one_line(r.err)) << r.err;
  EXPECT_NE(r.err.find(ledger_path(name) + " is the ledger of group '" + group +
                       "' (mode 0660, owner uid 65534), and this "
                       "process (uid 0) is not a member of that group"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("unless it names a group"), std::string::npos) << r.err;
  // Root that names no group is told that the ledger is a group's and how to name it (before:
  // "private to the user who created it unless it names a group", of a ledger that is a group's).
  const HoldRun u = hold({file_}, {"RESIDENCY_SHARED_BUDGET=" + name + ":8MiB"});
  EXPECT_EQ(u.exit_code, 2) << u.err;
  EXPECT_TRUE(one_line(u.err)) << u.err;
  EXPECT_NE(u.err.find(ledger_path(name) + " is the ledger of group '" + group +
                       "' (mode 0660, owner uid 65534), and "
                       "this budget names no group; to share it, name the group: NAME:SIZE:" +
                       group),
            std::string::npos)
      << u.err;
  EXPECT_EQ(u.err.find("private to the user"), std::string::npos) << u.err;
  ::kill(running_.front(), SIGTERM);
  EXPECT_EQ(finish(running_.front(), "nobody").exit_code, 0);
  EXPECT_FALSE(exists(ledger_path(name)));
  // nobody names the group root, which it is not a member of.
  const std::string other = unique_name("notmember");
  const HoldRun n = hold({file_}, {"RESIDENCY_SHARED_BUDGET=" + other + ":8MiB:root"}, 65534);
  EXPECT_EQ(n.exit_code, 2) << n.err;  // (after the RLIMIT_MEMLOCK clamp warning a non-root user gets)
  EXPECT_NE(n.err.find("cannot give the new ledger " + ledger_path(other) +
                       " to the group 'root': Operation not permitted (a user may give a file only to a group it is a "
                       "member of"),
            std::string::npos)
      << n.err;
  EXPECT_EQ(n.err.find(".tmp-"), std::string::npos) << "names the temporary file: " << n.err;
  EXPECT_FALSE(exists(ledger_path(other)));
  EXPECT_TRUE(shm_entries_of(other).empty()) << "left in /dev/shm: " << shm_entries_of(other).front();
}

// A ledger that cannot be made (here: RLIMIT_FSIZE below its size, so that sizing the new file
// fails with EFBIG; SIGXFSZ is ignored, as a shell's `trap '' XFSZ` would) is named by its path
// (before: by the `.tmp-` file it was being made as, which is removed before the message is
// read), and nothing of it is left in /dev/shm.
TEST_F(LedgerMessages, ALedgerThatCannotBeMadeIsNamedByItsPath) {
  const std::string name = unique_name("fsize");
  // 1 KiB: below a ledger's 64 slots of 64 bytes and more, above the one line hold writes to its
  // stderr file (RLIMIT_FSIZE holds for those files too).
  const rlim_t limit = 1024;
  const HoldRun r = hold({file_}, {"RESIDENCY_SHARED_BUDGET=" + name + ":8MiB"}, -1, [limit] {
    ::signal(SIGXFSZ, SIG_IGN);  // kept across exec: ignored signals stay ignored
    const rlimit rl{limit, limit};
    if (::setrlimit(RLIMIT_FSIZE, &rl) != 0) ::_exit(125);
  });
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(one_line(r.err)) << r.err;
  EXPECT_NE(r.err.find("cannot set the size of the new ledger " + ledger_path(name) + ": File too large"), std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find(".tmp-"), std::string::npos) << "names the temporary file: " << r.err;
  EXPECT_FALSE(exists(ledger_path(name)));
  EXPECT_TRUE(shm_entries_of(name).empty()) << "left in /dev/shm: " << shm_entries_of(name).front();
}

}  // namespace
#endif
