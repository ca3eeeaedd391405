// The residency manager: regions, sets, budget and keep-alive, over any Backend.
//
// State lives under one mutex (`mu`); the backend is only called with it held, so backends need
// no locking. touch() is the exception: it stores the time of use and reads one flag, both
// atomics, and takes the mutex only when memory must be re-wired. The release decision and
// touch() follow a store-then-load protocol on (last_use_ns, fast) with sequentially
// consistent order: either touch() sees that the memory is being released and re-wires, or
// the releasing thread sees the new use and keeps the memory. No use is ever lost.
#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <unordered_map>

#include "keep_alive_scheduler.hpp"
#include "residency/residency.hpp"
#include "set_layout.hpp"
#include "wired_budget.hpp"

namespace residency {

using core::KeepAliveScheduler;
using core::SetLayout;

void log_to_stderr(LogLevel level, std::string_view message) {
  std::fprintf(stderr, "residency: %s: %.*s\n", to_string(level), static_cast<int>(message.size()),
               message.data());
}

namespace {

constexpr double kMiB = 1024.0 * 1024.0;
// mlx-lm warns when a generation wires a model above 0.9 x the recommended working set.
constexpr double kScopeWarnFraction = 0.9;
// Default memory limit on tracked bytes (MLX): min(1.5 x recommended, 0.95 x physical).
constexpr double kMemoryLimitOfRecommended = 1.5;
constexpr double kMemoryLimitOfPhysical = 0.95;

std::string mib(std::uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(bytes) / kMiB);
  return buf;
}

std::string ms(Nanos d) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f ms", static_cast<double>(d.count()) / 1e6);
  return buf;
}

}  // namespace

struct Manager::Impl {
  struct Region {
    RegionDesc desc;
    int priority = 0;
    std::uint64_t last_use = 0;  // recency sequence
    bool admitted = false;       // in `set`
    SetId set = 0;
    bool eligible = true;  // false after the backend failed to wire it, until the limit changes
  };
  struct SetState {
    bool requested = false;  // residency requested on the backend
    bool created = false;    // exists on the backend
  };

  // Immutable after create().
  Config config;
  std::shared_ptr<Backend> backend;
  Capabilities caps;
  Clock* clock = nullptr;
  LogCallback log_cb;
  std::uint64_t recommended = 0;
  std::uint64_t physical = 0;
  std::uint64_t memory_limit = 0;  // 0 = none
  bool managing = true;            // keep_alive != off
  KeepAlive::Kind policy = KeepAlive::Kind::duration;
  Nanos keep_alive{0};

  // touch()'s hot path. On separate cache lines: every use writes last_use_ns.
  alignas(64) std::atomic<std::int64_t> last_use_ns{0};
  alignas(64) std::atomic<bool> fast{true};  // touch() has nothing more to do

  alignas(64) mutable std::mutex mu;
  // Everything below is guarded by mu.
  std::unordered_map<RegionId, Region> regions;
  std::map<std::uintptr_t, RegionId> by_address;
  std::unique_ptr<SetLayout> layout;
  std::vector<SetState> set_state;
  // Sets with staged changes, to commit at the end of the batch, with their net change in
  // bytes. Committed in order of net change, most shrinking first: resident bytes then only
  // fall, then only rise, so no moment exceeds the larger of the old and the new budget.
  std::map<SetId, std::int64_t> dirty;
  std::uint64_t wired_limit = 0;
  std::uint64_t tracked = 0;
  std::uint64_t admitted = 0;
  bool resident = false;  // residency requested (policy says the memory should be wired)
  bool ever_released = false;
  int scopes = 0;
  int batch_depth = 0;
  std::uint64_t seq = 0;
  RegionId next_id = 1;
  Nanos next_refresh{0};
  bool warned_over_recommended = false;
  bool warned_scope_size = false;
  Stats counters;
  std::unique_ptr<KeepAliveScheduler> scheduler;
  bool pressure_watch = false;
  bool prefetch_requested = false;  // prefetch(): wire on the scheduler thread

  bool logs(LogLevel level) const {
    return log_cb && static_cast<int>(level) <= static_cast<int>(config.log_level);
  }
  void log(LogLevel level, const std::string& msg) const {
    if (logs(level)) log_cb(level, msg);
  }

  SetState& state(SetId s) {
    if (s >= set_state.size()) set_state.resize(s + 1);
    return set_state[s];
  }

  // --- membership -------------------------------------------------------------------------

  // Puts a region into a set (creating the set if the layout says so). False when the backend
  // could not create the set; the region then stays pending.
  bool admit(Region& r) {
    const auto p = layout->place(r.desc.size);
    SetState& st = state(p.set);
    if (p.created || !st.created) {
      Status s = backend->create_set(p.set, layout->cap_bytes() == UINT64_MAX ? r.desc.size : layout->cap_bytes());
      if (!s) {
        layout->remove(p.set, r.desc.size);
        log(LogLevel::warn, "could not create residency set " + std::to_string(p.set) + ": " + s.message() +
                                "; the region stays tracked but unwired");
        r.eligible = false;
        return false;
      }
      st = SetState{false, true};
      log(LogLevel::debug, "created residency set " + std::to_string(p.set) + " (max_bytes_per_set = " +
                               (layout->cap_bytes() == UINT64_MAX ? std::string("unlimited") : mib(layout->cap_bytes())) + ")");
    }
    backend->add_region(p.set, r.desc);
    r.admitted = true;
    r.set = p.set;
    admitted += r.desc.size;
    dirty[p.set] += static_cast<std::int64_t>(r.desc.size);
    return true;
  }

  void evict(Region& r) {
    if (!r.admitted) return;
    const bool destroy = layout->remove(r.set, r.desc.size);
    if (destroy) {
      backend->destroy_set(r.set);
      set_state[r.set] = SetState{};
      dirty.erase(r.set);
    } else {
      backend->remove_region(r.set, r.desc.id);
      dirty[r.set] -= static_cast<std::int64_t>(r.desc.size);
    }
    admitted -= r.desc.size;
    r.admitted = false;
  }

  std::vector<core::BudgetEntry> budget_entries() const {
    std::vector<core::BudgetEntry> v;
    v.reserve(regions.size());
    for (const auto& [id, r] : regions)
      v.push_back({id, r.desc.size, r.priority, r.last_use, r.admitted, r.eligible});
    return v;
  }

  void promote() {
    if (!managing) return;
    const auto entries = budget_entries();
    for (RegionId id : core::choose_promotions(entries, admitted, wired_limit)) admit(regions.at(id));
  }

  void shrink_to_limit() {
    const auto entries = budget_entries();
    for (RegionId id : core::choose_evictions(entries, admitted, wired_limit)) evict(regions.at(id));
  }

  // Regions the backend could not wire leave their set and wait, out of the budget's way.
  void handle_outcome(const SetOutcome& out, const char* what) {
    if (out.ok()) return;
    std::uint64_t bytes = 0;
    for (RegionId id : out.failed) {
      auto it = regions.find(id);
      if (it == regions.end()) continue;
      bytes += it->second.desc.size;
      evict(it->second);
      it->second.eligible = false;
    }
    counters.wire_failures += out.failed.size();
    std::string msg = std::string(what) + " failed";
    if (!out.failed.empty())
      msg += " for " + std::to_string(out.failed.size()) + " region(s), " + mib(bytes) +
             "; they stay tracked but unwired and the process goes on";
    if (!out.status.is_ok()) msg += ": " + out.status.message();
    log(LogLevel::warn, msg);
  }

  // Commits every set touched since the last flush, once each; requests residency of sets
  // that joined while resident. Failures move regions out, which touches their sets again:
  // a second round commits those (only on failure).
  void flush() {
    if (batch_depth > 0) return;
    for (int round = 0; round < 3 && !dirty.empty(); ++round) {
      std::vector<std::pair<std::int64_t, SetId>> order;
      for (auto [s, delta] : dirty) order.emplace_back(delta, s);
      dirty.clear();
      std::sort(order.begin(), order.end());
      for (auto [delta, s] : order) {
        if (!layout->exists(s) || !state(s).created) continue;
        SetOutcome out = backend->commit(s);
        ++counters.commits;
        handle_outcome(out, "wiring newly added memory");
        if (resident && !state(s).requested && layout->set_bytes(s) > 0) {
          SetOutcome req = backend->request_residency(s);
          ++counters.residency_requests;
          state(s).requested = true;
          handle_outcome(req, "requesting residency");
        }
      }
    }
  }

  // --- residency --------------------------------------------------------------------------

  void wire(const char* why) {
    const Nanos t0 = clock->now();
    std::uint64_t bytes = 0;
    std::uint32_t n = 0;
    resident = true;
    for (SetId s : layout->live_set_ids()) {
      SetState& st = state(s);
      if (!st.created || st.requested || layout->set_bytes(s) == 0) continue;
      bytes += layout->set_bytes(s);
      ++n;
      SetOutcome out = backend->request_residency(s);
      ++counters.residency_requests;
      st.requested = true;
      handle_outcome(out, "re-wiring");
    }
    flush();
    if (policy == KeepAlive::Kind::duration || policy == KeepAlive::Kind::forever) fast.store(true);
    next_refresh = clock->now() + caps.refresh_period;
    if (ever_released) {
      const Nanos dt = clock->now() - t0;
      ++counters.rewires;
      counters.rewire_time += dt;
      log(LogLevel::info, "re-wired " + mib(bytes) + " in " + std::to_string(n) + " set(s) in " + ms(dt) +
                              " (" + why + ")");
    }
    if (scheduler) scheduler->wake_locked();
  }

  void release(const char* why) {
    const Nanos t0 = clock->now();
    std::uint64_t bytes = 0;
    std::uint32_t n = 0;
    for (SetId s : layout->live_set_ids()) {
      SetState& st = state(s);
      if (!st.requested) continue;
      backend->end_residency(s);
      st.requested = false;
      bytes += layout->set_bytes(s);
      ++n;
    }
    resident = false;
    if (n > 0) backend->after_release();
    ever_released = true;
    ++counters.releases;
    log(LogLevel::info, "released " + mib(bytes) + " in " + std::to_string(n) + " set(s) in " +
                            ms(clock->now() - t0) + " (" + why + ")");
  }

  // Releases unless a use arrives concurrently (see the protocol at the top of the file).
  // Returns false when touch() won and the memory stays.
  bool release_unless_used(std::int64_t seen_last_use, const char* why) {
    fast.store(false);
    if (last_use_ns.load() != seen_last_use) {
      fast.store(true);
      return false;
    }
    release(why);
    return true;
  }

  // The scheduler's work: expiry and refresh. Returns the next deadline.
  std::optional<Nanos> due() {
    if (prefetch_requested) {
      prefetch_requested = false;
      if (managing && !resident) wire("prefetch");
    }
    if (!managing || !resident) return std::nullopt;
    const Nanos now = clock->now();
    std::optional<Nanos> next;
    if (policy == KeepAlive::Kind::duration && scopes == 0) {
      const std::int64_t lu = last_use_ns.load();
      const Nanos expiry = Nanos(lu) + keep_alive;
      if (now >= expiry) {
        if (release_unless_used(lu, ("keep-alive " + config.keep_alive.to_string() + " expired").c_str()))
          return std::nullopt;  // nothing scheduled until the next use: zero wake-ups
        return Nanos(last_use_ns.load()) + keep_alive;
      }
      next = expiry;
    }
    if (caps.needs_refresh && caps.refresh_period.count() > 0) {
      if (now >= next_refresh) {
        for (SetId s : layout->live_set_ids()) {
          if (!state(s).requested) continue;
          SetOutcome out = backend->refresh(s);
          ++counters.residency_requests;
          handle_outcome(out, "refreshing residency");
        }
        flush();
        next_refresh = now + caps.refresh_period;
      }
      next = next ? std::min(*next, next_refresh) : next_refresh;
    }
    return next;
  }

  void note_use() { last_use_ns.store(clock->now().count()); }

  Stats stats() const {
    Stats s = counters;
    s.tracked_bytes = tracked;
    s.admitted_bytes = admitted;
    s.wired_bytes = resident ? admitted : 0;
    s.pending_bytes = tracked - admitted;
    s.wired_limit = wired_limit;
    s.regions = static_cast<std::uint32_t>(regions.size());
    s.sets = layout->live_sets();
    s.resident = resident && admitted > 0;
    s.scheduler_wakeups = scheduler ? scheduler->wakeups() : 0;
    return s;
  }

  // Opens a batch for the duration of one public call.
  struct Guard {
    Impl& impl;
    explicit Guard(Impl& i) : impl(i) { ++impl.batch_depth; }
    ~Guard() {
      if (--impl.batch_depth == 0) impl.flush();
    }
  };

  Result<RegionId> register_locked(const RegionDesc& in, int priority) {
    RegionDesc d = in;
    if (d.size == 0) return Status(ErrorCode::invalid_argument, "register_region: size is 0; a region needs at least one byte");
    if (d.base == nullptr) return Status(ErrorCode::invalid_argument, "register_region: base is null");
    const auto b = reinterpret_cast<std::uintptr_t>(d.base);
    if (b + d.size < b) return Status(ErrorCode::invalid_argument, "register_region: base + size wraps around the address space");
    auto next = by_address.lower_bound(b);
    if (next != by_address.end() && next->first < b + d.size)
      return Status(ErrorCode::invalid_argument, "register_region: [" + std::to_string(b) + ", +" + std::to_string(d.size) +
                                                     ") overlaps region " + std::to_string(next->second) + " already tracked");
    if (next != by_address.begin()) {
      auto prev = std::prev(next);
      const auto& pr = regions.at(prev->second);
      if (prev->first + pr.desc.size > b)
        return Status(ErrorCode::invalid_argument, "register_region: region overlaps region " + std::to_string(prev->second) +
                                                       " already tracked");
    }
    if (memory_limit != 0 && tracked + d.size > memory_limit)
      return Status(ErrorCode::limit_exceeded,
                    "register_region: tracking " + format_size(d.size) + " more would make " + format_size(tracked + d.size) +
                        ", above the memory limit of " + format_size(memory_limit) +
                        " (min(1.5 x recommended working set, 0.95 x physical memory)); unregister regions or set "
                        "Config::memory_limit");
    d.id = next_id++;
    Region r;
    r.desc = d;
    r.priority = priority;
    r.last_use = ++seq;
    tracked += d.size;
    by_address[b] = d.id;
    Region& rr = regions.emplace(d.id, r).first->second;

    if (logs(LogLevel::debug)) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "allocated buffer, size = %8.2f MiB, (%8.2f / %8.2f)",
                    static_cast<double>(d.size) / kMiB, static_cast<double>(tracked) / kMiB,
                    static_cast<double>(recommended) / kMiB);
      log(LogLevel::debug, buf);
    }
    if (recommended != 0 && tracked > recommended && !warned_over_recommended) {
      warned_over_recommended = true;
      log(LogLevel::warn, "current allocated size " + mib(tracked) + " is greater than the recommended max working set size " +
                              mib(recommended));
    }
    if (!managing) return d.id;
    if (admitted + d.size <= wired_limit) admit(rr);
    else
      log(LogLevel::debug, "region " + std::to_string(d.id) + " (" + mib(d.size) + ") is over the wired limit " + mib(wired_limit) +
                               " (" + mib(admitted) + " admitted): tracked but not wired");
    // Registration is a use: the engine is loading the model.
    note_use();
    if ((policy == KeepAlive::Kind::duration || policy == KeepAlive::Kind::forever) && !resident) wire("new region");
    if (scheduler) scheduler->wake_locked();
    return d.id;
  }

  void remove_locked(Region& r) {
    evict(r);
    const auto b = reinterpret_cast<std::uintptr_t>(r.desc.base);
    by_address.erase(b);
    tracked -= r.desc.size;
  }
};

// ------------------------------------------------------------------------------------------

Manager::Manager(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<Manager>> Manager::create(ManagerOptions o) {
  if (!o.backend) return Status(ErrorCode::invalid_argument, "ManagerOptions::backend is null; pass make_backend(\"auto\")");
  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  m.config = o.config;
  m.backend = std::move(o.backend);
  m.caps = m.backend->capabilities();
  m.clock = o.clock ? o.clock : &SteadyClock::instance();
  m.log_cb = o.log ? std::move(o.log) : LogCallback(log_to_stderr);
  m.policy = m.config.keep_alive.kind;
  m.keep_alive = m.config.keep_alive.duration;
  m.managing = m.policy != KeepAlive::Kind::off;
  if (m.policy == KeepAlive::Kind::duration && m.keep_alive.count() <= 0) m.policy = KeepAlive::Kind::zero;

  const MemoryInfo mem = m.backend->memory_info();
  m.recommended = mem.recommended_working_set;
  m.physical = mem.physical;

  // The budget: explicit, else the recommended working set, else unlimited; never above
  // the backend's hard limit.
  std::uint64_t limit = UINT64_MAX;
  if (m.config.wired_limit) {
    if (m.config.wired_limit->is_percent && m.recommended == 0)
      return Status(ErrorCode::invalid_argument, "wired limit " + m.config.wired_limit->to_string() + " is a percent, but the " +
                                                     m.caps.name + " backend reports no recommended working set; give bytes instead");
    limit = m.config.wired_limit->resolve(m.recommended);
    if (m.recommended != 0 && limit > m.recommended)
      return Status(ErrorCode::limit_exceeded, "wired limit " + format_size(limit) + " is above the recommended working set of " +
                                                   format_size(m.recommended) + " (" + m.caps.name +
                                                   " backend); choose at most that, e.g. RESIDENCY_WIRED_LIMIT=100%");
  } else if (m.recommended != 0) {
    limit = m.recommended;
  }
  if (mem.hard_limit != 0 && limit > mem.hard_limit && m.managing) {
    m.log(LogLevel::warn, "wired limit clamped to " + mem.hard_limit_name + " = " + format_size(mem.hard_limit) +
                              (m.config.wired_limit ? " (asked for " + format_size(limit) + ")" : std::string()) +
                              "; to wire more: " + mem.hard_limit_fix);
    limit = mem.hard_limit;
  }
  m.wired_limit = limit;

  if (m.config.memory_limit) {
    m.memory_limit = *m.config.memory_limit;
  } else if (m.recommended != 0 || m.physical != 0) {
    const double a = m.recommended ? kMemoryLimitOfRecommended * static_cast<double>(m.recommended) : 1e300;
    const double b = m.physical ? kMemoryLimitOfPhysical * static_cast<double>(m.physical) : 1e300;
    m.memory_limit = static_cast<std::uint64_t>(std::min(a, b));
  }

  m.layout = std::make_unique<SetLayout>(m.config.layout, m.config.set_max_pct, m.recommended, m.caps.max_sets);
  m.resident = m.policy == KeepAlive::Kind::duration || m.policy == KeepAlive::Kind::forever;
  m.fast.store(true);
  m.note_use();

  for (const auto& note : m.config.notes) m.log(LogLevel::info, note);
  m.log(LogLevel::info, "creating a residency set collection (keep_alive = " + m.config.keep_alive.to_string() +
                            ", layout = " + to_string(m.config.layout) + ", wired limit = " +
                            (limit == UINT64_MAX ? std::string("unlimited") : mib(limit)) + ", backend = " + m.caps.name + ")");
  if (m.managing && limit == 0) {
    m.log(LogLevel::info, "use residency sets = false (wired limit = 0: nothing is wired until set_wired_limit() raises it)");
  } else if (m.managing) {
    m.log(LogLevel::info, "use residency sets = true");
  } else {
    m.log(LogLevel::info, "use residency sets = false (keep_alive = off: residency is not managed)");
  }

  if (o.start_scheduler && m.managing) {
    Impl* raw = &m;
    m.scheduler = std::make_unique<KeepAliveScheduler>(*m.clock, m.mu, [raw] { return raw->due(); });
    m.scheduler->start();
  }
  auto mgr = std::unique_ptr<Manager>(new Manager(std::move(impl)));
  if (m.config.release_on_pressure && m.managing) {
    Manager* self = mgr.get();
    Status s = m.backend->watch_pressure([self] { self->notify_memory_pressure(); });
    if (s) {
      m.pressure_watch = true;
    } else {
      m.log(LogLevel::warn, "release_on_pressure is set but " + s.message() + "; call notify_memory_pressure() yourself");
    }
  }
  return mgr;
}

Manager::~Manager() {
  Impl& m = *impl_;
  if (m.pressure_watch) m.backend->stop_pressure_watch();
  if (m.scheduler) m.scheduler->stop();
  std::lock_guard<std::mutex> g(m.mu);
  if (!m.regions.empty()) {
    m.log(LogLevel::warn, std::to_string(m.regions.size()) + " region(s), " + mib(m.tracked) +
                              ", still registered at teardown; releasing them (not an error)");
  }
  // Backend memory first (no pointless copy-out of device weights), then the sets.
  for (auto& [id, r] : m.regions)
    if (r.desc.backend_allocated) m.backend->deallocate(r.desc.base);
  bool any_requested = false;
  for (SetId s : m.layout->live_set_ids()) {
    if (!m.state(s).created) continue;
    any_requested = any_requested || m.state(s).requested;
    m.backend->destroy_set(s);
  }
  if (any_requested) m.backend->after_release();
  m.regions.clear();
}

Result<RegionId> Manager::register_region(void* base, std::size_t size, RegionClass cls, int priority,
                                          void* backend_object) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> g(m.mu);
  Impl::Guard batch(m);
  RegionDesc d;
  d.base = base;
  d.size = size;
  d.cls = cls;
  d.backend_object = backend_object;
  return m.register_locked(d, priority);
}

Result<Allocation> Manager::allocate(std::size_t size, RegionClass cls, int priority) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> g(m.mu);
  if (size == 0) return Status(ErrorCode::invalid_argument, "allocate: size is 0");
  Impl::Guard batch(m);
  Result<void*> p = m.backend->allocate(size, cls);
  if (!p) return p.status();
  RegionDesc d;
  d.base = *p;
  d.size = size;
  d.cls = cls;
  d.backend_allocated = true;
  auto id = m.register_locked(d, priority);
  if (!id) {
    m.backend->deallocate(*p);
    return id.status();
  }
  return Allocation{*id, *p};
}

Status Manager::unregister_region(RegionId id) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> g(m.mu);
  auto it = m.regions.find(id);
  if (it == m.regions.end())
    return Status(ErrorCode::not_found, "unregister_region: no region with id " + std::to_string(id) + " is tracked");
  Impl::Guard batch(m);
  Impl::Region& r = it->second;
  // Free backend memory first: leaving the set first would make the backend end its
  // residency, i.e. copy device weights to host just before they are thrown away.
  if (r.desc.backend_allocated) m.backend->deallocate(r.desc.base);
  m.remove_locked(r);
  m.regions.erase(it);
  m.promote();  // unlike MLX, freeing wired memory makes room for what waits
  return {};
}

Status Manager::mark_used(RegionId id) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> g(m.mu);
  auto it = m.regions.find(id);
  if (it == m.regions.end())
    return Status(ErrorCode::not_found, "mark_used: no region with id " + std::to_string(id) + " is tracked");
  it->second.last_use = ++m.seq;
  return {};
}

Status Manager::set_wired_limit(std::uint64_t bytes) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> g(m.mu);
  if (m.recommended != 0 && bytes > m.recommended)
    return Status(ErrorCode::limit_exceeded, "set_wired_limit: " + format_size(bytes) + " is above the recommended working set of " +
                                                 format_size(m.recommended) + "; choose at most that");
  const MemoryInfo mem = m.backend->memory_info();
  if (mem.hard_limit != 0 && bytes > mem.hard_limit) {
    m.log(LogLevel::warn, "wired limit " + format_size(bytes) + " clamped to " + mem.hard_limit_name + " = " +
                              format_size(mem.hard_limit) + "; to wire more: " + mem.hard_limit_fix);
    bytes = mem.hard_limit;
  }
  Impl::Guard batch(m);
  m.wired_limit = bytes;
  for (auto& [id, r] : m.regions) r.eligible = true;  // a new limit: try again what failed
  m.shrink_to_limit();
  m.promote();
  return {};
}

std::uint64_t Manager::wired_limit() const {
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->wired_limit;
}

void Manager::touch() noexcept {
  Impl& m = *impl_;
  m.last_use_ns.store(m.clock->now().count());
  if (m.fast.load()) return;
  // Slow path: the memory was released; wire it again before the caller computes.
  std::lock_guard<std::mutex> g(m.mu);
  if (m.resident) return;
  if (m.policy != KeepAlive::Kind::duration && m.policy != KeepAlive::Kind::forever) return;
  m.wire("touch after release");
}

void Manager::prefetch() noexcept {
  Impl& m = *impl_;
  m.note_use();
  if (m.fast.load()) return;
  std::lock_guard<std::mutex> g(m.mu);
  if (m.resident || (m.policy != KeepAlive::Kind::duration && m.policy != KeepAlive::Kind::forever)) return;
  m.prefetch_requested = true;
  if (m.scheduler) m.scheduler->wake_locked();
}

UseScope Manager::use(std::function<void()> synchronize) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> g(m.mu);
  if (!m.managing) return UseScope(this, std::move(synchronize), Status());
  ++m.scopes;
  m.note_use();
  if (!m.resident) m.wire("use scope");
  Status st;
  if (m.policy == KeepAlive::Kind::zero && m.recommended != 0 && !m.warned_scope_size &&
      static_cast<double>(m.admitted) > kScopeWarnFraction * static_cast<double>(m.recommended)) {
    m.warned_scope_size = true;
    m.log(LogLevel::warn, "generating with a model that requires " + mib(m.admitted) +
                              ", close to the maximum recommended size of " + mib(m.recommended) +
                              "; this can be slow (other applications compete for the memory)");
  }
  if (m.admitted < m.tracked)
    st = Status(ErrorCode::limit_exceeded, format_size(m.tracked - m.admitted) + " of " + format_size(m.tracked) +
                                               " tracked is not wired (over the wired limit of " + format_size(m.wired_limit) +
                                               " or refused by the backend)");
  return UseScope(this, std::move(synchronize), std::move(st));
}

void Manager::notify_memory_pressure() {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> g(m.mu);
  if (!m.config.release_on_pressure) {
    m.log(LogLevel::debug, "memory pressure reported; release_on_pressure is off, keeping residency");
    return;
  }
  if (!m.managing || !m.resident || m.scopes > 0) return;
  m.fast.store(false);
  m.release("memory pressure");
}

void Manager::release_now() {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> g(m.mu);
  if (!m.managing || !m.resident) return;
  if (m.scopes > 0) {
    m.log(LogLevel::warn, "release_now: " + std::to_string(m.scopes) + " use scope(s) still open; not releasing");
    return;
  }
  m.fast.store(false);
  m.release("asked by the engine");
}

Batch Manager::batch() {
  std::lock_guard<std::mutex> g(impl_->mu);
  ++impl_->batch_depth;
  return Batch(this);
}

Batch::~Batch() {
  if (!manager_) return;
  Manager::Impl& m = *manager_->impl_;
  std::lock_guard<std::mutex> g(m.mu);
  if (--m.batch_depth == 0) m.flush();
}

std::optional<Nanos> Manager::run_due() {
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->due();
}

Stats Manager::stats() const {
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->stats();
}

const Config& Manager::config() const { return impl_->config; }
Capabilities Manager::backend_capabilities() const { return impl_->caps; }
Backend& Manager::backend() { return *impl_->backend; }

// --- UseScope ----------------------------------------------------------------------------

UseScope::UseScope(Manager* m, std::function<void()> sync, Status st)
    : manager_(m), synchronize_(std::move(sync)), status_(std::move(st)) {}

UseScope::UseScope(UseScope&& o) noexcept
    : manager_(o.manager_), synchronize_(std::move(o.synchronize_)), status_(std::move(o.status_)) {
  o.manager_ = nullptr;
}

UseScope& UseScope::operator=(UseScope&& o) noexcept {
  if (this != &o) {
    end();
    manager_ = o.manager_;
    synchronize_ = std::move(o.synchronize_);
    status_ = std::move(o.status_);
    o.manager_ = nullptr;
  }
  return *this;
}

UseScope::~UseScope() { end(); }

void UseScope::end() {
  if (!manager_) return;
  Manager* mgr = manager_;
  manager_ = nullptr;
  // The GPU may still be reading: wait for it before anything can be released (mlx-lm
  // synchronizes before restoring the wired limit for the same reason).
  if (synchronize_) synchronize_();
  Manager::Impl& m = *mgr->impl_;
  std::lock_guard<std::mutex> g(m.mu);
  if (!m.managing) return;
  if (m.scopes > 0) --m.scopes;
  m.note_use();
  if (m.scopes == 0 && m.policy == KeepAlive::Kind::zero && m.resident) {
    m.release("end of use (keep_alive = 0)");
  } else if (m.scheduler) {
    m.scheduler->wake_locked();
  }
}

}  // namespace residency
