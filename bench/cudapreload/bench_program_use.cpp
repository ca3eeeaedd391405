// SPDX-License-Identifier: MIT
// What the CUDA preload adds to each launch, copy or memset of a program whose device memory is
// awake: ProgramSession::use() (a manager call opened and closed on each device with a manager),
// against the manager's own begin_call() + end_call() (BM_BaselineCall) measured in the same run.
// The fake backend stands for the GPU: nothing here reaches a backend while resident.
//   BM_Use/devices:1|2     one use with one or two devices' managers started
//   BM_BaselineCall        one manager's begin_call() + end_call()
#include <benchmark/benchmark.h>

#include <memory>

#include "cudapreload/program_session.hpp"
#include "support/fake_backend.hpp"

using namespace residency;
using residency::cudapreload::ProgramSession;
using residency::testing::FakeBackend;

namespace {

std::unique_ptr<ProgramSession> make_session(int devices) {
  ProgramSession::Options o;
  o.config.keep_alive = KeepAlive::after(std::chrono::minutes(5));
  o.config.log_level = LogLevel::error;
  o.backends = [](int, const Config&) -> Result<std::shared_ptr<Backend>> {
    return std::shared_ptr<Backend>(std::make_shared<FakeBackend>());
  };
  o.clock = &SteadyClock::instance();
  o.start_schedulers = false;
  auto s = std::make_unique<ProgramSession>(std::move(o));
  for (int d = 0; d < devices; ++d) (void)s->allocate(d, std::size_t{64} << 20);
  return s;
}

void BM_Use(benchmark::State& state) {
  static std::unique_ptr<ProgramSession> s;
  if (state.thread_index() == 0) s = make_session(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    const auto u = s->use();
    benchmark::DoNotOptimize(&u);
  }
}
BENCHMARK(BM_Use)->Arg(1)->Arg(2)->ArgName("devices")->ThreadRange(1, 2);

void BM_BaselineCall(benchmark::State& state) {
  static std::unique_ptr<ProgramSession> s;
  if (state.thread_index() == 0) s = make_session(1);
  Manager* m = s->manager(0);
  for (auto _ : state) {
    m->begin_call();
    m->end_call();
  }
}
BENCHMARK(BM_BaselineCall)->ThreadRange(1, 2);

}  // namespace

BENCHMARK_MAIN();
