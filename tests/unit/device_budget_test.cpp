// SPDX-License-Identifier: MIT
// A shared budget over device memory (issue 20, item 1: the preload's RESIDENCY_GPU_BUDGET gives
// each GPU's device managers one ledger): two managers of backend-allocated memory (a GPU's, as
// the CUDA backend makes it; here the fake backend's) in one process, each a holder of a real
// ledger in /dev/shm, on one ManualClock. What the backends hold is asserted, and the ledger's
// books as `residency stat` reads them.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/state_file.hpp"
#include "ledger/ledger.hpp"
#include "residency/shared_budget.hpp"
#include "support/manager_fixture.hpp"
#include "support/state_files.hpp"

using namespace residency;
using namespace residency::testing;
using namespace std::chrono_literals;

namespace {

class DeviceBudgetTest : public ::testing::Test {
 protected:
  ManualClock clock{Nanos(std::chrono::hours(1))};
  std::string name = "unit-device-" + std::to_string(::getpid()) + "-" + std::to_string(serial()++);
  struct Device {
    std::shared_ptr<FakeBackend> fake = std::make_shared<FakeBackend>();
    LogCapture logs;
    std::unique_ptr<Manager> m;
  };

  // A run that died inside a test (TSan's halt_on_error) left its ledgers: gone before this one.
  DeviceBudgetTest() { remove_ledgers_of_dead_runs("unit-device-"); }

  static std::atomic<int>& serial() {
    static std::atomic<int> n{0};
    return n;
  }
  void start(Device& d, std::uint64_t budget, std::optional<Nanos> wait = std::nullopt,
             const std::string& budget_name = {}, int priority = 0, LogLevel level = LogLevel::info,
             bool state_file = false) {
    ManagerOptions o;
    o.config.log_level = level;
    o.config.budget_wait = wait;
    o.config.shared_priority = priority;
    o.config.keep_alive = KeepAlive::after(10s);
    o.config.layout = Layout::per_buffer;
    o.config.shared_budget = SharedBudget{budget_name.empty() ? name : budget_name, WiredLimit{false, budget, 0}, ""};
    o.config.state_file = state_file;
    o.backend = d.fake;
    o.clock = &clock;
    o.log = d.logs.callback();
    o.start_scheduler = false;
    auto m = Manager::create(std::move(o));
    ASSERT_TRUE(m) << m.message();
    d.m = std::move(*m);
  }
  // Two device managers under an 8 MiB budget; `a` holds 6 MiB of device memory, awake.
  Allocation two_holders_a_with_6_mib() {
    start(a, 8 * MiB);
    start(b, 8 * MiB);
    auto pa = a.m->allocate(6 * MiB);
    EXPECT_TRUE(pa) << pa.message();
    EXPECT_TRUE(pa && a.fake->is_resident(pa->id));
    return pa ? *pa : Allocation{};
  }
  Device a, b, c;
  // Two holders under a budget with room, on a GPU that holds a's 6 MiB and no more: b's 4 MiB
  // asleep, and waking it fails for want of device memory while a is awake.
  std::pair<Allocation, Allocation> b_asleep_on_a_gpu_full_with_a() {
    start(a, 100 * MiB);
    start(b, 100 * MiB);
    auto pa = a.m->allocate(6 * MiB);
    auto pb = b.m->allocate(4 * MiB);
    EXPECT_TRUE(pa && pb);
    if (!pa || !pb) return {};
    b.m->release_now();
    EXPECT_FALSE(b.fake->is_resident(pb->id));
    const RegionId ida = pa->id;
    b.fake->device_full = [this, ida] { return a.fake->is_resident(ida); };
    return {*pa, *pb};
  }
  // A switch to come: b's 4 MiB asleep while a holds 6 MiB of an 8 MiB budget, so 2 MiB of room.
  // `paced`: b wakes as the cuda backend does (1 MiB pieces); `wait`: RESIDENCY_BUDGET_WAIT (none:
  // going over); `b_level`: b's log level.
  std::pair<Allocation, Allocation> b_asleep_while_a_holds_6_of_8_mib(std::optional<Nanos> wait = std::nullopt,
                                                                      bool paced = true,
                                                                      LogLevel b_level = LogLevel::info) {
    if (paced) b.fake->pace_piece = 1 * MiB;
    start(a, 8 * MiB, wait);
    start(b, 8 * MiB, wait, {}, 0, b_level);
    auto pb = b.m->allocate(4 * MiB);
    EXPECT_TRUE(pb) << pb.message();
    if (!pb) return {};
    b.m->release_now();
    EXPECT_FALSE(b.fake->is_resident(pb->id));
    auto pa = a.m->allocate(6 * MiB);
    EXPECT_TRUE(pa) << pa.message();
    if (!pa) return {};
    return {*pa, *pb};
  }
  // What another holder's listener thread does in answer to an ask, waited for (real time).
  static bool eventually(const std::function<bool()>& done) {
    for (int i = 0; i < 200; ++i) {
      if (done()) return true;
      std::this_thread::sleep_for(10ms);
    }
    return done();
  }
  std::uint64_t used() {
    for (const auto& info : list_shared_budgets())
      if (info.name == name) return info.used;
    return 0;
  }
};

// A device allocation that does not fit asks the idle holder to sleep, and only then is it
// admitted: the asked manager's memory is given back (its set released), the asker's is awake.
TEST_F(DeviceBudgetTest, AnAllocationThatDoesNotFitPutsTheIdleHolderToSleepFirst) {
  const Allocation pa = two_holders_a_with_6_mib();
  clock.advance(2s);  // a is idle for longer than ledger::kIdleBeforeAsked
  auto pb = b.m->allocate(4 * MiB);
  ASSERT_TRUE(pb) << pb.message();
  EXPECT_FALSE(a.fake->is_resident(pa.id)) << "the idle holder sleeps";
  EXPECT_TRUE(b.fake->is_resident(pb->id)) << "then the asker's memory is admitted and awake";
  EXPECT_TRUE(a.logs.contains(LogLevel::info, "asked by process " + std::to_string(::getpid()) + ": shared budget " + name));
  EXPECT_EQ(used(), 4 * MiB);
  EXPECT_EQ(b.m->stats().shared_held, 4 * MiB);
  EXPECT_FALSE(b.logs.contains(LogLevel::warn, "over it")) << "nothing woke over the budget";
  // The sleeper's next call wakes it, and it puts the other (idle now) to sleep first.
  clock.advance(2s);
  a.m->begin_call();
  EXPECT_TRUE(a.fake->is_resident(pa.id));
  EXPECT_FALSE(b.fake->is_resident(pb->id)) << "the holder idle longest slept so that the call could wake";
  a.m->end_call();
  EXPECT_EQ(used(), 6 * MiB);
}

// With a debug log, a switch says where its time went: the ask and its answer, and the wake's
// phases (on the manual clock every phase takes 0 ms).
TEST_F(DeviceBudgetTest, ADebugLogTellsTheSwitchsTimeline) {
  const auto [pa, pb] = b_asleep_while_a_holds_6_of_8_mib(1s, /*paced=*/false, LogLevel::debug);
  ASSERT_NE(pb.ptr, nullptr);
  clock.advance(2s);
  b.m->begin_call();
  EXPECT_TRUE(b.fake->is_resident(pb.id));
  EXPECT_TRUE(b.logs.contains(LogLevel::debug, "timeline: asked the holders of " + name + " for 2.00 MiB of room"));
  EXPECT_TRUE(b.logs.contains(LogLevel::debug, "timeline: the wake of 4.00 MiB: 0.00 ms waiting for room"));
  EXPECT_TRUE(b.logs.contains(LogLevel::info, "re-wired 4.00 MiB in 1 set(s)"));
  EXPECT_FALSE(a.logs.contains("timeline:")) << "nothing at info";
  b.m->end_call();
}

// A holder inside a call is never put to sleep; when nobody can give way, device memory (which a
// decode reads, and cannot wait unwired as host memory can) wakes over the budget, with one
// warning, and the ledger's books say so.
TEST_F(DeviceBudgetTest, WhenNoHolderCanSleepTheWakeGoesOverTheBudgetAndSaysSo) {
  const Allocation pa = two_holders_a_with_6_mib();
  a.m->begin_call();  // a decode is running
  clock.advance(2s);
  auto pb = b.m->allocate(4 * MiB);
  ASSERT_TRUE(pb) << pb.message();
  EXPECT_TRUE(a.fake->is_resident(pa.id)) << "a holder inside a call is not put to sleep";
  EXPECT_TRUE(b.fake->is_resident(pb->id));
  EXPECT_TRUE(b.logs.contains(LogLevel::warn, "of device memory is awake over it"));
  EXPECT_EQ(used(), 10 * MiB) << "the books show the 2 MiB over the budget";
  a.m->end_call();
}

// Device budgets (docs/design.md, "The GPU budget"): a holder not inside a call is asked however
// short its idle: a waker cannot wait unwired, so a minimum idle would only push it over the
// budget.
TEST_F(DeviceBudgetTest, AHolderIdleForMillisecondsIsAskedToSleep) {
  const Allocation pa = two_holders_a_with_6_mib();
  // The GPU is as full as the budget: room must be made before the allocation, not after.
  b.fake->device_full = [&] { return a.fake->is_resident(pa.id); };
  clock.advance(10ms);  // far less than ledger::kIdleBeforeAsked
  auto pb = b.m->allocate(4 * MiB);
  ASSERT_TRUE(pb) << pb.message();
  EXPECT_FALSE(a.fake->is_resident(pa.id)) << "the holder idle for 10 ms sleeps";
  EXPECT_TRUE(b.fake->is_resident(pb->id));
  EXPECT_EQ(used(), 4 * MiB) << "never over the budget";
  EXPECT_FALSE(b.logs.contains(LogLevel::warn, "over it"));
  EXPECT_FALSE(b.logs.contains(LogLevel::info, "out of device memory")) << "room was made before allocating";
}

// The least recently used holder is asked first; one inside a call declines, and the next is asked.
TEST_F(DeviceBudgetTest, AHolderInsideACallDeclinesAndTheNextLeastRecentlyUsedSleeps) {
  start(a, 10 * MiB);
  start(b, 10 * MiB);
  start(c, 10 * MiB);
  auto pa = a.m->allocate(4 * MiB);
  clock.advance(5ms);
  auto pb = b.m->allocate(4 * MiB);
  ASSERT_TRUE(pa && pb);
  clock.advance(5ms);
  a.m->begin_call();  // a is the least recently used, but decoding
  clock.advance(5ms);
  auto pc = c.m->allocate(4 * MiB);
  ASSERT_TRUE(pc) << pc.message();
  EXPECT_TRUE(a.fake->is_resident(pa->id)) << "a holder inside a call is never put to sleep";
  EXPECT_FALSE(b.fake->is_resident(pb->id)) << "the next one asked sleeps";
  EXPECT_TRUE(c.fake->is_resident(pc->id));
  EXPECT_EQ(used(), 8 * MiB);
  a.m->end_call();
}

// A switch (docs/design.md, "The GPU budget"): the waker's wake begins in the room the budget has
// while the holder it asked gives its memory back, as the cuda backend paces its chunks. b (4 MiB,
// asleep) wakes while a holds 6 MiB of an 8 MiB budget: b's first 2 MiB are mapped while a still
// holds its memory, the rest only after a gave it back, and neither the ledger nor what the two
// backends hold ever exceeds the budget.
TEST_F(DeviceBudgetTest, AWakeBeginsInTheBudgetsRoomWhileTheHolderAskedGivesWay) {
  const std::pair<Allocation, Allocation> ab = b_asleep_while_a_holds_6_of_8_mib();
  const Allocation &pa = ab.first, &pb = ab.second;
  ASSERT_TRUE(pa.ptr != nullptr && pb.ptr != nullptr);
  clock.advance(10ms);
  struct Seen {
    std::uint64_t mapped;  // b's bytes mapped so far
    bool a_awake;
    std::uint64_t ledger;
  };
  std::vector<Seen> seen;
  b.fake->on_paced = [&](std::uint64_t mapped) { seen.push_back({mapped, a.fake->is_resident(pa.id), used()}); };
  b.m->begin_call();
  EXPECT_TRUE(b.fake->is_resident(pb.id));
  EXPECT_FALSE(a.fake->is_resident(pa.id)) << "a was asked and slept";
  ASSERT_EQ(seen.size(), 4u) << "b mapped its 4 MiB in four pieces";
  EXPECT_TRUE(seen[0].a_awake && seen[1].a_awake) << "b's first 2 MiB were mapped in the room, while a held its 6 MiB";
  EXPECT_FALSE(seen[2].a_awake) << "b's third MiB waited for a to give way";
  for (const Seen& x : seen) {
    EXPECT_LE((x.a_awake ? 6 * MiB : 0) + x.mapped, 8 * MiB) << "what the two backends hold, at " << x.mapped;
    EXPECT_LE(x.ledger, 8 * MiB) << "the ledger's sum, at " << x.mapped;
  }
  EXPECT_TRUE(
      b.logs.contains(LogLevel::info, "the first 2.00 MiB in the budget's room while the holders asked made the rest"));
  EXPECT_FALSE(b.logs.contains(LogLevel::warn, "over it")) << "nothing woke over the budget";
  b.m->end_call();
  EXPECT_EQ(used(), 4 * MiB);
  EXPECT_EQ(b.m->stats().shared_held, 4 * MiB);
}

// A paced wake whose room nobody can make (the holder is inside a call) wakes the rest over the
// budget, as an unpaced one does after its ask, and says so once.
TEST_F(DeviceBudgetTest, APacedWakeThatNobodyCanMakeRoomForGoesOverTheBudgetAndSaysSo) {
  const std::pair<Allocation, Allocation> ab = b_asleep_while_a_holds_6_of_8_mib();
  const Allocation &pa = ab.first, &pb = ab.second;
  ASSERT_TRUE(pa.ptr != nullptr && pb.ptr != nullptr);
  a.m->begin_call();  // decoding
  clock.advance(10ms);
  b.m->begin_call();
  EXPECT_TRUE(b.fake->is_resident(pb.id));
  EXPECT_TRUE(a.fake->is_resident(pa.id)) << "a holder inside a call is never put to sleep";
  EXPECT_TRUE(b.logs.contains(LogLevel::warn, "of device memory is awake over it"));
  EXPECT_EQ(used(), 10 * MiB) << "the books show the 2 MiB over the budget";
  EXPECT_EQ(b.m->stats().shared_held, 4 * MiB);
  b.m->end_call();
  a.m->end_call();
}

// A GPU context is device memory no sleep gives back (586 MiB per llama-server on the H200): the
// ledger counts each holder's (Backend::unmanaged_device_bytes), so that the budget is what the
// GPU holds, and an asker passes a holder that holds nothing else: a (asleep, its context only)
// is the least recently used, yet c is the one asked.
TEST_F(DeviceBudgetTest, EachHoldersContextCountsAndAHolderOfOnlyThatIsNotAsked) {
  for (Device* d : {&a, &b, &c}) d->fake->unmanaged = 1 * MiB;
  start(a, 10 * MiB);
  start(b, 10 * MiB);
  start(c, 10 * MiB);
  auto pa = a.m->allocate(3 * MiB);
  ASSERT_TRUE(pa) << pa.message();
  EXPECT_EQ(used(), 4 * MiB) << "a's 3 MiB and its context";
  a.m->release_now();
  EXPECT_EQ(used(), 1 * MiB) << "asleep, a still holds its context";
  EXPECT_EQ(a.m->stats().shared_held, 1 * MiB);
  for (const auto& info : list_shared_budgets()) {  // as `residency stat` shows it
    if (info.name != name) continue;
    for (const auto& h : info.holders)  // a's; b's and c's are read at their first allocation
      EXPECT_EQ(h.unmanaged, h.bytes != 0 ? 1 * MiB : 0) << "pid " << h.pid << " holding " << h.bytes;
  }
  clock.advance(5ms);
  auto pc = c.m->allocate(4 * MiB);
  ASSERT_TRUE(pc) << pc.message();
  EXPECT_EQ(used(), 6 * MiB);
  clock.advance(5ms);
  auto pb = b.m->allocate(5 * MiB);  // 6 MiB with its context; 4 free
  ASSERT_TRUE(pb) << pb.message();
  EXPECT_FALSE(c.fake->is_resident(pc->id)) << "c, holding more than its context, was asked and slept";
  EXPECT_TRUE(b.fake->is_resident(pb->id));
  EXPECT_EQ(b.m->stats().shared_asks, 1u) << "one ask, of c: a, holding only its context, was passed";
  EXPECT_EQ(used(), 8 * MiB) << "three contexts and b's 5 MiB";
  EXPECT_FALSE(b.logs.contains(LogLevel::warn, "over it"));
}

// A request to the holder asked stops its release (issue 29, item 4): the asker, whose wait ends
// with no room made, asks the next least recently used holder instead. a keeps its memory (it never
// left the device), c sleeps, b wakes within the budget.
TEST_F(DeviceBudgetTest, WhenTheHolderAskedStopsItsReleaseForACallTheAskerAsksTheNext) {
  start(a, 8 * MiB);
  start(b, 8 * MiB);
  start(c, 8 * MiB);
  auto pb = b.m->allocate(4 * MiB);
  ASSERT_TRUE(pb) << pb.message();
  b.m->release_now();
  auto pa = a.m->allocate(3 * MiB);
  clock.advance(5ms);
  auto pc = c.m->allocate(3 * MiB);
  ASSERT_TRUE(pa && pc);
  clock.advance(5ms);  // a is the least recently used: asked first
  std::thread caller;
  // Set and reset under the fake's lock: a's release reads the hook on a's ask thread, which this
  // thread reaches only through the ledger's futex (which ThreadSanitizer does not see).
  {
    std::lock_guard<std::recursive_mutex> g(a.fake->mu);
    a.fake->during_end_residency = [&] {  // a request reaches a while it releases
      caller = std::thread([&] { a.m->touch(); });
      for (int i = 0; i < 5000 && a.fake->interrupts.load() == 0; ++i) std::this_thread::sleep_for(1ms);
    };
  }
  b.m->begin_call();
  {
    std::lock_guard<std::recursive_mutex> g(a.fake->mu);  // after a's release took it: `caller` is seen
    a.fake->during_end_residency = nullptr;
  }
  ASSERT_TRUE(caller.joinable()) << "a was asked first";
  caller.join();
  EXPECT_EQ(a.fake->interrupted_ends, 1) << "a's release stopped";
  EXPECT_TRUE(a.fake->is_resident(pa->id)) << "and its memory never left";
  EXPECT_FALSE(c.fake->is_resident(pc->id)) << "the next least recently used was asked and slept";
  EXPECT_TRUE(b.fake->is_resident(pb->id));
  EXPECT_EQ(used(), 7 * MiB);
  EXPECT_FALSE(b.logs.contains(LogLevel::warn, "over it")) << "nothing woke over the budget";
  EXPECT_TRUE(a.logs.contains(LogLevel::info, "release stopped"));
  b.m->end_call();
}

// A release stopped by a call after part of it was given back keeps that part's share: the call
// wires it again at once. Under a strict budget the asker could otherwise take the share, and the
// holder, inside its call with memory awake, would be refused (llama-server answered HTTP 500).
TEST_F(DeviceBudgetTest, AReleaseStoppedByACallKeepsItsShareForThatCall) {
  start(a, 8 * MiB, 300ms);
  start(b, 8 * MiB, 300ms);
  auto pb = b.m->allocate(4 * MiB);
  ASSERT_TRUE(pb) << pb.message();
  b.m->release_now();
  auto pa1 = a.m->allocate(3 * MiB);
  auto pa2 = a.m->allocate(3 * MiB);
  ASSERT_TRUE(pa1 && pa2);
  clock.advance(5ms);
  std::thread caller;
  int ends = 0;
  {
    std::lock_guard<std::recursive_mutex> g(a.fake->mu);
    a.fake->during_end_residency = [&] {  // a request reaches a after its first set was given back
      if (++ends != 2) return;
      caller = std::thread([&] {
        a.m->begin_call();
        EXPECT_TRUE(a.m->unwired_status()) << a.m->unwired_status().message();
        a.m->end_call();
      });
      for (int i = 0; i < 5000 && a.fake->interrupts.load() == 0; ++i) std::this_thread::sleep_for(1ms);
    };
  }
  b.m->begin_call();  // asks a, whose release stops at its second set
  {
    std::lock_guard<std::recursive_mutex> g(a.fake->mu);
    a.fake->during_end_residency = nullptr;
  }
  ASSERT_TRUE(caller.joinable()) << "a's release reached its second set";
  caller.join();
  EXPECT_EQ(a.fake->interrupted_ends, 1);
  EXPECT_TRUE(a.logs.contains(LogLevel::info, "3.00 MiB released (its share of the budget kept for the call)"));
  EXPECT_FALSE(a.logs.contains(LogLevel::warn, "had no room")) << "a's call was not refused";
  EXPECT_LE(used(), 8 * MiB);
  EXPECT_LE(a.fake->resident_bytes() + b.fake->resident_bytes(), 8 * MiB) << "what the devices hold";
  b.m->end_call();
}

// Memory a release could not give back stays awake while the keep-alive no longer holds it; asked
// later, its holder gives it back (it used to decline, holding its share of a strict budget: the
// askers waited out their bound and were refused).
TEST_F(DeviceBudgetTest, MemoryAReleaseLeftAwakeIsGivenBackWhenAsked) {
  const auto [pa, pb] = b_asleep_while_a_holds_6_of_8_mib(300ms, /*paced=*/false);
  ASSERT_NE(pa.ptr, nullptr);
  {
    std::lock_guard<std::recursive_mutex> g(a.fake->mu);
    a.fake->fail_end_residency = true;
  }
  a.m->release_now();
  EXPECT_TRUE(a.logs.contains(LogLevel::warn, "could not release"));
  ASSERT_TRUE(a.fake->is_resident(pa.id));
  {
    std::lock_guard<std::recursive_mutex> g(a.fake->mu);
    a.fake->fail_end_residency = false;
  }
  clock.advance(5ms);
  b.m->begin_call();  // asks a, idle with 6 MiB awake
  EXPECT_TRUE(b.fake->is_resident(pb.id));
  EXPECT_TRUE(b.m->unwired_status()) << b.m->unwired_status().message();
  EXPECT_FALSE(a.fake->is_resident(pa.id));
  EXPECT_LE(used(), 8 * MiB);
  b.m->end_call();
}

// A wake over the budget (every other holder inside a call) is repaid: once a call ends and the
// budget is over, the least recently used holder sleeps until the sum fits.
TEST_F(DeviceBudgetTest, AWakeOverTheBudgetIsRepaidWhenACallEnds) {
  const Allocation pa = two_holders_a_with_6_mib();
  a.m->begin_call();
  clock.advance(5ms);
  auto pb = b.m->allocate(4 * MiB);
  ASSERT_TRUE(pb) << pb.message();
  ASSERT_EQ(used(), 10 * MiB) << "over, since a was inside a call";
  clock.advance(5ms);
  a.m->end_call();  // a's call ends: b (allocated before it) is the least recently used
  EXPECT_TRUE(eventually([&] { return used() <= 8 * MiB; })) << "the debt is repaid";
  EXPECT_TRUE(a.fake->is_resident(pa.id));
  EXPECT_TRUE(eventually([&] { return !b.fake->is_resident(pb->id); })) << "the least recently used sleeps";
  EXPECT_EQ(used(), 6 * MiB);
  // Its next call wakes it, and a (idle now) sleeps first: the budget holds.
  clock.advance(5ms);
  b.m->begin_call();
  EXPECT_TRUE(b.fake->is_resident(pb->id));
  EXPECT_FALSE(a.fake->is_resident(pa.id));
  b.m->end_call();
  EXPECT_EQ(used(), 4 * MiB);
}

// The GPU itself is full (the budget had room): the allocation asks the others to sleep and tries
// again, rather than failing the engine's call (a model load included).
TEST_F(DeviceBudgetTest, AnAllocationOutOfDeviceMemoryAsksTheOthersAndTriesAgain) {
  start(a, 100 * MiB);
  start(b, 100 * MiB);
  auto pa = a.m->allocate(6 * MiB);
  ASSERT_TRUE(pa);
  b.fake->device_full = [&] { return a.fake->is_resident(pa->id); };  // the GPU holds a's 6 MiB and no more
  clock.advance(5ms);
  auto pb = b.m->allocate(4 * MiB);
  ASSERT_TRUE(pb) << pb.message();
  EXPECT_FALSE(a.fake->is_resident(pa->id));
  EXPECT_TRUE(b.fake->is_resident(pb->id));
  EXPECT_TRUE(b.logs.contains(LogLevel::info, "out of device memory for 4.00 MiB"));
  // When nobody can give way, the error is the backend's, and nothing is left reserved.
  start(c, 100 * MiB);
  c.fake->device_full = [] { return true; };
  auto pc = c.m->allocate(4 * MiB);
  ASSERT_FALSE(pc);
  EXPECT_EQ(pc.status().code(), ErrorCode::out_of_memory);
  EXPECT_EQ(c.m->stats().shared_held, 0u);
}

// The wake of a sleeping holder on a GPU that is full before the budget is (memory held outside
// it): the others are asked to sleep and the wake is tried again. Unmapped device memory is not
// something a decode can run on (on the H200 it ended in an illegal memory access).
TEST_F(DeviceBudgetTest, AWakeOutOfDeviceMemoryAsksTheOthersAndWakesAfterAll) {
  const auto [pa, pb] = b_asleep_on_a_gpu_full_with_a();
  clock.advance(5ms);
  b.m->begin_call();
  EXPECT_TRUE(b.fake->is_resident(pb.id)) << "awake for the call";
  EXPECT_FALSE(a.fake->is_resident(pa.id)) << "the other holder slept to make room";
  EXPECT_FALSE(b.logs.contains(LogLevel::warn, "failed")) << "nothing was left unwired";
  b.m->end_call();
}

// The same in a burst: the only holder that could give way is inside a call; the wake waits for
// that call to end (boundedly) rather than fail its own.
TEST_F(DeviceBudgetTest, AWakeOutOfDeviceMemoryWaitsForTheHolderInsideACallToEndIt) {
  const auto [pa, pb] = b_asleep_on_a_gpu_full_with_a();
  std::atomic<bool> in_call{false};
  std::thread decoding([&] {  // a call begins and ends on one thread
    a.m->begin_call();
    in_call = true;
    std::this_thread::sleep_for(150ms);
    a.m->end_call();
  });
  while (!in_call) std::this_thread::yield();
  b.m->begin_call();
  decoding.join();
  EXPECT_TRUE(b.fake->is_resident(pb.id)) << "awake once a's call ended";
  EXPECT_FALSE(a.fake->is_resident(pa.id));
  b.m->end_call();
}

// A burst of wakers on a full GPU: the memory a holder gave back may be taken by another waker
// before this one tries again; then it asks again (boundedly) rather than fail its call.
TEST_F(DeviceBudgetTest, AWakeWhoseFreedMemoryAnotherWakerTookAsksAgain) {
  start(a, 100 * MiB);
  start(b, 100 * MiB);
  start(c, 100 * MiB);
  auto pa = a.m->allocate(6 * MiB);
  auto pc = c.m->allocate(6 * MiB);
  auto pb = b.m->allocate(4 * MiB);
  ASSERT_TRUE(pa && pb && pc);
  b.m->release_now();
  ASSERT_FALSE(b.fake->is_resident(pb->id));
  // The GPU holds a's and c's memory and no more; the first room made is taken by someone else.
  int taken = 1;
  b.fake->device_full = [&] {
    if (a.fake->is_resident(pa->id) && c.fake->is_resident(pc->id)) return true;
    return taken-- > 0;
  };
  clock.advance(5ms);
  b.m->begin_call();
  EXPECT_TRUE(b.fake->is_resident(pb->id)) << "awake after a second round of asking";
  EXPECT_FALSE(a.fake->is_resident(pa->id) && c.fake->is_resident(pc->id));
  EXPECT_FALSE(a.fake->is_resident(pa->id) || c.fake->is_resident(pc->id)) << "both gave way, one per round";
  EXPECT_FALSE(b.logs.contains(LogLevel::warn, "failed")) << "nothing was left unwired";
  b.m->end_call();
}

// Host memory under the same budget keeps its rule: what does not fit stays tracked but unwired.
TEST_F(DeviceBudgetTest, HostMemoryThatDoesNotFitStaysUnwiredAsBefore) {
  two_holders_a_with_6_mib();
  a.m->begin_call();
  std::vector<char> host(4 * MiB);
  auto id = b.m->register_region(host.data(), host.size());
  ASSERT_TRUE(id) << id.message();
  EXPECT_FALSE(b.fake->is_resident(*id));
  EXPECT_EQ(b.m->stats().pending_bytes, 4 * MiB);
  EXPECT_EQ(used(), 6 * MiB);
  a.m->end_call();
  (void)b.m->unregister_region(*id);
}

// --- the strict budget (RESIDENCY_BUDGET_WAIT): never over it ---------------------------------

// A wake or allocation that finds no idle holder waits for one to end its call and be asked; the
// books never show more than the budget.
TEST_F(DeviceBudgetTest, AStrictBudgetWaitsForTheHolderInsideACallAndNeverGoesOver) {
  start(a, 8 * MiB, 5s);
  start(b, 8 * MiB, 5s);
  auto pa = a.m->allocate(6 * MiB);
  ASSERT_TRUE(pa) << pa.message();
  a.m->begin_call();  // a decode is running
  std::atomic<bool> done{false};
  Result<Allocation> pb = Status(ErrorCode::not_found, "not yet");
  std::thread waker([&] {
    pb = b.m->allocate(4 * MiB);
    done = true;
  });
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(done.load()) << "the allocation waits while the only holder is inside a call";
  EXPECT_EQ(used(), 6 * MiB);
  bool waiting = false;
  for (const auto& info : list_shared_budgets())
    if (info.name == name)
      for (const auto& h : info.holders) waiting = waiting || h.waiting;
  EXPECT_TRUE(waiting) << "`residency stat` shows the holder waiting its turn";
  const auto ended = std::chrono::steady_clock::now();
  a.m->end_call();
  waker.join();
  // How long after the call ended the waiter was served (a measurement, not a limit).
  RecordProperty("served_after_the_call_ended_us",
                 std::to_string(
                     std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - ended).count()));
  ASSERT_TRUE(pb) << pb.message();
  EXPECT_FALSE(a.fake->is_resident(pa->id)) << "asked once its call ended, it slept";
  EXPECT_TRUE(b.fake->is_resident(pb->id));
  EXPECT_EQ(used(), 4 * MiB);
  EXPECT_FALSE(b.logs.contains(LogLevel::warn, "over it")) << "nothing woke over the budget";
}

// At the bound the allocation is refused, with the budget, the wait and who holds it; nothing of it
// is allocated and the books are as they were.
TEST_F(DeviceBudgetTest, AStrictBudgetRefusesAtTheBoundAndSaysWhoHoldsIt) {
  start(a, 8 * MiB, 300ms);
  start(b, 8 * MiB, 300ms);
  auto pa = a.m->allocate(6 * MiB);
  ASSERT_TRUE(pa) << pa.message();
  a.m->begin_call();
  const auto t0 = std::chrono::steady_clock::now();
  auto pb = b.m->allocate(4 * MiB);
  const auto waited = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(pb);
  EXPECT_EQ(pb.status().code(), ErrorCode::out_of_memory);
  EXPECT_NE(pb.message().find("shared budget " + name +
                              " (8.00 MiB) had no room for 4.00 MiB of device memory "
                              "within RESIDENCY_BUDGET_WAIT (300 ms"),
            std::string::npos)
      << pb.message();
  EXPECT_NE(pb.message().find("pid " + std::to_string(::getpid()) + " holds 6.0 MiB"), std::string::npos) << pb.message();
  EXPECT_GE(waited, 300ms);
  EXPECT_LT(waited, 2s) << "bounded by RESIDENCY_BUDGET_WAIT";
  EXPECT_TRUE(b.fake->allocated.empty()) << "nothing was allocated";
  EXPECT_EQ(used(), 6 * MiB);
  EXPECT_TRUE(a.fake->is_resident(pa->id));
  a.m->end_call();
}

// A wake that gets no room stays asleep: the manager says its memory is not wired (the preload
// then refuses the decode), and the books never show more than the budget.
TEST_F(DeviceBudgetTest, AStrictWakeWithoutRoomStaysAsleepAndTheCallIsTold) {
  const auto [pa, pb] = b_asleep_while_a_holds_6_of_8_mib(300ms, /*paced=*/false);
  ASSERT_NE(pa.ptr, nullptr);
  a.m->begin_call();
  b.m->begin_call();  // wakes: no room within 300 ms
  EXPECT_FALSE(b.fake->is_resident(pb.id));
  EXPECT_FALSE(b.m->unwired_status()) << "the call is told its memory is not awake";
  EXPECT_TRUE(b.logs.contains(LogLevel::warn, "had no room for 4.00 MiB of device memory"));
  EXPECT_EQ(used(), 6 * MiB);
  b.m->end_call();
  a.m->end_call();
  // The next call, with a idle now, gets its room.
  b.m->begin_call();
  EXPECT_TRUE(b.fake->is_resident(pb.id));
  EXPECT_FALSE(a.fake->is_resident(pa.id));
  EXPECT_TRUE(b.m->unwired_status());
  b.m->end_call();
  EXPECT_EQ(used(), 4 * MiB);
}

// Waits are served in order of arrival. a and d each hold 4 MiB of 8 inside a call; b, then c, each
// wait for 4 MiB (b of a higher priority, so that c may not ask b to give back what it got). When a's
// call ends, its 4 MiB go to b, the first to arrive, though c asks as well; c's turn comes with d's.
TEST_F(DeviceBudgetTest, StrictWaitsAreServedInOrderOfArrival) {
  Device d;
  start(a, 8 * MiB, 5s);
  start(d, 8 * MiB, 5s);
  start(b, 8 * MiB, 5s, {}, /*priority=*/1);
  start(c, 8 * MiB, 5s);
  auto pa = a.m->allocate(4 * MiB);
  auto pd = d.m->allocate(4 * MiB);
  ASSERT_TRUE(pa && pd);
  a.m->begin_call();
  d.m->begin_call();
  std::atomic<int> order{0};
  std::atomic<int> b_done{0}, c_done{0};
  Result<Allocation> pb = Status(ErrorCode::not_found, ""), pc = Status(ErrorCode::not_found, "");
  std::thread tb([&] {
    pb = b.m->allocate(4 * MiB);
    b_done = ++order;
  });
  std::this_thread::sleep_for(100ms);  // b has its ticket first
  std::thread tc([&] {
    pc = c.m->allocate(4 * MiB);
    c_done = ++order;
  });
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(order.load(), 0) << "both wait while a and d are inside their calls";
  a.m->end_call();
  tb.join();
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(b_done.load(), 1) << "the first to arrive is served first";
  EXPECT_EQ(c_done.load(), 0) << "the second waits on, though it asked too";
  EXPECT_LE(used(), 8 * MiB);
  d.m->end_call();
  tc.join();
  ASSERT_TRUE(pb) << pb.message();
  ASSERT_TRUE(pc) << pc.message();
  EXPECT_EQ(c_done.load(), 2);
  EXPECT_LE(used(), 8 * MiB);
}

// A holder inside a call with its memory awake never waits for the budget (two such holders would
// wait for each other): what does not fit is refused at once.
TEST_F(DeviceBudgetTest, AStrictHolderInsideACallWithMemoryAwakeNeverWaits) {
  start(a, 8 * MiB, 5s);
  start(b, 8 * MiB, 5s);
  auto pa = a.m->allocate(6 * MiB);
  auto pb = b.m->allocate(2 * MiB);
  ASSERT_TRUE(pa && pb);
  a.m->begin_call();
  b.m->begin_call();
  const auto t0 = std::chrono::steady_clock::now();
  auto more = b.m->allocate(2 * MiB);
  EXPECT_FALSE(more);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s) << "refused at once, not after the 5 s wait";
  EXPECT_EQ(used(), 8 * MiB);
  b.m->end_call();
  a.m->end_call();
}

// Two devices of one process: a wait for one GPU's budget holds nothing of the other's.
TEST_F(DeviceBudgetTest, StrictWaitsOnTwoDevicesOfOneProcessAreApart) {
  const std::string other = name + "-gpu1";
  start(a, 8 * MiB, 2s);
  start(b, 8 * MiB, 2s);
  start(c, 8 * MiB, 2s, other);
  auto pa = a.m->allocate(8 * MiB);
  ASSERT_TRUE(pa) << pa.message();
  a.m->begin_call();
  std::thread waiter([&] { (void)b.m->allocate(4 * MiB); });
  std::this_thread::sleep_for(50ms);
  const auto t0 = std::chrono::steady_clock::now();
  auto pc = c.m->allocate(4 * MiB);
  ASSERT_TRUE(pc) << pc.message();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 200ms) << "the other device's budget does not wait";
  a.m->end_call();
  waiter.join();
}

TEST(DeviceConfig, AGpuBudgetIsNamedByTheDevicesUuid) {
  auto c = Config::from_env(
      [](const char* n) -> const char* { return std::string(n) == "RESIDENCY_GPU_BUDGET" ? "models:80%" : nullptr; });
  ASSERT_TRUE(c) << c.message();
  const Config d = c->for_device_memory("GPU-0123abcd-0000-1111-2222-333344445555");
  ASSERT_TRUE(d.shared_budget);
  EXPECT_EQ(d.shared_budget->name, "models.GPU-0123abcd-0000-1111-2222-333344445555");
  EXPECT_TRUE(d.shared_budget->size.is_percent);
  EXPECT_FALSE(c->for_device_memory().shared_budget) << "no UUID, no budget";
  Config host = *c;
  host.shared_budget = SharedBudget{"ram", WiredLimit{false, 1 << 20, 0}, ""};
  EXPECT_FALSE(host.for_device_memory().shared_budget) << "RESIDENCY_SHARED_BUDGET is a budget of RAM";
  auto bad = Config::from_env([](const char* n) -> const char* {
    return std::string(n) == "RESIDENCY_GPU_BUDGET" ? "a-name-longer-than-thirty-one-chars:1GiB" : nullptr;
  });
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.message().find("RESIDENCY_GPU_BUDGET="), std::string::npos) << bad.message();
  EXPECT_NE(bad.message().find("longer than 31 characters"), std::string::npos) << bad.message();
}

}  // namespace

namespace {
// What sleeping models hold of the host is shown: the model files a backend keeps registered with
// the GPU (pinned page cache) are in the holder's state file, which `residency stat` reads
// (HolderFacts::registered_file_bytes).
TEST_F(DeviceBudgetTest, TheModelFilesABackendKeepsRegisteredAreInTheHoldersStateFile) {
  a.fake->registered_files = 7 * MiB;
  start(a, 8 * MiB, std::nullopt, {}, 0, LogLevel::info, /*state_file=*/true);
  auto p = a.m->allocate(4 * MiB);
  ASSERT_TRUE(p) << p.message();
  a.m->release_now();  // published at once
  std::string registered;
  for (const auto& s : core::read_state_files(::getpid(), ::geteuid(), core::process_start_time(::getpid())))
    if (s.fields.count("shared_budget") != 0 && s.fields.at("shared_budget") == name)
      registered = s.fields.count("registered_file_bytes") != 0 ? s.fields.at("registered_file_bytes") : "absent";
  EXPECT_EQ(registered, std::to_string(7 * MiB));
}
}  // namespace
