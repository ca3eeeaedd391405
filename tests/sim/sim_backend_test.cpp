// SPDX-License-Identifier: MIT
// The sim backend on its own: each modelled rule, observed the way a user of a Mac would see
// it (wired bytes, the time of the next GPU pass), in virtual time.
#include <gtest/gtest.h>

#include <thread>

#include "sim/sim_test_support.hpp"

namespace residency {
namespace {

using namespace simtest;

RegionDesc region(RegionId id, std::uintptr_t n, std::uint64_t size) {
  RegionDesc d;
  d.id = id;
  d.base = fake_base(n);
  d.size = size;
  return d;
}

SimBackend::GpuBuffer gpu(std::uintptr_t n, std::uint64_t size) { return {fake_base(n), size}; }

double ms_of(Nanos d) { return static_cast<double>(d.count()) / 1e6; }

// ---- the collector and the re-wire cost ----------------------------------------------------

TEST(SimCollector, UnwiresAfterTheDelayAtItsRateAndTheNextUsePaysTheRewire) {
  ManualClock clock;
  auto sim = make_sim(clock);
  ASSERT_TRUE(sim);
  auto q = sim->add_queue();
  ASSERT_TRUE(q);
  // First use wires 2 GB: 2 s of re-wire at 1 GB/s.
  auto first = sim->run_command_buffer(*q, {gpu(1, 2 * kGB)}, 10ms);
  ASSERT_TRUE(first) << first.message();
  EXPECT_EQ(*first, 10ms + 2s);
  clock.advance(*first);
  EXPECT_EQ(sim->wired_bytes(), 2 * kGB);
  // Still wired just before the delay; the collector then unwires 1 GB/s.
  clock.advance(999ms);
  EXPECT_EQ(sim->wired_bytes(), 2 * kGB);
  clock.advance(501ms);  // 0.5 s into the collection
  EXPECT_EQ(sim->wired_bytes(), kGB + kGB / 2);
  auto second = sim->run_command_buffer(*q, {gpu(1, 2 * kGB)}, 10ms);
  ASSERT_TRUE(second);
  EXPECT_EQ(*second, 10ms + 500ms);  // re-wires the 0.5 GB taken
  clock.advance(*second);
  // A short pause costs nothing.
  clock.advance(300ms);
  auto third = sim->run_command_buffer(*q, {gpu(1, 2 * kGB)}, 10ms);
  ASSERT_TRUE(third);
  EXPECT_EQ(*third, 10ms);
  // A long pause takes it all; the next use pays for all of it.
  clock.advance(*third + 10s);
  EXPECT_EQ(sim->wired_bytes(), 0u);
  auto fourth = sim->run_command_buffer(*q, {gpu(1, 2 * kGB)}, 10ms);
  ASSERT_TRUE(fourth);
  EXPECT_EQ(*fourth, 10ms + 2s);
  EXPECT_EQ(sim->stats().rewired_bytes, 2 * kGB + kGB / 2 + 2 * kGB);
}

TEST(SimCollector, TakesLeastRecentlyUsedFirstAtOneRateForAllBuffers) {
  ManualClock clock;
  auto sim = make_sim(clock);
  auto q = sim->add_queue();
  // Each first use re-wires 1 GB (1 s): buffer 1 is last used at 1.0 s, buffer 2 at 1.1 s,
  // so the collector may take buffer 1 from 2.0 s and buffer 2 from 2.1 s.
  ASSERT_TRUE(sim->run_command_buffer(*q, {gpu(1, kGB)}, 0ms));
  clock.set(100ms);
  ASSERT_TRUE(sim->run_command_buffer(*q, {gpu(2, kGB)}, 0ms));
  // At 2.6 s it has worked 0.6 s at 1 GB/s, all of it on the older buffer.
  clock.set(2600ms);
  EXPECT_EQ(sim->wired_bytes(fake_base(1)), kGB - 600'000'000ULL);
  EXPECT_EQ(sim->wired_bytes(fake_base(2)), kGB);
  // At 3.5 s: 1.5 GB in all, buffer 1 gone and half of buffer 2 (one rate, not one per buffer).
  clock.set(3500ms);
  EXPECT_EQ(sim->wired_bytes(fake_base(1)), 0u);
  EXPECT_EQ(sim->wired_bytes(fake_base(2)), kGB / 2);
  EXPECT_EQ(sim->stats().collected_bytes, kGB + kGB / 2);
}

TEST(SimCollector, ReplayDoesNotDependOnHowOftenItIsObserved) {
  // The same history observed once or every millisecond gives the same state.
  auto run = [](bool observe_often) {
    ManualClock clock;
    auto sim = make_sim(clock);
    auto q = sim->add_queue();
    EXPECT_TRUE(sim->run_command_buffer(*q, {gpu(1, 3 * kGB)}, 0ms));
    EXPECT_TRUE(sim->run_command_buffer(*q, {gpu(2, kGB)}, 0ms));
    // Buffer 2 (last used at 1 s) is exposed from 2 s, buffer 1 (at 3 s) from 4 s.
    for (int i = 0; i < 4300; ++i) {
      clock.advance(1ms);
      if (observe_often) (void)sim->wired_bytes();
    }
    return std::pair{sim->wired_bytes(fake_base(1)), sim->wired_bytes(fake_base(2))};
  };
  EXPECT_EQ(run(true), run(false));
  EXPECT_EQ(run(false).first + run(false).second, 4 * kGB - 1'300'000'000ULL);
}

// ---- residency requests ---------------------------------------------------------------------

TEST(SimResidency, ARequestKeepsMemoryWiredAndWiresWhatWasTaken) {
  ManualClock clock;
  auto sim = make_sim(clock);
  auto q = sim->add_queue();
  ASSERT_TRUE(sim->create_set(0, 2 * kGB));
  sim->add_region(0, region(1, 1, 2 * kGB));
  EXPECT_TRUE(sim->commit(0).ok());
  EXPECT_EQ(sim->wired_bytes(), 0u);  // membership alone wires nothing
  EXPECT_TRUE(sim->request_residency(0).ok());
  EXPECT_EQ(sim->wired_bytes(), 2 * kGB);
  EXPECT_EQ(sim->stats().request_wire_time, 2s);
  clock.advance(10min);
  EXPECT_EQ(sim->wired_bytes(), 2 * kGB);  // no decay in this mode
  auto pass = sim->run_command_buffer(*q, {gpu(1, 2 * kGB)}, 10ms);
  ASSERT_TRUE(pass);
  EXPECT_EQ(*pass, 10ms);
}

TEST(SimResidency, ResidencyIsTheUnionOfAllRequestedSets) {
  ManualClock clock;
  auto sim = make_sim(clock);
  ASSERT_TRUE(sim->create_set(0, 0));
  ASSERT_TRUE(sim->create_set(1, 0));
  sim->add_region(0, region(1, 1, kGB));
  sim->add_region(1, region(1, 1, kGB));  // the same memory in two sets
  sim->add_region(1, region(2, 2, kGB));
  EXPECT_TRUE(sim->commit(0).ok());
  EXPECT_TRUE(sim->commit(1).ok());
  EXPECT_TRUE(sim->request_residency(0).ok());
  EXPECT_TRUE(sim->request_residency(1).ok());
  EXPECT_EQ(sim->wired_bytes(), 2 * kGB);
  // Removing buffer 1 from set 1 and ending set 0 leaves buffer 1 unprotected...
  EXPECT_TRUE(sim->end_residency(0));
  sim->gpu_operation();
  clock.advance(5s);
  EXPECT_EQ(sim->wired_bytes(fake_base(1)), kGB);  // ...not yet: set 1 still holds it
  sim->remove_region(1, 1);
  EXPECT_TRUE(sim->commit(1).ok());
  clock.advance(5s);
  EXPECT_EQ(sim->wired_bytes(fake_base(1)), 0u);
  EXPECT_EQ(sim->wired_bytes(fake_base(2)), kGB);  // still requested through set 1
}

TEST(SimResidency, RegionsAddedToARequestedSetAreWiredAtCommit) {
  ManualClock clock;
  auto sim = make_sim(clock);
  ASSERT_TRUE(sim->create_set(0, 0));
  EXPECT_TRUE(sim->request_residency(0).ok());
  sim->add_region(0, region(1, 1, kGB));
  EXPECT_EQ(sim->wired_bytes(), 0u);  // staged, not committed
  EXPECT_TRUE(sim->commit(0).ok());
  EXPECT_EQ(sim->wired_bytes(), kGB);
}

TEST(SimResidency, DecayingRequestsLapseAboutOneSecondAfterTheLastUseUnlessRepeated) {
  ManualClock clock;
  SimOptions o;
  o.decaying_requests = true;
  auto sim = make_sim(clock, o);
  ASSERT_TRUE(sim->create_set(0, 0));
  ASSERT_TRUE(sim->create_set(1, 0));
  sim->add_region(0, region(1, 1, kGB));
  sim->add_region(1, region(2, 2, kGB));
  EXPECT_TRUE(sim->commit(0).ok());
  EXPECT_TRUE(sim->commit(1).ok());
  EXPECT_TRUE(sim->request_residency(0).ok());
  EXPECT_TRUE(sim->request_residency(1).ok());
  // Set 0 is refreshed every 500 ms, set 1 never.
  for (int i = 0; i < 10; ++i) {
    clock.advance(500ms);
    EXPECT_TRUE(sim->refresh(0).ok());
  }
  EXPECT_TRUE(sim->residency_requested(0));
  EXPECT_FALSE(sim->residency_requested(1));
  EXPECT_EQ(sim->wired_bytes(fake_base(1)), kGB);
  EXPECT_EQ(sim->wired_bytes(fake_base(2)), 0u);  // lapsed at 1 s, collected by 2 s
  EXPECT_EQ(sim->stats().refreshes, 10u);
  // A refresh after the lapse re-wires, paying for what was taken.
  const Nanos before = sim->stats().request_wire_time;
  EXPECT_TRUE(sim->refresh(1).ok());
  EXPECT_EQ(sim->stats().request_wire_time - before, 1s);
  EXPECT_EQ(sim->wired_bytes(fake_base(2)), kGB);
}

TEST(SimResidency, CapabilitiesFollowTheMode) {
  ManualClock clock;
  auto plain = make_sim(clock);
  EXPECT_EQ(plain->capabilities().name, "sim");
  EXPECT_FALSE(plain->capabilities().needs_refresh);
  EXPECT_EQ(plain->capabilities().max_sets, 0u);
  SimOptions o;
  o.decaying_requests = true;
  o.attach_new_sets = true;
  o.queue_set_limit = 8;
  auto decaying = make_sim(clock, o);
  EXPECT_TRUE(decaying->capabilities().needs_refresh);
  EXPECT_EQ(decaying->capabilities().refresh_period, 500ms);
  EXPECT_EQ(decaying->capabilities().max_sets, 8u);
}

// ---- the ended-set leak (llama.cpp issue 25937) -----------------------------------------------

TEST(SimLeak, EndedSetsStayWiredInAProcessThatRanNoGpuWork) {
  ManualClock clock;
  SimOptions o;
  o.after_release_gpu_op = false;
  auto sim = make_sim(clock, o);
  ASSERT_TRUE(sim->create_set(0, 0));
  sim->add_region(0, region(1, 1, 4 * kGB));
  EXPECT_TRUE(sim->commit(0).ok());
  EXPECT_TRUE(sim->request_residency(0).ok());
  EXPECT_TRUE(sim->end_residency(0));
  sim->remove_region(0, 1);
  EXPECT_TRUE(sim->commit(0).ok());
  EXPECT_TRUE(sim->destroy_set(0));
  sim->after_release();  // does nothing in this configuration
  clock.advance(1h);
  EXPECT_EQ(sim->wired_bytes(), 4 * kGB);  // the bug: still wired an hour later
  // Any GPU operation in the process ends it; the collector then takes the memory.
  sim->gpu_operation();
  clock.advance(1s);
  EXPECT_EQ(sim->wired_bytes(), 3 * kGB);
  clock.advance(5s);
  EXPECT_EQ(sim->wired_bytes(), 0u);
}

TEST(SimLeak, TheAfterReleaseGpuOperationGivesEndedSetsBack) {
  ManualClock clock;
  auto sim = make_sim(clock);  // after_release_gpu_op = true, the default
  ASSERT_TRUE(sim->create_set(0, 0));
  sim->add_region(0, region(1, 1, 4 * kGB));
  EXPECT_TRUE(sim->commit(0).ok());
  EXPECT_TRUE(sim->request_residency(0).ok());
  EXPECT_TRUE(sim->end_residency(0));
  sim->after_release();
  EXPECT_EQ(sim->stats().gpu_operations, 1u);
  clock.advance(10s);  // llama.cpp's test: 75 % of the growth gone within 10 s
  EXPECT_EQ(sim->wired_bytes(), 0u);
}

TEST(SimLeak, AGpuOperationBeforeTheEndPreventsTheLeak) {
  ManualClock clock;
  SimOptions o;
  o.after_release_gpu_op = false;
  auto sim = make_sim(clock, o);
  sim->gpu_operation();  // e.g. llama.cpp's 1-byte blit at initialisation
  ASSERT_TRUE(sim->create_set(0, 0));
  sim->add_region(0, region(1, 1, kGB));
  EXPECT_TRUE(sim->commit(0).ok());
  EXPECT_TRUE(sim->request_residency(0).ok());
  EXPECT_TRUE(sim->end_residency(0));
  clock.advance(3s);
  EXPECT_EQ(sim->wired_bytes(), 0u);
}

// ---- queues and command buffers -----------------------------------------------------------

TEST(SimQueue, NoQueueIsGivenMoreSetsThanItsLimit) {
  ManualClock clock;
  SimOptions o;
  o.queue_set_limit = 4;
  auto sim = make_sim(clock, o);
  auto q = sim->add_queue();
  for (SetId s = 0; s < 6; ++s) ASSERT_TRUE(sim->create_set(s, 0));
  for (SetId s = 0; s < 4; ++s) EXPECT_TRUE(sim->attach_set(*q, s));
  Status over = sim->attach_set(*q, 4);
  EXPECT_EQ(over.code(), ErrorCode::limit_exceeded);
  EXPECT_NE(over.message().find("already holds 4"), std::string::npos) << over.message();
  EXPECT_EQ(sim->queue_sets(*q).size(), 4u);
  // Room again after a detach or a destroy.
  EXPECT_TRUE(sim->detach_set(*q, 0));
  EXPECT_TRUE(sim->attach_set(*q, 4));
  EXPECT_TRUE(sim->destroy_set(1));
  EXPECT_TRUE(sim->attach_set(*q, 5));
  EXPECT_EQ(sim->queue_sets(*q).size(), 4u);
}

TEST(SimQueue, AttachingNewSetsStopsAtTheLimit) {
  ManualClock clock;
  SimOptions o;
  o.queue_set_limit = 3;
  o.attach_new_sets = true;
  auto sim = make_sim(clock, o);
  auto q1 = sim->add_queue();
  auto q2 = sim->add_queue();
  for (SetId s = 0; s < 3; ++s) ASSERT_TRUE(sim->create_set(s, 0));
  EXPECT_EQ(sim->queue_sets(*q1).size(), 3u);
  EXPECT_EQ(sim->queue_sets(*q2).size(), 3u);
  Status over = sim->create_set(3, 0);
  EXPECT_EQ(over.code(), ErrorCode::limit_exceeded);
  EXPECT_EQ(sim->live_sets(), 3u);
  EXPECT_EQ(sim->queue_sets(*q1).size(), 3u);
}

TEST(SimQueue, ASetCreatedAfterACommandBufferIsCommittedDoesNotCountForIt) {
  ManualClock clock;
  SimOptions o;
  o.attach_new_sets = true;
  auto sim = make_sim(clock, o);
  auto q = sim->add_queue();
  ASSERT_TRUE(sim->create_set(0, 0));
  sim->add_region(0, region(1, 1, kGB));
  EXPECT_TRUE(sim->commit(0).ok());
  auto early = sim->commit_command_buffer(*q, {}, 5ms);
  ASSERT_TRUE(early);
  // Set 1 arrives after that commit.
  ASSERT_TRUE(sim->create_set(1, 0));
  sim->add_region(1, region(2, 2, kGB));
  EXPECT_TRUE(sim->commit(1).ok());
  auto late = sim->commit_command_buffer(*q, {}, 5ms);
  ASSERT_TRUE(late);
  EXPECT_EQ(early->resident_sets, std::vector<SetId>{0});
  EXPECT_EQ(late->resident_sets, (std::vector<SetId>{0, 1}));
  // Executing the early one wires set 0's memory only (1 s of re-wire), the late one both.
  auto e = sim->execute(*early);
  ASSERT_TRUE(e);
  EXPECT_EQ(*e, 5ms + 1s);
  EXPECT_EQ(sim->wired_bytes(fake_base(1)), kGB);
  EXPECT_EQ(sim->wired_bytes(fake_base(2)), 0u);
  auto l = sim->execute(*late);
  ASSERT_TRUE(l);
  EXPECT_EQ(*l, 5ms + 1s);  // set 0 is wired now; set 1 pays
  EXPECT_EQ(sim->wired_bytes(fake_base(2)), kGB);
}

// ---- teardown, errors, threads ---------------------------------------------------------------

TEST(SimTeardown, DestroyingLiveSetsGivesEverythingBack) {
  ManualClock clock;
  SimOptions o;
  o.attach_new_sets = true;
  auto sim = make_sim(clock, o);
  auto q = sim->add_queue();
  for (SetId s = 0; s < 3; ++s) {
    ASSERT_TRUE(sim->create_set(s, 0));
    sim->add_region(s, region(s + 1, s + 1, kGB));
    EXPECT_TRUE(sim->commit(s).ok());
    EXPECT_TRUE(sim->request_residency(s).ok());
  }
  EXPECT_EQ(sim->wired_bytes(), 3 * kGB);
  for (SetId s = 0; s < 3; ++s) EXPECT_TRUE(sim->destroy_set(s));
  sim->after_release();
  EXPECT_EQ(sim->live_sets(), 0u);
  EXPECT_TRUE(sim->queue_sets(*q).empty());
  clock.advance(1s + 3s);
  EXPECT_EQ(sim->wired_bytes(), 0u);
  EXPECT_EQ(sim->allocated_bytes(), 0u);  // nothing left that the sim holds
}

TEST(SimErrors, MisuseIsReportedNotFatal) {
  ManualClock clock;
  auto sim = make_sim(clock);
  EXPECT_EQ(sim->commit(7).status.code(), ErrorCode::not_found);
  EXPECT_EQ(sim->request_residency(7).status.code(), ErrorCode::not_found);
  sim->add_region(7, region(1, 1, kGB));
  EXPECT_NE(sim->last_error().find("no residency set 7"), std::string::npos) << sim->last_error();
  EXPECT_EQ(sim->end_residency(7).code(), ErrorCode::not_found);
  EXPECT_EQ(sim->destroy_set(7).code(), ErrorCode::not_found);
  EXPECT_EQ(sim->stats().misuse, 3u);
  ASSERT_TRUE(sim->create_set(0, 0));
  EXPECT_EQ(sim->create_set(0, 0).code(), ErrorCode::invalid_argument);
  // The same base with two sizes, and a null region, fail only those regions.
  sim->add_region(0, region(1, 1, kGB));
  sim->add_region(0, region(2, 1, 2 * kGB));
  sim->add_region(0, RegionDesc{3, nullptr, 10, RegionClass::weights, false, nullptr});
  SetOutcome out = sim->commit(0);
  EXPECT_FALSE(out.ok());
  EXPECT_EQ(out.failed.size(), 2u);
  EXPECT_EQ(out.status.code(), ErrorCode::invalid_argument);
  EXPECT_EQ(sim->allocated_bytes(), kGB);
  auto q = sim->add_queue();
  EXPECT_FALSE(sim->run_command_buffer(*q, {gpu(1, 3 * kGB)}, 1ms));
  EXPECT_FALSE(sim->run_command_buffer(*q + 1, {gpu(1, kGB)}, 1ms));
  EXPECT_FALSE(sim->run_command_buffer(*q, {gpu(9, 0)}, 1ms));
  EXPECT_FALSE(sim->run_command_buffer(*q, {gpu(9, 1)}, -1ms));
  EXPECT_EQ(sim->attach_set(*q, 42).code(), ErrorCode::not_found);
}

TEST(SimErrors, OptionsThatModelNothingAreRefused) {
  SimOptions o;
  o.profile.collector_rate = 0;
  o.queue_set_limit = 0;
  auto sim = make_sim_backend(o);
  ASSERT_FALSE(sim);
  EXPECT_NE(sim.message().find("collector_rate"), std::string::npos) << sim.message();
  EXPECT_NE(sim.message().find("queue_set_limit"), std::string::npos) << sim.message();
  auto unknown = sim_profile("m1-tiny");
  ASSERT_FALSE(unknown);
  EXPECT_NE(unknown.message().find("m2-ultra-8b-f16"), std::string::npos) << unknown.message();
  for (const auto& name : sim_profile_names()) EXPECT_TRUE(sim_profile(name)) << name;
  // make_sim_backend() with no arguments: the default profile on the steady clock.
  auto plain = make_sim_backend();
  ASSERT_TRUE(plain) << plain.message();
  EXPECT_EQ((*plain)->memory_info().recommended_working_set, 147456ULL * 1024 * 1024);
}

TEST(SimThreads, ConcurrentCallsAreSerialised) {
  ManualClock clock;
  SimOptions o;
  o.decaying_requests = true;
  auto sim = make_sim(clock, o);
  ASSERT_TRUE(sim->create_set(0, 0));
  sim->add_region(0, region(1, 1, kGB));
  EXPECT_TRUE(sim->commit(0).ok());
  auto q = sim->add_queue();
  std::thread refresher([&] {
    for (int i = 0; i < 2000; ++i) (void)sim->refresh(0);
  });
  for (int i = 0; i < 2000; ++i) {
    clock.advance(1ms);
    (void)sim->run_command_buffer(*q, {gpu(1, kGB)}, 1ms);
    (void)sim->wired_bytes();
  }
  refresher.join();
  EXPECT_EQ(sim->stats().refreshes, 2000u);
  EXPECT_EQ(sim->wired_bytes(), kGB);
}

// ---- the calibration, on the backend alone -------------------------------------------------

TEST(SimProfiles, F16DecodeAfterAPauseMatchesLlamaIdle) {
  // llama-idle without residency sets: sleep, decode (every weight once), repeat.
  ManualClock clock;
  SimOptions o;
  o.clock = &clock;
  auto sim = make_sim_backend(o);  // the default profile: m2-ultra-8b-f16
  ASSERT_TRUE(sim);
  const SimProfile& p = (*sim)->options().profile;
  auto q = (*sim)->add_queue();
  auto decode = [&] {
    auto d = (*sim)->run_command_buffer(*q, {{fake_base(1), p.model_bytes}}, p.decode_compute);
    EXPECT_TRUE(d);
    clock.advance(*d);
    return ms_of(*d);
  };
  decode();  // warm-up
  struct Point {
    int pause_ms;
    double lo, hi;
  };
  for (Point pt :
       {Point{0, 29, 29}, Point{1000, 29, 29}, Point{1200, 227, 227}, Point{1400, 413, 472}, Point{3000, 413, 472}}) {
    clock.advance(std::chrono::milliseconds(pt.pause_ms));
    const double t = decode();
    EXPECT_GE(t, pt.lo * 0.85) << "pause " << pt.pause_ms;
    EXPECT_LE(t, pt.hi * 1.15) << "pause " << pt.pause_ms;
  }
}

}  // namespace
}  // namespace residency
