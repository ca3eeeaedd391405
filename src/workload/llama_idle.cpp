// SPDX-License-Identifier: MIT
#include "workload/llama_idle.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>

#include "residency/config.hpp"
#include "residency/text.hpp"
#include "workload/cleanup.hpp"
#include "workload/gguf.hpp"

extern char** environ;

namespace residency::workload {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr int kItersPerPause = 3;
constexpr int kPauses = 6;                    // 0, 800, ..., 4000 ms
constexpr milliseconds kPressureLead{150};    // pressure this long before a pause ends
constexpr milliseconds kHeldLead{300};        // what is held: read this long before the last pause ends
constexpr milliseconds kChildLimit{180'000};  // one llama-idle run takes ~45 s; 4x that is a hang
constexpr double kImplausibleDecodeMs = 0.1;  // a failed llama_decode "takes" ~0.02 ms
constexpr const char* kDecodePrefix = "  - decode time:";

Status bad(std::string m) { return Status(ErrorCode::invalid_argument, std::move(m)); }

bool executable(const std::string& p) { return !p.empty() && ::access(p.c_str(), X_OK) == 0; }

std::string keep_alive_text(Nanos k) { return KeepAlive::after(k).to_string(); }

// The child's mappings of the file (dev, inode) and its anonymous ones (where llama.cpp keeps
// weights it repacked at load: AMX, CPU_REPACK; its KV cache; its compute buffers), from
// /proc/PID/maps. Libraries and other files are left alone: real pressure reclaims cold pages,
// and a program's code is hot.
std::vector<iovec> mappings_of(pid_t pid, dev_t dev, ino_t ino) {
  std::vector<iovec> out;
  std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
  std::string line;
  while (std::getline(maps, line)) {
    unsigned long long b = 0, e = 0, off = 0, inode = 0;
    unsigned dmaj = 0, dmin = 0;
    char perms[8] = {};
    if (std::sscanf(line.c_str(), "%llx-%llx %7s %llx %x:%x %llu", &b, &e, perms, &off, &dmaj, &dmin, &inode) != 7)
      continue;
    const bool anonymous = inode == 0 && line.find("[vsyscall]") == std::string::npos &&
                           line.find("[vvar") == std::string::npos && line.find("[vdso]") == std::string::npos;
    if ((inode == ino && makedev(dmaj, dmin) == dev) || anonymous)
      out.push_back({reinterpret_cast<void*>(b), static_cast<std::size_t>(e - b)});
  }
  return out;
}

// VmLck, RssAnon and VmSwap of the child, bytes.
void read_status(pid_t pid, LlamaIdleHeld& held) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  auto value = [&](const char* key, std::uint64_t& out) {
    if (line.rfind(key, 0) == 0) out = std::stoull(line.substr(std::strlen(key))) * 1024;
  };
  while (std::getline(f, line)) {
    value("VmLck:", held.vm_lck);
    value("RssAnon:", held.rss_anon);
    value("VmSwap:", held.vm_swap);
  }
}

// The model file, for pressure and mincore, without faulting anything in (mincore reports the
// page cache whatever our own page tables hold).
class ModelFile {
 public:
  Status open(const std::string& path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) return bad("cannot open the model '" + printable(path) + "': " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd_, &st) != 0 || st.st_size <= 0) return bad("cannot stat the model '" + printable(path) + "'");
    dev_ = st.st_dev;
    ino_ = st.st_ino;
    size_ = static_cast<std::size_t>(st.st_size);
    map_ = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd_, 0);
    if (map_ == MAP_FAILED) return bad("cannot map the model '" + printable(path) + "': " + std::strerror(errno));
    return {};
  }
  ~ModelFile() {
    if (map_ && map_ != MAP_FAILED) ::munmap(map_, size_);
    if (fd_ >= 0) ::close(fd_);
  }
  double resident() const {
    auto r = resident_fraction(map_, size_);
    return r ? *r : -1;
  }
  // process_madvise(MADV_PAGEOUT) over the child's mappings of the model and its anonymous
  // ones (swapped out where there is swap), then drop the file's unmapped pages.
  Status page_out(pid_t pid) const {
#if defined(SYS_pidfd_open) && defined(SYS_process_madvise)
    auto iov = mappings_of(pid, dev_, ino_);
    if (!iov.empty()) {
      const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
      if (pidfd < 0) return Status(ErrorCode::unsupported, std::string("pidfd_open: ") + std::strerror(errno));
      // One range per call: the kernel stops a vector at the first range it refuses (EINVAL: a
      // locked range, the point; ENOMEM: one that went away), and the ranges after it must still
      // be paged out.
      for (const iovec& range : iov) {
        const long r = ::syscall(SYS_process_madvise, pidfd, &range, 1, MADV_PAGEOUT, 0U);
        const int err = errno;
        if (r < 0 && err != EINVAL && err != ENOMEM) {
          ::close(pidfd);
          return Status(ErrorCode::unsupported, std::string("process_madvise(MADV_PAGEOUT): ") + std::strerror(err));
        }
      }
      ::close(pidfd);
    }
#else
    (void)pid;
    return Status(ErrorCode::unsupported, "this build has no process_madvise");
#endif
    ::posix_fadvise(fd_, 0, static_cast<off_t>(size_), POSIX_FADV_DONTNEED);
    return {};
  }

 private:
  int fd_ = -1;
  dev_t dev_ = 0;
  ino_t ino_ = 0;
  std::size_t size_ = 0;
  void* map_ = nullptr;
};

struct ChildResult {
  std::vector<double> decode_ms;  // in schedule order, warm-up excluded
  std::vector<HogRun> hogs;       // hog:SIZE, one per pause longer than 0, in order
  LlamaIdleHeld held;
  std::string stderr_tail;
};

// The last n lines of `text` (all of it when it has fewer, "" when it is empty: a child that
// wrote nothing to stderr, as llama-idle with --load-mode and a quiet load).
std::string tail_lines(const std::string& text, int n) {
  std::size_t at = text.size();
  for (int i = 0; i <= n; ++i) {
    if (at == 0) return text;
    at = text.rfind('\n', at - 1);
    if (at == std::string::npos) return text;
  }
  return text.substr(at + 1);
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// Starts argv with `env` added (LD_PRELOAD and RESIDENCY_* removed unless given), stdout to a
// pseudo-terminal, stderr to `err_path`. A terminal, because stdio buffers a pipe in 4 KiB blocks
// and llama-idle flushes only after each pause's three decodes: through a pipe the lines would
// arrive late, and pressure timed from them would fall anywhere in the pause. On a terminal stdio
// writes each line as it ends (raw mode: no \r added). The child dies with us (PR_SET_PDEATHSIG).
Result<pid_t> spawn(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                    const std::string& err_path, int* out_fd, bool pass_environment) {
  const int master = ::posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
  if (master < 0 || ::grantpt(master) != 0 || ::unlockpt(master) != 0)
    return Status(ErrorCode::backend_error, std::string("posix_openpt: ") + std::strerror(errno));
  const char* pts = ::ptsname(master);
  const int slave = pts ? ::open(pts, O_RDWR | O_NOCTTY | O_CLOEXEC) : -1;
  if (slave < 0) {
    ::close(master);
    return Status(ErrorCode::backend_error, std::string("opening the pseudo-terminal: ") + std::strerror(errno));
  }
  termios tio{};
  if (::tcgetattr(slave, &tio) == 0) {
    ::cfmakeraw(&tio);
    ::tcsetattr(slave, TCSANOW, &tio);
  }
  int p[2] = {master, slave};
  std::vector<std::string> envs;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    if (kv.rfind("LD_PRELOAD=", 0) == 0) continue;
    // What each configuration sets is its own; the rest of the user's configuration goes along
    // when asked for (LlamaIdleOptions::pass_environment).
    if (kv.rfind("RESIDENCY_KEEP_ALIVE=", 0) == 0 || kv.rfind("RESIDENCY_RELEASE_ON_PRESSURE=", 0) == 0) continue;
    if (!pass_environment && kv.rfind("RESIDENCY_", 0) == 0) continue;
    envs.push_back(kv);
  }
  for (const auto& kv : env) envs.push_back(kv);
  std::vector<char*> cargv, cenv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  for (const auto& e : envs) cenv.push_back(const_cast<char*>(e.c_str()));
  cenv.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) return Status(ErrorCode::backend_error, std::string("fork: ") + std::strerror(errno));
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    ::dup2(p[1], STDOUT_FILENO);
    const int e = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (e >= 0) ::dup2(e, STDERR_FILENO);
    ::execve(cargv[0], cargv.data(), cenv.data());
    ::_exit(127);
  }
  ::close(slave);
  *out_fd = master;
  CleanupRegistry::set_child(pid);
  return pid;
}

// Runs one child through llama-idle's schedule, applying pressure and reading what it holds.
Result<ChildResult> run_child(const LlamaIdleConfig& cfg, const std::vector<std::string>& argv,
                              const std::vector<std::string>& env, const std::string& err_path, const ModelFile& model,
                              const Pressure& pressure, bool first_line_is_warmup, bool pass_environment,
                              LlamaIdleObserver* observer) {
  int fd = -1;
  auto pid = spawn(argv, env, err_path, &fd, pass_environment);
  if (!pid) return pid.status();
  ChildResult out;
  const auto pauses = llama_idle_fixed_schedule().pauses;
  std::string buf;
  constexpr Clock::time_point kNever = Clock::time_point::max();
  Clock::time_point pressure_at = kNever, held_at = kNever;  // kNever: nothing scheduled
  bool warmup_pending = first_line_is_warmup;
  const auto deadline = Clock::now() + kChildLimit;
  Status failure;
  // After decode line k (0-based) the pause before decode k+1 begins.
  auto schedule_after = [&](int k) {
    const int next = k + 1;
    if (next >= kPauses * kItersPerPause) return;
    const auto pause = std::chrono::duration_cast<milliseconds>(pauses[static_cast<std::size_t>(next / kItersPerPause)]);
    if (pause.count() == 0) return;
    const auto now = Clock::now();
    // pageout at the end of the pause; a hog from its start (it takes time to fill memory).
    if (pressure.kind == Pressure::Kind::pageout) pressure_at = now + pause - kPressureLead;
    if (pressure.kind == Pressure::Kind::hog) pressure_at = now + milliseconds(50);
    if (next == kPauses * kItersPerPause - 1) held_at = now + pause - kHeldLead;
  };
  for (;;) {
    const auto now = Clock::now();
    if (now > deadline) {
      failure = Status(ErrorCode::backend_error,
                       cfg.id + ": no output for " + std::to_string(kChildLimit.count() / 1000) + " s; stopped");
      break;
    }
    const auto next_event = std::min({deadline, pressure_at, held_at});
    const int timeout = static_cast<int>(
        std::max<long long>(0, std::chrono::duration_cast<milliseconds>(next_event - now).count()));
    pollfd pfd{fd, POLLIN, 0};
    const int r = ::poll(&pfd, 1, timeout);
    if (r < 0 && errno == EINTR) continue;
    const auto t = Clock::now();
    if (t >= held_at) {
      read_status(*pid, out.held);
      out.held.resident_fraction = model.resident();
      held_at = kNever;
    }
    if (t >= pressure_at) {
      pressure_at = kNever;
      Status st;
      if (pressure.kind == Pressure::Kind::pageout) {
        st = model.page_out(*pid);
      } else if (auto hog = run_hog(pressure.hog_bytes)) {
        out.hogs.push_back(*hog);
      } else {
        st = hog.status();
      }
      if (!st) {
        failure = Status(st.code(), cfg.id + ": applying " + pressure.to_string() + " failed: " + st.message());
        break;
      }
    }
    if (r <= 0 || !(pfd.revents & (POLLIN | POLLHUP))) continue;
    char chunk[4096];
    const ssize_t n = ::read(fd, chunk, sizeof chunk);
    if (n <= 0) break;  // the child closed its terminal (EIO on a pty): it is exiting
    buf.append(chunk, static_cast<std::size_t>(n));
    for (std::size_t nl; (nl = buf.find('\n')) != std::string::npos; buf.erase(0, nl + 1)) {
      const std::string line = buf.substr(0, nl);
      double ms = 0;
      bool decode = false;
      if (line.rfind(kDecodePrefix, 0) == 0) {
        decode = std::sscanf(line.c_str() + std::strlen(kDecodePrefix), "%lf", &ms) == 1;
      } else if (const auto at = line.find(": first token "); line.rfind("request ", 0) == 0 && at != std::string::npos) {
        decode = std::sscanf(line.c_str() + at + std::strlen(": first token "), "%lf", &ms) == 1;
      }
      if (observer) observer->child_line(cfg, line);
      if (!decode) continue;
      if (warmup_pending) {  // the engine prints its warm-up request; llama-idle does not
        warmup_pending = false;
        schedule_after(-1);
        continue;
      }
      out.decode_ms.push_back(ms);
      schedule_after(static_cast<int>(out.decode_ms.size()) - 1);
    }
  }
  ::close(fd);
  if (!failure.is_ok()) ::kill(*pid, SIGKILL);
  int status = 0;
  while (::waitpid(*pid, &status, 0) < 0 && errno == EINTR) {
  }
  CleanupRegistry::set_child(0);
  const std::string err = read_file(err_path);
  out.stderr_tail = tail_lines(err, 6);
  if (!failure.is_ok()) return Status(failure.code(), failure.message() + "\n" + out.stderr_tail);
  const std::size_t expected = kPauses * kItersPerPause;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    return Status(ErrorCode::backend_error, cfg.id + ": " + argv[0] + " ended with " +
                                                (WIFEXITED(status) ? "exit status " + std::to_string(WEXITSTATUS(status))
                                                                   : "signal " + std::to_string(WTERMSIG(status))) +
                                                "; its stderr ends with:\n" + out.stderr_tail);
  if (out.decode_ms.size() != expected)
    return Status(ErrorCode::backend_error, cfg.id + ": printed " + std::to_string(out.decode_ms.size()) +
                                                " decode times, not " + std::to_string(expected) +
                                                "; its stderr ends with:\n" + out.stderr_tail);
  if (err.find("failed to decode") != std::string::npos || err.find("llama_decode: failed") != std::string::npos ||
      *std::min_element(out.decode_ms.begin(), out.decode_ms.end()) < kImplausibleDecodeMs)
    return Status(
        ErrorCode::backend_error,
        cfg.id + ": its decodes failed (times under " + std::to_string(kImplausibleDecodeMs) +
            " ms, or a decode error on stderr): a model without a BOS token (tokenizer.ggml.model = none) makes "
            "llama-idle's decodes fail; its stderr ends with:\n" +
            out.stderr_tail);
  return out;
}

}  // namespace

IdleSchedule llama_idle_fixed_schedule() {
  IdleSchedule s;
  for (int p = 0; p < kPauses; ++p) s.pauses.push_back(milliseconds(800 * p));
  s.iters = kItersPerPause;
  return s;
}

Result<std::vector<LlamaIdleConfig>> parse_llama_idle_configs(const std::string& list, Nanos keep_alive) {
  static const char* kAccepted = "mmap, mlock, keep-alive, pressure-aware, 0, no-mmap, engine";
  std::vector<LlamaIdleConfig> out;
  std::stringstream ss(list);
  std::string id;
  while (std::getline(ss, id, ',')) {
    LlamaIdleConfig c{id, ""};
    if (id == "mmap") c.name = "mmap (llama.cpp default)";
    else if (id == "mlock") c.name = "--load-mode mlock";
    else if (id == "keep-alive") c.name = "residency keep-alive " + keep_alive_text(keep_alive);
    else if (id == "pressure-aware") c.name = "residency keep-alive " + keep_alive_text(keep_alive) + " + pressure";
    else if (id == "0") c.name = "residency 0";
    else if (id == "no-mmap") c.name = "--load-mode none (no mmap)";
    else if (id == "engine") c.name = "llama_engine keep-alive " + keep_alive_text(keep_alive);
    else return bad("--configs: unknown configuration '" + printable(id) + "'; accepted: " + kAccepted);
    for (const auto& o : out)
      if (o.id == id) return bad("--configs: '" + printable(id) + "' is named twice");
    out.push_back(c);
  }
  if (out.empty()) return bad(std::string("--configs: empty; accepted: ") + kAccepted);
  return out;
}

Status check_llama_idle_options(const LlamaIdleOptions& o, bool check_model) {
  if (!executable(o.llama_idle))
    return bad("llama-idle not found or not executable at '" + printable(o.llama_idle) +
               "'; build llama.cpp with scripts/llama-cpp, or give --llama-dir");
  auto configs = parse_llama_idle_configs(
      [&] {
        std::string s;
        for (const auto& c : o.configs) s += (s.empty() ? "" : ",") + c;
        return s;
      }(),
      o.keep_alive);
  if (!configs) return configs.status();
  for (const auto& c : *configs) {
    if ((c.id == "keep-alive" || c.id == "pressure-aware" || c.id == "0") &&
        (o.preload.empty() || ::access(o.preload.c_str(), R_OK) != 0))
      return bad("configuration '" + c.id + "' needs libresidency_preload.so, not found at '" + printable(o.preload) +
                 "'; give --preload, or leave it out of --configs");
    if (c.id == "engine" && !executable(o.engine))
      return bad("configuration 'engine' needs the llama_engine example, not found at '" + printable(o.engine) +
                 "'; give --engine, or leave it out of --configs");
  }
  if (o.keep_alive.count() <= 0 || o.keep_alive > std::chrono::milliseconds(3500))
    return bad("--keep-alive '" + keep_alive_text(o.keep_alive) +
               "': accepted: more than 0 and at most 3.5 s, so that the last pause (4 s) shows what is given back");
  if (o.rounds < 1 || o.rounds > 20) return bad("--rounds " + std::to_string(o.rounds) + ": accepted 1 to 20");
  if (o.pressure.kind == Pressure::Kind::pageout) {
    if (Status st = pageout_supported(); !st) return bad(st.message());
  } else if (o.pressure.kind == Pressure::Kind::hog) {
    if (Status st = check_hog_fits(o.pressure.hog_bytes); !st) return bad(st.message());
  }
  if (!check_model) return {};
  auto model = GgufFile::open(o.model);
  if (!model) return bad(model.message());
  const GgufValue* tok = model->model().find("tokenizer.ggml.model");
  const GgufValue* bos = model->model().find("tokenizer.ggml.bos_token_id");
  if (!tok || tok->str == "none" || !bos)
    return bad("'" + printable(o.model) + "' has no BOS token (tokenizer.ggml.model " +
               (tok ? "= " + tok->str : std::string("missing")) +
               "): llama-idle decodes its BOS token and would fail; `residency make-model` writes models it can run");
  return {};
}

Result<LlamaIdleOutcome> run_llama_idle(const LlamaIdleOptions& o, LlamaIdleObserver* observer) {
  if (Status st = check_llama_idle_options(o); !st) return st;
  std::string list;
  for (const auto& c : o.configs) list += (list.empty() ? "" : ",") + c;
  auto configs = parse_llama_idle_configs(list, o.keep_alive);
  ModelFile model;
  if (Status st = model.open(o.model); !st) return st;
  CleanupRegistry::install_signal_handlers();
  auto work = TempDir::create(::access("/var/tmp", W_OK) == 0 ? "/var/tmp" : "/tmp", "residency-llama-idle-");
  if (!work) return work.status();

  LlamaIdleOutcome outcome;
  IdleResults& r = outcome.results;
  r.schedule = llama_idle_fixed_schedule();
  r.pressure = o.pressure;
  for (const auto& c : *configs) {
    IdlePolicy p;
    p.id = c.id;
    p.name = c.name;
    p.kind = (c.id == "keep-alive" || c.id == "pressure-aware" || c.id == "engine") ? IdlePolicy::Kind::keep_alive
                                                                                    : IdlePolicy::Kind::off;
    p.keep_alive = KeepAlive::after(o.keep_alive);
    r.policies.push_back(p);
  }
  outcome.held.resize(configs->size());
  outcome.stderr_tails.resize(configs->size());
  const std::string ka = "RESIDENCY_KEEP_ALIVE=" +
                         std::to_string(std::chrono::duration_cast<milliseconds>(o.keep_alive).count()) + "ms";
  std::string engine_pauses = "0";  // the warm-up request
  for (const auto& p : r.schedule.pauses)
    for (int i = 0; i < kItersPerPause; ++i)
      engine_pauses += "," + std::to_string(std::chrono::duration_cast<milliseconds>(p).count());
  const auto t0 = Clock::now();
  for (int round = 0; round < o.rounds; ++round) {
    for (std::size_t k = 0; k < configs->size(); ++k) {
      const std::size_t ci = (k + static_cast<std::size_t>(round)) % configs->size();
      const LlamaIdleConfig& c = (*configs)[ci];
      std::vector<std::string> argv{o.llama_idle, "-m", o.model};
      std::vector<std::string> env;
      bool warmup_line = false;
      if (o.no_repack) argv.push_back("--no-repack");
      // llama.cpp v0.4.0 deprecates --mlock and --no-mmap (a "DEPRECATED" line at every start)
      // for --load-mode, with the same meanings: --mlock was "mlock", --no-mmap "none".
      if (c.id == "mlock") argv.insert(argv.end(), {"--load-mode", "mlock"});
      if (c.id == "no-mmap") argv.insert(argv.end(), {"--load-mode", "none"});
      if (c.id == "keep-alive" || c.id == "0")
        env = {"LD_PRELOAD=" + o.preload, c.id == "0" ? "RESIDENCY_KEEP_ALIVE=0" : ka};
      if (c.id == "pressure-aware") env = {"LD_PRELOAD=" + o.preload, ka, "RESIDENCY_RELEASE_ON_PRESSURE=1"};
      if (c.id == "engine") {
        argv = {o.engine, o.model, std::to_string(1 + kPauses * kItersPerPause), "1", engine_pauses};
        if (o.no_repack) argv.insert(argv.begin() + 1, "--no-repack");
        env = {ka};
        warmup_line = true;
      }
      if (observer) observer->child_starts(c, round);
      auto res = run_child(c, argv, env, work->track(c.id + ".stderr"), model, o.pressure, warmup_line,
                           o.pass_environment, observer);
      if (!res) return res.status();
      std::size_t hog = 0;
      for (std::size_t i = 0; i < res->decode_ms.size(); ++i) {
        IdleSample s;
        s.policy = ci;
        s.pause = i / kItersPerPause;
        s.iter = round * kItersPerPause + static_cast<int>(i % kItersPerPause);
        s.decode_ms = res->decode_ms[i];
        s.idle_ms = static_cast<double>(std::chrono::duration_cast<milliseconds>(r.schedule.pauses[s.pause]).count());
        if (r.schedule.pauses[s.pause].count() > 0 && hog < res->hogs.size()) s.hog = res->hogs[hog++];
        r.samples.push_back(s);
      }
      outcome.held[ci] = res->held;
      outcome.stderr_tails[ci] = res->stderr_tail;
    }
  }
  r.schedule.iters = kItersPerPause * o.rounds;
  r.wall_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return outcome;
}

std::string format_llama_idle_held(const LlamaIdleOutcome& o) {
  std::string s =
      "| configuration | VmLck 3.7 s after a decode | RSS anonymous | swapped out | model file resident |\n"
      "|---|---:|---:|---:|---:|\n";
  for (std::size_t i = 0; i < o.results.policies.size(); ++i) {
    char pct[32];
    const double f = o.held[i].resident_fraction;
    if (f < 0) std::snprintf(pct, sizeof pct, "unknown");
    else std::snprintf(pct, sizeof pct, "%.1f %%", 100.0 * f);
    s += "| " + o.results.policies[i].name + " | " + format_size(o.held[i].vm_lck) + " | " +
         format_size(o.held[i].rss_anon) + " | " + format_size(o.held[i].vm_swap) + " | " + pct + " |\n";
  }
  return s;
}

}  // namespace residency::workload
