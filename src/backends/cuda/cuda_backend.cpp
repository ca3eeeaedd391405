// SPDX-License-Identifier: MIT
// The cuda backend; see cuda_backend.hpp for the design and the residency rule.
#include "backends/cuda/cuda_backend.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "backends/cuda/nvml.hpp"
#include "residency/config.hpp"
#include "residency/text.hpp"

namespace residency::cuda {
namespace {

// More streams than copy engines buy nothing; 16 is far above any current GPU's count.
constexpr int kMaxStreams = 16;

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older headers lack the name
#endif

// Transparent huge pages are 2 MiB on x86-64 and on arm64 with 4 KiB pages: the backup is
// aligned to that, so that every chunk (a multiple of the 2 MiB device granularity) is made of
// whole huge pages, which fault in and pin several times faster than 4 KiB pages.
constexpr std::size_t kHugePage = std::size_t{2} << 20;
// The unit of faulting-in work a host thread takes: small enough that a chunk's pages are
// faulted in by many threads at once (so the first copy starts early), large enough that the
// hand-out costs nothing.
constexpr std::size_t kFaultSlice = std::size_t{16} << 20;
constexpr int kDefaultMaxBackupThreads = 16;

std::size_t host_page() {
  const long p = sysconf(_SC_PAGESIZE);
  return p > 0 ? static_cast<std::size_t>(p) : 4096;
}

// Faults in [p, p + len) for writing: MADV_POPULATE_WRITE (one call, no signal on failure),
// or, on kernels before 5.14, a write to every page. Returns 0 or an errno.
int fault_in(char* p, std::size_t len) {
  static std::atomic<bool> no_populate{false};
  if (!no_populate.load(std::memory_order_relaxed)) {
    for (;;) {
      if (madvise(p, len, MADV_POPULATE_WRITE) == 0) return 0;
      if (errno == EINTR || errno == EAGAIN) continue;
      if (errno != EINVAL) return errno;
      no_populate.store(true, std::memory_order_relaxed);
      break;
    }
  }
  const std::size_t page = host_page();
  for (std::size_t off = 0; off < len; off += page) static_cast<volatile char*>(p)[off] = 0;
  return 0;
}

// Half the hardware threads, at most 16: past half the cores the faulting threads slow each
// other down, and far fewer leave the pinning behind the copies (the thread sweep is in
// docs/measurements.md).
int default_backup_threads() {
  const int hw = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(hw <= 0 ? 4 : hw / 2, 1, kDefaultMaxBackupThreads);
}

std::string hex(std::uintptr_t p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%" PRIxPTR, p);
  return buf;
}

CUmemAllocationProp device_prop(CUdevice dev) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = static_cast<int>(dev);
  return prop;
}

std::size_t round_up(std::size_t v, std::size_t unit) { return (v + unit - 1) / unit * unit; }

// NVML reports a process, however many backends it has on a device: the physical memory of the
// awake allocations of all of them, and the one that carries the rest (the context) in a budget,
// the first made for the device (unmanaged_device_bytes()).
constexpr int kMaxDevices = 64;
std::atomic<std::uint64_t> g_mapped[kMaxDevices];
std::atomic<const void*> g_carrier[kMaxDevices];
std::size_t device_slot(CUdevice dev) { return static_cast<std::size_t>(dev) % kMaxDevices; }

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
  std::string uuid;  // as nvidia-smi names the device; empty if the driver does not say
  CUuuid u{};
  if (d.cuDeviceGetUuid != nullptr && d.cuDeviceGetUuid(&u, dev) == CUDA_SUCCESS) {
    static constexpr char kHex[] = "0123456789abcdef";
    uuid = "GPU-";
    for (int i = 0; i < 16; ++i) {
      if (i == 4 || i == 6 || i == 8 || i == 10) uuid += '-';
      const auto byte = static_cast<unsigned char>(u.bytes[i]);
      uuid += kHex[byte >> 4];
      uuid += kHex[byte & 15];
    }
  }
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
    : d_(d),
      dev_(dev),
      ctx_(ctx),
      granularity_(granularity),
      chunk_(round_up(o.chunk_bytes, granularity)),
      stream_count_(o.streams),
      backup_threads_(default_backup_threads()),
      backup_mode_(o.backup),
      notice_(o.notice) {
  const void* none = nullptr;
  (void)g_carrier[device_slot(dev_)].compare_exchange_strong(none, this);
}

void CudaBackend::note_mapped(std::uint64_t bytes, bool added) {
  if (added) {
    mapped_bytes_ += bytes;
    g_mapped[device_slot(dev_)].fetch_add(bytes, std::memory_order_relaxed);
  } else {
    mapped_bytes_ -= bytes;
    g_mapped[device_slot(dev_)].fetch_sub(bytes, std::memory_order_relaxed);
  }
}

Status CudaBackend::init_streams() {
  ContextScope scope(*d_, ctx_);
  if (!scope.ok()) return Status(ErrorCode::backend_error, "cuda: cannot make the primary context current");
  for (int i = 0; i < stream_count_; ++i) {
    CUstream s = nullptr;
    const CUresult r = d_->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
    if (r != CUDA_SUCCESS) return d_->error(r, "creating copy streams", "cuStreamCreate");
    streams_.push_back(s);
  }
  return {};
}

CudaBackend::~CudaBackend() {
  {
    std::lock_guard<std::mutex> bg(bg_mu_);
    bg_stop_ = true;
    bg_queue_.clear();
  }
  bg_cv_.notify_all();
  if (bg_thread_.joinable()) bg_thread_.join();  // finishes the pinning in progress, if any
  std::lock_guard<std::mutex> lock(mu_);
  {
    ContextScope scope(*d_, ctx_);
    (void)d_->cuCtxSynchronize();
    for (auto& [va, a] : allocations_) {
      if (a.resident) unmap_chunks(a, a.chunks.size());
      (void)d_->cuMemAddressFree(a.va, a.reserved);
      free_backup(a);
    }
    allocations_.clear();
    note_mapped(mapped_bytes_, false);
    drop_unused_files();
    for (auto& [id, h] : host_ranges_) {
      if (h.registered && h.owned) (void)d_->cuMemHostUnregister(h.base);
    }
    host_ranges_.clear();
    for (CUstream s : streams_) (void)d_->cuStreamDestroy(s);
    streams_.clear();
  }
  const void* self = this;
  (void)g_carrier[device_slot(dev_)].compare_exchange_strong(self, nullptr);
  (void)d_->cuDevicePrimaryCtxRelease(dev_);
}

Capabilities CudaBackend::capabilities() const {
  Capabilities c;
  c.name = "cuda";
  c.needs_refresh = false;  // device mappings do not decay
  c.max_sets = 0;           // no limit: a set is only a list here
  c.device_uuid = uuid_;
  c.paced_wake = true;  // wake() asks the gate before each chunk it maps
  // Physical memory comes in whole units of the allocation granularity (2 MiB here): a budget is
  // charged what the device holds, not the bytes asked for.
  c.wire_granularity = granularity_;
  return c;
}

void CudaBackend::set_wake_gate(WakeGate gate) {
  std::lock_guard<std::mutex> lock(mu_);
  gate_ = std::move(gate);
}

// NVML's figure for this process (what nvidia-smi shows) less the physical memory of the process's
// awake allocations on the device; carried by one backend per device. The caller holds the
// manager's lock, under which this backend's wakes and allocations run.
std::uint64_t CudaBackend::unmanaged_device_bytes() {
  if (uuid_.empty()) return 0;
  if (g_carrier[device_slot(dev_)].load() != this) return 0;  // another backend of the process carries it
  std::string why;
  const std::optional<std::uint64_t> used = nvml_process_bytes(uuid_, ::getpid(), &why);
  if (!used) {
    if (!nvml_said_.exchange(true))
      say("the memory this process holds on " + uuid_ +
          " besides its allocations (the CUDA context, libraries' "
          "workspaces) is unknown: " +
          why + "; a GPU budget counts only the allocations");
    return 0;
  }
  const std::uint64_t mapped = g_mapped[device_slot(dev_)].load(std::memory_order_relaxed);
  return *used > mapped ? *used - mapped : 0;
}

MemoryInfo CudaBackend::memory_info() {
  std::lock_guard<std::mutex> lock(mu_);
  MemoryInfo m;
  ContextScope scope(*d_, ctx_);
  std::size_t free_b = 0;
  std::size_t total_b = 0;
  if (scope.ok() && d_->cuMemGetInfo(&free_b, &total_b) == CUDA_SUCCESS) {
    m.physical = total_b;
    // The whole device: what other processes hold is theirs to budget.
    m.recommended_working_set = total_b;
  }
  return m;
}

std::uint64_t CudaBackend::allocated_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return allocated_bytes_;
}

std::uint64_t CudaBackend::resident_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return mapped_bytes_ + host_wired_bytes_;
}

Result<void*> CudaBackend::allocate(std::size_t size, RegionClass cls) {
  std::lock_guard<std::mutex> lock(mu_);
  if (size == 0) {
    return Status(ErrorCode::invalid_argument, "cuda: allocation of 0 bytes; accepted: 1 byte or more");
  }
  if (size > std::numeric_limits<std::size_t>::max() - granularity_) {
    return Status(ErrorCode::invalid_argument,
                  "cuda: allocation of " + std::to_string(size) + " bytes is larger than any address range");
  }
  ContextScope scope(*d_, ctx_);
  if (!scope.ok()) return Status(ErrorCode::backend_error, "cuda: cannot make the primary context current");
  DeviceAllocation a;
  a.size = size;
  a.reserved = round_up(size, granularity_);
  a.cls = cls;
  CUresult r = d_->cuMemAddressReserve(&a.va, a.reserved, granularity_, 0, 0);
  if (r != CUDA_SUCCESS) {
    return d_->error(r, "reserving " + format_size(a.reserved) + " of device addresses", "cuMemAddressReserve");
  }
  Status st = wake(a);
  if (!st) {
    (void)d_->cuMemAddressFree(a.va, a.reserved);
    return Status(st.code(), "cuda: allocating " + format_size(size) + " (" + to_string(cls) + "): " + st.message());
  }
  const CUdeviceptr va = a.va;
  a.serial = next_serial_++;
  const std::uint64_t serial = a.serial;
  allocated_bytes_ += a.reserved;
  allocations_.emplace(va, std::move(a));
  if (backup_mode_ == CudaBackendOptions::Backup::after_allocation && cls == RegionClass::weights) {
    try {
      {
        std::lock_guard<std::mutex> bg(bg_mu_);
        bg_queue_.emplace_back(va, serial);
      }
      if (!bg_thread_.joinable()) bg_thread_ = std::thread([this] { background_loop(); });
      bg_cv_.notify_all();
    } catch (...) {
      // No thread or no memory for the queue: the first sleep pins the backup, as by default.
    }
  }
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(va));
}

void CudaBackend::background_loop() {
  ContextScope scope(*d_, ctx_);
  for (;;) {
    std::pair<CUdeviceptr, std::uint64_t> job;
    {
      std::unique_lock<std::mutex> bg(bg_mu_);
      bg_busy_ = false;
      bg_cv_.notify_all();  // wait_background_backups
      bg_cv_.wait(bg, [this] { return bg_stop_ || !bg_queue_.empty(); });
      if (bg_stop_) return;
      job = bg_queue_.front();
      bg_queue_.pop_front();
      bg_busy_ = true;
    }
    DeviceAllocation tmp;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = allocations_.find(job.first);
      // A tracked allocation's first sleep decides what needs pinning (file pieces need none).
      if (it == allocations_.end() || it->second.serial != job.second || it->second.backup != nullptr || it->second.tracked)
        continue;
      tmp.va = it->second.va;
      tmp.size = it->second.size;
    }
    // Pinning reads only tmp and the backend's constant settings: the engine's calls and the
    // manager's go on meanwhile.
    const Status st = scope.ok() ? pin_backup(tmp, /*copy=*/false)
                                 : Status(ErrorCode::backend_error, "cuda: no context on the background thread");
    if (!st) {
      bg_failed_.fetch_add(1);
      continue;
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto it = allocations_.find(job.first);
    if (it != allocations_.end() && it->second.serial == job.second && it->second.backup == nullptr && !it->second.tracked) {
      it->second.backup = tmp.backup;
      it->second.backup_mapped = tmp.backup_mapped;
      it->second.pinned = std::move(tmp.pinned);
      bg_done_.fetch_add(1);
    } else {
      free_backup(tmp);  // freed meanwhile, or its first sleep pinned one of its own
    }
  }
}

bool CudaBackend::wait_background_backups(int timeout_ms) {
  std::unique_lock<std::mutex> bg(bg_mu_);
  return bg_cv_.wait_for(bg, std::chrono::milliseconds(timeout_ms),
                         [this] { return bg_stop_ || (bg_queue_.empty() && !bg_busy_); });
}

void CudaBackend::deallocate(void* base) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = allocations_.find(static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(base)));
  if (it == allocations_.end()) return;  // not ours (or freed already): nothing to do
  // A region still listed in a set would point at a freed range; drop it from every set.
  for (auto& [sid, s] : sets_) {
    auto ours = [base](const RegionDesc& r) { return r.backend_allocated && r.base == base; };
    s.members.erase(std::remove_if(s.members.begin(), s.members.end(), ours), s.members.end());
    s.staged_add.erase(std::remove_if(s.staged_add.begin(), s.staged_add.end(), ours), s.staged_add.end());
  }
  DeviceAllocation& a = it->second;
  ContextScope scope(*d_, ctx_);
  // Like cudaFree: kernels still using the memory finish before it is unmapped.
  (void)d_->cuCtxSynchronize();
  if (a.resident) {
    unmap_chunks(a, a.chunks.size());
    note_mapped(a.reserved, false);
  }
  (void)d_->cuMemAddressFree(a.va, a.reserved);
  free_backup(a);
  allocated_bytes_ -= a.reserved;
  allocations_.erase(it);
  drop_unused_files();
}

Status CudaBackend::sync_streams() {
  Status first;
  for (CUstream s : streams_) {
    const CUresult r = d_->cuStreamSynchronize(s);
    if (r != CUDA_SUCCESS && first) first = d_->error(r, "waiting for copies", "cuStreamSynchronize");
  }
  return first;
}

void CudaBackend::unmap_chunks(DeviceAllocation& a, std::size_t count) {
  (void)sync_streams();  // no copy may still target a chunk that goes away
  for (std::size_t i = 0; i < count && i < a.chunks.size(); ++i) {
    const std::size_t off = i * chunk_;
    const std::size_t len = std::min(chunk_, a.reserved - off);
    (void)d_->cuMemUnmap(a.va + off, len);
    (void)d_->cuMemRelease(a.chunks[i]);
  }
  a.chunks.clear();
}

// Maps physical memory chunk by chunk and, for weights with a backup, starts each chunk's
// copy as soon as it is mapped, so the copies of early chunks overlap the mapping of later
// ones. On any failure everything mapped so far is unmapped again and the backup is left as
// it was: a failed wake loses nothing.
Status CudaBackend::wake(DeviceAllocation& a) {
  if (a.resident) return {};
  const bool restore = a.cls == RegionClass::weights && a.backup_valid;
  if (restore) {
    // A file that changed while its bytes slept in it: nothing else holds them any more.
    for (auto& [key, f] : files_) {
      if (f->map == nullptr || f->unusable || file_unchanged(*f)) continue;
      f->unusable = true;
      say(f->name +
          " changed while the weights filled from it slept (size or modification time); they are "
          "restored from it as it is now, which may differ from what was loaded; replace a model "
          "file by renaming a new one over it, never by writing into it, while a server uses it");
    }
  }
  const CUmemAllocationProp prop = device_prop(dev_);
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = static_cast<int>(dev_);
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;

  const std::size_t n = (a.reserved + chunk_ - 1) / chunk_;
  a.chunks.clear();
  a.chunks.reserve(n);
  auto fail = [&](CUresult r, const char* call, std::size_t off) {
    unmap_chunks(a, a.chunks.size());
    const bool oom = r == CUDA_ERROR_OUT_OF_MEMORY;
    std::string what = std::string(oom ? "out of device memory" : "mapping failed") + " waking a " + format_size(a.size) +
                       " " + to_string(a.cls) + " allocation at " + hex(a.va) + " after " + format_size(off) + "; " +
                       "the partial mapping was rolled back" + (restore ? " and the host backup is kept" : "");
    Status s = d_->error(r, what, call);
    return Status(s.code(), s.message() + (oom ? "; free device memory (other allocations or "
                                                 "processes) and request residency again"
                                               : ""));
  };
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t off = i * chunk_;
    const std::size_t len = std::min(chunk_, a.reserved - off);
    // A paced wake: the budget makes room for this chunk (the copies queued so far go on meanwhile).
    if (gate_) gate_(len);
    CUmemGenericAllocationHandle h = 0;
    CUresult r = d_->cuMemCreate(&h, len, &prop, 0);
    if (r != CUDA_SUCCESS) return fail(r, "cuMemCreate", off);
    r = d_->cuMemMap(a.va + off, len, 0, h, 0);
    if (r != CUDA_SUCCESS) {
      (void)d_->cuMemRelease(h);
      return fail(r, "cuMemMap", off);
    }
    a.chunks.push_back(h);
    r = d_->cuMemSetAccess(a.va + off, len, &access, 1);
    if (r != CUDA_SUCCESS) return fail(r, "cuMemSetAccess", off);
    if (restore && off < a.size) {
      const std::size_t bytes = std::min(len, a.size - off);
      CUstream stream = streams_[i % streams_.size()];
      r = i < a.from_file.size() && a.from_file[i] != 0
              ? restore_from_file(a, i, stream)
              : d_->cuMemcpyHtoDAsync(a.va + off, static_cast<const char*>(a.backup) + off, bytes, stream);
      if (r != CUDA_SUCCESS) return fail(r, "cuMemcpyHtoDAsync", off);
    }
  }
  if (restore) {
    Status st = sync_streams();
    if (!st) {
      unmap_chunks(a, a.chunks.size());
      return st;
    }
    copied_to_device_ += a.size;
  }
  a.resident = true;
  if (a.tracked && restore) {
    // Written chunks are reported as they are written: the backup stays the contents until then.
    a.dirty.assign(a.dirty.size(), 0);
  } else {
    a.backup_valid = false;  // the engine may write from now on; the next sleep copies again
  }
  note_mapped(a.reserved, true);
  return {};
}

// Copies weights out (chunked over the streams), then unmaps and releases. The caller has
// synchronized the context, so kernels that were using the memory have finished. On a
// failure the allocation stays resident: nothing is released before the backup is whole.
// The first sleep builds the backup while it copies (pin_backup).
Status CudaBackend::sleep(DeviceAllocation& a) {
  Status st = save(a);
  if (!st) return st;
  drop(a);
  return {};
}

void CudaBackend::drop(DeviceAllocation& a) {
  if (!a.resident) return;
  unmap_chunks(a, a.chunks.size());
  a.resident = false;
  note_mapped(a.reserved, false);
}

// What a sleep keeps of `a` (weights only), made while the memory is still mapped.
Status CudaBackend::save(DeviceAllocation& a) {
  if (!a.resident) return {};
  if (a.cls == RegionClass::weights && a.tracked && !a.pieces.empty()) {
    Status st = sleep_from_files(a);
    if (!st) return st;
  } else if (a.cls == RegionClass::weights) {
    // Tracked and whole since its last sleep: only the chunks written since then are copied.
    const bool only_written = a.tracked && a.backup_valid && a.dirty.size() == (a.size + chunk_ - 1) / chunk_;
    a.backup_valid = false;
    if (a.backup == nullptr) {
      Status st = pin_backup(a, /*copy=*/true);
      if (!st) return st;
      copied_to_host_ += a.size;
    } else {
      // Pieces of at most kCopyPiece, one in flight per stream: a call that begins meanwhile
      // (interrupt_release) stops the copying within a piece's time per stream, and the
      // allocation stays resident (its backup is then not valid, so the next sleep copies again).
      const std::size_t n = (a.size + chunk_ - 1) / chunk_;
      std::size_t k = 0;  // pieces issued
      for (std::size_t i = 0; i < n; ++i) {
        if (only_written && a.dirty[i] == 0) continue;
        const std::size_t end = std::min(a.size, (i + 1) * chunk_);
        for (std::size_t off = i * chunk_; off < end; off += kCopyPiece, ++k) {
          CUstream stream = streams_[k % streams_.size()];
          if (k >= streams_.size()) (void)d_->cuStreamSynchronize(stream);  // its previous piece
          if (interrupt_wanted()) {
            (void)sync_streams();
            return Status(ErrorCode::interrupted, "cuda: a call began; the release stopped while copying");
          }
          const std::size_t bytes = std::min(kCopyPiece, end - off);
          const CUresult r = d_->cuMemcpyDtoHAsync(a.backup + off, a.va + off, bytes, stream);
          if (r != CUDA_SUCCESS) {
            (void)sync_streams();
            return d_->error(r, "copying weights at " + hex(a.va) + " to the host backup; the allocation stays resident",
                             "cuMemcpyDtoHAsync");
          }
          copied_to_host_ += bytes;
        }
      }
      Status st = sync_streams();
      if (!st) return Status(st.code(), st.message() + "; the allocation stays resident");
    }
    a.backup_valid = true;
    if (a.tracked) a.dirty.assign((a.size + chunk_ - 1) / chunk_, 0);
  }
  return {};
}

// The pipeline of a first sleep. Host threads fault the memory in, handed out in kFaultSlice
// pieces in address order; with pipeline `workers` (the default) the thread that faults in a
// chunk's last piece registers the chunk; with `registrar` this thread registers each chunk as
// soon as all its pieces are in. This thread takes the chunks in order and issues each one's
// copy as soon as it is registered, so chunk k copies while chunk k+1 is registered and later
// chunks are faulted in. Registration is per chunk, and so is every later copy (never across
// two registrations).
Status CudaBackend::pin_backup(DeviceAllocation& a, bool copy, const std::vector<std::uint8_t>* need) {
  const std::size_t mapped = round_up(a.size, host_page());
  auto wanted = [&](std::size_t i) {
    return (need == nullptr || (i < need->size() && (*need)[i] != 0)) && (i >= a.pinned.size() || a.pinned[i] == 0);
  };
  const std::string what = "pinning a " + format_size(a.size) + " host backup for the weights at " + hex(a.va);
  const std::string kept =
      "; the partial backup was rolled back (unregistered and unmapped) and the "
      "allocation stays resident, nothing is lost; free host memory and release again";

  // The mapping is made once (its pages cost nothing until a chunk is faulted in); a later call
  // pins more chunks of it.
  const bool fresh = a.backup == nullptr;
  char* base = a.backup;
  if (fresh) {
    // Reserve 2 MiB more than needed, keep the 2 MiB-aligned part of exactly `mapped` bytes.
    void* raw = mmap(nullptr, mapped + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
      const int e = errno;
      return Status(e == ENOMEM ? ErrorCode::out_of_memory : ErrorCode::backend_error,
                    "cuda: " + what + ": mmap of " + format_size(mapped) + " failed: " + std::strerror(e) +
                        "; the allocation stays resident (nothing is lost); free host memory and release again");
    }
    const auto raw_addr = reinterpret_cast<std::uintptr_t>(raw);
    const std::uintptr_t start = round_up(raw_addr, kHugePage);
    if (start > raw_addr) (void)munmap(raw, start - raw_addr);
    const std::uintptr_t end = start + mapped;
    if (raw_addr + mapped + kHugePage > end)
      (void)munmap(reinterpret_cast<void*>(end), raw_addr + mapped + kHugePage - end);
    base = reinterpret_cast<char*>(start);
    (void)madvise(base, mapped, MADV_HUGEPAGE);  // a hint: without THP the backup is made of 4 KiB pages
  }

  const std::size_t n = (mapped + chunk_ - 1) / chunk_;
  struct Slice {
    std::size_t chunk, off, len;
  };
  std::vector<Slice> slices;
  std::unique_ptr<std::atomic<std::size_t>[]> left(new std::atomic<std::size_t>[n]);
  for (std::size_t i = 0; i < n; ++i) {
    left[i].store(0);
    if (!wanted(i)) continue;
    const std::size_t coff = i * chunk_;
    const std::size_t clen = std::min(chunk_, mapped - coff);
    std::size_t count = 0;
    for (std::size_t o = 0; o < clen; o += kFaultSlice, ++count)
      slices.push_back({i, coff + o, std::min(kFaultSlice, clen - o)});
    left[i].store(count);
  }

  std::mutex m;
  std::condition_variable cv;
  constexpr std::uint8_t kFaulted = 1, kRegistered = 2;
  std::vector<std::uint8_t> state(n, 0);  // under m: 0, kFaulted, kRegistered
  Status failure;                         // under m: the first failure
  std::atomic<bool> failed{false};
  std::atomic<std::size_t> next{0};
  auto fail = [&](Status s) {
    std::lock_guard<std::mutex> lock(m);
    if (failure) failure = std::move(s);
    failed.store(true);
    cv.notify_all();
  };
  auto worker = [&] {
    ContextScope scope(*d_, ctx_);
    if (!scope.ok()) {
      fail(Status(ErrorCode::backend_error, "cuda: " + what + ": cannot make the primary context current on a host thread"));
      return;
    }
    while (!failed.load(std::memory_order_relaxed)) {
      const std::size_t t = next.fetch_add(1);
      if (t >= slices.size()) return;
      const Slice& sl = slices[t];
      const int e = fault_in(base + sl.off, sl.len);
      if (e != 0) {
        fail(Status(e == ENOMEM ? ErrorCode::out_of_memory : ErrorCode::backend_error,
                    "cuda: " + what + ": faulting in host memory at offset " + format_size(sl.off) +
                        " failed: " + std::strerror(e) + kept));
        return;
      }
      if (left[sl.chunk].fetch_sub(1) != 1) continue;
      if (pipeline_.load(std::memory_order_relaxed) == BackupPipeline::registrar) {
        std::lock_guard<std::mutex> lock(m);
        state[sl.chunk] = kFaulted;  // the copying thread registers it
        cv.notify_all();
        continue;
      }
      // The last piece of this chunk: register it here.
      const std::size_t coff = sl.chunk * chunk_;
      const std::size_t clen = std::min(chunk_, mapped - coff);
      const CUresult r = d_->cuMemHostRegister(base + coff, clen, CU_MEMHOSTREGISTER_PORTABLE);
      if (r != CUDA_SUCCESS) {
        Status s = d_->error(r, what + " (chunk " + std::to_string(sl.chunk + 1) + " of " + std::to_string(n) + ")",
                             "cuMemHostRegister");
        fail(Status(s.code(), s.message() + kept));
        return;
      }
      std::lock_guard<std::mutex> lock(m);
      state[sl.chunk] = kRegistered;
      cv.notify_all();
    }
  };

  const std::size_t thread_count = std::min<std::size_t>(static_cast<std::size_t>(backup_threads_.load()), slices.size());
  std::vector<std::thread> threads;
  threads.reserve(thread_count);
  for (std::size_t i = 0; i < thread_count; ++i) {
    try {
      threads.emplace_back(worker);
    } catch (const std::exception&) {
      if (threads.empty())
        fail(Status(ErrorCode::backend_error, "cuda: " + what + ": cannot start a host thread" + kept));
      break;  // fewer threads: slower, not wrong
    }
  }

  // Registers (pipeline registrar) and copies in chunk order as chunks become ready (without
  // `copy`, only registers or waits).
  for (std::size_t i = 0; i < n; ++i) {
    if (!wanted(i)) continue;
    {
      std::unique_lock<std::mutex> lock(m);
      cv.wait(lock, [&] { return state[i] != 0 || failed.load(); });
      if (failed.load() || state[i] == 0) break;
    }
    const std::size_t off = i * chunk_;
    if (state[i] == kFaulted) {  // read without the lock: only this thread writes it from here on
      const CUresult r = d_->cuMemHostRegister(base + off, std::min(chunk_, mapped - off), CU_MEMHOSTREGISTER_PORTABLE);
      if (r != CUDA_SUCCESS) {
        Status s = d_->error(r, what + " (chunk " + std::to_string(i + 1) + " of " + std::to_string(n) + ")",
                             "cuMemHostRegister");
        fail(Status(s.code(), s.message() + kept));
        break;
      }
      std::lock_guard<std::mutex> lock(m);
      state[i] = kRegistered;
    }
    if (!copy || off >= a.size) continue;
    const std::size_t bytes = std::min(chunk_, a.size - off);
    const CUresult r = d_->cuMemcpyDtoHAsync(base + off, a.va + off, bytes, streams_[i % streams_.size()]);
    if (r != CUDA_SUCCESS) {
      Status s = d_->error(r, "copying weights at " + hex(a.va) + " to the host backup while " + what,
                           "cuMemcpyDtoHAsync");
      fail(Status(s.code(), s.message() + kept));
      break;
    }
  }
  for (auto& t : threads) t.join();
  if (!failed.load() && copy) {
    Status st = sync_streams();
    if (!st) fail(Status(st.code(), st.message() + kept));
  }
  if (failed.load()) {
    (void)sync_streams();  // no copy may still target memory that goes away
    for (std::size_t i = 0; i < n; ++i) {
      if (state[i] == kRegistered) (void)d_->cuMemHostUnregister(base + i * chunk_);
    }
    if (fresh) {
      (void)munmap(base, mapped);
    } else {
      for (std::size_t i = 0; i < n; ++i)
        if (wanted(i)) (void)madvise(base + i * chunk_, std::min(chunk_, mapped - i * chunk_), MADV_DONTNEED);
    }
    return failure;
  }
  a.pinned.resize(n, 0);
  for (std::size_t i = 0; i < n; ++i)
    if (state[i] == kRegistered) a.pinned[i] = 1;
  a.backup = base;
  a.backup_mapped = mapped;
  return {};
}

void CudaBackend::free_backup(DeviceAllocation& a) {
  for (Gaps& g : a.gaps) free_gaps(g);
  if (a.backup == nullptr) return;
  const std::size_t n = (a.backup_mapped + chunk_ - 1) / chunk_;
  for (std::size_t i = 0; i < n && i < a.pinned.size(); ++i)
    if (a.pinned[i] != 0) (void)d_->cuMemHostUnregister(a.backup + i * chunk_);
  (void)munmap(a.backup, a.backup_mapped);
  a.backup = nullptr;
  a.backup_mapped = 0;
  a.backup_valid = false;
  a.pinned.clear();
}

Status CudaBackend::wire_region(const RegionDesc& r) {
  if (r.backend_allocated) {
    auto it = allocations_.find(static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(r.base)));
    if (it == allocations_.end()) {
      return Status(ErrorCode::not_found, "cuda: region " + std::to_string(r.id) + " at " +
                                              hex(reinterpret_cast<std::uintptr_t>(r.base)) +
                                              " was not allocated by this cuda backend (or was freed)");
    }
    return wake(it->second);
  }
  HostRange& h = host_ranges_[r.id];
  if (h.registered) return {};
  h.base = r.base;
  h.size = r.size;
  // PORTABLE: usable from every context; DEVICEMAP: kernels read it through its address.
  constexpr unsigned kFlags = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP;
  CUresult res = d_->cuMemHostRegister(r.base, r.size, kFlags);
  if (res != CUDA_SUCCESS && res != CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED && res != CUDA_ERROR_OUT_OF_MEMORY) {
    // A read-only mapping (PROT_READ mmap of a model file) can be registered only as such.
    const CUresult ro = d_->cuMemHostRegister(r.base, r.size, kFlags | CU_MEMHOSTREGISTER_READ_ONLY);
    if (ro == CUDA_SUCCESS) res = ro;
  }
  if (res == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED) {
    h.registered = true;  // the engine registered it itself; it stays the engine's to undo
    h.owned = false;
    return {};
  }
  if (res != CUDA_SUCCESS) {
    Status s = d_->error(res,
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
    auto it = allocations_.find(static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(r.base)));
    if (it == allocations_.end()) return {};
    return sleep(it->second);
  }
  auto it = host_ranges_.find(r.id);
  if (it == host_ranges_.end()) return {};
  HostRange& h = it->second;
  Status st;
  if (h.registered && h.owned) {
    const CUresult res = d_->cuMemHostUnregister(h.base);
    if (res != CUDA_SUCCESS) st = d_->error(res, "unwiring host region " + std::to_string(r.id), "cuMemHostUnregister");
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
  ContextScope scope(*d_, ctx_);
  if (!scope.ok()) {
    out.status = Status(ErrorCode::backend_error, "cuda: cannot make the primary context current");
    for (const auto& m : members) out.failed.push_back(m.id);
    return out;
  }
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
  ContextScope scope(*d_, ctx_);
  if (!scope.ok()) return Status(ErrorCode::backend_error, "cuda: cannot make the primary context current");
  Status first;
  bool device = false;
  for (const auto& m : members) device = device || m.backend_allocated;
  if (device) {
    // Kernels in flight may still read or write the memory: let them finish first.
    const CUresult r = d_->cuCtxSynchronize();
    if (r != CUDA_SUCCESS) {
      return d_->error(r, "waiting for the device before a release (nothing was released)", "cuCtxSynchronize");
    }
  }
  // First every device member's backup, while its memory is mapped: a call that begins meanwhile
  // (interrupt_release) stops the release here and finds everything in place. Then, past the last
  // look, the memory is given back.
  std::vector<DeviceAllocation*> saved;
  auto interrupted = [&] {
    if (!interruptible || !interrupt_wanted()) return false;
    // Still resident: an untracked backup is only valid from a sleep to the next wake.
    for (DeviceAllocation* a : saved)
      if (!a->tracked) a->backup_valid = false;
    return true;
  };
  const Status stopped(ErrorCode::interrupted, "cuda: a call began; the release stopped before giving anything back");
  for (const auto& m : members) {
    if (!m.backend_allocated) continue;
    if (interrupted()) return stopped;
    auto it = allocations_.find(static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(m.base)));
    if (it == allocations_.end()) continue;  // unwire_region says so below
    Status st = save(it->second);
    if (st.code() == ErrorCode::interrupted) {
      (void)interrupted();
      return stopped;
    }
    if (!st) {
      if (first) first = st;
      continue;
    }
    saved.push_back(&it->second);
  }
  if (interrupted()) return stopped;
  for (const auto& m : members) {
    if (m.backend_allocated) {
      auto it = allocations_.find(static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(m.base)));
      if (it != allocations_.end() && std::find(saved.begin(), saved.end(), &it->second) != saved.end()) {
        drop(it->second);
        continue;
      }
      if (it != allocations_.end()) continue;  // its save failed: it stays resident (reported above)
    }
    Status st = unwire_region(m);
    if (!st && first) first = st;
  }
  return first;
}

bool CudaBackend::interrupt_wanted() const {
  return releasing_.load(std::memory_order_acquire) && interrupt_.load(std::memory_order_acquire);
}

void CudaBackend::interrupt_release() {
  if (releasing_.load(std::memory_order_acquire)) interrupt_.store(true, std::memory_order_release);
}

Status CudaBackend::create_set(SetId set, std::uint64_t /*capacity_bytes*/) {
  std::lock_guard<std::mutex> lock(mu_);
  if (sets_.count(set) != 0) {
    return Status(ErrorCode::invalid_argument, "cuda: set " + std::to_string(set) + " exists already");
  }
  sets_.emplace(set, Set{});
  return {};
}

Status CudaBackend::destroy_set(SetId set) {
  std::lock_guard<std::mutex> lock(mu_);
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
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sets_.find(set);
  if (it == sets_.end()) return;  // commit() reports nothing for an unknown set either
  it->second.staged_add.push_back(region);
}

void CudaBackend::remove_region(SetId set, RegionId region) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sets_.find(set);
  if (it == sets_.end()) return;
  it->second.staged_remove.push_back(region);
}

SetOutcome CudaBackend::commit(SetId set) {
  std::lock_guard<std::mutex> lock(mu_);
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
  std::lock_guard<std::mutex> lock(mu_);
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
  std::lock_guard<std::mutex> lock(mu_);
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

void CudaBackend::track_writes(void* base) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = allocations_.find(static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(base)));
  if (it == allocations_.end() || it->second.tracked) return;
  DeviceAllocation& a = it->second;
  a.tracked = true;
  // Writes before now were not reported: unless asleep (its backup is its contents), the backup
  // is not valid until the next sleep copies everything.
  if (a.resident) a.backup_valid = false;
  a.dirty.assign((a.size + chunk_ - 1) / chunk_, a.resident ? 1 : 0);
}

// With mu_ held: the tracked allocation that holds `addr`, with the chunks [first, last) touches
// flagged as written and its file pieces cut there; null where no tracked allocation is.
CudaBackend::DeviceAllocation* CudaBackend::note_write_locked(const void* addr, std::size_t bytes, std::size_t& first,
                                                              std::size_t& last) {
  const auto p = static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(addr));
  auto it = allocations_.upper_bound(p);
  if (it == allocations_.begin() || bytes == 0) return nullptr;
  --it;
  DeviceAllocation& a = it->second;
  if (!a.tracked || p >= a.va + a.size || a.dirty.empty()) return nullptr;
  first = static_cast<std::size_t>(p - a.va);
  last = std::min(a.size, first + std::min(bytes, a.size - first));  // exclusive
  for (std::size_t i = first / chunk_; i * chunk_ < last && i < a.dirty.size(); ++i) a.dirty[i] = 1;
  cut_pieces(a, first, last);  // no longer the file's bytes
  return &a;
}

void CudaBackend::written(const void* addr, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  std::size_t first = 0, last = 0;
  (void)note_write_locked(addr, bytes, first, last);
}

void CudaBackend::filled_from_file(const void* addr, std::size_t bytes, int fd, std::uint64_t offset) {
  std::lock_guard<std::mutex> lock(mu_);
  std::size_t first = 0, last = 0;
  DeviceAllocation* found = note_write_locked(addr, bytes, first, last);
  if (found == nullptr) return;
  DeviceAllocation& a = *found;
  if (a.cls != RegionClass::weights) return;
  struct stat st {};
  if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size < 0 ||
      offset > static_cast<std::uint64_t>(st.st_size) || last - first > static_cast<std::uint64_t>(st.st_size) - offset)
    return;  // a write like any other
  auto key = std::make_pair(st.st_dev, st.st_ino);
  auto f = files_.find(key);
  if (f == files_.end()) {
    auto file = std::make_unique<BackingFile>();
    file->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (file->fd < 0) return;
    char link[64];
    std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    char path[4096];
    const ssize_t len = readlink(link, path, sizeof path - 1);
    file->name = len > 0 ? std::string(path, static_cast<std::size_t>(len))
                         : "the model file (fd " + std::to_string(fd) + ")";
    file->dev = st.st_dev;
    file->ino = st.st_ino;
    file->size = st.st_size;
    file->mtime_ns = static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
    f = files_.emplace(key, std::move(file)).first;
  }
  BackingFile& file = *f->second;
  if (file.unusable || !file_unchanged(file)) return;
  Piece piece{first, last - first, &file, offset};
  auto at = std::lower_bound(a.pieces.begin(), a.pieces.end(), first,
                             [](const Piece& x, std::size_t off) { return x.off < off; });
  a.pieces.insert(at, piece);
}

// Removes [begin, end) from the pieces (splitting those it cuts through).
void CudaBackend::cut_pieces(DeviceAllocation& a, std::size_t begin, std::size_t end) {
  if (a.pieces.empty() || begin >= end) return;
  std::vector<Piece> kept;
  kept.reserve(a.pieces.size() + 1);
  for (const Piece& x : a.pieces) {
    const std::size_t xe = x.off + x.len;
    if (xe <= begin || x.off >= end) {
      kept.push_back(x);
      continue;
    }
    if (x.off < begin) kept.push_back(Piece{x.off, begin - x.off, x.file, x.file_off});
    if (xe > end) kept.push_back(Piece{end, xe - end, x.file, x.file_off + (end - x.off)});
  }
  a.pieces = std::move(kept);
}

bool CudaBackend::file_unchanged(const BackingFile& f) {
  struct stat st {};
  if (fstat(f.fd, &st) != 0) return false;
  const std::int64_t mtime = static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  return st.st_dev == f.dev && st.st_ino == f.ino && st.st_size == f.size && mtime == f.mtime_ns;
}

void CudaBackend::say(const std::string& line) const {
  if (!notice_) return;
  try {
    notice_(line);
  } catch (...) {
    // the line is lost, nothing else
  }
}

bool CudaBackend::file_ready(BackingFile& f) {
  if (f.unusable) return false;
  const std::string fallback = "; the weights filled from it are backed up in pinned host memory instead";
  if (!file_unchanged(f)) {
    f.unusable = true;
    say(f.name + " changed since the weights were loaded from it (size or modification time)" + fallback);
    return false;
  }
  if (f.map != nullptr) return true;
  const std::size_t len = round_up(static_cast<std::size_t>(f.size), host_page());
  void* m = mmap(nullptr, len, PROT_READ, MAP_SHARED, f.fd, 0);
  if (m == MAP_FAILED) {
    f.unusable = true;
    say("cannot map " + f.name + " (" + std::strerror(errno) + ")" + fallback);
    return false;
  }
  const CUresult r = d_->cuMemHostRegister(m, len, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_READ_ONLY);
  if (r != CUDA_SUCCESS) {
    (void)munmap(m, len);
    f.unusable = true;
    say("cannot register " + f.name + " read-only with the GPU (" + d_->error(r, "", "cuMemHostRegister").message() +
        ")" + fallback);
    return false;
  }
  f.map = static_cast<char*>(m);
  f.map_len = len;
  return true;
}

void CudaBackend::free_gaps(Gaps& g) {
  if (g.buf != nullptr) {
    (void)d_->cuMemHostUnregister(g.buf);
    (void)munmap(g.buf, g.mapped);
  }
  g = Gaps{};
}

void CudaBackend::drop_unused_files() {
  for (auto it = files_.begin(); it != files_.end();) {
    bool used = false;
    for (const auto& [va, a] : allocations_) {
      for (const Piece& p : a.pieces) used = used || p.file == it->second.get();
      if (used) break;
    }
    if (used) {
      ++it;
      continue;
    }
    BackingFile& f = *it->second;
    if (f.map != nullptr) {
      (void)d_->cuMemHostUnregister(f.map);
      (void)munmap(f.map, f.map_len);
    }
    if (f.fd >= 0) (void)close(f.fd);
    it = files_.erase(it);
  }
}

// The chunk's file pieces, clipped to it, then its gaps.
CUresult CudaBackend::restore_from_file(const DeviceAllocation& a, std::size_t i, CUstream stream) const {
  const std::size_t cb = i * chunk_;
  const std::size_t ce = std::min(cb + chunk_, a.size);
  auto it = std::lower_bound(a.pieces.begin(), a.pieces.end(), cb,
                             [](const Piece& x, std::size_t off) { return x.off + x.len <= off; });
  for (; it != a.pieces.end() && it->off < ce; ++it) {
    const std::size_t b = std::max(it->off, cb);
    const std::size_t e = std::min(it->off + it->len, ce);
    const CUresult r = d_->cuMemcpyHtoDAsync(a.va + b, it->file->map + it->file_off + (b - it->off), e - b, stream);
    if (r != CUDA_SUCCESS) return r;
  }
  const Gaps& g = a.gaps[i];
  std::size_t at = 0;
  for (const auto& [off, len] : g.ranges) {
    const CUresult r = d_->cuMemcpyHtoDAsync(a.va + off, g.buf + at, len, stream);
    if (r != CUDA_SUCCESS) return r;
    at += len;
  }
  return CUDA_SUCCESS;
}

// Chunk by chunk, what changed since the last sleep (or everything, the first time) is saved:
// a chunk made of its file's bytes but for at most kMaxGapBytes keeps those in the file (nothing
// to copy) and its gaps in a small pinned buffer; any other chunk goes to the pinned backup,
// pinned chunk by chunk as needed. Chunks that now sleep in their file give their pinned backup
// back. On a failure the allocation stays resident and nothing is lost.
Status CudaBackend::sleep_from_files(DeviceAllocation& a) {
  const std::size_t n = (a.size + chunk_ - 1) / chunk_;
  const std::string stays = "; the allocation stays resident (nothing is lost)";
  // Files that cannot back anything any more: their pieces go, their chunks are saved anew.
  for (std::size_t k = 0; k < a.pieces.size();) {
    BackingFile& f = *a.pieces[k].file;
    if (file_ready(f)) {
      ++k;
      continue;
    }
    for (const Piece& p : a.pieces)
      if (p.file == &f)
        for (std::size_t i = p.off / chunk_; i * chunk_ < p.off + p.len && i < n; ++i) a.dirty[i] = 1;
    a.pieces.erase(std::remove_if(a.pieces.begin(), a.pieces.end(), [&f](const Piece& p) { return p.file == &f; }),
                   a.pieces.end());
  }
  std::vector<std::uint8_t> in_file(n, 0);
  std::vector<std::size_t> covered(n, 0);
  for (const Piece& p : a.pieces) {
    for (std::size_t i = p.off / chunk_; i * chunk_ < p.off + p.len && i < n; ++i) {
      const std::size_t b = std::max(p.off, i * chunk_);
      const std::size_t e = std::min(p.off + p.len, std::min((i + 1) * chunk_, a.size));
      covered[i] += e - b;
    }
  }
  a.from_file.resize(n, 0);
  a.gaps.resize(n);
  std::vector<std::uint8_t> need_pin(n, 0);
  bool any_pin = false;
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t len = std::min(chunk_, a.size - i * chunk_);
    in_file[i] = covered[i] > 0 && len - covered[i] <= kMaxGapBytes ? 1 : 0;
    if (!a.backup_valid || in_file[i] != a.from_file[i]) a.dirty[i] = 1;
    if (in_file[i] == 0 && a.dirty[i] != 0 && (i >= a.pinned.size() || a.pinned[i] == 0))
      need_pin[i] = 1, any_pin = true;
  }
  a.backup_valid = false;
  if (any_pin) {
    Status st = pin_backup(a, /*copy=*/true, &need_pin);
    if (!st) return st;
    for (std::size_t i = 0; i < n; ++i)
      if (need_pin[i] != 0) copied_to_host_ += std::min(chunk_, a.size - i * chunk_);
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (a.dirty[i] == 0 || need_pin[i] != 0) continue;
    const std::size_t cb = i * chunk_;
    const std::size_t ce = std::min(cb + chunk_, a.size);
    CUstream stream = streams_[i % streams_.size()];
    if (in_file[i] == 0) {
      const CUresult r = d_->cuMemcpyDtoHAsync(a.backup + cb, a.va + cb, ce - cb, stream);
      if (r != CUDA_SUCCESS) {
        (void)sync_streams();
        return d_->error(r, "copying weights at " + hex(a.va) + " to the host backup" + stays, "cuMemcpyDtoHAsync");
      }
      copied_to_host_ += ce - cb;
      continue;
    }
    // The gaps: what the pieces leave of [cb, ce).
    Gaps g;
    std::size_t at = cb, bytes = 0;
    auto it = std::lower_bound(a.pieces.begin(), a.pieces.end(), cb,
                               [](const Piece& x, std::size_t off) { return x.off + x.len <= off; });
    for (; it != a.pieces.end() && it->off < ce; ++it) {
      if (it->off > at) g.ranges.emplace_back(at, it->off - at), bytes += it->off - at;
      at = std::max(at, it->off + it->len);
    }
    if (at < ce) g.ranges.emplace_back(at, ce - at), bytes += ce - at;
    if (bytes > 0) {
      g.mapped = round_up(bytes, host_page());
      void* m = mmap(nullptr, g.mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (m == MAP_FAILED) {
        (void)sync_streams();
        return Status(ErrorCode::out_of_memory, "cuda: no host memory for the " + format_size(bytes) +
                                                    " of a weights chunk that are not its file's" + stays);
      }
      const int e = fault_in(static_cast<char*>(m), g.mapped);
      const CUresult r = e == 0 ? d_->cuMemHostRegister(m, g.mapped, CU_MEMHOSTREGISTER_PORTABLE)
                                : CUDA_ERROR_OUT_OF_MEMORY;
      if (r != CUDA_SUCCESS) {
        (void)munmap(m, g.mapped);
        (void)sync_streams();
        return d_->error(r,
                         "pinning " + format_size(bytes) + " for the bytes of a weights chunk that are not its file's" + stays,
                         "cuMemHostRegister");
      }
      g.buf = static_cast<char*>(m);
      std::size_t put = 0;
      for (const auto& [off, len] : g.ranges) {
        const CUresult c = d_->cuMemcpyDtoHAsync(g.buf + put, a.va + off, len, stream);
        if (c != CUDA_SUCCESS) {
          (void)sync_streams();
          free_gaps(g);
          return d_->error(c, "copying the bytes of a weights chunk that are not its file's" + stays,
                           "cuMemcpyDtoHAsync");
        }
        put += len;
      }
      copied_to_host_ += bytes;
    }
    free_gaps(a.gaps[i]);  // (no copy can target the old buffer: it is only read by wakes)
    a.gaps[i] = std::move(g);
  }
  Status st = sync_streams();
  if (!st) return Status(st.code(), st.message() + stays);
  for (std::size_t i = 0; i < n; ++i) {
    if (in_file[i] == 0) {
      free_gaps(a.gaps[i]);
    } else if (i < a.pinned.size() && a.pinned[i] != 0) {
      // Sleeps in its file from now on: its pinned backup chunk goes back.
      const std::size_t cb = i * chunk_;
      (void)d_->cuMemHostUnregister(a.backup + cb);
      (void)madvise(a.backup + cb, std::min(chunk_, a.backup_mapped - cb), MADV_DONTNEED);
      a.pinned[i] = 0;
    }
  }
  a.from_file = std::move(in_file);
  a.dirty.assign(n, 0);
  a.backup_valid = true;
  return {};
}

std::uint64_t CudaBackend::bytes_copied_to_host() const {
  std::lock_guard<std::mutex> lock(mu_);
  return copied_to_host_;
}

std::uint64_t CudaBackend::bytes_copied_to_device() const {
  std::lock_guard<std::mutex> lock(mu_);
  return copied_to_device_;
}

std::uint64_t CudaBackend::pinned_host_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::uint64_t n = 0;
  for (const auto& [va, a] : allocations_) {
    for (std::size_t i = 0; i < a.pinned.size(); ++i)
      if (a.pinned[i] != 0) n += std::min(chunk_, a.backup_mapped - i * chunk_);
    for (const Gaps& g : a.gaps) n += g.mapped;
  }
  return n;
}

std::uint64_t CudaBackend::file_backed_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::uint64_t n = 0;
  for (const auto& [va, a] : allocations_) {
    for (const Piece& p : a.pieces) {
      for (std::size_t i = p.off / chunk_; i * chunk_ < p.off + p.len && i < a.from_file.size(); ++i) {
        if (a.from_file[i] == 0) continue;
        n += std::min(p.off + p.len, (i + 1) * chunk_) - std::max(p.off, i * chunk_);
      }
    }
  }
  return n;
}

bool CudaBackend::is_resident(const void* base) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = allocations_.find(static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(base)));
  return it != allocations_.end() && it->second.resident;
}

void* CudaBackend::host_backup(const void* base) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = allocations_.find(static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(base)));
  return it == allocations_.end() ? nullptr : it->second.backup;
}

std::size_t CudaBackend::host_backup_bytes(const void* base) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = allocations_.find(static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(base)));
  return it == allocations_.end() ? 0 : it->second.backup_mapped;
}

Status CudaBackend::prepare_backup(const void* base) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = allocations_.find(static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(base)));
  if (it == allocations_.end()) {
    return Status(ErrorCode::not_found, "cuda: prepare_backup of " + hex(reinterpret_cast<std::uintptr_t>(base)) +
                                            ", which this cuda backend did not allocate (or freed)");
  }
  DeviceAllocation& a = it->second;
  if (a.cls != RegionClass::weights || a.backup != nullptr) return {};
  ContextScope scope(*d_, ctx_);
  if (!scope.ok()) return Status(ErrorCode::backend_error, "cuda: cannot make the primary context current");
  return pin_backup(a, /*copy=*/false);
}

void CudaBackend::set_backup_threads(int threads) {
  std::lock_guard<std::mutex> lock(mu_);
  backup_threads_ = std::clamp(threads, 1, 64);
}

int CudaBackend::backup_threads() const {
  std::lock_guard<std::mutex> lock(mu_);
  return backup_threads_;
}

void CudaBackend::set_backup_pipeline(BackupPipeline p) {
  std::lock_guard<std::mutex> lock(mu_);
  pipeline_ = p;
}

CudaBackend::BackupPipeline CudaBackend::backup_pipeline() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pipeline_;
}

Status CudaBackend::last_release_status() const {
  std::lock_guard<std::mutex> lock(mu_);
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
