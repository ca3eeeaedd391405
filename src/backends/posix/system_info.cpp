// SPDX-License-Identifier: MIT
// residency posix backend: machine-level figures (see system_info.hpp) and the public
// read_posix_system_info() behind `residency stat`.
#include "backends/posix/system_info.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

#include "backends/posix/proc_info.hpp"
#include "residency/backends/posix.hpp"
#include "residency/config.hpp"
#include "residency/text.hpp"

namespace residency {
namespace posix {
namespace {

std::uint64_t rlim_bytes(rlim_t v) {
  return v == RLIM_INFINITY ? MemlockLimit::kUnlimited : static_cast<std::uint64_t>(v);
}

std::uint64_t page_size() {
  const long ps = ::sysconf(_SC_PAGESIZE);
  return ps > 0 ? static_cast<std::uint64_t>(ps) : 4096;  // 4 KiB: the POSIX minimum
}

std::uint64_t sysconf_physical() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  return pages > 0 ? static_cast<std::uint64_t>(pages) * page_size() : 0;
}

}  // namespace

MemlockLimit read_memlock_limit() {
  MemlockLimit lim;
  rlimit rl{};
  if (::getrlimit(RLIMIT_MEMLOCK, &rl) == 0) {
    lim.soft = rlim_bytes(rl.rlim_cur);
    lim.hard = rlim_bytes(rl.rlim_max);
  }
  if (auto st = read_proc_status(); st && st->cap_eff) lim.cap_ipc_lock = has_cap_ipc_lock(*st->cap_eff);
  return lim;
}

std::string format_limit(std::uint64_t bytes) {
  return bytes == MemlockLimit::kUnlimited ? std::string("unlimited") : format_size(bytes);
}

bool raise_memlock_soft_limit() {
  rlimit rl{};
  if (::getrlimit(RLIMIT_MEMLOCK, &rl) != 0) return false;
  if (rl.rlim_cur == rl.rlim_max) return true;
  rl.rlim_cur = rl.rlim_max;
  return ::setrlimit(RLIMIT_MEMLOCK, &rl) == 0;
}

MemoryFigures read_memory_figures() {
  MemoryFigures f;
  if (auto mi = read_meminfo()) {
    f.physical = mi->mem_total;
    f.available = mi->mem_available.value_or(0);
  } else {
    f.physical = sysconf_physical();
  }
  if (auto st = read_proc_status(); st && st->vm_lck) f.vm_lck = *st->vm_lck;
  f.limit_base = f.physical;
  if (auto cg = find_memory_cgroup()) {
    if (auto max = memory_cgroup_limit(*cg); max && *max > 0)
      f.limit_base = f.limit_base == 0 ? *max : std::min(f.limit_base, *max);
  }
  return f;
}

}  // namespace posix

namespace {
bool ends_with(std::string_view s, std::string_view tail) {
  return s.size() >= tail.size() && s.substr(s.size() - tail.size()) == tail;
}
std::string parent_dir(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}
std::string seconds_text(Nanos d) {
  const double s = std::chrono::duration<double>(d).count();
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g s", s);
  return buf;
}
// A source of `kind` on `path`, or, when `why_not` is set, none with that reason.
PressureSource source_or_why_not(PressureSource::Kind kind, const std::string& path, std::string scope,
                                 std::string reason, std::optional<std::string> why_not) {
  PressureSource src;
  if (why_not) {
    src.reason = std::move(*why_not);
    return src;
  }
  src.kind = kind;
  src.path = path;
  src.scope = std::move(scope);
  src.reason = std::move(reason);
  return src;
}
PressureSource psi_source(const std::string& path, std::string scope, std::string reason) {
  auto info = posix::read_pressure(path);
  return source_or_why_not(PressureSource::Kind::psi, path, std::move(scope), std::move(reason),
                           info.available ? std::nullopt : std::optional<std::string>(std::move(info.reason)));
}
// A cgroup v1 memory.pressure_level this process may register on: the file readable and the
// cgroup.event_control beside it writable. Empty reason = usable.
std::string v1_level_unusable(const std::string& level_file) {
  if (::access(level_file.c_str(), R_OK) != 0) return "cannot read " + level_file + ": " + std::strerror(errno);
  const std::string ctl = parent_dir(level_file) + "/cgroup.event_control";
  if (::access(ctl.c_str(), W_OK) != 0)
    return "cannot write " + ctl + " (needed to register for " + level_file + "): " + std::strerror(errno);
  return {};
}
PressureSource v1_source(const std::string& level_file, std::string scope, std::string reason) {
  std::string why = v1_level_unusable(level_file);
  return source_or_why_not(PressureSource::Kind::cgroup_v1_level, level_file, std::move(scope), std::move(reason),
                           why.empty() ? std::nullopt : std::optional<std::string>(std::move(why)));
}
}  // namespace

std::string PressureSource::describe(const PosixOptions& options) const {
  switch (kind) {
    case Kind::none: return "none (" + reason + ")";
    case Kind::psi:
      return "PSI some " +
             std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(options.pressure_stall).count()) +
             " ms in " + seconds_text(options.pressure_window) + " on " + path + " (" + scope + ")";
    case Kind::cgroup_v1_level:
      return std::string("cgroup v1 memory.pressure_level '") + kCgroupV1PressureLevel + "' (" + scope + ", " + path +
             "), at most one event per " + seconds_text(options.pressure_window);
  }
  return "?";
}

PressureSource posix_pressure_source(const std::string& override_file) {
  if (!override_file.empty()) {
    if (ends_with(override_file, "/memory.pressure_level") || override_file == "memory.pressure_level")
      return v1_source(override_file, "cgroup v1 " + parent_dir(override_file), "as configured");
    return psi_source(override_file, override_file == "/proc/pressure/memory" ? "system" : parent_dir(override_file),
                      "as configured");
  }
  std::string closer;  // why the process's own cgroup is not watched, when it is not the root
  bool v1_root = false;
  if (auto cg = posix::find_memory_cgroup()) {
    if (cg->cgroup_path != "/") {
      if (cg->version == 2) {
        auto src = psi_source(cg->dir + "/memory.pressure", "cgroup v2 " + cg->cgroup_path,
                              "this process's memory cgroup");
        if (src.kind != PressureSource::Kind::none) return src;
        closer = src.reason;
      } else {
        // cgroup v1 has no per-cgroup PSI: its kernel source is vmpressure's memory.pressure_level.
        auto src = v1_source(cg->dir + "/memory.pressure_level", "cgroup v1 " + cg->cgroup_path,
                             "this process's memory cgroup (cgroup v1: PSI exists only system-wide)");
        if (src.kind != PressureSource::Kind::none) return src;
        closer = src.reason;
      }
    } else {
      v1_root = cg->version == 1;
      closer = "the process is in the root memory cgroup";
    }
  } else {
    closer = cg.message();
  }
  auto sys = psi_source("/proc/pressure/memory", "system-wide", closer);
  if (sys.kind != PressureSource::Kind::none) return sys;
  if (v1_root) {
    if (auto cg = posix::find_memory_cgroup()) {
      auto src = v1_source(cg->dir + "/memory.pressure_level", "cgroup v1 root", "no PSI: " + sys.reason);
      if (src.kind != PressureSource::Kind::none) return src;
    }
  }
  PressureSource none;
  none.reason = sys.reason + (closer.empty() ? "" : "; " + closer);
  return none;
}

std::uint64_t posix_recommended_working_set(std::uint64_t physical, double pct) {
  if (!(pct > 0)) return 0;
  if (pct >= 100) return physical;
  return static_cast<std::uint64_t>(std::floor(static_cast<double>(physical) * (pct / 100.0)));
}

PosixSystemInfo read_posix_system_info() {
  PosixSystemInfo info;
  info.page_size = posix::page_size();
  if (auto mi = posix::read_meminfo()) {
    info.mem_total = mi->mem_total;
    info.mem_available = mi->mem_available;
    info.mlocked = mi->mlocked;
    if (!mi->mem_available) info.problems.push_back("/proc/meminfo has no MemAvailable (Linux < 3.14)");
    if (!mi->mlocked) info.problems.push_back("/proc/meminfo has no Mlocked line");
  } else {
    info.problems.push_back(mi.message());
    if (auto phys = posix::sysconf_physical(); phys > 0) info.mem_total = phys;
  }
  if (auto st = posix::read_proc_status()) {
    info.vm_lck = st->vm_lck;
    if (!st->vm_lck) info.problems.push_back("/proc/self/status has no VmLck line");
    if (st->cap_eff) {
      info.cap_ipc_lock = posix::has_cap_ipc_lock(*st->cap_eff);
    } else {
      info.problems.push_back("/proc/self/status has no CapEff line; CAP_IPC_LOCK assumed absent");
    }
  } else {
    info.problems.push_back(st.message());
  }
  const auto lim = posix::read_memlock_limit();
  info.memlock_soft = lim.soft;
  info.memlock_hard = lim.hard;

  info.system_pressure = posix::read_pressure("/proc/pressure/memory");
  if (auto cg = posix::find_memory_cgroup()) {
    info.cgroup_path = cg->cgroup_path;
    info.cgroup_version = cg->version;
    if (cg->cgroup_path != "/") {
      if (cg->version == 2) info.cgroup_pressure = posix::read_pressure(cg->dir + "/memory.pressure");
      if (auto max = posix::read_memory_cgroup_limit(*cg)) {
        info.cgroup_memory_max = *max;
      } else {
        info.cgroup_memory_max_unknown = max.status().code() == ErrorCode::not_found ? "missing" : "unreadable";
        info.problems.push_back("memory cgroup limit: " + max.message());
      }
    }
  } else {
    info.problems.push_back("memory cgroup: " + cg.message());
  }
  info.pressure_watch = posix_pressure_source();
  return info;
}

}  // namespace residency
