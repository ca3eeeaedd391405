// SPDX-License-Identifier: MIT
// The one entry around an engine call (Manager::begin_call / end_call / access), on the fake
// backend with a ManualClock: what the backend holds during and after calls, under each policy.
#include <gtest/gtest.h>

#include <algorithm>
#include <mutex>
#include <thread>

#include "support/manager_fixture.hpp"

using namespace residency;
using namespace residency::testing;
using namespace std::chrono_literals;

// A decode longer than the keep-alive is not released under it (before the entry, the preload's
// touches around llama_decode let the scheduler release mid-decode), and the keep-alive counts
// from the end of the call.
TEST_F(ManagerTest, ACallLongerThanTheKeepAliveIsNeverReleasedDuringItAndExpiresAfterItsEnd) {
  auto m = make(with_keep_alive("10s"));
  RegionId id = reg(*m, 64 * MiB);
  m->begin_call();
  for (int i = 0; i < 5; ++i) {
    advance(9s);
    const auto next = m->run_due();
    ASSERT_TRUE(next.has_value()) << "a deadline stays scheduled while the call is open";
    EXPECT_TRUE(fake->is_resident(id)) << "released during a call, after " << 9 * (i + 1) << " s";
  }
  m->end_call();
  advance(9s);
  m->run_due();
  EXPECT_TRUE(fake->is_resident(id)) << "the keep-alive counts from the end of the call";
  advance(2s);
  m->run_due();
  EXPECT_FALSE(fake->is_resident(id));
  EXPECT_EQ(m->stats().releases, 1u);
  m->begin_call();  // a call after the release wires again before it returns
  EXPECT_TRUE(fake->is_resident(id));
  m->end_call();
  EXPECT_EQ(m->stats().rewires, 1u);
}

TEST_F(ManagerTest, CallsOnTheFastPathMakeNoBackendCall) {
  auto m = make();
  reg(*m, 1 * MiB);
  const int req = fake->total_requests, com = fake->total_commits;
  for (int i = 0; i < 1000; ++i) {
    m->begin_call();
    m->end_call();
  }
  EXPECT_EQ(fake->total_requests, req);
  EXPECT_EQ(fake->total_commits, com);
}

// Under keep-alive 0 a call wires, overlapping calls share it, and the last end releases after the
// synchronize function ran (what the preload's llama_decode hook does with llama_synchronize).
TEST_F(ManagerTest, UnderZeroTheLastOverlappingCallReleasesAfterSynchronizing) {
  auto m = make(with_keep_alive("0"));
  RegionId id = reg(*m, 8 * MiB);
  EXPECT_FALSE(fake->is_resident(id));
  struct Probe {
    FakeBackend* fake;
    RegionId id;
    int syncs = 0;
    bool resident_at_sync = false;
  } probe{fake.get(), id};
  auto sync = [](void* p) {
    auto* pr = static_cast<Probe*>(p);
    ++pr->syncs;
    pr->resident_at_sync = pr->fake->is_resident(pr->id);
  };
  m->begin_call();
  EXPECT_TRUE(fake->is_resident(id));
  m->begin_call();  // a second context decodes meanwhile
  m->end_call(sync, &probe);
  EXPECT_TRUE(fake->is_resident(id)) << "one call is still open";
  m->end_call(sync, &probe);
  EXPECT_EQ(probe.syncs, 2);
  EXPECT_TRUE(probe.resident_at_sync) << "synchronize runs before the release";
  EXPECT_FALSE(fake->is_resident(id));
  EXPECT_EQ(m->stats().releases, 1u);
  m->end_call();  // a stray end is ignored
  EXPECT_FALSE(fake->is_resident(id));
}

// Under 0, a stray end_call() on another thread (one that began no call) while a call is in flight
// is ignored: the memory stays for the call, and the call's own end releases it (before, the stray
// end took the call's count and released mid-call). Said once. A use scope still ends on any thread.
TEST_F(ManagerTest, UnderZeroAStrayEndFromAnotherThreadIsIgnoredWhileACallIsInFlight) {
  auto m = make(with_keep_alive("0"));
  RegionId id = reg(*m, 8 * MiB);
  m->begin_call();
  ASSERT_TRUE(fake->is_resident(id));
  for (int i = 0; i < 2; ++i) std::thread([&] { m->end_call(); }).join();
  EXPECT_TRUE(fake->is_resident(id)) << "released by a stray end while the call was in flight";
  EXPECT_EQ(m->stats().releases, 0u);
  {
    std::lock_guard<std::mutex> g(logs.m);
    EXPECT_EQ(std::count_if(logs.lines.begin(), logs.lines.end(),
                            [](const auto& l) {
                              return l.first == LogLevel::warn &&
                                     l.second.find("end_call() on a thread that holds no call of this manager open") !=
                                         std::string::npos;
                            }),
              1);
  }
  advance(1h);
  m->run_due();
  EXPECT_TRUE(fake->is_resident(id));
  m->end_call();  // the call's own end
  EXPECT_FALSE(fake->is_resident(id));
  EXPECT_EQ(m->stats().releases, 1u);

  // Two threads' calls overlap: each end is its own thread's, and the last releases.
  m->begin_call();
  std::thread other([&] {
    m->begin_call();
    m->end_call();
  });
  other.join();
  EXPECT_TRUE(fake->is_resident(id)) << "this thread's call is still open";
  m->end_call();
  EXPECT_FALSE(fake->is_resident(id));

  // A use scope begun here and ended on another thread is no stray end.
  UseScope scope = m->use();
  EXPECT_TRUE(fake->is_resident(id));
  std::thread([s = std::move(scope)]() mutable { s = UseScope(); }).join();
  EXPECT_FALSE(fake->is_resident(id));
  EXPECT_EQ(m->stats().releases, 3u);
}

// An access outside a call under 0 (an upload of the input before the decode) wires, and the
// memory stays until the end of the call that follows.
TEST_F(ManagerTest, UnderZeroAnAccessHoldsTheMemoryUntilTheEndOfTheNextCall) {
  auto m = make(with_keep_alive("0"));
  RegionId id = reg(*m, 8 * MiB);
  m->access();
  EXPECT_TRUE(fake->is_resident(id));
  m->access();  // held already: nothing more
  advance(1h);
  m->run_due();
  EXPECT_TRUE(fake->is_resident(id)) << "no keep-alive under 0: held until the next call ends";
  m->begin_call();
  m->end_call();
  EXPECT_FALSE(fake->is_resident(id));
  EXPECT_EQ(m->stats().releases, 1u);
}

// Pressure, the engine's release_now() and another process's ask never release during a call.
TEST_F(ManagerTest, NeitherPressureNorReleaseNowReleasesDuringACall) {
  Config c = with_keep_alive("forever");
  c.release_on_pressure = true;
  auto m = make(c);
  RegionId id = reg(*m, 8 * MiB, 0, RegionClass::scratch);
  m->begin_call();
  m->notify_memory_pressure();
  m->release_now();
  EXPECT_TRUE(fake->is_resident(id));
  EXPECT_TRUE(logs.contains(LogLevel::warn, "still open; not releasing"));
  m->end_call();
  m->release_now();
  EXPECT_FALSE(fake->is_resident(id));
}

TEST_F(ManagerTest, UnderOffCallsDoNothing) {
  auto m = make(with_keep_alive("off"));
  reg(*m, 1 * MiB);
  const int req = fake->total_requests;
  m->begin_call();
  m->access();
  m->end_call();
  EXPECT_EQ(fake->total_requests, req);
}
