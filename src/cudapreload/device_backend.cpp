// SPDX-License-Identifier: MIT
#include "cudapreload/device_backend.hpp"

#include <string>

#include "preload/session_log.hpp"
#include "residency/backends/cuda.hpp"

namespace residency::preload {

Result<std::shared_ptr<Backend>> cuda_device_backend(int device, const Config& device_config) {
  CudaBackendOptions co;
  co.device = device;
  // Config::for_device_memory() decided what RESIDENCY_CUDA_BACKUP=auto means.
  co.backup = device_config.cuda_backup == CudaBackup::at_first_sleep ? CudaBackendOptions::Backup::at_first_sleep
                                                                      : CudaBackendOptions::Backup::after_allocation;
  const std::string prefix = "cuda:" + std::to_string(device) + ": ";
  const SessionLog log(device_config.log_level, device_config.log_time);
  // Where weights cannot sleep in their model file: one warning, as the session's own lines.
  co.notice = [log, prefix](const std::string& line) { log.warn(prefix + line); };
  co.info = [log, prefix](const std::string& line) { log.info(prefix + line); };
  // RESIDENCY_LOG=debug: each wake's timeline (its time measured only then).
  if (device_config.log_level >= LogLevel::debug)
    co.trace = [log, prefix](const std::string& line) { log.debug(prefix + "timeline: " + line); };
  return make_cuda_backend(co);
}

}  // namespace residency::preload
