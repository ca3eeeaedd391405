// SPDX-License-Identifier: MIT
// llama.cpp's memory as ggml's own backend buffers (DESIGN §13): every buffer in host memory that
// ggml makes is followed from creation to free, and registered with the session's manager as
// buffer_plan.hpp decides: the model's weights in whatever buffer type holds them (CPU_Mapped
// file ranges, AMX, CPU_REPACK, plain CPU), the KV cache, the compute buffers.
//
// What is interposed for it (all public ggml-backend.h functions, so the preload never depends
// on ggml's internal structs):
// - ggml_backend_buft_alloc_buffer: every buffer of a buffer type (ggml's own memory; the graph
//   allocator's compute buffers and the KV cache come through it too);
// - ggml_backend_cpu_buffer_from_ptr / ggml_backend_dev_buffer_from_host_ptr: buffers over memory
//   that is not ggml's (llama.cpp's CPU_Mapped buffers over the GGUF mapping);
// - ggml_backend_tensor_alloc: where a tensor is placed in such a buffer;
// - ggml_backend_buffer_set_usage: WEIGHTS (llama.cpp's model buffers) and COMPUTE (graph
//   allocator) decide the class;
// - ggml_backend_buffer_free: the buffer's regions are unregistered before its memory goes.
// Registration waits for a flush point: the end of llama_model_load_from_file (the weights are
// loaded, every tensor is placed), of llama_init_from_model (KV cache and compute buffers), and
// the start of each decode (buffers ggml made since, e.g. a grown compute buffer).
//
// Every method is called with the preload's lock held, except has_pending().
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include <ggml-backend.h>

#include "buffer_plan.hpp"
#include "piece_table.hpp"
#include "residency/residency.hpp"

namespace residency::preload {

// ggml's functions the tracker reads buffers with, from the library behind the preload; null when
// one is missing (ggml is not a shared library here): then no buffer is followed.
struct GgmlApi {
  decltype(&ggml_backend_buffer_get_base) get_base = nullptr;
  decltype(&ggml_backend_buffer_get_size) get_size = nullptr;
  decltype(&ggml_backend_buffer_get_type) get_type = nullptr;
  decltype(&ggml_backend_buffer_name) name = nullptr;
  decltype(&ggml_backend_buft_is_host) buft_is_host = nullptr;
  decltype(&ggml_backend_buft_get_device) buft_get_device = nullptr;
  decltype(&ggml_backend_dev_type) dev_type = nullptr;
  decltype(&ggml_nbytes) nbytes = nullptr;
};
const GgmlApi* ggml_api() noexcept;

class GgmlBuffers {
 public:
  using Warn = PieceTable::Warn;
  using Info = void (*)(const std::string& message);
  // pressure_without_swap: the configuration releases on pressure and the machine has no swap;
  // then weights in anonymous memory (a repacked copy) get one warning: unlocking them under
  // pressure frees nothing, since anonymous pages can only be reclaimed to swap.
  // info: the summary of each flush; detail: one line per buffer (debug level).
  GgmlBuffers(Manager& manager, Warn warn, Info info, Info detail, bool pressure_without_swap)
      : pieces_(&manager, warn, "ggml buffers"),
        warn_(warn),
        info_(info),
        detail_(detail),
        pressure_without_swap_(pressure_without_swap) {}

  void created(ggml_backend_buffer_t b, bool from_ptr) noexcept;
  void tensor_placed(ggml_backend_buffer_t b, const struct ggml_tensor* t, const void* addr) noexcept;
  void usage_set(ggml_backend_buffer_t b, enum ggml_backend_buffer_usage usage) noexcept;
  void freeing(ggml_backend_buffer_t b) noexcept;

  // Lock-free: whether `b` is a buffer over memory that is not ggml's (the only ones whose tensor
  // placements matter: ggml's graph allocator places every node of every graph, in its own
  // buffers, and those calls must not take the preload's lock).
  bool is_from_ptr(ggml_backend_buffer_t b) const noexcept;
  // Lock-free: whether a buffer waits for registration.
  bool has_pending() const noexcept { return pending_.load(std::memory_order_acquire); }
  // Registers every buffer that changed since the last flush: one info line for them all, by
  // class and buffer type ("registered 3 buffers: weights 111.7 MiB (CPU_REPACK 103.2 MiB,
  // CPU_Mapped 8.5 MiB), kv_cache 16 MiB (CPU), scratch 4 MiB (CPU)"), one debug line each.
  void flush() noexcept;
  // Whether a buffer llama.cpp marked as weights is still there (a model is loaded).
  bool holds_weights() const noexcept;
  // The registered pieces of buffers over memory that is not ggml's, sorted by address.
  std::vector<Extent> from_ptr_runs() const;

  PieceTable& pieces() noexcept { return pieces_; }
  const PieceTable& pieces() const noexcept { return pieces_; }

 private:
  struct Tracked {
    BufferFacts facts;
    bool dirty = true;  // changed since it was last registered
  };
  // What one registration placed: its class, buffer type and bytes (0: nothing registered).
  struct Registered {
    RegionClass cls = RegionClass::weights;
    std::string type;
    std::size_t bytes = 0;
  };
  Registered register_buffer(ggml_backend_buffer_t b, Tracked& t);
  void remember_from_ptr(ggml_backend_buffer_t b) noexcept;
  void forget_from_ptr(ggml_backend_buffer_t b) noexcept;

  PieceTable pieces_;
  Warn warn_;
  Info info_;
  Info detail_;
  bool pressure_without_swap_;
  bool warned_anonymous_weights_ = false;
  std::unordered_map<ggml_backend_buffer_t, Tracked> buffers_;
  // The from_ptr buffers (few: one per model file), readable without the lock; null: free.
  static constexpr std::size_t kMaxFromPtr = 64;
  std::array<std::atomic<ggml_backend_buffer_t>, kMaxFromPtr> from_ptr_{};
  std::atomic<std::size_t> from_ptr_used_{0};  // slots [0, used) were ever taken (set with the lock held)
  std::atomic<bool> pending_{false};
};

}  // namespace residency::preload
