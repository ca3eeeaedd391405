// SPDX-License-Identifier: MIT
// residency metal backend: the macOS figures the backend, the tests and `residency stat` share
// (sysctl and Mach readers; no Metal). The public half is in residency/backends/metal.hpp.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "backends/metal/pressure_source.hpp"

namespace residency::metal {

// An integer sysctl (4 or 8 bytes, as the kernel stores it). nullopt when it does not exist or
// has another size; `why` then says so.
std::optional<std::int64_t> read_sysctl_integer(const char* name, std::string* why = nullptr);
// kern.memorystatus_vm_pressure_level (1 normal, 2 warn, 4 critical); nullopt when unreadable.
std::optional<PressureLevel> read_memory_pressure_level();

}  // namespace residency::metal
