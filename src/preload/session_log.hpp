// SPDX-License-Identifier: MIT
// The preload's own log lines ("residency[PID]: warn: preload: ..."), filtered by the session's
// configured level and written through one sink, so that a test reads exactly what a user would.
//
// Each line is one line: a message with newlines has them replaced by "; " (a server's log is
// read line by line). Never throws: running out of memory while logging loses the line only.
#pragma once

#include <functional>
#include <string>
#include <string_view>

#include "residency/residency.hpp"

namespace residency::preload {

class SessionLog {
 public:
  // Receives the finished line's level and text ("preload: ..."); the default writes to stderr.
  using Sink = std::function<void(LogLevel level, std::string_view line)>;

  // Warnings only, to stderr without a time: what the preload says before it read RESIDENCY_LOG.
  SessionLog() = default;
  SessionLog(LogLevel level, bool with_time, Sink sink = {})
      : level_(level), with_time_(with_time), sink_(std::move(sink)) {}

  void warn(const std::string& message) const noexcept { write(LogLevel::warn, message); }
  void info(const std::string& message) const noexcept { write(LogLevel::info, message); }
  void debug(const std::string& message) const noexcept { write(LogLevel::debug, message); }
  bool enabled(LogLevel level) const noexcept { return level <= level_; }
  LogLevel level() const noexcept { return level_; }
  bool with_time() const noexcept { return with_time_; }
  // The sink as a manager's LogCallback: the manager's own lines, prefixed (a device's "cuda:0: ").
  LogCallback for_manager(std::string prefix) const;

 private:
  void write(LogLevel level, const std::string& message) const noexcept;

  LogLevel level_ = LogLevel::warn;
  bool with_time_ = false;
  Sink sink_;
};

}  // namespace residency::preload
