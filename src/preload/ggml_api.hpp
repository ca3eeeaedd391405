// SPDX-License-Identifier: MIT
// ggml's answers about its buffers, for the session (ggml_buffers.hpp's BufferReader): read
// through ggml's public ggml-backend.h functions in the library behind the preload, so that the
// preload never depends on ggml's internal structs. The one part of the preload that includes
// ggml's headers besides the hooks themselves.
#pragma once

#include <ggml-backend.h>

#include "ggml_buffers.hpp"

namespace residency::preload {

// ggml's functions, resolved behind the preload or where `near` is (an address in libggml or in a
// library that loads it); null when one is missing (ggml is not a shared library here): then no
// buffer can be followed. Cached once found, never when missing.
struct GgmlApi {
  decltype(&ggml_backend_buffer_get_base) get_base = nullptr;
  decltype(&ggml_backend_buffer_get_size) get_size = nullptr;
  decltype(&ggml_backend_buffer_get_type) get_type = nullptr;
  decltype(&ggml_backend_buffer_name) name = nullptr;
  decltype(&ggml_backend_buft_is_host) buft_is_host = nullptr;
  decltype(&ggml_backend_buft_get_device) buft_get_device = nullptr;
  decltype(&ggml_backend_dev_type) dev_type = nullptr;
  decltype(&ggml_nbytes) nbytes = nullptr;
  // Optional (null where this ggml lacks them): a graph's nodes, for the writes a graph makes.
  decltype(&ggml_graph_n_nodes) graph_n_nodes = nullptr;
  decltype(&ggml_graph_node) graph_node = nullptr;
};
const GgmlApi* ggml_api(const void* near) noexcept;

// The BufferReader over ggml_api(near); null when that is.
const BufferReader* ggml_buffer_reader(const void* near) noexcept;

inline BufferId buffer_id(ggml_backend_buffer_t b) noexcept { return reinterpret_cast<BufferId>(b); }

// ggml_backend_buffer_usage as the session knows it.
BufferUsage buffer_usage_of(enum ggml_backend_buffer_usage usage) noexcept;

}  // namespace residency::preload
