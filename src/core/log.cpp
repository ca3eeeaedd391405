// SPDX-License-Identifier: MIT
#include "log.hpp"

#include <cstdio>

namespace residency {

void log_to_stderr(LogLevel level, std::string_view message) {
  std::fprintf(stderr, "residency: %s: %.*s\n", to_string(level), static_cast<int>(message.size()),
               message.data());
}

namespace core {

std::string mib(std::uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buf;
}

std::string ms(Nanos d) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f ms", static_cast<double>(d.count()) / 1e6);
  return buf;
}

}  // namespace core
}  // namespace residency
