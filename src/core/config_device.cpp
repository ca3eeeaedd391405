// SPDX-License-Identifier: MIT
#include "residency/config.hpp"

namespace residency {

Config Config::for_device_memory() const {
  Config c = *this;
  c.wired_limit.reset();
  c.memory_limit.reset();
  c.release_on_pressure = false;
  c.pressure_floor.reset();
  c.shared_budget.reset();  // RESIDENCY_SHARED_BUDGET is a budget of RAM
  c.layout = Layout::per_buffer;
  c.notes.clear();
  return c;
}

}  // namespace residency
