// SPDX-License-Identifier: MIT
// The tests' guard on kill() (tests/support/safe_kill.cpp): a pid that is not a child's is
// refused. Probed with signal 0, which signals nothing even where the guard is missing (then
// kill(-1, 0) succeeds and this test fails).
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>

TEST(SafeKill, APidThatIsNotAChildsIsRefusedAndARealOneGoesThrough) {
  errno = 0;
  EXPECT_EQ(::kill(-1, 0), -1);
  EXPECT_EQ(errno, EINVAL);
  errno = 0;
  EXPECT_EQ(::kill(0, 0), -1);
  EXPECT_EQ(errno, EINVAL);
  EXPECT_EQ(::kill(::getpid(), 0), 0);
}
