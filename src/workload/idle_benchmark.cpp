// The idle benchmark's schedule, run loop and text output (see idle_benchmark.hpp).
#include "workload/idle_benchmark.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

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
  const std::string accepted = "expected comma-separated pauses in milliseconds (or with a unit: 500ms, 2s), e.g. 0,800,1600";
  std::vector<Nanos> out;
  std::size_t start = 0, index = 0;
  while (true) {
    const std::size_t comma = text.find(',', start);
    const std::string item = trim(text.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start));
    ++index;
    const std::string where = "--pauses '" + std::string(text) + "': item " + std::to_string(index);
    if (item.empty()) return Status(ErrorCode::invalid_argument, where + " is empty; " + accepted);
    std::size_t digits = 0;
    while (digits < item.size() && item[digits] >= '0' && item[digits] <= '9') ++digits;
    if (digits == 0 || digits > 10) {
      return Status(ErrorCode::invalid_argument, where + " '" + item + "' is not a non-negative whole number; " + accepted);
    }
    const std::int64_t value = std::stoll(item.substr(0, digits));
    const std::string unit = item.substr(digits);
    std::int64_t ms_value = 0;
    if (unit.empty() || unit == "ms") {
      ms_value = value;
    } else if (unit == "s") {
      ms_value = value * 1000;
    } else {
      return Status(ErrorCode::invalid_argument, where + " '" + item + "' has an unknown unit '" + unit + "'; " + accepted);
    }
    if (ms_value > kMaxPauseMs) {
      return Status(ErrorCode::invalid_argument, where + " '" + item + "' is longer than one hour; " + accepted);
    }
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

Result<IdleResults> run_idle_benchmark(IdleTarget& target, const IdleSchedule& schedule,
                                       const std::vector<IdlePolicy>& policies, const Pressure& pressure,
                                       IdleObserver* observer) {
  IdleObserver none;
  IdleObserver& obs = observer ? *observer : none;
  IdleResults r;
  r.policies = policies;
  r.schedule = schedule;
  r.pressure = pressure;
  if (policies.empty() || schedule.pauses.empty() || schedule.iters < 1) {
    return Status(ErrorCode::invalid_argument, "nothing to run: no policy, no pause or fewer than 1 iteration");
  }
  const auto wall0 = std::chrono::steady_clock::now();
  const std::size_t blocks = schedule.pauses.size() * policies.size();
  std::size_t block = 0;
  for (std::size_t p = 0; p < schedule.pauses.size(); ++p) {
    for (std::size_t k = 0; k < policies.size(); ++k) {
      const std::size_t pol = (k + p) % policies.size();  // rotate the order from pause to pause
      obs.block_start(r, pol, p, block++, blocks);
      if (Status st = target.activate(policies[pol]); !st) return st;
      auto warm = target.decode();
      if (!warm) {
        target.deactivate();
        return warm.status();
      }
      r.warmups.push_back({pol, p, ms(warm->elapsed)});
      obs.warmup(r, r.warmups.back());
      for (int it = 0; it < schedule.iters; ++it) {
        obs.pausing(r, pol, p, it);
        auto paused = target.pause(schedule.pauses[p], pressure);
        if (!paused) {
          target.deactivate();
          return paused.status();
        }
        auto d = target.decode();
        if (!d) {
          target.deactivate();
          return d.status();
        }
        IdleSample s;
        s.policy = pol;
        s.pause = p;
        s.iter = it;
        s.decode_ms = ms(d->elapsed);
        s.idle_ms = ms(paused->idle);
        s.pressure_ms = ms(paused->pressure_time);
        s.resident_before = paused->resident_before;
        r.samples.push_back(s);
        obs.sample(r, s);
      }
      target.deactivate();
      obs.block_end(r, pol, p);
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
    for (std::size_t k = 0; k < cells.size(); ++k) s += " " + std::string(width[k] - cells[k].size(), ' ') + cells[k] + " |";
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
