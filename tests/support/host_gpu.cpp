// SPDX-License-Identifier: MIT
// HostGpu: the device as the backend asks about it (name, UUID, attributes), its primary context,
// streams, events, error names, and the object tests hold; device memory, host registrations and
// copies are in host_gpu_memory.cpp.
#include "support/host_gpu.hpp"

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "support/host_gpu_state.hpp"

namespace residency::cuda::testing {
namespace host_gpu {
namespace {

// The one device's primary context, as a handle nobody dereferences.
const CUcontext kContext = reinterpret_cast<CUcontext>(std::uintptr_t{0xc0de0000});
// The fixed UUID cuDeviceGetUuid reports: GPU-f4ce0000-0000-4000-8000-000000000001.
constexpr unsigned char kUuid[16] = {0xf4, 0xce, 0, 0, 0, 0, 0x40, 0, 0x80, 0, 0, 0, 0, 0, 0, 0x01};
constexpr const char* kName = "residency HostGpu (one device emulated in host memory)";

// The contexts this thread pushed (cuCtxPushCurrent / cuCtxPopCurrent).
thread_local std::vector<CUcontext> t_current;

}  // namespace

State& state() {
  static State* const s = new State();
  return *s;
}

bool has_context() { return !t_current.empty(); }

bool stream_ok(const State& s, CUstream st) {
  const auto v = reinterpret_cast<std::uintptr_t>(st);
  // The null stream, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD always exist.
  return v <= 2 || s.streams.count(v) != 0;
}

CUresult CUDAAPI host_cuInit(unsigned int flags) { return flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }

CUresult CUDAAPI host_cuDriverGetVersion(int* v) {
  if (v == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *v = 13000;
  return CUDA_SUCCESS;
}

#define HOST_GPU_ERRORS(X)                                                                                    \
  X(CUDA_SUCCESS, "no error")                                                                                 \
  X(CUDA_ERROR_INVALID_VALUE, "invalid argument")                                                             \
  X(CUDA_ERROR_OUT_OF_MEMORY, "out of memory")                                                                \
  X(CUDA_ERROR_NOT_INITIALIZED, "initialization error")                                                       \
  X(CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected")                                               \
  X(CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal")                                                      \
  X(CUDA_ERROR_INVALID_IMAGE, "device kernel image is invalid")                                               \
  X(CUDA_ERROR_INVALID_CONTEXT, "invalid device context")                                                     \
  X(CUDA_ERROR_INVALID_HANDLE, "invalid resource handle")                                                     \
  X(CUDA_ERROR_NOT_FOUND, "named symbol not found")                                                           \
  X(CUDA_ERROR_NOT_READY, "device not ready")                                                                 \
  X(CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered")                                   \
  X(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "part or all of the requested memory range is already mapped") \
  X(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "pointer does not correspond to a registered memory region")       \
  X(CUDA_ERROR_NOT_PERMITTED, "operation not permitted")                                                      \
  X(CUDA_ERROR_NOT_SUPPORTED, "operation not supported")                                                      \
  X(CUDA_ERROR_UNKNOWN, "unknown error")

CUresult CUDAAPI host_cuGetErrorName(CUresult r, const char** out) {
  if (out == nullptr) return CUDA_ERROR_INVALID_VALUE;
#define HOST_GPU_NAME(code, text) \
  if (r == code) {                \
    *out = #code;                 \
    return CUDA_SUCCESS;          \
  }
  HOST_GPU_ERRORS(HOST_GPU_NAME)
#undef HOST_GPU_NAME
  *out = nullptr;
  return CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI host_cuGetErrorString(CUresult r, const char** out) {
  if (out == nullptr) return CUDA_ERROR_INVALID_VALUE;
#define HOST_GPU_TEXT(code, text) \
  if (r == code) {                \
    *out = text;                  \
    return CUDA_SUCCESS;          \
  }
  HOST_GPU_ERRORS(HOST_GPU_TEXT)
#undef HOST_GPU_TEXT
  *out = nullptr;
  return CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI host_cuDeviceGetCount(int* n) {
  if (n == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *n = 1;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuDeviceGet(CUdevice* dev, int ordinal) {
  if (dev == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
  *dev = 0;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuDeviceGetName(char* name, int len, CUdevice dev) {
  if (name == nullptr || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  if (dev != 0) return CUDA_ERROR_INVALID_DEVICE;
  std::snprintf(name, static_cast<std::size_t>(len), "%s", kName);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuDeviceGetUuid(CUuuid* u, CUdevice dev) {
  if (u == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (dev != 0) return CUDA_ERROR_INVALID_DEVICE;
  std::memcpy(u->bytes, kUuid, sizeof kUuid);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuDeviceGetAttribute(int* v, CUdevice_attribute a, CUdevice dev) {
  if (v == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (dev != 0) return CUDA_ERROR_INVALID_DEVICE;
  switch (a) {  // what an H100 says, where a caller could care; 0 for the rest
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: *v = 1; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *v = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *v = 1; break;
    case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: *v = 2; break;
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: *v = 1; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: *v = 1; break;
    case CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED: *v = 1; break;
    case CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED: *v = 1; break;
    default: *v = 0; break;
  }
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuDeviceTotalMem(std::size_t* bytes, CUdevice dev) {
  if (bytes == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (dev != 0) return CUDA_ERROR_INVALID_DEVICE;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  *bytes = s.config.capacity;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice dev) {
  if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (dev != 0) return CUDA_ERROR_INVALID_DEVICE;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  ++s.context_retains;
  *ctx = kContext;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuDevicePrimaryCtxRelease(CUdevice dev) {
  if (dev != 0) return CUDA_ERROR_INVALID_DEVICE;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.context_retains == 0) return CUDA_ERROR_INVALID_CONTEXT;
  --s.context_retains;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuCtxPushCurrent(CUcontext ctx) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (ctx != kContext || s.context_retains == 0) return CUDA_ERROR_INVALID_CONTEXT;
  t_current.push_back(ctx);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuCtxPopCurrent(CUcontext* ctx) {
  if (t_current.empty()) return CUDA_ERROR_INVALID_CONTEXT;
  if (ctx != nullptr) *ctx = t_current.back();
  t_current.pop_back();
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuCtxSynchronize() { return has_context() ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT; }

CUresult CUDAAPI host_cuStreamCreate(CUstream* st, unsigned int) {
  if (st == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!has_context()) return CUDA_ERROR_INVALID_CONTEXT;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  const std::uintptr_t t = s.next_token++;
  s.streams[t] = true;
  *st = reinterpret_cast<CUstream>(t);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuStreamDestroy(CUstream st) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.streams.erase(reinterpret_cast<std::uintptr_t>(st)) != 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult CUDAAPI host_cuStreamSynchronize(CUstream st) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return stream_ok(s, st) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;  // every copy is done already
}

CUresult CUDAAPI host_cuEventCreate(CUevent* ev, unsigned int) {
  if (ev == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!has_context()) return CUDA_ERROR_INVALID_CONTEXT;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  const std::uintptr_t t = s.next_token++;
  s.events[t] = Clock::time_point{};
  *ev = reinterpret_cast<CUevent>(t);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuEventDestroy(CUevent ev) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.events.erase(reinterpret_cast<std::uintptr_t>(ev)) != 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult CUDAAPI host_cuEventRecord(CUevent ev, CUstream st) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.events.find(reinterpret_cast<std::uintptr_t>(ev));
  if (it == s.events.end() || !stream_ok(s, st)) return CUDA_ERROR_INVALID_HANDLE;
  it->second = Clock::now();
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuEventSynchronize(CUevent ev) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.events.count(reinterpret_cast<std::uintptr_t>(ev)) != 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult CUDAAPI host_cuEventElapsedTime(float* ms, CUevent a, CUevent b) {
  if (ms == nullptr) return CUDA_ERROR_INVALID_VALUE;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto x = s.events.find(reinterpret_cast<std::uintptr_t>(a));
  auto y = s.events.find(reinterpret_cast<std::uintptr_t>(b));
  if (x == s.events.end() || y == s.events.end()) return CUDA_ERROR_INVALID_HANDLE;
  if (x->second == Clock::time_point{} || y->second == Clock::time_point{}) return CUDA_ERROR_INVALID_HANDLE;
  *ms = std::chrono::duration<float, std::milli>(y->second - x->second).count();
  return CUDA_SUCCESS;
}

// No kernels: tests fill device memory with copies.
CUresult CUDAAPI host_cuModuleLoadData(CUmodule*, const void*) { return CUDA_ERROR_NOT_SUPPORTED; }
CUresult CUDAAPI host_cuModuleUnload(CUmodule) { return CUDA_ERROR_NOT_SUPPORTED; }
CUresult CUDAAPI host_cuModuleGetFunction(CUfunction*, CUmodule, const char*) { return CUDA_ERROR_NOT_SUPPORTED; }
CUresult CUDAAPI host_cuLaunchKernel(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
                                     unsigned int, unsigned int, CUstream, void**, void**) {
  return CUDA_ERROR_NOT_SUPPORTED;
}

}  // namespace host_gpu

using namespace host_gpu;

HostGpu::HostGpu() {
  // Every entry point the Driver has (host_gpu_state.hpp declares them from the same list): a new
  // line in RESIDENCY_CUDA_DRIVER_FUNCTIONS fails to link until the fake has it too.
#define HOST_GPU_ASSIGN(name, version) driver_.name = &host_##name;
  RESIDENCY_CUDA_DRIVER_FUNCTIONS(HOST_GPU_ASSIGN)
#undef HOST_GPU_ASSIGN
  driver_.driver_version = 13000;
  driver_.library = "HostGpu (tests/support/host_gpu.cpp)";
}

HostGpu& HostGpu::instance() {
  static HostGpu* const g = new HostGpu();  // never destroyed, like its state
  return *g;
}

void HostGpu::reset(const Config& config) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  release_memory(s);
  s.streams.clear();
  s.events.clear();
  s.context_retains = 0;
  s.faulting = false;
  s.fault = {};
  s.fault_seen = 0;
  s.hook = nullptr;
  s.counters = {};
  s.config = config;
  if (s.config.granularity == 0) s.config.granularity = Config{}.granularity;
}

std::string HostGpu::live() const {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  std::string out;
  auto line = [&out](std::size_t n, const char* what, std::uint64_t bytes) {
    if (n == 0) return;
    out += std::to_string(n) + " " + what;
    if (bytes != 0) out += " (" + std::to_string(bytes) + " bytes)";
    out += "\n";
  };
  std::uint64_t reserved = 0, registered = 0;
  for (const auto& [b, size] : s.reservations) reserved += size;
  for (const auto& [b, r] : s.registrations) registered += r.size;
  line(s.reservations.size(), "address reservations", reserved);
  line(s.physical.size(), "physical allocations", s.used);
  line(s.mappings.size(), "mappings", 0);
  line(s.registrations.size(), "host registrations", registered);
  line(s.streams.size(), "streams", 0);
  line(s.events.size(), "events", 0);
  line(static_cast<std::size_t>(s.context_retains), "primary context retains", 0);
  return out;
}

void HostGpu::fail_host_register(const RegisterFault& fault) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.faulting = true;
  s.fault = fault;
  s.fault_seen = 0;
}

void HostGpu::on_copy(CopyHook hook) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.hook = std::move(hook);
}

HostGpu::Counters HostGpu::counters() const {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.counters;
}

std::uint64_t HostGpu::used() const {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.used;
}

std::uint64_t HostGpu::free_bytes() const {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.config.capacity - s.used;
}

std::uint64_t HostGpu::mapped_bytes(CUdeviceptr p, std::size_t bytes) const {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  std::uint64_t n = 0;
  for (const auto& [b, m] : s.mappings) {
    const CUdeviceptr lo = std::max(b, p), hi = std::min(b + m.size, p + bytes);
    if (hi > lo) n += hi - lo;
  }
  return n;
}

std::size_t HostGpu::registrations() const {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.registrations.size();
}

std::uint64_t HostGpu::registered_bytes() const {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  std::uint64_t n = 0;
  for (const auto& [b, r] : s.registrations) n += r.size;
  return n;
}

std::size_t HostGpu::read_only_registrations() const {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  std::size_t n = 0;
  for (const auto& [b, r] : s.registrations) n += (r.flags & CU_MEMHOSTREGISTER_READ_ONLY) != 0 ? 1 : 0;
  return n;
}

bool HostGpu::registered(const void* p, std::size_t bytes) const {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return registration_of(s, reinterpret_cast<std::uintptr_t>(p), bytes) != nullptr;
}

}  // namespace residency::cuda::testing
