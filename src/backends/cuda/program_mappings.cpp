// SPDX-License-Identifier: MIT
#include "backends/cuda/program_mappings.hpp"

#include <utility>

#include "backends/cuda/cuda_process.hpp"
#include "backends/cuda/device_link.hpp"

namespace residency::cuda {

Result<std::shared_ptr<ProgramMappings>> ProgramMappings::create(const Driver& d, int device) {
  CUdevice dev = 0;
  CUresult r = d.cuDeviceGet(&dev, device);
  if (r != CUDA_SUCCESS) return d.error(r, "opening device " + std::to_string(device), "cuDeviceGet");
  CUcontext ctx = nullptr;
  r = d.cuDevicePrimaryCtxRetain(&ctx, dev);
  if (r != CUDA_SUCCESS) return d.error(r, "retaining the primary context", "cuDevicePrimaryCtxRetain");
  std::size_t total = 0;
  if (d.cuDeviceTotalMem(&total, dev) != CUDA_SUCCESS) total = 0;
  return std::shared_ptr<ProgramMappings>(new ProgramMappings(d, dev, ctx, device_uuid(d, dev), total));
}

ProgramMappings::ProgramMappings(const Driver& d, CUdevice dev, CUcontext ctx, std::string uuid, std::uint64_t total)
    : d_(d), dev_(dev), ctx_(ctx), uuid_(std::move(uuid)), total_(total) {}

ProgramMappings::~ProgramMappings() {
  {
    MutexLock lock(mu_);
    // What still sleeps goes back to the program's address as it was (a manager torn down before
    // the program's exit must not leave it an unmapped range).
    for (auto& [va, m] : mappings_)
      if (!m.awake) (void)wake_locked(va, m);
  }
  (void)d_.cuDevicePrimaryCtxRelease(dev_);
}

// ---- What the program did ----

void ProgramMappings::created(CUmemGenericAllocationHandle handle, std::size_t size, const CUmemAllocationProp& prop) {
  MutexLock lock(mu_);
  Handle& h = handles_[handle];
  h = Handle{};
  h.size = size;
  h.prop = prop;
  h.real = handle;
}

CUmemGenericAllocationHandle ProgramMappings::real_handle(CUmemGenericAllocationHandle handle) const {
  MutexLock lock(mu_);
  const auto it = handles_.find(handle);
  return it == handles_.end() ? handle : it->second.real;
}

CUmemGenericAllocationHandle ProgramMappings::program_handle(CUmemGenericAllocationHandle real) const {
  MutexLock lock(mu_);
  for (const auto& [name, h] : handles_)
    if (h.real == real) return name;
  return real;
}

bool ProgramMappings::mapped(CUdeviceptr va, std::size_t size, std::size_t offset, CUmemGenericAllocationHandle handle) {
  MutexLock lock(mu_);
  const auto h = handles_.find(handle);
  if (h == handles_.end() || offset != 0 || size != h->second.size) return false;
  for (const auto& [start, m] : mappings_)
    if (m.handle == handle) return false;  // mapped twice: the two addresses must stay one memory
  Mapping& m = mappings_[va];
  m = Mapping{};
  m.size = size;
  m.handle = handle;
  // Mapped by this backend's books from now on: a GPU budget counts it as this holder's, not as the
  // process's memory outside its allocations (NVML's figure less what the backends map).
  CudaProcess::instance().note_mapped(dev_, size, true);
  return true;
}

void ProgramMappings::access_set(CUdeviceptr va, std::size_t size, const CUmemAccessDesc* desc, std::size_t count) {
  if (desc == nullptr || count == 0) return;
  MutexLock lock(mu_);
  for (auto it = mappings_.lower_bound(va); it != mappings_.end() && it->first < va + size; ++it)
    if (it->first + it->second.size <= va + size) it->second.access.assign(desc, desc + count);
}

std::vector<CUdeviceptr> ProgramMappings::unmapped(CUdeviceptr va, std::size_t size) {
  MutexLock lock(mu_);
  std::vector<CUdeviceptr> gone;
  for (auto it = mappings_.lower_bound(va); it != mappings_.end() && it->first < va + size;) {
    if (it->second.backup != nullptr) (void)d_.cuMemFreeHost(it->second.backup);
    if (it->second.awake) CudaProcess::instance().note_mapped(dev_, it->second.size, false);
    gone.push_back(it->first);
    it = mappings_.erase(it);
  }
  return gone;
}

CUmemGenericAllocationHandle ProgramMappings::released(CUmemGenericAllocationHandle handle) {
  MutexLock lock(mu_);
  const auto it = handles_.find(handle);
  if (it == handles_.end()) return handle;
  bool still_mapped = false;
  for (const auto& [start, m] : mappings_) still_mapped = still_mapped || m.handle == handle;
  const CUmemGenericAllocationHandle real = it->second.real;
  if (!still_mapped) {
    handles_.erase(it);
    return real;
  }
  // Released while mapped (legal: the memory goes when it is unmapped). Asleep, there is nothing
  // to release now; the wake releases the new physical handle once it is mapped.
  it->second.released_by_program = true;
  return real;  // 0 while asleep
}

std::optional<CUmemAllocationProp> ProgramMappings::properties(CUmemGenericAllocationHandle handle) const {
  MutexLock lock(mu_);
  const auto it = handles_.find(handle);
  if (it == handles_.end()) return std::nullopt;
  return it->second.prop;
}

std::size_t ProgramMappings::asleep() const {
  MutexLock lock(mu_);
  std::size_t n = 0;
  for (const auto& [va, m] : mappings_) n += m.awake ? 0 : 1;
  return n;
}

std::uint64_t ProgramMappings::bytes_slept() const {
  MutexLock lock(mu_);
  return bytes_slept_;
}

// ---- Sleep and wake of one mapping ----

// Waits for the device, copies the mapping out, unmaps it and gives its physical memory back. On
// a failure before the unmap nothing changed.
Status ProgramMappings::sleep_locked(CUdeviceptr va, Mapping& m) {
  if (!m.awake) return {};
  const auto h = handles_.find(m.handle);
  if (h == handles_.end()) return Status(ErrorCode::backend_error, "cuda: a mapping without its handle");
  ContextScope scope(d_, ctx_);
  CUresult r = d_.cuCtxSynchronize();  // the current context: the scope above
  if (r != CUDA_SUCCESS) return d_.error(r, "waiting for the device before a sleep", "cuCtxSynchronize");
  void* backup = nullptr;
  r = d_.cuMemHostAlloc(&backup, m.size, 0);
  if (r != CUDA_SUCCESS) return d_.error(r, "pinning the host copy of a program's mapping", "cuMemHostAlloc");
  r = d_.cuMemcpyDtoH(backup, va, m.size);
  if (r == CUDA_SUCCESS) r = d_.cuMemUnmap(va, m.size);
  if (r != CUDA_SUCCESS) {
    (void)d_.cuMemFreeHost(backup);
    return d_.error(r, "putting a program's mapping to sleep", "cuMemcpyDtoH/cuMemUnmap");
  }
  // Unmapped: a handle the program released already is gone with its last mapping.
  if (!h->second.released_by_program) (void)d_.cuMemRelease(h->second.real);
  h->second.real = 0;
  m.backup = backup;
  m.awake = false;
  bytes_slept_ += m.size;
  CudaProcess::instance().note_mapped(dev_, m.size, false);
  return {};
}

// Physical memory with the handle's properties, mapped at the same address with the same access,
// and the bytes copied back; on a failure whatever was made is given back and it stays asleep.
Status ProgramMappings::wake_locked(CUdeviceptr va, Mapping& m) {
  if (m.awake) return {};
  const auto h = handles_.find(m.handle);
  if (h == handles_.end()) return Status(ErrorCode::backend_error, "cuda: a mapping without its handle");
  ContextScope scope(d_, ctx_);
  CUmemGenericAllocationHandle fresh = 0;
  CUresult r = d_.cuMemCreate(&fresh, h->second.size, &h->second.prop, 0);
  if (r != CUDA_SUCCESS) return d_.error(r, "waking a program's mapping", "cuMemCreate");
  r = d_.cuMemMap(va, m.size, 0, fresh, 0);
  if (r != CUDA_SUCCESS) {
    (void)d_.cuMemRelease(fresh);
    return d_.error(r, "waking a program's mapping", "cuMemMap");
  }
  if (!m.access.empty()) r = d_.cuMemSetAccess(va, m.size, m.access.data(), m.access.size());
  if (r == CUDA_SUCCESS) r = d_.cuMemcpyHtoD(va, m.backup, m.size);
  if (r != CUDA_SUCCESS) {
    (void)d_.cuMemUnmap(va, m.size);
    (void)d_.cuMemRelease(fresh);
    return d_.error(r, "waking a program's mapping", "cuMemSetAccess/cuMemcpyHtoD");
  }
  (void)d_.cuMemFreeHost(m.backup);
  m.backup = nullptr;
  m.awake = true;
  CudaProcess::instance().note_mapped(dev_, m.size, true);
  if (h->second.released_by_program) {
    (void)d_.cuMemRelease(fresh);  // as the program left it: gone with its mapping
    h->second.real = 0;
  } else {
    h->second.real = fresh;
  }
  return {};
}

// ---- Backend ----

Capabilities ProgramMappings::capabilities() const {
  Capabilities c;
  c.name = "cuda";  // GPU memory, as `residency ps` and `stat` show it (the program maps it itself)
  c.needs_refresh = false;
  c.max_sets = 0;
  c.device_uuid = uuid_;
  return c;
}

MemoryInfo ProgramMappings::memory_info() {
  MemoryInfo m;
  m.physical = total_;
  m.recommended_working_set = total_;
  return m;
}

Status ProgramMappings::create_set(SetId set, std::uint64_t) {
  MutexLock lock(mu_);
  if (sets_.count(set) != 0) return Status(ErrorCode::invalid_argument, "cuda: set exists");
  sets_[set] = SetRec{};
  return {};
}

Status ProgramMappings::destroy_set(SetId set) {
  MutexLock lock(mu_);
  sets_.erase(set);
  return {};
}

void ProgramMappings::add_region(SetId set, const RegionDesc& region) {
  MutexLock lock(mu_);
  const auto it = sets_.find(set);
  if (it != sets_.end()) it->second.regions[region.id] = reinterpret_cast<CUdeviceptr>(region.base);
}

void ProgramMappings::remove_region(SetId set, RegionId region) {
  MutexLock lock(mu_);
  const auto it = sets_.find(set);
  if (it != sets_.end()) it->second.regions.erase(region);
}

SetOutcome ProgramMappings::commit(SetId set) {
  MutexLock lock(mu_);
  if (sets_.count(set) == 0) return {Status(ErrorCode::invalid_argument, "cuda: no such set"), {}};
  return {};
}

SetOutcome ProgramMappings::request_residency(SetId set) {
  MutexLock lock(mu_);
  const auto it = sets_.find(set);
  if (it == sets_.end()) return {Status(ErrorCode::invalid_argument, "cuda: no such set"), {}};
  it->second.requested = true;
  SetOutcome out;
  for (const auto& [id, va] : it->second.regions) {
    const auto m = mappings_.find(va);
    if (m == mappings_.end()) continue;
    if (Status st = wake_locked(va, m->second); !st) {
      out.failed.push_back(id);
      if (out.status) out.status = st;
    }
  }
  return out;
}

Status ProgramMappings::end_residency(SetId set) {
  MutexLock lock(mu_);
  const auto it = sets_.find(set);
  if (it == sets_.end()) return Status(ErrorCode::invalid_argument, "cuda: no such set");
  Status out;
  for (const auto& [id, va] : it->second.regions) {
    const auto m = mappings_.find(va);
    if (m == mappings_.end()) continue;
    if (Status st = sleep_locked(va, m->second); !st && out) out = st;
  }
  if (out) it->second.requested = false;  // a failed release leaves the set requested
  return out;
}

}  // namespace residency::cuda
