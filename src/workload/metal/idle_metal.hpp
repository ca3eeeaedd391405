// SPDX-License-Identifier: MIT
// The metal idle target: `residency idle --backend metal` (see workload/idle_target.hpp).
//
// The model is the mmap'd GGUF file, as llama.cpp's Metal backend holds it: wrapped in no-copy
// buffers (MetalHostViews, split around the tensors when longer than maxBufferLength) and
// registered with each policy's manager as one region whose backend object is the array of
// those buffers, so the residency set holds exactly what the kernel reads. A decode is the Metal
// decode pass (metal_decode.hpp) over them. With policy off, macOS unwires the buffers about a
// second after their last use and the next decode pays the re-wire (llama-idle's table); a
// keep-alive holds them wired. Pressure: only --pressure none (MADV_PAGEOUT is Linux's; a hog is
// not implemented for macOS).
#pragma once

#include <memory>

#include "workload/idle_target.hpp"

namespace residency::workload {

// Errors: no Metal device, or residency sets unsupported here (the backend's message).
Result<std::unique_ptr<IdleTarget>> make_metal_idle_target(const IdleTargetOptions& options);

}  // namespace residency::workload
