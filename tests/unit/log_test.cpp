// SPDX-License-Identifier: MIT
// The default log line as a user reads it on stderr: "residency[PID]: level: message", with the
// local time after the pid under RESIDENCY_LOG_TIME=1, and on a fresh line after a host
// program's unfinished line when stderr is a file. Each case runs in a child process whose
// stderr is a real file (or pipe), read back afterwards.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <regex>
#include <string>

#include "residency/backends.hpp"
#include "residency/config.hpp"
#include "residency/residency.hpp"

namespace {

struct Logged {
  pid_t pid = -1;
  std::string text;
};

// Runs `body` in a child whose stderr is a fresh file; what the file holds afterwards.
Logged in_child_with_stderr_file(const std::function<void()>& body) {
  const std::string path = ::testing::TempDir() + "/residency-log-test-" + std::to_string(::getpid()) + ".err";
  ::unlink(path.c_str());
  Logged out;
  out.pid = ::fork();
  if (out.pid == 0) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);  // write-only, as `2>file` opens it
    if (fd < 0 || ::dup2(fd, STDERR_FILENO) < 0) ::_exit(126);
    body();
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(out.pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  std::ifstream f(path, std::ios::binary);
  out.text.assign(std::istreambuf_iterator<char>(f), {});
  ::unlink(path.c_str());
  return out;
}

TEST(Log, EveryLineCarriesThePidAndStartsOnAFreshLineAfterAHostsPartialLine) {
  const Logged l = in_child_with_stderr_file([] {
    residency::log_to_stderr(residency::LogLevel::info, "first");
    const char partial[] = "llama_model_load: loading ...";  // no newline, as llama.cpp's dots
    if (::write(STDERR_FILENO, partial, sizeof partial - 1) < 0) ::_exit(125);
    residency::log_to_stderr(residency::LogLevel::warn, "second");
    residency::log_to_stderr(residency::LogLevel::info, "third");
  });
  const std::string p = "residency[" + std::to_string(l.pid) + "]: ";
  EXPECT_EQ(l.text, p + "info: first\nllama_model_load: loading ...\n" + p + "warn: second\n" + p + "info: third\n");
}

TEST(Log, WithTimeTheLocalTimeFollowsThePid) {
  const Logged l = in_child_with_stderr_file([] { residency::log_to_stderr(residency::LogLevel::info, "hello", true); });
  EXPECT_TRUE(
      std::regex_match(l.text,
                       std::regex(
                           "residency\\[" + std::to_string(l.pid) +
                           "\\]: 20[0-9]{2}-[0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{3} info: hello\n")))
      << l.text;
}

TEST(Log, TheManagersDefaultLogFollowsResidencyLogTime) {
  auto on = residency::Config::from_env(
      [](const char* n) { return std::strcmp(n, "RESIDENCY_LOG_TIME") == 0 ? "1" : nullptr; });
  ASSERT_TRUE(on.is_ok()) << on.message();
  EXPECT_TRUE(on->log_time);
  auto off = residency::Config::from_env([](const char*) -> const char* { return nullptr; });
  ASSERT_TRUE(off.is_ok());
  EXPECT_FALSE(off->log_time);
  // A manager without a log callback: its start-up line carries the time.
  const Logged l = in_child_with_stderr_file([&] {
    auto backend = residency::make_backend("sim");
    if (!backend) ::_exit(124);
    residency::ManagerOptions o;
    o.config = *on;
    o.backend = *backend;
    auto m = residency::Manager::create(o);
    if (!m) ::_exit(123);
  });
  EXPECT_TRUE(std::regex_search(
      l.text,
      std::regex("^residency\\[" + std::to_string(l.pid) +
                 "\\]: 20[0-9]{2}-[0-9]{2}-[0-9]{2} [0-9:]{8}\\.[0-9]{3} info: creating a residency set collection")))
      << l.text;
  auto bad = residency::Config::from_env(
      [](const char* n) { return std::strcmp(n, "RESIDENCY_LOG_TIME") == 0 ? "sometimes" : nullptr; });
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.message().find("RESIDENCY_LOG_TIME"), std::string::npos) << bad.message();
  EXPECT_NE(bad.message().find("0 or 1"), std::string::npos) << bad.message();
}

}  // namespace
