// SPDX-License-Identifier: MIT
// The cuda idle target: `residency idle --backend cuda` (see workload/idle_target.hpp).
//
// The model's data section is copied into device memory allocated through
// Manager::allocate, so the policy under test decides when it sleeps (copied to the pinned
// host backup, device memory released) and when it wakes; a decode is the GPU decode pass
// (gpu_decode.hpp) over it. With a keep-alive the decode time stays flat across pauses
// shorter than the keep-alive (device memory has no idle penalty of its own); after the
// keep-alive, or under policy 0 after every use, the first decode pays the wake at the link's
// bandwidth. Memory pressure is a host notion: only --pressure none is accepted.
#pragma once

#include <memory>

#include "workload/idle_target.hpp"

namespace residency::workload {

// Errors: no CUDA driver or device (the cuda backend's message).
Result<std::unique_ptr<IdleTarget>> make_cuda_idle_target(const IdleTargetOptions& options);

}  // namespace residency::workload
