// SPDX-License-Identifier: MIT
// /proc/PID/stat (see proc_stat.hpp).
#include "platform/proc_stat.hpp"

#include <cerrno>
#include <charconv>
#include <string>

#if defined(__linux__)
#include <fcntl.h>
#include <unistd.h>
#endif

namespace residency::platform {
namespace {

// The next field of `rest`, separated by spaces (the file ends with a newline); empty at the end.
std::string_view next_field(std::string_view& rest) {
  const std::size_t begin = rest.find_first_not_of(" \n");
  if (begin == std::string_view::npos) {
    rest = {};
    return {};
  }
  rest.remove_prefix(begin);
  const std::size_t end = rest.find_first_of(" \n");
  const std::string_view field = rest.substr(0, end);
  rest.remove_prefix(end == std::string_view::npos ? rest.size() : end);
  return field;
}

std::optional<ProcStat> read_file(const std::string& path) {
#if defined(__linux__)
  // The whole file, not one line: COMM is whatever the process named itself (prctl PR_SET_NAME),
  // a newline included, and a line read would end inside it, so that field 22 would not parse
  // and a live holder would be taken for a dead one. The file is below 1 KiB; 4 KiB bounds it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::string text;
  char buf[1024];
  while (text.size() < 4096) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return parse_proc_stat(text);
#else
  (void)path;
  return std::nullopt;
#endif
}

}  // namespace

std::optional<ProcStat> parse_proc_stat(std::string_view line) {
  const std::size_t close = line.rfind(')');
  if (close == std::string_view::npos) return std::nullopt;
  std::string_view rest = line.substr(close + 1);
  ProcStat out;
  std::string_view field;
  for (int i = 3; i <= 22; ++i) {
    field = next_field(rest);
    if (field.empty()) return std::nullopt;
    if (i == 3) out.state = field.size() == 1 ? field[0] : '?';
  }
  const char* end = field.data() + field.size();
  const auto [ptr, ec] = std::from_chars(field.data(), end, out.start_time);
  if (ec != std::errc() || ptr != end) return std::nullopt;
  return out;
}

std::optional<ProcStat> read_proc_stat(int pid) {
  if (pid <= 0) return std::nullopt;
  return read_file("/proc/" + std::to_string(pid) + "/stat");
}

std::optional<ProcStat> read_own_proc_stat() { return read_file("/proc/self/stat"); }

}  // namespace residency::platform
