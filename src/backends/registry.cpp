// SPDX-License-Identifier: MIT
// The composition root: the one file that knows every backend compiled into this build, and
// which backend takes which BackendOptions field. Each backend's CMakeLists defines
// RESIDENCY_HAVE_<NAME> and provides make_<name>_backend() in include/residency/backends/<name>.hpp.
#include "residency/backends.hpp"
#include "residency/text.hpp"

#include "residency/config.hpp"

#include <map>

#include "platform/thread_annotations.hpp"

#if RESIDENCY_HAVE_POSIX
#include "residency/backends/posix.hpp"
#endif
#if RESIDENCY_HAVE_SIM
#include "residency/backends/sim.hpp"
#endif
#if RESIDENCY_HAVE_METAL
#include "residency/backends/metal.hpp"
#endif
#if RESIDENCY_HAVE_CUDA
#include "residency/backends/cuda.hpp"
#endif

namespace residency {

std::vector<std::string> available_backends() {
  std::vector<std::string> names;
#if RESIDENCY_HAVE_CUDA
  names.emplace_back("cuda");
#endif
#if RESIDENCY_HAVE_METAL
  names.emplace_back("metal");
#endif
#if RESIDENCY_HAVE_POSIX
  names.emplace_back("posix");
#endif
#if RESIDENCY_HAVE_SIM
  names.emplace_back("sim");
#endif
  return names;
}

namespace {
Result<std::shared_ptr<Backend>> make_named(std::string_view name) {
#if RESIDENCY_HAVE_CUDA
  if (name == "cuda") return make_cuda_backend();
  if (name.starts_with("cuda:")) {  // "cuda:N": device N
    const std::string_view n = name.substr(5);
    int device = 0;
    bool ok = !n.empty() && n.size() <= 4;
    for (char c : n) {
      if (c < '0' || c > '9') ok = false;
      else device = device * 10 + (c - '0');
    }
    if (ok) {
      CudaBackendOptions o;
      o.device = device;
      return make_cuda_backend(o);
    }
  }
#endif
#if RESIDENCY_HAVE_METAL
  if (name == "metal") return make_metal_backend();
#endif
#if RESIDENCY_HAVE_POSIX
  if (name == "posix") return make_posix_backend();
#endif
#if RESIDENCY_HAVE_SIM
  if (name == "sim") return make_sim_backend();
#endif
  std::string accepted;
  for (const auto& n : available_backends()) accepted += (accepted.empty() ? "" : ", ") + n;
  return Status(ErrorCode::invalid_argument,
                "unknown backend '" + printable(name) + "'; this build has: auto, " + accepted);
}

// One backend per kind per process: what a backend controls (page locks, RLIMIT_MEMLOCK, a GPU
// context) belongs to the process, so every manager that asks for a kind gets the instance that
// is already alive, if any. Held weakly: the backend goes when its last manager does.
Result<std::shared_ptr<Backend>> shared_backend(const std::string& name) {
  static Mutex mu;
  static auto* live RESIDENCY_PT_GUARDED_BY(mu) = new std::map<std::string, std::weak_ptr<Backend>>;  // never destroyed
  MutexLock lock(mu);
  if (auto b = (*live)[name].lock()) return b;
  auto made = make_named(name);
  if (made) (*live)[name] = *made;
  return made;
}
}  // namespace

Result<std::shared_ptr<Backend>> make_backend(std::string_view name) {
  if (name != "auto") return shared_backend(std::string(name));
  std::string reasons;
  for (const auto& n : available_backends()) {
    if (n == "sim") continue;  // never chosen automatically: it is a simulation
    auto b = shared_backend(n);
    if (b) return b;
    reasons += "\n  " + n + ": " + b.message();
  }
  return Status(ErrorCode::unsupported, "no backend works on this machine:" + reasons);
}

Result<std::shared_ptr<Backend>> make_backend(std::string_view name, const BackendOptions& options) {
  if (options == BackendOptions{}) return make_backend(name);
  if (name == "cuda") {
#if RESIDENCY_HAVE_CUDA
    CudaBackendOptions o;
    o.device = options.cuda_device;
    return make_cuda_backend(o);
#else
    return Status(ErrorCode::unsupported, "this build has no cuda backend");
#endif
  }
  if (name == "metal") {
#if RESIDENCY_HAVE_METAL
    MetalOptions o;
    o.device = options.metal_device;
    o.attach_to_queues = options.metal_attach_to_queues;
    auto b = make_metal_backend(o);
    if (!b) return b.status();
    return std::shared_ptr<Backend>(std::move(b).value());
#else
    return Status(ErrorCode::unsupported, "this build has no metal backend");
#endif
  }
  return Status(ErrorCode::invalid_argument,
                "cuda_device, metal_device and metal_attach_to_queues apply to the cuda and metal backends only; kind "
                "is '" +
                    printable(name) + "'");
}

Status add_command_queue(Backend& backend, void* queue) {
#if RESIDENCY_HAVE_METAL
  if (auto* metal = dynamic_cast<MetalBackend*>(&backend)) return metal->add_command_queue(queue);
#else
  (void)queue;
#endif
  return Status(ErrorCode::unsupported,
                "the " + backend.capabilities().name + " backend has no command queues (metal only)");
}

}  // namespace residency
