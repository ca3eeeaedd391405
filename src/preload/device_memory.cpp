// SPDX-License-Identifier: MIT
#include "device_memory.hpp"

#include <atomic>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "preload_session.hpp"
#include "residency/backends.hpp"
#include "residency/residency.hpp"
#if RESIDENCY_PRELOAD_CUDA
#include "residency/backends/cuda.hpp"
#endif

namespace residency::preload {

namespace {

// cudaError_t values (the runtime's headers are not needed to build the preload).
constexpr int kCudaSuccess = 0;
constexpr int kCudaErrorMemoryAllocation = 2;
constexpr int kCudaErrorInitialization = 3;

// Smaller allocations stay the runtime's: the backend maps whole 2 MiB granules.
constexpr std::size_t kMinRouted = std::size_t{2} << 20;
constexpr int kMaxDevices = 64;

using CudaMallocFn = int (*)(void**, std::size_t);
using CudaFreeFn = int (*)(void*);
using CudaGetDeviceFn = int (*)(int*);

constexpr const char* kWithout = "; device memory stays the CUDA runtime's (no sleep)";

enum DeviceState : int { kUntried = 0, kActive = 1, kPassThrough = 2 };

struct Device {
  std::atomic<int> state{kUntried};
  std::atomic<Manager*> manager{nullptr};  // leaked on purpose, like the host session's
};

// Guards starting devices and `routed`. Lock order: this, then a manager's.
constinit std::mutex g_mu;
Device g_devices[kMaxDevices];
constinit std::atomic<int> g_active_count{0};  // devices with a manager (hooks skip all when 0)
constinit std::atomic<bool> g_warned_small_limit{false};
// Routed pointer -> device (a map only touched by cudaMalloc/cudaFree of routed sizes or of
// pointers; cudaFree(nullptr) and unrouted frees look it up too, under g_mu).
std::unordered_map<void*, int>* g_routed = nullptr;

[[gnu::tls_model("initial-exec")]] thread_local int t_compute_depth = 0;

CudaMallocFn next_cuda_malloc() noexcept {
  static std::atomic<CudaMallocFn> cache{nullptr};
  static std::atomic<bool> done{false};
  return resolve_next(cache, done, "cudaMalloc");
}
CudaFreeFn next_cuda_free() noexcept {
  static std::atomic<CudaFreeFn> cache{nullptr};
  static std::atomic<bool> done{false};
  return resolve_next(cache, done, "cudaFree");
}
CudaGetDeviceFn next_cuda_get_device() noexcept {
  static std::atomic<CudaGetDeviceFn> cache{nullptr};
  static std::atomic<bool> done{false};
  return resolve_next(cache, done, "cudaGetDevice");
}

#if RESIDENCY_PRELOAD_CUDA
// The backend's form of Config::cuda_backup (RESIDENCY_CUDA_BACKUP; Config::for_device_memory()
// decides what `automatic` means).
CudaBackendOptions::Backup backup_mode(CudaBackup configured) noexcept {
  return configured == CudaBackup::at_first_sleep ? CudaBackendOptions::Backup::at_first_sleep
                                                  : CudaBackendOptions::Backup::after_allocation;
}
#endif

// With g_mu held: the manager of device `dev`, started on first use; null: pass through.
Manager* device_manager(int dev) noexcept {
  Device& d = g_devices[dev];
  if (d.state.load(std::memory_order_relaxed) == kActive) return d.manager.load(std::memory_order_relaxed);
  if (d.state.load(std::memory_order_relaxed) == kPassThrough) return nullptr;
  d.state.store(kPassThrough, std::memory_order_relaxed);  // unless everything below works
  try {
    const Startup* up = startup();
    if (up == nullptr) return nullptr;
    if (up->config.keep_alive.kind == KeepAlive::Kind::off) return nullptr;  // residency off: nothing to manage
    const std::string name = "cuda:" + std::to_string(dev);
    const Config device_config = up->config.for_device_memory();
#if RESIDENCY_PRELOAD_CUDA
    CudaBackendOptions co;
    co.device = dev;
    co.backup = backup_mode(device_config.cuda_backup);
    auto backend = make_cuda_backend(co);
#else
    auto backend = make_backend(name);  // an error naming the backends this build has
#endif
    if (!backend) {
      warn("CUDA device " + std::to_string(dev) + ": " + backend.message() + kWithout);
      return nullptr;
    }
    // The GPU's budget is named by its UUID (the same GPU has other indices in other processes).
    const std::string uuid = (*backend)->capabilities().device_uuid;
    if (up->config.gpu_budget && uuid.empty())
      warn("CUDA device " + std::to_string(dev) + ": its UUID is unknown, so RESIDENCY_GPU_BUDGET=" +
           up->config.gpu_budget->to_string() + " cannot name its budget; its memory is not budgeted");
    ManagerOptions options;
    options.config = up->config.for_device_memory(uuid);
    options.backend = *backend;
    options.clock = up->clock;
    // Its lines say which device they are about (the host session's have no prefix).
    const LogLevel level = up->config.log_level;
    options.log = [prefix = name + ": ", level, time = up->config.log_time](LogLevel l, std::string_view message) {
      if (l <= level) log_to_stderr(l, prefix + std::string(message), time);
    };
    auto manager = Manager::create(std::move(options));
    if (!manager) {
      warn("CUDA device " + std::to_string(dev) + ": " + manager.message() + kWithout);
      return nullptr;
    }
    if (g_routed == nullptr) g_routed = new std::unordered_map<void*, int>;  // never destroyed
    Manager* m = (*manager).release();
    d.manager.store(m, std::memory_order_release);
    d.state.store(kActive, std::memory_order_release);
    g_active_count.fetch_add(1, std::memory_order_release);
    return m;
  } catch (...) {
    return nullptr;  // out of memory while starting: this device passes through
  }
}


template <class F>
void for_each_manager(F&& f) noexcept {
  if (g_active_count.load(std::memory_order_acquire) == 0) return;
  for (Device& d : g_devices) {
    if (d.state.load(std::memory_order_acquire) != kActive) continue;
    if (Manager* m = d.manager.load(std::memory_order_acquire)) f(d, *m);
  }
}

}  // namespace

int device_malloc_hook(void** ptr, std::size_t size) noexcept {
  const CudaMallocFn next = next_cuda_malloc();
  if (next == nullptr) return kCudaErrorInitialization;  // no CUDA runtime behind the preload
  if (in_hook() || ptr == nullptr || size < kMinRouted || forked_child()) return next(ptr, size);
  const CudaGetDeviceFn get_device = next_cuda_get_device();
  int dev = -1;
  if (get_device == nullptr || get_device(&dev) != kCudaSuccess || dev < 0 || dev >= kMaxDevices) return next(ptr, size);
  if (g_devices[dev].state.load(std::memory_order_acquire) == kPassThrough) return next(ptr, size);

  HookScope hook;
  ErrnoKeeper keep;
  std::lock_guard<std::mutex> lock(g_mu);
  Manager* m = device_manager(dev);
  if (m == nullptr) return next(ptr, size);
  const RegionClass cls = t_compute_depth > 0 ? RegionClass::scratch : RegionClass::weights;
  auto a = m->allocate(size, cls);
  if (!a) {
    if (a.status().code() == ErrorCode::out_of_memory) return kCudaErrorMemoryAllocation;  // as cudaMalloc says it
    if (!g_warned_small_limit.exchange(true)) warn("CUDA device " + std::to_string(dev) + ": " + a.message() + kWithout);
    return next(ptr, size);
  }
  try {
    g_routed->emplace(a->ptr, dev);
  } catch (...) {
    (void)m->deallocate(a->ptr);
    return next(ptr, size);
  }
  *ptr = a->ptr;
  return kCudaSuccess;
}

int device_free_hook(void* ptr) noexcept {
  const CudaFreeFn next = next_cuda_free();
  if (next == nullptr) return kCudaErrorInitialization;
  if (ptr == nullptr || in_hook() || g_active_count.load(std::memory_order_acquire) == 0) return next(ptr);
  HookScope hook;
  ErrnoKeeper keep;
  std::lock_guard<std::mutex> lock(g_mu);
  const auto it = g_routed->find(ptr);
  if (it == g_routed->end()) return next(ptr);
  Manager* m = g_devices[it->second].manager.load(std::memory_order_relaxed);
  g_routed->erase(it);
  // Like cudaFree, waits for the device to finish with the memory first (the backend
  // synchronizes before it unmaps).
  (void)m->deallocate(ptr);
  return kCudaSuccess;
}

void device_access() noexcept {
  if (g_active_count.load(std::memory_order_acquire) == 0 || in_hook()) return;
  HookScope hook;
  ErrnoKeeper keep;
  for_each_manager([](Device&, Manager& m) { m.access(); });
}

ComputeAllocationScope::ComputeAllocationScope() noexcept { ++t_compute_depth; }
ComputeAllocationScope::~ComputeAllocationScope() { --t_compute_depth; }

DeviceDecodeScope::DeviceDecodeScope(llama_context* ctx) noexcept : ctx_(ctx) {
  if (g_active_count.load(std::memory_order_acquire) == 0 || in_hook()) return;
  active_ = true;
  HookScope hook;
  ErrnoKeeper keep;
  for_each_manager([](Device&, Manager& m) { m.begin_call(); });
}

DeviceDecodeScope::~DeviceDecodeScope() {
  if (!active_) return;
  HookScope hook;
  ErrnoKeeper keep;
  // Under keep-alive 0 the manager waits for the decode's kernels before the memory goes (the
  // backend also synchronizes the device before it unmaps).
  for_each_manager([this](Device&, Manager& m) { m.end_call(&synchronize_context, ctx_); });
}

}  // namespace residency::preload
