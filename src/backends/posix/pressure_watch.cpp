// SPDX-License-Identifier: MIT
// residency posix backend: the pressure watch thread (see pressure_watch.hpp).
#include "backends/posix/pressure_watch.hpp"

#include <fcntl.h>
#include <poll.h>
#if defined(__linux__)
#include <sys/eventfd.h>
#endif
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <system_error>

namespace residency::posix {
namespace {
void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}
std::string err_text(int err) { return std::strerror(err); }
#if defined(__linux__)
std::string parent_dir(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}
#endif
// The "oom" count of a cgroup v2 memory.events (read from the start: the read also re-arms the
// kernel's notification); nullopt when it cannot be read. Not "max": the cgroup reaches its limit
// whenever reclaim of clean page cache is enough (loading a model in a tight container does),
// which is no reason to give memory back; "oom" counts the times reclaim was not enough.
std::optional<std::uint64_t> limit_events(int fd) {
  char buf[512];
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  if (n <= 0) return std::nullopt;
  buf[n] = '\0';
  // "oom N" starts a line (the first line is "low N"); "oom_kill N" is another key.
  const char* at = std::strstr(buf, "\noom ");
  return at != nullptr ? std::strtoull(at + 5, nullptr, 10) : 0;
}
constexpr Nanos kEventsWindow = std::chrono::seconds(2);
}  // namespace

Status PressureWatch::start(const std::string& path, const std::string& trigger, std::function<void()> on_pressure) {
  stop();
  int fd = ::open(path.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    std::string why = "cannot open " + path + " for writing a PSI trigger: " + err_text(err);
    if (err == ENOENT) why += " (no PSI: Linux < 4.20 or CONFIG_PSI off)";
    if (err == EOPNOTSUPP) why += " (PSI is compiled in but disabled: boot with psi=1)";
    if (err == EACCES || err == EROFS)
      why +=
          " (the file must be writable by this process; in a container mount the cgroup file system read-write or "
          "delegate the cgroup)";
    return Status(ErrorCode::unsupported, why);
  }
  // The kernel reads the trigger as a C string: the terminating NUL is part of the write
  // (without it the last digit is dropped and the window comes out 10x too small).
  const ssize_t n = ::write(fd, trigger.c_str(), trigger.size() + 1);
  if (n < 0) {
    const int err = errno;
    ::close(fd);
    std::string why = "the kernel refused the PSI trigger '" + trigger + "' on " + path + ": " + err_text(err);
    if (err == EPERM || err == EACCES) why += " (before Linux 6.4 PSI triggers need CAP_SYS_RESOURCE)";
    if (err == EINVAL) why += " (without CAP_SYS_RESOURCE the window must be a multiple of 2 s)";
    if (err == EOPNOTSUPP) why += " (PSI is compiled in but disabled: boot with psi=1)";
    return Status(ErrorCode::unsupported, why);
  }
  Source src;
  src.fd = fd;
  const std::string suffix = "/memory.pressure";
  if (path.size() > suffix.size() && path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0) {
    src.events_fd = ::open((parent_dir(path) + "/memory.events").c_str(), O_RDONLY | O_CLOEXEC);
    if (src.events_fd >= 0) {
      if (const auto seen = limit_events(src.events_fd)) {
        src.events_seen = *seen;
        src.window = kEventsWindow;
      } else {
        close_fd(src.events_fd);
      }
    }
  }
  return run(std::move(src), std::move(on_pressure));
}

Status PressureWatch::start_cgroup_v1(const std::string& level_file, const std::string& level, Nanos window,
                                      std::function<void()> on_pressure) {
  stop();
#if !defined(__linux__)
  (void)level;
  (void)window;
  (void)on_pressure;
  return Status(ErrorCode::unsupported, "cannot watch " + level_file + ": cgroup v1 pressure levels are Linux only");
#else
  const int lfd = ::open(level_file.c_str(), O_RDONLY | O_CLOEXEC);
  if (lfd < 0) {
    const int err = errno;
    return Status(ErrorCode::unsupported, "cannot open " + level_file + ": " + err_text(err) +
                                              (err == ENOENT ? " (no cgroup v1 memory controller there)" : ""));
  }
  const int efd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (efd < 0) {
    const int err = errno;
    ::close(lfd);
    return Status(ErrorCode::backend_error, "eventfd() for the pressure watch failed: " + err_text(err));
  }
  const std::string ctl = parent_dir(level_file) + "/cgroup.event_control";
  const int cfd = ::open(ctl.c_str(), O_WRONLY | O_CLOEXEC);
  if (cfd < 0) {
    const int err = errno;
    ::close(lfd);
    ::close(efd);
    return Status(ErrorCode::unsupported,
                  "cannot open " + ctl + " to register for " + level_file + ": " + err_text(err) +
                      (err == EACCES ? " (it is writable by its owner only: run as root or chown the cgroup)" : ""));
  }
  // "<event_fd> <fd of memory.pressure_level> <level>": the kernel keeps the registration until
  // the eventfd is closed or the cgroup is removed; the two other descriptors may go now.
  const std::string line = std::to_string(efd) + " " + std::to_string(lfd) + " " + level;
  const ssize_t n = ::write(cfd, line.c_str(), line.size());
  const int err = errno;
  ::close(cfd);
  ::close(lfd);
  if (n < 0) {
    ::close(efd);
    return Status(ErrorCode::unsupported, "the kernel refused the registration '" + level + "' on " + level_file +
                                              " (" + ctl + "): " + err_text(err));
  }
  Source src;
  src.fd = efd;
  src.eventfd = true;
  src.window = window;
  src.level_file = level_file;
  return run(std::move(src), std::move(on_pressure));
#endif
}

Status PressureWatch::run(Source src, std::function<void()> on_pressure) {
  int p[2];
  if (::pipe(p) != 0) {
    const int err = errno;
    ::close(src.fd);
    return Status(ErrorCode::backend_error, "pipe() for the pressure watch failed: " + err_text(err));
  }
  for (int e : p) ::fcntl(e, F_SETFD, FD_CLOEXEC);
  const int fd = src.fd;
  const int events_fd = src.events_fd;
  try {
    thread_ = std::thread(&PressureWatch::loop, std::move(src), p[0], std::move(on_pressure));
  } catch (const std::system_error& e) {
    ::close(fd);
    if (events_fd >= 0) ::close(events_fd);
    ::close(p[0]);
    ::close(p[1]);
    return Status(ErrorCode::backend_error, std::string("cannot start the pressure watch thread: ") + e.what());
  }
  stop_write_ = p[1];
  return Status::ok();
}

void PressureWatch::stop() {
  if (!thread_.joinable()) return;
  const char byte = 1;
  while (::write(stop_write_, &byte, 1) < 0 && errno == EINTR) {
  }
  if (thread_.get_id() == std::this_thread::get_id()) {
    // Called from inside on_pressure: the loop sees the byte as soon as the callback returns
    // (the pipe keeps it after the write end is closed) and leaves.
    thread_.detach();
  } else {
    thread_.join();
  }
  close_fd(stop_write_);
}

void PressureWatch::loop(Source src, int stop_fd, std::function<void()> on_pressure) {
  using Clock = std::chrono::steady_clock;
  std::optional<Clock::time_point> last;        // eventfd, memory.events: the last call
  std::optional<Clock::time_point> last_quiet;  // memory.events: the last wake with no new count
  int quiet_wakes = 0;
  bool held = false;  // eventfd: an event came inside the window
  bool gone = false;
  while (!gone) {
    int timeout = -1;
    if (held) {
      const auto left = *last + src.window - Clock::now();
      timeout = static_cast<int>(std::max<std::int64_t>(0, std::chrono::ceil<std::chrono::milliseconds>(left).count()));
    }
    pollfd fds[3] = {{src.fd, static_cast<short>(src.eventfd ? POLLIN : POLLPRI), 0},
                     {stop_fd, POLLIN, 0},
                     {src.events_fd, POLLPRI, 0}};
    const int r = ::poll(fds, src.events_fd >= 0 ? 3 : 2, timeout);
    if (r < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (fds[1].revents != 0) break;  // stop() checked first: no callback after a stop
    if (!src.eventfd) {
      if ((fds[0].revents & POLLPRI) != 0) {
        last = Clock::now();
        on_pressure();
        continue;
      }
      if (src.events_fd >= 0 && fds[2].revents != 0) {
        // The cgroup ran out of memory since the last read: pressure, at most once per window
        // (and not right after the PSI trigger's own call).
        const auto seen = limit_events(src.events_fd);
        if (!seen) {
          close_fd(src.events_fd);  // the cgroup is gone: the trigger's POLLERR says so too
          continue;
        }
        const bool grew = *seen > src.events_seen;
        src.events_seen = *seen;
        const auto now = Clock::now();
        // A kernel whose notification the read does not re-arm would wake poll() at once, again
        // and again: given up after 100 wakes without news within 10 ms of each other.
        if (!grew) {
          quiet_wakes = last_quiet && now - *last_quiet < std::chrono::milliseconds(10) ? quiet_wakes + 1 : 0;
          last_quiet = now;
          if (quiet_wakes > 100) close_fd(src.events_fd);
          continue;
        }
        if (!last || now - *last >= src.window) {
          last = now;
          on_pressure();
        }
        continue;
      }
      // The trigger is gone (its cgroup was removed): nothing more will come from it.
      if ((fds[0].revents & (POLLERR | POLLNVAL | POLLHUP)) != 0) gone = true;
      continue;
    }
    bool event = false;
    if ((fds[0].revents & POLLIN) != 0) {
      std::uint64_t count = 0;
      while (::read(src.fd, &count, sizeof count) < 0 && errno == EINTR) {
      }
      // The kernel also signals the eventfd once when it removes the registration with its
      // cgroup: no pressure then, and nothing more will come.
      if (::access(src.level_file.c_str(), F_OK) != 0) {
        gone = true;
        continue;
      }
      event = true;
    } else if ((fds[0].revents & (POLLERR | POLLNVAL | POLLHUP)) != 0) {
      gone = true;
      continue;
    }
    const auto now = Clock::now();
    const bool window_over = !last || now - *last >= src.window;
    if (event && !window_over) {
      held = true;
    } else if ((event || held) && window_over) {
      held = false;
      last = now;
      on_pressure();
    }
  }
  if (gone) {  // wait for stop() without spinning
    pollfd s = {stop_fd, POLLIN, 0};
    while (::poll(&s, 1, -1) < 0 && errno == EINTR) {
    }
  }
  ::close(src.fd);
  if (src.events_fd >= 0) ::close(src.events_fd);
  ::close(stop_fd);
}

}  // namespace residency::posix
