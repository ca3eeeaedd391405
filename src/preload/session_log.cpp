// SPDX-License-Identifier: MIT
#include "session_log.hpp"

namespace residency::preload {

namespace {

std::string one_line(std::string s) {
  for (std::size_t p = s.find('\n'); p != std::string::npos; p = s.find('\n', p)) s.replace(p, 1, "; ");
  return s;
}

}  // namespace

void SessionLog::write(LogLevel level, const std::string& message) const noexcept {
  if (!enabled(level)) return;
  try {
    const std::string line = "preload: " + one_line(message);
    if (sink_) sink_(level, line);
    else log_to_stderr(level, line, with_time_);
  } catch (...) {
  }
}

LogCallback SessionLog::for_manager(std::string prefix) const {
  return [prefix = std::move(prefix), level = level_, time = with_time_, sink = sink_](LogLevel l,
                                                                                       std::string_view message) {
    if (l > level) return;
    const std::string line = prefix + std::string(message);
    if (sink) sink(l, line);
    else log_to_stderr(l, line, time);
  };
}

}  // namespace residency::preload
