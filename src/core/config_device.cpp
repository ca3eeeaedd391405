// SPDX-License-Identifier: MIT
#include "residency/config.hpp"

namespace residency {

Config Config::for_device_memory(std::string_view device_uuid) const {
  Config c = *this;
  c.wired_limit.reset();
  c.memory_limit.reset();
  c.release_on_pressure = false;
  c.pressure_floor.reset();
  c.shared_budget.reset();  // RESIDENCY_SHARED_BUDGET is a budget of RAM
  // ... which bounds the model files a device keeps registered, unless the host tier names its own.
  if (!c.host_budget.off && !c.host_budget.budget) {
    if (shared_budget) {
      c.host_budget.budget = *shared_budget;
    } else {
      WiredLimit half;
      half.is_percent = true;
      half.percent = kDefaultHostBudgetPercent;
      c.host_budget.budget = SharedBudget{kDefaultHostBudgetName, half, ""};
    }
  }
  if (gpu_budget && !device_uuid.empty())
    c.shared_budget = SharedBudget{gpu_budget->name + "." + std::string(device_uuid), gpu_budget->size, gpu_budget->group};
  c.layout = Layout::per_buffer;
  c.notes.clear();
  // Not set: after-allocation when the keep-alive will put the GPU to sleep (a duration or 0), so
  // that the first sleep only copies and a request that comes during it waits a copy's time, not a
  // pinning's (a first sleep that pins as it copies runs well below the link's rate, and unevenly
  // from run to run: docs/measurements.md); the host memory it takes is what the first sleep
  // would take anyway.
  // Under forever nothing sleeps: no backup is made before a sleep.
  if (c.cuda_backup == CudaBackup::automatic)
    c.cuda_backup = keep_alive.never_expires() ? CudaBackup::at_first_sleep : CudaBackup::after_allocation;
  return c;
}

}  // namespace residency
