// SPDX-License-Identifier: MIT
// What a ggml graph about to run writes, as the preload reports it (src/preload/graph_writes.hpp):
// every node's bytes but a view's, and only where they meet a tracked device range (the weights),
// read once per graph. Real ggml graphs (libggml from scripts/llama-cpp) over a real EngineSession
// with a fake device; the tensors' data pointers are placed by hand (nothing is computed).
#include <ggml.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string_view>
#include <utility>
#include <vector>

#include "preload/engine_session.hpp"
#include "preload/graph_writes.hpp"
#include "residency/clock.hpp"
#include "support/fake_backend.hpp"

namespace residency::preload {
namespace {

using residency::testing::FakeBackend;
using W = std::pair<std::uintptr_t, std::size_t>;
constexpr std::size_t kMiB = std::size_t{1} << 20;

class GraphWritesTest : public ::testing::Test {
 protected:
  ManualClock clock;
  std::shared_ptr<FakeBackend> gpu = std::make_shared<FakeBackend>();
  std::unique_ptr<EngineSession> session;
  ggml_context* ctx = nullptr;
  GgmlApi api;

  void SetUp() override {
    EngineSession::Options o;
    o.config.keep_alive.kind = KeepAlive::Kind::forever;
    o.config.release_on_pressure = false;
    o.backends = [this](int, const Config&) -> Result<std::shared_ptr<Backend>> { return std::shared_ptr<Backend>(gpu); };
    o.clock = &clock;
    o.log = [](LogLevel, std::string_view) {};
    o.start_schedulers = false;
    o.engine_memory = false;
    session = std::make_unique<EngineSession>(std::move(o));
    ggml_init_params p{};
    p.mem_size = 1 << 20;
    p.no_alloc = true;  // every tensor's data is placed by the test
    ctx = ggml_init(p);
    api.nbytes = &ggml_nbytes;
    api.graph_n_nodes = &ggml_graph_n_nodes;
    api.graph_node = &ggml_graph_node;
  }
  void TearDown() override { ggml_free(ctx); }

  // 4 MiB of routed device memory; tracked as weights when asked.
  std::uintptr_t device(bool weights) {
    const auto d = session->device_allocate(0, 4 * kMiB, false);
    EXPECT_EQ(d.outcome, EngineSession::DeviceAllocation::Outcome::routed);
    const auto base = reinterpret_cast<std::uintptr_t>(d.ptr);
    if (weights) session->device_weights_buffer(base, 4 * kMiB);
    return base;
  }
  ggml_tensor* at(ggml_tensor* t, std::uintptr_t addr) {
    t->data = reinterpret_cast<void*>(addr);
    return t;
  }
  std::vector<W> writes() {
    std::lock_guard<std::recursive_mutex> g(gpu->mu);
    return gpu->writes;
  }
};

TEST_F(GraphWritesTest, ANodeInTrackedWeightsIsAWriteAndViewsAndOtherMemoryAreNot) {
  const std::uintptr_t w = device(true);
  const std::uintptr_t kv = device(false);  // routed, untracked (a KV cache)
  std::vector<float> host(4096);
  const auto h = reinterpret_cast<std::uintptr_t>(host.data());

  ggml_tensor* x = at(ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 256), h);  // a leaf: never a node
  ggml_tensor* into_weights = at(ggml_add(ctx, x, x), w + 4096);        // 1 KiB into the weights
  ggml_tensor* view = at(ggml_view_1d(ctx, into_weights, 64, 0), w);    // views write nothing
  ggml_tensor* in_kv = at(ggml_mul(ctx, view, view), kv + 128);
  ggml_tensor* last = at(ggml_scale(ctx, in_kv, 2.0f), w + 4 * kMiB - 256);  // the weights' last 256 bytes
  ggml_cgraph* g = ggml_new_graph(ctx);
  ggml_build_forward_expand(g, last);
  ASSERT_EQ(ggml_graph_n_nodes(g), 4) << "add, view, mul, scale";

  report_graph_writes(api, g, *session);
  EXPECT_EQ(writes(), (std::vector<W>{{w + 4096, 1024}, {w + 4 * kMiB - 256, 256}}))
      << "the two nodes in the weights, whole; not the view, not the KV cache";
}

TEST_F(GraphWritesTest, ANodeThatOnlyOverlapsTheWeightsIsReportedForThatPart) {
  const std::uintptr_t w = device(true);
  ggml_tensor* x = at(ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 256), w - 512);  // 1 KiB across the start
  ggml_cgraph* g = ggml_new_graph(ctx);
  ggml_build_forward_expand(g, at(ggml_add(ctx, x, x), w - 512));
  report_graph_writes(api, g, *session);
  EXPECT_EQ(writes(), (std::vector<W>{{w, 512}}));
}

TEST_F(GraphWritesTest, NothingIsReportedWithoutTrackedWeightsOrAfterTheirFree) {
  const std::uintptr_t w = device(false);
  ggml_tensor* x = at(ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 256), w);
  ggml_cgraph* g = ggml_new_graph(ctx);
  ggml_build_forward_expand(g, at(ggml_add(ctx, x, x), w));
  EXPECT_EQ(session->tracked_ranges().size(), 0u);
  report_graph_writes(api, g, *session);
  EXPECT_TRUE(writes().empty()) << "untracked";

  const std::uintptr_t t = device(true);
  EXPECT_EQ(session->tracked_ranges().size(), 1u);
  EXPECT_TRUE(session->tracked_ranges().meets(t + 4 * kMiB - 1, t + 4 * kMiB));
  EXPECT_FALSE(session->tracked_ranges().meets(t + 4 * kMiB, t + 5 * kMiB));
  EXPECT_TRUE(session->device_free(reinterpret_cast<void*>(t)));
  EXPECT_EQ(session->tracked_ranges().size(), 0u) << "freed: no longer tracked";
  EXPECT_TRUE(session->device_free(reinterpret_cast<void*>(w)));
}

}  // namespace
}  // namespace residency::preload
