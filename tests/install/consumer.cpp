// SPDX-License-Identifier: MIT
// A C++ program built against the installed static library: the C++ API.
#include <cstdio>

#include "residency/backends.hpp"
#include "residency/residency.hpp"

int main() {
  auto backend = residency::make_backend("auto");
  if (!backend) return std::printf("consumer_static_cxx: %s\n", backend.message().c_str()), 1;
  residency::ManagerOptions o;
  o.config.log_level = residency::LogLevel::error;
  o.backend = *backend;
  auto m = residency::Manager::create(o);
  if (!m) return std::printf("consumer_static_cxx: %s\n", m.message().c_str()), 1;
  (*m)->touch();
  std::printf("consumer_static_cxx: ok (backend %s)\n", (*m)->backend_capabilities().name.c_str());
  return 0;
}
