// SPDX-License-Identifier: MIT
// BudgetShare on its own: two shares of one real ledger in /dev/shm, on one ManualClock, each with
// a mutex standing for its manager's lock and a listener that answers asks as a manager would
// (idle: everything goes back; inside a call: it declines). What the ledger holds is asserted as
// `residency stat` reads it (list_shared_budgets()), and the shares' logs as a user reads them.
// These are the rules the managers' tests (manager_test, device_budget_test) reach only through a
// whole manager and a fake backend.
#include "core/budget_share.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>

#include "ledger/ledger.hpp"
#include "residency/shared_budget.hpp"
#include "support/fake_backend.hpp"
#include "support/state_files.hpp"

using namespace residency;
using namespace residency::core;
using namespace residency::testing;
using namespace std::chrono_literals;

namespace {

constexpr std::uint64_t kMiB = 1024 * 1024;

// One share as a manager holds it: the share under `mu`, its Room beside it, and what the listener
// does when asked.
struct Holder {
  LogCapture logs;
  LogSink sink{logs.callback(), LogLevel::debug};
  Mutex mu;
  std::unique_ptr<BudgetShare> share;
  std::optional<BudgetShare::Room> room;
  std::atomic<bool> in_call{false};
  std::atomic<int> asks{0};

  void join(const std::string& name, std::uint64_t budget, Clock& clock, bool paced_wake = false) {
    auto l = ledger::Ledger::attach({name, budget, "", 0});
    ASSERT_TRUE(l) << l.message();
    BudgetShare::Joined joined(std::move(*l));
    room = BudgetShare::room(joined, clock);
    publisher = BudgetShare::publisher(joined);
    share = std::make_unique<BudgetShare>(joined, /*priority=*/0, paced_wake, clock, sink);
    // As the manager answers: idle, everything goes back (the sets ended: nothing is wired);
    // inside a call, it declines and keeps what it holds.
    room->listen([this](int) {
      asks.fetch_add(1);
      MutexLock g(mu);
      if (!in_call.load()) share->settle(Demand{0, 0, /*wants_resident=*/false});
    });
  }
  // The time of last use, as KeepAliveState publishes it at each use.
  void used_at(Nanos t) const { publisher.fn(publisher.ctx, t.count()); }
  LastUsePublisher publisher;
  ~Holder() {
    if (room) room->stop_listening(mu);
  }
};

class BudgetShareTest : public ::testing::Test {
 protected:
  BudgetShareTest() { remove_ledgers_of_dead_runs("unit-share-"); }
  ManualClock clock{Nanos(std::chrono::hours(1))};
  const std::string name = "unit-share-" + std::to_string(::getpid()) + "-" +
                           ::testing::UnitTest::GetInstance()->current_test_info()->name();
  Holder a, b;

  void join_both(std::uint64_t budget, bool paced_wake = false) {
    a.join(name, budget, clock, paced_wake);
    b.join(name, budget, clock, paced_wake);
  }
  // What `residency stat` reads: the sum the ledger holds for both.
  std::uint64_t ledger_used() const {
    for (const SharedBudgetInfo& info : list_shared_budgets())
      if (info.name == name) return info.used;
    ADD_FAILURE() << "no ledger " << name << " in /dev/shm";
    return 0;
  }
  static Demand resident(std::uint64_t admitted, std::uint64_t requested = 0) { return {admitted, requested, true}; }
};

}  // namespace

// The ledger holds what the demand says: everything admitted while the memory is wanted resident,
// only what is still wired once it is not; the rest goes back at settle().
TEST_F(BudgetShareTest, TheLedgerHoldsWhatTheDemandSays) {
  join_both(8 * kMiB);
  MutexLock g(a.mu);
  EXPECT_EQ(a.share->needed(resident(3 * kMiB)), 3 * kMiB);
  EXPECT_EQ(a.share->needed({3 * kMiB, 1 * kMiB, false}), 1 * kMiB);
  ASSERT_TRUE(a.share->reserve(resident(0), 3 * kMiB, /*device=*/false));
  EXPECT_EQ(a.share->held(), 3 * kMiB);
  EXPECT_EQ(ledger_used(), 3 * kMiB);
  a.share->settle({3 * kMiB, 1 * kMiB, false});  // released: 1 MiB still wired
  EXPECT_EQ(a.share->held(), 1 * kMiB);
  a.share->settle({3 * kMiB, 0, false});
  EXPECT_EQ(ledger_used(), 0u);
}

// A full budget on a first attempt says nothing yet: the share remembers what to ask for, the Room
// asks the idle holder, which gives back, and the retry gets the room.
TEST_F(BudgetShareTest, AFirstAttemptAtAFullBudgetAsksTheIdleHolderBeforeItSaysAnything) {
  join_both(8 * kMiB);
  {
    MutexLock g(a.mu);
    ASSERT_TRUE(a.share->reserve(resident(0), 6 * kMiB, false));
  }
  a.used_at(clock.now());
  clock.advance(5s);  // a is idle for longer than ledger::kIdleBeforeAsked
  BudgetShare::RoomWanted want;
  {
    MutexLock g(b.mu);
    EXPECT_FALSE(b.share->reserve(resident(0), 4 * kMiB, false));
    EXPECT_TRUE(b.share->asking());
    want = b.share->take_room_wanted();
  }
  EXPECT_EQ(want.bytes, 4 * kMiB);
  EXPECT_FALSE(want.device);
  EXPECT_TRUE(b.logs.lines.empty()) << b.logs.lines.front().second;
  b.room->make(want, b.mu);  // without b's lock: it waits for a's answer
  EXPECT_EQ(a.asks.load(), 1);
  EXPECT_EQ(a.share->held(), 0u);
  MutexLock g(b.mu);
  b.share->begin_retry(false);
  EXPECT_TRUE(b.share->reserve(resident(0), 4 * kMiB, false));
  EXPECT_EQ(b.share->held(), 4 * kMiB);
  EXPECT_EQ(ledger_used(), 4 * kMiB);
  EXPECT_EQ(b.share->short_count(), 0u);
}

// A holder used within the last second is not asked for host memory; after the ask, what still
// does not fit stays unwired, and the log says why and what to do, once.
TEST_F(BudgetShareTest, HostMemoryThatStillDoesNotFitAfterTheAskStaysUnwiredAndSaysSo) {
  join_both(8 * kMiB);
  {
    MutexLock g(a.mu);
    ASSERT_TRUE(a.share->reserve(resident(0), 6 * kMiB, false));
  }
  a.used_at(clock.now());
  clock.advance(100ms);
  MutexLock g(b.mu);
  EXPECT_FALSE(b.share->reserve(resident(0), 4 * kMiB, false));
  const BudgetShare::RoomWanted want = b.share->take_room_wanted();
  b.mu.unlock();
  b.room->make(want, b.mu);
  b.mu.lock();
  EXPECT_EQ(a.asks.load(), 0);
  EXPECT_EQ(a.share->held(), 6 * kMiB);
  b.share->begin_retry(false);
  EXPECT_FALSE(b.share->reserve(resident(0), 4 * kMiB, false));
  EXPECT_EQ(b.share->short_count(), 1u);
  EXPECT_TRUE(b.logs.contains(LogLevel::warn, "is full: 4.00 MiB stays tracked but unwired"));
  EXPECT_EQ(ledger_used(), 6 * kMiB);
}

// Device memory cannot wait: after the ask, what the budget lacks wakes over it, in the ledger's
// books, and the least recently used holder is the one to repay.
TEST_F(BudgetShareTest, DeviceMemoryWakesOverTheBudgetAfterTheAskAndTheLeastRecentlyUsedRepays) {
  join_both(8 * kMiB);
  {
    MutexLock g(a.mu);
    ASSERT_TRUE(a.share->reserve(resident(0), 6 * kMiB, /*device=*/true));
  }
  a.in_call = true;  // a declines every ask
  a.used_at(clock.now() - 10s);
  b.used_at(clock.now());
  {
    MutexLock g(b.mu);
    EXPECT_FALSE(b.share->reserve(resident(0), 4 * kMiB, true));
    const BudgetShare::RoomWanted want = b.share->take_room_wanted();
    EXPECT_TRUE(want.device);
    b.mu.unlock();
    b.room->make(want, b.mu);
    b.mu.lock();
    b.share->begin_retry(false);
    EXPECT_TRUE(b.share->reserve(resident(0), 4 * kMiB, true));
    EXPECT_EQ(b.share->over_count(), 1u);
  }
  EXPECT_GE(a.asks.load(), 1);
  EXPECT_TRUE(b.logs.contains(LogLevel::warn, "of device memory is awake over it"));
  EXPECT_EQ(ledger_used(), 10 * kMiB);
  EXPECT_EQ(b.room->over_budget(), 2 * kMiB);
  a.in_call = false;
  MutexLock g(a.mu);
  EXPECT_TRUE(a.share->repay_turn());  // a was used 10 s before b
}

// Before the sets are requested: host memory keeps admitted what the ledger holds; device memory
// on a first attempt waits, and its room is asked for as device memory (any idle).
TEST_F(BudgetShareTest, AWirePlanKeepsHostMemoryToTheRoomAndHoldsDeviceMemoryUntilTheOthersAreAsked) {
  join_both(8 * kMiB);
  {
    MutexLock g(a.mu);
    ASSERT_TRUE(a.share->reserve(resident(0), 5 * kMiB, false));
  }
  MutexLock g(b.mu);
  BudgetShare::WirePlan host = b.share->plan_wire(resident(6 * kMiB), /*device_memory=*/false, 0);
  EXPECT_EQ(host.step, BudgetShare::WirePlan::Step::evict_to);
  EXPECT_EQ(host.keep, 3 * kMiB);  // partial: what was free
  EXPECT_EQ(host.missing, 3 * kMiB);
  b.share->begin_retry(false);
  b.share->settle({0, 0, false});
  b.share->begin_retry(true);
  const BudgetShare::WirePlan device = b.share->plan_wire(resident(6 * kMiB), /*device_memory=*/true, 0);
  EXPECT_EQ(device.step, BudgetShare::WirePlan::Step::wait);
  const BudgetShare::RoomWanted want = b.share->take_room_wanted();
  EXPECT_TRUE(want.device);
  EXPECT_EQ(want.bytes, 3 * kMiB);
}

// A paced wake begins in the room the ledger holds, and asks for the rest only when a piece needs
// it: the holder asked gives way while the first pieces are copied.
TEST_F(BudgetShareTest, APacedWakeBeginsInTheRoomThereIsAndAsksForTheRestWhenAPieceNeedsIt) {
  join_both(8 * kMiB, /*paced_wake=*/true);
  {
    MutexLock g(a.mu);
    ASSERT_TRUE(a.share->reserve(resident(0), 6 * kMiB, true));
  }
  a.used_at(clock.now());  // idle for 0 s: device memory asks it anyway
  MutexLock g(b.mu);
  const BudgetShare::WirePlan plan = b.share->plan_wire(resident(6 * kMiB), /*device_memory=*/true, 0);
  EXPECT_EQ(plan.step, BudgetShare::WirePlan::Step::go);
  ASSERT_TRUE(b.share->pacing());
  EXPECT_EQ(b.share->take_paced_head(), 2 * kMiB);
  b.share->pace(2 * kMiB);  // in the room: nobody is asked
  EXPECT_EQ(a.asks.load(), 0);
  b.share->pace(4 * kMiB);  // the rest: a is asked and waited for (the one wait under the lock)
  EXPECT_EQ(a.asks.load(), 1);
  b.share->stop_pacing();
  b.share->end_paced_wake(resident(6 * kMiB, 6 * kMiB));
  EXPECT_EQ(b.share->held(), 6 * kMiB);
  EXPECT_EQ(a.share->held(), 0u);
  EXPECT_EQ(b.share->over_count(), 0u);
}

// A device holder's context is held whatever the policy says, and a holder of only that is not
// asked: freeing device memory finds nobody to ask and returns at once.
TEST_F(BudgetShareTest, AHoldersUnmanagedFloorIsHeldAndNeverAskedFor) {
  join_both(8 * kMiB);
  {
    MutexLock g(a.mu);
    a.share->count_unmanaged(3 * kMiB);
    a.share->settle({0, 0, false});
    ASSERT_TRUE(a.share->reserve({0, 0, true}, 0, true));
    EXPECT_EQ(a.share->needed({0, 0, false}), 3 * kMiB);
  }
  EXPECT_EQ(a.share->held(), 3 * kMiB);
  EXPECT_EQ(ledger_used(), 3 * kMiB);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(b.room->free_device_memory(3 * kMiB, b.mu), 0u);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, ledger::kAskWait);
  EXPECT_EQ(a.asks.load(), 0);
  EXPECT_EQ(a.share->held(), 3 * kMiB);
}

// An allocation reserves before it allocates; its region takes the reservation over, and what it
// did not take goes back when the allocation ends.
TEST_F(BudgetShareTest, AnAllocationsReservationAheadIsTakenOverByItsRegionOrGivenBack) {
  join_both(8 * kMiB);
  MutexLock g(a.mu);
  ASSERT_TRUE(a.share->reserve_ahead(resident(0), 4 * kMiB, 0));
  EXPECT_EQ(ledger_used(), 4 * kMiB);
  EXPECT_EQ(a.share->take_ahead(4 * kMiB), 4 * kMiB);  // the region is admitted with it
  a.share->end_ahead(resident(4 * kMiB), 4 * kMiB);
  EXPECT_EQ(a.share->held(), 4 * kMiB);
  ASSERT_TRUE(a.share->reserve_ahead(resident(4 * kMiB), 2 * kMiB, 0));
  EXPECT_EQ(a.share->held(), 6 * kMiB);
  a.share->end_ahead(resident(4 * kMiB), 2 * kMiB);  // the allocation failed
  EXPECT_EQ(a.share->held(), 4 * kMiB);
  EXPECT_EQ(ledger_used(), 4 * kMiB);
}

// A process that is exiting reserves nothing more, so that nothing more is wired.
TEST_F(BudgetShareTest, AnExitingShareReservesNothing) {
  join_both(8 * kMiB);
  MutexLock g(a.mu);
  a.share->begin_exit();
  EXPECT_FALSE(a.share->reserve(resident(0), 1 * kMiB, false));
  EXPECT_FALSE(a.share->asking());
  EXPECT_EQ(ledger_used(), 0u);
}

// A strict share (RESIDENCY_BUDGET_WAIT): device memory that finds no room after its turn is
// refused, never woken over the budget, and the refusal names the budget, the wait and the holders.
TEST_F(BudgetShareTest, AStrictShareRefusesWhatItsTurnDidNotBringAndNamesWhoHolds) {
  a.join(name, 8 * kMiB, clock);
  auto l = ledger::Ledger::attach({name, 8 * kMiB, "", 0});
  ASSERT_TRUE(l) << l.message();
  BudgetShare::Joined joined(std::move(*l));
  b.room = BudgetShare::room(joined, clock);
  b.share = std::make_unique<BudgetShare>(joined, 0, false, clock, b.sink, Nanos(200ms));
  {
    MutexLock g(a.mu);
    ASSERT_TRUE(a.share->reserve(resident(0), 6 * kMiB, true));
  }
  a.in_call = true;  // declines every ask
  MutexLock g(b.mu);
  EXPECT_TRUE(b.share->strict());
  EXPECT_FALSE(b.share->reserve(resident(0), 4 * kMiB, true));
  const BudgetShare::RoomWanted want = b.share->take_room_wanted();
  EXPECT_TRUE(want.in_turn);
  EXPECT_EQ(want.wait, Nanos(200ms));
  b.mu.unlock();
  const auto t0 = std::chrono::steady_clock::now();
  b.room->make(want, b.mu);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 200ms);
  b.mu.lock();
  b.share->begin_retry(false);
  EXPECT_FALSE(b.share->reserve(resident(0), 4 * kMiB, true)) << "refused, not woken over the budget";
  EXPECT_EQ(b.share->over_count(), 0u);
  EXPECT_TRUE(b.logs.contains(LogLevel::warn,
                              "had no room for 4.00 MiB of device memory within "
                              "RESIDENCY_BUDGET_WAIT (200 ms"));
  EXPECT_TRUE(b.logs.contains(LogLevel::warn, "holds 6.0 MiB"));
  EXPECT_FALSE(b.share->covers(resident(4 * kMiB)));
  EXPECT_EQ(ledger_used(), 6 * kMiB);
}
