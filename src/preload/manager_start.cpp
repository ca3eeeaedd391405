// SPDX-License-Identifier: MIT
#include "manager_start.hpp"

#include <string>

namespace residency::preload {

std::unique_ptr<Manager> start_session_manager(int where, const Config& config, const SessionBackends& backends,
                                               Clock* clock, bool start_scheduler, const SessionLog& log,
                                               const char* without) noexcept {
  const bool host = where < 0;
  try {
    const std::string who = host ? std::string() : "CUDA device " + std::to_string(where) + ": ";
    auto backend = backends(where, host ? config : config.for_device_memory());
    if (!backend) {
      log.warn(who + backend.message() + without);
      return nullptr;
    }
    ManagerOptions mo;
    mo.backend = *backend;
    mo.clock = clock;
    mo.start_scheduler = start_scheduler;
    if (host) {
      mo.config = config;
      mo.log = log.for_manager("");
    } else {
      // A GPU's budget is named by its UUID (the same GPU has other indices in other processes).
      const std::string uuid = (*backend)->capabilities().device_uuid;
      if (config.gpu_budget && uuid.empty())
        log.warn(who + "its UUID is unknown, so RESIDENCY_GPU_BUDGET=" + config.gpu_budget->to_string() +
                 " cannot name its budget; its memory is not budgeted");
      mo.config = config.for_device_memory(uuid);
      mo.log = log.for_manager("cuda:" + std::to_string(where) + ": ");  // which device a line is about
    }
    auto manager = Manager::create(std::move(mo));
    if (!manager) {
      log.warn(who + manager.message() + without);
      return nullptr;
    }
    return std::move(*manager);
  } catch (...) {
    return nullptr;  // out of memory while starting: pass through
  }
}

}  // namespace residency::preload
