// SPDX-License-Identifier: MIT
// Linked into every test executable on Linux with `-Wl,--wrap=kill` (tests/CMakeLists.txt): a
// test's kill() of a pid that is not a child's (-1 from a failed fork(), or a child already
// reaped and marked -1; 0) fails with EINVAL and says so on stderr, instead of signalling every
// process this user may signal (pid -1: as root, the whole machine, the CI runner included) or
// the test's own process group (0). kill(pid, 0) probes and positive pids go through.
#include <signal.h>
#include <sys/types.h>

#include <cerrno>
#include <cstdio>

extern "C" int __real_kill(pid_t pid, int sig);

extern "C" int __wrap_kill(pid_t pid, int sig) {
  if (pid <= 0) {
    std::fprintf(stderr, "test support: refused kill(%d, %d): not a child's pid (a failed fork, or a reaped child)\n",
                 static_cast<int>(pid), sig);
    errno = EINVAL;
    return -1;
  }
  return __real_kill(pid, sig);
}
