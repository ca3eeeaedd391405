// SPDX-License-Identifier: MIT
// A program a test starts and talks to: stdout read line by line with a timeout, stdin written
// a line at a time (or /dev/null), stderr into a file; killed and reaped when it goes out of
// scope, so a failing assertion leaves no process behind. Used by the tests that run real
// programs under the preload (tests/preload, tests/pressure).
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "support/state_files.hpp"

extern char** environ;

namespace residency::testing {

struct ChildSpec {
  std::vector<std::string> argv;               // argv[0] is the program's path
  std::vector<std::string> env;                // NAME=VALUE added to the inherited environment
  std::vector<std::string> drop_env_prefixes;  // inherited variables starting so are left out
  bool stdin_pipe = false;                     // else stdin is /dev/null
  std::string stderr_path;                     // the child's stderr goes here (truncated)
  // Runs in the child after fork, before exec (join a cgroup, drop a capability, set a limit);
  // false: the child exits with 126 instead of running the program.
  std::function<bool()> before_exec;
};

class ChildProcess {
 public:
  explicit ChildProcess(const ChildSpec& s) : err_path_(s.stderr_path) {
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string kv = *e;
      bool drop = false;
      for (const auto& p : s.drop_env_prefixes) drop = drop || kv.rfind(p, 0) == 0;
      if (!drop) env.push_back(kv);
    }
    env.insert(env.end(), s.env.begin(), s.env.end());
    std::vector<char*> argv, envp;
    for (const auto& a : s.argv) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    for (auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
    envp.push_back(nullptr);

    int out[2] = {-1, -1}, in[2] = {-1, -1};
    if (s.argv.empty() || ::pipe2(out, O_CLOEXEC) != 0) return;
    if (s.stdin_pipe && ::pipe2(in, O_CLOEXEC) != 0) {
      ::close(out[0]);
      ::close(out[1]);
      return;
    }
    const int err_fd = ::open(s.stderr_path.empty() ? "/dev/null" : s.stderr_path.c_str(),
                              O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(s.stdin_pipe ? in[0] : null_fd, 0);
      ::dup2(out[1], 1);
      ::dup2(err_fd, 2);
      if (s.before_exec && !s.before_exec()) ::_exit(126);
      ::execve(argv[0], argv.data(), envp.data());
      ::_exit(127);
    }
    ::close(out[1]);
    out_fd_ = out[0];
    if (s.stdin_pipe) {
      ::close(in[0]);
      in_fd_ = in[1];
    }
    if (err_fd >= 0) ::close(err_fd);
    if (null_fd >= 0) ::close(null_fd);
    if (pid_ < 0) close_fds();
  }
  ~ChildProcess() { kill(); }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  bool started() const { return pid_ > 0; }
  bool alive() const { return pid_ > 0 && !reaped_ && ::waitpid(pid_, nullptr, WNOHANG) == 0; }

  // The next line of stdout, or nullopt at the end of the output or after `timeout_s`.
  std::optional<std::string> read_line(double timeout_s = 120) {
    const auto t0 = Clock::now();
    for (;;) {
      if (const auto nl = buf_.find('\n'); nl != std::string::npos) {
        std::string line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        out_ += line + "\n";
        return line;
      }
      const double left = timeout_s - seconds_since(t0);
      if (left <= 0 || out_fd_ < 0) return std::nullopt;
      pollfd p{out_fd_, POLLIN, 0};
      const int r = ::poll(&p, 1, static_cast<int>(left * 1000) + 1);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return std::nullopt;
      char chunk[4096];
      const ssize_t n = ::read(out_fd_, chunk, sizeof chunk);
      if (n <= 0) return std::nullopt;
      buf_.append(chunk, static_cast<std::size_t>(n));
    }
  }
  // Reads lines until one starts with `prefix` (the others are kept in stdout_text()).
  std::optional<std::string> wait_for(const std::string& prefix, double timeout_s = 120) {
    const auto t0 = Clock::now();
    for (;;) {
      const double left = timeout_s - seconds_since(t0);
      if (left <= 0) return std::nullopt;
      auto line = read_line(left);
      if (!line) return std::nullopt;
      if (line->rfind(prefix, 0) == 0) return line;
    }
  }
  bool send_line(const std::string& line = "") {
    const std::string l = line + "\n";
    return in_fd_ >= 0 && ::write(in_fd_, l.data(), l.size()) == static_cast<ssize_t>(l.size());
  }
  void close_stdin() {
    if (in_fd_ >= 0) ::close(in_fd_);
    in_fd_ = -1;
  }
  // Closes stdin, reads the rest of stdout and waits for the exit, killing the child after
  // `timeout_s`: its exit code, or -1 when a signal ended it.
  int finish(double timeout_s = 120) {
    close_stdin();
    if (pid_ <= 0 || reaped_) return -1;
    while (read_line(timeout_s)) {
    }
    const auto t0 = Clock::now();
    int status = 0;
    for (;;) {
      const pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_ || (r < 0 && errno != EINTR)) break;
      if (seconds_since(t0) > timeout_s) {
        ::kill(pid_, SIGKILL);
        while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
        }
        remove_state_files_of(pid_);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    reaped_ = true;
    close_fds();
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  // SIGKILL and reap (nothing when it has exited and been reaped already).
  void kill() {
    close_stdin();
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      while (::waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
      }
      remove_state_files_of(pid_);
      reaped_ = true;
    }
    close_fds();
  }
  // Every stdout line read so far.
  const std::string& stdout_text() const { return out_; }
  std::string stderr_text() const {
    std::ifstream f(err_path_);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }

 private:
  using Clock = std::chrono::steady_clock;
  static double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
  void close_fds() {
    close_stdin();
    if (out_fd_ >= 0) ::close(out_fd_);
    out_fd_ = -1;
  }

  std::string err_path_;
  pid_t pid_ = -1;
  int out_fd_ = -1, in_fd_ = -1;
  bool reaped_ = false;
  std::string buf_, out_;
};

}  // namespace residency::testing
