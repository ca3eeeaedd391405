// SPDX-License-Identifier: MIT
// The CUDA preload's decisions without CUDA: a ProgramSession driven with the fake backend, a manual
// clock and the events its hooks would send (allocations, frees, uses, copies, tags). What is
// asserted is what the backend was asked to hold and to track. tests/cuda_host/cuda_hooks_test.cpp
// runs the same session behind the driver wrappers over the real cuda backend and an emulated GPU.
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cudapreload/program_session.hpp"
#include "support/fake_backend.hpp"

namespace residency::cudapreload {
namespace {

using testing::FakeBackend;
using testing::LogCapture;
using Outcome = ProgramSession::Allocation::Outcome;

constexpr std::size_t kMiB = std::size_t{1} << 20;

class ProgramSessionTest : public ::testing::Test {
 protected:
  ManualClock clock{Nanos(std::chrono::hours(1))};
  std::map<int, std::shared_ptr<FakeBackend>> gpus;
  LogCapture logs;
  bool backend_fails = false;

  std::unique_ptr<ProgramSession> make(KeepAlive keep_alive = KeepAlive::after(std::chrono::seconds(10))) {
    ProgramSession::Options o;
    o.config.keep_alive = keep_alive;
    o.config.log_level = LogLevel::debug;
    o.config.release_on_pressure = false;
    o.backends = [this](int device, const Config&) -> Result<std::shared_ptr<Backend>> {
      if (backend_fails) return Status(ErrorCode::unsupported, "cuda: no NVIDIA driver here");
      auto& g = gpus[device];
      if (!g) g = std::make_shared<FakeBackend>();
      return std::shared_ptr<Backend>(g);
    };
    o.clock = &clock;
    o.log = [this](LogLevel l, std::string_view line) { logs.callback()(l, line); };
    o.start_schedulers = false;
    return std::make_unique<ProgramSession>(std::move(o));
  }
  // The keep-alive runs out: the clock moves past it and the manager does what is due.
  void idle(ProgramSession& s, std::chrono::seconds d = std::chrono::seconds(11)) {
    clock.advance(d);
    for (int dev = 0; dev < 4; ++dev)
      if (Manager* m = s.manager(dev)) m->run_due();
  }
  std::uint64_t resident(int dev) { return gpus.count(dev) ? gpus[dev]->resident_bytes() : 0; }
};

TEST(ProgramTags, TheNamesAreTheOnesTheApiDocuments) {
  EXPECT_EQ(parse_tag("weights"), Tag::weights);
  EXPECT_EQ(parse_tag("kv"), Tag::kv);
  EXPECT_EQ(parse_tag("scratch"), Tag::scratch);
  EXPECT_EQ(parse_tag(""), Tag::unknown);
  EXPECT_EQ(parse_tag("unknown"), Tag::unknown);
  EXPECT_EQ(parse_tag("Weights"), std::nullopt);
  EXPECT_EQ(parse_tag("weights "), std::nullopt);
  for (Tag t : {Tag::unknown, Tag::weights, Tag::kv, Tag::scratch}) EXPECT_EQ(parse_tag(to_string(t)), t);
}

TEST_F(ProgramSessionTest, LargeAllocationsAreRoutedSmallOnesAndBadDevicesStayTheRuntimes) {
  auto s = make();
  EXPECT_EQ(s->allocate(0, ProgramRules::kMinRoutedBytes - 1).outcome, Outcome::pass_through);
  EXPECT_EQ(s->allocate(-1, 64 * kMiB).outcome, Outcome::pass_through);
  EXPECT_EQ(s->allocate(ProgramRules::kMaxDevices, 64 * kMiB).outcome, Outcome::pass_through);
  EXPECT_TRUE(gpus.empty()) << "no backend is started before an allocation it would serve";

  const auto a = s->allocate(0, 64 * kMiB);
  ASSERT_EQ(a.outcome, Outcome::routed);
  EXPECT_EQ(resident(0), 64 * kMiB) << "a new allocation is awake";
  EXPECT_TRUE(s->routed(a.ptr));
  EXPECT_TRUE(s->routed(static_cast<char*>(a.ptr) + 64 * kMiB - 1));
  EXPECT_FALSE(s->routed(static_cast<char*>(a.ptr) + 64 * kMiB));
  EXPECT_TRUE(s->routed(static_cast<char*>(a.ptr) - 10, 11)) << "a range that reaches into it";
  EXPECT_EQ(s->routed_bytes(), 64 * kMiB);

  int other = 0;
  EXPECT_FALSE(s->free(&other)) << "not routed: the runtime's to free";
  EXPECT_TRUE(s->free(a.ptr));
  EXPECT_FALSE(s->routed(a.ptr));
  EXPECT_EQ(resident(0), 0u);
  EXPECT_TRUE(gpus[0]->allocated.empty()) << "the backend let the memory go";
}

TEST_F(ProgramSessionTest, MemorySleepsAfterTheKeepAliveFromTheLastUseAndAUseWakesItFirst) {
  auto s = make();
  const auto a = s->allocate(0, 32 * kMiB);
  ASSERT_EQ(a.outcome, Outcome::routed);
  { const auto u = s->use(); }
  idle(*s, std::chrono::seconds(6));
  { const auto u = s->use(); }  // a use 6 s in: the keep-alive counts from here
  idle(*s, std::chrono::seconds(6));
  EXPECT_EQ(resident(0), 32 * kMiB) << "12 s after the first use, 6 s after the last: still awake";
  idle(*s, std::chrono::seconds(5));
  EXPECT_EQ(resident(0), 0u) << "11 s after the last use: asleep";
  EXPECT_TRUE(s->routed(a.ptr)) << "asleep, the allocation keeps its address";
  {
    const auto u = s->use();
    EXPECT_TRUE(u.status());
    EXPECT_EQ(resident(0), 32 * kMiB) << "awake before the launch or copy goes ahead";
  }
  // A use holds it for its whole length, however long the clock runs meanwhile.
  {
    const auto u = s->use();
    idle(*s, std::chrono::seconds(60));
    EXPECT_EQ(resident(0), 32 * kMiB);
  }
  idle(*s);
  EXPECT_EQ(resident(0), 0u);
}

TEST_F(ProgramSessionTest, UsesFromManyThreadsKeepItAwakeAndEachEndsItsOwnCall) {
  auto s = make();
  ASSERT_EQ(s->allocate(0, 8 * kMiB).outcome, Outcome::routed);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 1000; ++i) {
        const auto u = s->use();
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_FALSE(logs.contains("stray")) << "every use ended the call it began";
  idle(*s);
  EXPECT_EQ(resident(0), 0u);
}

TEST_F(ProgramSessionTest, WritesAreReportedOnlyForWeightsAndOnlyInsideThem) {
  auto s = make();
  const auto w = s->allocate(0, 8 * kMiB, Tag::weights);
  const auto k = s->allocate(0, 8 * kMiB, Tag::kv);
  const auto u = s->allocate(0, 8 * kMiB);
  ASSERT_EQ(w.outcome, Outcome::routed);
  FakeBackend& b = *gpus[0];
  EXPECT_EQ(b.tracked, (std::set<char*>{static_cast<char*>(w.ptr)})) << "only weights are tracked";
  const auto wb = reinterpret_cast<std::uintptr_t>(w.ptr);
  s->written(w.ptr, 100);
  s->written(reinterpret_cast<void*>(wb - 50), 60);             // across its start: clipped
  s->written(reinterpret_cast<void*>(wb + 8 * kMiB - 5), 100);  // across its end: clipped
  s->written(k.ptr, 4096);                                      // kv: copied whole at each sleep anyway
  s->written(u.ptr, 4096);
  const std::vector<std::pair<std::uintptr_t, std::size_t>> want{{wb, 100}, {wb, 10}, {wb + 8 * kMiB - 5, 5}};
  EXPECT_EQ(b.writes, want);
}

TEST_F(ProgramSessionTest, ATagGivenLaterCoversOnlyAllocationsWhollyInsideTheRange) {
  auto s = make();
  const auto a = s->allocate(0, 4 * kMiB);
  const auto b = s->allocate(0, 4 * kMiB);
  const auto scratch = s->allocate(0, 4 * kMiB, Tag::scratch);
  ASSERT_EQ(b.outcome, Outcome::routed);
  FakeBackend& g = *gpus[0];
  EXPECT_EQ(s->tag(a.ptr, 4 * kMiB - 1, Tag::weights), 0u) << "a range short of its end tags nothing";
  EXPECT_TRUE(g.tracked.empty());
  EXPECT_EQ(s->tag(a.ptr, 4 * kMiB, Tag::weights), 4 * kMiB);
  EXPECT_EQ(g.tracked, (std::set<char*>{static_cast<char*>(a.ptr)}));
  EXPECT_EQ(s->tag(a.ptr, 4 * kMiB, Tag::weights), 4 * kMiB) << "tagging again changes nothing";
  EXPECT_EQ(s->tag(scratch.ptr, 4 * kMiB, Tag::weights), 0u) << "scratch is dropped at sleep: never weights";
  EXPECT_EQ(s->tag(b.ptr, 4 * kMiB, Tag::kv), 4 * kMiB) << "kv is what an untagged allocation is already";
  EXPECT_EQ(g.tracked.size(), 1u);
  s->written(b.ptr, 64);
  EXPECT_TRUE(g.writes.empty());
  s->written(a.ptr, 64);
  EXPECT_EQ(g.writes.size(), 1u);
}

// A CUDA graph being captured must see no sleep and no wake (a capture forbids their copies and
// synchronizations): a capture wakes everything first and holds it to its end.
TEST_F(ProgramSessionTest, AStreamCaptureWakesEverythingFirstAndHoldsItToItsEnd) {
  auto s = make();
  ASSERT_EQ(s->allocate(0, 8 * kMiB).outcome, Outcome::routed);
  ASSERT_EQ(s->allocate(1, 8 * kMiB).outcome, Outcome::routed);
  idle(*s);
  ASSERT_EQ(resident(0) + resident(1), 0u);
  int stream_a = 0, stream_b = 0;
  s->capture_began(&stream_a);
  EXPECT_EQ(resident(0) + resident(1), 16 * kMiB) << "awake before the capture begins";
  s->capture_began(&stream_b);
  idle(*s, std::chrono::seconds(3600));
  EXPECT_EQ(resident(0) + resident(1), 16 * kMiB) << "held while captures last";
  s->capture_ended(&stream_a);
  idle(*s, std::chrono::seconds(3600));
  EXPECT_EQ(resident(0) + resident(1), 16 * kMiB) << "the other capture still holds it";
  s->capture_ended(&stream_b);
  s->capture_ended(&stream_b);  // an end without its begin changes nothing
  idle(*s);
  EXPECT_EQ(resident(0) + resident(1), 0u);
}

TEST_F(ProgramSessionTest, AnExplicitSleepAndWakeActAtOnce) {
  auto s = make(KeepAlive::forever());
  ASSERT_EQ(s->allocate(0, 16 * kMiB).outcome, Outcome::routed);
  s->sleep_now();
  EXPECT_EQ(resident(0), 0u);
  EXPECT_TRUE(s->wake_now());
  EXPECT_EQ(resident(0), 16 * kMiB);
}

TEST_F(ProgramSessionTest, StandingAsideHoldsWhatIsRoutedAwakeAndPassesNewAllocationsThrough) {
  auto s = make();
  const auto a = s->allocate(0, 16 * kMiB);
  ASSERT_EQ(a.outcome, Outcome::routed);
  idle(*s);
  ASSERT_EQ(resident(0), 0u);
  s->stand_aside("the program exports device memory over CUDA IPC (cudaIpcGetMemHandle)");
  s->stand_aside("a second reason");
  EXPECT_TRUE(s->stood_aside());
  EXPECT_EQ(resident(0), 16 * kMiB) << "woken, and held";
  idle(*s, std::chrono::seconds(3600));
  EXPECT_EQ(resident(0), 16 * kMiB);
  EXPECT_EQ(s->allocate(0, 16 * kMiB).outcome, Outcome::pass_through);
  EXPECT_TRUE(logs.contains(LogLevel::warn, "CUDA IPC (cudaIpcGetMemHandle); from now on its memory stays on the GPU"));
  EXPECT_FALSE(logs.contains("a second reason")) << "said once";
  EXPECT_TRUE(s->free(a.ptr)) << "what was routed is still freed through the backend";
}

TEST_F(ProgramSessionTest, OffAForkedChildAndABackendThatCannotStartPassThrough) {
  {
    auto s = make(KeepAlive::off());
    EXPECT_EQ(s->allocate(0, 64 * kMiB).outcome, Outcome::pass_through);
    EXPECT_TRUE(gpus.empty());
  }
  {
    auto s = make();
    s->forked();
    EXPECT_EQ(s->allocate(0, 64 * kMiB).outcome, Outcome::pass_through);
  }
  backend_fails = true;
  auto s = make();
  EXPECT_EQ(s->allocate(0, 64 * kMiB).outcome, Outcome::pass_through);
  EXPECT_EQ(s->allocate(0, 64 * kMiB).outcome, Outcome::pass_through);
  EXPECT_TRUE(logs.contains(LogLevel::warn,
                            "CUDA device 0: cuda: no NVIDIA driver here; its device memory stays the "
                            "CUDA runtime's (no sleep)"));
  const auto u = s->use();
  EXPECT_TRUE(u.status()) << "no manager: a use is a no-op";
}

TEST_F(ProgramSessionTest, AFullDeviceIsTheProgramsOutOfMemory) {
  auto s = make();
  ASSERT_EQ(s->allocate(0, 8 * kMiB).outcome, Outcome::routed);
  bool full = true;
  gpus[0]->device_full = [&] { return full; };
  EXPECT_EQ(s->allocate(0, 8 * kMiB).outcome, Outcome::out_of_memory);
  full = false;
  EXPECT_EQ(s->allocate(0, 8 * kMiB).outcome, Outcome::routed);
}

}  // namespace
}  // namespace residency::cudapreload
