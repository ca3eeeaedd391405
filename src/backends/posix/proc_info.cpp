// SPDX-License-Identifier: MIT
// residency posix backend: /proc and cgroup parsers and readers (see proc_info.hpp).
#include "backends/posix/proc_info.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <limits>
#include <vector>

namespace residency::posix {
namespace {

// The kernel prints sizes in "kB", which are KiB.
constexpr std::uint64_t kKiB = 1024;
// PSI window limits enforced by the kernel (kernel/sched/psi.c WINDOW_MIN_US / WINDOW_MAX_US),
// and the granularity it demands from processes without CAP_SYS_RESOURCE (Linux >= 6.4).
constexpr std::int64_t kPsiWindowMinUs = 500'000;
constexpr std::int64_t kPsiWindowMaxUs = 10'000'000;
constexpr std::int64_t kPsiUnprivilegedWindowUs = 2'000'000;

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

std::vector<std::string_view> split_lines(std::string_view text) {
  std::vector<std::string_view> lines;
  while (!text.empty()) {
    const auto nl = text.find('\n');
    lines.push_back(text.substr(0, nl));
    if (nl == std::string_view::npos) break;
    text.remove_prefix(nl + 1);
  }
  return lines;
}

std::vector<std::string_view> split_fields(std::string_view s) {
  std::vector<std::string_view> out;
  std::size_t i = 0;
  while (i < s.size()) {
    while (i < s.size() && (s[i] == ' ' || s[i] == '\t')) ++i;
    const std::size_t start = i;
    while (i < s.size() && s[i] != ' ' && s[i] != '\t') ++i;
    if (i > start) out.push_back(s.substr(start, i - start));
  }
  return out;
}

std::optional<std::uint64_t> to_u64(std::string_view s, int base = 10) {
  std::uint64_t v = 0;
  if (s.empty()) return std::nullopt;
  const auto* end = s.data() + s.size();
  const auto [p, ec] = std::from_chars(s.data(), end, v, base);
  if (ec != std::errc() || p != end) return std::nullopt;
  return v;
}

std::optional<double> to_double(std::string_view s) {
  // std::from_chars for double is missing from older libstdc++/libc++; PSI averages are
  // "<digits>.<digits>", parsed by hand, exactly.
  const auto dot = s.find('.');
  const auto whole = to_u64(s.substr(0, dot));
  if (!whole) return std::nullopt;
  double v = static_cast<double>(*whole);
  if (dot != std::string_view::npos) {
    const auto frac_text = s.substr(dot + 1);
    const auto frac = to_u64(frac_text);
    if (!frac || frac_text.size() > 9) return std::nullopt;
    double scale = 1;
    for (std::size_t i = 0; i < frac_text.size(); ++i) scale *= 10;
    v += static_cast<double>(*frac) / scale;
  }
  return v;
}

std::string quoted(std::string_view line) {
  constexpr std::size_t kMaxShown = 80;  // keep messages one readable line
  std::string s(line.substr(0, kMaxShown));
  if (line.size() > kMaxShown) s += "...";
  return "'" + s + "'";
}

// "<name>: <number> kB" (or without unit, for counters) -> bytes.
Result<std::uint64_t> kb_value(std::string_view file, std::string_view line, std::string_view rest) {
  const auto f = split_fields(rest);
  if (f.size() == 2 && f[1] == "kB") {
    if (auto v = to_u64(f[0]); v && *v <= std::numeric_limits<std::uint64_t>::max() / kKiB) return *v * kKiB;
  }
  return Status(ErrorCode::io_error, std::string(file) + ": expected '<name>: <number> kB', found " + quoted(line));
}

Result<PressureReading> parse_pressure_fields(std::string_view line, std::string_view rest) {
  PressureReading r;
  bool seen[4] = {false, false, false, false};
  for (auto field : split_fields(rest)) {
    const auto eq = field.find('=');
    if (eq == std::string_view::npos) {
      return Status(ErrorCode::io_error, "PSI: expected key=value fields, found " + quoted(line));
    }
    const auto key = field.substr(0, eq);
    const auto val = field.substr(eq + 1);
    bool ok = false;
    if (key == "avg10" || key == "avg60" || key == "avg300") {
      if (auto d = to_double(val)) {
        (key == "avg10" ? r.avg10 : key == "avg60" ? r.avg60 : r.avg300) = *d;
        seen[key == "avg10" ? 0 : key == "avg60" ? 1 : 2] = true;
        ok = true;
      }
    } else if (key == "total") {
      if (auto t = to_u64(val)) {
        r.total_us = *t;
        seen[3] = true;
        ok = true;
      }
    } else {
      ok = true;  // a field a later kernel may add: ignored
    }
    if (!ok) return Status(ErrorCode::io_error, "PSI: bad number in " + quoted(line));
  }
  for (bool s : seen) {
    if (!s) return Status(ErrorCode::io_error, "PSI: expected avg10=, avg60=, avg300= and total= in " + quoted(line));
  }
  return r;
}

std::string decode_octal_escapes(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size()) {
      const auto code = to_u64(s.substr(i + 1, 3), 8);
      if (code && *code < 256) {
        out.push_back(static_cast<char>(*code));
        i += 3;
        continue;
      }
    }
    out.push_back(s[i]);
  }
  return out;
}

std::string errno_text(int err) { return std::string(std::strerror(err)); }

// Reads a whole (small, /proc-like) file; on failure sets `err` to the errno.
std::optional<std::string> read_file_errno(const std::string& path, int& err) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    err = errno;
    return std::nullopt;
  }
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      err = errno;
      ::close(fd);
      return std::nullopt;
    }
    if (n == 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return out;
}

}  // namespace

Result<MemInfo> parse_meminfo(std::string_view text) {
  MemInfo mi;
  bool have_total = false;
  for (auto raw : split_lines(text)) {
    const auto line = trim(raw);
    if (line.empty()) continue;
    const auto colon = line.find(':');
    if (colon == std::string_view::npos) {
      return Status(ErrorCode::io_error, "/proc/meminfo: expected '<name>: <value>', found " + quoted(line));
    }
    const auto name = line.substr(0, colon);
    const auto rest = line.substr(colon + 1);
    if (name == "MemTotal" || name == "MemAvailable" || name == "Mlocked" || name == "SwapTotal") {
      auto v = kb_value("/proc/meminfo", line, rest);
      if (!v) return v.status();
      if (name == "MemTotal") {
        mi.mem_total = *v;
        have_total = true;
      } else if (name == "MemAvailable") {
        mi.mem_available = *v;
      } else if (name == "SwapTotal") {
        mi.swap_total = *v;
      } else {
        mi.mlocked = *v;
      }
    }
  }
  if (!have_total) return Status(ErrorCode::io_error, "/proc/meminfo: no MemTotal line");
  return mi;
}

Result<ProcStatus> parse_proc_status(std::string_view text) {
  ProcStatus st;
  for (auto raw : split_lines(text)) {
    const auto line = trim(raw);
    const auto colon = line.find(':');
    if (colon == std::string_view::npos) continue;  // status has free-form lines; only ours matter
    const auto name = line.substr(0, colon);
    const auto rest = trim(line.substr(colon + 1));
    if (name == "VmLck") {
      auto v = kb_value("/proc/self/status", line, rest);
      if (!v) return v.status();
      st.vm_lck = *v;
    } else if (name == "CapEff") {
      auto v = to_u64(rest, 16);
      if (!v || rest.size() > 16) {
        return Status(ErrorCode::io_error, "/proc/self/status: expected 'CapEff: <hex mask>', found " + quoted(line));
      }
      st.cap_eff = *v;
    }
  }
  return st;
}

Result<PressureText> parse_pressure(std::string_view text) {
  PressureText pt;
  bool have_some = false;
  for (auto raw : split_lines(text)) {
    const auto line = trim(raw);
    if (line.empty()) continue;
    const auto sp = line.find(' ');
    const auto kind = line.substr(0, sp);
    const auto rest = sp == std::string_view::npos ? std::string_view() : line.substr(sp + 1);
    if (kind != "some" && kind != "full") {
      return Status(ErrorCode::io_error, "PSI: expected lines starting 'some' or 'full', found " + quoted(line));
    }
    auto r = parse_pressure_fields(line, rest);
    if (!r) return r.status();
    if (kind == "some") {
      pt.some = *r;
      pt.some_line = std::string(line);
      have_some = true;
    } else {
      pt.full = *r;
      pt.full_line = std::string(line);
    }
  }
  if (!have_some) return Status(ErrorCode::io_error, "PSI: no 'some' line");
  return pt;
}

Result<std::optional<std::string>> parse_cgroup_v2_path(std::string_view text) {
  std::optional<std::string> path;
  for (auto raw : split_lines(text)) {
    const auto line = trim(raw);
    if (line.empty()) continue;
    // hierarchy-ID:controller-list:cgroup-path; the path may itself contain ':'.
    const auto c1 = line.find(':');
    const auto c2 = c1 == std::string_view::npos ? c1 : line.find(':', c1 + 1);
    if (c2 == std::string_view::npos || !to_u64(line.substr(0, c1))) {
      return Status(ErrorCode::io_error, "/proc/self/cgroup: expected 'id:controllers:path', found " + quoted(line));
    }
    if (line.substr(0, c1) == "0" && c2 == c1 + 1) {
      auto p = line.substr(c2 + 1);
      constexpr std::string_view kDeleted = " (deleted)";
      if (p.size() >= kDeleted.size() && p.substr(p.size() - kDeleted.size()) == kDeleted) {
        p.remove_suffix(kDeleted.size());
      }
      if (p.empty() || p.front() != '/') {
        return Status(ErrorCode::io_error, "/proc/self/cgroup: cgroup v2 path is not absolute in " + quoted(line));
      }
      path = std::string(p);
    }
  }
  return path;
}

namespace {

// The first mount in /proc/self/mountinfo whose file system type is `fstype` and, when
// `super_option` is not empty, whose super options include it. Each line is
// "id parent major:minor root mount-point options [optional...] - fstype source super-options".
Result<std::optional<CgroupMount>> find_mount(std::string_view text, std::string_view fstype,
                                              std::string_view super_option) {
  for (auto raw : split_lines(text)) {
    const auto line = trim(raw);
    if (line.empty()) continue;
    const auto f = split_fields(line);
    std::size_t dash = 0;
    for (std::size_t i = 6; i < f.size(); ++i) {
      if (f[i] == "-") {
        dash = i;
        break;
      }
    }
    if (f.size() < 7 || dash == 0 || dash + 1 >= f.size()) {
      return Status(ErrorCode::io_error,
                    "/proc/self/mountinfo: expected 'id parent dev root mount-point options ... - fstype ...', found " +
                        quoted(line));
    }
    if (f[dash + 1] != fstype) continue;
    bool has_option = super_option.empty();
    if (!has_option) {
      const std::string_view opts = dash + 3 < f.size() ? f[dash + 3] : std::string_view();
      for (std::size_t at = 0; at <= opts.size() && !has_option;) {
        const std::size_t comma = std::min(opts.find(',', at), opts.size());
        has_option = opts.substr(at, comma - at) == super_option;
        at = comma + 1;
      }
    }
    if (has_option)
      return std::optional<CgroupMount>(CgroupMount{decode_octal_escapes(f[4]), decode_octal_escapes(f[3])});
  }
  return std::optional<CgroupMount>();
}

}  // namespace

Result<std::optional<CgroupMount>> parse_cgroup2_mount(std::string_view text) {
  return find_mount(text, "cgroup2", "");
}

std::optional<std::string> cgroup_dir(const CgroupMount& mount, std::string_view cgroup_path) {
  std::string_view rel = cgroup_path;
  if (mount.root != "/") {
    const std::string_view root = mount.root;
    if (rel.substr(0, root.size()) != root || (rel.size() > root.size() && rel[root.size()] != '/')) {
      return std::nullopt;
    }
    rel.remove_prefix(root.size());
  }
  std::string dir = mount.mount_point;
  while (!dir.empty() && dir.back() == '/') dir.pop_back();
  while (!rel.empty() && rel.back() == '/') rel.remove_suffix(1);
  dir += rel;
  if (dir.empty()) dir = "/";
  return dir;
}

Result<std::optional<std::uint64_t>> parse_memory_max(std::string_view text) {
  const auto t = trim(text.substr(0, text.find('\n')));
  if (t == "max") return std::optional<std::uint64_t>();
  if (auto v = to_u64(t)) return std::optional<std::uint64_t>(*v);
  return Status(ErrorCode::io_error, "memory.max: expected a byte count or 'max', found " + quoted(t));
}

Result<std::optional<std::string>> parse_cgroup_v1_memory_path(std::string_view text) {
  for (auto raw : split_lines(text)) {
    const auto line = trim(raw);
    if (line.empty()) continue;
    const auto c1 = line.find(':');
    const auto c2 = c1 == std::string_view::npos ? c1 : line.find(':', c1 + 1);
    if (c2 == std::string_view::npos || !to_u64(line.substr(0, c1))) {
      return Status(ErrorCode::io_error, "/proc/self/cgroup: expected 'id:controllers:path', found " + quoted(line));
    }
    const auto controllers = line.substr(c1 + 1, c2 - c1 - 1);
    bool memory = false;
    for (std::size_t at = 0; at <= controllers.size();) {
      const std::size_t comma = std::min(controllers.find(',', at), controllers.size());
      if (controllers.substr(at, comma - at) == "memory") memory = true;
      at = comma + 1;
    }
    if (!memory) continue;
    auto p = line.substr(c2 + 1);
    if (p.empty() || p.front() != '/')
      return Status(ErrorCode::io_error, "/proc/self/cgroup: cgroup v1 memory path is not absolute in " + quoted(line));
    return std::optional<std::string>(std::string(p));
  }
  return std::optional<std::string>();
}

Result<std::optional<CgroupMount>> parse_cgroup_v1_memory_mount(std::string_view text) {
  return find_mount(text, "cgroup", "memory");
}

Result<std::optional<std::uint64_t>> parse_memory_limit_v1(std::string_view text) {
  const auto t = trim(text.substr(0, text.find('\n')));
  auto v = to_u64(t);
  if (!v) return Status(ErrorCode::io_error, "memory.limit_in_bytes: expected a byte count, found " + quoted(t));
  if (*v >= (std::uint64_t{1} << 62)) return std::optional<std::uint64_t>();  // "no limit"
  return std::optional<std::uint64_t>(*v);
}

Result<std::string> make_psi_trigger(Nanos stall, Nanos window, bool privileged) {
  const auto stall_us = std::chrono::duration_cast<std::chrono::microseconds>(stall).count();
  const auto window_us = std::chrono::duration_cast<std::chrono::microseconds>(window).count();
  if (window_us < kPsiWindowMinUs || window_us > kPsiWindowMaxUs) {
    return Status(ErrorCode::invalid_argument,
                  "PSI window " + std::to_string(window_us) + " us is outside what the kernel accepts (500 ms to 10 s)");
  }
  if (stall_us <= 0 || stall_us > window_us) {
    return Status(ErrorCode::invalid_argument, "PSI stall threshold " + std::to_string(stall_us) +
                                                   " us must be > 0 and <= the window (" + std::to_string(window_us) +
                                                   " us)");
  }
  if (!privileged && window_us % kPsiUnprivilegedWindowUs != 0) {
    return Status(ErrorCode::invalid_argument,
                  "PSI window " + std::to_string(window_us) +
                      " us: without CAP_SYS_RESOURCE the kernel accepts only multiples of 2 s; use 2 s, 4 s, ...");
  }
  return "some " + std::to_string(stall_us) + " " + std::to_string(window_us);
}

Result<std::string> read_text_file(const std::string& path) {
  int err = 0;
  auto text = read_file_errno(path, err);
  if (!text) return Status(ErrorCode::io_error, "cannot read " + path + ": " + errno_text(err));
  return std::move(*text);
}

Result<MemInfo> read_meminfo() {
  auto text = read_text_file("/proc/meminfo");
  if (!text) return text.status();
  return parse_meminfo(*text);
}

Result<ProcStatus> read_proc_status() {
  auto text = read_text_file("/proc/thread-self/status");  // Linux >= 4.1
  if (!text) text = read_text_file("/proc/self/status");
  if (!text) return text.status();
  return parse_proc_status(*text);
}

Result<CgroupLocation> find_cgroup_v2() {
  auto cg_text = read_text_file("/proc/self/cgroup");
  if (!cg_text) return cg_text.status();
  auto path = parse_cgroup_v2_path(*cg_text);
  if (!path) return path.status();
  if (!path->has_value()) {
    return Status(ErrorCode::unsupported,
                  "this process is in no cgroup v2 hierarchy (/proc/self/cgroup has no '0::' line)");
  }
  auto mi_text = read_text_file("/proc/self/mountinfo");
  if (!mi_text) return mi_text.status();
  auto mount = parse_cgroup2_mount(*mi_text);
  if (!mount) return mount.status();
  if (!mount->has_value()) return Status(ErrorCode::unsupported, "no cgroup2 file system is mounted");
  auto dir = cgroup_dir(**mount, **path);
  if (!dir) {
    return Status(ErrorCode::unsupported, "cgroup " + **path + " lies outside the cgroup2 mount at " +
                                              (*mount)->mount_point + " (root " + (*mount)->root + ")");
  }
  return CgroupLocation{**path, *dir};
}

Result<MemoryCgroup> find_memory_cgroup() {
  auto cg_text = read_text_file("/proc/self/cgroup");
  if (!cg_text) return cg_text.status();
  auto v1 = parse_cgroup_v1_memory_path(*cg_text);
  if (!v1) return v1.status();
  if (v1->has_value()) {
    auto mi_text = read_text_file("/proc/self/mountinfo");
    if (!mi_text) return mi_text.status();
    auto mount = parse_cgroup_v1_memory_mount(*mi_text);
    if (!mount) return mount.status();
    if (!mount->has_value())
      return Status(ErrorCode::unsupported,
                    "/proc/self/cgroup names a cgroup v1 memory controller, but it is not mounted");
    auto dir = cgroup_dir(**mount, **v1);
    if (!dir)
      return Status(ErrorCode::unsupported,
                    "cgroup " + **v1 + " lies outside the cgroup v1 memory mount at " + (*mount)->mount_point);
    return MemoryCgroup{1, **v1, *dir};
  }
  auto v2 = find_cgroup_v2();
  if (!v2) return v2.status();
  return MemoryCgroup{2, v2->cgroup_path, v2->dir};
}

Result<std::optional<std::uint64_t>> read_memory_cgroup_limit(const MemoryCgroup& cg) {
  if (cg.cgroup_path == "/") return std::optional<std::uint64_t>();  // the root cgroup has no limit of its own
  const std::string path = cg.dir + (cg.version == 1 ? "/memory.limit_in_bytes" : "/memory.max");
  int err = 0;
  auto text = read_file_errno(path, err);
  if (!text) {
    if (err == ENOENT) return Status(ErrorCode::not_found, path + " is missing");
    return Status(ErrorCode::io_error, "cannot read " + path + ": " + errno_text(err));
  }
  auto v = cg.version == 1 ? parse_memory_limit_v1(*text) : parse_memory_max(*text);
  if (!v) return Status(ErrorCode::io_error, path + ": " + v.message());
  return *v;
}

std::optional<std::uint64_t> memory_cgroup_limit(const MemoryCgroup& cg) {
  auto v = read_memory_cgroup_limit(cg);
  if (!v) return std::nullopt;
  return *v;
}

std::optional<std::uint64_t> parse_memory_stat_value(std::string_view text, std::string_view key) {
  for (std::string_view line : split_lines(text)) {
    const auto f = split_fields(line);
    if (f.size() == 2 && f[0] == key) return to_u64(f[1]);
  }
  return std::nullopt;
}

std::optional<std::uint64_t> memory_cgroup_headroom(const MemoryCgroup& cg) {
  const std::string& path = cg.cgroup_path;
  if (path.empty() || path == "/" || path.front() != '/' || cg.dir.size() < path.size() ||
      cg.dir.compare(cg.dir.size() - path.size(), path.size(), path) != 0)
    return std::nullopt;
  const std::string mount = cg.dir.substr(0, cg.dir.size() - path.size());
  const bool v1 = cg.version == 1;
  std::optional<std::uint64_t> least;
  // This cgroup, then each parent up to (not including) the root, which has no limit of its own.
  for (std::string p = path; p.size() > 1; p = p.substr(0, std::max<std::size_t>(p.rfind('/'), 1))) {
    const MemoryCgroup level{cg.version, p, mount + p};
    const auto limit = memory_cgroup_limit(level);
    if (!limit) continue;
    auto usage_text = read_text_file(level.dir + (v1 ? "/memory.usage_in_bytes" : "/memory.current"));
    auto stat_text = read_text_file(level.dir + "/memory.stat");
    if (!usage_text || !stat_text) continue;
    const auto usage = to_u64(trim(std::string_view(*usage_text).substr(0, usage_text->find('\n'))));
    if (!usage) continue;
    // File pages on the LRU lists (active or not; locked ones are on the unevictable list) can be
    // reclaimed, and wiring a page that is cached already takes no new memory.
    const std::uint64_t file =
        std::min(parse_memory_stat_value(*stat_text, v1 ? "total_inactive_file" : "inactive_file").value_or(0) +
                     parse_memory_stat_value(*stat_text, v1 ? "total_active_file" : "active_file").value_or(0),
                 *usage);
    const std::uint64_t headroom = (*limit > *usage ? *limit - *usage : 0) + file;
    least = least ? std::min(*least, headroom) : headroom;
  }
  return least;
}

PressureInfo read_pressure(const std::string& path) {
  PressureInfo info;
  info.path = path;
  int err = 0;
  auto text = read_file_errno(path, err);
  if (!text) {
    info.reason = "cannot read " + path + ": " + errno_text(err);
    if (err == ENOENT) info.reason += " (no PSI: Linux < 4.20 or CONFIG_PSI off)";
    if (err == EOPNOTSUPP) info.reason += " (PSI is compiled in but disabled: boot with psi=1)";
    return info;
  }
  auto parsed = parse_pressure(*text);
  if (!parsed) {
    info.reason = path + ": " + parsed.message();
    return info;
  }
  info.available = true;
  info.some_line = parsed->some_line;
  info.full_line = parsed->full_line;
  info.some = parsed->some;
  info.full = parsed->full;
  return info;
}

}  // namespace residency::posix
