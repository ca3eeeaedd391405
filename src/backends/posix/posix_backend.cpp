// SPDX-License-Identifier: MIT
// residency posix backend: sets of host ranges made resident with mlock (see
// include/residency/backends/posix.hpp for why, and lock_table.hpp for the per-page counts).
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/syscall.h>
#endif

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <map>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backends/posix/lock_table.hpp"
#include "backends/posix/pressure_watch.hpp"
#include "backends/posix/proc_info.hpp"
#include "backends/posix/system_info.hpp"
#include "platform/thread_annotations.hpp"
#include "residency/backends/posix.hpp"
#include "residency/config.hpp"
#include "residency/text.hpp"

namespace residency {
namespace {

using posix::AddrRange;

// CAP_SYS_RESOURCE (linux/capability.h): lets a process register PSI triggers with any window.
constexpr unsigned kCapSysResource = 24;

std::string errno_name(int err) {
  switch (err) {
    case ENOMEM: return "ENOMEM";
    case EPERM: return "EPERM";
    case EAGAIN: return "EAGAIN";
    case EINVAL: return "EINVAL";
    default: return "errno " + std::to_string(err);
  }
}

// mlock / munlock as system calls. AddressSanitizer (and the other sanitizers sharing its
// interceptors) replaces the libc functions with ones that do nothing and return 0, because
// mlockall would lock its terabytes of shadow memory; calling the kernel directly keeps the
// backend doing what it says under every sanitizer the tests run with.
int sys_mlock(std::uintptr_t addr, std::size_t len) {
#if defined(__linux__) && defined(SYS_mlock)
  return static_cast<int>(::syscall(SYS_mlock, addr, len));
#else
  return ::mlock(reinterpret_cast<void*>(addr), len);
#endif
}
int sys_munlock(std::uintptr_t addr, std::size_t len) {
#if defined(__linux__) && defined(SYS_munlock)
  return static_cast<int>(::syscall(SYS_munlock, addr, len));
#else
  return ::munlock(reinterpret_cast<void*>(addr), len);
#endif
}

std::string hex_addr(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%" PRIxPTR, reinterpret_cast<std::uintptr_t>(p));
  return buf;
}

std::string describe_region(const RegionDesc& r) {
  return "region " + std::to_string(r.id) + " (" + format_size(r.size) + " at " + hex_addr(r.base) + ")";
}

// The kernel keeps one lock state per page for the whole process, and one RLIMIT_MEMLOCK. So
// their mirror is process-wide too: every PosixBackend of the process (and every manager using
// one) counts its holds in the same table and reserves from the same limit, and a page that two
// managers lock stays locked until both have let it go.
struct ProcessLocks {
  Mutex mu;  // taken after a backend's own mutex, never before
  posix::LockTable table RESIDENCY_GUARDED_BY(mu);
  std::uint64_t reserved RESIDENCY_GUARDED_BY(mu) = 0;  // bytes the managers of this process reserved for wiring
};
ProcessLocks& process_locks() {
  static ProcessLocks* locks = new ProcessLocks;  // never destroyed: backends may outlive statics
  return *locks;
}

class PosixBackend final : public Backend {
 public:
  explicit PosixBackend(PosixOptions options) : options_(std::move(options)) {
    const long ps = ::sysconf(_SC_PAGESIZE);
    page_ = ps > 0 ? static_cast<std::uintptr_t>(ps) : 4096;  // 4 KiB: the POSIX minimum
  }

  ~PosixBackend() override {
    watch_.stop();
    MutexLock lock(mu_);
    for (auto& [id, set] : sets_) end_locked(set);
  }

  Capabilities capabilities() const override {
    Capabilities c;
    c.name = "posix";
    c.needs_refresh = false;     // mlock holds until munlock: nothing decays
    c.max_sets = 0;              // a set is our own bookkeeping: no system limit on their number
    c.wire_granularity = page_;  // mlock locks whole pages: two pages for a region that straddles one
    // munlock only makes pages evictable again; it cannot drop a caller's data. Discarding a
    // KV cache would mean MADV_DONTNEED / MADV_FREE on memory the engine owns and may still
    // read (zeroed anonymous pages, or nothing at all for a shared file mapping), which is the
    // engine's decision to make, not the residency layer's. So every class is kept as weights.
    // Host memory is the engine's (malloc, mmap of the model file): allocate() is unsupported.
    return c;
  }

  // MemAvailable, and the headroom of this process's memory cgroup and those above it: the least.
  std::optional<std::uint64_t> memory_available() override {
    std::optional<std::uint64_t> avail;
    if (auto mi = posix::read_meminfo(); mi && mi->mem_available) avail = *mi->mem_available;
    if (auto cg = posix::find_memory_cgroup()) {
      if (auto h = posix::memory_cgroup_headroom(*cg)) avail = avail ? std::min(*avail, *h) : *h;
    }
    return avail;
  }

  MemoryInfo memory_info() override {
    MemoryInfo mi;
    const auto sys = posix::read_memory_figures();
    mi.physical = sys.physical;
    mi.recommended_working_set = posix_recommended_working_set(sys.limit_base, options_.recommended_pct);
    const auto lim = posix::read_memlock_limit();
    mi.hard_limit = lim.enforced() ? lim.soft : 0;
    mi.hard_limit_name = "RLIMIT_MEMLOCK";
    mi.hard_limit_fix = posix::kMemlockFix;
    return mi;
  }

  Status create_set(SetId set, std::uint64_t /*capacity_bytes*/) override {
    MutexLock lock(mu_);
    if (sets_.count(set) != 0) {
      return Status(ErrorCode::invalid_argument, "posix: set " + std::to_string(set) + " already exists");
    }
    sets_.emplace(set, Set{});
    return Status::ok();
  }

  Status reserve_wired(std::uint64_t bytes) override {
    const auto lim = posix::read_memlock_limit();
    ProcessLocks& pl = process_locks();
    MutexLock lock(pl.mu);
    if (lim.enforced() && (bytes > lim.soft || pl.reserved > lim.soft - bytes)) {
      return Status(ErrorCode::limit_exceeded, "RLIMIT_MEMLOCK is " + format_size(lim.soft) +
                                                   " and the managers of this process already reserved " +
                                                   format_size(pl.reserved) + " of it; wiring " + format_size(bytes) +
                                                   " more needs " + posix::kMemlockFix);
    }
    pl.reserved += bytes;
    return Status::ok();
  }

  void unreserve_wired(std::uint64_t bytes) override {
    ProcessLocks& pl = process_locks();
    MutexLock lock(pl.mu);
    pl.reserved -= std::min(pl.reserved, bytes);
  }

  Status destroy_set(SetId set) override {
    MutexLock lock(mu_);
    auto it = sets_.find(set);
    if (it == sets_.end()) return Status::ok();
    end_locked(it->second);
    sets_.erase(it);
    staged_.erase(set);
    return Status::ok();
  }

  // Staged; a set that does not exist makes commit() report it.
  void add_region(SetId set, const RegionDesc& region) override {
    MutexLock lock(mu_);
    staged_[set].push_back({true, region});
  }
  void remove_region(SetId set, RegionId region) override {
    MutexLock lock(mu_);
    RegionDesc d;
    d.id = region;
    staged_[set].push_back({false, d});
  }

  SetOutcome commit(SetId set) override {
    MutexLock lock(mu_);
    auto staged_it = staged_.find(set);
    std::vector<Change> changes;
    if (staged_it != staged_.end()) {
      changes = std::move(staged_it->second);
      staged_.erase(staged_it);
    }
    auto it = sets_.find(set);
    if (it == sets_.end()) {
      return {Status(ErrorCode::not_found,
                     "posix: commit of set " + std::to_string(set) + ", which does not exist (create_set first)"),
              {}};
    }
    Set& s = it->second;
    // Final membership after the staged changes, in order (an add then a remove of the same
    // region cancel out).
    std::map<RegionId, std::optional<RegionDesc>> final_state;
    for (auto& c : changes) final_state[c.region.id] = c.add ? std::optional<RegionDesc>(c.region) : std::nullopt;

    // Removals first: their pages may make room under RLIMIT_MEMLOCK for the additions.
    std::vector<RegionDesc> added;
    for (auto& [id, desc] : final_state) {
      auto m = s.members.find(id);
      const bool replace = m != s.members.end() && desc &&
                           (m->second.desc.base != desc->base || m->second.desc.size != desc->size);
      if (m != s.members.end() && (!desc || replace)) {
        if (m->second.locked) unlock_member(m->second);
        s.members.erase(m);
      }
      if (desc && s.members.count(id) == 0) added.push_back(*desc);
    }
    Failures failures;
    for (auto& d : added) {
      Member mem{d, false};
      if (s.requested) {
        Status st = lock_member(mem);
        if (!st) failures.add(d.id, std::move(st));
      }
      s.members.emplace(d.id, std::move(mem));
    }
    return failures.outcome();
  }

  SetOutcome request_residency(SetId set) override {
    MutexLock lock(mu_);
    auto it = sets_.find(set);
    if (it == sets_.end()) {
      return {Status(ErrorCode::not_found,
                     "posix: residency requested for set " + std::to_string(set) + ", which does not exist"),
              {}};
    }
    Set& s = it->second;
    s.requested = true;
    Failures failures;
    for (auto& [id, m] : s.members) {
      if (m.locked) continue;  // locked pages cannot have been evicted: nothing to re-wire
      Status st = lock_member(m);
      if (!st) failures.add(id, std::move(st));
    }
    return failures.outcome();
  }

  Status end_residency(SetId set) override {
    MutexLock lock(mu_);
    auto it = sets_.find(set);
    if (it == sets_.end())
      return Status(ErrorCode::not_found,
                    "posix: end_residency of set " + std::to_string(set) + ", which does not exist");
    end_locked(it->second);
    return Status::ok();
  }

  // One pressure watch for the whole backend; each manager adds a watcher to it.
  Result<PressureWatchId> watch_pressure(std::function<void()> on_pressure) override {
    MutexLock lock(watch_mu_);
    if (no_watchers()) {
      if (Status s = start_watch(); !s) return s;
    }
    MutexLock g(watchers_mu_);
    const PressureWatchId id = next_watch_id_++;
    watchers_.emplace(id, std::move(on_pressure));
    return id;
  }

  void stop_pressure_watch(PressureWatchId id) override {
    MutexLock lock(watch_mu_);
    bool last = false;
    {
      MutexLock g(watchers_mu_);  // waits for a callback in flight
      if (watchers_.erase(id) == 0) return;
      last = watchers_.empty();
    }
    if (last) watch_.stop();
  }

  std::string pressure_source() const override {
    MutexLock lock(watch_mu_);
    return watch_.running() ? watching_ : std::string();
  }

 private:
  // watchers_ changes only with watch_mu_ and watchers_mu_ both held, so watch_mu_ alone is enough
  // to read it (and watchers_mu_ is not taken here, so a callback in flight is not waited for);
  // the analysis knows one guard per member.
  bool no_watchers() const RESIDENCY_REQUIRES(watch_mu_) RESIDENCY_NO_THREAD_SAFETY_ANALYSIS {
    return watchers_.empty();
  }

  Status start_watch() RESIDENCY_REQUIRES(watch_mu_) {
    const PressureSource src = posix_pressure_source(options_.pressure_file);
    Status st;
    if (src.kind == PressureSource::Kind::none) {
      return Status(ErrorCode::unsupported, "memory pressure cannot be watched: " + src.reason);
    }
    auto notify = [this] {
      MutexLock g(watchers_mu_);
      for (auto& [id, cb] : watchers_) cb();
    };
    if (src.kind == PressureSource::Kind::cgroup_v1_level) {
      st = watch_.start_cgroup_v1(src.path, kCgroupV1PressureLevel, options_.pressure_window, notify);
    } else {
      bool privileged = false;
      if (auto ps = posix::read_proc_status(); ps && ps->cap_eff) {
        privileged = ((*ps->cap_eff >> kCapSysResource) & 1U) != 0;
      }
      auto trigger = posix::make_psi_trigger(options_.pressure_stall, options_.pressure_window, privileged);
      if (!trigger) return Status(trigger.status().code(), "memory pressure cannot be watched: " + trigger.message());
      st = watch_.start(src.path, *trigger, notify);
    }
    if (!st) return Status(st.code(), "memory pressure cannot be watched: " + st.message());
    watching_ = src.describe(options_) + (src.reason.empty() ? "" : "; " + src.reason);
    return Status::ok();
  }

  struct Change {
    bool add;
    RegionDesc region;
  };
  struct Member {
    RegionDesc desc;
    bool locked = false;  // this member holds its pages in the lock table
  };
  struct Set {
    std::map<RegionId, Member> members;  // committed membership
    bool requested = false;              // residency requested and not ended
  };

  // The first failure's Status names the cause; the rest are counted.
  struct Failures {
    Status first;
    std::vector<RegionId> ids;
    void add(RegionId id, Status st) {
      if (ids.empty()) first = std::move(st);
      ids.push_back(id);
    }
    SetOutcome outcome() {
      SetOutcome o;
      if (ids.size() > 1) {
        first = Status(first.code(), first.message() + " (" + std::to_string(ids.size() - 1) +
                                         " more region(s) of this set were not made resident either)");
      }
      o.status = std::move(first);
      o.failed = std::move(ids);
      return o;
    }
  };

  AddrRange page_range(const RegionDesc& r) const {
    const auto b = reinterpret_cast<std::uintptr_t>(r.base);
    return {b & ~(page_ - 1), (b + r.size + page_ - 1) & ~(page_ - 1)};
  }

  // mlock-s the pages of `m` that no other member holds. On failure nothing of `m` stays
  // locked or counted and the Status says why and what to do.
  Status lock_member(Member& m) RESIDENCY_REQUIRES(mu_) {
    const auto& d = m.desc;
    const auto b = reinterpret_cast<std::uintptr_t>(d.base);
    if (d.base == nullptr || d.size == 0 || b + d.size < b || b + d.size > UINTPTR_MAX - page_) {
      return Status(ErrorCode::invalid_argument,
                    "posix: " + describe_region(d) + " is not a valid host range (null, empty or wrapping around)");
    }
    const AddrRange range = page_range(d);
    ProcessLocks& pl = process_locks();
    MutexLock lock(pl.mu);
    const auto fresh = pl.table.acquire(range);
    std::uint64_t fresh_bytes = 0;
    for (const auto& f : fresh) fresh_bytes += f.size();
    for (const auto& f : fresh) {
      if (sys_mlock(f.begin, f.size()) != 0) {
        const int err = errno;
        for (const auto& u : pl.table.release(range)) sys_munlock(u.begin, u.size());
        return mlock_failure(err, d, fresh_bytes);
      }
    }
    m.locked = true;
    return Status::ok();
  }

  // munlock-s the pages of `m` that no other holder (member, set, manager) still wants. munlock
  // fails only for a range that is no longer mapped (the engine unmapped it before unregistering
  // it), whose pages are then locked by nobody: a release here cannot fail.
  void unlock_member(Member& m) RESIDENCY_REQUIRES(mu_) {
    ProcessLocks& pl = process_locks();
    MutexLock lock(pl.mu);
    for (const auto& u : pl.table.release(page_range(m.desc))) sys_munlock(u.begin, u.size());
    m.locked = false;
  }

  void end_locked(Set& s) RESIDENCY_REQUIRES(mu_) {
    for (auto& [id, m] : s.members) {
      if (m.locked) unlock_member(m);
    }
    s.requested = false;
  }

  Status mlock_failure(int err, const RegionDesc& d, std::uint64_t bytes) const {
    const auto lim = posix::read_memlock_limit();
    const auto status = posix::read_proc_status();
    const std::uint64_t locked = status && status->vm_lck ? *status->vm_lck : 0;
    std::string head = "posix: mlock of " + describe_region(d) + " failed with " + errno_name(err) + " (" +
                       std::strerror(err) + "): ";
    const std::string tail = "; it stays tracked but not resident (its pages may be evicted under pressure).";
    if ((err == ENOMEM || err == EPERM) && lim.enforced() && (err == EPERM || locked + bytes > lim.soft)) {
      return Status(err == EPERM ? ErrorCode::permission_denied : ErrorCode::limit_exceeded,
                    head + "RLIMIT_MEMLOCK = " + std::to_string(lim.soft) + " bytes (" + format_size(lim.soft) +
                        ", hard " + posix::format_limit(lim.hard) + ") and this process already locks " +
                        format_size(locked) + ", without CAP_IPC_LOCK" + tail + " Fix: " + posix::kMemlockFix);
    }
    if (err == ENOMEM) {
      return Status(ErrorCode::invalid_argument,
                    head +
                        "part of the range is not mapped in this process, or the number of memory "
                        "mappings reached vm.max_map_count (mlock splits mappings)" +
                        tail);
    }
    if (err == EAGAIN) {
      return Status(ErrorCode::out_of_memory,
                    head +
                        "some pages could not be locked now (the kernel is short of memory or the "
                        "pages are being migrated)" +
                        tail);
    }
    return Status(ErrorCode::backend_error, head + "unexpected error" + tail);
  }

  PosixOptions options_;
  std::uintptr_t page_ = 4096;

  mutable Mutex mu_;  // guards sets_ and staged_; held across mlock/munlock calls
  std::map<SetId, Set> sets_ RESIDENCY_GUARDED_BY(mu_);
  std::unordered_map<SetId, std::vector<Change>> staged_ RESIDENCY_GUARDED_BY(mu_);  // add/remove since the last commit

  mutable Mutex watch_mu_;  // serialises watch_pressure / stop_pressure_watch
  posix::PressureWatch watch_ RESIDENCY_GUARDED_BY(watch_mu_);
  std::string watching_ RESIDENCY_GUARDED_BY(watch_mu_);  // the source's description, while watch_ runs
  Mutex watchers_mu_;                                     // guards watchers_; held while they are called
  std::map<PressureWatchId, std::function<void()>> watchers_ RESIDENCY_GUARDED_BY(watchers_mu_);
  PressureWatchId next_watch_id_ RESIDENCY_GUARDED_BY(watchers_mu_) = 1;
};

}  // namespace

Result<std::shared_ptr<Backend>> make_posix_backend(const PosixOptions& options) {
  if (!(options.recommended_pct > 0 && options.recommended_pct <= 100)) {
    return Status(ErrorCode::invalid_argument, "posix: recommended_pct = " + std::to_string(options.recommended_pct) +
                                                   "; accepted: a percent of physical memory in (0, 100], e.g. 75");
  }
  // The PSI range rules are checked now, so that a bad option fails early; the 2 s rule
  // depends on the privileges the process has when it starts watching, so it is checked then.
  if (auto trig = posix::make_psi_trigger(options.pressure_stall, options.pressure_window, /*privileged=*/true); !trig) {
    return Status(trig.status().code(), "posix: " + trig.message());
  }
  if (options.raise_memlock_soft_limit) posix::raise_memlock_soft_limit();
  return std::shared_ptr<Backend>(std::make_shared<PosixBackend>(options));
}

}  // namespace residency
