// residency posix backend: the PSI watch thread (see pressure_watch.hpp).
#include "backends/posix/pressure_watch.hpp"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>

namespace residency::posix {
namespace {
void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}
std::string err_text(int err) { return std::strerror(err); }
}  // namespace

Status PressureWatch::start(const std::string& path, const std::string& trigger,
                            std::function<void()> on_pressure) {
  stop();
  int fd = ::open(path.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    std::string why = "cannot open " + path + " for writing a PSI trigger: " + err_text(err);
    if (err == ENOENT) why += " (no PSI: Linux < 4.20 or CONFIG_PSI off)";
    if (err == EOPNOTSUPP) why += " (PSI is compiled in but disabled: boot with psi=1)";
    if (err == EACCES || err == EROFS) why += " (the file must be writable by this process; in a container mount the cgroup file system read-write or delegate the cgroup)";
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
  int p[2];
  if (::pipe(p) != 0) {
    const int err = errno;
    ::close(fd);
    return Status(ErrorCode::backend_error, "pipe() for the pressure watch failed: " + err_text(err));
  }
  for (int e : p) ::fcntl(e, F_SETFD, FD_CLOEXEC);
  try {
    thread_ = std::thread(&PressureWatch::loop, fd, p[0], std::move(on_pressure));
  } catch (const std::system_error& e) {
    ::close(fd);
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

void PressureWatch::loop(int psi_fd, int stop_fd, std::function<void()> on_pressure) {
  for (;;) {
    pollfd fds[2] = {{psi_fd, POLLPRI, 0}, {stop_fd, POLLIN, 0}};
    const int r = ::poll(fds, 2, -1);
    if (r < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (fds[1].revents != 0) break;  // stop() checked first: no callback after a stop
    if ((fds[0].revents & POLLPRI) != 0) {
      on_pressure();
      continue;
    }
    if ((fds[0].revents & (POLLERR | POLLNVAL | POLLHUP)) != 0) {
      // The trigger is gone (its cgroup was removed): nothing more will come from it. Wait
      // for stop() without spinning.
      pollfd s = {stop_fd, POLLIN, 0};
      while (::poll(&s, 1, -1) < 0 && errno == EINTR) {
      }
      break;
    }
  }
  ::close(psi_fd);
  ::close(stop_fd);
}

}  // namespace residency::posix
