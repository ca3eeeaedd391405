// SPDX-License-Identifier: MIT
#include "cuda_hooks.hpp"

#include <cudaTypedefs.h>

#include <atomic>
#include <cstring>
#include <string>

namespace residency::cudapreload {

namespace {

constinit HookEnv g_env{};

ProgramSession* session() noexcept { return g_env.session != nullptr ? g_env.session() : nullptr; }

[[gnu::tls_model("initial-exec")]] thread_local Tag t_regions[kMaxRegionDepth];
[[gnu::tls_model("initial-exec")]] thread_local int t_depth = 0;

}  // namespace

void set_hook_env(const HookEnv& env) noexcept { g_env = env; }
const HookEnv& hook_env() noexcept { return g_env; }

bool push_region(Tag tag) noexcept {
  if (t_depth >= kMaxRegionDepth) return false;
  t_regions[t_depth++] = tag;
  return true;
}
bool pop_region() noexcept {
  if (t_depth == 0) return false;
  --t_depth;
  return true;
}
Tag current_region() noexcept { return t_depth > 0 ? t_regions[t_depth - 1] : Tag::unknown; }

bool may_route(std::size_t size) noexcept {
  if (size < ProgramRules::kMinRoutedBytes) return false;
  const ProgramSession* s = session();
  return s != nullptr && s->routes();
}

ProgramSession::Allocation route_allocation(int device, std::size_t size) noexcept {
  if (size < ProgramRules::kMinRoutedBytes || device < 0) return {};
  ProgramSession* s = session();
  return s != nullptr ? s->allocate(device, size, current_region()) : ProgramSession::Allocation{};
}

bool route_free(void* ptr) noexcept {
  ProgramSession* s = session();
  return s != nullptr && s->free(ptr);
}

ProgramSession::Use use_device() noexcept {
  ProgramSession* s = session();
  return s != nullptr ? s->use() : ProgramSession::Use{};
}

void capture_began(const void* stream) noexcept {
  if (ProgramSession* s = session()) s->capture_began(stream);
}
void capture_ended(const void* stream) noexcept {
  if (ProgramSession* s = session()) s->capture_ended(stream);
}

void device_written(const void* dst, std::size_t bytes) noexcept {
  if (ProgramSession* s = session()) s->written(dst, bytes);
}

void ipc_export(const void* ptr, const char* call) noexcept {
  ProgramSession* s = session();
  if (s == nullptr || s->stood_aside() || !s->routed(ptr)) return;
  s->stand_aside(std::string("the program exports device memory the preload manages over CUDA IPC (") + call +
                 "), which another process could not open");
}

void unmanaged_memory(int key, const char* call) noexcept {
  const ProgramSession* s = session();
  if (g_env.warn_once == nullptr || s == nullptr || !s->routes()) return;  // residency is off: nothing to say
  try {
    std::string line;
    if (key == kManagedMemory)
      line = std::string("the program allocates managed (unified) memory (") + call +
             "): the driver moves it, and it is neither put to sleep nor counted against a budget";
    else if (key == kOwnMappings)
      line = std::string("the program maps physical device memory itself (") + call +
             ", as PyTorch's expandable_segments does): that memory stays on the GPU (no sleep) and counts "
             "against no budget; without expandable_segments its allocations are managed";
    else line = std::string(call);
    g_env.warn_once(key, line.c_str());
  } catch (...) {
  }
}

namespace {

// ---- The driver's functions the preload wraps ----

enum Index : int {
  kMemAlloc,
  kMemFree,
  kMemAllocAsync,
  kMemFreeAsync,
  kLaunchKernel,
  kLaunchKernelEx,
  kLaunchCooperativeKernel,
  kGraphLaunch,
  kMemcpy,
  kMemcpyAsync,
  kMemcpyHtoD,
  kMemcpyHtoDAsync,
  kMemcpyDtoH,
  kMemcpyDtoHAsync,
  kMemcpyDtoD,
  kMemcpyDtoDAsync,
  kMemcpy2D,
  kMemcpy2DAsync,
  kMemcpy3D,
  kMemcpy3DAsync,
  kMemcpyPeer,
  kMemcpyPeerAsync,
  kMemsetD8,
  kMemsetD8Async,
  kMemsetD16,
  kMemsetD16Async,
  kMemsetD32,
  kMemsetD32Async,
  kIpcGetMemHandle,
  kMemCreate,
  kMemAllocManaged,
  kMemRelease,
  kMemMap,
  kMemUnmap,
  kMemSetAccess,
  kMemExportToShareableHandle,
  kMemGetAllocationPropertiesFromHandle,
  kStreamBeginCapture,
  kStreamBeginCaptureToGraph,
  kStreamEndCapture,
  kPointerGetAttribute,
  kPointerGetAttributes,
  kCount
};

// The real function behind each wrapper, per variant (0: default stream, 1: per-thread). Bound
// once, by the first request for it; constant-initialized.
constinit std::atomic<void*> g_real[2][kCount]{};

template <bool PT, class Fn>
Fn real(Index i) noexcept {
  return reinterpret_cast<Fn>(g_real[PT ? 1 : 0][i].load(std::memory_order_acquire));
}

int current_driver_device() noexcept { return g_env.driver_device != nullptr ? g_env.driver_device() : -1; }

CUdeviceptr as_dptr(const void* p) noexcept { return reinterpret_cast<CUdeviceptr>(p); }
const void* as_ptr(CUdeviceptr d) noexcept { return reinterpret_cast<const void*>(d); }

// ---- The program's own mappings (cuMemCreate, cuMemMap: PyTorch's expandable_segments) ----

// The mapping backends handed out so far, by device: the ones that may know a handle.
constinit std::atomic<cuda::ProgramMappings*> g_mappings[ProgramRules::kMaxDevices]{};

cuda::ProgramMappings* mappings_for(int device) noexcept {
  if (device < 0 || device >= ProgramRules::kMaxDevices || g_env.mappings == nullptr) return nullptr;
  auto& slot = g_mappings[static_cast<std::size_t>(device)];
  if (cuda::ProgramMappings* pm = slot.load(std::memory_order_acquire)) return pm;
  cuda::ProgramMappings* pm = g_env.mappings(device);
  slot.store(pm, std::memory_order_release);
  return pm;
}

// The backend that knows the program's `handle`, and its device.
cuda::ProgramMappings* mappings_of(CUmemGenericAllocationHandle handle, int* device = nullptr) noexcept {
  for (int d = 0; d < ProgramRules::kMaxDevices; ++d) {
    cuda::ProgramMappings* pm = g_mappings[static_cast<std::size_t>(d)].load(std::memory_order_acquire);
    if (pm == nullptr || !pm->properties(handle)) continue;
    if (device != nullptr) *device = d;
    return pm;
  }
  return nullptr;
}

// Where a 2D or 3D copy writes, at most: from its first destination byte over every pitch-wide row.
struct Span {
  CUdeviceptr at = 0;
  std::size_t bytes = 0;
};
Span dst_of(const CUDA_MEMCPY2D* p) noexcept {
  if (p == nullptr || (p->dstMemoryType != CU_MEMORYTYPE_DEVICE && p->dstMemoryType != CU_MEMORYTYPE_UNIFIED))
    return {};
  return {p->dstDevice + p->dstY * p->dstPitch + p->dstXInBytes, p->Height * std::max(p->dstPitch, p->WidthInBytes)};
}
Span dst_of(const CUDA_MEMCPY3D* p) noexcept {
  if (p == nullptr || (p->dstMemoryType != CU_MEMORYTYPE_DEVICE && p->dstMemoryType != CU_MEMORYTYPE_UNIFIED))
    return {};
  const std::size_t pitch = std::max(p->dstPitch, p->WidthInBytes);
  const std::size_t rows = std::max(p->dstHeight, p->Height);
  return {p->dstDevice + (p->dstZ * rows + p->dstY) * pitch + p->dstXInBytes, p->Depth * rows * pitch};
}

// What a launch, copy or memset does around the real call: opens a use (a wake first, where the
// memory sleeps), refuses with out of memory when the memory could not be woken (never run on
// memory that is not there), reports the bytes the call writes, and makes the call.
template <class Call>
CUresult enqueue(const void* dst, std::size_t bytes, Call&& call) {
  const auto u = use_device();
  if (!u.status()) return CUDA_ERROR_OUT_OF_MEMORY;
  device_written(dst, bytes);
  return call();
}

template <bool PT>
struct Wrap {
  // Allocation and free.
  static CUresult CUDAAPI MemAlloc(CUdeviceptr* dptr, size_t bytes) {
    if (dptr != nullptr && may_route(bytes)) {
      const auto a = route_allocation(current_driver_device(), bytes);
      if (a.outcome == ProgramSession::Allocation::Outcome::routed) return *dptr = as_dptr(a.ptr), CUDA_SUCCESS;
      if (a.outcome == ProgramSession::Allocation::Outcome::out_of_memory) return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return real<PT, PFN_cuMemAlloc_v3020>(kMemAlloc)(dptr, bytes);
  }
  static CUresult CUDAAPI MemFree(CUdeviceptr dptr) {
    if (route_free(const_cast<void*>(as_ptr(dptr)))) return CUDA_SUCCESS;
    return real<PT, PFN_cuMemFree_v3020>(kMemFree)(dptr);
  }
  // Stream-ordered: a routed allocation is usable at once, which is all a stream order promises; a
  // routed free waits for the device first.
  static CUresult CUDAAPI MemAllocAsync(CUdeviceptr* dptr, size_t bytes, CUstream s) {
    if (dptr != nullptr && may_route(bytes)) {
      const auto a = route_allocation(current_driver_device(), bytes);
      if (a.outcome == ProgramSession::Allocation::Outcome::routed) return *dptr = as_dptr(a.ptr), CUDA_SUCCESS;
      if (a.outcome == ProgramSession::Allocation::Outcome::out_of_memory) return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return real<PT, PFN_cuMemAllocAsync_v11020>(kMemAllocAsync)(dptr, bytes, s);
  }
  static CUresult CUDAAPI MemFreeAsync(CUdeviceptr dptr, CUstream s) {
    if (route_free(const_cast<void*>(as_ptr(dptr)))) return CUDA_SUCCESS;
    return real<PT, PFN_cuMemFreeAsync_v11020>(kMemFreeAsync)(dptr, s);
  }

  // Launches: a use.
  static CUresult CUDAAPI LaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                       unsigned bz, unsigned shmem, CUstream s, void** params, void** extra) {
    return enqueue(nullptr, 0, [&] {
      return real<PT, PFN_cuLaunchKernel_v4000>(kLaunchKernel)(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
    });
  }
  static CUresult CUDAAPI LaunchKernelEx(const CUlaunchConfig* config, CUfunction f, void** params, void** extra) {
    return enqueue(nullptr, 0,
                   [&] { return real<PT, PFN_cuLaunchKernelEx_v11060>(kLaunchKernelEx)(config, f, params, extra); });
  }
  static CUresult CUDAAPI LaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                                  unsigned by, unsigned bz, unsigned shmem, CUstream s, void** params) {
    return enqueue(nullptr, 0, [&] {
      return real<PT, PFN_cuLaunchCooperativeKernel_v9000>(kLaunchCooperativeKernel)(f, gx, gy, gz, bx, by, bz, shmem,
                                                                                     s, params);
    });
  }
  static CUresult CUDAAPI GraphLaunch(CUgraphExec g, CUstream s) {
    return enqueue(nullptr, 0, [&] { return real<PT, PFN_cuGraphLaunch_v10000>(kGraphLaunch)(g, s); });
  }

  // Copies and memsets: a use, and a write where the destination is on the device.
  static CUresult CUDAAPI Memcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    return enqueue(as_ptr(dst), n, [&] { return real<PT, PFN_cuMemcpy_v4000>(kMemcpy)(dst, src, n); });
  }
  static CUresult CUDAAPI MemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    return enqueue(as_ptr(dst), n, [&] { return real<PT, PFN_cuMemcpyAsync_v4000>(kMemcpyAsync)(dst, src, n, s); });
  }
  static CUresult CUDAAPI MemcpyHtoD(CUdeviceptr dst, const void* src, size_t n) {
    return enqueue(as_ptr(dst), n, [&] { return real<PT, PFN_cuMemcpyHtoD_v3020>(kMemcpyHtoD)(dst, src, n); });
  }
  static CUresult CUDAAPI MemcpyHtoDAsync(CUdeviceptr dst, const void* src, size_t n, CUstream s) {
    return enqueue(as_ptr(dst), n,
                   [&] { return real<PT, PFN_cuMemcpyHtoDAsync_v3020>(kMemcpyHtoDAsync)(dst, src, n, s); });
  }
  static CUresult CUDAAPI MemcpyDtoH(void* dst, CUdeviceptr src, size_t n) {
    return enqueue(nullptr, 0, [&] { return real<PT, PFN_cuMemcpyDtoH_v3020>(kMemcpyDtoH)(dst, src, n); });
  }
  static CUresult CUDAAPI MemcpyDtoHAsync(void* dst, CUdeviceptr src, size_t n, CUstream s) {
    return enqueue(nullptr, 0, [&] { return real<PT, PFN_cuMemcpyDtoHAsync_v3020>(kMemcpyDtoHAsync)(dst, src, n, s); });
  }
  static CUresult CUDAAPI MemcpyDtoD(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    return enqueue(as_ptr(dst), n, [&] { return real<PT, PFN_cuMemcpyDtoD_v3020>(kMemcpyDtoD)(dst, src, n); });
  }
  static CUresult CUDAAPI MemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    return enqueue(as_ptr(dst), n,
                   [&] { return real<PT, PFN_cuMemcpyDtoDAsync_v3020>(kMemcpyDtoDAsync)(dst, src, n, s); });
  }
  static CUresult CUDAAPI Memcpy2D(const CUDA_MEMCPY2D* p) {
    const Span w = dst_of(p);
    return enqueue(as_ptr(w.at), w.bytes, [&] { return real<PT, PFN_cuMemcpy2D_v3020>(kMemcpy2D)(p); });
  }
  static CUresult CUDAAPI Memcpy2DAsync(const CUDA_MEMCPY2D* p, CUstream s) {
    const Span w = dst_of(p);
    return enqueue(as_ptr(w.at), w.bytes, [&] { return real<PT, PFN_cuMemcpy2DAsync_v3020>(kMemcpy2DAsync)(p, s); });
  }
  static CUresult CUDAAPI Memcpy3D(const CUDA_MEMCPY3D* p) {
    const Span w = dst_of(p);
    return enqueue(as_ptr(w.at), w.bytes, [&] { return real<PT, PFN_cuMemcpy3D_v3020>(kMemcpy3D)(p); });
  }
  static CUresult CUDAAPI Memcpy3DAsync(const CUDA_MEMCPY3D* p, CUstream s) {
    const Span w = dst_of(p);
    return enqueue(as_ptr(w.at), w.bytes, [&] { return real<PT, PFN_cuMemcpy3DAsync_v3020>(kMemcpy3DAsync)(p, s); });
  }
  static CUresult CUDAAPI MemcpyPeer(CUdeviceptr dst, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t n) {
    return enqueue(as_ptr(dst), n, [&] { return real<PT, PFN_cuMemcpyPeer_v4000>(kMemcpyPeer)(dst, dc, src, sc, n); });
  }
  static CUresult CUDAAPI MemcpyPeerAsync(CUdeviceptr dst, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t n,
                                          CUstream s) {
    return enqueue(as_ptr(dst), n,
                   [&] { return real<PT, PFN_cuMemcpyPeerAsync_v4000>(kMemcpyPeerAsync)(dst, dc, src, sc, n, s); });
  }
  static CUresult CUDAAPI MemsetD8(CUdeviceptr dst, unsigned char v, size_t n) {
    return enqueue(as_ptr(dst), n, [&] { return real<PT, PFN_cuMemsetD8_v3020>(kMemsetD8)(dst, v, n); });
  }
  static CUresult CUDAAPI MemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, CUstream s) {
    return enqueue(as_ptr(dst), n, [&] { return real<PT, PFN_cuMemsetD8Async_v3020>(kMemsetD8Async)(dst, v, n, s); });
  }
  static CUresult CUDAAPI MemsetD16(CUdeviceptr dst, unsigned short v, size_t n) {
    return enqueue(as_ptr(dst), 2 * n, [&] { return real<PT, PFN_cuMemsetD16_v3020>(kMemsetD16)(dst, v, n); });
  }
  static CUresult CUDAAPI MemsetD16Async(CUdeviceptr dst, unsigned short v, size_t n, CUstream s) {
    return enqueue(as_ptr(dst), 2 * n,
                   [&] { return real<PT, PFN_cuMemsetD16Async_v3020>(kMemsetD16Async)(dst, v, n, s); });
  }
  static CUresult CUDAAPI MemsetD32(CUdeviceptr dst, unsigned int v, size_t n) {
    return enqueue(as_ptr(dst), 4 * n, [&] { return real<PT, PFN_cuMemsetD32_v3020>(kMemsetD32)(dst, v, n); });
  }
  static CUresult CUDAAPI MemsetD32Async(CUdeviceptr dst, unsigned int v, size_t n, CUstream s) {
    return enqueue(as_ptr(dst), 4 * n,
                   [&] { return real<PT, PFN_cuMemsetD32Async_v3020>(kMemsetD32Async)(dst, v, n, s); });
  }

  // Stream capture: everything awake and held from its beginning to its end.
  static CUresult CUDAAPI StreamBeginCapture(CUstream s, CUstreamCaptureMode mode) {
    capture_began(s);
    const CUresult r = real<PT, PFN_cuStreamBeginCapture_v10010>(kStreamBeginCapture)(s, mode);
    if (r != CUDA_SUCCESS) capture_ended(s);
    return r;
  }
  static CUresult CUDAAPI StreamBeginCaptureToGraph(CUstream s, CUgraph g, const CUgraphNode* deps,
                                                    const CUgraphEdgeData* edges, size_t n, CUstreamCaptureMode mode) {
    capture_began(s);
    const CUresult r = real<PT, PFN_cuStreamBeginCaptureToGraph_v12030>(kStreamBeginCaptureToGraph)(s, g, deps, edges,
                                                                                                    n, mode);
    if (r != CUDA_SUCCESS) capture_ended(s);
    return r;
  }
  static CUresult CUDAAPI StreamEndCapture(CUstream s, CUgraph* g) {
    const CUresult r = real<PT, PFN_cuStreamEndCapture_v10000>(kStreamEndCapture)(s, g);
    capture_ended(s);
    return r;
  }
  // A pointer's attributes: asleep, its range has no memory behind it to describe.
  static CUresult CUDAAPI PointerGetAttribute(void* data, CUpointer_attribute a, CUdeviceptr p) {
    const auto u = use_device();
    return real<PT, PFN_cuPointerGetAttribute_v4000>(kPointerGetAttribute)(data, a, p);
  }
  static CUresult CUDAAPI PointerGetAttributes(unsigned n, CUpointer_attribute* a, void** data, CUdeviceptr p) {
    const auto u = use_device();
    return real<PT, PFN_cuPointerGetAttributes_v7000>(kPointerGetAttributes)(n, a, data, p);
  }

  // What the preload cannot serve, or does not manage: said, then forwarded.
  static CUresult CUDAAPI IpcGetMemHandle(CUipcMemHandle* h, CUdeviceptr dptr) {
    ipc_export(as_ptr(dptr), "cuIpcGetMemHandle");
    return real<PT, PFN_cuIpcGetMemHandle_v4010>(kIpcGetMemHandle)(h, dptr);
  }
  // The program's own physical memory: known to the device's mapping backend from its creation, so
  // that a mapping of all of it can sleep (the program keeps its handle as the memory's name).
  static CUresult CUDAAPI MemCreate(CUmemGenericAllocationHandle* h, size_t size, const CUmemAllocationProp* prop,
                                    unsigned long long flags) {
    const CUresult r = real<PT, PFN_cuMemCreate_v10020>(kMemCreate)(h, size, prop, flags);
    if (r != CUDA_SUCCESS || h == nullptr || prop == nullptr) return r;
    const ProgramSession* s = session();
    cuda::ProgramMappings* pm = nullptr;
    if (s != nullptr && s->routes() && prop->type == CU_MEM_ALLOCATION_TYPE_PINNED &&
        prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE)
      pm = mappings_for(prop->location.id);
    if (pm != nullptr) pm->created(*h, size, *prop);
    else unmanaged_memory(kOwnMappings, "cuMemCreate");
    return r;
  }
  static CUresult CUDAAPI MemRelease(CUmemGenericAllocationHandle h) {
    if (cuda::ProgramMappings* pm = mappings_of(h)) {
      const CUmemGenericAllocationHandle now = pm->released(h);
      if (now == 0) return CUDA_SUCCESS;  // asleep: its physical memory is given back already
      return real<PT, PFN_cuMemRelease_v10020>(kMemRelease)(now);
    }
    return real<PT, PFN_cuMemRelease_v10020>(kMemRelease)(h);
  }
  static CUresult CUDAAPI MemMap(CUdeviceptr va, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                                 unsigned long long flags) {
    const auto u = use_device();
    int device = -1;
    cuda::ProgramMappings* pm = mappings_of(h, &device);
    const CUresult r = real<PT, PFN_cuMemMap_v10020>(kMemMap)(va, size, offset, pm != nullptr ? pm->real_handle(h) : h,
                                                              flags);
    if (r == CUDA_SUCCESS && pm != nullptr && pm->mapped(va, size, offset, h))
      if (ProgramSession* s = session(); s == nullptr || !s->mapping_made(device, const_cast<void*>(as_ptr(va)), size))
        (void)pm->unmapped(va, size);  // not managed after all: forgotten, left as the program made it
    return r;
  }
  static CUresult CUDAAPI MemUnmap(CUdeviceptr va, size_t size) {
    const auto u = use_device();  // awake first: the program unmaps what it mapped
    for (auto& slot : g_mappings) {
      cuda::ProgramMappings* pm = slot.load(std::memory_order_acquire);
      if (pm == nullptr) continue;
      for (const CUdeviceptr gone : pm->unmapped(va, size))
        if (ProgramSession* s = session()) s->mapping_gone(const_cast<void*>(as_ptr(gone)));
    }
    return real<PT, PFN_cuMemUnmap_v10020>(kMemUnmap)(va, size);
  }
  static CUresult CUDAAPI MemSetAccess(CUdeviceptr va, size_t size, const CUmemAccessDesc* desc, size_t count) {
    const auto u = use_device();
    const CUresult r = real<PT, PFN_cuMemSetAccess_v10020>(kMemSetAccess)(va, size, desc, count);
    if (r == CUDA_SUCCESS)
      for (auto& slot : g_mappings)
        if (cuda::ProgramMappings* pm = slot.load(std::memory_order_acquire)) pm->access_set(va, size, desc, count);
    return r;
  }
  static CUresult CUDAAPI MemExportToShareableHandle(void* out, CUmemGenericAllocationHandle h,
                                                     CUmemAllocationHandleType type, unsigned long long flags) {
    if (cuda::ProgramMappings* pm = mappings_of(h)) {
      if (ProgramSession* s = session())
        s->stand_aside(
            "the program exports device memory it mapped itself (cuMemExportToShareableHandle), which "
            "another process could not use once it slept");
      h = pm->real_handle(h);  // awake now, and held
    }
    return real<PT, PFN_cuMemExportToShareableHandle_v10020>(kMemExportToShareableHandle)(out, h, type, flags);
  }
  static CUresult CUDAAPI MemGetAllocationPropertiesFromHandle(CUmemAllocationProp* prop, CUmemGenericAllocationHandle h) {
    if (cuda::ProgramMappings* pm = mappings_of(h)) {
      const CUmemGenericAllocationHandle now = pm->real_handle(h);
      if (now == 0 && prop != nullptr) {  // asleep: as it was made
        *prop = *pm->properties(h);
        return CUDA_SUCCESS;
      }
      h = now;
    }
    return real<PT, PFN_cuMemGetAllocationPropertiesFromHandle_v10020>(kMemGetAllocationPropertiesFromHandle)(prop, h);
  }
  static CUresult CUDAAPI MemAllocManaged(CUdeviceptr* dptr, size_t bytes, unsigned int flags) {
    unmanaged_memory(kManagedMemory, "cuMemAllocManaged");
    return real<PT, PFN_cuMemAllocManaged_v6000>(kMemAllocManaged)(dptr, bytes, flags);
  }
};

// One row per wrapped function: its name as cuGetProcAddress is asked for it, the ABI version the
// wrapper has (the newest variant at or below a caller's version is this one from `since` on, up
// to the newest CUDA this preload was built against), and the wrappers.
struct Hooked {
  const char* name;
  int since;
  Index index;
  void* wrapper[2];
};

#define RESIDENCY_HOOKED(name, since, fn)                                                                       \
  {                                                                                                             \
    name, since, k##fn, { reinterpret_cast<void*>(&Wrap<false>::fn), reinterpret_cast<void*>(&Wrap<true>::fn) } \
  }
const Hooked kHooked[] = {
    RESIDENCY_HOOKED("cuMemAlloc", 3020, MemAlloc),
    RESIDENCY_HOOKED("cuMemFree", 3020, MemFree),
    RESIDENCY_HOOKED("cuMemAllocAsync", 11020, MemAllocAsync),
    RESIDENCY_HOOKED("cuMemFreeAsync", 11020, MemFreeAsync),
    RESIDENCY_HOOKED("cuLaunchKernel", 4000, LaunchKernel),
    RESIDENCY_HOOKED("cuLaunchKernelEx", 11060, LaunchKernelEx),
    RESIDENCY_HOOKED("cuLaunchCooperativeKernel", 9000, LaunchCooperativeKernel),
    RESIDENCY_HOOKED("cuGraphLaunch", 10000, GraphLaunch),
    RESIDENCY_HOOKED("cuMemcpy", 4000, Memcpy),
    RESIDENCY_HOOKED("cuMemcpyAsync", 4000, MemcpyAsync),
    RESIDENCY_HOOKED("cuMemcpyHtoD", 3020, MemcpyHtoD),
    RESIDENCY_HOOKED("cuMemcpyHtoDAsync", 3020, MemcpyHtoDAsync),
    RESIDENCY_HOOKED("cuMemcpyDtoH", 3020, MemcpyDtoH),
    RESIDENCY_HOOKED("cuMemcpyDtoHAsync", 3020, MemcpyDtoHAsync),
    RESIDENCY_HOOKED("cuMemcpyDtoD", 3020, MemcpyDtoD),
    RESIDENCY_HOOKED("cuMemcpyDtoDAsync", 3020, MemcpyDtoDAsync),
    RESIDENCY_HOOKED("cuMemcpy2D", 3020, Memcpy2D),
    RESIDENCY_HOOKED("cuMemcpy2DAsync", 3020, Memcpy2DAsync),
    RESIDENCY_HOOKED("cuMemcpy3D", 3020, Memcpy3D),
    RESIDENCY_HOOKED("cuMemcpy3DAsync", 3020, Memcpy3DAsync),
    RESIDENCY_HOOKED("cuMemcpyPeer", 4000, MemcpyPeer),
    RESIDENCY_HOOKED("cuMemcpyPeerAsync", 4000, MemcpyPeerAsync),
    RESIDENCY_HOOKED("cuMemsetD8", 3020, MemsetD8),
    RESIDENCY_HOOKED("cuMemsetD8Async", 3020, MemsetD8Async),
    RESIDENCY_HOOKED("cuMemsetD16", 3020, MemsetD16),
    RESIDENCY_HOOKED("cuMemsetD16Async", 3020, MemsetD16Async),
    RESIDENCY_HOOKED("cuMemsetD32", 3020, MemsetD32),
    RESIDENCY_HOOKED("cuMemsetD32Async", 3020, MemsetD32Async),
    RESIDENCY_HOOKED("cuIpcGetMemHandle", 4010, IpcGetMemHandle),
    RESIDENCY_HOOKED("cuMemCreate", 10020, MemCreate),
    RESIDENCY_HOOKED("cuMemAllocManaged", 6000, MemAllocManaged),
    RESIDENCY_HOOKED("cuMemRelease", 10020, MemRelease),
    RESIDENCY_HOOKED("cuMemMap", 10020, MemMap),
    RESIDENCY_HOOKED("cuMemUnmap", 10020, MemUnmap),
    RESIDENCY_HOOKED("cuMemSetAccess", 10020, MemSetAccess),
    RESIDENCY_HOOKED("cuMemExportToShareableHandle", 10020, MemExportToShareableHandle),
    RESIDENCY_HOOKED("cuMemGetAllocationPropertiesFromHandle", 10020, MemGetAllocationPropertiesFromHandle),
    RESIDENCY_HOOKED("cuStreamBeginCapture", 10010, StreamBeginCapture),
    RESIDENCY_HOOKED("cuStreamBeginCaptureToGraph", 12030, StreamBeginCaptureToGraph),
    RESIDENCY_HOOKED("cuStreamEndCapture", 10000, StreamEndCapture),
    RESIDENCY_HOOKED("cuPointerGetAttribute", 4000, PointerGetAttribute),
    RESIDENCY_HOOKED("cuPointerGetAttributes", 7000, PointerGetAttributes),
};
#undef RESIDENCY_HOOKED

const Hooked* find_hooked(const char* name) noexcept {
  if (name == nullptr) return nullptr;
  for (const Hooked& h : kHooked)
    if (std::strcmp(h.name, name) == 0) return &h;
  return nullptr;
}

// Newer than the <cuda.h> this preload was built against, a function may have a new ABI the wrapper
// does not have: such a request is not wrapped, and the session stands aside (a launch it could not
// see would find its memory asleep).
constexpr int kNewestKnownVersion = (CUDA_VERSION / 1000) * 1000 + 999;

}  // namespace

bool hooks_driver_function(const char* name) noexcept { return find_hooked(name) != nullptr; }

void* wrap_driver(const char* name, int cuda_version, bool per_thread, void* real_fn) noexcept {
  const Hooked* h = find_hooked(name);
  if (h == nullptr || real_fn == nullptr || cuda_version < h->since) return real_fn;
  if (cuda_version > kNewestKnownVersion) {
    if (ProgramSession* s = session())
      s->stand_aside(std::string("a library asks the driver for ") + name + " of CUDA " +
                     std::to_string(cuda_version / 1000) + "." + std::to_string(cuda_version % 1000 / 10) +
                     ", newer than this preload knows (CUDA " + std::to_string(CUDA_VERSION / 1000) + ")");
    return real_fn;
  }
  // Two slots per function (the default-stream and the per-thread variants are two functions of
  // one ABI): the one bound to `real_fn` already, else a free one, the asked variant's first.
  const int first = per_thread ? 1 : 0;
  for (const int v : {first, 1 - first}) {
    void* expected = nullptr;
    if (g_real[v][h->index].compare_exchange_strong(expected, real_fn, std::memory_order_acq_rel) || expected == real_fn)
      return h->wrapper[v];
  }
  if (ProgramSession* s = session())
    s->stand_aside(std::string("a third variant of the driver's ") + name +
                   " was asked for, which this preload cannot wrap");
  return real_fn;
}

}  // namespace residency::cudapreload
