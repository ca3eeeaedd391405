// SPDX-License-Identifier: MIT
// residency stat: what this machine holds resident, and what limits apply to what it starts.
//
// The first thing to run when memory does not stay resident: how much RAM there is and is
// available, how much is locked system-wide, the RLIMIT_MEMLOCK that caps mlock for a process
// started from here (and whether CAP_IPC_LOCK lifts it), the PSI memory pressure lines, and the
// backends this build has. Not this process's own VmLck: stat locks nothing, so it would always
// read 0 and be taken for someone else's (--pid PID reports another process). Human text by
// default; --json gives the raw byte values.
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "command.hpp"
#include "json_text.hpp"
#include "residency/backends.hpp"
#include "residency/config.hpp"
#include "residency/shared_budget.hpp"
#include "residency/text.hpp"
#include "stat_pid.hpp"

#if RESIDENCY_TOOL_HAVE_METAL  // macOS with the metal backend: stat_apple.cpp
#include "stat_apple.hpp"
#elif defined(__unix__) || defined(__APPLE__)
#define RESIDENCY_STAT_POSIX 1
#include "residency/backends/posix.hpp"
#endif

namespace residency::tool {
namespace {

// The backends of this build that start on this machine, and why the others do not.
struct BackendsHere {
  std::vector<std::string> working;
  std::vector<std::pair<std::string, std::string>> not_here;  // name, reason (first line)
};
BackendsHere backends_here() {
  BackendsHere b;
  for (const auto& n : available_backends()) {
    auto made = make_backend(n);
    if (made) {
      b.working.push_back(n);
    } else {
      std::string why = made.message();
      b.not_here.emplace_back(n, why.substr(0, why.find('\n')));
    }
  }
  return b;
}

// The backends that start here, for the `backends` line; those that do not go on lines of
// their own, each with its reason.
std::string backends_text(const BackendsHere& b) {
  std::string s;
  for (const auto& n : b.working) s += (s.empty() ? "" : ", ") + n;
  return s.empty() ? std::string("none") : s;
}

// "cuda: libcuda.so.1 not found ...": the reason, named once.
[[maybe_unused]] std::string named_reason(const std::string& name, const std::string& why) {
  return why.rfind(name + ":", 0) == 0 ? why : name + ": " + why;
}

nlohmann::json backends_json(const BackendsHere& b) {
  nlohmann::json na = nlohmann::json::object();
  for (const auto& [n, why] : b.not_here) na[n] = why;
  return na;
}

using Row = std::pair<std::string, std::string>;

// The cgroup limit that could not be read: never shown as "none", which would read as "no limit".
std::string limit_unknown_text(const PosixSystemInfo& info) {
  return info.cgroup_memory_max_unknown + " (the limit is unknown, not absent; see the note)";
}

// The machine-wide budgets (RESIDENCY_SHARED_BUDGET) this user can read: the library reads the
// ledgers; here they are only formatted.
[[maybe_unused]] std::string idle_text(const std::optional<Nanos>& idle) {
  if (!idle) return "never used";
  char buf[48];
  std::snprintf(buf, sizeof buf, "idle %.1f s", std::chrono::duration<double>(*idle).count());
  return buf;
}

[[maybe_unused]] void shared_budget_rows(std::vector<Row>& rows, const std::vector<SharedBudgetInfo>& budgets) {
  if (budgets.empty()) {
    rows.emplace_back("shared budgets", "none (RESIDENCY_SHARED_BUDGET=NAME:SIZE makes one)");
    return;
  }
  const char* label = "shared budgets";
  // Names, paths and errors come from file names in /dev/shm, which any user can choose: printed
  // through printable() (no escape sequence or newline of theirs reaches the terminal).
  for (const auto& b : budgets) {
    if (!b.error.empty()) {
      rows.emplace_back(label, printable(b.name) + ": unreadable: " + printable(b.error, 400));
      label = "";
      continue;
    }
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", b.mode);
    rows.emplace_back(label, printable(b.name) + ": " + format_size(b.size) + ", used " + format_size(b.used) + ", " +
                                 std::to_string(b.holders.size()) + " holder(s)  (" + printable(b.path, 400) +
                                 ", mode " + mode + ")");
    label = "";
    for (const auto& h : b.holders) {
      // The holder's own account (its state file): program, awake or asleep, switches, pinned bytes.
      const HolderFacts f = h.alive ? holder_facts(h.pid, b.name) : HolderFacts{};
      std::string own;
      if (!f.state.empty()) {
        own = ", " + f.state;
        if (!f.switches.empty())
          own += ", " + printable(f.switches) + (f.state == "awake" || f.state == "asleep" ? " wake(s)" : " re-wire(s)");
        if (!f.last_switch_ms.empty()) own += " (last " + printable(f.last_switch_ms) + " ms)";
        if (!f.pinned_host_bytes.empty())
          own += ", pinned host " + format_size(std::strtoull(f.pinned_host_bytes.c_str(), nullptr, 10));
        if (!f.registered_file_bytes.empty())
          own += ", model files registered " + format_size(std::strtoull(f.registered_file_bytes.c_str(), nullptr, 10));
      }
      rows.emplace_back("",
                        "  pid " + std::to_string(h.pid) +
                            (f.program.empty() ? "" : " (" + printable(f.program) + ")") + ": " + format_size(h.bytes) +
                            (h.unmanaged != 0 ? " (" + format_size(h.unmanaged) + " of it the GPU context)" : "") +
                            own + ", " + idle_text(h.idle) + ", priority " + std::to_string(h.priority) +
                            (h.asked ? ", asked to give back" : "") + (h.waiting ? ", waiting its turn for room" : "") +
                            (h.alive ? "" : "  DEAD: its share is reclaimed by the next process that takes the lock"));
    }
  }
}

[[maybe_unused]] nlohmann::json shared_budgets_json(const std::vector<SharedBudgetInfo>& budgets) {
  nlohmann::json a = nlohmann::json::array();
  for (const auto& b : budgets) {
    // printable(): a file name need not be UTF-8, which JSON strings must be.
    nlohmann::json j = {{"name", printable(b.name)}, {"path", printable(b.path, 400)}};
    if (!b.error.empty()) {
      j["error"] = printable(b.error, 400);
      a.push_back(j);
      continue;
    }
    j["size"] = b.size;
    j["used"] = b.used;
    j["mode"] = b.mode;
    nlohmann::json hs = nlohmann::json::array();
    for (const auto& h : b.holders) {
      const HolderFacts f = h.alive ? holder_facts(h.pid, b.name) : HolderFacts{};
      const auto opt_num = [](const std::string& v) {
        return v.empty() ? nlohmann::json(nullptr) : nlohmann::json(std::strtod(v.c_str(), nullptr));
      };
      hs.push_back(
          {{"pid", h.pid},
           {"program", printable(f.program)},
           {"state", f.state.empty() ? nlohmann::json(nullptr) : nlohmann::json(f.state)},
           {"switches", opt_num(f.switches)},
           {"last_switch_ms", opt_num(f.last_switch_ms)},
           {"pinned_host_bytes", opt_num(f.pinned_host_bytes)},
           {"registered_file_bytes", opt_num(f.registered_file_bytes)},
           {"bytes", h.bytes},
           {"unmanaged_bytes", h.unmanaged},
           {"idle_s", h.idle ? nlohmann::json(std::chrono::duration<double>(*h.idle).count()) : nlohmann::json(nullptr)},
           {"priority", h.priority},
           {"alive", h.alive},
           {"asked", h.asked},
           {"waiting", h.waiting}});
    }
    j["holders"] = hs;
    a.push_back(j);
  }
  return a;
}

#if RESIDENCY_TOOL_HAVE_METAL
int run_stat(bool json) {
  const BackendsHere here = backends_here();
  return run_stat_apple(json, backends_text(here),
                        {{"backends", here.working}, {"backends_not_here", backends_json(here)}});
}
#elif RESIDENCY_STAT_POSIX

std::string size_or_unknown(const std::optional<std::uint64_t>& v) {
  return v ? format_size(*v) : std::string("unknown");
}

std::string limit_text(std::uint64_t v) {
  return v == PosixSystemInfo::kUnlimited ? std::string("unlimited") : format_size(v);
}

nlohmann::json bytes_or_null(const std::optional<std::uint64_t>& v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}

nlohmann::json limit_json(std::uint64_t v) {
  return v == PosixSystemInfo::kUnlimited ? nlohmann::json(nullptr) : nlohmann::json(v);
}

nlohmann::json reading_json(const std::optional<PressureReading>& r) {
  if (!r) return nullptr;
  return {{"avg10", r->avg10}, {"avg60", r->avg60}, {"avg300", r->avg300}, {"total_us", r->total_us}};
}

nlohmann::json pressure_json(const PressureInfo& p) {
  nlohmann::json j = {{"path", p.path}, {"available", p.available}};
  if (p.available) {
    j["some"] = reading_json(p.some);
    j["full"] = reading_json(p.full);
  } else {
    j["reason"] = p.reason;
  }
  return j;
}

void pressure_rows(std::vector<Row>& rows, const std::string& label, const PressureInfo& p) {
  if (!p.available) {
    rows.emplace_back(label, "unavailable: " + p.reason);
    return;
  }
  rows.emplace_back(label, p.some_line + "  (" + p.path + ")");
  if (!p.full_line.empty()) rows.emplace_back("", p.full_line);
}

nlohmann::json pressure_source_json(const PressureSource& src) {
  const char* kind = src.kind == PressureSource::Kind::psi               ? "psi"
                     : src.kind == PressureSource::Kind::cgroup_v1_level ? "cgroup_v1_pressure_level"
                                                                         : "none";
  nlohmann::json j = {{"kind", kind}, {"description", src.describe()}, {"reason", src.reason}};
  j["path"] = src.path.empty() ? nlohmann::json(nullptr) : nlohmann::json(src.path);
  j["scope"] = src.scope.empty() ? nlohmann::json(nullptr) : nlohmann::json(src.scope);
  if (src.kind == PressureSource::Kind::cgroup_v1_level) j["level"] = kCgroupV1PressureLevel;
  return j;
}

int run_stat(bool json) {
  const PosixSystemInfo info = read_posix_system_info();
  const BackendsHere here = backends_here();
  const auto& backends = here.working;
  const std::uint64_t base = info.mem_total ? *info.mem_total : 0;
  const std::uint64_t limit_base = info.cgroup_memory_max && *info.cgroup_memory_max < base ? *info.cgroup_memory_max
                                                                                            : base;
  const std::uint64_t recommended = posix_recommended_working_set(limit_base);

  if (json) {
    nlohmann::json j;
    j["page_size"] = info.page_size;
    j["mem_total"] = bytes_or_null(info.mem_total);
    j["mem_available"] = bytes_or_null(info.mem_available);
    j["mlocked"] = bytes_or_null(info.mlocked);
    // No vm_lck: it would be this stat process's own, which locks nothing (see the file's top).
    j["rlimit_memlock"] = {{"soft", limit_json(info.memlock_soft)},
                           {"hard", limit_json(info.memlock_hard)},
                           {"soft_unlimited", info.memlock_soft == PosixSystemInfo::kUnlimited},
                           {"hard_unlimited", info.memlock_hard == PosixSystemInfo::kUnlimited}};
    j["cap_ipc_lock"] = info.cap_ipc_lock;
    j["recommended_working_set"] = recommended;
    j["cgroup"] = {{"path", info.cgroup_path.empty() ? nlohmann::json(nullptr) : nlohmann::json(info.cgroup_path)},
                   {"version", info.cgroup_version == 0 ? nlohmann::json(nullptr) : nlohmann::json(info.cgroup_version)},
                   {"memory_max", bytes_or_null(info.cgroup_memory_max)},
                   {"memory_max_unknown", info.cgroup_memory_max_unknown.empty()
                                              ? nlohmann::json(nullptr)
                                              : nlohmann::json(info.cgroup_memory_max_unknown)}};
    j["psi_memory"] = pressure_json(info.system_pressure);
    j["psi_memory_cgroup"] = info.cgroup_pressure ? pressure_json(*info.cgroup_pressure) : nlohmann::json(nullptr);
    j["pressure_watch"] = pressure_source_json(info.pressure_watch);
    j["backends"] = backends;  // those that start here
    j["backends_not_here"] = backends_json(here);
    j["shared_budgets"] = shared_budgets_json(list_shared_budgets());
    j["problems"] = info.problems;
    std::printf("%s\n", json_text(j).c_str());
    return kExitOk;
  }

  std::vector<Row> rows;
  rows.reserve(16);  // also keeps GCC 12 at -O3 from a false -Warray-bounds on the first emplace
  rows.emplace_back("MemTotal", size_or_unknown(info.mem_total));
  rows.emplace_back("MemAvailable", size_or_unknown(info.mem_available));
  rows.emplace_back("Mlocked (system)", size_or_unknown(info.mlocked));
  // No VmLck line: it would be this stat process's own, always 0 (see the file's top).
  rows.emplace_back("RLIMIT_MEMLOCK", "soft " + limit_text(info.memlock_soft) + ", hard " + limit_text(info.memlock_hard));
  if (info.cap_ipc_lock) {
    rows.emplace_back("CAP_IPC_LOCK", "yes (mlock is not held to RLIMIT_MEMLOCK)");
  } else if (info.memlock_soft == PosixSystemInfo::kUnlimited) {
    rows.emplace_back("CAP_IPC_LOCK", "no (RLIMIT_MEMLOCK is unlimited: not needed)");
  } else {
    rows.emplace_back("CAP_IPC_LOCK",
                      "no (mlock is held to " + limit_text(info.memlock_soft) + "; raise it with `ulimit -l`)");
  }
  rows.emplace_back("recommended working set",
                    base ? format_size(recommended) + " (posix: 75 % of " +
                               (limit_base < base ? std::string("cgroup memory.max") : std::string("MemTotal")) + ")"
                         : std::string("unknown"));
  if (!info.cgroup_path.empty()) {
    const bool v1 = info.cgroup_version == 1;
    rows.emplace_back(v1 ? "cgroup (v1 memory)" : "cgroup (v2)",
                      info.cgroup_path + (v1 ? ", memory.limit_in_bytes " : ", memory.max ") +
                          (info.cgroup_memory_max                   ? format_size(*info.cgroup_memory_max)
                           : info.cgroup_memory_max_unknown.empty() ? std::string("none (no limit)")
                                                                    : limit_unknown_text(info)));
  }
  pressure_rows(rows, "PSI memory", info.system_pressure);
  if (info.cgroup_pressure) pressure_rows(rows, "PSI memory (cgroup)", *info.cgroup_pressure);
  rows.emplace_back("pressure watch",
                    info.pressure_watch.describe() +
                        (info.pressure_watch.reason.empty() || info.pressure_watch.kind == PressureSource::Kind::none
                             ? std::string()
                             : "; " + info.pressure_watch.reason));
  rows.emplace_back("backends", backends_text(here));
  for (const auto& [n, why] : here.not_here) rows.emplace_back("not here", named_reason(n, why));
  shared_budget_rows(rows, list_shared_budgets());
  for (const auto& p : info.problems) rows.emplace_back("note", p);

  std::size_t width = 0;
  for (const auto& [k, v] : rows) width = std::max(width, k.size());
  for (const auto& [k, v] : rows) std::printf("%-*s  %s\n", static_cast<int>(width), k.c_str(), v.c_str());
  return kExitOk;
}
#else
int run_stat(bool json) {
  const BackendsHere here = backends_here();
  if (json) {
    std::printf("%s\n", json_text(nlohmann::json({{"backends", here.working},
                                                  {"backends_not_here", backends_json(here)},
                                                  {"shared_budgets", shared_budgets_json(list_shared_budgets())}}))
                            .c_str());
  } else {
    std::vector<Row> rows = {{"backends", backends_text(here)}};
    for (const auto& [n, why] : here.not_here) rows.emplace_back("not here", named_reason(n, why));
    shared_budget_rows(rows, list_shared_budgets());
    for (const auto& [k, v] : rows) std::printf("%-14s  %s\n", k.c_str(), v.c_str());
  }
  return kExitOk;
}
#endif

const Command stat_command{
    "stat",
    "what this machine holds resident and what a process started here may lock (memory, locks, limits, pressure)",
    [](CLI::App& app) {
      auto json = std::make_shared<bool>(false);
      auto pid = std::make_shared<int>(0);  // 0: not given (the option takes 1 and above)
      app.add_flag("--json", *json, "print JSON with raw byte values");
      add_whole_number(app, "--pid", *pid, 1, 4194304,
                       "report on that process instead: what it holds locked and resident, its residency "
                       "managers' state, what it holds on its GPUs",
                       "a process id, 1 to 4194304");
      return [json, pid] { return *pid ? run_stat_pid(*pid, *json) : run_stat(*json); };
    }};

}  // namespace
}  // namespace residency::tool
