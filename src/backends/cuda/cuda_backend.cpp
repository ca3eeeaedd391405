// SPDX-License-Identifier: MIT
// The cuda backend's front: Backend over the sets (cuda_backend.hpp says how the parts fit).
#include "backends/cuda/cuda_backend.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <optional>
#include <string>

#include "backends/cuda/cuda_process.hpp"
#include "backends/cuda/nvml.hpp"
#include "residency/config.hpp"
#include "residency/text.hpp"

namespace residency::cuda {
namespace {

// More streams than copy engines buy nothing; 16 is far above any current GPU's count.
constexpr int kMaxStreams = 16;

}  // namespace

Result<std::shared_ptr<CudaBackend>> CudaBackend::create(const CudaBackendOptions& o) {
  auto drv = Driver::get();
  if (!drv) return drv.status();
  return create(o, **drv);
}

Result<std::shared_ptr<CudaBackend>> CudaBackend::create(const CudaBackendOptions& o, const Driver& d) {
  if (o.streams < 1 || o.streams > kMaxStreams) {
    return Status(ErrorCode::invalid_argument,
                  "cuda: streams = " + std::to_string(o.streams) + "; accepted: 1 to " + std::to_string(kMaxStreams));
  }
  if (o.chunk_bytes == 0) {
    return Status(ErrorCode::invalid_argument,
                  "cuda: chunk_bytes = 0; accepted: any positive size (rounded up to the "
                  "allocation granularity, 2 MiB on current GPUs)");
  }
  int count = 0;
  CUresult r = d.cuDeviceGetCount(&count);
  if (r != CUDA_SUCCESS) return d.error(r, "counting devices", "cuDeviceGetCount");
  if (count == 0) {
    return Status(ErrorCode::unsupported, "cuda: no CUDA device on this machine (the driver is " + d.library +
                                              "); choose another backend (posix)");
  }
  if (o.device < 0 || o.device >= count) {
    return Status(ErrorCode::invalid_argument, "cuda: device " + std::to_string(o.device) +
                                                   " does not exist; this machine has " + std::to_string(count) +
                                                   " (0 to " + std::to_string(count - 1) + ")");
  }
  CUdevice dev = 0;
  r = d.cuDeviceGet(&dev, o.device);
  if (r != CUDA_SUCCESS) return d.error(r, "opening device " + std::to_string(o.device), "cuDeviceGet");
  const std::string uuid = device_uuid(d, dev);  // as nvidia-smi names the device; empty if unknown
  int vmm = 0;
  r = d.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
  if (r != CUDA_SUCCESS || vmm == 0) {
    return Status(ErrorCode::unsupported,
                  "cuda: device " + std::to_string(o.device) +
                      " does not support virtual memory management (cuMemCreate/cuMemMap), which "
                      "this backend needs for stable addresses; choose another backend (posix)");
  }
  const CUmemAllocationProp prop = device_prop(dev);
  std::size_t granularity = 0;
  r = d.cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  if (r != CUDA_SUCCESS || granularity == 0) {
    return d.error(r, "reading the allocation granularity", "cuMemGetAllocationGranularity");
  }
  CUcontext ctx = nullptr;
  r = d.cuDevicePrimaryCtxRetain(&ctx, dev);
  if (r != CUDA_SUCCESS) return d.error(r, "retaining the primary context", "cuDevicePrimaryCtxRetain");

  std::shared_ptr<CudaBackend> b(new CudaBackend(&d, dev, ctx, o, granularity));
  b->uuid_ = std::move(uuid);
  Status st = b->init_streams();
  if (!st) return st;  // the destructor releases the context and any stream made
  return b;
}

CudaBackend::CudaBackend(const Driver* d, CUdevice dev, CUcontext ctx, const CudaBackendOptions& o, std::size_t granularity)
    : stream_count_(o.streams),
      backup_threads_(default_backup_threads()),
      backup_mode_(o.backup),
      notice_(o.notice),
      info_(o.info),
      trace_(o.trace) {
  link_.d = d;
  link_.dev = dev;
  link_.ctx = ctx;
  link_.granularity = granularity;
  link_.chunk = round_up(o.chunk_bytes, granularity);
  CudaProcess::instance().claim_carrier(dev, this);
}

Status CudaBackend::init_streams() {
  ContextScope scope(*link_.d, link_.ctx);
  if (!scope.ok()) return Status(ErrorCode::backend_error, "cuda: cannot make the primary context current");
  for (int i = 0; i < stream_count_; ++i) {
    CUstream s = nullptr;
    const CUresult r = link_.d->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
    if (r != CUDA_SUCCESS) return link_.d->error(r, "creating copy streams", "cuStreamCreate");
    link_.streams.push_back(s);
  }
  return {};
}

CudaBackend::~CudaBackend() {
  {
    MutexLock bg(bg_mu_);
    bg_stop_ = true;
    bg_queue_.clear();
  }
  bg_cv_.notify_all();
  std::thread bg_thread;
  {
    MutexLock lock(mu_);
    bg_thread = std::move(bg_thread_);
  }
  if (bg_thread.joinable()) bg_thread.join();  // finishes the pinning in progress, if any
  MutexLock lock(mu_);
  {
    ContextScope scope(*link_.d, link_.ctx);
    (void)link_.d->cuCtxSynchronize();
    for (auto& [va, a] : allocations_) free_allocation(a);
    allocations_.clear();
    drop_unused_files();
    staging_.free(link_);
    for (auto& [id, h] : host_ranges_) {
      if (h.registered && h.owned) (void)link_.d->cuMemHostUnregister(h.base);
    }
    host_ranges_.clear();
    for (CUstream s : link_.streams) (void)link_.d->cuStreamDestroy(s);
    link_.streams.clear();
  }
  CudaProcess::instance().leave_carrier(link_.dev, this);
  (void)link_.d->cuDevicePrimaryCtxRelease(link_.dev);
}

Capabilities CudaBackend::capabilities() const {
  Capabilities c;
  c.name = "cuda";
  c.needs_refresh = false;  // device mappings do not decay
  c.max_sets = 0;           // no limit: a set is only a list here
  c.device_uuid = uuid_;
  c.paced_wake = true;        // wake() asks the gate before each chunk it maps
  c.prepares_release = true;  // prepare_release(): model files registered, backups pinned ahead
  c.registers_files = true;   // the host tier: a registration asks the host gate first
  // Physical memory comes in whole units of the allocation granularity (2 MiB here): a budget is
  // charged what the device holds, not the bytes asked for.
  c.wire_granularity = link_.granularity;
  return c;
}

void CudaBackend::set_wake_gate(WakeGate gate) {
  MutexLock lock(mu_);
  gate_ = std::move(gate);
}

void CudaBackend::set_host_gate(HostGate gate) {
  MutexLock lock(mu_);
  host_gate_ = std::move(gate);
  files_.set_gate(host_gate_.reserve ? &host_gate_ : nullptr);
}

// NVML's figure for this process (what nvidia-smi shows) less the physical memory of the process's
// awake allocations on the device; carried by one backend per device. Under mu_, so that none of
// this backend's wakes or allocations is halfway between the two figures.
std::uint64_t CudaBackend::unmanaged_device_bytes() {
  if (uuid_.empty()) return 0;
  CudaProcess& process = CudaProcess::instance();
  if (!process.carries(link_.dev, this)) return 0;  // another backend of the process carries it
  MutexLock lock(mu_);
  std::string why;
  const std::optional<std::uint64_t> used = nvml_process_bytes(process.nvml(), uuid_, ::getpid(), &why);
  if (!used) {
    if (!nvml_said_.exchange(true))
      say("the memory this process holds on " + uuid_ +
          " besides its allocations (the CUDA context, libraries' workspaces) is unknown: " + why +
          "; a GPU budget counts only the allocations");
    return 0;
  }
  const std::uint64_t mapped = process.mapped(link_.dev);
  return *used > mapped ? *used - mapped : 0;
}

MemoryInfo CudaBackend::memory_info() {
  MutexLock lock(mu_);
  MemoryInfo m;
  ContextScope scope(*link_.d, link_.ctx);
  std::size_t free_b = 0;
  std::size_t total_b = 0;
  if (scope.ok() && link_.d->cuMemGetInfo(&free_b, &total_b) == CUDA_SUCCESS) {
    m.physical = total_b;
    // The whole device: what other processes hold is theirs to budget.
    m.recommended_working_set = total_b;
  }
  return m;
}

Result<void*> CudaBackend::allocate(std::size_t size, RegionClass cls) {
  MutexLock lock(mu_);
  if (size == 0) return Status(ErrorCode::invalid_argument, "cuda: allocation of 0 bytes; accepted: 1 byte or more");
  ContextScope scope(*link_.d, link_.ctx);
  if (!scope.ok()) return Status(ErrorCode::backend_error, "cuda: cannot make the primary context current");
  DeviceAllocation a;
  a.cls = cls;
  if (Status st = a.range.reserve(link_, size); !st) return st;
  if (Status st = wake(a); !st) {
    a.range.free(link_);
    return Status(st.code(), "cuda: allocating " + format_size(size) + " (" + to_string(cls) + "): " + st.message());
  }
  const CUdeviceptr va = a.range.va;
  a.serial = next_serial_++;
  const std::uint64_t serial = a.serial;
  allocated_bytes_ += a.range.reserved;
  allocations_.emplace(va, std::move(a));
  if (backup_mode_ == CudaBackendOptions::Backup::after_allocation && cls == RegionClass::weights)
    queue_background_pin(va, serial);
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(va));
}

void CudaBackend::deallocate(void* base) {
  MutexLock lock(mu_);
  auto it = allocations_.find(static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(base)));
  if (it == allocations_.end()) return;  // not ours (or freed already): nothing to do
  // A region still listed in a set would point at a freed range; drop it from every set.
  for (auto& [sid, s] : sets_) {
    auto ours = [base](const RegionDesc& r) { return r.backend_allocated && r.base == base; };
    s.members.erase(std::remove_if(s.members.begin(), s.members.end(), ours), s.members.end());
    s.staged_add.erase(std::remove_if(s.staged_add.begin(), s.staged_add.end(), ours), s.staged_add.end());
  }
  ContextScope scope(*link_.d, link_.ctx);
  // Like cudaFree: kernels still using the memory finish before it is unmapped.
  (void)link_.d->cuCtxSynchronize();
  allocated_bytes_ -= it->second.range.reserved;
  free_allocation(it->second);
  allocations_.erase(it);
  drop_unused_files();
}

Status CudaBackend::wire_region(const RegionDesc& r) {
  if (r.backend_allocated) {
    DeviceAllocation* a = find(r.base);
    if (a == nullptr) {
      return Status(ErrorCode::not_found, "cuda: region " + std::to_string(r.id) + " at " +
                                              hex(reinterpret_cast<std::uintptr_t>(r.base)) +
                                              " was not allocated by this cuda backend (or was freed)");
    }
    return wake(*a);
  }
  HostRange& h = host_ranges_[r.id];
  if (h.registered) return {};
  h.base = r.base;
  h.size = r.size;
  // PORTABLE: usable from every context; DEVICEMAP: kernels read it through its address.
  constexpr unsigned kFlags = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP;
  CUresult res = link_.d->cuMemHostRegister(r.base, r.size, kFlags);
  if (res != CUDA_SUCCESS && res != CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED && res != CUDA_ERROR_OUT_OF_MEMORY) {
    // A read-only mapping (PROT_READ mmap of a model file) can be registered only as such.
    const CUresult ro = link_.d->cuMemHostRegister(r.base, r.size, kFlags | CU_MEMHOSTREGISTER_READ_ONLY);
    if (ro == CUDA_SUCCESS) res = ro;
  }
  if (res == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED) {
    h.registered = true;  // the engine registered it itself; it stays the engine's to undo
    h.owned = false;
    return {};
  }
  if (res != CUDA_SUCCESS) {
    Status s = link_.d->error(res,
                              "wiring host region " + std::to_string(r.id) + " (" + format_size(r.size) + " at " +
                                  hex(reinterpret_cast<std::uintptr_t>(r.base)) + ")",
                              "cuMemHostRegister");
    return Status(s.code(), s.message() + "; the region stays tracked but unwired");
  }
  h.registered = true;
  h.owned = true;
  host_wired_bytes_ += r.size;
  return {};
}

Status CudaBackend::unwire_region(const RegionDesc& r) {
  if (r.backend_allocated) {
    DeviceAllocation* a = find(r.base);
    return a == nullptr ? Status() : sleep(*a);
  }
  auto it = host_ranges_.find(r.id);
  if (it == host_ranges_.end()) return {};
  HostRange& h = it->second;
  Status st;
  if (h.registered && h.owned) {
    const CUresult res = link_.d->cuMemHostUnregister(h.base);
    if (res != CUDA_SUCCESS)
      st = link_.d->error(res, "unwiring host region " + std::to_string(r.id), "cuMemHostUnregister");
    host_wired_bytes_ -= h.size;
  }
  host_ranges_.erase(it);
  return st;
}

bool CudaBackend::wanted(RegionId id) const {
  for (const auto& [sid, s] : sets_) {
    if (!s.requested) continue;
    for (const auto& m : s.members)
      if (m.id == id) return true;
  }
  return false;
}

SetOutcome CudaBackend::wake_members(const std::vector<RegionDesc>& members) {
  SetOutcome out;
  if (members.empty()) return out;
  ContextScope scope(*link_.d, link_.ctx);
  if (!scope.ok()) {
    out.status = Status(ErrorCode::backend_error, "cuda: cannot make the primary context current");
    for (const auto& m : members) out.failed.push_back(m.id);
    return out;
  }
  wakes_.fetch_add(1);  // a registration the background thread makes for the host tier stops
  for (const auto& m : members) {
    Status st = wire_region(m);
    if (!st) {
      out.failed.push_back(m.id);
      if (out.status) out.status = st;
    }
  }
  return out;
}

Status CudaBackend::sleep_members(const std::vector<RegionDesc>& members, bool interruptible) {
  if (members.empty()) return {};
  ContextScope scope(*link_.d, link_.ctx);
  if (!scope.ok()) return Status(ErrorCode::backend_error, "cuda: cannot make the primary context current");
  Status first;
  bool device = false;
  for (const auto& m : members) device = device || m.backend_allocated;
  if (device) {
    // Kernels in flight may still read or write the memory: let them finish first.
    const CUresult r = link_.d->cuCtxSynchronize();
    if (r != CUDA_SUCCESS) {
      return link_.d->error(r, "waiting for the device before a release (nothing was released)", "cuCtxSynchronize");
    }
  }
  files_.begin_sleep();  // the host budget is asked once per file in this sleep
  // First every device member's backup, while its memory is mapped: a call that begins meanwhile
  // (interrupt_release) stops the release here and finds everything in place. Then, past the last
  // look, the memory is given back.
  std::vector<DeviceAllocation*> saved;
  // With a trace: each saved allocation's save time and bytes copied, in the order of `saved`.
  std::vector<std::pair<std::chrono::nanoseconds, std::uint64_t>> save_times;
  auto interrupted = [&] {
    if (!interruptible || !interrupt_wanted()) return false;
    // Still resident: an untracked backup is only valid from a sleep to the next wake.
    for (DeviceAllocation* a : saved)
      if (!a->tracked) a->backup.valid = false;
    return true;
  };
  const Status stopped(ErrorCode::interrupted, "cuda: a call began; the release stopped before giving anything back");
  for (const auto& m : members) {
    if (!m.backend_allocated) continue;
    if (interrupted()) return stopped;
    DeviceAllocation* a = find(m.base);
    if (a == nullptr) continue;  // unwire_region says so below
    const auto t0 = std::chrono::steady_clock::now();
    const std::uint64_t copied0 = copied_to_host_;
    Status st = save(*a);
    const auto took = std::chrono::steady_clock::now() - t0;
    if (st.code() == ErrorCode::interrupted) {
      (void)interrupted();
      return stopped;
    }
    if (!st) {
      if (first) first = st;
      continue;
    }
    if (trace_) save_times.emplace_back(took, copied_to_host_ - copied0);
    saved.push_back(a);
  }
  if (interrupted()) return stopped;
  for (const auto& m : members) {
    if (m.backend_allocated) {
      DeviceAllocation* a = find(m.base);
      const auto at = a == nullptr ? saved.end() : std::find(saved.begin(), saved.end(), a);
      if (at != saved.end()) {
        const auto t0 = std::chrono::steady_clock::now();
        drop(*a);
        if (trace_) {
          const auto& [took, copied] = save_times[static_cast<std::size_t>(at - saved.begin())];
          trace_sleep(*a, took, std::chrono::steady_clock::now() - t0, copied);
        }
        continue;
      }
      if (a != nullptr) continue;  // its save failed: it stays resident (reported above)
    }
    Status st = unwire_region(m);
    if (!st && first) first = st;
  }
  if (files_.take_held_back()) queue_host_room();  // the host budget had no room: make it off this path
  return first;
}

bool CudaBackend::interrupt_wanted() const {
  return releasing_.load(std::memory_order_acquire) && interrupt_.load(std::memory_order_acquire);
}

void CudaBackend::interrupt_release() {
  if (releasing_.load(std::memory_order_acquire)) interrupt_.store(true, std::memory_order_release);
}

Status CudaBackend::create_set(SetId set, std::uint64_t /*capacity_bytes*/) {
  MutexLock lock(mu_);
  if (sets_.count(set) != 0) {
    return Status(ErrorCode::invalid_argument, "cuda: set " + std::to_string(set) + " exists already");
  }
  sets_.emplace(set, Set{});
  return {};
}

Status CudaBackend::destroy_set(SetId set) {
  MutexLock lock(mu_);
  auto it = sets_.find(set);
  if (it == sets_.end()) return {};
  const bool was_requested = it->second.requested;
  std::vector<RegionDesc> members = std::move(it->second.members);
  sets_.erase(it);
  if (!was_requested) return {};
  std::vector<RegionDesc> release;
  for (const auto& m : members)
    if (!wanted(m.id)) release.push_back(m);
  last_release_ = sleep_members(release);
  return last_release_;
}

void CudaBackend::add_region(SetId set, const RegionDesc& region) {
  MutexLock lock(mu_);
  auto it = sets_.find(set);
  if (it == sets_.end()) return;  // commit() reports nothing for an unknown set either
  it->second.staged_add.push_back(region);
}

void CudaBackend::remove_region(SetId set, RegionId region) {
  MutexLock lock(mu_);
  auto it = sets_.find(set);
  if (it == sets_.end()) return;
  it->second.staged_remove.push_back(region);
}

SetOutcome CudaBackend::commit(SetId set) {
  MutexLock lock(mu_);
  SetOutcome out;
  auto it = sets_.find(set);
  if (it == sets_.end()) {
    out.status = Status(ErrorCode::not_found, "cuda: commit of unknown set " + std::to_string(set));
    return out;
  }
  Set& s = it->second;
  std::vector<RegionDesc> removed;
  for (RegionId id : s.staged_remove) {
    auto m = std::find_if(s.members.begin(), s.members.end(), [id](const RegionDesc& r) { return r.id == id; });
    if (m == s.members.end()) continue;
    removed.push_back(*m);
    s.members.erase(m);
  }
  std::vector<RegionDesc> added;
  for (const RegionDesc& r : s.staged_add) {
    const bool present = std::any_of(s.members.begin(), s.members.end(),
                                     [&r](const RegionDesc& m) { return m.id == r.id; });
    if (present) continue;
    s.members.push_back(r);
    added.push_back(r);
  }
  s.staged_add.clear();
  s.staged_remove.clear();
  if (!s.requested) return out;

  std::vector<RegionDesc> release;
  for (const auto& r : removed)
    if (!wanted(r.id)) release.push_back(r);
  Status released = sleep_members(release);  // first, so that the memory is free for the adds
  last_release_ = released;
  out = wake_members(added);
  if (out.status && !released) out.status = released;
  return out;
}

SetOutcome CudaBackend::request_residency(SetId set) {
  MutexLock lock(mu_);
  auto it = sets_.find(set);
  if (it == sets_.end()) {
    SetOutcome out;
    out.status = Status(ErrorCode::not_found, "cuda: residency requested for unknown set " + std::to_string(set));
    return out;
  }
  it->second.requested = true;
  return wake_members(it->second.members);
}

Status CudaBackend::end_residency(SetId set) {
  MutexLock lock(mu_);
  auto it = sets_.find(set);
  if (it == sets_.end())
    return Status(ErrorCode::not_found, "cuda: end_residency of unknown set " + std::to_string(set));
  it->second.requested = false;
  std::vector<RegionDesc> release;
  for (const auto& m : it->second.members)
    if (!wanted(m.id)) release.push_back(m);
  releasing_.store(true, std::memory_order_release);
  interrupt_.store(false, std::memory_order_release);  // one of an earlier release, come too late
  last_release_ = sleep_members(release, /*interruptible=*/true);
  releasing_.store(false, std::memory_order_release);
  // What could not sleep is still resident: the set stays requested, as the manager will see.
  if (!last_release_) it->second.requested = true;
  return last_release_;
}

std::uint64_t CudaBackend::bytes_copied_to_host() const {
  MutexLock lock(mu_);
  return copied_to_host_;
}

std::uint64_t CudaBackend::bytes_copied_to_device() const {
  MutexLock lock(mu_);
  return copied_to_device_;
}

std::uint64_t CudaBackend::pinned_host_bytes() const {
  MutexLock lock(mu_);
  std::uint64_t n = 0;
  for (const auto& [va, a] : allocations_) {
    n += a.backup.pinned_bytes(link_);
    for (const Gaps& g : a.files.gaps) n += g.mapped;
  }
  return n;
}

std::uint64_t CudaBackend::file_backed_bytes() const {
  MutexLock lock(mu_);
  std::uint64_t n = 0;
  for (const auto& [va, a] : allocations_) n += a.files.bytes_in_files(link_.chunk);
  return n;
}

bool CudaBackend::is_resident(const void* base) const {
  MutexLock lock(mu_);
  const DeviceAllocation* a = find(base);
  return a != nullptr && a->range.mapped;
}

void* CudaBackend::host_backup(const void* base) const {
  MutexLock lock(mu_);
  const DeviceAllocation* a = find(base);
  return a == nullptr ? nullptr : a->backup.base;
}

std::size_t CudaBackend::host_backup_bytes(const void* base) const {
  MutexLock lock(mu_);
  const DeviceAllocation* a = find(base);
  return a == nullptr ? 0 : a->backup.mapped;
}

std::uint64_t CudaBackend::allocated_bytes() const {
  MutexLock lock(mu_);
  return allocated_bytes_;
}

std::uint64_t CudaBackend::resident_bytes() const {
  MutexLock lock(mu_);
  return mapped_bytes_ + host_wired_bytes_;
}

void CudaBackend::set_backup_threads(int threads) { backup_threads_ = std::clamp(threads, 1, 64); }
int CudaBackend::backup_threads() const { return backup_threads_; }
void CudaBackend::set_backup_pipeline(BackupPipeline p) { pipeline_ = p; }
CudaBackend::BackupPipeline CudaBackend::backup_pipeline() const { return pipeline_; }

Status CudaBackend::last_release_status() const {
  MutexLock lock(mu_);
  return last_release_;
}

}  // namespace residency::cuda

namespace residency {

Result<std::shared_ptr<Backend>> make_cuda_backend(const CudaBackendOptions& options) {
  auto b = cuda::CudaBackend::create(options);
  if (!b) return b.status();
  return std::shared_ptr<Backend>(std::move(b.value()));
}

}  // namespace residency
