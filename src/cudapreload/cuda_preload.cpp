// SPDX-License-Identifier: MIT
// libresidency_cuda.so: LD_PRELOAD it into an unmodified CUDA program (a PyTorch server, an
// embedding or diffusion model) and its device allocations sleep and wake under the keep-alive and
// the GPU budget (docs/design.md, "Any CUDA program"). A library of its own rather than more hooks
// in libresidency_preload.so: that one follows llama.cpp's buffers and calls (it needs llama.h and
// refuses a llama.cpp it was not built against), while this one needs only the CUDA API, and a
// program that is not llama.cpp should not carry hooks of ggml's names.
//
// Here are the exported functions only: each finds the real function (the next definition in the
// global scope, else in the caller's own scope: PyTorch's libcudart is a dependency of an extension
// Python dlopen'ed without RTLD_GLOBAL) and calls the action of cuda_hooks.hpp. The decisions are
// the ProgramSession's.
#include <dlfcn.h>
#include <pthread.h>

#include <cuda.h>
#include <cudaTypedefs.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>

#include "backends/cuda/cuda_process.hpp"
#include "cudapreload/cuda_hooks.hpp"
#include "cudapreload/device_backend.hpp"
#include "platform/symbol_lookup.hpp"
#include "platform/thread_annotations.hpp"

#define RESIDENCY_CUDA_EXPORT extern "C" __attribute__((visibility("default")))

// The first copy of this preload in the lookup order is the one that works.
RESIDENCY_CUDA_EXPORT const char residency_cuda_preload_instance[] = "residency";

namespace residency::cudapreload {

namespace {

// An address in this copy (internal linkage: never bound to another copy's symbol).
void this_copy_marker() noexcept {}
const void* self() noexcept { return reinterpret_cast<const void*>(&this_copy_marker); }

bool is_this_copy(const void* p) noexcept { return platform::object_base(p) == platform::object_base(self()); }

// Bumped around every dlclose (the preload's hook below): a library unloaded may leave a cached
// target pointing into its code, or another library may load where it was.
constinit std::atomic<std::uint64_t> g_generation{1};

// One export's real functions, one per calling object: a process may hold two CUDA runtimes (one
// library's own next to PyTorch's), each the target of its own callers, as the dynamic linker
// would have bound them. Constant-initialized: a static in each export.
struct CallerTargets {
  static constexpr std::size_t kCallers = 8;  // more calling objects resolve on every call
  struct Entry {
    std::atomic<std::uintptr_t> begin{0};  // the calling object's span; 0: free, 1: being filled
    std::atomic<std::uintptr_t> end{0};
    std::atomic<void*> fn{nullptr};
  };
  std::array<Entry, kCallers> entries{};
  std::atomic<std::uint64_t> generation{0};
};

// The real `name` for a call from `caller`: past the preload in the global scope, else in the scope
// of the caller's own object, else in any loaded object. Lock-free once cached.
void* next_function(CallerTargets& t, const char* name, const void* caller) noexcept {
  const std::uint64_t gen = g_generation.load(std::memory_order_acquire);
  if (t.generation.load(std::memory_order_acquire) != gen) {
    for (auto& e : t.entries) e.begin.store(0, std::memory_order_release);
    t.generation.store(gen, std::memory_order_release);
  }
  const auto at = reinterpret_cast<std::uintptr_t>(caller);
  for (auto& e : t.entries) {
    const std::uintptr_t b = e.begin.load(std::memory_order_acquire);
    if (b > 1 && b <= at && at < e.end.load(std::memory_order_relaxed)) return e.fn.load(std::memory_order_relaxed);
  }
  platform::ObjectSpan span;
  const bool known = caller != nullptr && platform::object_span(caller, span);
  void* f = ::dlsym(RTLD_NEXT, name);
  if (f != nullptr && is_this_copy(f)) f = nullptr;
  if (f == nullptr && known) f = platform::find_in_object(span.path, name, self());
  if (f == nullptr) f = platform::find_anywhere(name, self());
  if (f == nullptr || !known || g_generation.load(std::memory_order_acquire) != gen) return f;
  for (auto& e : t.entries) {
    std::uintptr_t expected = 0;
    if (!e.begin.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) continue;
    e.fn.store(f, std::memory_order_relaxed);
    e.end.store(span.end, std::memory_order_relaxed);
    e.begin.store(span.begin, std::memory_order_release);
    break;
  }
  return f;
}

constexpr const char* kWithout = "; the program runs without residency";

constinit std::atomic<ProgramSession*> g_session{nullptr};
constinit std::atomic<bool> g_made{false};
constinit std::atomic<bool> g_forked{false};
constinit Mutex g_make_mu;
constinit std::atomic<unsigned> g_warned{0};  // warn_once keys said
constinit std::atomic<const preload::SessionLog*> g_log{nullptr};

void on_fork_child() {
  g_forked.store(true, std::memory_order_relaxed);
  if (ProgramSession* s = g_session.load(std::memory_order_acquire)) s->forked();
}

void warn(const std::string& line) noexcept {
  if (const preload::SessionLog* log = g_log.load(std::memory_order_acquire)) log->warn(line);
  else preload::SessionLog().warn(line);
}

Result<std::shared_ptr<Backend>> mapping_backend(int device, const Config&);

ProgramSession* make_session() noexcept {
  try {
    auto config = Config::from_env();
    if (!config) {
      std::string msg = config.message();
      for (std::size_t p = msg.find('\n'); p != std::string::npos; p = msg.find('\n', p))
        msg.replace(p, 1, kWithout + std::string("; "));
      warn(msg + kWithout);
      return nullptr;
    }
    const preload::SessionLog log(config->log_level, config->log_time);
    if (const void* first = ::dlsym(RTLD_DEFAULT, "residency_cuda_preload_instance");
        first != nullptr && !is_this_copy(first)) {
      log.warn("a second copy of the CUDA preload is loaded; this copy stays out of the way");
      return nullptr;
    }
    // The llama.cpp preload manages a llama.cpp program's device memory itself (its buffers, its
    // decodes): one of them, never both.
    if (::dlsym(RTLD_DEFAULT, "residency_preload_instance") != nullptr) {
      log.warn(
          "libresidency_preload.so is loaded too and manages this program's device memory; the CUDA preload "
          "(libresidency_cuda.so) stays out of the way");
      return nullptr;
    }
    if (const int err = ::pthread_atfork(nullptr, nullptr, &on_fork_child); err != 0) {
      log.warn(std::string("pthread_atfork failed (") + std::strerror(err) + ")" + kWithout);
      return nullptr;
    }
    ProgramSession::Options o;
    o.config = *config;
    o.backends = &preload::cuda_device_backend;
    o.mapping_backends = &mapping_backend;
    // Never destroyed, like the session: a scheduler thread may read it while exit() runs.
    o.clock = new SteadyClock;
    auto* s = new ProgramSession(std::move(o));
    g_log.store(&s->log(), std::memory_order_release);
    return s;
  } catch (...) {
    return nullptr;  // out of memory while starting: pass through
  }
}

// The one session, made at the first CUDA call that needs it (leaked on purpose: threads of the
// program may still call CUDA while exit() runs).
ProgramSession* session() noexcept {
  if (g_forked.load(std::memory_order_relaxed)) return nullptr;
  if (g_made.load(std::memory_order_acquire)) return g_session.load(std::memory_order_acquire);
  MutexLock lock(g_make_mu);
  if (!g_made.load(std::memory_order_relaxed)) {
    g_session.store(make_session(), std::memory_order_release);
    g_made.store(true, std::memory_order_release);
  }
  return g_session.load(std::memory_order_acquire);
}

int driver_device() noexcept {
  // One driver per process: found once, wherever it is (no caller of the program's to follow).
  static std::atomic<void*> found{nullptr};
  void* f = found.load(std::memory_order_acquire);
  if (f == nullptr) {
    static CallerTargets next;
    f = next_function(next, "cuCtxGetDevice", nullptr);
    found.store(f, std::memory_order_release);
  }
  const auto get = reinterpret_cast<PFN_cuCtxGetDevice_v2000>(f);
  CUdevice d = -1;
  return get != nullptr && get(&d) == CUDA_SUCCESS ? static_cast<int>(d) : -1;
}

// The backend of each device's memory the program maps itself: one per device, made on first
// need and kept for the process's life (the session's mapping manager and the hooks share it).
// Never destroyed, like the session: at exit the driver may be gone before a destructor runs.
constinit Mutex g_mappings_mu;
std::shared_ptr<cuda::ProgramMappings>* const g_mapping_backends =
    new std::shared_ptr<cuda::ProgramMappings>[ProgramRules::kMaxDevices];

Result<std::shared_ptr<Backend>> mapping_backend(int device, const Config&) {
  if (device < 0 || device >= ProgramRules::kMaxDevices)
    return Status(ErrorCode::invalid_argument, "cuda: no device " + std::to_string(device));
  MutexLock lock(g_mappings_mu);
  auto& pm = g_mapping_backends[static_cast<std::size_t>(device)];
  if (!pm) {
    auto driver = cuda::CudaProcess::instance().driver();
    if (!driver) return driver.status();
    auto made = cuda::ProgramMappings::create(**driver, device);
    if (!made) return made.status();
    pm = *made;
  }
  return std::shared_ptr<Backend>(pm);
}

cuda::ProgramMappings* mappings_of_device(int device) noexcept {
  try {
    auto b = mapping_backend(device, Config{});
    return b ? static_cast<cuda::ProgramMappings*>(b->get()) : nullptr;
  } catch (...) {
    return nullptr;
  }
}

void warn_once(int key, const char* line) noexcept {
  const unsigned bit = 1U << (static_cast<unsigned>(key) & 31U);
  if ((g_warned.fetch_or(bit, std::memory_order_relaxed) & bit) == 0) warn(line);
}

// Set before any hook runs (a constructor of this library).
[[gnu::constructor]] void install_env() {
  HookEnv env;
  env.session = &session;
  env.driver_device = &driver_device;
  env.warn_once = &warn_once;
  env.mappings = &mappings_of_device;
  set_hook_env(env);
}

// ---- The runtime API (libcudart as a shared library), without its headers ----

using cudaError_t = int;
constexpr cudaError_t kCudaSuccess = 0;
constexpr cudaError_t kCudaErrorMemoryAllocation = 2;
constexpr cudaError_t kCudaErrorInitialization = 3;
struct Dim3 {
  unsigned x, y, z;
};

int runtime_device(const void* caller) noexcept {
  static CallerTargets next;
  const auto get = reinterpret_cast<cudaError_t (*)(int*)>(next_function(next, "cudaGetDevice", caller));
  int d = -1;
  return get != nullptr && get(&d) == kCudaSuccess ? d : -1;
}

}  // namespace

}  // namespace residency::cudapreload

namespace rc = residency::cudapreload;

// The real function of the exported `sym` (type `Fn`), or return `missing` from the hook.
#define RESIDENCY_NEXT(Fn, sym, missing)                                                                    \
  static rc::CallerTargets next_##sym;                                                                      \
  const auto next = reinterpret_cast<Fn>(rc::next_function(next_##sym, #sym, __builtin_return_address(0))); \
  if (next == nullptr) return missing

// ---- The driver API by symbol (programs and libraries linked with -lcuda) ----
// Each goes through the same wrapper cuGetProcAddress hands out, at this build's CUDA version.
#define RESIDENCY_DRIVER_EXPORT(sym, base, Fn, params, args)                                                     \
  RESIDENCY_CUDA_EXPORT CUresult CUDAAPI sym params {                                                            \
    RESIDENCY_NEXT(Fn, sym, CUDA_ERROR_NOT_INITIALIZED);                                                         \
    return reinterpret_cast<Fn>(rc::wrap_driver(base, CUDA_VERSION, false, reinterpret_cast<void*>(next))) args; \
  }

RESIDENCY_DRIVER_EXPORT(cuMemAlloc_v2, "cuMemAlloc", PFN_cuMemAlloc_v3020, (CUdeviceptr * p, size_t n), (p, n))
RESIDENCY_DRIVER_EXPORT(cuMemFree_v2, "cuMemFree", PFN_cuMemFree_v3020, (CUdeviceptr p), (p))
RESIDENCY_DRIVER_EXPORT(cuMemAllocAsync, "cuMemAllocAsync", PFN_cuMemAllocAsync_v11020,
                        (CUdeviceptr * p, size_t n, CUstream s), (p, n, s))
RESIDENCY_DRIVER_EXPORT(cuMemFreeAsync, "cuMemFreeAsync", PFN_cuMemFreeAsync_v11020, (CUdeviceptr p, CUstream s), (p, s))
RESIDENCY_DRIVER_EXPORT(cuLaunchKernel, "cuLaunchKernel", PFN_cuLaunchKernel_v4000,
                        (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                         unsigned shmem, CUstream s, void** params, void** extra),
                        (f, gx, gy, gz, bx, by, bz, shmem, s, params, extra))
RESIDENCY_DRIVER_EXPORT(cuLaunchKernelEx, "cuLaunchKernelEx", PFN_cuLaunchKernelEx_v11060,
                        (const CUlaunchConfig* c, CUfunction f, void** params, void** extra), (c, f, params, extra))
RESIDENCY_DRIVER_EXPORT(cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel", PFN_cuLaunchCooperativeKernel_v9000,
                        (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                         unsigned shmem, CUstream s, void** params),
                        (f, gx, gy, gz, bx, by, bz, shmem, s, params))
RESIDENCY_DRIVER_EXPORT(cuGraphLaunch, "cuGraphLaunch", PFN_cuGraphLaunch_v10000, (CUgraphExec g, CUstream s), (g, s))
RESIDENCY_DRIVER_EXPORT(cuMemcpy, "cuMemcpy", PFN_cuMemcpy_v4000, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))
RESIDENCY_DRIVER_EXPORT(cuMemcpyAsync, "cuMemcpyAsync", PFN_cuMemcpyAsync_v4000,
                        (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st))
RESIDENCY_DRIVER_EXPORT(cuMemcpyHtoD_v2, "cuMemcpyHtoD", PFN_cuMemcpyHtoD_v3020,
                        (CUdeviceptr d, const void* s, size_t n), (d, s, n))
RESIDENCY_DRIVER_EXPORT(cuMemcpyHtoDAsync_v2, "cuMemcpyHtoDAsync", PFN_cuMemcpyHtoDAsync_v3020,
                        (CUdeviceptr d, const void* s, size_t n, CUstream st), (d, s, n, st))
RESIDENCY_DRIVER_EXPORT(cuMemcpyDtoH_v2, "cuMemcpyDtoH", PFN_cuMemcpyDtoH_v3020, (void* d, CUdeviceptr s, size_t n),
                        (d, s, n))
RESIDENCY_DRIVER_EXPORT(cuMemcpyDtoHAsync_v2, "cuMemcpyDtoHAsync", PFN_cuMemcpyDtoHAsync_v3020,
                        (void* d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st))
RESIDENCY_DRIVER_EXPORT(cuMemcpyDtoD_v2, "cuMemcpyDtoD", PFN_cuMemcpyDtoD_v3020,
                        (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))
RESIDENCY_DRIVER_EXPORT(cuMemcpyDtoDAsync_v2, "cuMemcpyDtoDAsync", PFN_cuMemcpyDtoDAsync_v3020,
                        (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st))
RESIDENCY_DRIVER_EXPORT(cuMemcpy2D_v2, "cuMemcpy2D", PFN_cuMemcpy2D_v3020, (const CUDA_MEMCPY2D* p), (p))
RESIDENCY_DRIVER_EXPORT(cuMemcpy2DAsync_v2, "cuMemcpy2DAsync", PFN_cuMemcpy2DAsync_v3020,
                        (const CUDA_MEMCPY2D* p, CUstream st), (p, st))
RESIDENCY_DRIVER_EXPORT(cuMemcpy3D_v2, "cuMemcpy3D", PFN_cuMemcpy3D_v3020, (const CUDA_MEMCPY3D* p), (p))
RESIDENCY_DRIVER_EXPORT(cuMemcpy3DAsync_v2, "cuMemcpy3DAsync", PFN_cuMemcpy3DAsync_v3020,
                        (const CUDA_MEMCPY3D* p, CUstream st), (p, st))
RESIDENCY_DRIVER_EXPORT(cuMemcpyPeer, "cuMemcpyPeer", PFN_cuMemcpyPeer_v4000,
                        (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n), (d, dc, s, sc, n))
RESIDENCY_DRIVER_EXPORT(cuMemcpyPeerAsync, "cuMemcpyPeerAsync", PFN_cuMemcpyPeerAsync_v4000,
                        (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n, CUstream st),
                        (d, dc, s, sc, n, st))
RESIDENCY_DRIVER_EXPORT(cuMemsetD8_v2, "cuMemsetD8", PFN_cuMemsetD8_v3020, (CUdeviceptr d, unsigned char v, size_t n),
                        (d, v, n))
RESIDENCY_DRIVER_EXPORT(cuMemsetD8Async, "cuMemsetD8Async", PFN_cuMemsetD8Async_v3020,
                        (CUdeviceptr d, unsigned char v, size_t n, CUstream st), (d, v, n, st))
RESIDENCY_DRIVER_EXPORT(cuMemsetD16_v2, "cuMemsetD16", PFN_cuMemsetD16_v3020,
                        (CUdeviceptr d, unsigned short v, size_t n), (d, v, n))
RESIDENCY_DRIVER_EXPORT(cuMemsetD16Async, "cuMemsetD16Async", PFN_cuMemsetD16Async_v3020,
                        (CUdeviceptr d, unsigned short v, size_t n, CUstream st), (d, v, n, st))
RESIDENCY_DRIVER_EXPORT(cuMemsetD32_v2, "cuMemsetD32", PFN_cuMemsetD32_v3020, (CUdeviceptr d, unsigned int v, size_t n),
                        (d, v, n))
RESIDENCY_DRIVER_EXPORT(cuMemsetD32Async, "cuMemsetD32Async", PFN_cuMemsetD32Async_v3020,
                        (CUdeviceptr d, unsigned int v, size_t n, CUstream st), (d, v, n, st))
RESIDENCY_DRIVER_EXPORT(cuIpcGetMemHandle, "cuIpcGetMemHandle", PFN_cuIpcGetMemHandle_v4010,
                        (CUipcMemHandle * h, CUdeviceptr p), (h, p))
RESIDENCY_DRIVER_EXPORT(cuMemCreate, "cuMemCreate", PFN_cuMemCreate_v10020,
                        (CUmemGenericAllocationHandle * h, size_t n, const CUmemAllocationProp* prop,
                         unsigned long long flags),
                        (h, n, prop, flags))
RESIDENCY_DRIVER_EXPORT(cuMemAllocManaged, "cuMemAllocManaged", PFN_cuMemAllocManaged_v6000,
                        (CUdeviceptr * p, size_t n, unsigned int flags), (p, n, flags))
RESIDENCY_DRIVER_EXPORT(cuMemRelease, "cuMemRelease", PFN_cuMemRelease_v10020, (CUmemGenericAllocationHandle h), (h))
RESIDENCY_DRIVER_EXPORT(cuMemMap, "cuMemMap", PFN_cuMemMap_v10020,
                        (CUdeviceptr va, size_t n, size_t off, CUmemGenericAllocationHandle h, unsigned long long f),
                        (va, n, off, h, f))
RESIDENCY_DRIVER_EXPORT(cuMemUnmap, "cuMemUnmap", PFN_cuMemUnmap_v10020, (CUdeviceptr va, size_t n), (va, n))
RESIDENCY_DRIVER_EXPORT(cuMemSetAccess, "cuMemSetAccess", PFN_cuMemSetAccess_v10020,
                        (CUdeviceptr va, size_t n, const CUmemAccessDesc* d, size_t c), (va, n, d, c))
RESIDENCY_DRIVER_EXPORT(cuMemExportToShareableHandle, "cuMemExportToShareableHandle",
                        PFN_cuMemExportToShareableHandle_v10020,
                        (void* out, CUmemGenericAllocationHandle h, CUmemAllocationHandleType t, unsigned long long f),
                        (out, h, t, f))
RESIDENCY_DRIVER_EXPORT(cuMemGetAllocationPropertiesFromHandle, "cuMemGetAllocationPropertiesFromHandle",
                        PFN_cuMemGetAllocationPropertiesFromHandle_v10020,
                        (CUmemAllocationProp * p, CUmemGenericAllocationHandle h), (p, h))
RESIDENCY_DRIVER_EXPORT(cuStreamBeginCapture_v2, "cuStreamBeginCapture", PFN_cuStreamBeginCapture_v10010,
                        (CUstream s, CUstreamCaptureMode mode), (s, mode))
RESIDENCY_DRIVER_EXPORT(cuStreamBeginCaptureToGraph, "cuStreamBeginCaptureToGraph", PFN_cuStreamBeginCaptureToGraph_v12030,
                        (CUstream s, CUgraph g, const CUgraphNode* deps, const CUgraphEdgeData* edges, size_t n,
                         CUstreamCaptureMode mode),
                        (s, g, deps, edges, n, mode))
RESIDENCY_DRIVER_EXPORT(cuStreamEndCapture, "cuStreamEndCapture", PFN_cuStreamEndCapture_v10000,
                        (CUstream s, CUgraph* g), (s, g))
RESIDENCY_DRIVER_EXPORT(cuPointerGetAttribute, "cuPointerGetAttribute", PFN_cuPointerGetAttribute_v4000,
                        (void* data, CUpointer_attribute a, CUdeviceptr p), (data, a, p))
RESIDENCY_DRIVER_EXPORT(cuPointerGetAttributes, "cuPointerGetAttributes", PFN_cuPointerGetAttributes_v7000,
                        (unsigned n, CUpointer_attribute* a, void** data, CUdeviceptr p), (n, a, data, p))
#undef RESIDENCY_DRIVER_EXPORT

// ---- Entry points handed out: the wrapper instead of each hooked function ----

namespace residency::cudapreload {
namespace {

void* hand_out(const char* symbol, void* real, int cuda_version, std::uint64_t flags) noexcept;

}  // namespace
}  // namespace residency::cudapreload

RESIDENCY_CUDA_EXPORT CUresult CUDAAPI cuGetProcAddress_v2(const char* symbol, void** pfn, int cuda_version,
                                                           cuuint64_t flags, CUdriverProcAddressQueryResult* found) {
  RESIDENCY_NEXT(PFN_cuGetProcAddress_v12000, cuGetProcAddress_v2, CUDA_ERROR_NOT_INITIALIZED);
  const CUresult r = next(symbol, pfn, cuda_version, flags, found);
  if (r == CUDA_SUCCESS && pfn != nullptr) *pfn = rc::hand_out(symbol, *pfn, cuda_version, flags);
  return r;
}

// The CUDA 11.3-11.8 form ("cuGetProcAddress" without _v2; <cuda.h> renames the name itself).
extern "C" CUresult CUDAAPI residency_cuGetProcAddress_v1(const char* symbol, void** pfn, int cuda_version,
                                                          cuuint64_t flags) __asm__("cuGetProcAddress");
RESIDENCY_CUDA_EXPORT CUresult CUDAAPI residency_cuGetProcAddress_v1(const char* symbol, void** pfn, int cuda_version,
                                                                     cuuint64_t flags) {
  RESIDENCY_NEXT(PFN_cuGetProcAddress_v11030, cuGetProcAddress, CUDA_ERROR_NOT_INITIALIZED);
  const CUresult r = next(symbol, pfn, cuda_version, flags);
  if (r == CUDA_SUCCESS && pfn != nullptr) *pfn = rc::hand_out(symbol, *pfn, cuda_version, flags);
  return r;
}

namespace residency::cudapreload {
namespace {

void* hand_out(const char* symbol, void* real, int cuda_version, std::uint64_t flags) noexcept {
  if (symbol == nullptr || real == nullptr) return real;
  // Asked for cuGetProcAddress itself, the caller gets the preload's, so that what it looks up
  // next is handed out here too.
  if (std::strcmp(symbol, "cuGetProcAddress") == 0)
    return cuda_version >= 12000 ? reinterpret_cast<void*>(&::cuGetProcAddress_v2)
                                 : reinterpret_cast<void*>(&::residency_cuGetProcAddress_v1);
  return wrap_driver(symbol, cuda_version, (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0, real);
}

}  // namespace
}  // namespace residency::cudapreload

// cudaGetDriverEntryPoint (the runtime's version) and ...ByVersion: the same hand-out.
RESIDENCY_CUDA_EXPORT rc::cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned version,
                                                                       unsigned long long flags, int* status) {
  RESIDENCY_NEXT(rc::cudaError_t(*)(const char*, void**, unsigned, unsigned long long, int*),
                 cudaGetDriverEntryPointByVersion, rc::kCudaErrorInitialization);
  const rc::cudaError_t r = next(symbol, fn, version, flags, status);
  // cudaEnablePerThreadDefaultStream is 2 (driver_types.h)
  if (r == rc::kCudaSuccess && fn != nullptr)
    *fn = rc::hand_out(symbol, *fn, static_cast<int>(version),
                       (flags & 2U) != 0 ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : 0);
  return r;
}

RESIDENCY_CUDA_EXPORT rc::cudaError_t cudaGetDriverEntryPoint(const char* symbol, void** fn, unsigned long long flags,
                                                              int* status) {
  RESIDENCY_NEXT(rc::cudaError_t(*)(const char*, void**, unsigned long long, int*), cudaGetDriverEntryPoint,
                 rc::kCudaErrorInitialization);
  const rc::cudaError_t r = next(symbol, fn, flags, status);
  if (r != rc::kCudaSuccess || fn == nullptr) return r;
  // The ABI given is the runtime's own version's.
  static rc::CallerTargets next_version;
  const auto version_of = reinterpret_cast<rc::cudaError_t (*)(int*)>(
      rc::next_function(next_version, "cudaRuntimeGetVersion", __builtin_return_address(0)));
  int version = 0;
  if (version_of == nullptr || version_of(&version) != rc::kCudaSuccess) version = CUDA_VERSION;
  *fn = rc::hand_out(symbol, *fn, version, (flags & 2U) != 0 ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : 0);
  return r;
}

// ---- The runtime API: allocations ----

namespace {

template <class Real>
rc::cudaError_t runtime_alloc(void** p, size_t n, const void* caller, Real real) noexcept {
  if (p != nullptr && rc::may_route(n)) {
    const auto a = rc::route_allocation(rc::runtime_device(caller), n);
    if (a.outcome == rc::ProgramSession::Allocation::Outcome::routed) return *p = a.ptr, rc::kCudaSuccess;
    if (a.outcome == rc::ProgramSession::Allocation::Outcome::out_of_memory) return rc::kCudaErrorMemoryAllocation;
  }
  return real();
}

}  // namespace

RESIDENCY_CUDA_EXPORT rc::cudaError_t cudaMalloc(void** p, size_t n) {
  RESIDENCY_NEXT(rc::cudaError_t(*)(void**, size_t), cudaMalloc, rc::kCudaErrorInitialization);
  return runtime_alloc(p, n, __builtin_return_address(0), [&] { return next(p, n); });
}
RESIDENCY_CUDA_EXPORT rc::cudaError_t cudaFree(void* p) {
  RESIDENCY_NEXT(rc::cudaError_t(*)(void*), cudaFree, rc::kCudaErrorInitialization);
  return rc::route_free(p) ? rc::kCudaSuccess : next(p);
}
RESIDENCY_CUDA_EXPORT rc::cudaError_t cudaMallocAsync(void** p, size_t n, CUstream s) {
  RESIDENCY_NEXT(rc::cudaError_t(*)(void**, size_t, CUstream), cudaMallocAsync, rc::kCudaErrorInitialization);
  return runtime_alloc(p, n, __builtin_return_address(0), [&] { return next(p, n, s); });
}
RESIDENCY_CUDA_EXPORT rc::cudaError_t cudaMallocAsync_ptsz(void** p, size_t n, CUstream s) {
  RESIDENCY_NEXT(rc::cudaError_t(*)(void**, size_t, CUstream), cudaMallocAsync_ptsz, rc::kCudaErrorInitialization);
  return runtime_alloc(p, n, __builtin_return_address(0), [&] { return next(p, n, s); });
}
RESIDENCY_CUDA_EXPORT rc::cudaError_t cudaFreeAsync(void* p, CUstream s) {
  RESIDENCY_NEXT(rc::cudaError_t(*)(void*, CUstream), cudaFreeAsync, rc::kCudaErrorInitialization);
  return rc::route_free(p) ? rc::kCudaSuccess : next(p, s);
}
RESIDENCY_CUDA_EXPORT rc::cudaError_t cudaFreeAsync_ptsz(void* p, CUstream s) {
  RESIDENCY_NEXT(rc::cudaError_t(*)(void*, CUstream), cudaFreeAsync_ptsz, rc::kCudaErrorInitialization);
  return rc::route_free(p) ? rc::kCudaSuccess : next(p, s);
}
RESIDENCY_CUDA_EXPORT rc::cudaError_t cudaMallocManaged(void** p, size_t n, unsigned flags) {
  RESIDENCY_NEXT(rc::cudaError_t(*)(void**, size_t, unsigned), cudaMallocManaged, rc::kCudaErrorInitialization);
  rc::unmanaged_memory(rc::kManagedMemory, "cudaMallocManaged");
  return next(p, n, flags);
}
RESIDENCY_CUDA_EXPORT rc::cudaError_t cudaIpcGetMemHandle(void* handle, void* p) {
  RESIDENCY_NEXT(rc::cudaError_t(*)(void*, void*), cudaIpcGetMemHandle, rc::kCudaErrorInitialization);
  rc::ipc_export(p, "cudaIpcGetMemHandle");
  return next(handle, p);
}

// ---- The runtime API: uses (each also in its per-thread default stream form) ----

// A use around the call; `dst, bytes`: what it writes on the device (checked against routed memory).
#define RESIDENCY_RUNTIME_USE(sym, params, args, dst, bytes)                                          \
  RESIDENCY_CUDA_EXPORT rc::cudaError_t sym params {                                                  \
    RESIDENCY_NEXT(rc::cudaError_t(*) params, sym, rc::kCudaErrorInitialization);                     \
    const auto use = rc::use_device();                                                                \
    if (!use.status()) return rc::kCudaErrorMemoryAllocation; /* never on memory that is not there */ \
    rc::device_written(dst, bytes);                                                                   \
    return next args;                                                                                 \
  }
#define RESIDENCY_RUNTIME_USE2(sym, params, args, dst, bytes) \
  RESIDENCY_RUNTIME_USE(sym, params, args, dst, bytes)        \
  RESIDENCY_RUNTIME_USE(sym##_ptsz, params, args, dst, bytes)
#define RESIDENCY_RUNTIME_USE2_PTDS(sym, params, args, dst, bytes) \
  RESIDENCY_RUNTIME_USE(sym, params, args, dst, bytes)             \
  RESIDENCY_RUNTIME_USE(sym##_ptds, params, args, dst, bytes)

RESIDENCY_RUNTIME_USE2(cudaLaunchKernel, (const void* f, rc::Dim3 g, rc::Dim3 b, void** a, size_t shmem, CUstream s),
                       (f, g, b, a, shmem, s), nullptr, 0)
RESIDENCY_RUNTIME_USE2(cudaLaunchKernelExC, (const void* config, const void* f, void** a), (config, f, a), nullptr, 0)
RESIDENCY_RUNTIME_USE2(cudaLaunchCooperativeKernel,
                       (const void* f, rc::Dim3 g, rc::Dim3 b, void** a, size_t shmem, CUstream s),
                       (f, g, b, a, shmem, s), nullptr, 0)
RESIDENCY_RUNTIME_USE2(cudaGraphLaunch, (CUgraphExec g, CUstream s), (g, s), nullptr, 0)
RESIDENCY_RUNTIME_USE2_PTDS(cudaMemcpy, (void* d, const void* s, size_t n, int kind), (d, s, n, kind), d, n)
RESIDENCY_RUNTIME_USE2(cudaMemcpyAsync, (void* d, const void* s, size_t n, int kind, CUstream st), (d, s, n, kind, st),
                       d, n)
RESIDENCY_RUNTIME_USE2_PTDS(cudaMemcpy2D, (void* d, size_t dp, const void* s, size_t sp, size_t w, size_t h, int kind),
                            (d, dp, s, sp, w, h, kind), d, h*(dp > w ? dp : w))
RESIDENCY_RUNTIME_USE2(cudaMemcpy2DAsync,
                       (void* d, size_t dp, const void* s, size_t sp, size_t w, size_t h, int kind, CUstream st),
                       (d, dp, s, sp, w, h, kind, st), d, h*(dp > w ? dp : w))
RESIDENCY_RUNTIME_USE2_PTDS(cudaMemset, (void* d, int v, size_t n), (d, v, n), d, n)
RESIDENCY_RUNTIME_USE2(cudaMemsetAsync, (void* d, int v, size_t n, CUstream st), (d, v, n, st), d, n)
RESIDENCY_RUNTIME_USE(cudaMemcpyPeer, (void* d, int dd, const void* s, int sd, size_t n), (d, dd, s, sd, n), d, n)
RESIDENCY_RUNTIME_USE(cudaMemcpyPeerAsync, (void* d, int dd, const void* s, int sd, size_t n, CUstream st),
                      (d, dd, s, sd, n, st), d, n)
#undef RESIDENCY_RUNTIME_USE2_PTDS
#undef RESIDENCY_RUNTIME_USE2
#undef RESIDENCY_RUNTIME_USE

// ---- The runtime API: stream capture (everything held awake while a graph is recorded) ----

#define RESIDENCY_RUNTIME_BEGIN_CAPTURE(sym, params, args)                        \
  RESIDENCY_CUDA_EXPORT rc::cudaError_t sym params {                              \
    RESIDENCY_NEXT(rc::cudaError_t(*) params, sym, rc::kCudaErrorInitialization); \
    rc::capture_began(s);                                                         \
    const rc::cudaError_t r = next args;                                          \
    if (r != rc::kCudaSuccess) rc::capture_ended(s);                              \
    return r;                                                                     \
  }
RESIDENCY_RUNTIME_BEGIN_CAPTURE(cudaStreamBeginCapture, (CUstream s, int mode), (s, mode))
RESIDENCY_RUNTIME_BEGIN_CAPTURE(cudaStreamBeginCapture_ptsz, (CUstream s, int mode), (s, mode))
RESIDENCY_RUNTIME_BEGIN_CAPTURE(cudaStreamBeginCaptureToGraph,
                                (CUstream s, CUgraph g, const void* deps, const void* edges, size_t n, int mode),
                                (s, g, deps, edges, n, mode))
RESIDENCY_RUNTIME_BEGIN_CAPTURE(cudaStreamBeginCaptureToGraph_ptsz,
                                (CUstream s, CUgraph g, const void* deps, const void* edges, size_t n, int mode),
                                (s, g, deps, edges, n, mode))
#undef RESIDENCY_RUNTIME_BEGIN_CAPTURE
#define RESIDENCY_RUNTIME_END_CAPTURE(sym)                                                      \
  RESIDENCY_CUDA_EXPORT rc::cudaError_t sym(CUstream s, CUgraph* g) {                           \
    RESIDENCY_NEXT(rc::cudaError_t (*)(CUstream, CUgraph*), sym, rc::kCudaErrorInitialization); \
    const rc::cudaError_t r = next(s, g);                                                       \
    rc::capture_ended(s);                                                                       \
    return r;                                                                                   \
  }
RESIDENCY_RUNTIME_END_CAPTURE(cudaStreamEndCapture)
RESIDENCY_RUNTIME_END_CAPTURE(cudaStreamEndCapture_ptsz)
#undef RESIDENCY_RUNTIME_END_CAPTURE

// A pointer's attributes: asleep, its range has no memory behind it to describe.
RESIDENCY_CUDA_EXPORT rc::cudaError_t cudaPointerGetAttributes(void* attributes, const void* p) {
  RESIDENCY_NEXT(rc::cudaError_t(*)(void*, const void*), cudaPointerGetAttributes, rc::kCudaErrorInitialization);
  const auto use = rc::use_device();
  return next(attributes, p);
}

// ---- dlclose: a library unloaded invalidates the cached targets (forwarded as it came) ----

RESIDENCY_CUDA_EXPORT int dlclose(void* handle) {
  static std::atomic<void*> real{nullptr};
  auto fn = reinterpret_cast<int (*)(void*)>(real.load(std::memory_order_acquire));
  if (fn == nullptr) {
    fn = reinterpret_cast<int (*)(void*)>(::dlsym(RTLD_NEXT, "dlclose"));
    if (fn == nullptr) return -1;
    real.store(reinterpret_cast<void*>(fn), std::memory_order_release);
  }
  rc::g_generation.fetch_add(1, std::memory_order_acq_rel);
  const int r = fn(handle);
  rc::g_generation.fetch_add(1, std::memory_order_acq_rel);
  return r;
}

// ---- The program's own calls (python/residency_cuda.py's, through ctypes) ----

// 0, or -1 with errno EINVAL (unknown tag) or E2BIG (regions nested deeper than kMaxRegionDepth).
RESIDENCY_CUDA_EXPORT int residency_cuda_region_push(const char* tag) {
  const auto t = rc::parse_tag(tag != nullptr ? tag : "");
  if (!t) return errno = EINVAL, -1;
  return rc::push_region(*t) ? 0 : (errno = E2BIG, -1);
}
RESIDENCY_CUDA_EXPORT int residency_cuda_region_pop(void) { return rc::pop_region() ? 0 : (errno = EINVAL, -1); }
// The bytes of routed allocations wholly inside [ptr, ptr + bytes) that carry `tag` now; -1 with
// errno EINVAL for an unknown tag.
RESIDENCY_CUDA_EXPORT long long residency_cuda_tag(const void* ptr, size_t bytes, const char* tag) {
  const auto t = rc::parse_tag(tag != nullptr ? tag : "");
  if (!t) return errno = EINVAL, -1;
  rc::ProgramSession* s = rc::session();
  return s != nullptr ? static_cast<long long>(s->tag(ptr, bytes, *t)) : 0;
}
RESIDENCY_CUDA_EXPORT int residency_cuda_sleep(void) {
  if (rc::ProgramSession* s = rc::session()) s->sleep_now();
  return 0;
}
// 0, or -1 with errno EIO when device memory could not be woken (said in the log).
RESIDENCY_CUDA_EXPORT int residency_cuda_wake(void) {
  rc::ProgramSession* s = rc::session();
  if (s == nullptr) return 0;
  const residency::Status st = s->wake_now();
  if (st) return 0;
  s->log().warn("wake: " + st.message());
  return errno = EIO, -1;
}
// Bytes of device memory the preload manages now (awake or asleep); 0 when it manages none.
RESIDENCY_CUDA_EXPORT unsigned long long residency_cuda_managed_bytes(void) {
  rc::ProgramSession* s = rc::session();
  return s != nullptr ? s->routed_bytes() + s->mapping_bytes() : 0;
}
