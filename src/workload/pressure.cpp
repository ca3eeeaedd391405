// SPDX-License-Identifier: MIT
// Memory pressure (see pressure.hpp).
#include "workload/pressure.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#if defined(__linux__)
#include <sys/prctl.h>
#endif
#if defined(__APPLE__)
#include <sys/mount.h>  // statfs (macOS has no <sys/statfs.h>)
#else
#include <sys/statfs.h>
#endif
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "residency/config.hpp"
#include "residency/text.hpp"
#include "workload/cleanup.hpp"

#ifndef MADV_PAGEOUT
#define MADV_PAGEOUT 21  // Linux 5.4 uapi value, for older C library headers
#endif

namespace residency::workload {
namespace {

// MADV_PAGEOUT is asked in pieces of this size: the kernel refuses the whole call (EINVAL) when
// the range touches a locked mapping, so pieces let the unlocked parts of a partly wired model
// still be reclaimed, and count what was skipped.
constexpr std::size_t kPageoutPiece = 2u << 20;
// Exit codes of the hog child, read by the parent.
constexpr int kHogNoMemory = 3;
constexpr int kHogOrphaned = 4;
constexpr unsigned long kTmpfsMagic = 0x01021994;  // TMPFS_MAGIC (linux/magic.h)
constexpr unsigned long kRamfsMagic = 0x858458f6;  // RAMFS_MAGIC

std::size_t page_size() { return static_cast<std::size_t>(sysconf(_SC_PAGESIZE)); }

}  // namespace

std::string Pressure::to_string() const {
  switch (kind) {
    case Kind::none: return "none";
    case Kind::pageout: return "pageout";
    case Kind::hog: return "hog:" + format_size(hog_bytes);
  }
  return "?";
}

Result<Pressure> parse_pressure(std::string_view text) {
  Pressure p;
  if (text == "none") return p;
  if (text == "pageout") {
    p.kind = Pressure::Kind::pageout;
    return p;
  }
  if (text.substr(0, 4) == "hog:") {
    auto size = parse_size(text.substr(4));
    if (!size) {
      return Status(ErrorCode::invalid_argument,
                    "'" + printable(text) + "': " + size.message() + " (example: hog:4GiB)");
    }
    if (*size == 0) return Status(ErrorCode::invalid_argument, "'hog:0': the hog needs a size above 0");
    p.kind = Pressure::Kind::hog;
    p.hog_bytes = *size;
    return p;
  }
  return Status(ErrorCode::invalid_argument,
                "unknown pressure '" + printable(text) + "'; accepted: none, pageout, hog:SIZE (e.g. hog:4GiB)");
}

Result<std::uint64_t> mem_available() {
  std::ifstream f("/proc/meminfo");
  if (!f) return Status(ErrorCode::io_error, "cannot read /proc/meminfo (is /proc mounted?)");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream in(line.substr(13));
    std::uint64_t kib = 0;
    if (in >> kib) return kib * 1024;
  }
  return Status(ErrorCode::io_error, "/proc/meminfo has no MemAvailable line (Linux 3.14+ is needed)");
}

Status check_hog_fits(std::uint64_t bytes) {
  auto avail = mem_available();
  if (!avail) return avail.status();
  if (bytes > *avail) {
    return Status(ErrorCode::invalid_argument,
                  "hog:" + format_size(bytes) + " is more than the " + format_size(*avail) +
                      " of memory available now (MemAvailable in /proc/meminfo); choose a smaller size");
  }
  return {};
}

Status pageout_supported() {
  const std::size_t page = page_size();
  void* p = mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return Status(ErrorCode::out_of_memory, "cannot map one page to probe MADV_PAGEOUT");
  static_cast<volatile char*>(p)[0] = 1;
  const int rc = madvise(p, page, MADV_PAGEOUT);
  const int err = errno;
  munmap(p, page);
  if (rc != 0) {
    return Status(ErrorCode::unsupported,
                  std::string("this kernel refuses MADV_PAGEOUT (") + std::strerror(err) +
                      "; it needs Linux 5.4 or later): use --pressure hog:SIZE or --pressure none");
  }
  return {};
}

Result<PageoutResult> page_out(const void* base, std::size_t len, int fd) {
  PageoutResult r;
  const std::size_t page = page_size();
  auto* start = reinterpret_cast<std::uint8_t*>(reinterpret_cast<std::uintptr_t>(base) / page * page);
  const std::size_t total = static_cast<std::size_t>(static_cast<const std::uint8_t*>(base) + len - start);
  for (std::size_t off = 0; off < total; off += kPageoutPiece) {
    const std::size_t n = std::min(kPageoutPiece, total - off);
    if (madvise(start + off, n, MADV_PAGEOUT) == 0) {
      r.advised_bytes += n;
    } else if (errno == EINVAL) {
      r.locked_bytes += n;
    } else {
      return Status(ErrorCode::backend_error, std::string("madvise(MADV_PAGEOUT) failed: ") + std::strerror(errno));
    }
  }
#if defined(__APPLE__)
  (void)fd;  // macOS has no posix_fadvise (and no MADV_PAGEOUT: the probe refuses pageout first)
#else
  if (fd >= 0) {
    const int rc = posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    if (rc != 0) {
      return Status(ErrorCode::backend_error,
                    std::string("posix_fadvise(POSIX_FADV_DONTNEED) failed: ") + std::strerror(rc));
    }
  }
#endif
  return r;
}

Result<double> resident_fraction(const void* base, std::size_t len) {
  if (len == 0) return 1.0;
  const std::size_t page = page_size();
  auto* start = reinterpret_cast<std::uint8_t*>(reinterpret_cast<std::uintptr_t>(base) / page * page);
  const std::size_t total = static_cast<std::size_t>(static_cast<const std::uint8_t*>(base) + len - start);
  std::vector<unsigned char> vec((total + page - 1) / page);
#if defined(__APPLE__)
  char* out = reinterpret_cast<char*>(vec.data());  // macOS declares mincore with char*
#else
  unsigned char* out = vec.data();
#endif
  if (mincore(start, total, out) != 0) {
    return Status(ErrorCode::backend_error, std::string("mincore failed: ") + std::strerror(errno));
  }
  std::size_t in = 0;
  for (unsigned char v : vec) in += v & 1u;
  return static_cast<double>(in) / static_cast<double>(vec.size());
}

Result<HogRun> run_hog(std::uint64_t bytes, double give_up_s, std::chrono::milliseconds hold) {
  const std::size_t page = page_size();
  const pid_t parent = getpid();
  HogRun run;
  const auto t0 = std::chrono::steady_clock::now();
  const auto elapsed_ms = [&] {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
  while (!run.got) {
    ++run.attempts;
    const pid_t pid = fork();
    if (pid < 0)
      return Status(ErrorCode::backend_error, std::string("cannot start the hog: fork: ") + std::strerror(errno));
    if (pid == 0) {
      // The child: system calls and plain stores only (the parent has threads; nothing else is
      // safe after fork). Default signal actions, so an interrupt ends it and runs no cleanup.
      CleanupRegistry::reset_signals_in_child();
      // It dies with its parent, even a SIGKILLed one (gigabytes must not outlive the run). The
      // death signal comes when the forking thread ends; this thread waits for the hog below, so
      // that is never early. A parent already gone before prctl took effect is caught by getppid.
#if defined(__linux__)
      if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent) _exit(kHogOrphaned);
#else
      if (getppid() != parent) _exit(kHogOrphaned);  // no death signal here: a killed parent's hog runs to its end
#endif
      // Expendable: in a memory cgroup the OOM killer takes the hog, not the engine beside it.
      const int adj = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
      if (adj >= 0) {
        if (write(adj, "1000", 4) < 0) { /* the OOM killer then chooses by size alone */
        }
        close(adj);
      }
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) _exit(kHogNoMemory);
      auto* bytes_p = static_cast<volatile unsigned char*>(p);
      for (std::uint64_t off = 0; off < bytes; off += page) bytes_p[off] = 1;
      if (hold.count() > 0) {
        timespec ts{static_cast<time_t>(hold.count() / 1000), static_cast<long>(hold.count() % 1000) * 1'000'000};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
        }
      }
      munmap(p, bytes);
      _exit(0);
    }
    CleanupRegistry::set_child(pid);
    int status = 0;
    pid_t w;
    do {
      w = waitpid(pid, &status, 0);
    } while (w < 0 && errno == EINTR);
    CleanupRegistry::set_child(0);
    if (w < 0)
      return Status(ErrorCode::backend_error, std::string("waiting for the hog failed: ") + std::strerror(errno));
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
      run.got = true;
      break;
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == kHogOrphaned) {
      return Status(ErrorCode::backend_error,
                    "the hog could not tie its life to this process (prctl PR_SET_PDEATHSIG)");
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == kHogNoMemory) {
      return Status(ErrorCode::out_of_memory,
                    "the hog could not map " + format_size(bytes) + "; choose a smaller hog:SIZE");
    }
    if (!(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL))
      return Status(ErrorCode::backend_error, "the hog ended abnormally (wait status " + std::to_string(status) + ")");
    ++run.oom_killed;  // most likely the OOM killer: its supervisor tries again
    if (elapsed_ms() >= give_up_s * 1000) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  run.waited_ms = elapsed_ms();
  return run;
}

bool on_memory_filesystem(const std::string& path) {
  struct statfs s {};
  if (statfs(path.c_str(), &s) != 0) return false;
  const auto magic = static_cast<unsigned long>(s.f_type);
  return magic == kTmpfsMagic || magic == kRamfsMagic;
}

}  // namespace residency::workload
