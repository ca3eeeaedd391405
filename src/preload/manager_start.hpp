// SPDX-License-Identifier: MIT
// How a preload's session starts a manager, for host memory or for one GPU: the same in the
// llama.cpp preload's EngineSession and the CUDA preload's ProgramSession.
#pragma once

#include <functional>
#include <memory>

#include "residency/residency.hpp"
#include "session_log.hpp"

namespace residency::preload {

// The backend for host memory (where < 0, with the session's config) or for GPU `where` (with
// Config::for_device_memory()).
using SessionBackends = std::function<Result<std::shared_ptr<Backend>>(int where, const Config& config)>;

// The manager of host memory (where < 0: the session's config, its lines unprefixed) or of GPU
// `where`: its budget named by the GPU's UUID (RESIDENCY_GPU_BUDGET; an unknown UUID is said, and
// the memory is not budgeted), its lines prefixed "cuda:N: ". Null when the backend or the manager
// cannot start, said in one line ending with `without`.
std::unique_ptr<Manager> start_session_manager(int where, const Config& config, const SessionBackends& backends,
                                               Clock* clock, bool start_scheduler, const SessionLog& log,
                                               const char* without) noexcept;

}  // namespace residency::preload
