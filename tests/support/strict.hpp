// SPDX-License-Identifier: MIT
// Skips that CI does not accept. A test that can only run when the machine allows it (PSI
// writable, a cgroup to thrash in) skips with its reason on a developer's machine; in CI, where
// the machine is known to allow it, the same condition means the library misbehaved, so the
// test fails instead. .ci/run sets RESIDENCY_TESTS_STRICT=1.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

namespace residency::testing {
inline bool strict_tests() {
  const char* v = std::getenv("RESIDENCY_TESTS_STRICT");
  return v != nullptr && std::strcmp(v, "1") == 0;
}
}  // namespace residency::testing

#define RESIDENCY_SKIP_OR_FAIL_IN_CI(why)                                                     \
  do {                                                                                        \
    if (::residency::testing::strict_tests()) FAIL() << "(RESIDENCY_TESTS_STRICT=1) " << why; \
    GTEST_SKIP() << why;                                                                      \
  } while (0)
