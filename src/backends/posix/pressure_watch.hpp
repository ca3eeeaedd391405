// SPDX-License-Identifier: MIT
// residency posix backend: one thread that sleeps until the kernel reports memory pressure.
//
// Two kernel sources, whichever governs the process (posix_pressure_source() chooses): a PSI
// trigger (start()) or a cgroup v1 memory.pressure_level (start_cgroup_v1()). The watch thread
// costs nothing while there is no pressure: it blocks in poll() on two descriptors, the source
// and the read end of a pipe that stop() writes to, which is what makes stop() return at once
// instead of after the next event or a timeout.
#pragma once

#include <functional>
#include <string>
#include <thread>

#include "residency/clock.hpp"
#include "residency/status.hpp"

namespace residency::posix {

class PressureWatch {
 public:
  PressureWatch() = default;
  PressureWatch(const PressureWatch&) = delete;
  PressureWatch& operator=(const PressureWatch&) = delete;
  ~PressureWatch() { stop(); }

  // A PSI trigger ("some 150000 2000000": tasks stalled on memory for 150 ms within 2 s) is
  // registered by writing it to a pressure file (/proc/pressure/memory, a cgroup v2
  // memory.pressure); the kernel wakes poll() with POLLPRI when the threshold is crossed, at most
  // once per window. With a cgroup v2's PSI, its memory.events as well (POLLPRI when the kernel
  // changes it): the cgroup running out of memory ("oom") is pressure, even when nothing stalled
  // long enough for the trigger.
  //
  // Registers `trigger` on the PSI file `path` and calls `on_pressure` from the watch thread
  // each time the kernel reports it. Errors: unsupported when the file cannot be opened for
  // writing or the kernel refuses the trigger (the message says which and why), backend_error
  // when no thread or pipe could be made. A running watch is stopped first.
  Status start(const std::string& path, const std::string& trigger, std::function<void()> on_pressure);
  // cgroup v1's memory.pressure_level (vmpressure: PSI exists only system-wide under cgroup v1)
  // is registered through the cgroup's cgroup.event_control with an eventfd that the kernel
  // signals on each reclaim pass at or above the level. Those come in bursts (one per 512 pages
  // scanned), so the watch passes on at most one per `window`, as a PSI trigger does: an event
  // inside the window is held and delivered when it ends.
  //
  // Registers an eventfd for `level` ("low", "medium", "critical") on the cgroup v1 file
  // `level_file` (.../memory.pressure_level) through the cgroup.event_control beside it, and calls
  // `on_pressure` at most once per `window` while the kernel signals it. Errors as start(). The
  // kernel drops the registration when the eventfd is closed (stop()) or the cgroup is removed
  // (the watch then waits for stop()).
  Status start_cgroup_v1(const std::string& level_file, const std::string& level, Nanos window,
                         std::function<void()> on_pressure);
  // Stops the watch; on_pressure is not running and will not be called after this returns.
  // Returns at once. Safe to call when not started, and from inside on_pressure (the thread
  // is then detached and exits as soon as the callback returns).
  void stop();
  bool running() const { return thread_.joinable(); }

 private:
  struct Source {
    int fd = -1;
    bool eventfd = false;    // cgroup v1: POLLIN, read the counter; PSI: POLLPRI
    Nanos window{0};         // eventfd, memory.events: at most one call per window
    std::string level_file;  // eventfd: gone = the cgroup was removed
    // PSI of a cgroup v2 (its memory.pressure): the cgroup's memory.events too, whose "oom" count
    // grows when reclaim cannot keep its usage under memory.max. When the memory is locked,
    // reclaim finds nothing to do, so tasks hardly stall and the PSI trigger may never fire
    // before the OOM killer does (seen: a hog in the cgroup OOM-killed again and again while the
    // trigger stayed silent; docs/measurements.md).
    int events_fd = -1;
    std::uint64_t events_seen = 0;
  };
  Status run(Source src, std::function<void()> on_pressure);
  static void loop(Source src, int stop_fd, std::function<void()> on_pressure);
  std::thread thread_;
  // The loop owns (and closes on its way out) the source descriptor and the pipe's read end;
  // the watch owns the write end, valid while thread_ is joinable.
  int stop_write_ = -1;
};

}  // namespace residency::posix
