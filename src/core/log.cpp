// SPDX-License-Identifier: MIT
#include "log.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <ctime>

namespace residency {

namespace {

// Whether stderr is a regular file whose byte before the write position is not a newline: a
// host program (llama.cpp's loading dots, a progress line) left a line unfinished. Only a
// regular file can be read back; fd 2 is usually write-only, so the file is opened again for
// reading through /proc (Linux). Everywhere else: unknown, taken as "at a line start".
bool stderr_ends_mid_line() noexcept {
#if defined(__linux__)
  struct stat st {};
  if (::fstat(STDERR_FILENO, &st) != 0 || !S_ISREG(st.st_mode)) return false;
  const off_t at = ::lseek(STDERR_FILENO, 0, SEEK_CUR);  // O_APPEND: the end after the last write
  if (at <= 0) return false;
  const int fd = ::open("/proc/self/fd/2", O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) return false;
  char last = '\n';
  const bool got = ::pread(fd, &last, 1, at - 1) == 1;
  ::close(fd);
  return got && last != '\n';
#else
  return false;
#endif
}

// "YYYY-MM-DD hh:mm:ss.mmm " in local time.
std::string local_time_now() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  if (::localtime_r(&t, &tm) == nullptr) return {};
  char buf[40];
  const std::size_t n = std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
  std::snprintf(buf + n, sizeof buf - n, ".%03d ", static_cast<int>(ms));
  return buf;
}

// All of `line` with as few write(2) calls as the kernel allows (one, for a line this short).
void write_all_to_stderr(const std::string& line) noexcept {
  const char* p = line.data();
  std::size_t left = line.size();
  while (left > 0) {
    const ssize_t n = ::write(STDERR_FILENO, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // stderr closed or full: nowhere to say anything
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

}  // namespace

void log_to_stderr(LogLevel level, std::string_view message, bool with_time) {
  const int saved_errno = errno;  // callers log from inside hooks and error paths
  std::string line;
  line.reserve(message.size() + 64);
  if (stderr_ends_mid_line()) line += '\n';
  line += "residency[" + std::to_string(::getpid()) + "]: ";
  if (with_time) line += local_time_now();
  line += to_string(level);
  line += ": ";
  line += message;
  line += '\n';
  write_all_to_stderr(line);
  errno = saved_errno;
}

void log_to_stderr(LogLevel level, std::string_view message) { log_to_stderr(level, message, false); }

namespace core {

LogCallback stderr_log(const Config& config) {
  if (!config.log_time) return LogCallback(static_cast<void (*)(LogLevel, std::string_view)>(log_to_stderr));
  return [](LogLevel level, std::string_view message) { log_to_stderr(level, message, true); };
}

}  // namespace core
}  // namespace residency
