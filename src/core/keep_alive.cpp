// SPDX-License-Identifier: MIT
#include "keep_alive.hpp"

namespace residency::core {

KeepAliveState::KeepAliveState(const KeepAlive& policy, Clock& clock, Publisher publish)
    : clock_(clock),
      steady_(dynamic_cast<SteadyClock*>(&clock) != nullptr),
      kind_(policy.in_effect()),
      duration_(policy.duration),
      rewires_on_use_(kind_ == KeepAlive::Kind::duration || kind_ == KeepAlive::Kind::forever),
      use_(&last_use_),
      publish_(publish) {
  enable_asymmetric_fences();
  note_use();
}

bool KeepAliveState::begin_release_unless_used(std::int64_t seen_last_use) noexcept {
  resident_.store(false, std::memory_order_relaxed);
  heavy_fence();
  if (use_->load(std::memory_order_relaxed) != seen_last_use || calls_.load(std::memory_order_relaxed) > 0) {
    resident_.store(true, std::memory_order_relaxed);
    return false;
  }
  return true;
}

}  // namespace residency::core
