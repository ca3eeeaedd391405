// SPDX-License-Identifier: MIT
// Asymmetric fences: a free fence on the hot path, paid for by the rare path.
//
// touch() and the keep-alive release form a Dekker pair: touch() stores the time of use and then
// loads whether the memory is still resident; the releasing thread stores "not resident" and
// then loads the time of last use. Each side needs a full fence between its store and its load,
// or both may read stale values (touch() computes on memory that is being released). A full
// fence (or a sequentially consistent store) costs ~20 cycles on x86, more than the rest of
// touch(). Linux's membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) lets the rare side run a full
// fence on every CPU that runs a thread of this process, so the hot side only has to stop the
// compiler from reordering (folly's asymmetricLightBarrier / asymmetricHeavyBarrier, the
// userspace-RCU technique). Where membarrier is unavailable both sides fall back to full fences.
#pragma once

#include <atomic>

namespace residency::core {

// True once membarrier's private expedited command is registered for this process (done by the
// first heavy-fence user, enable_asymmetric_fences()).
extern std::atomic<bool> g_heavy_fence_is_membarrier;

// Registers membarrier once per process; cheap after the first call. Call before the first
// light_fence() whose pairing heavy_fence() must see it.
void enable_asymmetric_fences() noexcept;

// Hot side: between a store and a load that must not be reordered with the other side.
inline void light_fence() noexcept {
  if (g_heavy_fence_is_membarrier.load(std::memory_order_relaxed)) {
    std::atomic_signal_fence(std::memory_order_seq_cst);
  } else {
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
}

// Rare side: a full fence on this thread and on every thread of the process (a few
// microseconds: an interrupt to each CPU running one).
void heavy_fence() noexcept;

}  // namespace residency::core
