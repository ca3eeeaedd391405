// residency posix backend: one thread that sleeps until Linux PSI reports memory pressure.
//
// A PSI trigger ("some 150000 2000000": tasks stalled on memory for 150 ms within 2 s) is
// registered by writing it to a pressure file; the kernel then wakes poll() with POLLPRI when
// the threshold is crossed, at most once per window. So the watch thread costs nothing while
// there is no pressure: it blocks in poll() on two descriptors, the trigger and the read end
// of a pipe that stop() writes to, which is what makes stop() return at once instead of after
// the next event or a timeout.
#pragma once

#include <functional>
#include <string>
#include <thread>

#include "residency/status.hpp"

namespace residency::posix {

class PressureWatch {
 public:
  PressureWatch() = default;
  PressureWatch(const PressureWatch&) = delete;
  PressureWatch& operator=(const PressureWatch&) = delete;
  ~PressureWatch() { stop(); }

  // Registers `trigger` on the PSI file `path` and calls `on_pressure` from the watch thread
  // each time the kernel reports it. Errors: unsupported when the file cannot be opened for
  // writing or the kernel refuses the trigger (the message says which and why), backend_error
  // when no thread or pipe could be made. A running watch is stopped first.
  Status start(const std::string& path, const std::string& trigger, std::function<void()> on_pressure);
  // Stops the watch; on_pressure is not running and will not be called after this returns.
  // Returns at once. Safe to call when not started, and from inside on_pressure (the thread
  // is then detached and exits as soon as the callback returns).
  void stop();
  bool running() const { return thread_.joinable(); }

 private:
  static void loop(int psi_fd, int stop_fd, std::function<void()> on_pressure);
  std::thread thread_;
  // The loop owns (and closes on its way out) the trigger descriptor and the pipe's read end;
  // the watch owns the write end, valid while thread_ is joinable.
  int stop_write_ = -1;
};

}  // namespace residency::posix
