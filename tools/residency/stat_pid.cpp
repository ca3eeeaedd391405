// SPDX-License-Identifier: MIT
// residency stat --pid PID: what that process holds locked and resident, what its residency
// managers say about themselves, and what it holds on its GPUs.
//
// Three sources, each as far as this user may read it:
//   the kernel   /proc/PID/status (VmLck, VmRSS and its parts, VmSwap: readable by anyone) and
//                /proc/PID/smaps (locked bytes per mapping: only the process's user or root)
//   its managers the state files they publish (src/core/state_file.hpp: 0600, the process's
//                user only); a stale one (dead process, reused pid) is reported and removed
//   its GPUs     nvidia-smi's compute-apps query, where nvidia-smi is on PATH
#include "stat_pid.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "command.hpp"
#include "json_text.hpp"
#include "residency/config.hpp"
#include "residency/text.hpp"

#if defined(__linux__)
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/state_file.hpp"

extern char** environ;
#endif

namespace residency::tool {

#if defined(__linux__)
namespace {

using Row = std::pair<std::string, std::string>;

// --- the kernel ----------------------------------------------------------------------------

struct ProcStatus {
  std::string name;
  uid_t uid = 0;
  std::optional<std::uint64_t> vm_lck, vm_rss, rss_anon, rss_file, rss_shmem, vm_swap;
};

// "VmLck:   1234 kB" -> bytes.
std::optional<std::uint64_t> kb_field(const std::string& line) {
  const auto colon = line.find(':');
  if (colon == std::string::npos) return std::nullopt;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(line.c_str() + colon + 1, &end, 10);
  if (end == line.c_str() + colon + 1) return std::nullopt;
  return static_cast<std::uint64_t>(v) * 1024;
}

// nullopt: no such process (errno says why).
std::optional<ProcStatus> read_status(int pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  if (!f) return std::nullopt;
  ProcStatus s;
  std::string line;
  bool any = false;
  while (std::getline(f, line)) {
    any = true;
    auto is = [&](const char* k) { return line.rfind(k, 0) == 0; };
    if (is("Name:")) s.name = line.substr(line.find_first_not_of(" \t", 5));
    else if (is("Uid:")) s.uid = static_cast<uid_t>(std::strtoul(line.c_str() + 4, nullptr, 10));
    else if (is("VmLck:")) s.vm_lck = kb_field(line);
    else if (is("VmRSS:")) s.vm_rss = kb_field(line);
    else if (is("RssAnon:")) s.rss_anon = kb_field(line);
    else if (is("RssFile:")) s.rss_file = kb_field(line);
    else if (is("RssShmem:")) s.rss_shmem = kb_field(line);
    else if (is("VmSwap:")) s.vm_swap = kb_field(line);
  }
  if (!any) return std::nullopt;  // the process ended between open and read
  return s;
}

struct Mapping {
  std::string what;  // "file PATH", "anonymous", "[heap]", "[stack]", ...
  std::uint64_t locked = 0, rss = 0;
};

// Locked and resident bytes per mapping target, most locked first. Empty `error`: read.
struct Smaps {
  std::vector<Mapping> by_target;
  std::string error;
  int err = 0;
};
Smaps read_smaps(int pid) {
  Smaps out;
  const std::string path = "/proc/" + std::to_string(pid) + "/smaps";
  // std::ifstream hides errno; open() keeps it for the message.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    out.err = errno;
    out.error = path + ": " + std::strerror(errno);
    return out;
  }
  std::string text;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      out.err = errno;
      out.error = path + ": " + std::strerror(errno);
      break;
    }
    if (n == 0) break;
    text.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  if (!out.error.empty()) return out;
  std::map<std::string, Mapping> m;
  std::istringstream in(text);
  std::string line, current;
  while (std::getline(in, line)) {
    // A mapping's header: "start-end perms offset dev inode [path]"; its fields: "Key: value".
    const auto sp = line.find(' ');
    const bool header = sp != std::string::npos && line.find('-') < sp && line[sp - 1] != ':';
    if (header) {
      std::istringstream h(line);
      std::string range, perms, offset, dev, inode;
      h >> range >> perms >> offset >> dev >> inode;
      std::string rest;
      std::getline(h, rest);
      const auto start = rest.find_first_not_of(' ');
      rest = start == std::string::npos ? std::string() : rest.substr(start);
      current = rest.empty() ? "anonymous" : rest[0] == '[' ? rest : "file " + rest;
      m[current].what = current;
    } else if (line.rfind("Locked:", 0) == 0) {
      m[current].locked += kb_field(line).value_or(0);
    } else if (line.rfind("Rss:", 0) == 0) {
      m[current].rss += kb_field(line).value_or(0);
    }
  }
  for (auto& [k, v] : m) out.by_target.push_back(v);
  std::sort(out.by_target.begin(), out.by_target.end(), [](const Mapping& a, const Mapping& b) {
    return a.locked != b.locked ? a.locked > b.locked : a.rss > b.rss;
  });
  return out;
}

// --- the GPU -------------------------------------------------------------------------------

struct GpuUse {
  std::string gpu, uuid;
  std::uint64_t used = 0;
};
struct Gpu {
  bool available = false;
  std::string reason;  // when not available
  std::vector<GpuUse> uses;
};

std::string on_path(const char* program) {
  const char* env = std::getenv("PATH");
  std::stringstream dirs(env ? env : "");
  std::string d;
  while (std::getline(dirs, d, ':')) {
    if (d.empty()) continue;
    const std::string p = d + "/" + program;
    if (::access(p.c_str(), X_OK) == 0) return p;
  }
  return {};
}

// The program's stdout, or nullopt if it did not run or exit 0 within 10 s.
std::optional<std::string> run_for_output(const std::string& program, const std::vector<std::string>& args) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return std::nullopt;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(program.c_str()));
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t child = 0;
  const int rc = posix_spawn(&child, program.c_str(), &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  ::close(fds[1]);
  if (rc != 0) {
    ::close(fds[0]);
    return std::nullopt;
  }
  bool timed_out = false;
  const std::string out = read_child_output(fds[0], std::chrono::seconds(10), std::size_t{1} << 20, timed_out);
  ::close(fds[0]);
  if (timed_out) ::kill(child, SIGKILL);
  int status = 0;
  while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  if (timed_out || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return std::nullopt;
  return out;
}

std::vector<std::string> csv_fields(const std::string& line) {
  std::vector<std::string> f;
  std::stringstream s(line);
  std::string x;
  while (std::getline(s, x, ',')) {
    const auto a = x.find_first_not_of(' '), b = x.find_last_not_of(" \r");
    f.push_back(a == std::string::npos ? std::string() : x.substr(a, b - a + 1));
  }
  return f;
}

Gpu read_gpu(int pid) {
  Gpu g;
  const std::string smi = on_path("nvidia-smi");
  if (smi.empty()) {
    g.reason = "no NVIDIA driver (nvidia-smi is not on PATH)";
    return g;
  }
  const auto gpus = run_for_output(smi, {"--query-gpu=index,uuid", "--format=csv,noheader"});
  const auto apps = run_for_output(smi,
                                   {"--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"});
  if (!gpus || !apps) {
    g.reason = "nvidia-smi failed (no NVIDIA driver loaded?)";
    return g;
  }
  g.available = true;
  std::map<std::string, std::string> index_of;
  std::stringstream gl(*gpus);
  for (std::string line; std::getline(gl, line);)
    if (auto f = csv_fields(line); f.size() >= 2) index_of[f[1]] = f[0];
  std::stringstream al(*apps);
  for (std::string line; std::getline(al, line);) {
    auto f = csv_fields(line);
    if (f.size() < 3 || f[0] != std::to_string(pid)) continue;
    GpuUse u;
    u.uuid = f[1];
    u.gpu = index_of.count(f[1]) ? index_of[f[1]] : std::string("?");
    u.used = std::strtoull(f[2].c_str(), nullptr, 10) * 1024 * 1024;  // MiB
    g.uses.push_back(u);
  }
  return g;
}

// --- the managers ----------------------------------------------------------------------------

const std::string& field(const core::StateFileRead& s, const char* k) {
  static const std::string none;
  const auto it = s.fields.find(k);
  return it == s.fields.end() ? none : it->second;
}

std::uint64_t bytes_field(const core::StateFileRead& s, const char* k) {
  return std::strtoull(field(s, k).c_str(), nullptr, 10);
}

std::string ago(const std::string& unix_seconds) {
  const double then = std::strtod(unix_seconds.c_str(), nullptr);
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.1f s ago", std::max(0.0, now - then));
  return buf;
}

void manager_rows(std::vector<Row>& rows, const core::StateFileRead& s) {
  const std::string label = "manager " + printable(field(s, "manager"));
  if (!s.error.empty()) {
    rows.emplace_back("state file", printable(s.path, 400) + ": " + printable(s.error, 400));
    return;
  }
  if (s.stale) {
    rows.emplace_back("state file", printable(s.path, 400) + ": stale (its process is gone or the pid was reused)" +
                                        (s.removed ? std::string("; removed") : std::string("; not removed: not yours")));
    return;
  }
  const bool resident = field(s, "resident") == "1";
  rows.emplace_back(label, printable(field(s, "backend")) + ", keep-alive " + printable(field(s, "keep_alive")) + ", " +
                               (resident ? "resident" : "released"));
  const std::string& lim = field(s, "wired_limit");
  rows.emplace_back("  wired", format_size(bytes_field(s, "wired_bytes")) + " of " +
                                   format_size(bytes_field(s, "tracked_bytes")) + " registered in " +
                                   printable(field(s, "regions")) + " region(s); wired limit " +
                                   (lim == "unlimited" ? lim : format_size(bytes_field(s, "wired_limit"))));
  std::string classes;
  for (const char* c : {"weights", "kv_cache", "scratch"}) {
    const std::uint64_t t = bytes_field(s, ("tracked." + std::string(c)).c_str());
    if (t == 0) continue;
    classes += (classes.empty() ? "" : "; ") + std::string(c) + " " + format_size(t) + " (" +
               format_size(bytes_field(s, ("wired." + std::string(c)).c_str())) + " wired)";
  }
  rows.emplace_back("  by class", classes.empty() ? std::string("no regions") : classes);
  if (!field(s, "last_release_at").empty())
    rows.emplace_back("  last release", ago(field(s, "last_release_at")) + " (" +
                                            printable(field(s, "last_release_reason"), 200) + "); " +
                                            printable(field(s, "releases")) + " release(s)");
  else rows.emplace_back("  last release", "none yet");
  if (!field(s, "last_rewire_at").empty())
    rows.emplace_back("  last re-wire", ago(field(s, "last_rewire_at")) + ", " +
                                            format_size(bytes_field(s, "last_rewire_bytes")) + " in " +
                                            printable(field(s, "last_rewire_ms")) + " ms; " +
                                            printable(field(s, "rewires")) + " re-wire(s)");
  if (!field(s, "shared_budget").empty())
    rows.emplace_back("  shared budget", printable(field(s, "shared_budget")) + ": holds " +
                                             format_size(bytes_field(s, "shared_held")) + " of " +
                                             format_size(bytes_field(s, "shared_budget_size")) + ", priority " +
                                             printable(field(s, "shared_priority")) +
                                             (field(s, "shared_budget_mode").empty()
                                                  ? std::string()
                                                  : "; device memory: " + printable(field(s, "shared_budget_mode"))));
  if (field(s, "release_on_pressure") == "1")
    rows.emplace_back("  pressure", field(s, "pressure_source").empty()
                                        ? std::string("release on pressure: no source watched")
                                        : "watching " + printable(field(s, "pressure_source"), 400));
  rows.emplace_back("  state file", printable(s.path, 400) + ", updated " + ago(field(s, "updated")));
}

// A state file's values as JSON: whole numbers as numbers, the rest as text.
nlohmann::json manager_json(const core::StateFileRead& s) {
  nlohmann::json j = {{"path", printable(s.path, 400)}, {"stale", s.stale}, {"removed", s.removed}};
  if (!s.error.empty()) j["error"] = printable(s.error, 400);
  nlohmann::json st = nlohmann::json::object();
  for (const auto& [k, v] : s.fields) {
    const std::string digits = !v.empty() && v[0] == '-' ? v.substr(1) : v;
    const bool whole = !digits.empty() && digits.size() < 19 && digits.find_first_not_of("0123456789") == std::string::npos;
    char* end = nullptr;
    const double d = std::strtod(v.c_str(), &end);
    const bool real = !digits.empty() && end == v.c_str() + v.size() &&
                      digits.find_first_not_of("0123456789.") == std::string::npos;
    if (whole && digits.size() == v.size()) st[printable(k)] = std::strtoull(v.c_str(), nullptr, 10);
    else if (whole) st[printable(k)] = std::strtoll(v.c_str(), nullptr, 10);
    else if (real) st[printable(k)] = d;
    else st[printable(k)] = printable(v, 400);
  }
  j["state"] = st;
  return j;
}

// --- the preload, when the process has no state file -------------------------------------------

// Why a process whose environment names the preload has no residency manager: the library is not
// where LD_PRELOAD says (never built or installed: the loader ignored it with "cannot be preloaded"
// on the program's stderr), or it is but the loader refused it, or it is loaded and nothing was
// managed yet. Empty when the environment does not name it (or cannot be read).
std::string preload_diagnosis(int pid) {
  std::ifstream env("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
  std::string entry, preload;
  bool named = false;
  while (std::getline(env, entry, '\0'))
    if (entry.rfind("LD_PRELOAD=", 0) == 0) {
      preload = entry.substr(11);
      named = true;
    }
  if (!named) return {};
  std::vector<std::string> paths;
  std::string cur;
  for (char c : preload + ":") {
    if (c == ':' || c == ' ') {
      if (cur.find("libresidency_preload") != std::string::npos) paths.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (paths.empty()) return {};
  std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
  std::string line, mapped;
  while (std::getline(maps, line))
    if (line.find("libresidency_preload") != std::string::npos)
      mapped = line.substr(line.find('/') == std::string::npos ? 0 : line.find('/'));
  const std::string& path = paths.front();
  if (!mapped.empty())
    return "the preload is loaded (" + printable(mapped, 400) + ") but has made no manager yet: no llama.cpp model " +
           "loaded, RESIDENCY_KEEP_ALIVE=off, or RESIDENCY_STATE_FILE=0";
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    return "LD_PRELOAD names " + printable(path, 400) + ", which does not exist (" + std::strerror(errno) +
           "): the loader ignored it (\"cannot be preloaded\" on the program's stderr) and the program runs "
           "without residency; the preload is built only where CMake finds llama.cpp (its configure and install "
           "say so), or it was installed elsewhere";
  if (path.find('/') == std::string::npos)
    return "LD_PRELOAD names " + printable(path, 400) +
           " without a path and it is not loaded: give the full path "
           "(PREFIX/lib/libresidency_preload.so)";
  return "LD_PRELOAD names " + printable(path, 400) +
         ", but the process did not load it: the loader refused it "
         "(\"cannot be preloaded\" on the program's stderr: another architecture, or a set-user-ID program)";
}

nlohmann::json opt_json(const std::optional<std::uint64_t>& v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}
std::string opt_text(const std::optional<std::uint64_t>& v) { return v ? format_size(*v) : std::string("unknown"); }

}  // namespace

int run_stat_pid(int pid, bool json) {
  const auto status = read_status(pid);
  if (!status) {
    const int err = errno;
    // Its stale state files, if any of ours: reported and removed.
    std::string stale;
    for (const auto& s : core::read_state_files(pid, ::geteuid(), std::nullopt))
      if (s.removed) stale += "; removed its stale state file " + printable(s.path, 400);
    throw BadInput("--pid " + std::to_string(pid) + ": no such process (/proc/" + std::to_string(pid) +
                   "/status: " + std::strerror(err == 0 ? ESRCH : err) + "); give the pid of a running process" + stale);
  }
  const Smaps smaps = read_smaps(pid);
  if (smaps.err == EACCES || smaps.err == EPERM) {
    if (status->uid != ::geteuid() && ::geteuid() != 0)
      std::fprintf(stderr,
                   "residency stat: --pid %d (%s) runs as uid %u: only that user or root may see what it holds (%s)\n",
                   pid, printable(status->name).c_str(), static_cast<unsigned>(status->uid), smaps.error.c_str());
    else  // the kernel's ptrace check: a process of another user namespace, or yama's ptrace_scope
      std::fprintf(stderr,
                   "residency stat: --pid %d (%s): the kernel does not let this process read its mappings (%s)\n", pid,
                   printable(status->name).c_str(), smaps.error.c_str());
    return kExitFailure;
  }
  if (!smaps.error.empty() && !read_status(pid)) throw BadInput("--pid " + std::to_string(pid) + ": the process ended");
  const auto states = core::read_state_files(pid, status->uid, core::process_start_time(pid));
  const Gpu gpu = read_gpu(pid);
  std::uint64_t held = 0;  // what residency's host managers lock (wired_bytes)
  for (const auto& s : states) {
    const auto b = s.fields.find("backend"), w = s.fields.find("wired_bytes");
    if (s.error.empty() && !s.stale && b != s.fields.end() && b->second == "posix" && w != s.fields.end())
      held += std::strtoull(w->second.c_str(), nullptr, 10);
  }

  if (json) {
    nlohmann::json j;
    j["pid"] = pid;
    j["name"] = printable(status->name);
    j["uid"] = status->uid;
    j["vm_lck"] = opt_json(status->vm_lck);
    if (!states.empty()) j["vm_lck_held_by_residency"] = held;  // the rest: the program's own locks
    j["vm_rss"] = opt_json(status->vm_rss);
    j["rss_anon"] = opt_json(status->rss_anon);
    j["rss_file"] = opt_json(status->rss_file);
    j["rss_shmem"] = opt_json(status->rss_shmem);
    j["vm_swap"] = opt_json(status->vm_swap);
    nlohmann::json maps = nlohmann::json::array();
    for (const auto& m : smaps.by_target)
      if (m.locked > 0) maps.push_back({{"mapping", printable(m.what, 400)}, {"locked", m.locked}, {"rss", m.rss}});
    j["locked_mappings"] = maps;
    if (!smaps.error.empty()) j["smaps_error"] = smaps.error;
    nlohmann::json ms = nlohmann::json::array();
    for (const auto& s : states) ms.push_back(manager_json(s));
    j["managers"] = ms;
    if (states.empty())
      if (const std::string why = preload_diagnosis(pid); !why.empty()) j["preload_problem"] = why;
    nlohmann::json g = {{"available", gpu.available}};
    if (!gpu.available) g["reason"] = gpu.reason;
    nlohmann::json uses = nlohmann::json::array();
    for (const auto& u : gpu.uses) uses.push_back({{"gpu", u.gpu}, {"uuid", u.uuid}, {"used", u.used}});
    g["processes"] = uses;
    j["gpu"] = g;
    std::printf("%s\n", json_text(j).c_str());
    return kExitOk;
  }

  std::vector<Row> rows;
  rows.emplace_back("pid", std::to_string(pid) + " (" + printable(status->name) + "), uid " + std::to_string(status->uid));
  rows.emplace_back("VmLck", status->vm_lck && !states.empty() ? lock_breakdown(*status->vm_lck, held)
                                                               : opt_text(status->vm_lck));
  rows.emplace_back("VmRSS", opt_text(status->vm_rss) + " (anon " + opt_text(status->rss_anon) + ", file " +
                                 opt_text(status->rss_file) + ", shmem " + opt_text(status->rss_shmem) + ")");
  rows.emplace_back("VmSwap", opt_text(status->vm_swap));
  if (!smaps.error.empty()) {
    rows.emplace_back("locked mappings", "unreadable: " + smaps.error);
  } else {
    const char* label = "locked mappings";
    int shown = 0;
    std::uint64_t rest = 0;
    for (const auto& m : smaps.by_target) {
      if (m.locked == 0) continue;
      if (shown++ >= 5) {
        rest += m.locked;
        continue;
      }
      rows.emplace_back(label,
                        format_size(m.locked) + " of " + format_size(m.rss) + " resident: " + printable(m.what, 400));
      label = "";
    }
    if (shown == 0) rows.emplace_back(label, "none");
    if (shown > 5) rows.emplace_back("", format_size(rest) + " in " + std::to_string(shown - 5) + " more");
  }
  if (states.empty()) {
    const std::string why = preload_diagnosis(pid);
    rows.emplace_back("residency",
                      why.empty() ? "no state file (no residency manager in this process, or RESIDENCY_STATE_FILE=0)"
                                  : "no state file: " + why);
  }
  for (const auto& s : states) manager_rows(rows, s);
  if (!gpu.available) {
    rows.emplace_back("GPU", gpu.reason);
  } else if (gpu.uses.empty()) {
    rows.emplace_back("GPU", "nothing (no compute context on any GPU)");
  } else {
    const char* label = "GPU";
    for (const auto& u : gpu.uses) {
      rows.emplace_back(label, "GPU " + printable(u.gpu) + ": " + format_size(u.used) + " (" + printable(u.uuid) + ")");
      label = "";
    }
  }
  std::size_t width = 0;
  for (const auto& [k, v] : rows) width = std::max(width, k.size());
  for (const auto& [k, v] : rows) std::printf("%-*s  %s\n", static_cast<int>(width), k.c_str(), v.c_str());
  return kExitOk;
}

HolderFacts holder_facts(int pid, const std::string& budget) {
  HolderFacts f;
  // The whole of comm (a process may name itself with a newline in it), less the kernel's final newline.
  if (std::ifstream comm("/proc/" + std::to_string(pid) + "/comm", std::ios::binary); comm) {
    f.program.assign(std::istreambuf_iterator<char>(comm), {});
    if (!f.program.empty() && f.program.back() == '\n') f.program.pop_back();
  }
  for (const auto& s : core::read_state_files(pid, ::geteuid(), core::process_start_time(pid))) {
    const auto field = [&](const char* k) {
      const auto it = s.fields.find(k);
      return it == s.fields.end() ? std::string() : it->second;
    };
    // A device manager holds the GPU's budget and, for its registered model files, the host tier's.
    if (!s.error.empty() || s.stale || (field("shared_budget") != budget && field("host_budget") != budget)) continue;
    f.state = state_word(field("backend"), field("resident") == "1");
    f.switches = field("rewires");
    f.last_switch_ms = field("last_rewire_ms");
    f.pinned_host_bytes = field("pinned_host_bytes");
    f.registered_file_bytes = field("registered_file_bytes");
    break;
  }
  return f;
}

std::string lock_breakdown(std::uint64_t vm_lck, std::uint64_t held) {
  std::string out = format_size(vm_lck);
  if (vm_lck <= held + (std::uint64_t{1} << 20)) return out;
  return out + " (" + format_size(held) + " held by residency; the other " + format_size(vm_lck - held) +
         " locked by the program itself, as llama.cpp's --load-mode mlock or mmap+mlock and --mlock do: residency "
         "leaves that lock alone)";
}

std::string state_word(const std::string& backend, bool resident) {
  if (backend == "cuda") return resident ? "awake" : "asleep";
  return resident ? "resident" : "released";
}

std::optional<ProcBrief> proc_brief(int pid) {
  const auto s = read_status(pid);
  if (!s) return std::nullopt;
  return ProcBrief{s->name, static_cast<unsigned>(s->uid), s->vm_lck};
}

#else

int run_stat_pid(int, bool) { throw BadInput("--pid reads /proc: Linux only"); }
HolderFacts holder_facts(int, const std::string&) { return {}; }
std::optional<ProcBrief> proc_brief(int) { return std::nullopt; }

#endif

// What a child writes to `fd` until it closes it (at most about `max_bytes`), or until `limit` has
// passed (`timed_out` then says so): no child can hang the tool.
std::string read_child_output(int fd, std::chrono::milliseconds limit, std::size_t max_bytes, bool& timed_out) {
  std::string out;
  const auto deadline = std::chrono::steady_clock::now() + limit;
  timed_out = false;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    pollfd p{fd, POLLIN, 0};
    const int pr = ::poll(&p, 1, static_cast<int>(left.count()));
    if (pr < 0 && errno == EINTR) continue;
    if (pr <= 0) {
      timed_out = pr == 0;
      break;
    }
    char buf[4096];
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0 || out.size() > max_bytes) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  return out;
}

}  // namespace residency::tool
