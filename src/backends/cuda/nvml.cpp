// SPDX-License-Identifier: MIT
#include "backends/cuda/nvml.hpp"

#include <dlfcn.h>

#include <memory>
#include <string>
#include <vector>

namespace residency::cuda {
namespace {

// The few NVML declarations used, as nvml.h has them (its header is not needed to build).
using nvmlReturn_t = int;
using nvmlDevice_t = struct nvmlDevice_st*;
constexpr nvmlReturn_t kNvmlSuccess = 0;
constexpr nvmlReturn_t kNvmlInsufficientSize = 7;
struct nvmlProcessInfo_t {
  unsigned int pid;
  unsigned long long usedGpuMemory;
  unsigned int gpuInstanceId;
  unsigned int computeInstanceId;
};
constexpr unsigned long long kNvmlValueNotAvailable = ~0ULL;

}  // namespace

struct Nvml {
  nvmlReturn_t (*init)() = nullptr;
  nvmlReturn_t (*by_uuid)(const char*, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*processes)(nvmlDevice_t, unsigned int*, nvmlProcessInfo_t*) = nullptr;
  std::string problem;
};

const Nvml* open_nvml() {
  auto* r = new Nvml();  // kept for the life of the process, as NVML itself
  void* h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    const char* e = dlerror();
    r->problem = std::string("libnvidia-ml.so.1 could not be loaded: ") + (e != nullptr ? e : "dlopen failed");
    return r;
  }
  r->init = reinterpret_cast<nvmlReturn_t (*)()>(dlsym(h, "nvmlInit_v2"));
  r->by_uuid = reinterpret_cast<nvmlReturn_t (*)(const char*, nvmlDevice_t*)>(dlsym(h, "nvmlDeviceGetHandleByUUID"));
  r->processes = reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, unsigned int*, nvmlProcessInfo_t*)>(
      dlsym(h, "nvmlDeviceGetComputeRunningProcesses_v3"));
  if (r->init == nullptr || r->by_uuid == nullptr || r->processes == nullptr) {
    r->problem =
        "libnvidia-ml.so.1 lacks nvmlInit_v2, nvmlDeviceGetHandleByUUID or "
        "nvmlDeviceGetComputeRunningProcesses_v3 (a driver older than 510)";
    r->processes = nullptr;
    return r;
  }
  if (const nvmlReturn_t e = r->init(); e != kNvmlSuccess) {
    r->problem = "nvmlInit_v2 failed (NVML error " + std::to_string(e) + ")";
    r->processes = nullptr;
  }
  return r;
}

std::optional<std::uint64_t> nvml_process_bytes(const Nvml& n, const std::string& uuid, int pid, std::string* why) {
  auto fail = [&](std::string w) -> std::optional<std::uint64_t> {
    if (why != nullptr) *why = std::move(w);
    return std::nullopt;
  };
  if (n.processes == nullptr) return fail(n.problem);
  nvmlDevice_t dev = nullptr;
  if (const nvmlReturn_t e = n.by_uuid(uuid.c_str(), &dev); e != kNvmlSuccess)
    return fail("NVML does not know GPU " + uuid + " (NVML error " + std::to_string(e) + ")");
  std::vector<nvmlProcessInfo_t> list(64);
  for (int attempt = 0; attempt < 4; ++attempt) {
    auto count = static_cast<unsigned int>(list.size());
    const nvmlReturn_t e = n.processes(dev, &count, list.data());
    if (e == kNvmlInsufficientSize) {
      list.resize(static_cast<std::size_t>(count) + 16);
      continue;
    }
    if (e != kNvmlSuccess)
      return fail("nvmlDeviceGetComputeRunningProcesses_v3 failed (NVML error " + std::to_string(e) + ")");
    for (unsigned int i = 0; i < count && i < list.size(); ++i) {
      if (static_cast<int>(list[i].pid) != pid) continue;
      if (list[i].usedGpuMemory == kNvmlValueNotAvailable) return fail("NVML does not report the process's memory");
      return list[i].usedGpuMemory;
    }
    return fail("NVML does not list process " + std::to_string(pid) + " on " + uuid +
                " (a container with its own process namespace?)");
  }
  return fail("the list of processes on " + uuid + " kept growing");
}

}  // namespace residency::cuda
