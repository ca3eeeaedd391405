// SPDX-License-Identifier: MIT
// residency hold FILE...: keep files resident for whoever maps them.
//
// A file's page cache is shared by every process that maps it, so locking the pages here keeps
// a model resident for a llama.cpp server that maps the same file, without touching the server:
// vmtouch's `-l`, under the library's policy, budget and pressure settings. The files are mapped
// read-only and registered as weights (earlier files first when the budget must choose), on the
// posix backend. It holds until SIGINT/SIGTERM/SIGHUP (then unlocks everything and exits 0; a
// SIGHUP ignored at the start, as under nohup, stays ignored), or until the memory is released:
// the keep-alive expired (hold itself never uses the files, and it cannot see other processes'
// reads of the page cache without privileges (fanotify is root's), so a duration means "hold for
// this long from the start") or memory pressure with
// --release-on-pressure (the backend's pressure source: PSI or cgroup v1 memory.pressure_level); then it
// says why and exits 0. Waiting costs next to nothing: one poll() on a signalfd and a pipe, and
// once a second an fstat() of each held file (follow_files: a deleted file is released, a file
// whose length changed is held at its new length).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "command.hpp"
#include "core/config_keys.hpp"
#include "residency/backends.hpp"
#include "residency/config.hpp"
#include "residency/residency.hpp"
#include "residency/shared_budget.hpp"
#include "residency/text.hpp"

namespace residency::tool {
namespace {

struct HoldOptions {
  std::vector<std::string> files;
  std::optional<std::string> keep_alive;   // not given: RESIDENCY_KEEP_ALIVE, else forever
  std::optional<std::string> wired_limit;  // not given: RESIDENCY_WIRED_LIMIT, else the recommended working set
  bool release_on_pressure = false;
  bool quiet = false;
};

// A file mapped read-only for as long as the object lives.
class MappedFile {
 public:
  static MappedFile open(const std::string& path) {
    MappedFile f;
    f.path_ = path;
    // O_NONBLOCK: opening a FIFO would otherwise wait for a writer (forever); for a regular file
    // it changes nothing, and anything else is refused below.
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) throw BadInput("cannot open '" + printable(path) + "': " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      throw BadInput("cannot stat '" + printable(path) + "': " + std::strerror(err));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      throw BadInput("'" + printable(path) + "' is not a regular file; hold takes files (a model, its shards)");
    }
    if (st.st_size == 0) {
      ::close(fd);
      throw BadInput("'" + printable(path) + "' is empty; there is nothing to hold");
    }
    f.fd_ = fd;  // kept: the file is followed through it (changed())
    f.linked_ = st.st_nlink > 0;
    f.dev_ = st.st_dev;
    f.ino_ = st.st_ino;
    if (const int err = f.map(static_cast<std::size_t>(st.st_size)); err != 0)
      throw BadInput("cannot map '" + printable(path) + "': " + std::strerror(err));
    return f;
  }
  MappedFile() = default;
  MappedFile(MappedFile&& o) noexcept
      : path_(std::move(o.path_)), fd_(o.fd_), linked_(o.linked_), data_(o.data_), size_(o.size_), dev_(o.dev_), ino_(o.ino_) {
    o.fd_ = -1;
    o.data_ = nullptr;
  }
  MappedFile& operator=(MappedFile&&) = delete;
  ~MappedFile() {
    unmap();
    if (fd_ >= 0) ::close(fd_);
  }
  void* data() const { return data_; }
  std::size_t size() const { return size_; }
  bool mapped() const { return data_ != nullptr; }
  const std::string& path() const { return path_; }
  bool same_file(const MappedFile& o) const { return dev_ == o.dev_ && ino_ == o.ino_; }

  // What happened to the file since it was mapped, as its inode says (not its path: a file
  // replaced under the same name is the old one deleted). A file that had no name already when
  // it was opened (an unlinked file reached through /proc/PID/fd/N) is not "deleted" later.
  struct Change {
    enum class Kind { none, deleted, resized } kind = Kind::none;
    std::size_t size = 0;  // resized: the length now
  };
  Change changed() const {
    struct stat st {};
    if (fd_ < 0 || ::fstat(fd_, &st) != 0) return {};
    if (linked_ && st.st_nlink == 0) return {Change::Kind::deleted, 0};
    if (static_cast<std::size_t>(st.st_size) != size_)
      return {Change::Kind::resized, static_cast<std::size_t>(st.st_size)};
    return {};
  }
  // The mapping replaced by one of `size` bytes (0: none); 0 or the errno of mmap.
  int remap(std::size_t size) {
    unmap();
    return size == 0 ? 0 : map(size);
  }
  void unmap() {
    if (data_) ::munmap(data_, size_);
    data_ = nullptr;
    size_ = 0;
  }

 private:
  int map(std::size_t size) {
    void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd_, 0);
    if (p == MAP_FAILED) return errno;
    data_ = p;
    size_ = size;
    return 0;
  }

  std::string path_;
  int fd_ = -1;
  bool linked_ = false;  // the file had a name when it was opened
  void* data_ = nullptr;
  std::size_t size_ = 0;
  dev_t dev_ = 0;
  ino_t ino_ = 0;
};

// How often hold looks at its files (fstat of each): a deleted, truncated or extended file is
// noticed within this time.
constexpr int kFileCheckMs = 1000;

// Follows the held files: a deleted file is released (unlocked and unmapped) and said once; a
// file whose length changed is mapped again at its new length and registered anew (a shrunk file
// is never locked past its end: the pages beyond it are gone, and touching them would be SIGBUS;
// a grown file is held whole, as a new hold of it would). False: no file is left to hold.
bool follow_files(Manager& manager, std::vector<MappedFile>& files, std::vector<std::optional<RegionId>>& ids) {
  bool any = false;
  for (std::size_t i = 0; i < files.size(); ++i) {
    MappedFile& f = files[i];
    if (!ids[i]) continue;
    const MappedFile::Change c = f.changed();
    if (c.kind == MappedFile::Change::Kind::none) {
      any = true;
      continue;
    }
    const std::size_t was = f.size();
    (void)manager.unregister_region(*ids[i]);  // unlocks
    ids[i].reset();
    if (c.kind == MappedFile::Change::Kind::deleted) {
      f.unmap();
      std::printf("residency hold: '%s' was deleted: released its %s\n", printable(f.path()).c_str(),
                  format_size(was).c_str());
      continue;
    }
    if (const int err = f.remap(c.size); err != 0) {
      std::printf("residency hold: '%s' changed from %s to %s and cannot be mapped again (%s): released it\n",
                  printable(f.path()).c_str(), format_size(was).c_str(), format_size(c.size).c_str(), std::strerror(err));
      continue;
    }
    if (!f.mapped()) {
      std::printf("residency hold: '%s' was truncated to 0 bytes: released it\n", printable(f.path()).c_str());
      continue;
    }
    auto id = manager.register_region(f.data(), f.size(), RegionClass::weights, static_cast<int>(files.size() - i));
    const char* how = c.size < was ? "shrank" : "grew";
    if (!id) {
      std::printf("residency hold: '%s' %s from %s to %s and cannot be held again (%s): released it\n",
                  printable(f.path()).c_str(), how, format_size(was).c_str(), format_size(c.size).c_str(),
                  id.message().c_str());
      f.unmap();
      continue;
    }
    ids[i] = *id;
    any = true;
    const Stats s = manager.stats();
    std::printf("residency hold: '%s' %s from %s to %s: holding it at its new length (%s of %s wired in all)\n",
                printable(f.path()).c_str(), how, format_size(was).c_str(), format_size(c.size).c_str(),
                format_size(s.wired_bytes).c_str(), format_size(s.tracked_bytes).c_str());
  }
  std::fflush(stdout);
  return any;
}

Config hold_config(const HoldOptions& o) {
  auto c = Config::from_env();
  if (!c) throw BadInput(c.message());
  Config config = *c;
  if (o.keep_alive) {
    auto k = parse_keep_alive(*o.keep_alive);
    if (!k) throw BadInput("--keep-alive: " + k.message());
    config.keep_alive = *k;
  } else if (!core::config_key_set("keep_alive", [](const char* n) { return std::getenv(n); })) {
    config.keep_alive = KeepAlive::forever();  // vmtouch -l holds until stopped
  }
  if (!config.keep_alive.holds_between_uses())
    throw BadInput((o.keep_alive
                        ? "--keep-alive '" + printable(*o.keep_alive) + "': keep-alive "
                        : std::string("the environment's keep-alive (RESIDENCY_KEEP_ALIVE or its alias) is ")) +
                   config.keep_alive.to_string() + (o.keep_alive ? "" : ": it") +
                   " wires nothing outside a use, and hold has no uses; give a duration (how long to hold) or forever");
  if (o.wired_limit) {
    auto w = parse_wired_limit(*o.wired_limit);
    if (!w) throw BadInput("--wired-limit: " + w.message());
    config.wired_limit = *w;
  }
  // A limit of 0 (or 0%) wires nothing (parse_wired_limit), and wiring is all hold does.
  if (config.wired_limit && !config.wired_limit->is_percent && config.wired_limit->bytes == 0) {
    const char* env = std::getenv("RESIDENCY_WIRED_LIMIT");
    throw BadInput((o.wired_limit ? "--wired-limit '" + printable(*o.wired_limit)
                                  : "RESIDENCY_WIRED_LIMIT='" + printable(env ? env : "0")) +
                   "': a wired limit of 0 wires nothing, and hold only wires; give a limit above 0 (8GiB, 50%) or "
                   "none (the recommended working set)");
  }
  if (o.release_on_pressure) config.release_on_pressure = true;
  return config;
}

// What made the wired limit `limit`, for the line that says what did not fit under it: the
// process's own limit (RLIMIT_MEMLOCK without CAP_IPC_LOCK), named with its value and how to raise
// it, when the budget was clamped to it; else the option or variable that set it, or the default.
std::string wired_limit_source(const HoldOptions& o, const MemoryInfo& mem, std::uint64_t limit) {
  if (mem.hard_limit != 0 && limit == mem.hard_limit)
    return "the process's " + mem.hard_limit_name + " = " + format_size(mem.hard_limit) +
           "; to wire more: " + mem.hard_limit_fix;
  if (o.wired_limit) return "--wired-limit";
  if (core::config_key_set("wired_limit", [](const char* n) { return std::getenv(n); })) return "RESIDENCY_WIRED_LIMIT";
  return "the recommended working set; --wired-limit or RESIDENCY_WIRED_LIMIT sets another";
}

// The signals hold ends on, by the names `kill -s` takes (strsignal's "Terminated" would start a
// line in capitals, and a user who sent it knows it by this name).
const char* signal_name(int sig) {
  switch (sig) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    case SIGHUP: return "SIGHUP";
    default: return "a signal";
  }
}

// The write end of a pipe the log callback signals when the manager releases.
std::atomic<int> g_released_fd{-1};

// While the manager is created and the files registered, waits that hold does not control can
// happen (the shared budget's ledger: joining it, asking its holders). This thread takes a signal
// meanwhile and cancels those waits, so that SIGTERM/SIGINT end hold at once through the clean
// path (nothing wired is left, the slot is freed) instead of when the waits run out.
class SignalsWhileStarting {
 public:
  explicit SignalsWhileStarting(int sfd) : sfd_(sfd) {
    if (::pipe2(stop_, O_CLOEXEC) != 0)
      throw std::runtime_error(std::string("cannot set up signal handling (pipe): ") + std::strerror(errno));
    thread_ = std::thread([this] {
      pollfd fds[2] = {{sfd_, POLLIN, 0}, {stop_[0], POLLIN, 0}};
      while (::poll(fds, 2, -1) < 0 && errno == EINTR) {
      }
      if (!(fds[0].revents & POLLIN)) return;
      signalfd_siginfo si{};
      if (::read(sfd_, &si, sizeof si) != sizeof si) return;
      signo_.store(static_cast<int>(si.ssi_signo));
      cancel_shared_budget_waits();
    });
  }
  // Stops the thread; the signal it took, or 0.
  int finish() {
    if (thread_.joinable()) {
      const char b = 1;
      if (::write(stop_[1], &b, 1) < 0) { /* the thread has returned already */
      }
      thread_.join();
    }
    return signo_.load();
  }
  ~SignalsWhileStarting() {
    finish();
    ::close(stop_[0]);
    ::close(stop_[1]);
  }
  SignalsWhileStarting(const SignalsWhileStarting&) = delete;
  SignalsWhileStarting& operator=(const SignalsWhileStarting&) = delete;

 private:
  int sfd_;
  int stop_[2] = {-1, -1};
  std::atomic<int> signo_{0};
  std::thread thread_;
};

int run_hold(const HoldOptions& o) {
  const Config config = hold_config(o);
  std::vector<MappedFile> files;
  for (const auto& path : o.files) {
    MappedFile f = MappedFile::open(path);
    for (const MappedFile& g : files)
      if (g.same_file(f))
        throw BadInput("'" + printable(path) + "' is the same file as '" + printable(g.path()) +
                       "' (given twice, or a hard link); give each file once");
    files.push_back(std::move(f));
  }

  auto backend = make_backend("posix");
  if (!backend) throw std::runtime_error(backend.message());

  // Signals are taken through a signalfd: block them before any thread exists, so the manager's
  // threads inherit the mask and the process only ends through the clean path below. A SIGHUP
  // ignored when hold starts (`nohup residency hold ...`: the user asked it to outlive the
  // terminal) stays ignored, as the other subcommands leave it (CleanupRegistry): blocked and read
  // from the signalfd it would be taken all the same, since a blocked signal is queued whatever
  // its disposition.
  sigset_t mask;
  sigemptyset(&mask);
  for (int s : {SIGINT, SIGTERM, SIGHUP}) {
    struct sigaction old {};
    if (s == SIGHUP && ::sigaction(s, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) continue;
    sigaddset(&mask, s);
  }
  if (const int err = pthread_sigmask(SIG_BLOCK, &mask, nullptr); err != 0)
    throw std::runtime_error(std::string("cannot set up signal handling (pthread_sigmask): ") + std::strerror(err));
  const int sfd = ::signalfd(-1, &mask, SFD_CLOEXEC);
  int released[2] = {-1, -1};
  if (sfd < 0 || ::pipe2(released, O_CLOEXEC | O_NONBLOCK) != 0)
    throw std::runtime_error(std::string("cannot set up signal handling (signalfd, pipe): ") + std::strerror(errno));
  g_released_fd = released[1];
  std::mutex reason_mu;  // the reason is written on the scheduler's thread, read here
  std::string release_reason;

  ManagerOptions mo;
  mo.config = config;
  mo.backend = *backend;
  mo.log = [&release_reason, &reason_mu, quiet = o.quiet, level = config.log_level,
            time = config.log_time](LogLevel l, std::string_view msg) {
    // Called with the manager's lock held: only note and signal.
    if (l == LogLevel::info && msg.rfind("released ", 0) == 0) {
      {
        std::lock_guard<std::mutex> g(reason_mu);
        release_reason = std::string(msg);
      }
      const char b = 1;
      if (::write(g_released_fd.load(), &b, 1) < 0) { /* the pipe is full: a wake-up is pending already */
      }
    }
    if (!quiet || l <= LogLevel::warn)
      if (static_cast<int>(l) <= static_cast<int>(level)) log_to_stderr(l, msg, time);
  };
  auto starting = std::make_unique<SignalsWhileStarting>(sfd);
  auto manager = Manager::create(mo);
  if (!manager) {
    if (const int sig = starting->finish()) {
      std::printf("residency hold: %s while joining the shared budget: exiting\n", signal_name(sig));
      return kExitOk;
    }
    throw BadInput(manager.message());
  }
  std::vector<std::optional<RegionId>> ids;
  {
    auto batch = (*manager)->batch();
    int priority = static_cast<int>(files.size());
    for (auto& f : files) {
      auto id = (*manager)->register_region(f.data(), f.size(), RegionClass::weights, priority--);
      if (!id && id.status().code() == ErrorCode::limit_exceeded)
        throw BadInput("'" + printable(f.path()) + "': " + id.message() + "; hold fewer or smaller files");
      if (!id) throw BadInput("'" + printable(f.path()) + "': " + id.message());
      ids.emplace_back(*id);
    }
  }
  const int early_signal = starting->finish();
  starting.reset();
  const Stats s = (*manager)->stats();
  std::printf("residency hold: holding %s of %s in %zu file(s) (keep-alive %s, wired limit %s%s)\n",
              format_size(s.wired_bytes).c_str(), format_size(s.tracked_bytes).c_str(), files.size(),
              config.keep_alive.to_string().c_str(), format_size(s.wired_limit).c_str(),
              config.release_on_pressure ? ", release on pressure" : "");
  if (s.pending_bytes > 0 && s.shared_short > 0 && config.shared_budget)
    std::printf(
        "residency hold: %s is not wired: the shared budget %s (%s, RESIDENCY_SHARED_BUDGET) had no room for it "
        "(the warning above says why; `residency stat` lists its holders)\n",
        format_size(s.pending_bytes).c_str(), config.shared_budget->name.c_str(), format_size(s.shared_budget).c_str());
  else if (s.pending_bytes > 0)
    std::printf("residency hold: %s is not wired: over the wired limit of %s (%s)\n",
                format_size(s.pending_bytes).c_str(), format_size(s.wired_limit).c_str(),
                wired_limit_source(o, (*backend)->memory_info(), s.wired_limit).c_str());
  if (s.wired_bytes < s.admitted_bytes)
    std::printf(
        "residency hold: %s is not wired: the kernel refused it (RLIMIT_MEMLOCK without CAP_IPC_LOCK is the "
        "usual cause: ulimit -l unlimited, LimitMEMLOCK=infinity or --cap-add IPC_LOCK)\n",
        format_size(s.admitted_bytes - s.wired_bytes).c_str());
  std::fflush(stdout);
  int status = kExitOk;
  if (early_signal != 0) {
    std::printf("residency hold: %s: unlocking and exiting\n", signal_name(early_signal));
  } else if (s.wired_bytes == 0) {
    std::fprintf(stderr, "residency hold: nothing could be wired; exiting\n");
    status = kExitFailure;
  } else if (std::ferror(stdout)) {
    // Its stdout is gone (a pipe nobody reads, a full disk): say so (main) and unlock now rather
    // than hold for a reader that cannot learn what is held.
    status = kExitFailure;
  } else {
    pollfd fds[2] = {{sfd, POLLIN, 0}, {released[0], POLLIN, 0}};
    for (;;) {
      const int ready = ::poll(fds, 2, kFileCheckMs);
      if (ready < 0) {
        if (errno == EINTR) continue;
        break;
      }
      if (ready == 0) {
        if (!follow_files(**manager, files, ids)) {
          std::printf("residency hold: none of the files is left to hold; exiting\n");
          break;
        }
        continue;
      }
      if (fds[0].revents & POLLIN) {
        signalfd_siginfo si{};
        if (::read(sfd, &si, sizeof si) == sizeof si)
          std::printf("residency hold: %s: unlocking and exiting\n", signal_name(static_cast<int>(si.ssi_signo)));
        break;
      }
      if (fds[1].revents & POLLIN) {
        std::lock_guard<std::mutex> g(reason_mu);
        std::printf("residency hold: %s; exiting\n", release_reason.c_str());
        break;
      }
    }
  }
  std::fflush(stdout);
  for (const auto& id : ids)
    if (id) (void)(*manager)->unregister_region(*id);  // unlocks
  manager->reset();
  g_released_fd = -1;
  ::close(released[0]);
  ::close(released[1]);
  ::close(sfd);
  return status;
}

const Command
    cmd{"hold", "keep files resident (locked) for every process that maps them, under a keep-alive and a budget",
        [](CLI::App& app) {
          auto o = std::make_shared<HoldOptions>();
          app.add_option("FILE", o->files,
                         "files to hold (a model, its shards); earlier files win when the budget must choose")
              ->required();
          add_text_option(app, "--keep-alive", o->keep_alive,
                          "how long to hold, counted from the start (not from the last read of the files: "
                          "hold cannot see other processes' reads): a duration (500ms, 30m, 2h) or forever; "
                          "default RESIDENCY_KEEP_ALIVE, else forever");
          add_text_option(app, "--wired-limit", o->wired_limit,
                          "most to lock: bytes (8GiB) or a percent of the recommended working set (50%), above 0; "
                          "default RESIDENCY_WIRED_LIMIT, else the recommended working set");
          app.add_flag("--release-on-pressure", o->release_on_pressure,
                       "give everything back when the kernel reports memory pressure, then exit: PSI (this process's "
                       "cgroup v2 memory.pressure, else /proc/pressure/memory) or, in a cgroup v1 memory cgroup, "
                       "its memory.pressure_level; `residency stat` shows which on its 'pressure watch' line");
          app.add_flag("-q,--quiet", o->quiet, "only warnings and errors from the library");
          app.footer(
              "Stops on SIGINT, SIGTERM or SIGHUP (unlocking everything; a SIGHUP ignored at the start, as "
              "under nohup, stays ignored), or when the keep-alive expires or "
              "memory pressure releases the files, or when every file was deleted; exit status 0. Bad input: "
              "exit 2. Nothing could be wired, or stdout cannot be written: exit 1. Files are checked once a "
              "second: a deleted file (its last name removed, or replaced by another file) is released and said "
              "once; a file that shrank or grew is held at its new length (never past its end). Also honours "
              "RESIDENCY_* (the options win).");
          return [o] { return run_hold(*o); };
        }};

}  // namespace
}  // namespace residency::tool
