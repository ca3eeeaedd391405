// SPDX-License-Identifier: MIT
// residency: the backends this build has, by name.
//
// The only place that knows every backend (src/backends/registry.cpp). The core does not
// include it; the tool, the C API and engines that want "whatever this machine has" do.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "residency/backend.hpp"

namespace residency {

// Names of the backends compiled into this build, in order of preference for "auto".
std::vector<std::string> available_backends();
// "auto" picks the first backend that works on this machine (cuda where a GPU driver is
// present, metal on Apple, else posix). Unknown or unavailable names are an error that lists
// the accepted ones. One instance per kind per process: while a backend of that kind is alive,
// every call returns it (two managers in one process share its page locks and its limits).
// "cuda" is device 0; "cuda:N" is device N (one instance per device).
Result<std::shared_ptr<Backend>> make_backend(std::string_view name);

}  // namespace residency
