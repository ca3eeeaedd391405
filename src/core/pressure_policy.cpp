// SPDX-License-Identifier: MIT
#include "pressure_policy.hpp"

#include <algorithm>

namespace residency::core {

std::uint64_t PressurePolicy::on_pressure(Nanos now, std::uint64_t wired) {
  last_event_ = now;
  const std::uint64_t base = std::min(wired, cap_);
  const std::uint64_t above = base > floor_ ? base - floor_ : 0;
  const std::uint64_t step = std::max(above / 4, kMinPressureStep);
  cap_ = above > step ? base - step : floor_;
  return cap_;
}

std::optional<Nanos> PressurePolicy::lifts_at() const {
  if (!capped()) return std::nullopt;
  return last_event_ + quiet_;
}

void PressurePolicy::raise_to(std::uint64_t cap, Nanos now) {
  cap_ = std::max(cap_, cap);
  last_event_ = now;
}

}  // namespace residency::core
