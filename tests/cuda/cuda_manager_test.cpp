// SPDX-License-Identifier: MIT
// The Manager over the cuda backend: device memory allocated through the manager sleeps
// when the keep-alive expires (ManualClock + run_due, no sleeping in tests), touch() wakes
// it at the same address with its contents, a use scope under keep-alive 0 releases after
// the caller's synchronize, and destroying the manager while asleep frees everything.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cuda_test_support.hpp"
#include "residency/residency.hpp"

namespace residency::cuda::testing {
namespace {

class CudaManagerTest : public CudaTest {
 protected:
  std::unique_ptr<Manager> make_manager(std::shared_ptr<CudaBackend> b, KeepAlive ka,
                                        std::optional<SharedBudget> budget = std::nullopt) {
    ManagerOptions o;
    o.config.keep_alive = ka;
    o.config.shared_budget = std::move(budget);
    o.config.budget_wait.reset();  // `over`: the mode whose wakes are paced (a strict wake is not)
    o.config.state_file = false;
    o.config.log_level = LogLevel::info;
    o.backend = std::move(b);
    o.clock = &clock_;
    o.start_scheduler = false;
    o.log = [this](LogLevel, std::string_view msg) {
      std::lock_guard<std::mutex> g(log_mu_);
      log_.emplace_back(msg);
    };
    auto m = Manager::create(std::move(o));
    EXPECT_TRUE(m) << m.message();
    return m ? std::move(m.value()) : nullptr;
  }
  bool logged(const std::string& needle) {
    std::lock_guard<std::mutex> g(log_mu_);
    for (const auto& l : log_)
      if (l.find(needle) != std::string::npos) return true;
    return false;
  }

  ManualClock clock_;
  std::mutex log_mu_;
  std::vector<std::string> log_;
};

TEST_F(CudaManagerTest, KeepAliveExpiryReleasesAndTouchRewiresAtTheSameAddress) {
  auto m = make_manager(backend_, KeepAlive::after(std::chrono::seconds(10)));
  ASSERT_TRUE(m);
  constexpr std::size_t kSize = 2 * kGiB + 3;
  auto a = m->allocate(kSize, RegionClass::weights);
  ASSERT_TRUE(a) << a.message();
  ASSERT_TRUE(kernels_->fill(dptr(a->ptr), kSize, 51));
  sync();
  m->touch();
  EXPECT_TRUE(m->stats().resident);
  EXPECT_TRUE(backend_->is_resident(a->ptr));

  clock_.advance(std::chrono::seconds(9));
  m->run_due();
  EXPECT_TRUE(backend_->is_resident(a->ptr)) << "released before the keep-alive expired";

  clock_.advance(std::chrono::seconds(2));
  const auto next = m->run_due();
  EXPECT_FALSE(next.has_value()) << "nothing should be scheduled while idle";
  EXPECT_FALSE(backend_->is_resident(a->ptr));
  EXPECT_EQ(m->stats().releases, 1u);
  EXPECT_EQ(backend_->resident_bytes(), 0u);
  EXPECT_TRUE(logged("keep-alive 10 s expired")) << "the release should be logged with its reason";

  m->touch();  // the engine computes again
  EXPECT_TRUE(backend_->is_resident(a->ptr));
  EXPECT_EQ(m->stats().rewires, 1u);
  EXPECT_EQ(mismatches(a->ptr, kSize, 51), 0u) << "contents lost across the keep-alive release";
  EXPECT_TRUE(m->unregister_region(a->id));
  EXPECT_EQ(backend_->allocated_bytes(), 0u);
}

// Issue 29 item 4: a request that comes while the keep-alive's sleep is copying stops the sleep;
// the device memory, still mapped, stays, and the request does not wait for the rest of the sleep
// nor for a wake. Timed on the GPU (printed, not asserted); asserted: what the GPU holds, and that
// no byte was copied back to it.
TEST_F(CudaManagerTest, ARequestDuringASleepStopsItAndFindsItsMemoryInPlace) {
  auto m = make_manager(backend_, KeepAlive::after(std::chrono::seconds(10)));
  ASSERT_TRUE(m);
  constexpr std::size_t kSize = 8 * kGiB;
  auto a = m->allocate(kSize, RegionClass::weights);
  ASSERT_TRUE(a) << a.message();
  ASSERT_TRUE(kernels_->fill(dptr(a->ptr), kSize, 71));
  sync();
  ASSERT_TRUE(backend_->prepare_backup(a->ptr));  // the sleeps below only copy
  m->touch();
  using Clock = std::chrono::steady_clock;
  // A whole sleep and wake, and a touch while awake, for reference.
  clock_.advance(std::chrono::seconds(11));
  auto t0 = Clock::now();
  m->run_due();
  const double sleep_s = seconds_since(t0);
  ASSERT_FALSE(backend_->is_resident(a->ptr));
  t0 = Clock::now();
  m->touch();
  const double wake_s = seconds_since(t0);
  ASSERT_TRUE(backend_->is_resident(a->ptr));
  t0 = Clock::now();
  m->touch();
  const double awake_s = seconds_since(t0);

  // The race: the sleep runs on another thread; the request comes a third of the way into it.
  const std::uint64_t to_device = backend_->bytes_copied_to_device();
  const std::uint64_t to_host = backend_->bytes_copied_to_host();
  clock_.advance(std::chrono::seconds(11));
  std::thread sleeper([&] { m->run_due(); });
  std::this_thread::sleep_for(std::chrono::duration<double>(sleep_s / 3));
  t0 = Clock::now();
  m->touch();
  const double during_s = seconds_since(t0);
  sleeper.join();
  EXPECT_TRUE(backend_->is_resident(a->ptr));
  EXPECT_EQ(backend_->bytes_copied_to_device(), to_device) << "no wake: the memory never left the GPU";
  EXPECT_LT(backend_->bytes_copied_to_host() - to_host, kSize) << "the sleep's copy stopped part-way";
  EXPECT_TRUE(logged("release stopped")) << "the stopped sleep should be said";
  EXPECT_EQ(mismatches(a->ptr, kSize, 71), 0u);
  std::printf(
      "8 GiB: sleep %.1f ms, wake %.1f ms, a touch while awake %.3f ms; a request %.1f ms into a sleep "
      "waited %.1f ms (%.1f MiB had been copied)\n",
      sleep_s * 1e3, wake_s * 1e3, awake_s * 1e3, sleep_s / 3 * 1e3, during_s * 1e3,
      double(backend_->bytes_copied_to_host() - to_host) / kMiB);

  // The keep-alive releases after that use as always, and the next sleep copies everything again.
  clock_.advance(std::chrono::seconds(11));
  m->run_due();
  EXPECT_FALSE(backend_->is_resident(a->ptr));
  m->touch();
  EXPECT_EQ(mismatches(a->ptr, kSize, 71), 0u);
  EXPECT_TRUE(m->unregister_region(a->id));
}

// Issue 29 item 2: a switch under a GPU budget overlaps the asked holder's release with the
// waker's wake. Two managers, each with its own backend and slot in one ledger (as two servers),
// share a budget of one and a half models: b wakes its first half in the room while a, asked,
// sleeps; the device never holds more than the budget (cuMemGetInfo sampled all along), and both
// models come back intact. Timed against a's sleep and b's wake alone.
TEST_F(CudaManagerTest, ASwitchUnderAGpuBudgetWakesInTheRoomWhileTheAskedHolderSleeps) {
  constexpr std::size_t kSize = 4 * kGiB;
  auto second = CudaBackend::create({});
  ASSERT_TRUE(second) << second.message();
  std::shared_ptr<CudaBackend> other = std::move(second.value());
  const SharedBudget budget{"cuda-switch-" + std::to_string(::getpid()), WiredLimit{false, kSize + kSize / 2, 0}, ""};
  auto ma = make_manager(backend_, KeepAlive::after(std::chrono::seconds(10)), budget);
  auto mb = make_manager(other, KeepAlive::after(std::chrono::seconds(10)), budget);
  ASSERT_TRUE(ma && mb);
  const std::uint64_t free0 = device_free();
  using Clock = std::chrono::steady_clock;

  auto b = mb->allocate(kSize, RegionClass::weights);
  ASSERT_TRUE(b) << b.message();
  ASSERT_TRUE(kernels_->fill(dptr(b->ptr), kSize, 81));
  sync();
  ASSERT_TRUE(other->prepare_backup(b->ptr));  // the sleeps below only copy
  mb->release_now();
  ASSERT_FALSE(other->is_resident(b->ptr));
  auto a = ma->allocate(kSize, RegionClass::weights);
  ASSERT_TRUE(a) << a.message();
  ASSERT_TRUE(kernels_->fill(dptr(a->ptr), kSize, 82));
  sync();
  ASSERT_TRUE(backend_->prepare_backup(a->ptr));
  // For reference: a's sleep and b's wake, each alone.
  auto t0 = Clock::now();
  ma->release_now();
  const double sleep_s = seconds_since(t0);
  t0 = Clock::now();
  mb->touch();
  const double wake_s = seconds_since(t0);
  ASSERT_TRUE(other->is_resident(b->ptr));
  mb->release_now();
  ma->touch();
  ASSERT_TRUE(backend_->is_resident(a->ptr));
  ASSERT_FALSE(other->is_resident(b->ptr));

  const std::uint64_t a_held = ma->stats().shared_held;  // a's 4 GiB and the process's context
  // The switch, with the device's memory sampled throughout.
  std::atomic<bool> sampling{true};
  std::atomic<std::uint64_t> most{0};
  std::thread sampler([&] {
    while (sampling.load()) {
      const std::uint64_t f = device_free();
      if (f < free0) most.store(std::max(most.load(), free0 - f));
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  clock_.advance(std::chrono::milliseconds(10));
  t0 = Clock::now();
  mb->touch();
  const double switch_s = seconds_since(t0);
  sampling.store(false);
  sampler.join();
  EXPECT_TRUE(other->is_resident(b->ptr));
  EXPECT_FALSE(backend_->is_resident(a->ptr)) << "a was asked and slept";
  // The room: the budget less a's 4 GiB and the process's context, which a (the first backend of
  // the device) carries in the ledger.
  EXPECT_TRUE(logged("in the budget's room while the holders asked made the rest"));
  EXPECT_FALSE(logged("over it")) << "nothing woke over the budget";
  EXPECT_LE(most.load(), kSize + kSize / 2 + 64 * kMiB) << "the device held more than the budget";
  EXPECT_EQ(mismatches(b->ptr, kSize, 81), 0u);
  std::printf(
      "4 GiB under a budget of 6 GiB: a's sleep alone %.1f ms, b's wake alone %.1f ms; the switch (b's "
      "request while a held the device) %.1f ms, %.2fx the two in a row; the device held at most %.1f MiB; "
      "a held %.1f MiB of the budget awake (its 4096 MiB and the process's context)\n",
      sleep_s * 1e3, wake_s * 1e3, switch_s * 1e3, switch_s / (sleep_s + wake_s), double(most.load()) / kMiB,
      double(a_held) / kMiB);
  clock_.advance(std::chrono::milliseconds(10));
  ma->touch();  // and back
  EXPECT_FALSE(other->is_resident(b->ptr));
  EXPECT_EQ(mismatches(a->ptr, kSize, 82), 0u);
  EXPECT_TRUE(mb->unregister_region(b->id));
  EXPECT_TRUE(ma->unregister_region(a->id));
}

TEST_F(CudaManagerTest, KeepAliveZeroReleasesAfterTheScopesSynchronize) {
  auto m = make_manager(backend_, KeepAlive::zero());
  ASSERT_TRUE(m);
  constexpr std::size_t kSize = kGiB;
  auto w = m->allocate(kSize, RegionClass::weights);
  auto kv = m->allocate(kSize, RegionClass::kv_cache);
  ASSERT_TRUE(w && kv);
  bool synchronized = false;
  {
    auto scope = m->use([&] {
      sync();
      synchronized = true;
    });
    ASSERT_TRUE(scope.status()) << scope.status().message();
    EXPECT_TRUE(backend_->is_resident(w->ptr));
    // A long kernel still running when the scope ends: the scope's synchronize waits for it.
    ASSERT_TRUE(kernels_->wait_then_fill(dptr(w->ptr), kSize, 61, 200'000'000));
  }
  EXPECT_TRUE(synchronized);
  EXPECT_FALSE(backend_->is_resident(w->ptr));
  EXPECT_FALSE(backend_->is_resident(kv->ptr));
  EXPECT_EQ(backend_->host_backup(kv->ptr), nullptr) << "kv_cache must be discarded, not copied";
  {
    auto scope = m->use([&] { sync(); });
    EXPECT_TRUE(backend_->is_resident(w->ptr));
    EXPECT_EQ(mismatches(w->ptr, kSize, 61), 0u);
  }
}

TEST_F(CudaManagerTest, DestroyingTheManagerWhileAsleepFreesEverything) {
  const std::uint64_t free_before = device_free();
  {
    auto made = CudaBackend::create({});
    ASSERT_TRUE(made) << made.message();
    std::shared_ptr<CudaBackend> b = std::move(made.value());
    auto m = make_manager(b, KeepAlive::after(std::chrono::seconds(180)));
    ASSERT_TRUE(m);
    auto w = m->allocate(3 * kGiB, RegionClass::weights);
    auto s = m->allocate(kGiB, RegionClass::scratch);
    ASSERT_TRUE(w && s);
    m->release_now();
    EXPECT_FALSE(b->is_resident(w->ptr));
    EXPECT_NE(b->host_backup(w->ptr), nullptr);
    EXPECT_GE(device_free() + 64 * kMiB, free_before) << "asleep: the device memory is given back";
    m.reset();  // leftover regions are reported, released and freed; no abort
    EXPECT_TRUE(logged("still registered at teardown"));
    EXPECT_EQ(b->allocated_bytes(), 0u) << "the manager should free what it allocated";
  }
  EXPECT_GE(device_free() + 64 * kMiB, free_before) << "device memory leaked";
}

}  // namespace
}  // namespace residency::cuda::testing
