// SPDX-License-Identifier: MIT
// residency ps: every process on this machine that a residency manager runs in, one line each (the
// counterpart of `ollama ps`). Found from the managers' state files (/dev/shm/residency-state.*,
// core/state_file.hpp) and the shared budgets' ledgers (a holder of another user, whose state file
// this user may not read, still shows with its budget and bytes).
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "command.hpp"
#include "json_text.hpp"
#include "residency/config.hpp"
#include "residency/shared_budget.hpp"
#include "residency/text.hpp"
#include "stat_pid.hpp"

#if defined(__linux__)
#include <dirent.h>
#include <unistd.h>

#include "core/state_file.hpp"
#endif

namespace residency::tool {
namespace {

#if defined(__linux__)

struct Managed {
  int pid = 0;
  std::string program;
  std::vector<std::string> models;                           // GGUF files it maps (or names on its command line)
  std::vector<std::map<std::string, std::string>> managers;  // its state files' fields
  std::optional<std::uint64_t> host_locked;                  // VmLck
  std::uint64_t gpu_awake = 0;                               // wired bytes of its GPU managers
  std::string state, releases;
  std::set<std::string> budgets;
  bool readable = true;  // its state files could be read (same user, or root)
};

std::string field(const std::map<std::string, std::string>& f, const char* k) {
  const auto it = f.find(k);
  return it == f.end() ? std::string() : it->second;
}

std::uint64_t number(const std::map<std::string, std::string>& f, const char* k) {
  return std::strtoull(field(f, k).c_str(), nullptr, 10);
}

// The pids of every state file in kStateDir, with the uid its name carries.
std::map<int, unsigned> state_file_pids() {
  std::map<int, unsigned> out;
  DIR* d = ::opendir(core::kStateDir);
  if (d == nullptr) return out;
  const std::string prefix = core::kStatePrefix;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.rfind(prefix, 0) != 0) continue;
    unsigned uid = 0;
    int pid = 0;
    unsigned n = 0;
    char tail = 0;
    if (std::sscanf(name.c_str() + prefix.size(), "%u.%d.%u%c", &uid, &pid, &n, &tail) == 3 && pid > 0) out[pid] = uid;
  }
  ::closedir(d);
  return out;
}

// The GGUF files a process maps, else those its command line names.
std::vector<std::string> models_of(int pid) {
  std::set<std::string> seen;
  std::vector<std::string> out;
  auto take = [&](const std::string& path) {
    if (path.size() > 5 && path.compare(path.size() - 5, 5, ".gguf") == 0 && seen.insert(path).second)
      out.push_back(path);
  };
  std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
  std::string line;
  while (std::getline(maps, line))
    if (const auto slash = line.find('/'); slash != std::string::npos) take(line.substr(slash));
  if (!out.empty()) return out;
  std::ifstream cmdline("/proc/" + std::to_string(pid) + "/cmdline", std::ios::binary);
  while (std::getline(cmdline, line, '\0')) take(line);
  return out;
}

// When the process's memory goes back, from its managers and, for a holder of a shared budget,
// the ledger's idle time (the only place a last use is published).
std::string releases_of(const Managed& m, const std::vector<SharedBudgetInfo>& budgets) {
  std::string out;
  for (const auto& f : m.managers) {
    std::string what;
    const std::string ka_text = field(f, "keep_alive");
    if (field(f, "resident") != "1") {
      what = "released";
    } else if (ka_text == "forever") {
      what = "never (keep-alive forever)";
    } else if (ka_text == "0") {
      what = "after each call (keep-alive 0)";
    } else if (ka_text == "off") {
      what = "not managed (keep-alive off)";
    } else {
      std::string compact;
      for (char c : ka_text)
        if (c != ' ') compact += c;
      const auto ka = parse_keep_alive(compact);
      std::optional<std::chrono::nanoseconds> idle;
      for (const auto& b : budgets)
        if (b.name == field(f, "shared_budget"))
          for (const auto& h : b.holders)
            if (h.pid == m.pid) idle = h.idle;
      if (ka && ka->kind == KeepAlive::Kind::duration && idle) {
        const auto left = ka->duration - *idle;
        what = left.count() <= 0 ? "now (keep-alive " + ka_text + " expired)"
                                 : "in " + std::to_string((left.count() + 999'999'999) / 1'000'000'000) + " s";
      } else {
        what = ka_text + " after the last request (its last use is published only under a shared budget)";
      }
    }
    if (out.find(what) == std::string::npos) out += (out.empty() ? "" : "; ") + what;
  }
  return out;
}

std::vector<Managed> find_managed() {
  const auto budgets = list_shared_budgets();
  std::map<int, unsigned> pids = state_file_pids();
  for (const auto& b : budgets)
    for (const auto& h : b.holders)
      if (h.alive && pids.count(h.pid) == 0) pids[h.pid] = ~0u;  // uid from /proc
  std::vector<Managed> out;
  for (const auto& [pid, named_uid] : pids) {
    const auto brief = proc_brief(pid);
    const auto start = core::process_start_time(pid);
    if (!brief || !start) continue;  // gone: its files are stale (stat --pid removes them)
    Managed m;
    m.pid = pid;
    m.program = brief->name;
    m.host_locked = brief->vm_lck;
    m.models = models_of(pid);
    for (const auto& s : core::read_state_files(pid, brief->uid, start)) {
      if (!s.error.empty()) m.readable = false;
      if (s.error.empty() && !s.stale) m.managers.push_back(s.fields);
    }
    std::string state;
    for (const auto& f : m.managers) {
      const bool gpu = field(f, "backend") == "cuda";
      const std::string one = (gpu ? "GPU " : "host ") + state_word(field(f, "backend"), field(f, "resident") == "1");
      if (state.find(one) == std::string::npos) state += (state.empty() ? "" : ", ") + one;
      if (gpu) m.gpu_awake += number(f, "wired_bytes");
      if (const std::string b = field(f, "shared_budget"); !b.empty()) m.budgets.insert(b);
    }
    for (const auto& b : budgets)
      for (const auto& h : b.holders)
        if (h.pid == pid) m.budgets.insert(b.name);
    if (m.managers.empty() && m.budgets.empty()) continue;
    m.state = !state.empty() ? state : (m.readable ? "no manager" : "unknown (another user's process)");
    m.releases = m.managers.empty() ? "unknown (another user's process)" : releases_of(m, budgets);
    out.push_back(std::move(m));
  }
  return out;
}

std::string base_name(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// --- the Prometheus text format (node_exporter's textfile collector, or a scrape wrapper) -----------

std::string label_value(const std::string& v) {
  std::string out;
  for (char c : printable(v, 200)) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

class Metrics {
 public:
  // One family: its HELP and TYPE lines once, then its samples.
  void family(const std::string& name, const char* type, const char* help) {
    current_ = name;
    text_ += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
  }
  void sample(const std::string& suffix, const std::vector<std::pair<std::string, std::string>>& labels, double v) {
    text_ += current_ + suffix;
    if (!labels.empty()) {
      text_ += "{";
      for (std::size_t i = 0; i < labels.size(); ++i)
        text_ += (i ? "," : "") + labels[i].first + "=\"" + label_value(labels[i].second) + "\"";
      text_ += "}";
    }
    char buf[64];
    std::snprintf(buf, sizeof buf, " %.17g\n", v);
    text_ += buf;
  }
  const std::string& text() const { return text_; }

 private:
  std::string current_, text_;
};

using Labels = std::vector<std::pair<std::string, std::string>>;

std::string prometheus_text(const std::vector<Managed>& all, const std::vector<SharedBudgetInfo>& budgets) {
  Metrics out;
  auto proc = [](const Managed& m) { return Labels{{"pid", std::to_string(m.pid)}, {"program", m.program}}; };
  auto mgr = [&](const Managed& m, const std::map<std::string, std::string>& f) {
    Labels l = proc(m);
    l.emplace_back("manager", field(f, "manager"));
    l.emplace_back("backend", field(f, "backend"));
    return l;
  };
  out.family("residency_host_locked_bytes", "gauge", "Bytes the kernel holds locked for the process (VmLck).");
  for (const auto& m : all)
    if (m.host_locked) out.sample("", proc(m), static_cast<double>(*m.host_locked));
  out.family("residency_wired_bytes", "gauge",
             "Bytes a residency manager holds wired now: locked host memory, or a GPU's memory awake (backend cuda).");
  for (const auto& m : all)
    for (const auto& f : m.managers) out.sample("", mgr(m, f), static_cast<double>(number(f, "wired_bytes")));
  out.family("residency_resident", "gauge", "1 while the manager's memory is wired (awake, on a GPU), else 0.");
  for (const auto& m : all)
    for (const auto& f : m.managers) out.sample("", mgr(m, f), field(f, "resident") == "1" ? 1 : 0);
  out.family(
      "residency_releases_total", "counter",
      "Releases (sleeps, on a GPU) by reason: keep_alive, pressure (one step each), asked (another process, or a "
      "GPU budget's debt), engine (the engine asked, or the end of a keep-alive-0 call), other (exit).");
  for (const auto& m : all)
    for (const auto& f : m.managers) {
      const std::uint64_t ka = number(f, "releases.keep_alive"), asked = number(f, "releases.asked"),
                          engine = number(f, "releases.engine"), all_releases = number(f, "releases");
      const std::uint64_t named = ka + asked + engine;
      for (const auto& [reason, v] :
           std::vector<std::pair<std::string, std::uint64_t>>{{"keep_alive", ka},
                                                              {"pressure", number(f, "releases.pressure")},
                                                              {"asked", asked},
                                                              {"engine", engine},
                                                              {"other", all_releases > named ? all_releases - named : 0}}) {
        Labels l = mgr(m, f);
        l.emplace_back("reason", reason);
        out.sample("", l, static_cast<double>(v));
      }
    }
  out.family("residency_rewire_duration_seconds", "histogram",
             "Re-wires (wakes, on a GPU) of released memory, by how long each took.");
  for (const auto& m : all)
    for (const auto& f : m.managers) {
      std::vector<std::string> counts, bounds;
      std::string item;
      std::istringstream cs(field(f, "rewire_buckets")), bs(field(f, "rewire_bucket_bounds"));
      while (std::getline(cs, item, ',')) counts.push_back(item);
      while (std::getline(bs, item, ',')) bounds.push_back(item);
      if (counts.size() != bounds.size() + 1) continue;  // a manager of an older version
      std::uint64_t cumulative = 0;
      for (std::size_t i = 0; i < counts.size(); ++i) {
        cumulative += std::strtoull(counts[i].c_str(), nullptr, 10);
        Labels l = mgr(m, f);
        l.emplace_back("le", i < bounds.size() ? bounds[i] : "+Inf");
        out.sample("_bucket", l, static_cast<double>(cumulative));
      }
      out.sample("_sum", mgr(m, f), std::strtod(field(f, "rewire_seconds_sum").c_str(), nullptr));
      out.sample("_count", mgr(m, f), static_cast<double>(cumulative));
    }
  for (const auto& [name, key, help] :
       {std::tuple{"residency_asks_sent_total", "asks_sent",
                   "Times this manager asked the holders of its shared budget to give way."},
        std::tuple{"residency_asks_received_total", "asks_received",
                   "Times another process asked this manager to give way (given or declined)."}}) {
    out.family(name, "counter", help);
    for (const auto& m : all)
      for (const auto& f : m.managers)
        if (!field(f, "shared_budget").empty()) {
          Labels l = mgr(m, f);
          l.emplace_back("budget", field(f, "shared_budget"));
          out.sample("", l, static_cast<double>(number(f, key)));
        }
  }
  out.family("residency_budget_bytes", "gauge", "A shared or GPU budget's size.");
  for (const auto& b : budgets)
    if (b.error.empty()) out.sample("", {{"budget", b.name}}, static_cast<double>(b.size));
  out.family("residency_budget_used_bytes", "gauge", "What a shared or GPU budget's holders hold, in all.");
  for (const auto& b : budgets)
    if (b.error.empty()) out.sample("", {{"budget", b.name}}, static_cast<double>(b.used));
  out.family("residency_budget_holder_bytes", "gauge", "What one holder holds of a shared or GPU budget.");
  for (const auto& b : budgets)
    for (const auto& h : b.holders)
      if (h.alive) out.sample("", {{"budget", b.name}, {"pid", std::to_string(h.pid)}}, static_cast<double>(h.bytes));
  return out.text();
}

int run_ps(bool json, bool prometheus) {
  if (prometheus) {
    std::fputs(prometheus_text(find_managed(), list_shared_budgets()).c_str(), stdout);
    return kExitOk;
  }
  const std::vector<Managed> all = find_managed();
  if (json) {
    nlohmann::json a = nlohmann::json::array();
    for (const auto& m : all) {
      nlohmann::json j{{"pid", m.pid},
                       {"program", printable(m.program)},
                       {"models", m.models},
                       {"state", m.state},
                       {"host_locked_bytes", m.host_locked ? nlohmann::json(*m.host_locked) : nlohmann::json(nullptr)},
                       {"gpu_awake_bytes", m.gpu_awake},
                       {"releases", m.releases},
                       {"budgets", m.budgets}};
      nlohmann::json ms = nlohmann::json::array();
      for (const auto& f : m.managers)
        ms.push_back({{"backend", field(f, "backend")},
                      {"keep_alive", field(f, "keep_alive")},
                      {"resident", field(f, "resident") == "1"},
                      {"wired_bytes", number(f, "wired_bytes")},
                      {"releases", number(f, "releases")},
                      {"rewires", number(f, "rewires")}});
      j["managers"] = ms;
      a.push_back(j);
    }
    std::printf("%s\n", json_text(a).c_str());
    return kExitOk;
  }
  if (all.empty()) {
    std::printf(
        "no process runs a residency manager here (none with a state file in %s or a share of a shared budget)\n",
        core::kStateDir);
    return kExitOk;
  }
  std::vector<std::vector<std::string>> rows = {
      {"PID", "PROGRAM", "MODEL", "STATE", "HOST LOCKED", "GPU AWAKE", "RELEASES", "BUDGETS"}};
  for (const auto& m : all) {
    std::string models;
    for (const auto& p : m.models) models += (models.empty() ? "" : ",") + base_name(p);
    // Every column but the numbers comes from files other users may write (a process's name, its
    // state files, ledger names in /dev/shm): through printable(), so that none of their bytes
    // drives the terminal (an escape sequence, a newline). The state is the tool's own words.
    std::string budgets;
    for (const auto& b : m.budgets) budgets += (budgets.empty() ? "" : ",") + printable(b);
    rows.push_back({std::to_string(m.pid), printable(m.program), models.empty() ? "-" : printable(models, 200), m.state,
                    m.host_locked ? format_size(*m.host_locked) : "unknown", m.gpu_awake ? format_size(m.gpu_awake) : "-",
                    printable(m.releases, 400), budgets.empty() ? "-" : budgets});
  }
  std::vector<std::size_t> width(rows.front().size(), 0);
  for (const auto& r : rows)
    for (std::size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
  for (const auto& r : rows) {
    std::string line;
    for (std::size_t i = 0; i < r.size(); ++i) {
      line += r[i];
      if (i + 1 < r.size()) line += std::string(width[i] - r[i].size() + 2, ' ');
    }
    std::printf("%s\n", line.c_str());
  }
  return kExitOk;
}

#else

int run_ps(bool, bool) { throw BadInput("ps reads /proc and /dev/shm: Linux only"); }

#endif

const Command ps_command{
    "ps",
    "every process here that a residency manager runs in: its model, state, bytes held, when it releases, its budgets",
    [](CLI::App& app) {
      auto json = std::make_shared<bool>(false);
      auto prometheus = std::make_shared<bool>(false);
      auto* j = app.add_flag("--json", *json, "print JSON with raw byte values");
      app.add_flag("--prometheus", *prometheus,
                   "print the Prometheus text format (node_exporter's textfile collector; docs/tool.md has the recipe)")
          ->excludes(j);
      return [json, prometheus] { return run_ps(*json, *prometheus); };
    }};

}  // namespace
}  // namespace residency::tool
