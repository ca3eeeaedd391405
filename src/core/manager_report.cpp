// SPDX-License-Identifier: MIT
#include "manager_report.hpp"

#include <cstdio>

#include "budget_share.hpp"

namespace residency::core {

void ManagerReport::start_state_file(std::string pressure_source) {
  pressure_src_ = std::move(pressure_source);
  state_ = std::make_unique<StateFile>();
  publish();
}

void ManagerReport::log_start(bool managing) const {
  for (const auto& note : config_.notes) log_(LogLevel::info, note);
  const std::uint64_t limit = adm_.budget().limit();
  log_(LogLevel::info, "creating a residency set collection (keep_alive = " + config_.keep_alive.to_string() +
                           ", layout = " + to_string(config_.layout) +
                           ", wired limit = " + (limit == UINT64_MAX ? std::string("unlimited") : mib(limit)) +
                           ", backend = " + caps_.name + ")");
  if (managing && limit == 0) {
    log_(LogLevel::info,
         "use residency sets = false (wired limit = 0: nothing is wired until set_wired_limit() raises it)");
  } else if (managing) {
    log_(LogLevel::info, "use residency sets = true");
  } else {
    log_(LogLevel::info, "use residency sets = false (keep_alive = off: residency is not managed)");
  }
  if (const BudgetShare* shared = adm_.share()) {
    log_(LogLevel::info, "shared budget " + shared->name() + " = " + mib(shared->budget()) + " (ledger " +
                             shared->path() + ", priority " + std::to_string(shared->priority()) + ")");
    if (shared->requested_budget() != 0)
      log_(LogLevel::warn, "shared budget " + shared->name() + " exists with " + mib(shared->budget()) +
                               "; this process asked for " + mib(shared->requested_budget()) +
                               ": the ledger's size stays (the first process sets it)");
  }
}

bool ManagerReport::changed() {
  if (!state_) return false;
  const Nanos now = clock_.now();
  if (scheduler_) {
    if (dirty_) return false;
    dirty_ = true;
    due_ = now + kStateCoalesce;
    return true;  // the caller wakes the scheduler: due() writes it at due_
  }
  dirty_ = true;
  if (!written_ || now - *written_ >= kStateCoalesce) publish();
  return false;
}

std::optional<Nanos> ManagerReport::due() {
  if (dirty_ && clock_.now() >= due_) publish();
  return dirty_ ? std::optional<Nanos>(due_) : std::nullopt;
}

void ManagerReport::publish() {
  if (!state_) return;
  dirty_ = false;
  written_ = clock_.now();
  const RegionTable& regions = adm_.regions();
  const WiredBudget& budget = adm_.budget();
  const ResidencyCycle::Counters& c = cycle_.counters();
  std::uint64_t tracked[3] = {0, 0, 0}, wired[3] = {0, 0, 0};
  const bool requested = adm_.sets().requested_bytes() > 0;
  regions.for_each([&](const Region& r) {
    const auto cls = static_cast<std::size_t>(r.desc.cls);
    if (cls >= 3) return;
    tracked[cls] += r.desc.size;
    if (r.admitted && requested) wired[cls] += r.desc.size;
  });
  std::string b;
  auto put = [&b](const std::string& k, const std::string& v) {
    std::string line = v;
    for (char& ch : line)
      if (ch == '\n' || ch == '\r') ch = ' ';
    b += k + "=" + line + "\n";
  };
  auto num = [&](const char* k, std::uint64_t v) { put(k, std::to_string(v)); };
  auto secs = [&](const char* k, double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3f", v);
    put(k, buf);
  };
  put("backend", caps_.name);
  put("keep_alive", config_.keep_alive.to_string());
  num("resident", ka_.wants_resident() ? 1 : 0);
  put("wired_limit", budget.limit() == UINT64_MAX ? std::string("unlimited") : std::to_string(budget.limit()));
  num("wired_bytes", adm_.sets().requested_bytes());
  num("tracked_bytes", regions.tracked_bytes());
  num("admitted_bytes", budget.admitted());
  num("regions", regions.size());
  for (std::size_t i = 0; i < 3; ++i) {
    const std::string cls = to_string(static_cast<RegionClass>(i));
    put("tracked." + cls, std::to_string(tracked[i]));
    put("wired." + cls, std::to_string(wired[i]));
  }
  num("releases", c.releases);
  num("releases.keep_alive", c.releases_keep_alive);
  num("releases.asked", c.releases_asked);
  num("releases.engine", c.releases_engine);
  num("releases.pressure", c.pressure_releases);
  num("rewires", c.rewires);
  secs("rewire_seconds_sum", std::chrono::duration<double>(c.rewire_time).count());
  {
    std::string buckets;  // counts per bucket, the bounds in rewire_bucket_bounds (seconds)
    std::string bounds;
    for (std::size_t i = 0; i < ResidencyCycle::Counters::kRewireBucketCount; ++i) {
      buckets += (i ? "," : "") + std::to_string(c.rewire_buckets[i]);
      if (i + 1 < ResidencyCycle::Counters::kRewireBucketCount) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%g", ResidencyCycle::Counters::kRewireBuckets[i]);
        bounds += (i ? "," : "") + std::string(buf);
      }
    }
    put("rewire_buckets", buckets);
    put("rewire_bucket_bounds", bounds);
  }
  num("asks_received", c.asks_received);
  num("wire_failures", adm_.wire_failures());
  if (c.last_release_at > 0) {
    secs("last_release_at", c.last_release_at);
    put("last_release_reason", c.last_release_reason);
  }
  if (c.last_rewire_at > 0) {
    secs("last_rewire_at", c.last_rewire_at);
    secs("last_rewire_ms", std::chrono::duration<double, std::milli>(c.last_rewire_dt).count());
    num("last_rewire_bytes", c.last_rewire_bytes);
  }
  num("release_on_pressure", config_.release_on_pressure ? 1 : 0);
  if (!pressure_src_.empty()) put("pressure_source", pressure_src_);
  if (budget.cap() != UINT64_MAX) num("pressure_cap", budget.cap());
  if (const std::uint64_t pinned = backend_.pinned_host_bytes()) num("pinned_host_bytes", pinned);
  if (const std::uint64_t filed = backend_.file_backed_bytes()) num("file_backed_bytes", filed);
  if (const std::uint64_t registered = backend_.registered_file_bytes()) num("registered_file_bytes", registered);
  if (!host_budget_.empty()) put("host_budget", host_budget_);
  if (const BudgetShare* shared = adm_.share()) {
    put("shared_budget", shared->name());
    num("shared_budget_size", shared->budget());
    num("shared_held", shared->held());
    num("asks_sent", shared->asks_sent());
    put("shared_priority", std::to_string(config_.shared_priority));
    // Device memory the others could not make room for: woken over the budget, or waited for.
    put("shared_budget_mode",
        config_.budget_wait ? "strict, waits at most " + KeepAlive::after(*config_.budget_wait).to_string() : "over");
  }
  if (!state_->publish(b))
    if (std::string why = state_->why_not(); !why.empty()) log_(LogLevel::warn, why);
}

Stats ManagerReport::stats() const {
  const ResidencyCycle::Counters& c = cycle_.counters();
  Stats s;
  s.tracked_bytes = adm_.regions().tracked_bytes();
  s.admitted_bytes = adm_.budget().admitted();
  s.wired_bytes = adm_.sets().requested_bytes();
  s.pending_bytes = s.tracked_bytes - adm_.admitted_size();  // own bytes; admitted_bytes is charged
  s.wired_limit = adm_.budget().limit();
  s.regions = static_cast<std::uint32_t>(adm_.regions().size());
  s.sets = adm_.sets().live_sets();
  s.resident = s.wired_bytes > 0;
  s.commits = adm_.sets().commits();
  s.residency_requests = adm_.sets().requests();
  s.releases = c.releases;
  s.rewires = c.rewires;
  s.rewire_time = c.rewire_time;
  s.scheduler_wakeups = scheduler_ ? scheduler_->wakeups() : 0;
  s.wire_failures = adm_.wire_failures();
  s.release_failures = c.release_failures;
  s.pressure_releases = c.pressure_releases;
  s.pressure_restores = c.pressure_restores;
  s.pressure_cap = adm_.budget().cap();
  if (const BudgetShare* shared = adm_.share()) {
    s.shared_budget = shared->budget();
    s.shared_held = shared->held();
    s.shared_asks = shared->asks_sent();
    s.shared_gave_back = c.shared_gave_back;
    s.shared_short = shared->short_count();
  }
  return s;
}

}  // namespace residency::core
