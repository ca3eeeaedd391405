// SPDX-License-Identifier: MIT
// Threads registering, unregistering and touching while keep-alive expires and the limit
// changes. After every step of every thread: wired <= limit and the byte accounting is exact;
// inside every backend call: resident bytes never exceed the largest limit in force.
#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <thread>

#include "support/manager_fixture.hpp"

using namespace residency;
using namespace residency::testing;
using namespace std::chrono_literals;

namespace {

// A FakeBackend that checks, inside each call (the manager's lock is held), that what it
// holds resident fits the limit the test has in force.
class CheckingBackend : public FakeBackend {
 public:
  std::atomic<std::uint64_t> limit_ceiling{UINT64_MAX};
  std::atomic<int> violations{0};
  const char* where = "";
  void check() {
    if (resident_bytes() > limit_ceiling.load()) {
      if (violations.fetch_add(1) == 0) {
        fprintf(stderr, "VIOLATION in %s: resident %llu ceiling %llu\n", where, (unsigned long long)resident_bytes(),
                (unsigned long long)limit_ceiling.load());
        for (auto& [id, st] : sets)
          fprintf(stderr, " set %u exists %d req %d members %zu bytes %llu staged_add %zu staged_rm %zu\n", id,
                  st.exists, st.requested, st.members.size(), (unsigned long long)members_bytes(st),
                  st.staged_add.size(), st.staged_remove.size());
      }
    }
  }
  SetOutcome commit(SetId s) override {
    auto o = FakeBackend::commit(s);
    where = "commit";
    check();
    return o;
  }
  SetOutcome request_residency(SetId s) override {
    auto o = FakeBackend::request_residency(s);
    where = "request";
    check();
    return o;
  }
};

}  // namespace

TEST(Stress, ConcurrentRegistrationTouchExpiryAndLimitChanges) {
  auto backend = std::make_shared<CheckingBackend>();
  backend->recommended = 16 * GiB;  // memory limit 24 GiB: registrations are never refused
  backend->physical = 64 * GiB;
  ManualClock clock(Nanos(std::chrono::hours(1)));
  LogCapture logs;
  ManagerOptions o;
  o.config.keep_alive = KeepAlive::after(200ms);  // expires every few clock steps
  o.config.wired_limit = WiredLimit{false, 512 * MiB, 0};
  o.config.set_max_pct = 0.5;  // 82 MiB sets: many sets, many moves
  o.backend = backend;
  o.clock = &clock;
  o.log = logs.callback();
  backend->limit_ceiling = 512 * MiB;
  auto created = Manager::create(o);
  ASSERT_TRUE(created.is_ok()) << created.message();
  Manager& m = **created;

  constexpr int kThreads = 4;
  constexpr int kSteps = 1500;
  std::atomic<std::uint64_t> tracked{0};
  std::atomic<bool> stop{false};
  std::atomic<int> failures{0};

  // What the backend holds is checked inside every backend call (CheckingBackend: under the
  // manager's lock, against the limit in force then); between calls, the manager's own snapshot
  // must keep admitted bytes within its limit. (Comparing the backend's bytes with the limit from
  // another thread, outside the lock, would race with the limiter and prove nothing.)
  auto check_stats = [&] {
    const Stats s = m.stats();
    if (s.admitted_bytes > s.wired_limit) {
      failures.fetch_add(1);
      ADD_FAILURE() << "admitted " << s.admitted_bytes << " > limit " << s.wired_limit;
    }
  };

  std::atomic<bool> time_runs{false};
  std::atomic<int> rounds{0};  // the timekeeper's advances so far
  std::vector<std::thread> workers;
  for (int t = 0; t < kThreads; ++t) {
    workers.emplace_back([&, t] {
      while (!time_runs.load()) std::this_thread::yield();
      std::mt19937_64 rng(static_cast<std::uint64_t>(t) * 7919 + 1);
      std::vector<std::pair<RegionId, std::uint64_t>> mine;
      // Each thread uses its own address window: registrations never overlap.
      const std::uintptr_t base = (std::uintptr_t(1) << 44) + (std::uintptr_t(t) << 40);
      std::uintptr_t next = base;
      for (int step = 0; step < kSteps; ++step) {
        // Every 100 steps, wait for the clock to move once: on a loaded machine the workers could
        // otherwise finish before the timekeeper ran at all, and no keep-alive would expire.
        if (step % 100 == 0) {
          const int seen = rounds.load();
          while (rounds.load() == seen) std::this_thread::yield();
        }
        const int op = static_cast<int>(rng() % 10);
        if (op < 4 || mine.empty()) {
          const std::uint64_t size = (1 + rng() % 64) * MiB;
          auto id = m.register_region(reinterpret_cast<void*>(next), size, static_cast<RegionClass>(rng() % 3),
                                      static_cast<int>(rng() % 4));
          next += size + 4096;
          if (id) {
            mine.emplace_back(*id, size);
            tracked.fetch_add(size);
          } else {
            failures.fetch_add(1);
            ADD_FAILURE() << id.message();
          }
        } else if (op < 7) {
          const std::size_t i = rng() % mine.size();
          if (!m.unregister_region(mine[i].first)) failures.fetch_add(1);
          tracked.fetch_sub(mine[i].second);
          mine.erase(mine.begin() + static_cast<long>(i));
        } else {
          m.touch();
        }
        check_stats();
      }
      for (auto& [id, size] : mine) {
        if (!m.unregister_region(id)) failures.fetch_add(1);
        tracked.fetch_sub(size);
      }
    });
  }
  std::thread timekeeper([&] {
    time_runs = true;
    while (!stop.load()) {
      clock.advance(300ms);
      m.run_due();
      rounds.fetch_add(1);
      check_stats();
      std::this_thread::yield();
    }
  });
  std::thread limiter([&] {
    std::mt19937_64 rng(42);
    while (!stop.load()) {
      const std::uint64_t next = (64 + rng() % 960) * MiB;
      const std::uint64_t cur = m.wired_limit();
      backend->limit_ceiling = std::max(cur, next);  // either may be in force during the call
      if (!m.set_wired_limit(next)) failures.fetch_add(1);
      backend->limit_ceiling = next;
      check_stats();
      std::this_thread::yield();
    }
  });
  for (auto& w : workers) w.join();
  stop = true;
  timekeeper.join();
  limiter.join();

  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(backend->violations.load(), 0);
  const Stats s = m.stats();
  EXPECT_EQ(s.tracked_bytes, 0u);
  EXPECT_EQ(s.admitted_bytes, 0u);
  EXPECT_EQ(tracked.load(), 0u);
  EXPECT_GT(s.releases, 0u);  // the keep-alive did expire under load
  EXPECT_GT(s.rewires, 0u);
  EXPECT_EQ(backend->resident_bytes(), 0u) << "every region was unregistered";
  EXPECT_EQ(backend->reserved, 0u) << "every reservation was given back";
  EXPECT_LE(backend->max_resident, 1024 * MiB) << "never more than the largest limit set";
  created->reset();
  EXPECT_EQ(backend->live_sets(), 0);
}

TEST(Stress, TouchRacingTheReleaseNeverLeavesAUseUnwired) {
  // The release decision and touch() race; after every touch() returns, memory must be
  // resident (the engine computes right after touching).
  auto backend = std::make_shared<FakeBackend>();
  ManualClock clock(Nanos(std::chrono::hours(1)));
  ManagerOptions o;
  o.config.keep_alive = KeepAlive::after(1ms);
  o.backend = backend;
  o.clock = &clock;
  o.log = [](LogLevel, std::string_view) {};
  o.start_scheduler = false;
  auto m = Manager::create(o);
  ASSERT_TRUE(m.is_ok());
  ASSERT_TRUE((*m)->register_region(reinterpret_cast<void*>(std::uintptr_t(1) << 40), 1 << 20).is_ok());
  std::atomic<bool> stop{false}, started{false};
  std::atomic<int> unwired_after_touch{0};
  std::thread releaser([&] {
    started = true;
    while (!stop.load()) {
      clock.advance(2ms);
      (*m)->run_due();
    }
  });
  while (!started.load()) std::this_thread::yield();
  for (int i = 0; i < 2'000'000; ++i) {
    // If the memory was released before this touch(), touch() must have wired it again, so
    // right after it either the memory is resident or a newer release has happened.
    const std::uint64_t releases_before = (*m)->stats().releases;
    (*m)->touch();
    const bool resident = backend->resident_bytes() > 0;  // what the backend holds
    const Stats s = (*m)->stats();
    if (!resident && s.releases == releases_before) unwired_after_touch.fetch_add(1);
    if (i >= 20'000 && s.rewires >= 50) break;
  }
  stop = true;
  releaser.join();
  EXPECT_EQ(unwired_after_touch.load(), 0);
  EXPECT_GT((*m)->stats().rewires, 0u);
}
