// SPDX-License-Identifier: MIT
// The memory a ggml graph about to run writes: each node's bytes, but for nodes that only view
// another tensor's memory. The hooks report these to the session (interpose.cpp's graph_write,
// through report_graph_writes); bench/llama/bench_graph_scan.cpp measures what that costs per
// graph. Header-only: it needs ggml's headers, which the engine session does not include.
#pragma once

#include <ggml.h>

#include <cstdint>

#include "engine_session.hpp"
#include "ggml_api.hpp"

namespace residency::preload {

// Calls write(begin, end) for each node of `g` that writes memory. Nothing without the graph
// functions (an older ggml): then no device range is ever tracked (GgmlApi).
template <class Write>
void graph_writes(const GgmlApi& api, ggml_cgraph* g, Write&& write) noexcept {
  if (g == nullptr || api.graph_n_nodes == nullptr || api.graph_node == nullptr) return;
  const int n = api.graph_n_nodes(g);
  for (int i = 0; i < n; ++i) {
    const ggml_tensor* t = api.graph_node(g, i);
    if (t == nullptr || t->data == nullptr) continue;
    switch (t->op) {
      case GGML_OP_NONE:
      case GGML_OP_VIEW:
      case GGML_OP_RESHAPE:
      case GGML_OP_PERMUTE:
      case GGML_OP_TRANSPOSE: continue;
      default: {
        const auto b = reinterpret_cast<std::uintptr_t>(t->data);
        write(b, b + api.nbytes(t));
      }
    }
  }
}

// What a graph about to run writes, told to `s` where it meets a tracked device range. The ranges
// are read once per graph: they change at a model's load and free, never during a decode.
inline void report_graph_writes(const GgmlApi& api, ggml_cgraph* g, EngineSession& s) noexcept {
  const EngineSession::TrackedRanges ranges = s.tracked_ranges();
  if (ranges.size() == 0) return;
  graph_writes(api, g, [&](std::uintptr_t b, std::uintptr_t e) {
    if (ranges.meets(b, e)) s.device_written(b, e);
  });
}

}  // namespace residency::preload
