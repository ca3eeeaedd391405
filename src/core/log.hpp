// SPDX-License-Identifier: MIT
// LogSink: the manager's one way to speak, filtered by the configured level.
//
// Lines follow llama.cpp's and MLX's wording where they have one (docs/design.md, "Logs"), so that
// their users recognise them. Formatting a line costs more than most of what the manager does, so a
// line is only built when its level is enabled (ask enabled() first for expensive ones).
#pragma once

#include <cstdint>
#include <string>

#include "core/text.hpp"  // mib(), ms(): the numbers in the log lines
#include "residency/clock.hpp"
#include "residency/config.hpp"
#include "residency/residency.hpp"

namespace residency::core {

class LogSink {
 public:
  LogSink(LogCallback callback, LogLevel level) : callback_(std::move(callback)), level_(level) {}
  bool enabled(LogLevel l) const { return callback_ && static_cast<int>(l) <= static_cast<int>(level_); }
  void operator()(LogLevel l, const std::string& message) const {
    if (enabled(l)) callback_(l, message);
  }

 private:
  LogCallback callback_;
  LogLevel level_;
};

// The default callback: log_to_stderr, with the time when config.log_time says so.
LogCallback stderr_log(const Config& config);

}  // namespace residency::core
