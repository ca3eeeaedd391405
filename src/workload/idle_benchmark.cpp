// SPDX-License-Identifier: MIT
// The idle benchmark's schedule, run loop and text output (see idle_benchmark.hpp).
#include "workload/idle_benchmark.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>

#include "residency/text.hpp"

namespace residency::workload {
namespace {

// llama-idle's schedule (examples/idle): 0 to 4000 ms in steps of 800, 3 iterations each.
constexpr int kLlamaIdleMaxPauseMs = 4000;
constexpr int kLlamaIdleStepMs = 800;
constexpr int kLlamaIdleIters = 3;
// A pause list entry longer than this is almost certainly a unit mistake ("4000s").
constexpr std::int64_t kMaxPauseMs = 3'600'000;

double ms(Nanos d) { return static_cast<double>(d.count()) / 1e6; }

std::string trim(std::string_view s) {
  while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
  while (!s.empty() && s.back() == ' ') s.remove_suffix(1);
  return std::string(s);
}

}  // namespace

IdleSchedule llama_idle_schedule() {
  IdleSchedule s;
  for (int p = 0; p <= kLlamaIdleMaxPauseMs; p += kLlamaIdleStepMs) s.pauses.push_back(std::chrono::milliseconds(p));
  s.iters = kLlamaIdleIters;
  return s;
}

Result<std::vector<Nanos>> parse_pauses(std::string_view text) {
  const std::string accepted =
      "accepted: comma-separated pauses in milliseconds (or with a unit: 500ms, 2s), e.g. 0,800,1600";
  std::vector<Nanos> out;
  std::size_t start = 0, index = 0;
  while (true) {
    const std::size_t comma = text.find(',', start);
    const std::string item = trim(
        text.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start));
    ++index;
    const std::string where = "--pauses '" + printable(text) + "': item " + std::to_string(index);
    if (item.empty()) return Status(ErrorCode::invalid_argument, where + " is empty; " + accepted);
    std::size_t digits = 0;
    while (digits < item.size() && item[digits] >= '0' && item[digits] <= '9') ++digits;
    const std::string shown = " '" + printable(item) + "'";
    if (digits == 0) {
      return Status(ErrorCode::invalid_argument, where + shown + " is not a non-negative whole number; " + accepted);
    }
    const std::string unit = item.substr(digits);
    if (!unit.empty() && unit != "ms" && unit != "s") {
      return Status(ErrorCode::invalid_argument,
                    where + shown + " has an unknown unit '" + printable(unit) + "'; " + accepted);
    }
    const std::string too_long = where + shown + " is longer than one hour (3600000 ms), the longest pause accepted";
    if (digits > 10) return Status(ErrorCode::invalid_argument, too_long);
    const std::int64_t value = std::stoll(item.substr(0, digits));
    const std::int64_t ms_value = unit == "s" ? value * 1000 : value;
    if (ms_value > kMaxPauseMs) return Status(ErrorCode::invalid_argument, too_long);
    out.push_back(std::chrono::milliseconds(ms_value));
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return out;
}

IdleCell IdleResults::cell(std::size_t policy, std::size_t pause) const {
  IdleCell c;
  double sum = 0, resident = 0;
  int known = 0;
  for (const auto& s : samples) {
    if (s.policy != policy || s.pause != pause) continue;
    ++c.n;
    sum += s.decode_ms;
    if (s.resident_before >= 0) {
      resident += s.resident_before;
      ++known;
    }
  }
  if (c.n == 0) return c;
  c.mean_ms = sum / c.n;
  double sq = 0;
  for (const auto& s : samples) {
    if (s.policy == policy && s.pause == pause) sq += (s.decode_ms - c.mean_ms) * (s.decode_ms - c.mean_ms);
  }
  c.sd_ms = c.n > 1 ? std::sqrt(sq / (c.n - 1)) : 0.0;
  c.resident_before = known ? resident / known : -1.0;
  return c;
}

double estimate_seconds(const IdleSchedule& schedule, std::size_t policies, double decode_ms) {
  double pause_ms = 0;
  for (Nanos p : schedule.pauses) pause_ms += ms(p) * schedule.iters;
  const double decodes = static_cast<double>(schedule.pauses.size()) * (schedule.iters + 1);
  return static_cast<double>(policies) * (pause_ms + decodes * decode_ms) / 1000.0;
}

namespace {

// One block's policy in force: its manager over the model's memory, given back when the block
// ends (regions unregistered first, so the manager's teardown has nothing to warn about).
class PolicyBlock {
 public:
  // Creates the manager, places the model and, where the target needs it, releases and re-wires
  // once before anything is timed.
  static Result<PolicyBlock> start(IdleTarget& target, const IdlePolicy& policy, const IdleBenchmarkOptions& o) {
    auto backend = target.policy_backend();
    if (!backend) return backend.status();
    ManagerOptions mo;
    mo.config = o.config;
    mo.config.notes.clear();  // shown once by the caller, not once per block
    mo.config.keep_alive = policy.keep_alive;
    mo.config.release_on_pressure = policy.release_on_pressure;
    mo.config.log_level = o.log_level;
    if (auto layout = target.layout()) mo.config.layout = *layout;
    mo.backend = std::move(backend).value();
    mo.log = o.log;  // empty: the manager's default (stderr)
    mo.clock = &target.clock();
    mo.start_scheduler = target.virtual_clock() == nullptr;  // virtual time: IdleTime runs what is due
    auto manager = Manager::create(std::move(mo));
    if (!manager) return manager.status();
    PolicyBlock block(target, std::move(manager).value());
    auto regions = target.place_model(*block.manager_);
    if (!regions) return regions.status();
    block.regions_ = std::move(regions).value();
    if (target.first_release_sets_up()) {
      if (policy.kind == IdlePolicy::Kind::zero) {
        UseScope scope = block.manager_->use(target.synchronize());  // its end releases; the next use wires
      } else if (policy.kind != IdlePolicy::Kind::off) {
        block.manager_->release_now();
        block.manager_->touch();
      }
    }
    return block;
  }
  PolicyBlock(PolicyBlock&&) noexcept = default;
  PolicyBlock& operator=(PolicyBlock&&) = delete;
  PolicyBlock(const PolicyBlock&) = delete;
  PolicyBlock& operator=(const PolicyBlock&) = delete;
  ~PolicyBlock() {
    if (!manager_) return;
    for (RegionId id : regions_) (void)manager_->unregister_region(id);
  }

  Manager& manager() { return *manager_; }
  IdleTime& time() { return time_; }

 private:
  PolicyBlock(IdleTarget& target, std::unique_ptr<Manager> manager)
      : manager_(std::move(manager)), time_(target.clock(), target.virtual_clock(), *manager_) {}
  std::unique_ptr<Manager> manager_;
  std::vector<RegionId> regions_;
  IdleTime time_;  // refers to *manager_, which a move leaves where it is
};

// Warnings the run gives once, whichever policy or block meets them first.
struct RunWarnings {
  bool unwired = false;
  bool scope = false;
};

void warn(const IdleBenchmarkOptions& o, const std::string& message) {
  if (o.log) {
    o.log(LogLevel::warn, message);
  } else {
    log_to_stderr(LogLevel::warn, message);
  }
}

struct Decoded {
  Nanos elapsed{0};
  double checksum = 0;
};

// One decode as an engine does it under the policy (see idle_benchmark.hpp).
Result<Decoded> decode(IdleTarget& target, PolicyBlock& block, const IdlePolicy& policy, const IdleBenchmarkOptions& o,
                       RunWarnings& warned) {
  Decoded out;
  target.decode_starts();
  IdleTime& time = block.time();
  const Nanos t0 = time.now();
  Result<double> sum = 0.0;
  if (policy.kind == IdlePolicy::Kind::zero) {
    UseScope scope = block.manager().use(target.synchronize());
    if (!scope.status()) {
      if (target.decode_needs_residency()) return scope.status();
      if (!warned.scope) {
        warned.scope = true;
        warn(o, "policy 0: the model could not be wired for the decode: " + scope.status().message());
      }
    }
    sum = target.decode_pass(time);
    out.elapsed = time.now() - t0;  // before the scope's release, as llama-idle times it
  } else {
    block.manager().touch();
    sum = target.decode_pass(time);
    out.elapsed = time.now() - t0;
  }
  if (!sum) return sum.status();
  out.checksum = *sum;
  return out;
}

// Pause, then pressure (not after a pause of 0), then how much of the model is still resident.
Result<IdleSample> pause(IdleTarget& target, PolicyBlock& block, Nanos duration, const Pressure& pressure) {
  IdleSample s;
  IdleTime& time = block.time();
  const Nanos start = time.now();
  time.pass(duration);
  if (duration.count() > 0 && pressure.kind != Pressure::Kind::none) {
    const Nanos p0 = time.now();
    if (Status st = target.apply_pressure(pressure); !st) return st;
    s.pressure_ms = ms(time.now() - p0);
    s.hog = target.last_hog();
  }
  s.idle_ms = ms(time.now() - start);
  s.resident_before = target.resident_fraction();
  return s;
}

// Whether the observer wants the run to end (its output is gone): the reason as an error.
Status stopped(const IdleObserver& obs) {
  std::string why = obs.stop_reason();
  return why.empty() ? Status::ok() : Status(ErrorCode::io_error, std::move(why));
}

}  // namespace

Result<IdleResults> run_idle_benchmark(IdleTarget& target, const IdleBenchmarkOptions& o, IdleObserver* observer) {
  IdleObserver none;
  IdleObserver& obs = observer ? *observer : none;
  const IdleSchedule& schedule = o.schedule;
  const std::vector<IdlePolicy>& policies = o.policies;
  IdleResults r;
  r.policies = policies;
  r.schedule = schedule;
  r.pressure = o.pressure;
  if (policies.empty() || schedule.pauses.empty() || schedule.iters < 1) {
    return Status(ErrorCode::invalid_argument, "nothing to run: no policy, no pause or fewer than 1 iteration");
  }
  RunWarnings warned;
  const auto wall0 = std::chrono::steady_clock::now();
  const std::size_t blocks = schedule.pauses.size() * policies.size();
  std::size_t block_index = 0;
  for (std::size_t p = 0; p < schedule.pauses.size(); ++p) {
    for (std::size_t k = 0; k < policies.size(); ++k) {
      const std::size_t pol = (k + p) % policies.size();  // rotate the order from pause to pause
      const IdlePolicy& policy = policies[pol];
      obs.block_start(r, pol, p, block_index++, blocks);
      if (auto st = stopped(obs); !st.is_ok()) return st;
      std::optional<PolicyBlock> block;
      {
        auto started = PolicyBlock::start(target, policy, o);
        if (!started) return started.status();
        block.emplace(std::move(started).value());
      }
      // keep-alive and forever wire at registration; tell the user when the backend could not,
      // since the column then measures nothing but `off` (the backend's warning says why).
      if ((policy.kind == IdlePolicy::Kind::keep_alive || policy.kind == IdlePolicy::Kind::forever) && !warned.unwired) {
        const Stats st = block->manager().stats();
        if (st.wired_bytes < st.tracked_bytes) {
          warned.unwired = true;
          // Why, from what the manager says (a backend's own warning may have been printed once
          // per process, long before, or filtered by the log level).
          const std::string why =
              st.wired_limit < st.tracked_bytes
                  ? "the wired limit is " + format_size(st.wired_limit) +
                        " (RESIDENCY_WIRED_LIMIT, or RLIMIT_MEMLOCK without CAP_IPC_LOCK: ulimit -l)"
                  : "the backend refused the rest (" + std::to_string(st.wire_failures) +
                        " failed request(s); RLIMIT_MEMLOCK without CAP_IPC_LOCK is the usual cause: ulimit -l)";
          warn(o, "policy " + policy.name + ": only " + format_size(st.wired_bytes) + " of the " +
                      format_size(st.tracked_bytes) + " model could be wired: " + why +
                      "; its column is not what the policy would give");
        }
      }
      auto warm = decode(target, *block, policy, o, warned);
      if (!warm) return warm.status();
      r.warmups.push_back({pol, p, ms(warm->elapsed)});
      obs.warmup(r, r.warmups.back());
      if (auto st = stopped(obs); !st.is_ok()) return st;
      for (int it = 0; it < schedule.iters; ++it) {
        obs.pausing(r, pol, p, it);
        auto s = pause(target, *block, schedule.pauses[p], o.pressure);
        if (!s) return s.status();
        auto d = decode(target, *block, policy, o, warned);
        if (!d) return d.status();
        s->policy = pol;
        s->pause = p;
        s->iter = it;
        s->decode_ms = ms(d->elapsed);
        r.samples.push_back(*s);
        obs.sample(r, r.samples.back());
        if (auto st = stopped(obs); !st.is_ok()) return st;
      }
      block.reset();  // the policy's manager is gone before the next one starts
      obs.block_end(r, pol, p);
      if (auto st = stopped(obs); !st.is_ok()) return st;
    }
  }
  r.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  return r;
}

std::string format_decode_line(double ms_value) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "  - decode time: %8.2f ms", ms_value);
  return buf;
}

std::string format_summary_line(const IdleCell& cell, Nanos pause) {
  char buf[128];
  std::snprintf(buf, sizeof buf, "iters: %4d, pause: %5d ms, avg decode time: %8.2f +/- %4.2f ms", cell.n,
                static_cast<int>(pause.count() / 1'000'000), cell.mean_ms, cell.sd_ms);
  return buf;
}

std::string format_hog_waits(const IdleResults& results) {
  std::string out;
  for (std::size_t k = 0; k < results.policies.size(); ++k) {
    int n = 0, got = 0, killed = 0;
    double sum = 0, worst = 0;
    for (const auto& s : results.samples) {
      if (s.policy != k || !s.hog) continue;
      ++n;
      killed += s.hog->oom_killed;
      if (s.hog->got) {
        ++got;
        sum += s.hog->waited_ms;
        worst = std::max(worst, s.hog->waited_ms);
      }
    }
    if (n == 0) continue;
    char line[256];
    if (got > 0) {
      std::snprintf(
          line, sizeof line,
          "  %-26s got it %d/%d times, after %.0f ms on average (at most %.0f ms); %d attempt(s) OOM-killed\n",
          results.policies[k].name.c_str(), got, n, sum / got, worst, killed);
    } else {
      std::snprintf(line, sizeof line,
                    "  %-26s never got it (%d times; gave up after %.0f s each); %d attempt(s) OOM-killed\n",
                    results.policies[k].name.c_str(), n, kHogGiveUpSeconds, killed);
    }
    out += line;
  }
  if (out.empty()) return out;
  return "The hog (" + results.pressure.to_string() + ") waiting for its memory, per policy:\n" + out;
}

std::string format_idle_verdict(const IdleResults& r) {
  std::optional<std::size_t> off, kept;
  for (std::size_t i = 0; i < r.policies.size(); ++i) {
    if (r.policies[i].kind == IdlePolicy::Kind::off && !off) off = i;
    if (r.policies[i].kind == IdlePolicy::Kind::keep_alive && !kept) kept = i;
  }
  if (!off || !kept) return {};
  const Nanos keep = r.policies[*kept].keep_alive.duration;
  std::optional<std::size_t> within, past;  // the longest pause shorter than the keep-alive, and past it
  for (std::size_t p = 0; p < r.schedule.pauses.size(); ++p) {
    const Nanos pause = r.schedule.pauses[p];
    if (pause > Nanos(0) && pause < keep && (!within || pause > r.schedule.pauses[*within])) within = p;
    if (pause > keep && (!past || pause > r.schedule.pauses[*past])) past = p;
  }
  if (!within) return {};
  const IdleCell k = r.cell(*kept, *within), o = r.cell(*off, *within);
  if (k.n == 0 || o.n == 0) return {};
  const auto ms = [](double v) {
    char b[32];
    std::snprintf(b, sizeof b, "%.2f ms", v);
    return std::string(b);
  };
  const long long pause_ms = std::chrono::duration_cast<std::chrono::milliseconds>(r.schedule.pauses[*within]).count();
  const std::string name = r.policies[*kept].name;
  std::string line = "verdict: ";
  if (o.mean_ms > 1.1 * k.mean_ms) {
    char ratio[32];
    std::snprintf(ratio, sizeof ratio, "%.1fx", o.mean_ms / k.mean_ms);
    line += name + " saved " + ms(o.mean_ms - k.mean_ms) + " per decode after a " + std::to_string(pause_ms) +
            " ms pause (" + ms(k.mean_ms) + " against " + ms(o.mean_ms) + " with off, " + ratio + " faster)";
  } else {
    line += name + " made no difference after a " + std::to_string(pause_ms) + " ms pause (" + ms(k.mean_ms) +
            " against " + ms(o.mean_ms) + " with off): the model stayed in memory either way (pressure " +
            r.pressure.to_string() + ")";
  }
  if (past) {
    const IdleCell kp = r.cell(*kept, *past);
    const long long past_ms = std::chrono::duration_cast<std::chrono::milliseconds>(r.schedule.pauses[*past]).count();
    if (kp.n != 0)
      line += "; after " + std::to_string(past_ms) + " ms, past the keep-alive, it decoded in " + ms(kp.mean_ms) +
              (kp.mean_ms > 1.1 * k.mean_ms ? " (the model was given back, as set)" : "");
  }
  return line;
}

std::string format_idle_table(const IdleResults& r) {
  std::vector<std::string> header{"pause (ms)"};
  for (const auto& p : r.policies) header.push_back(p.name);
  std::vector<std::vector<std::string>> rows;
  for (std::size_t p = 0; p < r.schedule.pauses.size(); ++p) {
    std::vector<std::string> row{std::to_string(r.schedule.pauses[p].count() / 1'000'000)};
    for (std::size_t k = 0; k < r.policies.size(); ++k) {
      const IdleCell c = r.cell(k, p);
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.2f +/- %.2f", c.mean_ms, c.sd_ms);
      row.emplace_back(c.n ? buf : "-");
    }
    rows.push_back(std::move(row));
  }
  std::vector<std::size_t> width(header.size());
  for (std::size_t k = 0; k < header.size(); ++k) {
    width[k] = header[k].size();
    for (const auto& row : rows) width[k] = std::max(width[k], row[k].size());
  }
  auto line = [&](const std::vector<std::string>& cells) {
    std::string s = "|";
    for (std::size_t k = 0; k < cells.size(); ++k)
      s += " " + std::string(width[k] - cells[k].size(), ' ') + cells[k] + " |";
    return s + "\n";
  };
  std::string out = line(header) + "|";
  for (std::size_t k = 0; k < header.size(); ++k) out += std::string(width[k] + 1, '-') + ":|";
  out += "\n";
  for (const auto& row : rows) out += line(row);
  return out;
}

std::string format_idle_csv(const IdleResults& r) {
  std::string out = "policy,pause_ms,iter,decode_ms,idle_ms,pressure_ms,resident_before_pct\n";
  char buf[256];
  for (const auto& s : r.samples) {
    const double resident = s.resident_before < 0 ? -1.0 : 100.0 * s.resident_before;
    std::snprintf(buf, sizeof buf, "%s,%lld,%d,%.3f,%.3f,%.3f,%.1f\n", r.policies[s.policy].id.c_str(),
                  static_cast<long long>(r.schedule.pauses[s.pause].count() / 1'000'000), s.iter, s.decode_ms,
                  s.idle_ms, s.pressure_ms, resident);
    out += buf;
  }
  return out;
}

}  // namespace residency::workload
