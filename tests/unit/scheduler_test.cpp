// SPDX-License-Identifier: MIT
// The keep-alive scheduler thread, driven by a ManualClock: it sleeps until its deadline,
// wakes zero times once the keep-alive has expired, refreshes only for backends that ask,
// and stops at once on shutdown. Waiting here is for the thread to act, never for time.
#include <gtest/gtest.h>

#include <thread>

#include "support/manager_fixture.hpp"

using namespace residency;
using namespace residency::testing;
using namespace std::chrono_literals;

namespace {
// Waits (real time, bounded) for another thread to reach a state. Not a timing assertion.
template <typename Pred>
bool eventually(Pred p) {
  const auto until = std::chrono::steady_clock::now() + 20s;
  while (std::chrono::steady_clock::now() < until) {
    if (p()) return true;
    std::this_thread::yield();
  }
  return p();
}
}  // namespace

class SchedulerTest : public ManagerTest {};

TEST_F(SchedulerTest, ReleasesAtExpiryAndThenWakesZeroTimesWhileIdle) {
  auto m = make(with_keep_alive("10s"), /*start_scheduler=*/true);
  reg(*m, 64 * MiB);
  ASSERT_TRUE(eventually([&] { return clock.waiters() == 1; }));  // asleep until the deadline
  advance(11s);
  ASSERT_TRUE(eventually([&] { return m->stats().releases == 1 && clock.waiters() == 1; }));
  EXPECT_FALSE(m->stats().resident);
  const auto wakeups = m->stats().scheduler_wakeups;
  for (int i = 0; i < 3600; ++i) advance(1s);  // an idle hour
  EXPECT_EQ(m->stats().scheduler_wakeups, wakeups);
  // The next use wires again and re-arms the scheduler.
  m->touch();
  EXPECT_TRUE(m->stats().resident);
  advance(11s);
  ASSERT_TRUE(eventually([&] { return m->stats().releases == 2; }));
}

TEST_F(SchedulerTest, WhileInUseItWakesAboutOncePerKeepAlivePeriod) {
  auto m = make(with_keep_alive("10s"), true);
  reg(*m, 1 * MiB);
  ASSERT_TRUE(eventually([&] { return clock.waiters() == 1; }));
  const auto w0 = m->stats().scheduler_wakeups;
  for (int i = 0; i < 60; ++i) {  // one use a second for a minute
    m->touch();
    advance(1s);
    // Let the thread settle after each step so the count is deterministic.
    ASSERT_TRUE(eventually([&] { return clock.waiters() == 1; }));
  }
  EXPECT_EQ(m->stats().releases, 0u);
  const auto wakeups = m->stats().scheduler_wakeups - w0;
  EXPECT_GE(wakeups, 5u);
  EXPECT_LE(wakeups, 7u);  // llama.cpp's heartbeat: 12,000 wake-ups in the same minute
}

TEST_F(SchedulerTest, RefreshesWhileResidentForBackendsThatAskThenStops) {
  fake->needs_refresh = true;  // every 500 ms
  auto m = make(with_keep_alive("3s"), true);
  reg(*m, 1 * MiB);
  for (int i = 0; i < 12; ++i) {  // 6 s in 500 ms steps
    ASSERT_TRUE(eventually([&] { return clock.waiters() == 1; }));
    advance(500ms);
  }
  ASSERT_TRUE(eventually([&] { return m->stats().releases == 1 && clock.waiters() == 1; }));
  const auto requests = m->stats().residency_requests;
  EXPECT_GE(requests, 5u);  // 1 initial + refreshes at 0.5 .. 2.5 s
  for (int i = 0; i < 20; ++i) advance(500ms);
  EXPECT_EQ(m->stats().residency_requests, requests);
}

TEST_F(SchedulerTest, ShutdownIsImmediateEvenWithAFarDeadline) {
  auto m = make(with_keep_alive("1h"), true);
  reg(*m, 1 * MiB);
  ASSERT_TRUE(eventually([&] { return clock.waiters() == 1; }));
  const auto t0 = std::chrono::steady_clock::now();
  m.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);  // not an hour: a notify, not a timeout
  EXPECT_EQ(fake->resident_bytes(), 0u);
}

TEST_F(SchedulerTest, WithTheSteadyClockShutdownIsImmediateToo) {
  ManagerOptions o;
  o.config = with_keep_alive("1h");
  o.backend = fake;
  o.log = logs.callback();
  auto m = Manager::create(o);
  ASSERT_TRUE(m.is_ok());
  const auto t0 = std::chrono::steady_clock::now();
  m->reset();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
}

TEST_F(SchedulerTest, PrefetchWiresOnTheSchedulerThreadAndReturnsAtOnce) {
  auto m = make(with_keep_alive("10s"), true);
  reg(*m, 64 * MiB);
  advance(11s);
  ASSERT_TRUE(eventually([&] { return m->stats().releases == 1 && clock.waiters() == 1; }));
  m->prefetch();
  ASSERT_TRUE(eventually([&] { return m->stats().rewires == 1; }));  // done by the scheduler
  EXPECT_TRUE(m->stats().resident);
  m->touch();  // finds it resident: no second re-wire
  EXPECT_EQ(m->stats().rewires, 1u);
}

// The first release, prepared (docs/design.md): a holder that may be released and never was asks
// its backend, once it has been idle for 100 ms, to prepare that release in the background; a
// use tells the backend to stop, the next idle period asks again, and a backend with nothing left
// is not asked again.
TEST_F(SchedulerTest, TheFirstReleaseIsPreparedAfterABriefIdleAndAUseStopsIt) {
  fake->prepares_release = true;
  fake->prepare_answer = Backend::Preparation::started;
  auto m = make(with_keep_alive("10m"), true);
  reg(*m, 64 * MiB);
  ASSERT_TRUE(eventually([&] { return clock.waiters() == 1; }));
  advance(90ms);
  ASSERT_TRUE(eventually([&] { return clock.waiters() == 1; }));
  EXPECT_EQ(fake->prepare_calls.load(), 0) << "not before 100 ms of idle";
  advance(10ms);
  ASSERT_TRUE(eventually([&] { return fake->prepare_calls.load() == 1 && clock.waiters() == 1; }));
  EXPECT_EQ(fake->preparation_should_stop(), std::optional<bool>(false));
  m->touch();  // a use: the work stops
  EXPECT_EQ(fake->preparation_should_stop(), std::optional<bool>(true));
  advance(100ms);  // idle again: asked again, to go on
  ASSERT_TRUE(eventually([&] { return fake->prepare_calls.load() == 2 && clock.waiters() == 1; }));
  EXPECT_EQ(fake->preparation_should_stop(), std::optional<bool>(false));
  m->begin_call();  // a call stops it too
  EXPECT_EQ(fake->preparation_should_stop(), std::optional<bool>(true));
  for (int i = 0; i < 5; ++i) {
    advance(100ms);
    ASSERT_TRUE(eventually([&] { return clock.waiters() == 1; }));
  }
  EXPECT_EQ(fake->prepare_calls.load(), 2) << "never while a call is open";
  m->end_call();
  fake->prepare_answer = Backend::Preparation::nothing;
  advance(100ms);
  ASSERT_TRUE(eventually([&] { return fake->prepare_calls.load() == 3 && clock.waiters() == 1; }));
  const auto wakeups = m->stats().scheduler_wakeups;
  for (int i = 0; i < 5; ++i) {  // nothing left: no more asks, and no more wake-ups for it
    m->touch();
    advance(100ms);
    ASSERT_TRUE(eventually([&] { return clock.waiters() == 1; }));
  }
  EXPECT_EQ(fake->prepare_calls.load(), 3);
  EXPECT_LE(m->stats().scheduler_wakeups - wakeups, 1u);
  EXPECT_EQ(m->stats().releases, 0u) << "preparing releases nothing";
  EXPECT_TRUE(m->stats().resident);
  m.reset();  // the manager goes: the backend's work no longer calls its `stop`
  EXPECT_GE(fake->preparation_stops.load(), 1);
  EXPECT_EQ(fake->preparation_should_stop(), std::nullopt);
}

TEST_F(SchedulerTest, NothingIsPreparedWhenNothingWouldBeReleasedOrAfterTheFirstRelease) {
  fake->prepare_answer = Backend::Preparation::started;
  {
    auto m = make(with_keep_alive("3s"), true);  // a backend that prepares nothing is never asked
    reg(*m, 64 * MiB);
    for (int i = 0; i < 10; ++i) {
      ASSERT_TRUE(eventually([&] { return clock.waiters() == 1; }));
      advance(100ms);
    }
    ASSERT_TRUE(eventually([&] { return clock.waiters() == 1; }));
    EXPECT_EQ(fake->prepare_calls.load(), 0);
  }
  fake->prepares_release = true;
  {
    auto m = make(with_keep_alive("forever"), true);  // no budget either: nothing ever sleeps
    reg(*m, 64 * MiB);
    for (int i = 0; i < 10; ++i) {
      ASSERT_TRUE(eventually([&] { return clock.waiters() <= 1; }));
      advance(100ms);
    }
    EXPECT_EQ(fake->prepare_calls.load(), 0);
  }
  {
    auto m = make(with_keep_alive("0"), true);  // released at the end of every call
    reg(*m, 64 * MiB);
    m->begin_call();
    m->end_call();
    advance(5s);
    EXPECT_EQ(fake->prepare_calls.load(), 0);
  }
  auto m = make(with_keep_alive("3s"), true);
  reg(*m, 64 * MiB);
  for (int i = 0; i < 31; ++i) {  // asked after 100 ms, then each 100 ms: the backend has work left
    ASSERT_TRUE(eventually([&] { return clock.waiters() == 1; }));
    advance(100ms);
  }
  ASSERT_TRUE(eventually([&] { return m->stats().releases == 1 && clock.waiters() == 1; }));
  const int asks = fake->prepare_calls.load();
  EXPECT_GE(asks, 1);
  m->touch();  // woken again
  for (int i = 0; i < 5; ++i) {
    advance(100ms);
    ASSERT_TRUE(eventually([&] { return clock.waiters() == 1; }));
  }
  EXPECT_EQ(fake->prepare_calls.load(), asks) << "after a release there is no first release to prepare";
}
