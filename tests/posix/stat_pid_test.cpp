// SPDX-License-Identifier: MIT
// `residency stat --pid PID` of real processes: a `residency hold` child (what the kernel says it
// locked, its manager's state, its shared budget, as text and JSON) and children that run a
// Manager with a short keep-alive (the release and its reason; the state file removed at
// destruction and at exit, kept by a fork child's exit, left by a SIGKILL and then reported stale
// and removed). Bad pids exit 2 with a message; a file in the process's name owned by another
// user or readable by others is never read. Every /dev/shm file a test makes is removed.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "core/state_file.hpp"
#include "residency/backends.hpp"
#include "residency/clock.hpp"
#include "residency/residency.hpp"
#include "support/child_process.hpp"
#include "support/tool_run.hpp"

namespace {

using namespace std::chrono_literals;

using residency::testing::run_tool;
using residency::testing::ToolRun;

std::uint64_t status_kb(pid_t pid, const char* key) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return std::stoull(line.substr(std::strlen(key))) * 1024;
  return UINT64_MAX;
}

bool exists(const std::string& p) {
  struct stat st {};
  return ::lstat(p.c_str(), &st) == 0;
}

std::string state_path(pid_t pid, unsigned n = 0) {
  return std::string(residency::core::kStateDir) + "/" + residency::core::kStatePrefix + std::to_string(::getuid()) +
         "." + std::to_string(pid) + "." + std::to_string(n);
}

// Waits until `pred` holds (polled every 20 ms), at most `limit`.
template <typename F>
bool eventually(F pred, std::chrono::milliseconds limit = 10s) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(20ms);
  }
  return pred();
}

void kill_and_reap(pid_t pid) {
  if (pid <= 0) return;
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
}

// A pid that names no process: a child's, once reaped (the kernel does not reuse it at once).
// In a forked child: `size` bytes of anonymous memory, written (resident), or exit status 12.
void* touched_memory_or_exit(std::size_t size) {
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) ::_exit(12);
  std::memset(p, 1, size);
  return p;
}

pid_t dead_pid() {
  const pid_t c = ::fork();
  if (c == 0) ::_exit(0);
  ::waitpid(c, nullptr, 0);
  return c;
}

// --- a `residency hold` child --------------------------------------------------------------

constexpr std::size_t kHoldSize = 2u << 20;  // under the default 8 MiB RLIMIT_MEMLOCK

struct HoldChild {
  pid_t pid = -1;
  std::string file, budget;
  ~HoldChild() {
    if (pid > 0) {
      ::kill(pid, SIGTERM);  // hold unlocks and leaves the ledger on SIGTERM
      int st = 0;
      ::waitpid(pid, &st, 0);
    }
    if (!file.empty()) ::unlink(file.c_str());
    if (!budget.empty()) ::unlink(("/dev/shm/residency-budget-" + budget).c_str());  // only if a holder died
  }
};

void start_hold(HoldChild& h, const char* suffix = ".bin", const char* keep_alive = "forever") {
  h.file = "/tmp/residency-statpid-" + std::to_string(::getpid()) + suffix;
  h.budget = "statpid-" + std::to_string(::getpid());
  {
    std::ofstream f(h.file, std::ios::binary);
    std::vector<char> data(kHoldSize, 'x');
    f.write(data.data(), static_cast<std::streamsize>(data.size()));
  }
  const std::string sb = "RESIDENCY_SHARED_BUDGET=" + h.budget + ":64MiB";
  h.pid = ::fork();
  if (h.pid == 0) {
    ::setenv("RESIDENCY_SHARED_BUDGET", (h.budget + ":64MiB").c_str(), 1);
    ::unsetenv("RESIDENCY_STATE_FILE");
    const int devnull = ::open("/dev/null", O_WRONLY);
    ::dup2(devnull, 1);
    ::dup2(devnull, 2);
    ::execl(RESIDENCY_TOOL_PATH, RESIDENCY_TOOL_PATH, "hold", "--keep-alive", keep_alive, h.file.c_str(),
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
}

// `residency ps`: one line for a process that a manager runs in, found from its state file and its
// budget's ledger: program, model, state, bytes held, when it releases (from the ledger's idle
// time under a shared budget), its budget; gone once the process ends.
TEST(ResidencyPs, AHolderIsOneLineWithItsModelStateBytesReleaseAndBudget) {
  HoldChild h;
  start_hold(h, ".gguf", "5m");
  ASSERT_GT(h.pid, 0);
  ASSERT_TRUE(eventually([&] { return status_kb(h.pid, "VmLck:") >= kHoldSize && exists(state_path(h.pid)); }));
  const std::string pid = std::to_string(h.pid);
  std::string line;
  ASSERT_TRUE(eventually([&] {
    const ToolRun t = run_tool("ps");
    const std::size_t at = t.out.find("\n" + pid + " ");
    if (t.exit_code != 0 || at == std::string::npos) return false;
    line = t.out.substr(at + 1, t.out.find('\n', at + 1) - at - 1);
    return line.find("host resident") != std::string::npos;
  })) << run_tool("ps").out;
  EXPECT_NE(run_tool("ps").out.rfind("PID ", 0), std::string::npos) << "a header line first";
  for (const std::string& want : {std::string("residency"), h.file.substr(h.file.rfind('/') + 1),
                                  std::string("host resident"), std::string("2 MiB"), h.budget})
    EXPECT_NE(line.find(want), std::string::npos) << "'" << want << "' not in: " << line;
  EXPECT_TRUE(std::regex_search(line, std::regex(" in (2[0-9][0-9]|300) s ")))
      << "the 5 m keep-alive less its idle: " << line;

  const ToolRun j = run_tool("ps --json");
  ASSERT_EQ(j.exit_code, 0) << j.out;
  bool found = false;
  for (const auto& e : nlohmann::json::parse(j.out)) {
    if (e.value("pid", 0) != h.pid) continue;
    found = true;
    EXPECT_EQ(e["models"], nlohmann::json::array({h.file}));
    EXPECT_EQ(e["budgets"], nlohmann::json::array({h.budget}));
    EXPECT_EQ(e["host_locked_bytes"].get<std::uint64_t>(), status_kb(h.pid, "VmLck:"));
    EXPECT_EQ(e["state"], "host resident");
    EXPECT_EQ(e["releases"].get<std::string>().rfind("in ", 0), 0u) << e.dump();
    ASSERT_EQ(e["managers"].size(), 1u);
    EXPECT_EQ(e["managers"][0]["keep_alive"], "300 s");
  }
  EXPECT_TRUE(found) << j.out;

  ::kill(h.pid, SIGTERM);
  ::waitpid(h.pid, nullptr, 0);
  h.pid = -1;
  EXPECT_EQ(run_tool("ps").out.find("\n" + pid + " "), std::string::npos) << "an ended process is not listed";
}

// `residency ps --prometheus`: the text format promtool accepts, with this process's manager after
// one keep-alive release and one re-wire: the release counted under reason keep_alive, the re-wire in
// the histogram, the budget's size and use, the asks.
TEST(ResidencyPs, PrometheusTextIsValidAndCountsReleasesByReasonAndWakeTimes) {
  const std::string budget = "psprom-" + std::to_string(::getpid());
  // In a child, so that this process's state-file numbering (state_path(pid, 0) in the other tests
  // of this binary) stays as it was. The keep-alive on a manual clock: one release and one re-wire,
  // and no second expiry however slowly this runs (under a sanitizer, beside other tests).
  int ready[2], go[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(go), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto backend = residency::make_backend("posix");
    if (!backend) ::_exit(10);
    residency::ManualClock clock{residency::Nanos(std::chrono::hours(1))};
    residency::ManagerOptions o;
    o.config.keep_alive = residency::KeepAlive::after(100ms);
    o.config.shared_budget = residency::SharedBudget{budget, residency::WiredLimit{false, 16u << 20, 0}, ""};
    o.config.log_level = residency::LogLevel::error;
    o.backend = *backend;
    o.clock = &clock;
    o.start_scheduler = false;
    auto mgr = residency::Manager::create(std::move(o));
    if (!mgr) ::_exit(11);
    constexpr std::size_t kSize = 1u << 20;
    void* p = touched_memory_or_exit(kSize);
    if (!(*mgr)->register_region(p, kSize, residency::RegionClass::weights)) ::_exit(13);
    (*mgr)->touch();
    clock.advance(200ms);
    (void)(*mgr)->run_due();
    if ((*mgr)->stats().releases != 1) ::_exit(14);  // the keep-alive did not release
    (*mgr)->touch();                                 // re-wires
    if ((*mgr)->stats().rewires != 1) ::_exit(15);
    if (::write(ready[1], "r", 1) != 1) ::_exit(16);
    char byte = 0;
    if (::read(go[0], &byte, 1) != 1) ::_exit(17);
    mgr->reset();
    ::_exit(0);
  }
  struct Finish {  // however the test ends: the child is told to go, and reaped
    pid_t pid;
    int go_w;
    ~Finish() {
      (void)!::write(go_w, "g", 1);
      int st = 0;
      ::waitpid(pid, &st, 0);
    }
  } finish{child, go[1]};
  char byte = 0;
  ASSERT_EQ(::read(ready[0], &byte, 1), 1) << "the child's manager did not release and re-wire";
  const std::string me = "pid=\"" + std::to_string(child) + "\"";
  std::string text;
  ASSERT_TRUE(eventually([&] {  // the state file is written within 50 ms of a change
    text = run_tool("ps --prometheus").out;
    return text.find("residency_rewire_duration_seconds_count{" + me) != std::string::npos &&
           text.find("_count{" + me + ",program=") != std::string::npos &&
           text.find(",backend=\"posix\"} 1\n", text.find("residency_rewire_duration_seconds_count{" + me)) !=
               std::string::npos;
  })) << text;
  auto has = [&](const std::string& line) { return text.find(line + "\n") != std::string::npos; };
  const std::string mgr_labels = me + ",program=\"" + std::string(program_invocation_short_name).substr(0, 15) +
                                 "\",manager=\"0\",backend=\"posix\"";
  EXPECT_TRUE(has("residency_releases_total{" + mgr_labels + ",reason=\"keep_alive\"} 1")) << text;
  EXPECT_TRUE(has("residency_releases_total{" + mgr_labels + ",reason=\"asked\"} 0")) << text;
  EXPECT_TRUE(has("residency_rewire_duration_seconds_bucket{" + mgr_labels + ",le=\"+Inf\"} 1")) << text;
  EXPECT_TRUE(has("residency_wired_bytes{" + mgr_labels + "} 1048576")) << text;
  EXPECT_TRUE(has("residency_budget_bytes{budget=\"" + budget + "\"} 16777216")) << text;
  EXPECT_TRUE(has("residency_budget_used_bytes{budget=\"" + budget + "\"} 1048576")) << text;
  EXPECT_TRUE(has("residency_asks_received_total{" + mgr_labels + ",budget=\"" + budget + "\"} 0")) << text;

  // promtool (Debian's prometheus package) accepts it.
  if (std::system("command -v promtool > /dev/null 2>&1") != 0)
    GTEST_SKIP() << "promtool is not installed (Debian: prometheus)";
  const std::string file = ::testing::TempDir() + "residency-ps.prom";
  {
    std::ofstream f(file);
    f << text;
  }
  const ToolRun check = [&] {
    ToolRun r;
    FILE* pp = ::popen(("promtool check metrics < '" + file + "' 2>&1").c_str(), "r");
    char buf[4096];
    std::size_t n = 0;
    while (pp && (n = std::fread(buf, 1, sizeof buf, pp)) > 0) r.out.append(buf, n);
    const int st = pp ? ::pclose(pp) : -1;
    r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    return r;
  }();
  EXPECT_EQ(check.exit_code, 0) << check.out;
  std::remove(file.c_str());
}

TEST(StatPid, HoldChildLockedBytesManagerStateAndSharedBudget) {
  HoldChild h;
  start_hold(h);
  ASSERT_GT(h.pid, 0);
  ASSERT_TRUE(eventually([&] { return status_kb(h.pid, "VmLck:") >= kHoldSize; }))
      << "hold never locked its file (VmLck " << status_kb(h.pid, "VmLck:") << ")";
  ASSERT_TRUE(eventually([&] { return exists(state_path(h.pid)); })) << state_path(h.pid);
  // A registration is published within 50 ms (coalesced), after the snapshot made at creation.
  ASSERT_TRUE(eventually([&] {
    std::ifstream f(state_path(h.pid));
    std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    return text.find("\nregions=1\n") != std::string::npos;
  })) << "the state file never showed the held file's region";

  struct stat st {};
  ASSERT_EQ(::stat(state_path(h.pid).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u) << "a state file is for its user only";
  EXPECT_EQ(st.st_uid, ::getuid());

  const ToolRun j = run_tool("stat --pid " + std::to_string(h.pid) + " --json");
  ASSERT_EQ(j.exit_code, 0) << j.out;
  const auto doc = nlohmann::json::parse(j.out, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(doc.is_discarded()) << j.out;
  EXPECT_EQ(doc["pid"], h.pid);
  EXPECT_EQ(doc["vm_lck"].get<std::uint64_t>(), status_kb(h.pid, "VmLck:")) << "what /proc says it holds locked";
  EXPECT_EQ(doc["vm_rss"].is_number(), true);
  bool file_listed = false;
  for (const auto& m : doc["locked_mappings"])
    if (m["mapping"] == "file " + h.file) file_listed = m["locked"].get<std::uint64_t>() == kHoldSize;
  EXPECT_TRUE(file_listed) << "the held file, locked whole, among the locked mappings:\n" << j.out;
  ASSERT_EQ(doc["managers"].size(), 1u) << j.out;
  const auto& m = doc["managers"][0];
  EXPECT_FALSE(m["stale"].get<bool>());
  const auto& s = m["state"];
  EXPECT_EQ(s["backend"], "posix");
  EXPECT_EQ(s["keep_alive"], "forever");
  EXPECT_EQ(s["resident"], 1);
  EXPECT_EQ(s["wired_bytes"], kHoldSize);
  EXPECT_EQ(s["tracked.weights"], kHoldSize);
  EXPECT_EQ(s["wired.weights"], kHoldSize);
  EXPECT_EQ(s["tracked.kv_cache"], 0);
  EXPECT_EQ(s["regions"], 1);
  EXPECT_EQ(s["shared_budget"], h.budget);
  EXPECT_EQ(s["shared_budget_size"], 64u << 20);
  EXPECT_EQ(s["shared_held"], kHoldSize);
  EXPECT_EQ(s["pid"], h.pid);
  EXPECT_FALSE(doc["gpu"]["available"].get<bool>() && doc["gpu"]["processes"].size() > 0) << "hold has no GPU context";

  const ToolRun t = run_tool("stat --pid " + std::to_string(h.pid));
  ASSERT_EQ(t.exit_code, 0) << t.out;
  for (const std::string& want :
       std::vector<std::string>{"VmLck", "2 MiB of 2 MiB resident: file " + h.file, "manager 0",
                                "posix, keep-alive forever, resident", "weights 2 MiB (2 MiB wired)", "shared budget",
                                h.budget + ": holds 2 MiB of 64 MiB", "; device memory: strict, waits at most 30 s",
                                "none yet", "GPU"})
    EXPECT_NE(t.out.find(want), std::string::npos) << "missing '" << want << "' in:\n" << t.out;

  ::kill(h.pid, SIGTERM);
  int status = 0;
  ASSERT_EQ(::waitpid(h.pid, &status, 0), h.pid);
  const pid_t was = h.pid;
  h.pid = -1;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_FALSE(exists(state_path(was))) << "hold's manager removed its state file at exit";
}

// --- children that run a Manager --------------------------------------------------------

// The manager a child leaks on purpose (reachable from here: no leak report at its exit).
residency::Manager* volatile g_leaked = nullptr;  // volatile: a store nobody reads is kept

// How the child ends once the parent writes a byte to its pipe.
enum class End { destroy, exit_without_destroy, fork_child_exits_then_destroy };

// A child with a Manager (posix, keep-alive 300 ms) over 1 MiB of anonymous memory; it writes
// "r" to `ready` once the keep-alive has released it, then waits for a byte on `go`.
pid_t start_manager_child(End end, int ready_w, int go_r, bool state_file = true) {
  const pid_t c = ::fork();
  if (c != 0) return c;
  auto backend = residency::make_backend("posix");
  if (!backend) ::_exit(10);
  residency::ManagerOptions o;
  o.config.keep_alive = residency::KeepAlive::after(300ms);
  o.config.state_file = state_file;
  o.config.log_level = residency::LogLevel::error;
  o.backend = *backend;
  auto mgr = residency::Manager::create(std::move(o));
  if (!mgr) ::_exit(11);
  constexpr std::size_t kSize = 1u << 20;
  void* p = touched_memory_or_exit(kSize);
  if (!(*mgr)->register_region(p, kSize, residency::RegionClass::kv_cache)) ::_exit(13);
  (*mgr)->touch();
  for (int i = 0; i < 500 && (*mgr)->stats().releases == 0; ++i) std::this_thread::sleep_for(10ms);
  if ((*mgr)->stats().releases == 0) ::_exit(14);
  if (::write(ready_w, "r", 1) != 1) ::_exit(15);
  char b = 0;
  if (::read(go_r, &b, 1) != 1) ::_exit(16);
  if (end == End::exit_without_destroy) {
    g_leaked = mgr->release();  // leaked as the preload leaks its managers: only the exit handler is left
    std::exit(0);
  }
  if (end == End::fork_child_exits_then_destroy) {
    const pid_t g = ::fork();
    if (g == 0) std::exit(0);  // runs the exit handlers in a copy of this process
    ::waitpid(g, nullptr, 0);
    if (::access(state_path(::getpid()).c_str(), F_OK) != 0) ::_exit(20);  // the child removed our file
  }
  mgr->reset();
  ::_exit(0);
}

struct ManagerChild {
  int ready[2] = {-1, -1}, go[2] = {-1, -1};
  pid_t pid = -1;
  explicit ManagerChild(End end, bool state_file = true) {
    if (::pipe(ready) != 0 || ::pipe(go) != 0) return;
    pid = start_manager_child(end, ready[1], go[0], state_file);
    ::close(ready[1]);
    ::close(go[0]);
    ready[1] = go[0] = -1;
  }
  bool wait_ready() {
    char b = 0;
    return ::read(ready[0], &b, 1) == 1 && b == 'r';
  }
  // Lets the child end; its exit status (-1 if it did not exit).
  int finish() {
    if (::write(go[1], "g", 1) != 1) return -1;
    int st = 0;
    if (::waitpid(pid, &st, 0) != pid) return -1;
    pid = -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  }
  ~ManagerChild() {
    kill_and_reap(pid);
    if (pid > 0) ::unlink(state_path(pid).c_str());
    for (int fd : {ready[0], ready[1], go[0], go[1]})
      if (fd >= 0) ::close(fd);
  }
};

TEST(StatPid, ShowsTheKeepAlivesReleaseAndItsReasonThenTheFileGoesWithTheManager) {
  ManagerChild c(End::destroy);
  ASSERT_GT(c.pid, 0);
  ASSERT_TRUE(c.wait_ready()) << "the child's manager never released";
  const ToolRun t = run_tool("stat --pid " + std::to_string(c.pid));
  ASSERT_EQ(t.exit_code, 0) << t.out;
  for (const char* want :
       {"keep-alive 300 ms, released", "kv_cache 1 MiB (0 B wired)", "(keep-alive 300 ms expired); 1 release(s)"})
    EXPECT_NE(t.out.find(want), std::string::npos) << "missing '" << want << "' in:\n" << t.out;
  const ToolRun j = run_tool("stat --pid " + std::to_string(c.pid) + " --json");
  ASSERT_EQ(j.exit_code, 0) << j.out;
  const auto doc = nlohmann::json::parse(j.out, nullptr, false);
  ASSERT_FALSE(doc.is_discarded()) << j.out;
  ASSERT_EQ(doc["managers"].size(), 1u) << j.out;
  const auto& s = doc["managers"][0]["state"];
  EXPECT_EQ(s["resident"], 0);
  EXPECT_EQ(s["wired_bytes"], 0);
  EXPECT_EQ(s["releases"], 1);
  // Counted by the release's kind, not by its words.
  EXPECT_EQ(s["releases.keep_alive"], 1) << s.dump();
  EXPECT_EQ(s["releases.asked"], 0) << s.dump();
  EXPECT_EQ(s["releases.engine"], 0) << s.dump();
  EXPECT_EQ(s["last_release_reason"], "keep-alive 300 ms expired");
  EXPECT_TRUE(s["last_release_at"].is_number());
  EXPECT_EQ(doc["vm_lck"], 0u) << "released: nothing locked";
  const pid_t was = c.pid;
  ASSERT_TRUE(exists(state_path(was)));
  EXPECT_EQ(c.finish(), 0);
  EXPECT_FALSE(exists(state_path(was))) << "the manager's destruction removes its state file";
}

TEST(StatPid, ALeakedManagersFileIsRemovedAtExitAndAForkChildsExitLeavesItsParents) {
  {
    ManagerChild c(End::exit_without_destroy);
    ASSERT_TRUE(c.wait_ready());
    const pid_t was = c.pid;
    ASSERT_TRUE(exists(state_path(was)));
    EXPECT_EQ(c.finish(), 0);
    EXPECT_FALSE(exists(state_path(was))) << "exit() removes the state file of a manager never destroyed";
  }
  {
    ManagerChild c(End::fork_child_exits_then_destroy);
    ASSERT_TRUE(c.wait_ready());
    const pid_t was = c.pid;
    EXPECT_EQ(c.finish(), 0) << "20: a fork child's exit removed its parent's state file";
    EXPECT_FALSE(exists(state_path(was)));
  }
}

TEST(StatPid, StateFileOffPublishesNothing) {
  ManagerChild c(End::destroy, /*state_file=*/false);
  ASSERT_TRUE(c.wait_ready());
  EXPECT_FALSE(exists(state_path(c.pid)));
  const ToolRun t = run_tool("stat --pid " + std::to_string(c.pid));
  EXPECT_EQ(t.exit_code, 0) << t.out;
  EXPECT_NE(t.out.find("no state file"), std::string::npos) << t.out;
  EXPECT_EQ(c.finish(), 0);
}

// What the process serves (the preload sets the libllama it drives) is one `engine=` line of every
// snapshot written from then on, for `residency doctor PID`; a newline in it cannot add a field.
// In a forked child: a state file of this process would take manager number 0 from the others.
TEST(StatPid, AStateFileCarriesTheEngineItsProcessServes) {
  namespace core = residency::core;
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(fds[0]);
    bool ok = false;
    {
      core::StateFile file;
      auto field = [&](const char* key) {
        for (const auto& s : core::read_state_files(::getpid(), ::getuid(), core::process_start_time(::getpid())))
          if (s.path == file.path()) return s.fields.count(key) ? s.fields.at(key) : std::string("(none)");
        return std::string("(no file)");
      };
      std::string seen = file.publish("backend=test\n") ? field("engine") : "(not written)";
      core::set_state_engine("/opt/llama/lib/libllama.so.0\nbackend=forged");
      seen += "|" + (file.publish("backend=test\n") ? field("engine") + "|" + field("backend") : "(not written)");
      ok = ::write(fds[1], seen.data(), seen.size()) == static_cast<ssize_t>(seen.size());
    }  // the StateFile's destruction removes its file
    ::_exit(ok ? 0 : 1);
  }
  ::close(fds[1]);
  std::string seen;
  char buf[512];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) seen.append(buf, static_cast<std::size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_EQ(seen, "(none)|/opt/llama/lib/libllama.so.0 backend=forged|test") << "nothing set: no line; then one";
  EXPECT_FALSE(exists(state_path(child))) << "its destruction removed it";
  ::unlink(state_path(child).c_str());
}

// The README's quick start once ran llama-server with LD_PRELOAD naming a preload that was never
// built: the loader ignored it and the server ran unmanaged. stat says so, and why.
TEST(StatPid, APreloadNamedButNotLoadedIsSaidWithItsLikelyCause) {
  const std::string missing = "/nonexistent-residency-prefix/lib/libresidency_preload.so";
  residency::testing::ChildProcess sleeper(
      residency::testing::ChildSpec{{"/bin/sleep", "30"},
                                    {"LD_PRELOAD=" + missing},
                                    {"LD_PRELOAD="},
                                    false,
                                    ::testing::TempDir() + "stat_preload_missing.err",
                                    {}});
  // The loader's complaint comes first; wait until the program runs.
  for (int i = 0;
       i < 200 && run_tool("stat --pid " + std::to_string(sleeper.pid())).out.find("(sleep)") == std::string::npos; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const ToolRun t = run_tool("stat --pid " + std::to_string(sleeper.pid()));
  EXPECT_EQ(t.exit_code, 0) << t.out;
  EXPECT_NE(t.out.find("no state file: LD_PRELOAD names " + missing + ", which does not exist"), std::string::npos)
      << t.out;
  EXPECT_NE(t.out.find("cannot be preloaded"), std::string::npos) << t.out;
  const ToolRun j = run_tool("stat --json --pid " + std::to_string(sleeper.pid()));
  ASSERT_EQ(j.exit_code, 0) << j.out;
  EXPECT_NE(nlohmann::json::parse(j.out).value("preload_problem", "").find("does not exist"), std::string::npos) << j.out;

  // Without the preload in its environment: the plain line, no guess.
  residency::testing::ChildProcess plain(
      residency::testing::ChildSpec{{"/bin/sleep", "30"}, {}, {"LD_PRELOAD="}, false, "", {}});
  for (int i = 0;
       i < 200 && run_tool("stat --pid " + std::to_string(plain.pid())).out.find("(sleep)") == std::string::npos; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const ToolRun u = run_tool("stat --pid " + std::to_string(plain.pid()));
  EXPECT_NE(u.out.find("no state file (no residency manager"), std::string::npos) << u.out;
}

TEST(StatPid, AKilledProcesssFileIsReportedStaleAndRemoved) {
  ManagerChild c(End::destroy);
  ASSERT_TRUE(c.wait_ready());
  const pid_t was = c.pid;
  const std::string path = state_path(was);
  kill_and_reap(c.pid);
  c.pid = -1;
  ASSERT_TRUE(exists(path)) << "SIGKILL runs no exit handler: the file stays";
  const ToolRun t = run_tool("stat --pid " + std::to_string(was));
  EXPECT_EQ(t.exit_code, 2) << t.out;
  EXPECT_NE(t.out.find("--pid " + std::to_string(was) + ": no such process"), std::string::npos) << t.out;
  // Another process of this user that starts a manager meanwhile (a concurrent test) sweeps it
  // first (the next test): then stat has nothing left to remove.
  if (t.out.find("removed its stale state file " + path) == std::string::npos)
    std::printf("the file was swept by another process before stat ran:\n%s", t.out.c_str());
  EXPECT_FALSE(exists(path)) << t.out;
}

// Nobody runs stat: the next process of this user that publishes removes what the killed one left.
TEST(StatPid, TheNextManagerOfThisUserSweepsADeadProcesssFile) {
  std::string path;
  {
    ManagerChild killed(End::destroy);
    ASSERT_TRUE(killed.wait_ready());
    path = state_path(killed.pid);
    kill_and_reap(killed.pid);
    killed.pid = -1;
  }
  ASSERT_TRUE(exists(path));
  ManagerChild next(End::destroy);
  ASSERT_TRUE(next.wait_ready());
  const bool swept = !exists(path);
  ::unlink(path.c_str());
  EXPECT_TRUE(swept) << path << " is still there after another manager of this user started";
  EXPECT_EQ(next.finish(), 0);
}

// A file of this uid for a live process, with the start time of another (a reused pid).
TEST(StatPid, AFileOfAReusedPidIsStale) {
  const std::string path = state_path(::getpid(), 9);
  {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
    ASSERT_GE(fd, 0) << path << ": " << std::strerror(errno);
    const std::string text = std::string(residency::core::kStateHeader) + "\npid=" + std::to_string(::getpid()) +
                             "\nstart_time=1\nbackend=posix\n";
    ASSERT_EQ(::write(fd, text.data(), text.size()), static_cast<ssize_t>(text.size()));
    ::close(fd);
  }
  const ToolRun t = run_tool("stat --pid " + std::to_string(::getpid()));
  ::unlink(path.c_str());
  EXPECT_EQ(t.exit_code, 0) << t.out;
  EXPECT_NE(t.out.find(path + ": stale (its process is gone or the pid was reused); removed"), std::string::npos) << t.out;
}

TEST(StatPid, BadPidsExit2WithTheMessage) {
  const pid_t gone = dead_pid();
  const ToolRun t = run_tool("stat --pid " + std::to_string(gone));
  EXPECT_EQ(t.exit_code, 2) << t.out;
  EXPECT_NE(t.out.find("residency stat: --pid " + std::to_string(gone) + ": no such process"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("give the pid of a running process"), std::string::npos) << t.out;
  for (const char* bad : {"0", "abc", "-5", "99999999999"}) {
    const ToolRun b = run_tool(std::string("stat --pid ") + bad);
    EXPECT_EQ(b.exit_code, 2) << bad << ": " << b.out;
    EXPECT_NE(b.out.find("a process id, 1 to 4194304"), std::string::npos) << bad << ": " << b.out;
  }
}

// Files in a live process's name that are not its user's own 0600 file are never read.
TEST(StatPid, AFileOfAnotherOwnerOrModeIsNeverRead) {
  ManagerChild c(End::destroy);
  ASSERT_TRUE(c.wait_ready());
  const auto start = residency::core::process_start_time(c.pid);
  ASSERT_TRUE(start);
  const std::string text = std::string(residency::core::kStateHeader) + "\npid=" + std::to_string(c.pid) +
                           "\nstart_time=" + std::to_string(*start) + "\nbackend=FORGED\n";
  auto make = [&](unsigned n, mode_t mode, uid_t owner) {
    const std::string p = state_path(c.pid, n);
    const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
    if (fd < 0) return std::string();
    bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) && ::fchmod(fd, mode) == 0;
    if (owner != ::getuid()) ok = ok && ::fchown(fd, owner, static_cast<gid_t>(-1)) == 0;
    ::close(fd);
    if (!ok) {
      ::unlink(p.c_str());
      return std::string();
    }
    return p;
  };
  const std::string open_mode = make(7, 0644, ::getuid());
  ASSERT_FALSE(open_mode.empty());
  const std::string other = ::geteuid() == 0 ? make(8, 0600, 65534) : std::string();
  const ToolRun t = run_tool("stat --pid " + std::to_string(c.pid));
  const ToolRun j = run_tool("stat --pid " + std::to_string(c.pid) + " --json");
  ::unlink(open_mode.c_str());
  if (!other.empty()) ::unlink(other.c_str());
  EXPECT_EQ(t.exit_code, 0) << t.out;
  EXPECT_EQ(t.out.find("FORGED"), std::string::npos) << t.out;
  EXPECT_EQ(j.out.find("FORGED"), std::string::npos) << j.out;
  EXPECT_NE(t.out.find(open_mode + ": not read: mode 0644"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("posix, keep-alive 300 ms"), std::string::npos) << "its own file is still read:\n" << t.out;
  if (other.empty()) {
    std::printf("not root: the file owned by uid 65534 is not tried\n");
  } else {
    EXPECT_NE(t.out.find(other + ": not read: owned by uid 65534, not by the process's user"), std::string::npos) << t.out;
  }
  EXPECT_EQ(c.finish(), 0);
}

}  // namespace
