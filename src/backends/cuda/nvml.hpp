// SPDX-License-Identifier: MIT
// What this process holds on a GPU, as nvidia-smi shows it: NVML's per-process used memory
// (libnvidia-ml.so.1, which the driver installs beside libcuda; loaded at run time, like libcuda,
// so nothing links it). The cuda backend subtracts its own allocations to know the rest (the
// context, libraries' workspaces), which a GPU budget must count too
// (docs/design.md, "The GPU budget").
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace residency::cuda {

// libnvidia-ml.so.1's entry points, or why they are not there (nvml.cpp). CudaProcess opens it once
// per process and keeps it (NVML keeps driver state: never unloaded).
struct Nvml;
const Nvml* open_nvml();  // never freed

// Bytes process `pid` holds on the GPU named by `uuid` ("GPU-..."); nullopt when NVML is missing,
// fails, or does not list the process (another pid namespace). `why` says which, when given.
std::optional<std::uint64_t> nvml_process_bytes(const Nvml& nvml, const std::string& uuid, int pid,
                                                std::string* why = nullptr);

}  // namespace residency::cuda
