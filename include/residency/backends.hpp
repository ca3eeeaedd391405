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

// What a backend is made with beyond its name: each field is for one backend (the C API's
// residency_backend_options carries the same fields and hands them here as they are, so that
// only this file knows which backend takes what). The defaults are make_backend(name)'s.
struct BackendOptions {
  int cuda_device = 0;                  // cuda: the device ordinal
  void* metal_device = nullptr;         // metal: an MTL::Device*; nullptr: the system default
  bool metal_attach_to_queues = false;  // metal: attach every set to each queue given to add_command_queue
  bool operator==(const BackendOptions&) const = default;
};
// The default options: make_backend(name), the shared instance. Other options: a backend of its
// own, of kind "cuda" or "metal" (invalid_argument for any other name; unsupported when this
// build lacks that backend).
Result<std::shared_ptr<Backend>> make_backend(std::string_view name, const BackendOptions& options);

// metal: a command queue (MTL::CommandQueue*) to attach every set to (with
// metal_attach_to_queues). Every other backend: unsupported.
Status add_command_queue(Backend& backend, void* queue);

}  // namespace residency
