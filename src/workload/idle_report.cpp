// SPDX-License-Identifier: MIT
// residency idle's result files (see idle_report.hpp).
#include "workload/idle_report.hpp"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "residency/config.hpp"
#include "residency/text.hpp"
#include "workload/pressure.hpp"

namespace residency::workload {
namespace {

double ms_of(Nanos d) { return static_cast<double>(d.count()) / 1e6; }

Status write_text(const std::string& path, const std::string& text) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  int err = fd < 0 ? errno : 0;
  for (std::size_t off = 0; fd >= 0 && err == 0 && off < text.size();) {
    const ssize_t n = write(fd, text.data() + off, text.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) err = errno;
    else off += static_cast<std::size_t>(n);
  }
  if (fd >= 0 && close(fd) != 0 && err == 0) err = errno;
  if (err != 0) {
    return Status(ErrorCode::io_error, printable(path) + ": cannot write the results file: " + std::strerror(err));
  }
  return {};
}

// The full path of `program` on $PATH, or "".
std::string find_on_path(const std::string& program) {
  const char* env = std::getenv("PATH");
  const std::string path = env ? env : "/usr/bin:/bin";
  std::size_t start = 0;
  while (start <= path.size()) {
    const std::size_t end = path.find(':', start);
    const std::string dir = path.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (!dir.empty() && access((dir + "/" + program).c_str(), X_OK) == 0) return dir + "/" + program;
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return "";
}

// A gnuplot single-quoted string: '' stands for one quote inside. Nothing else is special inside
// single quotes except the end of the line, which would end the command and let the rest of the
// text run as gnuplot commands (system("...")): every string goes through printable() first, so it
// holds no newline or other control character.
std::string gp_quote(const std::string& s) {
  std::string out = "'";
  // (A title runs past printable()'s default of 80 bytes, which would cut it.)
  for (char c : printable(s, 400)) out += c == '\'' ? std::string("''") : std::string(1, c);
  return out + "'";
}

// Runs gnuplot (`program`, a full path) in `dir` with `script` on its standard input, without a
// shell; its own messages are kept out of our output. The script names its output relative to
// `dir`, so no path of the user's is ever part of it. A socket rather than a pipe: send() with
// MSG_NOSIGNAL cannot raise SIGPIPE if gnuplot stops reading.
bool run_gnuplot(const std::string& program, const std::string& dir, const std::string& script) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return false;
  const pid_t pid = fork();
  if (pid < 0) {
    close(sv[0]);
    close(sv[1]);
    return false;
  }
  if (pid == 0) {  // async-signal-safe calls only: the parent has threads
    if (chdir(dir.c_str()) != 0) _exit(126);
    const int devnull = open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (dup2(sv[1], 0) < 0 || devnull < 0 || dup2(devnull, 1) < 0 || dup2(devnull, 2) < 0) _exit(126);
    char* const argv[] = {const_cast<char*>("gnuplot"), nullptr};
    execv(program.c_str(), argv);
    _exit(127);
  }
  close(sv[1]);
  bool sent = true;
  for (std::size_t off = 0; off < script.size();) {
    const ssize_t n = send(sv[0], script.data() + off, script.size() - off, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      sent = false;
      break;
    }
    off += static_cast<std::size_t>(n);
  }
  close(sv[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return false;
  }
  return sent && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

}  // namespace

// The target a pause should meet: the next decode within this factor of the zero-pause one.
constexpr double kTargetFactor = 1.10;

std::string idle_plot_label(const IdlePolicy& policy) {
  if (policy.kind == IdlePolicy::Kind::off && policy.id == "off") {
    return policy.name + " (no residency: nothing locked, the kernel's paging alone)";
  }
  return policy.name;
}

namespace {

std::string num(const char* format, double v) {
  char buf[48];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

// The fastest policy's mean decode at pause 0: no pressure has been applied before it, so it is
// what a decode costs with the model warm and nothing to wire (policy 0 re-wires even at pause 0,
// so not every policy's pause-0 time is a baseline). 0 when the schedule has no pause 0.
double zero_pause_baseline(const IdleResults& r) {
  double best = 0;
  for (std::size_t p = 0; p < r.schedule.pauses.size(); ++p) {
    if (r.schedule.pauses[p].count() != 0) continue;
    for (std::size_t k = 0; k < r.policies.size(); ++k) {
      const auto c = r.cell(k, p);
      if (c.n > 0 && c.mean_ms > 0 && (best == 0 || c.mean_ms < best)) best = c.mean_ms;
    }
  }
  return best;
}

// A logarithmic y axis, so that 1.10x is the same height wherever the curves are, and a right axis
// in multiples of the baseline: the band stays visible next to decodes 50x slower. Both axes over
// the same range, the data's (gnuplot links no logarithmic axes); the left one ticked at 1, 2 and
// 5 times the powers of ten (a log axis labels decades only, often one or none over a run's range).
std::string log_axes(const IdleResults& r, double baseline) {
  double lo = baseline, hi = baseline * kTargetFactor;
  for (std::size_t k = 0; k < r.policies.size(); ++k) {
    for (std::size_t p = 0; p < r.schedule.pauses.size(); ++p) {
      const auto c = r.cell(k, p);
      if (c.n == 0 || c.mean_ms <= 0) continue;
      lo = std::min(lo, c.mean_ms);
      hi = std::max(hi, c.mean_ms + c.sd_ms);
    }
  }
  lo /= 1.25;
  hi *= 1.25;
  const std::string range = "[" + num("%.4f", lo) + ":" + num("%.4f", hi) + "]";
  std::string s = "set logscale y\nset logscale y2\nset yrange " + range + "\nset y2range " + range + "\n";
  s += "set ylabel 'decode time (ms, log scale), mean +/- sd'\nset y2label 'times the zero-pause baseline'\n";
  std::string tics;
  for (double decade = std::pow(10.0, std::floor(std::log10(lo))); decade <= hi; decade *= 10) {
    for (double m : {1.0, 2.0, 5.0}) {
      const double v = decade * m;
      if (v >= lo && v <= hi) tics += (tics.empty() ? "'" : ", '") + num("%g", v) + "' " + num("%g", v);
    }
  }
  s += "set ytics nomirror" + (tics.empty() ? std::string() : " (" + tics + ")") + "\n";
  // (1x is the dotted baseline itself; its label would overlap 1.1x.)
  std::string y2;
  for (double m : {kTargetFactor, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0}) {
    y2 += (y2.empty() ? "'" : ", '") + num("%g", m) + "x' " + num("%.4f", baseline * m);
  }
  return s + "set y2tics (" + y2 + ")\n";
}

// Policy k's points, "pause mean sd" a line. A keep-alive policy's are joined only within a
// regime: before its expiry the model is held, after it the model was given back, so between the
// two is a step at the expiry, not the ramp a line through both would draw; a blank line ends
// gnuplot's line there.
std::string data_block(const IdleResults& r, std::size_t k) {
  const IdlePolicy& policy = r.policies[k];
  const double expiry = policy.kind == IdlePolicy::Kind::keep_alive ? ms_of(policy.keep_alive.duration) : -1;
  std::string s = "$p" + std::to_string(k) + " << EOD\n";
  bool before_expiry = true, any = false;
  for (std::size_t p = 0; p < r.schedule.pauses.size(); ++p) {
    const auto c = r.cell(k, p);
    if (c.n == 0) continue;
    const double pause = ms_of(r.schedule.pauses[p]);
    if (expiry >= 0 && before_expiry && pause >= expiry) {
      if (any) s += "\n";
      before_expiry = false;
    }
    s += num("%.0f", pause) + " " + num("%.4f", c.mean_ms) + " " + num("%.4f", c.sd_ms) + "\n";
    any = true;
  }
  return s + "EOD\n";
}

}  // namespace

// The plot: decode time against pause, one line per policy (data_block), the zero-pause baseline
// and the band up to kTargetFactor times it on log axes (log_axes), so that whether a policy meets
// the target can be read off the picture, each keep-alive's expiry as a dashed line, and the
// legend below the plot area, never over a curve.
std::string idle_plot_script(const std::string& terminal, const std::string& path, const IdleResults& r,
                             const IdleRunInfo& info) {
  std::string s = "set terminal " + terminal + " size 1100,800 noenhanced\n";
  s += "set output " + gp_quote(path) + "\n";
  // Two title lines: single-quoted strings joined by gnuplot's "\n" (single quotes keep every other
  // character literal).
  s += "set title " +
       gp_quote(info.tool + ": decode time after a pause (" + format_size(info.model_bytes) + " model, pressure " +
                r.pressure.to_string() + ")") +
       ".\"\\n\"." + gp_quote(info.backend) + "\n";
  s += "set xlabel 'pause before the decode (ms)'\n";
  // The legend below the plot area, one entry per line, at the bottom of the picture; the plot area
  // ends high enough above it (about 24 px per entry of 800) that the x label stands clear.
  const std::size_t entries = r.policies.size() + 2;
  const double bottom = std::min(0.5, (24.0 * static_cast<double>(entries) + 110.0) / 800.0);
  s += "set grid\nset key at screen 0.5, screen 0.02 center bottom vertical Left reverse box spacing 1.25\n";
  s += "set bmargin at screen " + num("%.3f", bottom) + "\n";
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
  const double baseline = zero_pause_baseline(r);
  s += baseline > 0 ? log_axes(r, baseline) : "set ylabel 'decode time (ms), mean +/- sd'\nset yrange [0:*]\n";
  for (std::size_t k = 0; k < r.policies.size(); ++k) s += data_block(r, k);
  s += "plot ";
  if (baseline > 0) {
    const std::string b = num("%.4f", baseline);
    s += "'+' using 1:(" + b + "):(" + num("%.4f", baseline * kTargetFactor) +
         ") with filledcurves fillcolor rgb '#cfe8cf' fillstyle solid 1.0 noborder title " +
         gp_quote("target: within " + num("%.2f", kTargetFactor) + "x the baseline") + ", ";
    s += b + " with lines dashtype 3 linewidth 2 linecolor rgb 'black' title " +
         gp_quote("zero-pause baseline " + num("%.2f", baseline) + " ms (the fastest policy at pause 0)") + ", ";
  }
  // mean +/- sd; on the log axis a lower end at or below 0 is drawn to the bottom of the plot.
  const std::string columns = baseline > 0 ? " using 1:2:($2 - $3 > 0 ? $2 - $3 : 1e-9):($2 + $3)" : " using 1:2:3";
  // Okabe-Ito colours (told apart with any colour vision; no yellow on white), and a dash type and
  // a point type of each line's own, so that two lines differ even in grey.
  static constexpr const char* kColours[] = {"#0072B2", "#D55E00", "#009E73", "#CC79A7",
                                             "#E69F00", "#56B4E9", "#555555"};
  static constexpr int kPoints[] = {7, 5, 9, 11, 13, 3, 1};
  constexpr std::size_t kStyles = sizeof kPoints / sizeof kPoints[0];
  for (std::size_t k = 0; k < r.policies.size(); ++k) {
    if (k) s += ", ";
    s += "$p" + std::to_string(k) + columns + " with yerrorlines lw 2 linecolor rgb '" + kColours[k % kStyles] +
         "' dashtype " + std::to_string(k % 5 + 1) + " pt " + std::to_string(kPoints[k % kStyles]) + " ps 1.2 title " +
         gp_quote(idle_plot_label(r.policies[k]));
  }
  return s + "\n";
}

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
  for (const auto& p : r.policies)
    policies.push_back({{"id", p.id}, {"name", p.name}, {"keep_alive", p.keep_alive.to_string()}});
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
    if (s.hog) {
      samples.back()["hog"] = {{"got", s.hog->got},
                               {"waited_ms", s.hog->waited_ms},
                               {"attempts", s.hog->attempts},
                               {"oom_killed", s.hog->oom_killed}};
    }
  }
  j["samples"] = samples;
  json warmups = json::array();
  for (const auto& w : r.warmups) {
    warmups.push_back(
        {{"policy", r.policies[w.policy].id}, {"pause_ms", ms_of(r.schedule.pauses[w.pause])}, {"decode_ms", w.decode_ms}});
  }
  j["warmups"] = warmups;
  j["wall_seconds"] = r.wall_seconds;
  return write_text(path, j.dump(2) + "\n");
}

Status write_idle_csv(const std::string& path, const IdleResults& r) { return write_text(path, format_idle_csv(r)); }

std::string write_idle_plot(const std::string& path, const IdleResults& r, const IdleRunInfo& info) {
  const std::string gnuplot = find_on_path("gnuplot");
  if (gnuplot.empty()) return "gnuplot is not installed, so there is no plot (apt-get install gnuplot-nox)";
  const std::filesystem::path p(path);
  const std::string name = p.filename().string();
  const std::string dir = p.has_parent_path() ? p.parent_path().string() : ".";
  // The file name is the program's own (idle.png, llama-idle.png); refuse anything else rather
  // than put it in a script.
  if (name.empty() ||
      name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-") != std::string::npos) {
    return "no plot: the file name '" + printable(name) + "' is not a plain name";
  }
  for (const char* terminal : {"pngcairo", "png"}) {
    if (run_gnuplot(gnuplot, dir, idle_plot_script(terminal, name, r, info))) return {};
  }
  std::remove(path.c_str());
  return "gnuplot failed to draw " + printable(path) + " (no png terminal?)";
}

}  // namespace residency::workload
