// SPDX-License-Identifier: MIT
// Helpers for the posix backend's tests: a real file mapping (what an engine's mmap'd model
// is), what the kernel says about it (VmLck, mincore), the kernel's reclaim made repeatable
// (MADV_PAGEOUT + POSIX_FADV_DONTNEED), RLIMIT_MEMLOCK checks, and running a body in a forked
// child whose capabilities and limits can be lowered without touching the test process.
#pragma once

#include <fcntl.h>
#include <linux/capability.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backends/posix/proc_info.hpp"

namespace residency::posix_test {

constexpr std::uint64_t KiB = 1024;
constexpr std::uint64_t MiB = 1024 * KiB;

inline std::uint64_t page_size() { return static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE)); }

// mlock through the system call: the sanitizers' mlock interceptor does nothing.
inline int raw_mlock(const void* addr, std::size_t len) { return static_cast<int>(::syscall(SYS_mlock, addr, len)); }

// This process's VmLck, bytes (0 when unreadable).
inline std::uint64_t vm_lck() {
  auto st = posix::read_proc_status();
  return st && st->vm_lck ? *st->vm_lck : 0;
}

// A temporary file of `size` bytes, written (not sparse), synced so its pages are clean and
// reclaimable, and mapped MAP_SHARED, PROT_READ as an engine maps its model.
class TempMappedFile {
 public:
  explicit TempMappedFile(std::size_t size) : size_(size) {
    dir_ = choose_dir();
    std::string tmpl = dir_ + "/residency-posix-test-XXXXXX";
    fd_ = ::mkstemp(tmpl.data());
    if (fd_ < 0) {
      error_ = "mkstemp in " + dir_ + ": " + std::strerror(errno);
      return;
    }
    ::unlink(tmpl.c_str());
    std::vector<char> chunk(MiB);
    for (std::size_t off = 0; off < size; off += chunk.size()) {
      for (std::size_t i = 0; i < chunk.size(); i += 4096) chunk[i] = static_cast<char>((off + i) >> 12);
      const std::size_t n = std::min(chunk.size(), size - off);
      if (::pwrite(fd_, chunk.data(), n, static_cast<off_t>(off)) != static_cast<ssize_t>(n)) {
        error_ = "writing the test file: " + std::string(std::strerror(errno));
        return;
      }
    }
    ::fdatasync(fd_);
    void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd_, 0);
    if (p == MAP_FAILED) {
      error_ = "mmap: " + std::string(std::strerror(errno));
      return;
    }
    data_ = static_cast<char*>(p);
    struct statfs sfs {};
    // TMPFS_MAGIC: shmem pages without swap cannot be paged out, so eviction tests skip there.
    constexpr long kTmpfsMagic = 0x01021994;
    if (::fstatfs(fd_, &sfs) == 0 && static_cast<long>(sfs.f_type) == kTmpfsMagic) on_tmpfs_ = true;
  }
  ~TempMappedFile() {
    if (data_ != nullptr) ::munmap(data_, size_);
    if (fd_ >= 0) ::close(fd_);
  }
  TempMappedFile(const TempMappedFile&) = delete;
  TempMappedFile& operator=(const TempMappedFile&) = delete;

  bool ok() const { return data_ != nullptr; }
  const std::string& error() const { return error_; }
  char* data() const { return data_; }
  std::size_t size() const { return size_; }
  bool on_tmpfs() const { return on_tmpfs_; }
  int fd() const { return fd_; }
  const std::string& dir() const { return dir_; }

  // Reads one byte per page: makes every page resident (page cache + page tables).
  std::uint64_t touch_all() const {
    std::uint64_t sum = 0;
    for (std::size_t i = 0; i < size_; i += page_size()) sum += static_cast<unsigned char>(data_[i]);
    return sum;
  }
  // Fraction of the mapping's pages that mincore reports resident.
  double resident_fraction() const {
    const std::size_t pages = (size_ + page_size() - 1) / page_size();
    std::vector<unsigned char> vec(pages);
    if (::mincore(data_, size_, vec.data()) != 0) return -1;
    std::size_t n = 0;
    for (unsigned char v : vec) n += v & 1U;
    return static_cast<double>(n) / static_cast<double>(pages);
  }
  // What memory pressure does to unlocked pages, made repeatable: reclaim this mapping's
  // pages (MADV_PAGEOUT, Linux >= 5.4) and drop them from the page cache. Returns madvise's
  // errno (0 on success): EINVAL when the kernel lacks MADV_PAGEOUT, and also when the range
  // is mlock-ed (the kernel refuses to page out locked memory).
  int page_out() const {
    int err = 0;
    if (::madvise(data_, size_, MADV_PAGEOUT) != 0) err = errno;
    ::posix_fadvise(fd_, 0, static_cast<off_t>(size_), POSIX_FADV_DONTNEED);
    return err;
  }

 private:
  static std::string choose_dir() {
    // Prefer a disk-backed directory: pages of a tmpfs file cannot be evicted without swap.
    if (const char* t = std::getenv("TMPDIR"); t != nullptr && *t != '\0') return t;
    for (const char* d : {"/var/tmp", "/tmp"}) {
      if (::access(d, W_OK) == 0) return d;
    }
    return ".";
  }
  std::size_t size_;
  std::string dir_;
  int fd_ = -1;
  char* data_ = nullptr;
  bool on_tmpfs_ = false;
  std::string error_;
};

// Whether MADV_PAGEOUT works here: probe it on a small unlocked mapping.
inline std::optional<std::string> pageout_unsupported_reason() {
  TempMappedFile probe(64 * KiB);
  if (!probe.ok()) return "cannot make a probe file: " + probe.error();
  if (probe.on_tmpfs()) return probe.dir() + " is tmpfs: its pages cannot be paged out without swap";
  probe.touch_all();
  if (const int err = probe.page_out(); err != 0) {
    return std::string("madvise(MADV_PAGEOUT) failed: ") + std::strerror(err) + " (needs Linux >= 5.4)";
  }
  return std::nullopt;
}

inline bool has_cap_ipc_lock() {
  auto st = posix::read_proc_status();
  return st && st->cap_eff && posix::has_cap_ipc_lock(*st->cap_eff);
}

// Makes sure `bytes` more can be mlock-ed: CAP_IPC_LOCK, or a soft RLIMIT_MEMLOCK that fits
// (raised to the hard limit if needed). Returns why not, for GTEST_SKIP.
inline std::optional<std::string> ensure_memlock(std::uint64_t bytes) {
  if (has_cap_ipc_lock()) return std::nullopt;
  rlimit rl{};
  if (::getrlimit(RLIMIT_MEMLOCK, &rl) != 0) return std::string("getrlimit failed");
  auto fits = [&] { return rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur >= vm_lck() + bytes; };
  if (fits()) return std::nullopt;
  rl.rlim_cur = rl.rlim_max;
  ::setrlimit(RLIMIT_MEMLOCK, &rl);
  ::getrlimit(RLIMIT_MEMLOCK, &rl);
  if (fits()) return std::nullopt;
  return "RLIMIT_MEMLOCK (soft " + std::to_string(rl.rlim_cur) + ", hard " + std::to_string(rl.rlim_max) +
         " bytes) is below the " + std::to_string(bytes) +
         " bytes this test locks and the process lacks CAP_IPC_LOCK; run with `ulimit -l unlimited`";
}

// Removes CAP_IPC_LOCK from the calling thread's effective and permitted sets (irreversible
// for the process: use only in a forked child). Returns an error text, or empty on success.
inline std::string drop_cap_ipc_lock() {
  __user_cap_header_struct hdr{};
  hdr.version = _LINUX_CAPABILITY_VERSION_3;
  hdr.pid = 0;
  __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3] = {};
  if (::syscall(SYS_capget, &hdr, data) != 0) return std::string("capget: ") + std::strerror(errno);
  data[0].effective &= ~(1U << CAP_IPC_LOCK);
  data[0].permitted &= ~(1U << CAP_IPC_LOCK);
  if (::syscall(SYS_capset, &hdr, data) != 0) return std::string("capset: ") + std::strerror(errno);
  return {};
}

// Sets RLIMIT_MEMLOCK soft = hard = bytes (lowering needs no privilege).
inline std::string set_memlock_limit(std::uint64_t bytes) {
  rlimit rl{static_cast<rlim_t>(bytes), static_cast<rlim_t>(bytes)};
  if (::setrlimit(RLIMIT_MEMLOCK, &rl) != 0) return std::string("setrlimit: ") + std::strerror(errno);
  return {};
}

// The outcome of a body run in a forked child: its exit code and what it wrote.
struct ChildResult {
  int exit_code = -1;  // -1: killed by a signal (see `signal`)
  int signal = 0;
  std::string report;
};
// Exit code a child uses to say "skip" (the report says why).
inline constexpr int kChildSkip = 77;

// Forks; the child runs body(report) and exits with its return value. The child must not
// start threads (sanitizers and fork) and reports through `report`, never through gtest.
inline ChildResult run_in_child(const std::function<int(std::string& report)>& body) {
  ChildResult r;
  int p[2];
  if (::pipe(p) != 0) {
    r.report = "pipe failed";
    return r;
  }
  const pid_t pid = ::fork();
  if (pid < 0) {
    r.report = "fork failed";
    return r;
  }
  if (pid == 0) {
    ::close(p[0]);
    std::string report;
    const int code = body(report);
    std::size_t off = 0;
    while (off < report.size()) {
      const ssize_t n = ::write(p[1], report.data() + off, report.size() - off);
      if (n <= 0) break;
      off += static_cast<std::size_t>(n);
    }
    ::close(p[1]);
    ::_exit(code);
  }
  ::close(p[1]);
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(p[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    r.report.append(buf, static_cast<std::size_t>(n));
  }
  ::close(p[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
  return r;
}

// Real memory pressure, made on demand: a child process in a memory cgroup limited to
// `limit` bytes reads a file four times that size over and over, so that every read has to
// reclaim the page cache it charged a moment ago. Its stalls show in /proc/pressure/memory
// (and in the memory.pressure of every ancestor cgroup). Uses the cgroup v1 memory controller,
// or cgroup v2 where this process's cgroup already delegates "memory" to its children;
// skipped elsewhere (needs root). A 10 ms-in-2 s trigger fires within about one PSI window of
// the start (docs/measurements.md has the times).
class MemoryThrasher {
 public:
  // Returns why it cannot run here, or nullopt when it can.
  std::optional<std::string> start(std::uint64_t limit = 16 * MiB) {
    auto dir = make_cgroup(limit);
    if (!dir) return dir_error_;
    cgroup_dir_ = *dir;
    file_ = std::make_unique<TempMappedFile>(4 * limit);
    if (!file_->ok()) return "cannot make the file to read: " + file_->error();
    file_->page_out();  // out of our page cache, so that the child's reads charge its cgroup
    const int fd = file_->fd();
    const std::size_t size = file_->size();
    const std::string procs = cgroup_dir_ + "/cgroup.procs";
    pid_ = ::fork();
    if (pid_ < 0) return std::string("fork: ") + std::strerror(errno);
    if (pid_ == 0) {
      const int pfd = ::open(procs.c_str(), O_WRONLY);
      const std::string me = std::to_string(::getpid());
      if (pfd < 0 || ::write(pfd, me.c_str(), me.size()) < 0) ::_exit(3);
      ::close(pfd);
      std::vector<char> buf(MiB);
      const auto t0 = std::chrono::steady_clock::now();
      while (std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30)) {  // killed long before
        for (std::size_t off = 0; off < size; off += buf.size()) {
          if (::pread(fd, buf.data(), buf.size(), static_cast<off_t>(off)) < 0) ::_exit(4);
        }
      }
      ::_exit(0);
    }
    return std::nullopt;
  }
  void stop() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      while (::waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
      }
      pid_ = -1;
    }
    if (!cgroup_dir_.empty()) {
      ::rmdir(cgroup_dir_.c_str());
      cgroup_dir_.clear();
    }
  }
  ~MemoryThrasher() { stop(); }

 private:
  static std::string read_all(const std::string& path) {
    auto t = posix::read_text_file(path);
    return t ? *t : std::string();
  }
  static bool write_all(const std::string& path, const std::string& text) {
    const int fd = ::open(path.c_str(), O_WRONLY);
    if (fd < 0) return false;
    const bool ok = ::write(fd, text.c_str(), text.size()) == static_cast<ssize_t>(text.size());
    ::close(fd);
    return ok;
  }
  std::optional<std::string> make_cgroup(std::uint64_t limit) {
    const std::string name = "/residency-thrash-" + std::to_string(::getpid());
    // cgroup v1: the "memory" hierarchy's mount point + this process's path in it.
    std::string v1_mount, v1_path;
    for (const auto& line : split(read_all("/proc/self/mountinfo"), '\n')) {
      const auto f = split(line, ' ');
      const auto dash = std::find(f.begin(), f.end(), "-");
      if (dash == f.end() || dash + 3 > f.end() || f.size() < 5) continue;
      if (*(dash + 1) == "cgroup" && (dash + 3)->find("memory") != std::string::npos) v1_mount = f[4];
    }
    for (const auto& line : split(read_all("/proc/self/cgroup"), '\n')) {
      const auto c1 = line.find(':');
      const auto c2 = line.find(':', c1 + 1);
      if (c2 == std::string::npos) continue;
      for (const auto& ctl : split(line.substr(c1 + 1, c2 - c1 - 1), ','))
        if (ctl == "memory") v1_path = line.substr(c2 + 1);
    }
    if (!v1_mount.empty() && !v1_path.empty()) {
      std::string dir = v1_mount + (v1_path == "/" ? "" : v1_path) + name;
      if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
        dir_error_ = "cannot create memory cgroup " + dir + ": " + std::strerror(errno);
        return std::nullopt;
      }
      if (!write_all(dir + "/memory.limit_in_bytes", std::to_string(limit))) {
        ::rmdir(dir.c_str());
        dir_error_ = "cannot limit memory cgroup " + dir;
        return std::nullopt;
      }
      return dir;
    }
    auto v2 = posix::find_cgroup_v2();
    if (!v2) {
      dir_error_ = "no memory cgroup: " + v2.message();
      return std::nullopt;
    }
    if (read_all(v2->dir + "/cgroup.subtree_control").find("memory") == std::string::npos) {
      dir_error_ = "cgroup v2 " + v2->dir + " does not delegate the memory controller to children";
      return std::nullopt;
    }
    std::string dir = v2->dir + name;
    if ((::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) || !write_all(dir + "/memory.max", std::to_string(limit))) {
      ::rmdir(dir.c_str());
      dir_error_ = "cannot create a limited cgroup v2 " + dir;
      return std::nullopt;
    }
    return dir;
  }
  static std::vector<std::string> split(const std::string& s, char sep) {
    std::vector<std::string> out;
    std::size_t b = 0;
    while (b <= s.size()) {
      const auto e = s.find(sep, b);
      const auto piece = s.substr(b, e == std::string::npos ? std::string::npos : e - b);
      if (!piece.empty()) out.push_back(piece);
      if (e == std::string::npos) break;
      b = e + 1;
    }
    return out;
  }

  std::string dir_error_;
  std::string cgroup_dir_;
  std::unique_ptr<TempMappedFile> file_;
  pid_t pid_ = -1;
};

inline double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace residency::posix_test
