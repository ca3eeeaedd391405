// The decode-equivalent pass reads a model at close to the speed of memory.
//
// For each weight type, a synthetic model of a few hundred MiB is written to a temporary
// directory and read warm (page-cache resident). Each iteration times a plain multithreaded sum
// over exactly the same bytes (the bandwidth the machine gives a reader that does nothing else)
// and one decode pass, in alternating order so neither always runs first. The counters report
// both bandwidths and their ratio, measured in the same run: the pass is good enough for the idle
// benchmark when decode / sum >= 0.80, i.e. when a decode's time is the time to read the model.
//
//   bench_decode [--benchmark_min_time=2]     RESIDENCY_BENCH_MODEL_MIB=256 (default)
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "workload/cleanup.hpp"
#include "workload/decode_pass.hpp"
#include "workload/gguf.hpp"
#include "workload/gguf_writer.hpp"

namespace {

using namespace residency::workload;

// Large enough to be far beyond every CPU cache (so it measures memory, not cache), small enough
// to write in seconds and to keep four models in the page cache of a small machine.
constexpr std::uint64_t kDefaultModelMiB = 256;
// The pass must reach this fraction of the plain sum's bandwidth (issue 3).
constexpr double kRequiredRatio = 0.80;

struct Fixture {
  std::optional<GgufFile> file;
  std::unique_ptr<DecodePass> pass;
};

struct Outcome {
  double decode_gbps = 0, sum_gbps = 0, ratio = 0;
  std::uint64_t bytes = 0;
};
std::map<std::string, Outcome> g_outcomes;

void decode_vs_sum(benchmark::State& state, Fixture* fx, const std::string& type) {
  DecodePass& pass = *fx->pass;
  benchmark::DoNotOptimize(pass.run());  // warm: page tables, caches, threads
  benchmark::DoNotOptimize(pass.plain_sum());
  double decode_s = 0, sum_s = 0;
  std::uint64_t n = 0;
  using clock = std::chrono::steady_clock;
  for (auto _ : state) {
    auto time_sum = [&] {
      const auto t0 = clock::now();
      benchmark::DoNotOptimize(pass.plain_sum());
      sum_s += std::chrono::duration<double>(clock::now() - t0).count();
    };
    double d = 0;
    auto time_decode = [&] {
      const auto t0 = clock::now();
      benchmark::DoNotOptimize(pass.run());
      d = std::chrono::duration<double>(clock::now() - t0).count();
      decode_s += d;
    };
    if (n++ % 2 == 0) {
      time_sum();
      time_decode();
    } else {
      time_decode();
      time_sum();
    }
    state.SetIterationTime(d);
  }
  const double bytes = static_cast<double>(pass.bytes()) * static_cast<double>(n);
  Outcome o{bytes / decode_s / 1e9, bytes / sum_s / 1e9, sum_s / decode_s, pass.bytes()};
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes));
  state.counters["decode_GBps"] = o.decode_gbps;
  state.counters["sum_GBps"] = o.sum_gbps;
  state.counters["ratio"] = o.ratio;
  state.counters["threads"] = pass.threads();
  g_outcomes[type] = o;
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  std::uint64_t mib = kDefaultModelMiB;
  if (const char* env = std::getenv("RESIDENCY_BENCH_MODEL_MIB")) mib = std::strtoull(env, nullptr, 10);
  const char* tmp = std::getenv("TMPDIR");
  residency::workload::CleanupRegistry::install_signal_handlers();
  auto dir = TempDir::create(tmp && *tmp ? tmp : "/var/tmp", "residency-bench-decode-");
  if (!dir) {
    std::fprintf(stderr, "bench_decode: %s\n", dir.message().c_str());
    return 1;
  }
  std::map<std::string, Fixture> fixtures;
  for (GgmlType type : {GgmlType::f32, GgmlType::f16, GgmlType::bf16, GgmlType::q8_0}) {
    const std::string name(ggml_type_name(type));
    auto shape = plan_llama_shape(mib << 20, type);
    if (!shape) {
      std::fprintf(stderr, "bench_decode: %s\n", shape.message().c_str());
      return 1;
    }
    const std::string path = dir->track(name + ".gguf");
    if (auto st = write_synthetic_model(path, *shape); !st) {
      std::fprintf(stderr, "bench_decode: %s\n", st.message().c_str());
      return 1;
    }
    auto file = GgufFile::open(path);
    if (!file) {
      std::fprintf(stderr, "bench_decode: %s\n", file.message().c_str());
      return 1;
    }
    Fixture& fx = fixtures[name];
    fx.file.emplace(std::move(file).value());
    auto pass = DecodePass::create(fx.file->model(), fx.file->data());
    if (!pass) {
      std::fprintf(stderr, "bench_decode: %s\n", pass.message().c_str());
      return 1;
    }
    fx.pass = std::move(pass).value();
    benchmark::RegisterBenchmark(("decode_vs_plain_sum/" + name).c_str(), decode_vs_sum, &fx, name)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  bool all_ok = true;
  std::printf("\ndecode pass vs plain sum over the same bytes (%llu MiB models, warm, %s kernels):\n",
              static_cast<unsigned long long>(mib), fixtures.begin()->second.pass ?
              std::string(to_string(fixtures.begin()->second.pass->isa())).c_str() : "?");
  for (const auto& [type, o] : g_outcomes) {
    const bool ok = o.ratio >= kRequiredRatio;
    all_ok = all_ok && ok;
    std::printf("  %-5s decode %6.2f GB/s, plain sum %6.2f GB/s, ratio %.2f (>= %.2f: %s)\n", type.c_str(), o.decode_gbps,
                o.sum_gbps, o.ratio, kRequiredRatio, ok ? "yes" : "NO");
  }
  return all_ok ? 0 : 1;
}
