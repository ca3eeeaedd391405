// residency posix backend: machine-level figures (see system_info.hpp) and the public
// read_posix_system_info() behind `residency stat`.
#include "backends/posix/system_info.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>

#include "backends/posix/proc_info.hpp"
#include "residency/backends/posix.hpp"
#include "residency/config.hpp"

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

std::string default_pressure_file() {
  // A cgroup's memory.pressure exists only in cgroup v2, and means something only where the
  // memory controller is: with cgroup v1's memory controller, the system's PSI it is.
  if (auto cg = find_memory_cgroup(); cg && cg->version == 2 && cg->cgroup_path != "/") {
    std::string path = cg->dir + "/memory.pressure";
    if (read_pressure(path).available) return path;
  }
  return "/proc/pressure/memory";
}

}  // namespace posix

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
      info.cgroup_memory_max = posix::memory_cgroup_limit(*cg);
    }
  } else {
    info.problems.push_back("memory cgroup: " + cg.message());
  }
  return info;
}

}  // namespace residency
