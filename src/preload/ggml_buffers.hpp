// SPDX-License-Identifier: MIT
// llama.cpp's memory as ggml's own backend buffers
// (docs/design.md, "The model's memory: llama.cpp's buffers"): every buffer in host memory that
// ggml makes is followed from creation to free, and registered with the session's manager as
// buffer_plan.hpp decides: the model's weights in whatever buffer type holds them (CPU_Mapped file
// ranges, AMX, CPU_REPACK, plain CPU), the KV cache, the compute buffers.
//
// The hooks (interpose.cpp) read each buffer through ggml's public ggml-backend.h functions
// (ggml_api.hpp) and hand the facts here: made (ggml_backend_buft_alloc_buffer, or from_ptr over
// memory that is not ggml's: ggml_backend_cpu_buffer_from_ptr / _dev_buffer_from_host_ptr),
// a tensor placed in a from_ptr buffer, its usage set (WEIGHTS, COMPUTE), freed. Nothing here
// includes ggml: a test drives it with synthetic buffers (engine_session_test.cpp).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "buffer_plan.hpp"
#include "piece_table.hpp"
#include "residency/residency.hpp"

namespace residency::preload {

// A ggml buffer, as the session knows it (ggml_backend_buffer_t's value).
using BufferId = std::uintptr_t;

// What the table reads of a buffer when it is made and when it is registered: ggml's own answer
// through its public API behind the preload (ggml_api.hpp), or a test's.
class BufferReader {
 public:
  virtual ~BufferReader() = default;
  // Its size, type's device and is_host, and base (host memory only); from_ptr as given.
  virtual BufferFacts facts(BufferId b, bool from_ptr) const = 0;
  // Its buffer type's name now ("CPU", "CPU_REPACK", "CPU_Mapped", "AMX"...): read at
  // registration, since CPU_REPACK takes over a CPU buffer after ggml made it.
  virtual std::string type_name(BufferId b) const = 0;
};

// Every method is called with the session's lock held, except the lock-free ones marked so.
// Registration waits for a flush point (flush()): the end of a model's load (every tensor placed),
// of a context's creation (KV cache and compute buffers), and the start of each decode (a grown
// compute buffer).
class GgmlBuffers {
 public:
  // pressure_without_swap: the configuration releases on pressure and the machine has no swap;
  // then weights in anonymous memory (a repacked copy) get one warning: unlocking them under
  // pressure frees nothing, since anonymous pages can only be reclaimed to swap.
  // The log's info level has one summary per flush, debug one line per buffer. `reader` and `log`
  // must outlive the table.
  GgmlBuffers(Manager& manager, const BufferReader& reader, const SessionLog& log, bool pressure_without_swap)
      : pieces_(&manager, log, "ggml buffers"),
        reader_(&reader),
        log_(&log),
        pressure_without_swap_(pressure_without_swap) {}

  void created(BufferId b, bool from_ptr) noexcept;
  // A tensor of from_ptr buffer `b` was placed at [begin, end).
  void tensor_placed(BufferId b, std::uintptr_t begin, std::uintptr_t end) noexcept;
  void usage_set(BufferId b, BufferUsage usage) noexcept;
  void freeing(BufferId b) noexcept;

  // Lock-free: whether `b` is a buffer over memory that is not ggml's (the only ones whose tensor
  // placements matter: ggml's graph allocator places every node of every graph, in its own
  // buffers, and those calls must not take the preload's lock).
  bool is_from_ptr(BufferId b) const noexcept;
  // Lock-free: whether a buffer waits for registration.
  bool has_pending() const noexcept { return pending_.load(std::memory_order_acquire); }
  // Registers every buffer that changed since the last flush: one info line for them all, by
  // class and buffer type ("registered 3 buffers: weights 111.7 MiB (CPU_REPACK 103.2 MiB,
  // CPU_Mapped 8.5 MiB), kv_cache 16 MiB (CPU), scratch 4 MiB (CPU)"), one debug line each; and
  // one info line for what of them the program locked itself and is left to it ("left to the
  // program, which locks it itself: weights 63.2 MiB (CPU) ...").
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
  // What one registration placed: its class, buffer type and bytes (0: nothing registered), and
  // the bytes it left to the program, which locked them itself (llama.cpp's mlock load modes).
  struct Registered {
    RegionClass cls = RegionClass::weights;
    std::string type;
    std::size_t bytes = 0;
    std::size_t programs = 0;
  };
  Registered register_buffer(BufferId b, Tracked& t);
  void remember_from_ptr(BufferId b) noexcept;
  void forget_from_ptr(BufferId b) noexcept;

  PieceTable pieces_;
  const BufferReader* reader_;
  const SessionLog* log_;
  bool pressure_without_swap_;
  bool warned_anonymous_weights_ = false;
  std::unordered_map<BufferId, Tracked> buffers_;
  // The from_ptr buffers (few: one per model file), readable without the lock.
  static constexpr std::size_t kMaxFromPtr = 64;
  std::array<std::atomic<BufferId>, kMaxFromPtr> from_ptr_{};  // 0: free
  std::atomic<std::size_t> from_ptr_used_{0};  // slots [0, used) were ever taken (set with the lock held)
  std::atomic<bool> pending_{false};
};

}  // namespace residency::preload
