// SPDX-License-Identifier: MIT
// The cuda backend for one GPU, as both preloads make it (the llama.cpp preload's device memory and
// the CUDA preload's): the backup mode, and the backend's notices, info lines and wake timelines as
// the preload's own log lines, prefixed "cuda:N: ".
#pragma once

#include <memory>

#include "residency/residency.hpp"

namespace residency::preload {

// `device_config` is Config::for_device_memory(). Errors: no driver, no such device, no VMM.
Result<std::shared_ptr<Backend>> cuda_device_backend(int device, const Config& device_config);

}  // namespace residency::preload
