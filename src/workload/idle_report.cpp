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
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "residency/config.hpp"
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
  for (char c : printable(s)) out += c == '\'' ? std::string("''") : std::string(1, c);
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
    warmups.push_back({{"policy", r.policies[w.policy].id}, {"pause_ms", ms_of(r.schedule.pauses[w.pause])}, {"decode_ms", w.decode_ms}});
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
  if (name.empty() || name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-") != std::string::npos) {
    return "no plot: the file name '" + printable(name) + "' is not a plain name";
  }
  for (const char* terminal : {"pngcairo", "png"}) {
    if (run_gnuplot(gnuplot, dir, plot_script(terminal, name, r, info))) return {};
  }
  std::remove(path.c_str());
  return "gnuplot failed to draw " + printable(path) + " (no png terminal?)";
}

}  // namespace residency::workload
