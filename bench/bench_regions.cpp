// SPDX-License-Identifier: MIT
// A caching allocator's traffic: 10,000 regions registered and freed in random order, under a
// wired limit that half of them fit (so half wait, and every free of a wired region promotes
// one), and with no limit (nothing waits). Reports regions per second.
//
// The backend is a minimal one that keeps no books (the test FakeBackend sums its sets on every
// call, which would be what this measures). This file compiles against both versions of the
// Backend interface (RESIDENCY_BACKEND_INTERFACE_VERSION), so the same benchmark can be built
// against the commit before the redesign and run side by side (bench/results/ says how).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <random>
#include <vector>

#include "residency/residency.hpp"

using namespace residency;

namespace {

#ifndef RESIDENCY_BACKEND_INTERFACE_VERSION
#define RESIDENCY_BACKEND_INTERFACE_VERSION 1
#endif

// Accepts everything at no cost: what remains is the manager's own work.
class NullBackend final : public Backend {
 public:
  Capabilities capabilities() const override { return Capabilities{"null", false, Nanos(0), 0, {}, 1}; }
  MemoryInfo memory_info() override {
    MemoryInfo m;
    m.physical = 1ull << 44;
    m.recommended_working_set = 1ull << 43;
    return m;
  }
  Status create_set(SetId, std::uint64_t) override { return {}; }
  void add_region(SetId, const RegionDesc&) override {}
  void remove_region(SetId, RegionId) override {}
  SetOutcome commit(SetId) override { return {}; }
  SetOutcome request_residency(SetId) override { return {}; }
#if RESIDENCY_BACKEND_INTERFACE_VERSION >= 2
  Status destroy_set(SetId) override { return {}; }
  Status end_residency(SetId) override { return {}; }
#else
  void destroy_set(SetId) override {}
  void end_residency(SetId) override {}
#endif
};

constexpr int kRegions = 10'000;

void BM_RegisterFreeRandom(benchmark::State& state) {
  const bool limited = state.range(0) != 0;
  std::mt19937_64 rng(7);
  std::vector<std::uint64_t> sizes(kRegions);
  std::uint64_t total = 0;
  for (auto& s : sizes) total += (s = (16 + rng() % 1008) * 4096);  // 64 KiB .. 4 MiB
  std::vector<int> order(kRegions);
  for (int i = 0; i < kRegions; ++i) order[static_cast<std::size_t>(i)] = i;
  std::shuffle(order.begin(), order.end(), rng);

  for (auto _ : state) {
    state.PauseTiming();
    ManagerOptions o;
    o.config.keep_alive = KeepAlive::forever();
    o.config.log_level = LogLevel::error;
    o.config.layout = Layout::per_buffer;  // one set per block, as llama.cpp does per buffer
    if (limited) o.config.wired_limit = WiredLimit{false, total / 2, 0};
    o.backend = std::make_shared<NullBackend>();
    o.start_scheduler = false;
    auto m = Manager::create(o);
    std::vector<RegionId> ids(kRegions);
    state.ResumeTiming();
    std::uintptr_t addr = std::uintptr_t(1) << 40;
    for (int i = 0; i < kRegions; ++i) {
      auto id = (*m)->register_region(reinterpret_cast<void*>(addr), sizes[static_cast<std::size_t>(i)],
                                      RegionClass::weights, static_cast<int>(i % 4));
      ids[static_cast<std::size_t>(i)] = id ? *id : 0;
      addr += sizes[static_cast<std::size_t>(i)] + 4096;
    }
    for (int i : order) (void)(*m)->unregister_region(ids[static_cast<std::size_t>(i)]);
    state.PauseTiming();
    m = Status(ErrorCode::ok, "");
    state.ResumeTiming();
  }
  state.counters["regions_per_s"] = benchmark::Counter(static_cast<double>(kRegions) *
                                                           static_cast<double>(state.iterations()),
                                                       benchmark::Counter::kIsRate);
}
BENCHMARK(BM_RegisterFreeRandom)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->Iterations(3)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
