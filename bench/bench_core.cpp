// SPDX-License-Identifier: MIT
// Core microbenchmarks. Each reports against a baseline measured in the same run:
//   BM_Touch, BM_TouchRegion   touch() and touch(id) on the hot path (target < 10 ns), next to
//   BM_BaselineClockRead       one steady_clock read, the floor of a precisely stamped touch, and
//   BM_BaselineTouchBefore     the hot path this library had until 2026-12-01 (c1b06cb): a
//                              steady_clock read and a sequentially consistent store and load.
//   BM_RegisterUnregister      register + unregister of one region (fake backend: core cost).
//   BM_Commits/batched:0|1     64 registrations, one commit per allocation (MLX) vs one per
//                              touched set per batch; counters report commits per 64 regions.
//   BM_IdleWakeups             what one idle second costs: our scheduler after expiry vs
//                              llama.cpp's heartbeat pattern (a loop sleeping 5 ms), in
//                              wake-ups, context switches and CPU time, scaled per hour.
#include <benchmark/benchmark.h>
#include <sys/resource.h>

#include <atomic>
#include <thread>

#include "residency/residency.hpp"
#include "support/fake_backend.hpp"

using namespace residency;
using residency::testing::FakeBackend;

namespace {

std::unique_ptr<Manager> make_manager(std::shared_ptr<Backend> b, Config c = {}, bool scheduler = false) {
  ManagerOptions o;
  o.config = c;
  o.config.log_level = LogLevel::error;
  o.backend = std::move(b);
  o.start_scheduler = scheduler;
  auto m = Manager::create(std::move(o));
  if (!m) return nullptr;
  return std::move(*m);
}

void BM_BaselineClockRead(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(std::chrono::steady_clock::now());
}
BENCHMARK(BM_BaselineClockRead)->ThreadRange(1, 2);

// The floor of touch(): the coarse clock it stamps uses with (CLOCK_MONOTONIC_COARSE).
void BM_BaselineCoarseClockRead(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(SteadyClock::instance().now_coarse());
}
BENCHMARK(BM_BaselineCoarseClockRead)->ThreadRange(1, 2);

// The earlier touch(), reproduced: last_use.store(now) then fast.load(), both seq_cst.
void BM_BaselineTouchBefore(benchmark::State& state) {
  static std::atomic<std::int64_t> last_use{0};
  static std::atomic<bool> fast{true};
  for (auto _ : state) {
    last_use.store(std::chrono::steady_clock::now().time_since_epoch().count());
    if (!fast.load()) benchmark::DoNotOptimize(last_use);
  }
}
BENCHMARK(BM_BaselineTouchBefore)->ThreadRange(1, 2);

// A manager with one resident 64 MiB region, shared by a benchmark's threads: thread 0 makes it
// before the timed loop, which every thread enters together.
struct ResidentManager {
  std::unique_ptr<Manager> m;
  std::shared_ptr<FakeBackend> fake;
  RegionId id = 0;
  void set_up(const benchmark::State& state) {
    if (state.thread_index() != 0) return;
    fake = std::make_shared<FakeBackend>();
    m = make_manager(fake);
    auto r = m->register_region(reinterpret_cast<void*>(std::uintptr_t(1) << 40), 64 << 20);
    id = r ? *r : 0;
  }
  void count_backend_calls(benchmark::State& state) const {
    if (state.thread_index() == 0) state.counters["backend_calls"] = fake->total_requests;
  }
};

void BM_TouchRegion(benchmark::State& state) {
  static ResidentManager r;
  r.set_up(state);
  for (auto _ : state) r.m->touch(r.id);
}
BENCHMARK(BM_TouchRegion)->ThreadRange(1, 2);

void BM_Touch(benchmark::State& state) {
  static ResidentManager r;
  r.set_up(state);
  for (auto _ : state) r.m->touch();
  r.count_backend_calls(state);
}
BENCHMARK(BM_Touch)->ThreadRange(1, 2)->Teardown([](const benchmark::State&) {});

// One engine call (what the preload does around each llama_decode): begin_call() + end_call()
// while resident, against two touch() (what it did before the call entry): the difference is the
// count of calls in flight, one atomic add and one compare-exchange.
void BM_Call(benchmark::State& state) {
  static ResidentManager r;
  r.set_up(state);
  for (auto _ : state) {
    r.m->begin_call();
    r.m->end_call();
  }
  r.count_backend_calls(state);
}
BENCHMARK(BM_Call)->ThreadRange(1, 2);

void BM_BaselineTwoTouches(benchmark::State& state) {
  static ResidentManager r;
  r.set_up(state);
  for (auto _ : state) {
    r.m->touch();
    r.m->touch();
  }
}
BENCHMARK(BM_BaselineTwoTouches)->ThreadRange(1, 2);

void BM_RegisterUnregister(benchmark::State& state) {
  auto fake = std::make_shared<FakeBackend>();
  fake->physical = 1ull << 40;
  fake->recommended = 1ull << 39;
  auto m = make_manager(fake);
  std::uintptr_t addr = std::uintptr_t(1) << 40;
  for (auto _ : state) {
    auto id = m->register_region(reinterpret_cast<void*>(addr), 1 << 20);
    (void)m->unregister_region(*id);
    addr += 2 << 20;
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_RegisterUnregister);

void BM_Commits(benchmark::State& state) {
  const bool batched = state.range(0) != 0;
  std::uint64_t commits = 0;
  for (auto _ : state) {
    state.PauseTiming();
    auto fake = std::make_shared<FakeBackend>();
    fake->recommended = 16ull << 30;  // 5% = 819 MiB sets: 64 x 16 MiB fit in 2
    fake->physical = 64ull << 30;
    auto m = make_manager(fake);
    std::uintptr_t addr = std::uintptr_t(1) << 40;
    state.ResumeTiming();
    {
      std::optional<Batch> b;
      if (batched) b.emplace(m->batch());
      for (int i = 0; i < 64; ++i) {
        (void)m->register_region(reinterpret_cast<void*>(addr), 16 << 20);
        addr += 17 << 20;
      }
    }
    commits += m->stats().commits;
    state.PauseTiming();
    m.reset();
    state.ResumeTiming();
  }
  state.counters["commits_per_64_regions"] = benchmark::Counter(static_cast<double>(commits) /
                                                                static_cast<double>(state.iterations()));
}
BENCHMARK(BM_Commits)->Arg(0)->Arg(1)->ArgName("batched");

struct Usage {
  double cpu_s;
  long csw;
};
Usage thread_usage() {
  rusage ru{};
  getrusage(RUSAGE_THREAD, &ru);
  return {static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
              static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6,
          ru.ru_nvcsw + ru.ru_nivcsw};
}

// arg 0: our scheduler after its keep-alive expired; arg 1: a 5 ms polling heartbeat.
void BM_IdleWakeups(benchmark::State& state) {
  const bool polling = state.range(0) != 0;
  constexpr auto kWindow = std::chrono::seconds(2);
  for (auto _ : state) {
    std::atomic<bool> stop{false};
    std::atomic<std::uint64_t> wakeups{0};
    Usage used{};
    std::unique_ptr<Manager> m;
    std::thread heartbeat;
    if (polling) {
      heartbeat = std::thread([&] {
        const Usage u0 = thread_usage();
        while (!stop.load()) {  // llama.cpp's loop: the sleep is outside the keep-alive check
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
          wakeups.fetch_add(1);
        }
        const Usage u1 = thread_usage();
        used = {u1.cpu_s - u0.cpu_s, u1.csw - u0.csw};
      });
      std::this_thread::sleep_for(kWindow);
      stop = true;
      heartbeat.join();
    } else {
      auto fake = std::make_shared<FakeBackend>();
      Config c;
      c.keep_alive = KeepAlive::after(std::chrono::milliseconds(50));
      m = make_manager(fake, c, /*scheduler=*/true);
      (void)m->register_region(reinterpret_cast<void*>(std::uintptr_t(1) << 40), 1 << 20);
      while (m->stats().releases == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      const std::uint64_t w0 = m->stats().scheduler_wakeups;
      const rusage r0 = [] {
        rusage r{};
        getrusage(RUSAGE_SELF, &r);
        return r;
      }();
      std::this_thread::sleep_for(kWindow);
      const rusage r1 = [] {
        rusage r{};
        getrusage(RUSAGE_SELF, &r);
        return r;
      }();
      wakeups = m->stats().scheduler_wakeups - w0;
      // The whole process, this sleeping thread included: an upper bound for the scheduler.
      used.cpu_s =
          static_cast<double>(r1.ru_utime.tv_sec - r0.ru_utime.tv_sec + r1.ru_stime.tv_sec - r0.ru_stime.tv_sec) +
          static_cast<double>(r1.ru_utime.tv_usec - r0.ru_utime.tv_usec + r1.ru_stime.tv_usec - r0.ru_stime.tv_usec) / 1e6;
      used.csw = (r1.ru_nvcsw - r0.ru_nvcsw) + (r1.ru_nivcsw - r0.ru_nivcsw) - 1;  // minus our own sleep
      if (used.csw < 0) used.csw = 0;
    }
    const double per_hour = 3600.0 / std::chrono::duration<double>(kWindow).count();
    state.counters["wakeups_per_hour"] = static_cast<double>(wakeups.load()) * per_hour;
    state.counters["ctx_switches_per_hour"] = static_cast<double>(used.csw) * per_hour;
    state.counters["cpu_ms_per_hour"] = used.cpu_s * 1e3 * per_hour;
  }
}
BENCHMARK(BM_IdleWakeups)->Arg(0)->Arg(1)->ArgName("llama_cpp_polling")->Iterations(1)->Unit(benchmark::kSecond);

}  // namespace

BENCHMARK_MAIN();
