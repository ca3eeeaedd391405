// SPDX-License-Identifier: MIT
// `residency doctor` as a user runs it (issue 40, item 3): on a llama.cpp program under the
// preload (active, exit 0, the llama.cpp the preload says it serves; with a bad RESIDENCY_* value
// loaded but not active, that variable first to fix), on a process without it (not
// loaded and why, exit 1), on a process whose RLIMIT_MEMLOCK is below what it registered and on a
// command whose -m model is larger than the limit (the fix named), on a command with a bad
// RESIDENCY_* value (the variable named as the preload would), on another user's process (said,
// not fatal), and on bad input (one line, exit 2). --json is checked against the text's verdict.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support/child_process.hpp"
#include "support/memlock_privileges.hpp"
#include "support/temp_dir.hpp"

namespace {

using residency::testing::ChildProcess;
using residency::testing::ChildSpec;

struct DoctorRun {
  int exit_code = -1;
  std::string out, err;
  std::vector<std::string> lines;  // stdout's
};

// The tool with `args`, the environment less RESIDENCY_* and LD_PRELOAD plus `env`, and `before_exec`
// in the child (a limit, another user).
DoctorRun doctor(const std::vector<std::string>& args, const std::vector<std::string>& env = {},
                 std::function<bool()> before_exec = {}) {
  static int n = 0;
  ChildSpec spec;
  spec.argv = {RESIDENCY_TOOL_PATH, "doctor"};
  spec.argv.insert(spec.argv.end(), args.begin(), args.end());
  spec.env = env;
  spec.drop_env_prefixes = {"RESIDENCY_", "LD_PRELOAD="};
  spec.stderr_path = ::testing::TempDir() + "doctor-" + std::to_string(::getpid()) + "-" + std::to_string(n++) + ".err";
  spec.before_exec = std::move(before_exec);
  ChildProcess c(spec);
  DoctorRun r;
  r.exit_code = c.finish(60);
  r.out = c.stdout_text();
  r.err = c.stderr_text();
  ::unlink(spec.stderr_path.c_str());
  std::istringstream in(r.out);
  for (std::string line; std::getline(in, line);) r.lines.push_back(line);
  return r;
}

// The line of check `name` ("FAIL  memlock   ..."), or "".
std::string line_of(const DoctorRun& r, const std::string& name) {
  for (const auto& l : r.lines)
    if (l.size() > 6 && l.compare(6, name.size() + 1, name + " ") == 0) return l;
  return {};
}
std::string verdict_of(const std::string& line) { return line.substr(0, line.find(' ')); }

nlohmann::json json_check(const nlohmann::json& j, const std::string& name) {
  for (const auto& c : j.at("checks"))
    if (c.at("check") == name) return c;
  return nullptr;
}

// A process to look at: `argv` with `env`, RESIDENCY_* and LD_PRELOAD of ours dropped.
ChildSpec child(std::vector<std::string> argv, std::vector<std::string> env = {}) {
  ChildSpec s;
  s.argv = std::move(argv);
  s.env = std::move(env);
  s.drop_env_prefixes = {"RESIDENCY_", "LD_PRELOAD="};
  return s;
}

// Waits until `pid` runs `name` (its exec is done: before it, /proc shows the test's own copy).
bool wait_exec(pid_t pid, const std::string& name) {
  for (int i = 0; i < 500; ++i) {
    std::ifstream comm("/proc/" + std::to_string(pid) + "/comm");
    std::string now;
    if (std::getline(comm, now) && now == name) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

// Waits until `pid`'s first manager published a state file holding `text` (a snapshot is written
// at most 50 ms after a change).
bool wait_state(pid_t pid, const std::string& text) {
  const std::string path = "/dev/shm/residency-state." + std::to_string(::getuid()) + "." + std::to_string(pid) + ".0";
  for (int i = 0; i < 1000; ++i) {
    std::ifstream f(path);
    const std::string now((std::istreambuf_iterator<char>(f)), {});
    if (now.find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

class Doctor : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string error;
    dir_ = residency::testing::make_disk_temp_dir("residency-doctor", error);
    ASSERT_FALSE(dir_.empty()) << error;
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  std::string file(const std::string& name, std::size_t bytes) {
    const std::string p = dir_ + "/" + name;
    std::ofstream(p, std::ios::binary) << std::string(bytes, 'x');
    return p;
  }
  std::string dir_;
};

TEST_F(Doctor, AProcessWithoutThePreloadIsNotLoadedWithWhyAndExits1) {
  ChildProcess plain(child({"/bin/sleep", "60"}));
  ASSERT_TRUE(wait_exec(plain.pid(), "sleep"));
  const DoctorRun r = doctor({std::to_string(plain.pid())});
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  const std::string preload = line_of(r, "preload");
  EXPECT_EQ(verdict_of(preload), "FAIL") << r.out;
  EXPECT_NE(preload.find("not loaded: its environment has no LD_PRELOAD"), std::string::npos) << preload;
  EXPECT_NE(preload.find("fix: start it again as `LD_PRELOAD="), std::string::npos) << preload;
  ASSERT_FALSE(r.lines.empty());
  EXPECT_EQ(r.lines.back().rfind("first to fix: preload: start it again as `LD_PRELOAD=", 0), 0u) << r.out;

  const DoctorRun j = doctor({"--json", std::to_string(plain.pid())});
  EXPECT_EQ(j.exit_code, 1) << j.err;
  const auto parsed = nlohmann::json::parse(j.out);
  EXPECT_EQ(parsed.at("verdict"), "fail");
  EXPECT_EQ(parsed.at("first_to_fix").at("check"), "preload");
  EXPECT_EQ(json_check(parsed, "preload").at("verdict"), "fail");
  EXPECT_EQ(parsed.at("checks").size(), r.lines.size() - 1) << "one JSON check per line of text";

  // LD_PRELOAD naming a file that is not there: the loader ignored it, and doctor says so.
  ChildProcess missing(child({"/bin/sleep", "60"}, {"LD_PRELOAD=" + dir_ + "/none/libresidency_preload.so"}));
  ASSERT_TRUE(wait_exec(missing.pid(), "sleep"));
  const DoctorRun m = doctor({std::to_string(missing.pid())});
  EXPECT_EQ(m.exit_code, 1) << m.out;
  EXPECT_NE(line_of(m, "preload").find(dir_ + "/none/libresidency_preload.so, which does not exist"), std::string::npos)
      << m.out;
}

// A `residency hold` that may lock 256 KiB of the 1.1 MiB it registered (no CAP_IPC_LOCK): the
// limit, what it needs and each way to raise it, as the first thing to fix. The same for a
// command whose -m model is larger than the limit it would start with.
TEST_F(Doctor, AMemlockLimitBelowWhatTheModelNeedsIsAFailWithTheFix) {
  const std::string small = file("small.bin", 64 * 1024), big = file("big.bin", 1024 * 1024);
  auto limited = [] {
    residency::testing::drop_cap_ipc_lock();
    residency::testing::set_memlock_limit(256 * 1024);
    return true;
  };
  ChildSpec spec = child({RESIDENCY_TOOL_PATH, "hold", "--keep-alive", "60s", small, big});
  spec.before_exec = limited;
  ChildProcess hold(spec);
  ASSERT_TRUE(hold.started());
  ASSERT_TRUE(hold.wait_for("residency hold: holding", 30)) << hold.stderr_text();
  ASSERT_TRUE(wait_state(hold.pid(), "\nregions=2\n")) << "both files registered";

  const DoctorRun r = doctor({std::to_string(hold.pid())});
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_EQ(verdict_of(line_of(r, "preload")), "ok") << "hold runs the library itself:\n" << r.out;
  const std::string memlock = line_of(r, "memlock");
  EXPECT_EQ(verdict_of(memlock), "FAIL") << r.out;
  EXPECT_NE(memlock.find(
                "RLIMIT_MEMLOCK 256 KiB (hard 256 KiB) and no CAP_IPC_LOCK, below the 1.1 MiB the model needs"),
            std::string::npos)
      << memlock;
  for (const char* fix : {"`ulimit -l unlimited`", "`LimitMEMLOCK=infinity`", "/etc/security/limits.d/", "restart"})
    EXPECT_NE(memlock.find(fix), std::string::npos) << fix << " in: " << memlock;
  EXPECT_EQ(r.lines.back().rfind("first to fix: memlock: ", 0), 0u) << r.out;
  const auto j = nlohmann::json::parse(doctor({"--json", std::to_string(hold.pid())}).out);
  EXPECT_EQ(j.at("verdict"), "fail");
  EXPECT_EQ(j.at("first_to_fix").at("check"), "memlock");
  EXPECT_EQ(json_check(j, "memlock").at("details").at("soft"), 256 * 1024);

  const DoctorRun cmd = doctor({"--", "/bin/true", "-m", big}, {}, limited);
  EXPECT_EQ(cmd.exit_code, 1) << cmd.out << cmd.err;
  const std::string line = line_of(cmd, "memlock");
  EXPECT_EQ(verdict_of(line), "FAIL") << cmd.out;
  EXPECT_NE(line.find("below the 1 MiB the model needs (the size of " + big + ")"), std::string::npos) << line;

  // With room for it, the same command's limit is no problem.
  const DoctorRun roomy = doctor({"--", "/bin/true", "-m", small}, {}, limited);
  EXPECT_EQ(verdict_of(line_of(roomy, "memlock")), "ok") << roomy.out;
}

TEST_F(Doctor, BadInputIsOneLineNamingWhatIsAcceptedAndExit2) {
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{{"abc"},
                                                                                    {"0"},
                                                                                    {"99999999"},
                                                                                    {"4194304"},
                                                                                    {"1", "2"},
                                                                                    {"--"},
                                                                                    {"--", dir_ + "/no-such-program"},
                                                                                    {"--", "no-such-program-here"}}) {
    std::string shown;
    for (const auto& a : args) shown += a + " ";
    SCOPED_TRACE(shown);
    const DoctorRun r = doctor(args);
    EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "one line: " << r.err;
    EXPECT_EQ(r.err.rfind("residency doctor: ", 0), 0u) << r.err;
    EXPECT_TRUE(r.err.find("accepted: a process id") != std::string::npos ||
                r.err.find("give the pid of a running process") != std::string::npos)
        << r.err;
  }
  EXPECT_NE(doctor({"4194304"}).err.find("no such process"), std::string::npos);
}

// The variable the preload would refuse, named with its value and what it accepts; a misspelt one
// is named too (it is silently ignored otherwise).
TEST_F(Doctor, ACommandWithABadVariableNamesIt) {
  const DoctorRun r = doctor({"--", "/bin/true"}, {"RESIDENCY_KEEP_ALIVE=soon", "RESIDENCY_KEEPALIVE=3"});
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  const std::string config = line_of(r, "configuration");
  EXPECT_EQ(verdict_of(config), "FAIL") << r.out;
  EXPECT_NE(config.find("RESIDENCY_KEEP_ALIVE=\"soon\": not a duration; accepted: "), std::string::npos) << config;
  EXPECT_NE(config.find("RESIDENCY_KEEPALIVE is not a residency variable, and is not read (RESIDENCY_KEEP_ALIVE is)"),
            std::string::npos)
      << config;
  const auto j = nlohmann::json::parse(doctor({"--json", "--", "/bin/true"}, {"RESIDENCY_KEEP_ALIVE=soon"}).out);
  EXPECT_EQ(json_check(j, "configuration").at("verdict"), "fail");

  const DoctorRun good = doctor({"--", "/bin/true"}, {"RESIDENCY_KEEP_ALIVE=30s"});
  EXPECT_EQ(verdict_of(line_of(good, "configuration")), "ok") << good.out;
  EXPECT_NE(line_of(good, "configuration").find("keep-alive 30 s"), std::string::npos) << good.out;
}

// Another user's process: what cannot be read is said, with who may read it; no crash, exit 1.
TEST_F(Doctor, AnotherUsersProcessIsReportedNotFatal) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root, to run doctor as another user (uid 65534)";
  if (::access(RESIDENCY_TOOL_PATH, X_OK) != 0) GTEST_SKIP() << "the tool is not executable";
  ChildProcess mine(child({"/bin/sleep", "60"}));
  ASSERT_TRUE(wait_exec(mine.pid(), "sleep"));
  const DoctorRun r = doctor({std::to_string(mine.pid())}, {},
                             [] { return ::setgid(65534) == 0 && ::setuid(65534) == 0; });
  if (r.exit_code == 126 || r.exit_code == 127)
    GTEST_SKIP() << "uid 65534 cannot execute the tool here (a directory above it is not searchable by others)";
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  const std::string process = line_of(r, "process");
  EXPECT_EQ(verdict_of(process), "FAIL") << r.out;
  EXPECT_NE(process.find("Permission denied"), std::string::npos) << process;
  EXPECT_NE(process.find("as uid 0 or as root"), std::string::npos) << process;
  EXPECT_EQ(verdict_of(line_of(r, "preload")), "warn") << "unknown, not a failure of its own:\n" << r.out;
}

#if defined(PRELOAD_PATH) && defined(DECODE_LOOP_PATH)

bool can_lock(std::uint64_t bytes) {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("CapEff:", 0) == 0 && ((std::stoull(line.substr(7), nullptr, 16) >> 14) & 1U)) return true;
  rlimit rl{};
  return ::getrlimit(RLIMIT_MEMLOCK, &rl) == 0 && (rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur >= bytes);
}

std::string real(const std::string& p) { return std::filesystem::canonical(p).string(); }

// A llama.cpp program (decode_loop, linked to libllama) under the preload, its model loaded: doctor
// says the preload is loaded and active, names the libllama it serves (the state file's `engine`,
// which the preload writes), and exits 0. With a bad RESIDENCY_* value the preload is loaded but not
// active, and that variable is the first thing to fix. The command before it runs: the loader
// preloads it.
TEST_F(Doctor, AProgramUnderThePreloadIsActiveAndExits0) {
  if (!can_lock(512ull << 20))
    GTEST_SKIP() << "RLIMIT_MEMLOCK is below 512 MiB and there is no CAP_IPC_LOCK: memlock would fail";
  const std::string model = dir_ + "/model.gguf";
  {
    ChildProcess make(child({RESIDENCY_TOOL_PATH, "make-model", "--size", "32MiB", "--type", "q4_0", model}));
    ASSERT_EQ(make.finish(120), 0) << make.stderr_text();
  }
  ChildSpec spec = child({DECODE_LOOP_PATH, model, "2", "stdin"},
                         {"LD_PRELOAD=" + std::string(PRELOAD_PATH), "RESIDENCY_KEEP_ALIVE=10m"});
  spec.stdin_pipe = true;
  spec.stderr_path = dir_ + "/decode_loop.err";
  ChildProcess c(spec);
  ASSERT_TRUE(c.started());
  ASSERT_TRUE(c.wait_for("loaded", 120)) << c.stderr_text();
  ASSERT_TRUE(wait_state(c.pid(), "\nengine=")) << c.stderr_text();
  const std::string state = "/dev/shm/residency-state." + std::to_string(::getuid()) + "." + std::to_string(c.pid()) +
                            ".0";

  const DoctorRun r = doctor({std::to_string(c.pid())});
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err << c.stderr_text();
  const std::string preload = line_of(r, "preload");
  EXPECT_EQ(verdict_of(preload), "ok") << r.out;
  EXPECT_NE(preload.find("loaded (" + real(PRELOAD_PATH) + ") and active: manager 0: posix, keep-alive 600 s, resident"),
            std::string::npos)
      << preload;
  const std::string llama = line_of(r, "llama.cpp");
  EXPECT_NE(llama.find("libllama.so"), std::string::npos) << llama;
  EXPECT_NE(llama.find("; the preload serves it"), std::string::npos) << llama;
  EXPECT_TRUE(r.lines.back() == "all is well" || r.lines.back().rfind("nothing to fix", 0) == 0) << r.out;

  const DoctorRun jr = doctor({"--json", std::to_string(c.pid())});
  EXPECT_EQ(jr.exit_code, 0) << jr.err;
  const auto j = nlohmann::json::parse(jr.out);
  EXPECT_NE(j.at("verdict"), "fail");
  EXPECT_TRUE(j.at("first_to_fix").is_null());
  const auto l = json_check(j, "llama.cpp").at("details");
  EXPECT_EQ(l.at("served"), true);
  ASSERT_TRUE(l.at("engine").is_string()) << l.dump();
  EXPECT_EQ(real(l.at("engine")), real(l.at("libllama"))) << "the state file's engine is the libllama it maps";
  {
    std::ifstream f(state);
    const std::string text((std::istreambuf_iterator<char>(f)), {});
    EXPECT_NE(text.find("\nengine=" + l.at("engine").get<std::string>() + "\n"), std::string::npos) << text;
  }
  c.kill();

  // Loaded but not active: the preload refused a bad value and runs the program without residency.
  ChildSpec bad_spec = child({DECODE_LOOP_PATH, model, "2", "stdin"},
                             {"LD_PRELOAD=" + std::string(PRELOAD_PATH), "RESIDENCY_KEEP_ALIVE=soon"});
  bad_spec.stdin_pipe = true;
  ChildProcess bad(bad_spec);
  ASSERT_TRUE(bad.wait_for("loaded", 120));
  const DoctorRun b = doctor({std::to_string(bad.pid())});
  EXPECT_EQ(b.exit_code, 1) << b.out;
  EXPECT_NE(line_of(b, "preload").find("but not active: RESIDENCY_KEEP_ALIVE has a bad value"), std::string::npos) << b.out;
  EXPECT_NE(line_of(b, "configuration").find("RESIDENCY_KEEP_ALIVE=\"soon\": not a duration"), std::string::npos) << b.out;
  EXPECT_EQ(b.lines.back(),
            "first to fix: preload: give RESIDENCY_KEEP_ALIVE an accepted value, then restart the program")
      << b.out;
  bad.kill();

  // The command, not run: the loader would preload it, and the program links libllama.
  const DoctorRun cmd = doctor({"--", DECODE_LOOP_PATH, "-m", model}, {"LD_PRELOAD=" + std::string(PRELOAD_PATH)});
  EXPECT_EQ(verdict_of(line_of(cmd, "preload")), "ok") << cmd.out;
  EXPECT_NE(line_of(cmd, "preload").find("the loader preloads it"), std::string::npos) << cmd.out;
  EXPECT_NE(line_of(cmd, "llama.cpp").find("libllama.so"), std::string::npos) << cmd.out;
  EXPECT_EQ(cmd.exit_code, 0) << cmd.out;
}

// `residency stat --pid` of a llama.cpp program that locks its weights itself (--load-mode mlock):
// after the keep-alive residency holds nothing, and the VmLck row says that the rest is the
// program's own lock, which residency leaves alone (before, it said only VmLck beside "released").
TEST_F(Doctor, StatPidSaysWhatTheProgramLockedItself) {
  if (!can_lock(512ull << 20))
    GTEST_SKIP() << "RLIMIT_MEMLOCK is below 512 MiB and there is no CAP_IPC_LOCK: memlock would fail";
  const std::string model = dir_ + "/model.gguf";
  {
    ChildProcess make(child({RESIDENCY_TOOL_PATH, "make-model", "--size", "32MiB", "--type", "f16", model}));
    ASSERT_EQ(make.finish(120), 0) << make.stderr_text();
  }
  ChildSpec spec = child({DECODE_LOOP_PATH, "--no-repack", "--load-mode", "mlock", model, "2", "stdin"},
                         {"LD_PRELOAD=" + std::string(PRELOAD_PATH), "RESIDENCY_KEEP_ALIVE=1s"});
  spec.stdin_pipe = true;
  spec.stderr_path = dir_ + "/decode_loop.err";
  ChildProcess c(spec);
  ASSERT_TRUE(c.started());
  ASSERT_TRUE(c.wait_for("loaded", 120)) << c.stderr_text();
  ASSERT_TRUE(c.send_line());
  ASSERT_TRUE(c.wait_for("token 0", 60)) << c.stderr_text();
  ASSERT_TRUE(wait_state(c.pid(), "\nreleases.keep_alive=1\n")) << c.stderr_text();
  ChildSpec st = child({RESIDENCY_TOOL_PATH, "stat", "--pid", std::to_string(c.pid())});
  ChildProcess stat(st);
  ASSERT_EQ(stat.finish(60), 0) << stat.stderr_text();
  std::string vm_lck;
  std::istringstream in(stat.stdout_text());
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmLck", 0) == 0) vm_lck = line;
  EXPECT_NE(vm_lck.find("0 B held by residency; the other "), std::string::npos) << stat.stdout_text();
  EXPECT_NE(vm_lck.find("locked by the program itself"), std::string::npos) << stat.stdout_text();
  c.kill();
}

#else

TEST(DoctorWithThePreload, Skipped) {
  GTEST_SKIP() << "no libresidency_preload.so in this build (no llama.cpp, or a sanitizer build)";
}

#endif

}  // namespace
