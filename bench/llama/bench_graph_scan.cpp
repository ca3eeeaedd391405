// SPDX-License-Identifier: MIT
// What the preload's scan of a graph's writes costs per graph compute (src/preload/graph_writes.hpp).
//
// Once a process has device weights whose writes are tracked (issue 29: a sleep copies only what
// changed), every ggml graph compute the preload sees first walks the graph's nodes and reports
// each node's bytes to the session, which compares them with the tracked ranges. This measures
// that walk on ggml graphs shaped like a llama decode (per layer: norms, the seven weight
// products, attention over a KV cache view, the feed-forward; 29 nodes, 7 of them views), through
// the same report_graph_writes() the hooks call and a real EngineSession over fake devices:
//   BM_BaselineGraphWalk  the walk alone (each node's bytes summed, no session): the baseline
//   BM_GraphScan          the walk reporting to the session, 1 or 8 tracked ranges (8 is the most)
//   BM_GraphScanEachNodeAsked  the same, each node handed to EngineSession::device_written (which
//                         reads the tracked ranges each time): the hooks' way before 2026-12-04
// Counters: nodes per graph and ns per node. Compare with a decode step's time on the GPU
// (docs/measurements.md); the graph is built once, as llama.cpp reuses its graphs' shape.
#include <benchmark/benchmark.h>
#include <ggml.h>

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "preload/engine_session.hpp"
#include "preload/ggml_api.hpp"
#include "preload/graph_writes.hpp"
#include "residency/clock.hpp"
#include "support/fake_backend.hpp"

namespace {

using residency::preload::EngineSession;
using residency::preload::GgmlApi;

// A decode graph of `layers` layers over tiny tensors (the walk reads each node's header, never
// its data, so the tensors' sizes do not matter; their number and kinds do).
struct DecodeGraph {
  ggml_context* ctx = nullptr;
  ggml_cgraph* graph = nullptr;
  explicit DecodeGraph(int layers) {
    ggml_init_params p{};
    p.mem_size = static_cast<std::size_t>(layers + 4) * 64 * 1024 + ggml_graph_overhead_custom(8192, false);
    p.no_alloc = false;
    ctx = ggml_init(p);
    const int64_t n = 8;  // embedding width; 2 heads of 4
    auto w = [&](int64_t a, int64_t b) { return ggml_new_tensor_2d(ctx, GGML_TYPE_F32, a, b); };
    ggml_tensor* x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n, 1);
    ggml_tensor* kv = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 2 * n * layers);
    graph = ggml_new_graph_custom(ctx, 8192, false);
    for (int l = 0; l < layers; ++l) {
      ggml_tensor* cur = ggml_mul(ctx, ggml_rms_norm(ctx, x, 1e-5f), w(n, 1));
      ggml_tensor* q = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, w(n, n), cur), 4, 2, 1);
      ggml_tensor* k = ggml_mul_mat(ctx, w(n, n), cur);
      ggml_tensor* v = ggml_mul_mat(ctx, w(n, n), cur);
      // The new key and value go into the cache (a view of it: llama.cpp's ggml_set_rows / cpy).
      ggml_tensor* k_cache = ggml_cpy(ctx, k,
                                      ggml_view_1d(ctx, kv, n, static_cast<std::size_t>(2 * l) * n * sizeof(float)));
      ggml_tensor* v_cache = ggml_cpy(ctx, v,
                                      ggml_view_1d(ctx, kv, n, static_cast<std::size_t>(2 * l + 1) * n * sizeof(float)));
      ggml_tensor* kq = ggml_soft_max(ctx, ggml_mul_mat(ctx, ggml_reshape_3d(ctx, k_cache, 4, 2, 1), q));
      ggml_tensor* kqv = ggml_mul_mat(ctx, ggml_cont(ctx, ggml_transpose(ctx, ggml_reshape_2d(ctx, v_cache, 4, 2))), kq);
      ggml_tensor* attn = ggml_mul_mat(ctx, w(n, n), ggml_reshape_2d(ctx, ggml_cont(ctx, kqv), n, 1));
      x = ggml_add(ctx, x, attn);
      cur = ggml_mul(ctx, ggml_rms_norm(ctx, x, 1e-5f), w(n, 1));
      ggml_tensor* gate = ggml_silu(ctx, ggml_mul_mat(ctx, w(n, 2 * n), cur));
      ggml_tensor* up = ggml_mul_mat(ctx, w(n, 2 * n), cur);
      x = ggml_add(ctx, x, ggml_mul_mat(ctx, w(2 * n, n), ggml_mul(ctx, gate, up)));
    }
    ggml_build_forward_expand(graph, ggml_mul_mat(ctx, w(n, 32), ggml_rms_norm(ctx, x, 1e-5f)));
  }
  ~DecodeGraph() { ggml_free(ctx); }
  DecodeGraph(const DecodeGraph&) = delete;
  DecodeGraph& operator=(const DecodeGraph&) = delete;
};

GgmlApi api() {
  GgmlApi a;
  a.nbytes = &ggml_nbytes;
  a.graph_n_nodes = &ggml_graph_n_nodes;
  a.graph_node = &ggml_graph_node;
  return a;
}

void counters(benchmark::State& state, const DecodeGraph& g) {
  const int nodes = ggml_graph_n_nodes(g.graph);
  state.counters["nodes"] = nodes;
  state.counters["ns_per_node"] = benchmark::Counter(static_cast<double>(state.iterations()) * nodes,
                                                     benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

void BM_BaselineGraphWalk(benchmark::State& state) {
  DecodeGraph g(static_cast<int>(state.range(0)));
  const GgmlApi a = api();
  std::uintptr_t sum = 0;
  for (auto _ : state) {
    residency::preload::graph_writes(a, g.graph, [&](std::uintptr_t b, std::uintptr_t e) { sum += e - b; });
    benchmark::DoNotOptimize(sum);
  }
  counters(state, g);
}
BENCHMARK(BM_BaselineGraphWalk)->ArgName("layers")->Arg(32)->Arg(80);

// A session with `tracked` device weights ranges (fake device 0), none of them a node's: what a
// llama-server with its model on the GPU has. `each_node`: every node asked of the session.
void graph_scan(benchmark::State& state, bool each_node) {
  DecodeGraph g(static_cast<int>(state.range(0)));
  const GgmlApi a = api();
  residency::ManualClock clock;
  auto gpu = std::make_shared<residency::testing::FakeBackend>();
  EngineSession::Options o;
  o.config.keep_alive.kind = residency::KeepAlive::Kind::forever;
  o.config.release_on_pressure = false;
  o.backends = [&](int, const residency::Config&) -> residency::Result<std::shared_ptr<residency::Backend>> {
    return std::shared_ptr<residency::Backend>(gpu);
  };
  o.clock = &clock;
  o.log = [](residency::LogLevel, std::string_view) {};
  o.start_schedulers = false;
  o.engine_memory = false;
  EngineSession s(std::move(o));
  std::vector<void*> weights;
  for (int i = 0; i < state.range(1); ++i) {
    const auto d = s.device_allocate(0, std::size_t{2} << 20, false);
    if (d.outcome != EngineSession::DeviceAllocation::Outcome::routed) {
      state.SkipWithError("the fake device did not take the weights");
      return;
    }
    s.device_weights_buffer(reinterpret_cast<std::uintptr_t>(d.ptr), std::size_t{2} << 20);
    weights.push_back(d.ptr);
  }
  if (s.tracked_ranges().size() != static_cast<std::size_t>(state.range(1))) {
    state.SkipWithError("the device ranges are not all tracked");
    return;
  }
  if (each_node) {
    for (auto _ : state)
      residency::preload::graph_writes(a, g.graph, [&](std::uintptr_t b, std::uintptr_t e) { s.device_written(b, e); });
  } else {
    for (auto _ : state) residency::preload::report_graph_writes(a, g.graph, s);
  }
  counters(state, g);
  state.counters["tracked"] = static_cast<double>(state.range(1));
  for (void* p : weights) (void)s.device_free(p);
}
void BM_GraphScan(benchmark::State& state) { graph_scan(state, false); }
void BM_GraphScanEachNodeAsked(benchmark::State& state) { graph_scan(state, true); }
BENCHMARK(BM_GraphScan)->ArgNames({"layers", "tracked"})->ArgsProduct({{32, 80}, {1, 8}});
BENCHMARK(BM_GraphScanEachNodeAsked)->ArgNames({"layers", "tracked"})->ArgsProduct({{32, 80}, {1, 8}});

}  // namespace

BENCHMARK_MAIN();
