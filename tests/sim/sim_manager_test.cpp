// SPDX-License-Identifier: MIT
// A real Manager driving the sim backend in virtual time: the manager's refresh and keep-alive
// against decaying requests, the ended-set leak, the queue limit, and teardown with live sets.
// The manager runs without its thread (start_scheduler = false); advance_with() moves the
// shared ManualClock from one of its deadlines to the next, as its scheduler would.
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "sim/sim_test_support.hpp"

namespace residency {
namespace {

using namespace simtest;

struct Rig {
  // Declared in the order they must outlive each other: the manager logs into `logs` and
  // reads `clock` until it is destroyed, first.
  ManualClock clock;
  std::vector<std::string> logs;
  std::shared_ptr<SimBackend> sim;
  std::unique_ptr<Manager> manager;
  SimBackend::QueueId queue = 0;

  Status start(SimOptions sim_options, Config config) {
    sim = make_sim(clock, std::move(sim_options));
    if (!sim) return Status(ErrorCode::invalid_argument, "sim options");
    auto q = sim->add_queue();
    if (!q) return q.status();
    queue = *q;
    ManagerOptions mo;
    mo.config = std::move(config);
    mo.backend = sim;
    mo.clock = &clock;
    mo.start_scheduler = false;
    mo.log = [this](LogLevel, std::string_view m) { logs.emplace_back(m); };
    auto m = Manager::create(std::move(mo));
    if (!m) return m.status();
    manager = std::move(m.value());
    return Status::ok();
  }
  // One decode: the engine's touch(), then a command buffer reading `bytes` at `base`.
  // Returns what the user waits for: re-wiring done by the touch plus the GPU pass.
  Nanos decode(std::uintptr_t base, std::uint64_t bytes, Nanos compute = 10ms) {
    const Nanos wired_before = sim->stats().request_wire_time;
    manager->touch();
    auto pass = sim->run_command_buffer(queue, {{fake_base(base), bytes}}, compute);
    EXPECT_TRUE(pass) << pass.message();
    const Nanos total = (sim->stats().request_wire_time - wired_before) + (pass ? *pass : 0ns);
    advance_with(*manager, clock, clock.now() + total);
    return total;
  }
  void idle(Nanos d) { advance_with(*manager, clock, clock.now() + d); }
  bool logged(const std::string& needle) const {
    for (const auto& l : logs)
      if (l.find(needle) != std::string::npos) return true;
    return false;
  }
};

Config keep_alive(Nanos d) {
  Config c;
  c.keep_alive = KeepAlive::after(d);
  return c;
}

TEST(SimManager, RefreshKeepsDecayingRequestsWiredThroughLongGapsUntilTheKeepAlive) {
  Rig rig;
  SimOptions o;
  o.decaying_requests = true;
  ASSERT_TRUE(rig.start(o, keep_alive(5s)));
  EXPECT_TRUE(rig.manager->backend_capabilities().needs_refresh);
  ASSERT_TRUE(rig.manager->register_region(fake_base(1), 4 * kGB));
  rig.decode(1, 4 * kGB);  // warm
  // Gaps of 3 s, three times the request's decay: the refresh keeps everything wired and
  // every decode costs only its compute.
  for (int i = 0; i < 4; ++i) {
    rig.idle(3s);
    EXPECT_EQ(rig.sim->wired_bytes(), 4 * kGB) << "gap " << i;
    EXPECT_EQ(rig.decode(1, 4 * kGB), 10ms) << "gap " << i;
  }
  const auto refreshes_while_used = rig.sim->stats().refreshes;
  EXPECT_GE(refreshes_while_used, 4u * 5u);  // about one per 500 ms over 12 s
  // After the keep-alive the manager stops refreshing and ends residency; the collector then
  // takes the memory and the next decode pays the whole re-wire (4 GB at 1 GB/s).
  rig.idle(5s + 100ms);
  EXPECT_EQ(rig.manager->stats().releases, 1u);
  const auto refreshes_at_expiry = rig.sim->stats().refreshes;
  EXPECT_LE(refreshes_at_expiry - refreshes_while_used, 11u);
  rig.idle(30s);
  EXPECT_EQ(rig.sim->stats().refreshes, refreshes_at_expiry);  // zero refreshes while idle
  EXPECT_EQ(rig.sim->wired_bytes(), 0u);
  EXPECT_EQ(rig.decode(1, 4 * kGB), 10ms + 4s);
}

TEST(SimManager, TheSchedulerThreadRefreshesOnVirtualTime) {
  // The same rule with the manager's own thread: it sleeps on the ManualClock and wakes when
  // advance() passes its deadline, concurrently with the test's GPU work (TSan checks the sim's
  // locking here).
  ManualClock clock;
  std::vector<std::string> logs;
  SimOptions o;
  o.decaying_requests = true;
  auto sim = make_sim(clock, o);
  auto q = sim->add_queue();
  ManagerOptions mo;
  mo.config = keep_alive(5s);
  mo.backend = sim;
  mo.clock = &clock;
  mo.log = [&logs](LogLevel, std::string_view m) { logs.emplace_back(m); };
  auto m = Manager::create(std::move(mo));
  ASSERT_TRUE(m) << m.message();
  ASSERT_TRUE((*m)->register_region(fake_base(1), 4 * kGB));
  // Waits (in real time, bounded) until the scheduler is asleep on the clock again.
  auto settle = [&clock] {
    for (int i = 0; i < 20000 && clock.waiters() != 1; ++i) std::this_thread::sleep_for(100us);
    ASSERT_EQ(clock.waiters(), 1);
  };
  settle();
  (*m)->touch();
  ASSERT_TRUE(sim->run_command_buffer(*q, {{fake_base(1), 4 * kGB}}, 10ms));
  for (int i = 0; i < 40; ++i) {  // a 4 s gap with no GPU use, in 100 ms steps
    clock.advance(100ms);
    settle();
  }
  EXPECT_EQ(sim->wired_bytes(), 4 * kGB);
  EXPECT_GE(sim->stats().refreshes, 7u);
  auto pass = sim->run_command_buffer(*q, {{fake_base(1), 4 * kGB}}, 10ms);
  ASSERT_TRUE(pass);
  EXPECT_EQ(*pass, 10ms);
}

TEST(SimManager, WithoutTheRefreshADecayingRequestWouldLapse) {
  // The control for the test above: the same gap, the same backend, residency requested once
  // by hand and never repeated.
  ManualClock clock;
  SimOptions o;
  o.decaying_requests = true;
  auto sim = make_sim(clock, o);
  auto q = sim->add_queue();
  ASSERT_TRUE(sim->create_set(0, 0));
  sim->add_region(0, RegionDesc{1, fake_base(1), 4 * kGB, RegionClass::weights, false, nullptr});
  EXPECT_TRUE(sim->commit(0).ok());
  EXPECT_TRUE(sim->request_residency(0).ok());
  auto pass = sim->run_command_buffer(*q, {{fake_base(1), 4 * kGB}}, 10ms);
  ASSERT_TRUE(pass);
  clock.advance(*pass + 3s);
  EXPECT_LT(sim->wired_bytes(), 4 * kGB);
}

TEST(SimManager, EndedSetsStayWiredWithoutTheAfterReleaseGpuOperation) {
  for (bool gpu_op : {false, true}) {
    SCOPED_TRACE(gpu_op ? "with the after-release operation" : "without it");
    Rig rig;
    SimOptions o;
    o.after_release_gpu_op = gpu_op;
    ASSERT_TRUE(rig.start(o, keep_alive(1s)));
    // Load and keep-alive expiry with no GPU work at all (a process that only loads).
    ASSERT_TRUE(rig.manager->register_region(fake_base(1), 4 * kGB));
    EXPECT_EQ(rig.sim->wired_bytes(), 4 * kGB);
    rig.idle(2s);
    EXPECT_EQ(rig.manager->stats().releases, 1u);
    rig.idle(1h);
    EXPECT_EQ(rig.sim->wired_bytes(), gpu_op ? 0u : 4 * kGB);
  }
}

TEST(SimManager, NoQueueIsGivenMoreSetsThanItsLimit) {
  Rig rig;
  SimOptions o;
  o.attach_new_sets = true;  // every set on every queue, as MLX does
  Config c = keep_alive(180s);
  c.layout = Layout::sharded;
  c.set_max_pct = 0.5;  // 240 MB sets: each 256 MB region wants its own
  ASSERT_TRUE(rig.start(o, c));
  EXPECT_EQ(rig.manager->backend_capabilities().max_sets, 32u);
  constexpr std::uint64_t kRegion = 256'000'000ULL;
  for (std::uintptr_t i = 1; i <= 60; ++i) {
    ASSERT_TRUE(rig.manager->register_region(fake_base(i), kRegion)) << i;
  }
  EXPECT_LE(rig.sim->queue_sets(rig.queue).size(), 32u);
  EXPECT_EQ(rig.sim->queue_sets(rig.queue).size(), rig.sim->live_sets());
  EXPECT_EQ(rig.sim->last_error(), "");
  EXPECT_EQ(rig.manager->stats().wire_failures, 0u);
  EXPECT_EQ(rig.sim->wired_bytes(), 60 * kRegion);  // every region wired, sets shared
}

TEST(SimManager, TeardownWithLiveSetsGivesEverythingBack) {
  Rig rig;
  SimOptions o;
  o.attach_new_sets = true;
  Config c = keep_alive(180s);
  c.layout = Layout::per_buffer;
  ASSERT_TRUE(rig.start(o, c));
  for (std::uintptr_t i = 1; i <= 3; ++i) {
    ASSERT_TRUE(rig.manager->register_region(fake_base(i), kGB));
  }
  rig.decode(1, kGB);
  EXPECT_EQ(rig.sim->wired_bytes(), 3 * kGB);
  EXPECT_EQ(rig.sim->live_sets(), 3u);
  rig.manager.reset();  // regions still registered: a warning, not an abort
  EXPECT_TRUE(rig.logged("still registered at teardown"));
  EXPECT_EQ(rig.sim->live_sets(), 0u);
  EXPECT_TRUE(rig.sim->queue_sets(rig.queue).empty());
  rig.clock.advance(1s + 3s);
  EXPECT_EQ(rig.sim->wired_bytes(), 0u);
}

}  // namespace
}  // namespace residency
