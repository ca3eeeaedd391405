// SPDX-License-Identifier: MIT
#include "ggml_api.hpp"

#include <atomic>
#include <string>

#include "next_calls.hpp"

namespace residency::preload {

namespace {

template <class Fn>
void resolve_into(Fn& f, const char* name, const void* near, bool& ok) noexcept {
  f = reinterpret_cast<Fn>(resolve_symbol(name, near));
  ok = ok && f != nullptr;
}

// Into a table that is never destroyed (engine threads may read buffers while the process exits).
const GgmlApi* make_api(const void* near) noexcept {
  GgmlApi api;
  bool ok = true;
  resolve_into(api.get_base, "ggml_backend_buffer_get_base", near, ok);
  resolve_into(api.get_size, "ggml_backend_buffer_get_size", near, ok);
  resolve_into(api.get_type, "ggml_backend_buffer_get_type", near, ok);
  resolve_into(api.name, "ggml_backend_buffer_name", near, ok);
  resolve_into(api.buft_is_host, "ggml_backend_buft_is_host", near, ok);
  resolve_into(api.buft_get_device, "ggml_backend_buft_get_device", near, ok);
  resolve_into(api.dev_type, "ggml_backend_dev_type", near, ok);
  resolve_into(api.nbytes, "ggml_nbytes", near, ok);
  if (!ok) return nullptr;
  bool graphs = true;
  resolve_into(api.graph_n_nodes, "ggml_graph_n_nodes", near, graphs);
  resolve_into(api.graph_node, "ggml_graph_node", near, graphs);
  if (!graphs) api.graph_n_nodes = nullptr, api.graph_node = nullptr;
  try {
    return new GgmlApi(api);
  } catch (...) {
    return nullptr;
  }
}

DeviceKind device_kind(const GgmlApi& api, ggml_backend_buffer_type_t buft) noexcept {
  ggml_backend_dev_t dev = api.buft_get_device(buft);
  if (dev == nullptr) return DeviceKind::none;
  switch (api.dev_type(dev)) {
    case GGML_BACKEND_DEVICE_TYPE_CPU: return DeviceKind::cpu;
    case GGML_BACKEND_DEVICE_TYPE_GPU: return DeviceKind::gpu;
#if RESIDENCY_GGML_HAS_IGPU  // ggml since late 2025 (ACCEL was 2 before, 3 after)
    case GGML_BACKEND_DEVICE_TYPE_IGPU: return DeviceKind::igpu;
#endif
    case GGML_BACKEND_DEVICE_TYPE_ACCEL: return DeviceKind::accel;
    default: return DeviceKind::gpu;  // a kind this preload does not know: not host memory
  }
}

class GgmlReader final : public BufferReader {
 public:
  explicit GgmlReader(const GgmlApi& api) : api_(api) {}
  BufferFacts facts(BufferId id, bool from_ptr) const override {
    auto* b = reinterpret_cast<ggml_backend_buffer_t>(id);
    BufferFacts f;
    ggml_backend_buffer_type_t buft = api_.get_type(b);
    f.size = api_.get_size(b);
    f.is_host = api_.buft_is_host(buft);
    f.device = device_kind(api_, buft);
    f.from_ptr = from_ptr;
    // Only host memory has a base worth reading (device buffers' bases are device addresses).
    if (is_cpu_memory(f.device)) f.base = reinterpret_cast<std::uintptr_t>(api_.get_base(b));
    return f;
  }
  std::string type_name(BufferId id) const override { return api_.name(reinterpret_cast<ggml_backend_buffer_t>(id)); }

 private:
  const GgmlApi& api_;
};

}  // namespace

const GgmlApi* ggml_api(const void* near) noexcept {
  static std::atomic<const GgmlApi*> cache{nullptr};
  if (const GgmlApi* api = cache.load(std::memory_order_acquire)) return api;
  if (resolving_now()) return nullptr;
  const GgmlApi* api = make_api(near);
  if (api == nullptr) return nullptr;
  const GgmlApi* expected = nullptr;
  if (!cache.compare_exchange_strong(expected, api, std::memory_order_acq_rel)) {
    delete api;  // another thread's won
    return expected;
  }
  return api;
}

const BufferReader* ggml_buffer_reader(const void* near) noexcept {
  static std::atomic<const BufferReader*> cache{nullptr};
  if (const BufferReader* r = cache.load(std::memory_order_acquire)) return r;
  const GgmlApi* api = ggml_api(near);
  if (api == nullptr) return nullptr;
  try {
    // Never destroyed: engine threads may still read buffers while the process exits.
    const BufferReader* r = new GgmlReader(*api);
    const BufferReader* expected = nullptr;
    if (!cache.compare_exchange_strong(expected, r, std::memory_order_acq_rel)) {
      delete r;
      return expected;
    }
    return r;
  } catch (...) {
    return nullptr;
  }
}

BufferUsage buffer_usage_of(enum ggml_backend_buffer_usage usage) noexcept {
  return usage == GGML_BACKEND_BUFFER_USAGE_WEIGHTS   ? BufferUsage::weights
         : usage == GGML_BACKEND_BUFFER_USAGE_COMPUTE ? BufferUsage::compute
                                                      : BufferUsage::any;
}

}  // namespace residency::preload
