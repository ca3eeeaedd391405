// SPDX-License-Identifier: MIT
// Real memory pressure, end to end: llama.cpp (tests/preload/decode_loop.c, an unmodified program
// on libllama) serves a 2 GiB model under libresidency_preload.so, and a memory hog runs beside it
// in the SAME memory cgroup, which this test creates, limited to what the loaded server takes plus 1 GiB (cgroup v1's memory
// controller or cgroup v2, whichever governs this process) and removes. The limit confines the
// pressure: nothing outside the cgroup is ever reclaimed or OOM-killed.
//
//   forever          the model stays locked: the hog never gets its memory (every attempt is
//                    OOM-killed inside the cgroup, as the cgroup's oom_kill counter shows) and
//                    the server keeps every page (VmLck).
//   pressure-aware   keep-alive + release on pressure: the kernel's pressure source for the
//                    cgroup (memory.pressure_level under v1, memory.pressure's PSI under v2)
//                    makes the server unlock; the hog gets its memory within a bound that the
//                    test prints; after the hog is done and pressure has been quiet
//                    (RESIDENCY_PRESSURE_QUIET=3s here), the next request finds the model
//                    wired again (VmLck, and mincore on our own mapping of the file).
//
// The hog is what a batch job beside an inference server is: expendable (oom_score_adj 1000, so
// that the OOM killer takes it and not the server) and retried by its supervisor until it gets
// its memory; the time it waited is from its first attempt to the one that got everything.
//
// Runs as root (cgroup creation, and locking 2 GiB without a raised RLIMIT_MEMLOCK); elsewhere it
// skips with the reason, and under RESIDENCY_TESTS_STRICT=1 (CI, as root on a Linux machine or
// VM guest) not running is a failure. Whatever happens, TearDown kills the processes this
// test started (by pid), removes the cgroup, and TearDownTestSuite removes the model.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "backends/posix/proc_info.hpp"
#include "support/child_process.hpp"
#include "support/strict.hpp"
#include "support/temp_dir.hpp"
#include "workload/gguf_writer.hpp"

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;
constexpr std::uint64_t kMiB = 1024 * 1024;
constexpr std::uint64_t kGiB = 1024 * kMiB;
constexpr std::uint64_t kModelBytes = 2 * kGiB;
// The cgroup's limit is set once the server has loaded the model and served a request: what the
// cgroup holds then (what the model really takes on this CPU: the file's pages, or a repacked
// copy of the weights in anonymous memory when llama.cpp's AMX or CPU_REPACK buffer types took
// them) plus this. During the load there is no limit (a load on a repacking CPU reads the file and
// writes the copy, briefly holding the model twice).
constexpr std::uint64_t kCgroupHeadroom = 1 * kGiB;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool write_file(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = ::write(fd, text.c_str(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  return ok;
}

// "key N" in a flat-keyed cgroup file (memory.oom_control, memory.events).
std::uint64_t keyed_value(const std::string& text, const std::string& key) {
  std::istringstream in(text);
  for (std::string k; in >> k;) {
    std::uint64_t v = 0;
    if (!(in >> v)) break;
    if (k == key) return v;
  }
  return 0;
}

std::optional<std::uint64_t> vm_lck(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmLck:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  return std::nullopt;
}

// A memory cgroup made for the test, child of this process's own memory cgroup (so that every
// limit above it still applies), removed by remove().
class TestCgroup {
 public:
  // Returns why it cannot be made here, or nullopt.
  std::optional<std::string> create() {
    auto cg = residency::posix::find_memory_cgroup();
    if (!cg) return "no memory cgroup: " + cg.message();
    version_ = cg->version;
    const std::string name = "/residency-real-pressure-" + std::to_string(::getpid());
    std::string parent = cg->dir;
    if (version_ == 2) {
      // v2: the parent must hand the memory controller to its children, which it can only do
      // when it holds no processes itself (or is the root).
      auto delegates = [](const std::string& dir) {
        const std::string ctl = dir + "/cgroup.subtree_control";
        return read_file(ctl).find("memory") != std::string::npos || write_file(ctl, "+memory");
      };
      if (!delegates(parent)) {
        const std::string why = std::strerror(errno);
        // As root, beside this process's cgroup: the hierarchy's root delegates whatever processes
        // it holds (a job runner's or a VM agent's cgroup often holds the runner itself). The
        // test's own memory.max is the limit that matters.
        const std::string root = cg->cgroup_path == "/" ? cg->dir
                                                        : cg->dir.substr(0, cg->dir.size() - cg->cgroup_path.size());
        if (::geteuid() != 0 || root == cg->dir || !delegates(root))
          return "cgroup v2 " + cg->dir + " does not delegate the memory controller and cannot be made to (" + why +
                 "; it must hold no processes, or be the root)";
        parent = root;
      }
    }
    dir_ = parent + name;
    if (::mkdir(dir_.c_str(), 0755) != 0) {
      const std::string why = "cannot create the memory cgroup " + dir_ + ": " + std::strerror(errno);
      dir_.clear();
      return why;
    }
    if (version_ == 2) ram_only_ = write_file(dir_ + "/memory.swap.max", "0");  // confined to RAM (absent without swap)
    return std::nullopt;
  }
  // Sets the limit; false (errno set) when it cannot.
  bool set_limit(std::uint64_t limit) {
    limit_ = limit;
    if (version_ == 2) return write_file(dir_ + "/memory.max", std::to_string(limit));
    if (!write_file(dir_ + "/memory.limit_in_bytes", std::to_string(limit))) return false;
    // v1 on a machine with swap: memory and swap together under the same limit (the file exists
    // with swap accounting on), as v2's memory.swap.max = 0 confines the cgroup to RAM; else the
    // hog takes its memory by swapping the model's neighbours out and nothing is tested.
    const int saved = errno;
    ram_only_ = write_file(dir_ + "/memory.memsw.limit_in_bytes", std::to_string(limit));
    errno = saved;
    return true;
  }
  // Whether swap is closed to the cgroup (a machine with swap, and the limit covers it too).
  bool ram_only() const { return ram_only_; }
  std::uint64_t limit() const { return limit_; }
  // Removes the cgroup; its processes must be gone (rmdir fails with EBUSY until they are).
  bool remove() {
    if (dir_.empty()) return true;
    for (int i = 0; i < 200; ++i) {  // an exiting task leaves the cgroup a moment after its reap
      if (::rmdir(dir_.c_str()) == 0 || errno == ENOENT) {
        dir_.clear();
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }
  int version() const { return version_; }
  const std::string& dir() const { return dir_; }
  std::uint64_t limit_ = 0;
  std::string procs() const { return dir_ + "/cgroup.procs"; }
  std::uint64_t usage() const {
    const std::string t = read_file(dir_ + (version_ == 1 ? "/memory.usage_in_bytes" : "/memory.current"));
    return t.empty() ? 0 : std::stoull(t);
  }
  std::uint64_t oom_kills() const {
    return version_ == 1 ? keyed_value(read_file(dir_ + "/memory.oom_control"), "oom_kill")
                         : keyed_value(read_file(dir_ + "/memory.events"), "oom_kill");
  }

 private:
  int version_ = 0;
  bool ram_only_ = false;
  std::string dir_;
};

// A process started in the cgroup: it joins it between fork and exec, so that everything it
// faults in is charged there. stdout through a pipe read by line, stderr into a file.
// decode_loop in stdin mode (one decode per line), started inside the test's cgroup.
class Server : public residency::testing::ChildProcess {
 public:
  Server(const std::vector<std::string>& args, const std::vector<std::string>& extra_env, const std::string& procs,
         const std::string& err_path)
      : ChildProcess(spec(args, extra_env, procs, err_path)) {}
  // One request: a decode.
  std::optional<std::string> request(double timeout_s = 60) {
    if (!send_line()) return std::nullopt;
    return wait_for("token ", timeout_s);
  }

 private:
  static residency::testing::ChildSpec spec(const std::vector<std::string>& args, const std::vector<std::string>& env,
                                            const std::string& procs, const std::string& err_path) {
    residency::testing::ChildSpec s;
    s.argv = args;
    s.env = env;
    s.drop_env_prefixes = {"RESIDENCY_", "LD_PRELOAD="};
    s.stdin_pipe = true;
    s.stderr_path = err_path;
    s.before_exec = [procs] {  // into the cgroup before the program starts
      const int p = ::open(procs.c_str(), O_WRONLY);
      const bool ok = p >= 0 && ::write(p, "0", 1) == 1;
      if (p >= 0) ::close(p);
      return ok;
    };
    return s;
  }
};

// The hog: one attempt is a child in the cgroup that maps `bytes` anonymous, touches every page,
// says so through a pipe, holds it for `hold` and exits. Attempts repeat until one gets its
// memory or `deadline` passes.
struct HogOutcome {
  bool got = false;
  double waited_s = 0;  // from the first attempt to the moment the memory was all touched
  int attempts = 0;
  int killed = 0;                 // attempts ended by SIGKILL (the OOM killer)
  bool killed_after_got = false;  // the attempt that got its memory was killed while holding it
  std::optional<std::uint64_t> server_vm_lck_when_got;
};

pid_t g_hog_pid = -1;  // the attempt in flight, for TearDown

// `got_flag`, when given, is set the moment an attempt has all its memory (for a caller watching
// from another thread while the hog holds it).
HogOutcome run_hog(const std::string& procs, std::uint64_t bytes, double deadline_s, double hold_s, pid_t server,
                   std::atomic<bool>* got_flag = nullptr) {
  HogOutcome o;
  const auto t0 = Clock::now();
  const long page = ::sysconf(_SC_PAGESIZE);
  while (!o.got && seconds_since(t0) < deadline_s) {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) break;
    ++o.attempts;
    const pid_t pid = ::fork();
    if (pid == 0) {  // system calls and plain stores only
      const int f = ::open(procs.c_str(), O_WRONLY);
      if (f < 0 || ::write(f, "0", 1) != 1) ::_exit(3);
      ::close(f);
      const int a = ::open("/proc/self/oom_score_adj", O_WRONLY);
      if (a >= 0) {
        (void)!::write(a, "1000", 4);
        ::close(a);
      }
      void* m = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (m == MAP_FAILED) ::_exit(4);
      auto* b = static_cast<volatile unsigned char*>(m);
      for (std::uint64_t off = 0; off < bytes; off += static_cast<std::uint64_t>(page)) b[off] = 1;
      (void)!::write(p[1], "g", 1);
      const timespec ts{static_cast<time_t>(hold_s), static_cast<long>((hold_s - static_cast<long>(hold_s)) * 1e9)};
      ::nanosleep(&ts, nullptr);
      ::_exit(0);
    }
    ::close(p[1]);
    if (pid < 0) {
      ::close(p[0]);
      break;
    }
    g_hog_pid = pid;
    char c = 0;
    ssize_t n;
    while ((n = ::read(p[0], &c, 1)) < 0 && errno == EINTR) {
    }
    if (n == 1) {
      o.got = true;
      o.waited_s = seconds_since(t0);
      o.server_vm_lck_when_got = vm_lck(server);
      if (got_flag != nullptr) got_flag->store(true);
    }
    ::close(p[0]);
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    g_hog_pid = -1;
    if (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) {
      ++o.killed;
      if (o.got) o.killed_after_got = true;
    }
    if (!o.got) std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the supervisor's back-off
  }
  return o;
}

std::string model_dir_, model_path_, suite_error_;
bool suite_strict_skip_ = false;  // suite_error_ is a reason to skip (not a broken test)

double page_cache_fraction(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  struct stat st {};
  ::fstat(fd, &st);
  void* m = ::mmap(nullptr, static_cast<std::size_t>(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) return -1;
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> vec((static_cast<std::size_t>(st.st_size) + page - 1) / page);
  double f = -1;
  if (::mincore(m, static_cast<std::size_t>(st.st_size), vec.data()) == 0) {
    std::size_t in = 0;
    for (unsigned char v : vec) in += v & 1U;
    f = static_cast<double>(in) / static_cast<double>(vec.size());
  }
  ::munmap(m, static_cast<std::size_t>(st.st_size));
  return f;
}

// Drops the model from the page cache, so that the server's faults charge the test's cgroup.
void drop_page_cache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

// With llama.cpp's extra buffer types on (the Q4_0 matrices repacked into anonymous memory:
// CPU_REPACK on AVX2 x86 and ARM, AMX on CPUs with it) and off (every weight read from the file mapping).
class RealPressureTest : public ::testing::TestWithParam<bool> {
 protected:
  static void SetUpTestSuite() {
    // Why this cannot run here: checked before the 2 GiB model is written.
    if (::geteuid() != 0) {
      suite_error_ = "needs root: it creates a memory cgroup and locks 2 GiB (RLIMIT_MEMLOCK)";
      suite_strict_skip_ = true;
      return;
    }
    model_dir_ = residency::testing::make_disk_temp_dir("residency-real-pressure", suite_error_);
    if (model_dir_.empty()) return;
    struct statfs sfs {};
    if (::statfs(model_dir_.c_str(), &sfs) == 0 && static_cast<long>(sfs.f_type) == 0x01021994) {
      suite_error_ = model_dir_ +
                     " is tmpfs: unlocked model pages could not be reclaimed without swap; set TMPDIR to a disk";
      suite_strict_skip_ = true;
      return;
    }
    if (auto st = residency::workload::check_free_space(model_dir_, kModelBytes + 256 * kMiB); !st) {
      suite_error_ = st.message();
      suite_strict_skip_ = true;
      return;
    }
    auto shape = residency::workload::plan_llama_shape(kModelBytes, residency::workload::GgmlType::q4_0);
    if (!shape) {
      suite_error_ = shape.message();
      return;
    }
    model_path_ = model_dir_ + "/model-2GiB-q4_0.gguf";
    const auto t0 = Clock::now();
    if (auto st = residency::workload::write_synthetic_model(model_path_, *shape, residency::workload::kSyntheticSeed, 2);
        !st) {
      suite_error_ = st.message();
      return;
    }
    std::printf("[ model    ] %s written in %.1f s (%s)\n", model_path_.c_str(), seconds_since(t0),
                shape->to_string().c_str());
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    if (!model_dir_.empty()) std::filesystem::remove_all(model_dir_, ec);
    model_dir_.clear();
  }

  void SetUp() override {
    if (!suite_error_.empty()) {
      if (suite_strict_skip_) RESIDENCY_SKIP_OR_FAIL_IN_CI(suite_error_);
      FAIL() << suite_error_;
    }
    if (auto why = cg_.create()) {
      // CI runs as root on a machine with a memory controller: there this is a broken machine,
      // not a reason to pass without testing.
      RESIDENCY_SKIP_OR_FAIL_IN_CI("cannot make a memory cgroup here: " + *why);
    }
    drop_page_cache(model_path_);
  }
  void TearDown() override {
    if (g_hog_pid > 0) {
      ::kill(g_hog_pid, SIGKILL);
      ::waitpid(g_hog_pid, nullptr, 0);
      g_hog_pid = -1;
    }
    if (server_) server_->kill();
    server_.reset();
    const std::string dir = cg_.dir();
    EXPECT_TRUE(cg_.remove()) << "the test's cgroup " << dir << " could not be removed: " << std::strerror(errno);
    if (!dir.empty()) {
      EXPECT_NE(::access(dir.c_str(), F_OK), 0) << dir << " is left behind";
    }
    if (!model_path_.empty()) drop_page_cache(model_path_);
  }

  // Starts decode_loop under the preload in the cgroup and serves the first request; returns
  // the VmLck it then holds.
  std::uint64_t start_server(const std::vector<std::string>& env, const std::string& name) {
    std::vector<std::string> e = env;
    e.push_back(std::string("LD_PRELOAD=") + PRELOAD_PATH);
    e.push_back("RESIDENCY_LOG=info");
    err_path_ = model_dir_ + "/" + name + ".err";
    std::vector<std::string> argv{DECODE_LOOP_PATH, model_path_, "100", "stdin"};
    if (GetParam()) argv.insert(argv.begin() + 1, "--no-repack");
    server_ = std::make_unique<Server>(argv, e, cg_.procs(), err_path_);
    if (server_->pid() <= 0) {
      ADD_FAILURE() << "cannot start decode_loop";
      return 0;
    }
    if (!server_->wait_for("loaded", 180)) {
      ADD_FAILURE() << "decode_loop did not load the model:\n" << server_->stderr_text();
      return 0;
    }
    if (!server_->request()) {
      ADD_FAILURE() << "the first request failed:\n" << server_->stderr_text();
      return 0;
    }
    const std::uint64_t footprint = cg_.usage();
    if (!cg_.set_limit(footprint + kCgroupHeadroom)) {
      ADD_FAILURE() << "cannot set the limit of " << cg_.dir() << ": " << std::strerror(errno);
      return 0;
    }
    std::printf("[ cgroup   ] cgroup v%d memory controller: %s; the loaded server takes %llu MiB, limit %llu MiB\n",
                cg_.version(), cg_.dir().c_str(), static_cast<unsigned long long>(footprint / kMiB),
                static_cast<unsigned long long>(cg_.limit() / kMiB));
    return vm_lck(server_->pid()).value_or(0);
  }

  // Under release on pressure, weights llama.cpp repacked into anonymous memory cannot be taken
  // by pressure on a machine without swap (only the page cache can be reclaimed): the preload
  // says so in one warning, and the pressure cases have nothing to test then. With the extra
  // buffer types off the weights are file pages and the warning must not appear.
  bool anonymous_weights_without_swap() {
    const std::string err = server_->stderr_text();
    bool warned = err.find("this machine has no swap: releasing them under memory pressure frees nothing") !=
                  std::string::npos;
    // On a machine with swap the test's cgroup is closed to it (ram_only): repacked weights are as
    // stuck there as without swap, and the preload cannot know (its machine has swap).
    const auto weights = err.find(": weights ");  // "registered N buffers: weights 1.9 GiB (CPU_REPACK ...)"
    if (cg_.ram_only() && weights != std::string::npos) {
      const std::string line = err.substr(weights, err.find('\n', weights) - weights);
      warned = warned || line.find("(AMX ") != std::string::npos || line.find("(CPU_REPACK ") != std::string::npos;
    }
    if (GetParam()) {
      EXPECT_FALSE(warned) << "warned about anonymous weights with the extra buffer types off:\n"
                           << server_->stderr_text();
    }
    return warned;
  }

  // The hog's size: what the cgroup has left plus 512 MiB, so that it cannot fit beside the
  // locked model, but fits easily once the model may be reclaimed.
  std::uint64_t hog_bytes(std::uint64_t locked) {
    const std::uint64_t usage = cg_.usage();
    const std::uint64_t limit = cg_.limit();
    const std::uint64_t hog = (limit > usage ? limit - usage : 0) + 512 * kMiB;
    EXPECT_LT(hog + (usage > locked ? usage - locked : 0) + 256 * kMiB, limit)
        << "the hog would not fit even without the model: usage " << usage / kMiB << " MiB, locked " << locked / kMiB
        << " MiB";
    return hog;
  }

  TestCgroup cg_;
  std::unique_ptr<Server> server_;
  std::string err_path_;
};

TEST_P(RealPressureTest, ForeverKeepsTheModelAndTheHogDoesNotGetItsMemory) {
  const std::uint64_t locked = start_server({"RESIDENCY_KEEP_ALIVE=forever"}, "forever");
  ASSERT_FALSE(HasFailure());
  ASSERT_GE(locked, kModelBytes * 95 / 100) << "the model is not locked:\n" << server_->stderr_text();
  ASSERT_GE(cg_.usage(), kModelBytes * 95 / 100)
      << "the model is not charged to the test's cgroup: nothing would be tested";
  const std::uint64_t hog = hog_bytes(locked);
  const std::uint64_t ooms = cg_.oom_kills();
  const HogOutcome h = run_hog(cg_.procs(), hog, /*deadline_s=*/8, /*hold_s=*/0.5, server_->pid());
  EXPECT_FALSE(h.got) << "the hog got " << hog / kMiB << " MiB beside a locked 2 GiB model in a cgroup of "
                      << cg_.limit() / kMiB << " MiB";
  EXPECT_GT(cg_.oom_kills(), ooms) << "the cgroup's OOM killer never ran";
  EXPECT_TRUE(server_->alive()) << "the server was killed instead of the hog";
  EXPECT_GE(vm_lck(server_->pid()).value_or(0), kModelBytes * 95 / 100) << "forever gave the model up";
  EXPECT_TRUE(server_->request()) << "the server no longer serves:\n" << server_->stderr_text();
  std::printf(
      "[ measured ] forever: the hog (%llu MiB) did not get its memory in 8 s: %d attempt(s), %d OOM-killed in "
      "the cgroup (%llu cgroup OOM kills); the server kept %llu MiB locked\n",
      static_cast<unsigned long long>(hog / kMiB), h.attempts, h.killed,
      static_cast<unsigned long long>(cg_.oom_kills() - ooms),
      static_cast<unsigned long long>(vm_lck(server_->pid()).value_or(0) / kMiB));
}

TEST_P(RealPressureTest, PressureAwareGivesTheHogItsMemoryAndWiresTheModelAgainWhenRequestsResume) {
  const std::uint64_t locked = start_server({"RESIDENCY_KEEP_ALIVE=10m", "RESIDENCY_RELEASE_ON_PRESSURE=1",
                                             "RESIDENCY_PRESSURE_QUIET=3s"},
                                            "pressure-aware");
  ASSERT_FALSE(HasFailure());
  if (anonymous_weights_without_swap())
    GTEST_SKIP() << "llama.cpp repacked the weights into anonymous memory and neither the machine nor the test's "
                    "cgroup has swap: pressure can take none "
                    "of them (the preload's warning says so; the ExtraBufferTypesOff case tests pressure on this CPU)";
  ASSERT_GE(locked, kModelBytes * 95 / 100) << "the model is not locked:\n" << server_->stderr_text();
  ASSERT_GE(cg_.usage(), kModelBytes * 95 / 100)
      << "the model is not charged to the test's cgroup: nothing would be tested";
  // The server watches the pressure of the cgroup it is in, with the kernel's source for it.
  const std::string err = server_->stderr_text();
  const auto watch = err.find("watching memory pressure: ");
  ASSERT_NE(watch, std::string::npos) << "the watch did not start:\n" << err;
  const std::string watch_line = err.substr(watch, err.find('\n', watch) - watch);
  const std::string cg_name = cg_.dir().substr(cg_.dir().rfind('/'));
  EXPECT_NE(watch_line.find(cg_name + (cg_.version() == 1 ? "/memory.pressure_level" : "/memory.pressure")), std::string::npos)
      << watch_line;

  const std::uint64_t hog = hog_bytes(locked);
  const HogOutcome h = run_hog(cg_.procs(), hog, /*deadline_s=*/30, /*hold_s=*/0.5, server_->pid());
  ASSERT_TRUE(h.got) << "the hog did not get " << hog / kMiB << " MiB within 30 s (" << h.attempts << " attempts)\n"
                     << server_->stderr_text();
  EXPECT_TRUE(server_->alive()) << "the server was killed";
  EXPECT_LT(h.server_vm_lck_when_got.value_or(0), kModelBytes / 2)
      << "the hog got its memory while the model stayed locked?";
  EXPECT_NE(server_->stderr_text().find("under memory pressure"), std::string::npos) << server_->stderr_text();
  std::printf(
      "[ measured ] pressure-aware: the hog (%llu MiB) got its memory %.2f s after its first attempt (%d "
      "attempt(s), %d OOM-killed); the server held %llu MiB locked then\n",
      static_cast<unsigned long long>(hog / kMiB), h.waited_s, h.attempts, h.killed,
      static_cast<unsigned long long>(h.server_vm_lck_when_got.value_or(0) / kMiB));

  // The hog is done. Pressure goes quiet for 3 s and the budget comes back; requests resume.
  const auto t0 = Clock::now();
  while (server_->stderr_text().find("memory pressure has been quiet") == std::string::npos && seconds_since(t0) < 20)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_NE(server_->stderr_text().find("memory pressure has been quiet"), std::string::npos)
      << "the budget did not come back within 20 s:\n"
      << server_->stderr_text();
  const double quiet_s = seconds_since(t0);
  ASSERT_TRUE(server_->request()) << server_->stderr_text();
  ASSERT_TRUE(server_->request()) << server_->stderr_text();
  const std::uint64_t again = vm_lck(server_->pid()).value_or(0);
  EXPECT_GE(again, kModelBytes * 95 / 100) << "the model is not wired again after requests resumed";
  const double cached = page_cache_fraction(model_path_);
  EXPECT_GE(cached, 0.99) << "mincore: the model's pages are not all in memory again";
  std::printf(
      "[ measured ] pressure-aware: budget back %.1f s after the hog got its memory; after two requests the "
      "server holds %llu MiB locked, %.1f %% of the model in memory\n",
      quiet_s, static_cast<unsigned long long>(again / kMiB), cached * 100);
}

// Quiet is not free memory: here the hog keeps what it got for several quiet periods. The budget
// rises only to what the cgroup has room for (Backend::memory_available()): the model's weights
// (one 2 GiB buffer, or a repacked buffer and the pages of the tensors left in the file, each wired
// whole or not at all) do not fit beside the hog, so they stay unwired (the KV cache and compute
// buffers, tens of MiB, may be wired: there is room for them) and nobody
// is OOM-killed (lifting the whole budget, as before, wired it and the kernel killed the hog), and
// it is wired whole again once the hog has gone. The debug log shows each check.
TEST_P(RealPressureTest, AfterQuietTheModelTakesBackOnlyWhatTheCgroupHasRoomFor) {
  const std::uint64_t locked = start_server({"RESIDENCY_KEEP_ALIVE=10m", "RESIDENCY_RELEASE_ON_PRESSURE=1",
                                             "RESIDENCY_PRESSURE_QUIET=2s", "RESIDENCY_LOG=debug"},
                                            "room");
  ASSERT_FALSE(HasFailure());
  if (anonymous_weights_without_swap())
    GTEST_SKIP() << "llama.cpp repacked the weights into anonymous memory and neither the machine nor the test's "
                    "cgroup has swap: pressure can take none "
                    "of them (the preload's warning says so; the ExtraBufferTypesOff case tests pressure on this CPU)";
  ASSERT_GE(locked, kModelBytes * 95 / 100) << "the model is not locked:\n" << server_->stderr_text();
  const std::uint64_t hog = hog_bytes(locked);
  constexpr double kHold = 10;  // five quiet periods
  std::atomic<bool> got{false};
  HogOutcome h;
  std::thread hog_thread([&] { h = run_hog(cg_.procs(), hog, /*deadline_s=*/30, kHold, server_->pid(), &got); });
  const auto t0 = Clock::now();
  while (!got.load() && seconds_since(t0) < 31) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::uint64_t most_locked_while_held = 0;
  const auto held_since = Clock::now();
  while (got.load() && seconds_since(held_since) < kHold - 1) {
    most_locked_while_held = std::max(most_locked_while_held, vm_lck(server_->pid()).value_or(0));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const std::string while_held = server_->stderr_text();
  hog_thread.join();
  ASSERT_TRUE(h.got) << "the hog did not get " << hog / kMiB << " MiB within 30 s\n" << while_held;
  EXPECT_FALSE(h.killed_after_got)
      << "the hog was killed while it held its memory: the re-wire took more than there was room for\n"
      << server_->stderr_text();
  EXPECT_TRUE(server_->alive()) << "the server was killed";
  EXPECT_NE(while_held.find("memory pressure has been quiet, but only"), std::string::npos)
      << "no quiet period was seen with the hog holding its memory:\n"
      << while_held;
  EXPECT_EQ(while_held.find("memory pressure has been quiet: the budget is back"), std::string::npos)
      << "the whole budget came back while the hog held its memory:\n"
      << while_held;
  EXPECT_LT(most_locked_while_held + hog, cg_.limit()) << "locked beside the hog";
  EXPECT_LT(most_locked_while_held, kModelBytes / 8)
      << "the 2 GiB model's weights do not fit beside the hog: only its small buffers may be locked";

  // The hog has gone: the next quiet period gives the whole budget back, requests wire the model.
  const auto t1 = Clock::now();
  while (server_->stderr_text().find("memory pressure has been quiet: the budget is back") == std::string::npos &&
         seconds_since(t1) < 20)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_NE(server_->stderr_text().find("memory pressure has been quiet: the budget is back"), std::string::npos)
      << "the budget did not come back within 20 s of the hog's exit:\n"
      << server_->stderr_text();
  const double back_s = seconds_since(t1);
  ASSERT_TRUE(server_->request()) << server_->stderr_text();
  ASSERT_TRUE(server_->request()) << server_->stderr_text();
  const std::uint64_t again = vm_lck(server_->pid()).value_or(0);
  EXPECT_GE(again, kModelBytes * 95 / 100) << "the model is not wired again after the hog left";
  std::size_t checks = 0;
  for (std::size_t at = while_held.find("but only"); at != std::string::npos; at = while_held.find("but only", at + 1))
    ++checks;
  std::printf(
      "[ measured ] room: while the hog held %llu MiB for %.0f s (%zu quiet-period checks) the server locked at "
      "most %llu MiB and the hog was %s; budget back %.1f s after the hog left, then %llu MiB locked\n",
      static_cast<unsigned long long>(hog / kMiB), kHold, checks,
      static_cast<unsigned long long>(most_locked_while_held / kMiB), h.killed_after_got ? "KILLED" : "not killed",
      back_s, static_cast<unsigned long long>(again / kMiB));
}

INSTANTIATE_TEST_SUITE_P(Layouts, RealPressureTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return std::string(i.param ? "ExtraBufferTypesOff" : "ExtraBufferTypesOn");
                         });

}  // namespace
