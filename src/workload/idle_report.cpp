// residency idle's result files (see idle_report.hpp).
#include "workload/idle_report.hpp"

#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "residency/config.hpp"
#include "workload/pressure.hpp"

namespace residency::workload {
namespace {


double ms_of(Nanos d) { return static_cast<double>(d.count()) / 1e6; }

Status write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::trunc);
  f << text;
  f.close();
  if (!f) return Status(ErrorCode::io_error, path + ": cannot write the results file");
  return {};
}

bool on_path(const std::string& program) {
  const char* env = std::getenv("PATH");
  const std::string path = env ? env : "/usr/bin:/bin";
  std::size_t start = 0;
  while (start <= path.size()) {
    const std::size_t end = path.find(':', start);
    const std::string dir = path.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (!dir.empty() && access((dir + "/" + program).c_str(), X_OK) == 0) return true;
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return false;
}

// A gnuplot single-quoted string: '' stands for one quote inside.
std::string gp_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("''") : std::string(1, c);
  return out + "'";
}

std::string plot_script(const std::string& terminal, const std::string& path, const IdleResults& r,
                        const IdleRunInfo& info) {
  std::string s = "set terminal " + terminal + " size 1000,600 noenhanced\n";
  s += "set output " + gp_quote(path) + "\n";
  // Two title lines: single-quoted strings joined by gnuplot's "\n" (single quotes keep every other
  // character literal).
  s += "set title " + gp_quote("residency idle: decode time after a pause (" + format_size(info.model_bytes) +
                               " model, pressure " + r.pressure.to_string() + ")") +
       ".\"\\n\"." + gp_quote(info.backend) + "\n";
  s += "set xlabel 'pause before the decode (ms)'\nset ylabel 'decode time (ms), mean +/- sd'\n";
  s += "set grid\nset key top left box opaque\nset yrange [0:*]\n";
  double max_pause = 0;
  for (Nanos p : r.schedule.pauses) max_pause = std::max(max_pause, ms_of(p));
  const double margin = std::max(100.0, max_pause * 0.05);
  s += "set xrange [" + std::to_string(-margin) + ":" + std::to_string(max_pause + margin) + "]\n";
  // Where each keep-alive expires, when the pauses reach it: the step the table shows.
  for (const auto& p : r.policies) {
    if (p.kind != IdlePolicy::Kind::keep_alive) continue;
    const double at = ms_of(p.keep_alive.duration);
    if (at > max_pause) continue;
    s += "set arrow from " + std::to_string(at) + ", graph 0 to " + std::to_string(at) +
         ", graph 1 nohead dashtype 2 linecolor rgb 'gray40'\n";
    s += "set label " + gp_quote(p.name + " expires") + " at " + std::to_string(at) +
         ", graph 0.95 offset 0.5, 0 left textcolor rgb 'gray40'\n";
  }
  for (std::size_t k = 0; k < r.policies.size(); ++k) {
    s += "$p" + std::to_string(k) + " << EOD\n";
    for (std::size_t p = 0; p < r.schedule.pauses.size(); ++p) {
      const auto c = r.cell(k, p);
      if (c.n == 0) continue;
      char buf[96];
      std::snprintf(buf, sizeof buf, "%.0f %.4f %.4f\n", ms_of(r.schedule.pauses[p]), c.mean_ms, c.sd_ms);
      s += buf;
    }
    s += "EOD\n";
  }
  s += "plot ";
  for (std::size_t k = 0; k < r.policies.size(); ++k) {
    if (k) s += ", ";
    s += "$p" + std::to_string(k) + " using 1:2:3 with yerrorlines lw 2 pt 7 ps 1.2 title " + gp_quote(r.policies[k].name);
  }
  return s + "\n";
}

// Runs gnuplot with `script` on its standard input; its own messages are kept out of our output.
bool run_gnuplot(const std::string& script) {
  FILE* p = popen("gnuplot 2>/dev/null", "w");
  if (!p) return false;
  std::fwrite(script.data(), 1, script.size(), p);
  const int rc = pclose(p);
  return rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0;
}

}  // namespace

Status write_idle_json(const std::string& path, const IdleResults& r, const IdleRunInfo& info) {
  using nlohmann::json;
  json j;
  j["tool"] = "residency idle";
  struct utsname u {};
  json machine{{"cpus", std::thread::hardware_concurrency()}};
  if (uname(&u) == 0) {
    machine["kernel"] = std::string(u.sysname) + " " + u.release;
    machine["arch"] = u.machine;
  }
  if (auto avail = mem_available()) machine["mem_available_bytes_at_end"] = *avail;
  j["machine"] = machine;
  j["model"] = {{"path", info.model_path},
                {"synthetic", info.synthetic_model},
                {"bytes", info.model_bytes},
                {"summary", info.model_summary}};
  j["backend"] = info.backend;
  j["pressure"] = r.pressure.to_string();
  json pauses = json::array();
  for (Nanos p : r.schedule.pauses) pauses.push_back(ms_of(p));
  j["schedule"] = {{"pauses_ms", pauses}, {"iters", r.schedule.iters}};
  json policies = json::array();
  for (const auto& p : r.policies) policies.push_back({{"id", p.id}, {"name", p.name}, {"keep_alive", p.keep_alive.to_string()}});
  j["policies"] = policies;
  json summary = json::array();
  for (std::size_t p = 0; p < r.schedule.pauses.size(); ++p) {
    for (std::size_t k = 0; k < r.policies.size(); ++k) {
      const auto c = r.cell(k, p);
      summary.push_back({{"policy", r.policies[k].id},
                         {"pause_ms", ms_of(r.schedule.pauses[p])},
                         {"n", c.n},
                         {"mean_ms", c.mean_ms},
                         {"sd_ms", c.sd_ms},
                         {"resident_before_pct", c.resident_before < 0 ? json(nullptr) : json(100 * c.resident_before)}});
    }
  }
  j["summary"] = summary;
  json samples = json::array();
  for (const auto& s : r.samples) {
    samples.push_back({{"policy", r.policies[s.policy].id},
                       {"pause_ms", ms_of(r.schedule.pauses[s.pause])},
                       {"iter", s.iter},
                       {"decode_ms", s.decode_ms},
                       {"idle_ms", s.idle_ms},
                       {"pressure_ms", s.pressure_ms},
                       {"resident_before_pct", s.resident_before < 0 ? json(nullptr) : json(100 * s.resident_before)}});
  }
  j["samples"] = samples;
  json warmups = json::array();
  for (const auto& w : r.warmups) {
    warmups.push_back({{"policy", r.policies[w.policy].id}, {"pause_ms", ms_of(r.schedule.pauses[w.pause])}, {"decode_ms", w.decode_ms}});
  }
  j["warmups"] = warmups;
  j["wall_seconds"] = r.wall_seconds;
  return write_text(path, j.dump(2) + "\n");
}

Status write_idle_csv(const std::string& path, const IdleResults& r) { return write_text(path, format_idle_csv(r)); }

std::string write_idle_plot(const std::string& path, const IdleResults& r, const IdleRunInfo& info) {
  if (!on_path("gnuplot")) return "gnuplot is not installed, so there is no plot (apt-get install gnuplot-nox)";
  for (const char* terminal : {"pngcairo", "png"}) {
    if (run_gnuplot(plot_script(terminal, path, r, info))) return {};
  }
  std::remove(path.c_str());
  return "gnuplot failed to draw " + path + " (no png terminal?)";
}

}  // namespace residency::workload
