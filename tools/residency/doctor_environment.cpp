// SPDX-License-Identifier: MIT
// residency doctor's checks of what a process runs in (doctor.hpp): its RESIDENCY_* configuration,
// its memlock limit against what the model needs, the budgets it joins, the GPUs it sees and the
// state directory. The ledgers are listed without their lock, and no file is opened in a way that
// could wait.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "backends/posix/system_info.hpp"
#include "core/config_keys.hpp"
#include "doctor.hpp"
#include "ledger/ledger_file.hpp"
#include "platform/proc_stat.hpp"
#include "residency/config.hpp"
#include "residency/shared_budget.hpp"
#include "residency/text.hpp"

#if defined(__linux__)
#include <dirent.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#endif

namespace residency::tool::doctor {

#if defined(__linux__)

namespace {

constexpr std::uint64_t kUnlimited = UINT64_MAX;
constexpr int kCapIpcLock = 14;  // linux/capability.h

// How RLIMIT_MEMLOCK is raised: the library's words (posix::kMemlockFix), and for a user who logs in.
std::string memlock_fix(const Subject& s) {
  return std::string(posix::kMemlockFix) +
         "; for a user who logs in, `USER - memlock unlimited` in /etc/security/limits.d/residency.conf (then log in "
         "again)" +
         (s.kind == Subject::Kind::process ? "; then restart the program" : "");
}

// The 14th bit of CapEff in /proc/PID/status (or /proc/self/status).
bool has_cap_ipc_lock(const std::string& proc) {
  std::ifstream f(proc + "/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("CapEff:", 0) == 0) return (std::strtoull(line.c_str() + 7, nullptr, 16) >> kCapIpcLock) & 1U;
  return false;
}

struct Memlock {
  std::uint64_t soft = kUnlimited, hard = kUnlimited;
  bool known = false;
};
Memlock memlock_of(const Subject& s) {
  Memlock m;
  if (s.kind != Subject::Kind::process) {
    rlimit rl{};
    if (::getrlimit(RLIMIT_MEMLOCK, &rl) == 0) {
      m.soft = rl.rlim_cur == RLIM_INFINITY ? kUnlimited : rl.rlim_cur;
      m.hard = rl.rlim_max == RLIM_INFINITY ? kUnlimited : rl.rlim_max;
      m.known = true;
    }
    return m;
  }
  // "Max locked memory         8388608              8388608              bytes"
  std::ifstream f("/proc/" + std::to_string(s.pid) + "/limits");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind("Max locked memory", 0) != 0) continue;
    std::istringstream in(line.substr(17));
    std::string soft, hard;
    in >> soft >> hard;
    auto value = [](const std::string& v) {
      return v == "unlimited" ? kUnlimited : std::strtoull(v.c_str(), nullptr, 10);
    };
    m.soft = value(soft);
    m.hard = value(hard);
    m.known = !soft.empty() && !hard.empty();
  }
  return m;
}

std::string limit_text(std::uint64_t v) { return v == kUnlimited ? std::string("unlimited") : format_size(v); }

// The model file a command names: -m FILE, --model FILE, --model=FILE (llama.cpp's programs).
std::string model_argument(const std::vector<std::string>& argv) {
  for (std::size_t i = 1; i < argv.size(); ++i) {
    if ((argv[i] == "-m" || argv[i] == "--model") && i + 1 < argv.size()) return argv[i + 1];
    if (argv[i].rfind("--model=", 0) == 0) return argv[i].substr(8);
  }
  return {};
}

// /proc/driver/nvidia/gpus/*/information: "Model: ...", "GPU UUID: ...", one GPU per directory.
struct GpuSeen {
  std::string bus, model, uuid;
};
std::vector<GpuSeen> nvidia_gpus(bool& driver) {
  std::vector<GpuSeen> out;
  DIR* d = ::opendir("/proc/driver/nvidia/gpus");
  driver = d != nullptr;
  if (d == nullptr) return out;
  while (const dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    GpuSeen g;
    g.bus = e->d_name;
    std::ifstream info(std::string("/proc/driver/nvidia/gpus/") + e->d_name + "/information");
    for (std::string line; std::getline(info, line);) {
      const auto colon = line.find(':');
      if (colon == std::string::npos) continue;
      const std::string key = line.substr(0, colon);
      const auto start = line.find_first_not_of(" \t", colon + 1);
      const std::string value = start == std::string::npos ? std::string() : line.substr(start);
      if (key == "Model") g.model = value;
      if (key == "GPU UUID") g.uuid = value;
    }
    out.push_back(g);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end(), [](const GpuSeen& a, const GpuSeen& b) { return a.bus < b.bus; });
  return out;
}

void worst(Check& c, Verdict v) {
  if (static_cast<int>(v) > static_cast<int>(c.verdict)) c.verdict = v;
}

}  // namespace

// --- the configuration ------------------------------------------------------------------------

Check check_configuration(const Subject& s) {
  Check c;
  c.name = "configuration";
  if (!s.env_error.empty()) {
    c.verdict = Verdict::warn;
    c.text = "unknown: its environment cannot be read (" + printable(s.env_error, 300) + ")";
    return c;
  }
  std::set<std::string> known;
  for (const auto& k : core::config_keys()) known.insert(k.variable);
  std::string set, unknown;
  nlohmann::json vars = nlohmann::json::object();
  for (const auto& [k, v] : s.env) {
    if (k.rfind("RESIDENCY_", 0) != 0) continue;
    vars[printable(k)] = printable(v, 400);
    if (known.count(k) != 0) {
      set += (set.empty() ? "" : ", ") + printable(k) + "=" + printable(v);
      continue;
    }
    // Said as a likely typo when it matches a known name without its underscores and case.
    auto squash = [](const std::string& n) {
      std::string out;
      for (char ch : n)
        if (ch != '_') out += static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
      return out;
    };
    std::string meant;
    for (const auto& n : known)
      if (squash(n) == squash(k)) meant = n;
    unknown += (unknown.empty() ? "" : "; ") + printable(k) + " is not a residency variable, and is not read" +
               (meant.empty() ? std::string() : " (" + meant + " is)");
  }
  c.details["variables"] = vars;
  const auto config = Config::from_env(s.lookup());
  if (!config) {
    std::string lines;
    std::istringstream in(config.message());
    for (std::string line; std::getline(in, line);)
      if (!line.empty()) lines += (lines.empty() ? "" : "; ") + line;
    c.verdict = Verdict::fail;
    c.text = lines + " (with a bad value the preload runs the program without residency)";
    c.fix = "give it one of the values the line names (README, \"Configuration\")" +
            std::string(s.kind == Subject::Kind::process ? ", then restart the program" : "");
    if (!unknown.empty()) c.text += "; " + unknown;
    return c;
  }
  c.text = (set.empty() ? std::string("no RESIDENCY_* variable set: the defaults") : set) + "; keep-alive " +
           config->keep_alive.to_string();
  for (const auto& note : config->notes) c.text += "; " + note;
  if (!unknown.empty()) {
    c.verdict = Verdict::warn;
    c.text += "; " + unknown;
    c.fix = "spell it as the README's configuration table does";
  }
  return c;
}

// --- the memlock limit -------------------------------------------------------------------------

Check check_memlock(const Subject& s) {
  Check c;
  c.name = "memlock";
  const Memlock m = memlock_of(s);
  const bool cap = has_cap_ipc_lock(s.kind == Subject::Kind::process ? "/proc/" + std::to_string(s.pid) : "/proc/self");
  // What the model needs: what its host managers registered, else the GGUF files it maps or names.
  std::uint64_t need = 0;
  std::string from, model_problem;
  for (const auto* mgr : live_managers(s))
    if (state_field(*mgr, "backend") != "cuda")
      need += std::strtoull(state_field(*mgr, "tracked_bytes").c_str(), nullptr, 10);
  if (need > 0) {
    from = "what its residency managers registered";
  } else if (s.kind == Subject::Kind::process) {
    std::set<std::string> seen;
    for (const auto& f : s.files) {
      struct stat st {};
      if (f.size() > 5 && f.compare(f.size() - 5, 5, ".gguf") == 0 && seen.insert(f).second && ::stat(f.c_str(), &st) == 0) {
        need += static_cast<std::uint64_t>(st.st_size);
        from += (from.empty() ? "its GGUF files: " : ", ") + printable(base_name(f));
      }
    }
  } else if (const std::string model = model_argument(s.argv); !model.empty()) {
    struct stat st {};
    if (::stat(model.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
      need = static_cast<std::uint64_t>(st.st_size);
      from = "the size of " + printable(model, 300);
    } else {
      model_problem = "; its model " + printable(model, 300) + " cannot be read (" +
                      (::stat(model.c_str(), &st) == 0 ? std::string("not a regular file") : std::strerror(errno)) + ")";
    }
  }
  c.details = {{"soft", m.soft == kUnlimited ? nlohmann::json(nullptr) : nlohmann::json(m.soft)},
               {"hard", m.hard == kUnlimited ? nlohmann::json(nullptr) : nlohmann::json(m.hard)},
               {"cap_ipc_lock", cap},
               {"needed", need > 0 ? nlohmann::json(need) : nlohmann::json(nullptr)}};
  const std::string limits = "RLIMIT_MEMLOCK " + limit_text(m.soft) + " (hard " + limit_text(m.hard) + ")";
  if (!m.known) {
    c.verdict = Verdict::warn;
    c.text = "RLIMIT_MEMLOCK unknown (/proc/" + std::to_string(s.pid) + "/limits is not readable)";
  } else if (cap) {
    c.text = "CAP_IPC_LOCK: locking is not held to " + limits;
  } else if (m.soft == kUnlimited) {
    c.text = limits;
  } else if (need > m.soft) {
    c.verdict = Verdict::fail;
    c.text = limits + " and no CAP_IPC_LOCK, below the " + format_size(need) + " the model needs (" + from +
             "): " + format_size(need - m.soft) + " of it cannot be locked";
    c.fix = memlock_fix(s);
  } else if (need > 0) {
    c.text = limits + ", enough for the " + format_size(need) + " the model needs (" + from + ")";
  } else {
    c.verdict = Verdict::warn;
    c.text = limits + " and no CAP_IPC_LOCK: a model larger than " + limit_text(m.soft) +
             " is locked only in part (no model known here to compare" +
             (s.kind == Subject::Kind::process ? std::string(")") : std::string(": give the command's -m FILE)")) +
             model_problem;
    c.fix = memlock_fix(s);
  }
  if (c.verdict != Verdict::warn && !model_problem.empty()) c.text += model_problem;
  return c;
}

// --- the budgets -------------------------------------------------------------------------------

Check check_budgets(const Subject& s) {
  Check c;
  c.name = "budgets";
  if (!s.env_error.empty()) {
    c.verdict = Verdict::warn;
    c.text = "unknown: its environment cannot be read (" + printable(s.env_error, 300) + ")";
    return c;
  }
  // The two budget variables alone, read as Config::from_env reads them (a bad keep-alive does not
  // hide them).
  const auto budgets = Config::from_env([&s](const char* name) -> const char* {
    const std::string n = name;
    return n == "RESIDENCY_SHARED_BUDGET" || n == "RESIDENCY_GPU_BUDGET" ? s.getenv(name) : nullptr;
  });
  if (!budgets) {
    c.verdict = Verdict::warn;
    c.text = "unknown: a budget's value is bad (the configuration line names it)";
    return c;
  }
  if (!budgets->shared_budget && !budgets->gpu_budget) {
    c.text = "none (RESIDENCY_SHARED_BUDGET and RESIDENCY_GPU_BUDGET are not set)";
    return c;
  }
  const std::vector<SharedBudgetInfo> ledgers = list_shared_budgets();  // read without their lock
  std::set<std::string> joined;                                         // what its managers say they hold a share of
  for (const auto* m : live_managers(s))
    if (const std::string b = state_field(*m, "shared_budget"); !b.empty()) joined.insert(b);
  nlohmann::json details = nlohmann::json::array();
  std::vector<std::string> texts, fixes;
  auto describe = [&](const SharedBudgetInfo& e, const std::string& asked) {
    details.push_back({{"name", printable(e.name)},
                       {"path", printable(e.path, 400)},
                       {"error", e.error.empty() ? nlohmann::json(nullptr) : nlohmann::json(printable(e.error, 400))},
                       {"size", e.size},
                       {"used", e.used},
                       {"holders", e.holders.size()}});
    if (!e.error.empty()) {
      worst(c, Verdict::fail);
      texts.push_back(printable(e.name) + ": " + printable(e.error, 400));
      fixes.push_back("remove " + printable(e.path, 400) + " once no process holds it");
      return;
    }
    std::string t = printable(e.name) + ": " + format_size(e.size) + ", used " + format_size(e.used) + " by " +
                    std::to_string(e.holders.size()) + " holder(s)";
    std::size_t dead = 0;
    const SharedBudgetHolder* mine = nullptr;
    for (const auto& h : e.holders) {
      dead += h.alive ? 0 : 1;
      if (s.kind == Subject::Kind::process && h.pid == s.pid && h.alive) mine = &h;
    }
    if (mine != nullptr) t += "; this process holds " + format_size(mine->bytes);
    if (dead > 0)
      t += "; " + std::to_string(dead) + " dead holder(s), reclaimed by the next process that takes its lock";
    if (e.used >= e.size) t += "; full";
    if (s.kind == Subject::Kind::process && mine == nullptr && joined.count(e.name) != 0) {
      worst(c, Verdict::warn);
      t += "; the process is not among its holders (the ledger it joined was removed, and this is a new one)";
      fixes.push_back("give its user RemoveIPC=no (systemd-logind), then restart it");
    }
    if (!asked.empty()) t += asked;
    texts.push_back(t);
  };
  if (budgets->shared_budget) {
    const SharedBudget& b = *budgets->shared_budget;
    const auto e = std::find_if(ledgers.begin(), ledgers.end(),
                                [&](const SharedBudgetInfo& x) { return x.name == b.name; });
    const std::string path = std::string(ledger::kDir) + "/" + ledger::kPrefix + b.name;
    struct stat st {};
    if (e != ledgers.end()) {
      std::string asked;
      if (s.kind != Subject::Kind::process && !b.size.is_percent && e->error.empty() && b.size.bytes != e->size) {
        worst(c, Verdict::warn);
        asked = "; this asks for " + format_size(b.size.bytes) + ": the ledger's size stays (the first process set it)";
        fixes.push_back("name the size the ledger has, or another budget");
      }
      describe(*e, asked);
    } else if (::lstat(path.c_str(), &st) == 0) {
      worst(c, Verdict::fail);
      char mode[8];
      std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
      texts.push_back(printable(b.name) + ": " + printable(path, 400) + " exists but this user cannot read it (uid " +
                      std::to_string(st.st_uid) + ", mode " + mode + "): a process of this user cannot join it");
      fixes.push_back(
          "name another budget, or have its owner's processes name a group (NAME:SIZE:GROUP) this user is in");
    } else if (s.kind == Subject::Kind::process && joined.count(b.name) != 0) {
      worst(c, Verdict::fail);
      texts.push_back(
          printable(b.name) + ": its ledger " + printable(path, 400) +
          " is gone (removed while held: RemoveIPC=yes, a cleanup): its managers wire nothing more under it");
      fixes.push_back("give its user RemoveIPC=no (systemd-logind), then restart it");
    } else if (s.kind == Subject::Kind::process) {
      worst(c, Verdict::warn);
      texts.push_back(printable(b.name) +
                      ": no ledger: the process has not joined it (it joins when its residency "
                      "manager starts)");
    } else {
      texts.push_back(printable(b.name) + ": no ledger yet: the first process makes it, " + b.size.to_string());
    }
  }
  if (budgets->gpu_budget) {
    const SharedBudget& g = *budgets->gpu_budget;
    const std::string prefix = g.name + ".GPU-";
    bool any = false;
    for (const auto& e : ledgers)
      if (e.name.rfind(prefix, 0) == 0) {
        any = true;
        describe(e, "");
      }
    bool driver = false;
    if (!any && nvidia_gpus(driver).empty()) {
      worst(c, Verdict::warn);
      texts.push_back(printable(g.name) + " (GPU): set, but this machine shows no NVIDIA GPU: it budgets nothing");
    } else if (!any) {
      texts.push_back(printable(g.name) + " (GPU): no ledger yet: one per GPU, made by the first process on it, " +
                      g.size.to_string());
    }
  }
  c.details = {{"ledgers", details}};
  for (const auto& t : texts) c.text += (c.text.empty() ? "" : "; ") + t;
  if (!fixes.empty()) c.fix = fixes.front();
  return c;
}

// --- the GPUs --------------------------------------------------------------------------------

Check check_gpus(const Subject& s) {
  Check c;
  c.name = "GPUs";
  bool driver = false;
  const auto gpus = nvidia_gpus(driver);
  nlohmann::json list = nlohmann::json::array();
  for (const auto& g : gpus)
    list.push_back({{"bus", g.bus}, {"model", printable(g.model)}, {"uuid", printable(g.uuid)}});
  c.details = {{"nvidia", list}};
  const bool cuda_loaded = !first_of(s.files, "libggml-cuda").empty();
  if (gpus.empty()) {
    c.text = driver
                 ? "none (the NVIDIA driver lists no GPU in /proc/driver/nvidia/gpus)"
                 : "none (no NVIDIA driver here: /proc/driver/nvidia/gpus does not exist): residency holds host memory";
    if (cuda_loaded) {
      c.verdict = Verdict::warn;
      c.text += "; but llama.cpp's CUDA backend (libggml-cuda) is loaded";
    }
    return c;
  }
  for (const auto& g : gpus)
    c.text += (c.text.empty() ? "" : ", ") + printable(g.model.empty() ? std::string("GPU") : g.model) + " (" +
              printable(g.uuid.empty() ? g.bus : g.uuid) + ")";
  c.text = std::to_string(gpus.size()) + " NVIDIA GPU(s): " + c.text;
  if (const char* v = s.getenv("CUDA_VISIBLE_DEVICES")) c.text += "; CUDA_VISIBLE_DEVICES=" + printable(v);
  if (s.kind != Subject::Kind::process) {
    if (cuda_loaded) c.text += "; the program loads llama.cpp's CUDA backend";
    return c;
  }
  std::size_t device_managers = 0;
  for (const auto* m : live_managers(s)) device_managers += state_field(*m, "backend") == "cuda" ? 1 : 0;
  if (device_managers > 0) {
    c.text += "; its GPU memory has " + std::to_string(device_managers) + " residency manager(s)";
  } else if (cuda_loaded && !first_of(s.files, "libresidency_preload").empty()) {
    c.verdict = Verdict::warn;
    c.text +=
        "; llama.cpp's CUDA backend is loaded but no residency manager holds GPU memory (a preload built "
        "without the cuda backend, or nothing allocated on a GPU yet: -ngl 0)";
  }
  return c;
}

// --- the state directory -------------------------------------------------------------------------

Check check_state_directory(const Subject&) {
  Check c;
  c.name = "state directory";
  const std::string dir = core::kStateDir;
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    c.verdict = Verdict::fail;
    c.text = dir +
             (::stat(dir.c_str(), &st) != 0 ? std::string(" does not exist (") + std::strerror(errno) + ")"
                                            : std::string(" is not a directory")) +
             ": no state file for doctor, stat and ps, no shared budget";
    c.fix = "mount a tmpfs there (mode 1777), as every Linux distribution does";
    return c;
  }
  char mode[8];
  std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
  struct statvfs vfs {};
  const std::uint64_t free_bytes = ::statvfs(dir.c_str(), &vfs) == 0
                                       ? static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize
                                       : 0;
  c.text = dir + ": mode " + mode + ", " + format_size(free_bytes) + " free";
  c.details = {{"path", dir}, {"mode", st.st_mode & 07777}, {"free", free_bytes}};
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    c.verdict = Verdict::fail;
    c.text += "; this user cannot create files in it (" + std::string(std::strerror(errno)) + ")";
    c.fix = "make it writable for every user with the sticky bit (mode 1777)";
    return c;
  }
  if (free_bytes < (std::uint64_t{1} << 20)) {
    c.verdict = Verdict::fail;
    c.text += ": full, no state file or ledger can be written";
    c.fix = "free space in " + dir;
    return c;
  }
  // The names only (no file is opened): state files whose process is gone, and their temporary
  // files; ledgers that are not ledgers are the listing's (it opens nothing that could block).
  std::map<unsigned, std::set<int>> dead;  // uid in the name -> dead pids
  std::size_t live_files = 0, stale_files = 0;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name.rfind(".", 0) == 0 && name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0)
        name = name.substr(1, name.size() - 5);  // .residency-state.U.P.N.tmp: a writer that died mid-write
      if (name.rfind(core::kStatePrefix, 0) != 0) continue;
      unsigned uid = 0, n = 0;
      int pid = 0;
      char tail = 0;
      if (std::sscanf(name.c_str() + std::strlen(core::kStatePrefix), "%u.%d.%u%c", &uid, &pid, &n, &tail) != 3 || pid <= 0)
        continue;
      if (const auto ps = platform::read_proc_stat(pid); ps && !ps->gone()) {
        ++live_files;
      } else {
        ++stale_files;
        dead[uid].insert(pid);
      }
    }
    ::closedir(d);
  }
  c.text += "; " + std::to_string(live_files) + " state file(s) of running processes";
  std::vector<std::string> bad_ledgers;
  for (const auto& b : list_shared_budgets())
    if (!b.error.empty()) bad_ledgers.push_back(printable(b.name) + ": " + printable(b.error, 300));
  nlohmann::json stale = nlohmann::json::array();
  for (const auto& [uid, pids] : dead)
    for (int p : pids) stale.push_back({{"uid", uid}, {"pid", p}});
  c.details["stale"] = stale;
  c.details["unreadable_ledgers"] = bad_ledgers;
  if (stale_files > 0) {
    c.verdict = Verdict::warn;
    std::string pids;
    std::size_t shown = 0;
    for (const auto& [uid, ps] : dead)
      for (int p : ps)
        if (shown++ < 5) pids += (pids.empty() ? "" : ", ") + std::to_string(p);
    if (shown > 5) pids += ", ...";
    c.text += "; " + std::to_string(stale_files) + " stale state file(s) of processes that are gone (pids " + pids + ")";
    c.fix = "remove them (`rm -f " + dir + "/" + core::kStatePrefix + "*." + (shown == 1 ? pids : std::string("PID")) +
            ".*`" + (shown == 1 ? "" : " for each pid") +
            "), or leave them to the next residency manager of their user, which removes its user's";
  }
  if (!bad_ledgers.empty()) {
    c.verdict = Verdict::warn;
    std::string t;
    for (const auto& b : bad_ledgers) t += (t.empty() ? "" : "; ") + b;
    c.text += "; " + t;
    if (c.fix.empty()) c.fix = "remove what is not a ledger once no process holds it";
  }
  return c;
}

#endif  // __linux__ (elsewhere doctor is refused: doctor.cpp)

}  // namespace residency::tool::doctor
