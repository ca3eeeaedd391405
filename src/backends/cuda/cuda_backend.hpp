// SPDX-License-Identifier: MIT
// residency cuda backend: the front that implements Backend (see include/residency/backends/cuda.hpp
// for what it is for). Its parts, one concern each:
//   VmmRange      an allocation's address range and the physical chunks behind it (vmm_range.hpp)
//   PinnedBackup  the pinned host memory its weights sleep in, and the pinning pipeline (host_backup.hpp)
//   FileBacked    its ranges that sleep in the model file instead (file_backing.hpp)
//   CudaProcess   what the process's backends share: the driver, per-device books (cuda_process.hpp)
//   DeviceLink    the device, its context and copy streams, as every part sees them (device_link.hpp)
// The front holds the sets and decides what wakes and sleeps; cuda_backend.cpp implements Backend,
// cuda_allocation.cpp the wake and sleep of one allocation and the background pinning.
//
// One design decision shapes it: an allocation's address range and its contents are two
// separate things. The range (cuMemAddressReserve) lives from allocate() to deallocate() and
// never moves; the physical memory behind it comes and goes in chunks (cuMemCreate +
// cuMemMap), and the contents of `weights` survive in a pinned host backup while the
// physical memory is gone. Every other choice (chunked copies over several streams, mapping
// overlapped with copying, rollback on a failed wake) follows from treating the physical
// memory as a cache of the backup that can be dropped and refilled at the link's rate.
#pragma once

#include <cuda.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "backends/cuda/device_link.hpp"
#include "backends/cuda/driver.hpp"
#include "backends/cuda/file_backing.hpp"
#include "backends/cuda/host_backup.hpp"
#include "backends/cuda/vmm_range.hpp"
#include "platform/thread_annotations.hpp"
#include "residency/backend.hpp"
#include "residency/backends/cuda.hpp"

namespace residency::cuda {

class CudaBackend final : public Backend {
 public:
  static Result<std::shared_ptr<CudaBackend>> create(const CudaBackendOptions& options);
  std::uint64_t pinned_host_bytes() const override;
  void track_writes(void* base) override;
  void written(const void* addr, std::size_t bytes) override;
  // A tracked allocation's range filled from a file
  // (docs/design.md, "Weights backed by their file"): while the file is unchanged (inode, size,
  // modification time) its bytes sleep in the file itself, which the first sleep maps read-only and
  // registers (cuMemHostRegister READ_ONLY) so that a wake copies from it at the link's rate; the
  // rest of such a copy chunk (alignment gaps, up to kMaxGapBytes) sleeps in a small pinned buffer.
  // A chunk with more gaps, or whose file changed or cannot be registered, sleeps in the pinned
  // backup as before; the fallback is said once per file through CudaBackendOptions::notice.
  void filled_from_file(const void* addr, std::size_t bytes, int fd, std::uint64_t offset) override;
  std::uint64_t file_backed_bytes() const override;
  // A release in end_residency() stops before its first unmap (docs/design.md, "The GPU budget").
  void interrupt_release() override;
  void set_wake_gate(WakeGate gate) override;
  std::uint64_t unmanaged_device_bytes() override;
  // The host tier (docs/design.md, "The host tier"): every registration of a model file asks the
  // gate first. A sleep that found no room sleeps its weights in the file unregistered, and then
  // the background thread makes room (the gate may ask and wait there) and registers the file,
  // unless a wake or drop_file_registrations() comes first.
  void set_host_gate(HostGate gate) override;
  std::uint64_t drop_file_registrations() override;
  // The first release, prepared (docs/design.md): on the background thread, the model files the
  // weights sleep in are mapped and registered piece by piece (kRegisterPiece), the pinned
  // backups of what the files do not hold are made chunk by chunk (tracked weights) or queued as
  // a whole (other weights-class memory, the KV cache), and `stop` is polled between steps.
  Preparation prepare_release(std::function<bool()> stop) override;
  void stop_preparation() override;
  // One copy of a release in flight per stream is at most this: how long a call that begins
  // waits for the copies already issued (about 1.2 ms at 55 GB/s).
  static constexpr std::size_t kCopyPiece = std::size_t{64} << 20;
  // The most bytes of a copy chunk that may be gaps for the chunk to sleep in its file.
  static constexpr std::size_t kMaxGapBytes = cuda::kMaxGapBytes;
  // The same, through the entry points in `driver` as given (tests substitute one to inject
  // failures). `driver` must outlive the backend.
  static Result<std::shared_ptr<CudaBackend>> create(const CudaBackendOptions& options, const Driver& driver);
  // Frees everything still held: physical memory, address ranges, pinned backups, host
  // registrations, streams; then releases the primary context.
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  Capabilities capabilities() const override;
  MemoryInfo memory_info() override;
  Result<void*> allocate(std::size_t size, RegionClass cls) override;
  void deallocate(void* base) override;
  Status create_set(SetId set, std::uint64_t capacity_bytes) override;
  Status destroy_set(SetId set) override;
  void add_region(SetId set, const RegionDesc& region) override;
  void remove_region(SetId set, RegionId region) override;
  // A region is wanted resident while any set that holds it has its residency requested.
  // request_residency / commit wake what is wanted and asleep; end_residency / commit put to
  // sleep what is no longer wanted. A backend allocation starts resident (an engine fills it
  // right after allocating) and stays so until a set holding it is released.
  SetOutcome commit(SetId set) override;
  SetOutcome request_residency(SetId set) override;
  Status end_residency(SetId set) override;

  // --- cuda-specific, for tests, benchmarks and tools that hold the concrete backend ---
  // Whether the physical memory of the allocation at `base` is mapped now.
  bool is_resident(const void* base) const;
  // The pinned host buffer the allocation's weights sleep in, or nullptr before its first
  // sleep (benchmarks copy from it to measure the plain pinned copy on the same bytes).
  void* host_backup(const void* base) const;
  // Bytes the backup maps (the allocation's size rounded up to the host page), 0 without one.
  std::size_t host_backup_bytes(const void* base) const;
  // Builds the pinned backup of a weights allocation now, without copying (its first sleep then
  // only copies): for engines that would rather pay the pinning at load time. No-op for other
  // classes and where a backup exists. On failure nothing is kept.
  Status prepare_backup(const void* base);
  // With CudaBackendOptions::Backup::after_allocation: waits until the background thread has
  // pinned the backups of every allocation made so far (true), or `timeout_ms` passed (false).
  bool wait_background_backups(int timeout_ms);
  // Waits until no preparation (prepare_release) is queued or running (true), or `timeout_ms`
  // passed (false).
  bool wait_preparation(int timeout_ms);
  // Bytes of model files registered with the GPU now, over all files (piece by piece).
  std::uint64_t registered_file_bytes() const override;
  // The host tier below "asleep": gives back the registration of every model file (their pages
  // may be evicted from now on); the weights asleep in them wake through a small staging ring
  // (StagingRing), reading the file. Returns the bytes unregistered. A later sleep registers a
  // file again.
  std::uint64_t unregister_files();
  // Bytes wakes read from model files through the staging ring, over the life.
  std::uint64_t staged_bytes() const;
  // Registrations made in the background after a sleep the host budget held back (runs, and
  // those that got room), over the life.
  std::uint64_t host_room_runs() const { return room_runs_.load(); }
  std::uint64_t host_room_granted() const { return room_granted_.load(); }
  // Waits until no such registration is queued or running (true), or `timeout_ms` passed.
  bool wait_host_room(int timeout_ms);
  // Preparations that ran (each until done or stopped) and steps they completed, over the life.
  std::uint64_t preparation_runs() const { return prep_runs_.load(); }
  std::uint64_t preparation_steps() const { return prep_steps_.load(); }
  // Backups the background thread pinned, and background pinnings that failed (the first sleep
  // of that allocation then pins its own).
  std::uint64_t background_backups() const { return bg_done_.load(); }
  std::uint64_t background_backup_failures() const { return bg_failed_.load(); }
  // Host threads that fault in and register a backup (default: half the hardware threads, at
  // most 16; clamped to 1..64).
  void set_backup_threads(int threads);
  int backup_threads() const;
  // Who registers a backup's chunks (host_backup.hpp).
  using BackupPipeline = cuda::BackupPipeline;
  void set_backup_pipeline(BackupPipeline p);
  BackupPipeline backup_pipeline() const;
  // The last release's Status (also returned by end_residency / destroy_set): a failure (no
  // pinned memory for the backup) leaves the region resident, nothing is lost.
  Status last_release_status() const;
  // Bytes the sleeps of this backend copied to host backups, over its life (tests and tools: a
  // tracked allocation that nobody wrote copies nothing at its second sleep).
  std::uint64_t bytes_copied_to_host() const;
  // Bytes the wakes of this backend restored to the device (from backups or files), over its life.
  std::uint64_t bytes_copied_to_device() const;
  // Bytes this backend has allocated (reserved sizes), and holds resident now (device mappings
  // plus host ranges it registered): what its own books say, for tests and diagnostics.
  std::uint64_t allocated_bytes() const;
  std::uint64_t resident_bytes() const;
  const Driver& driver() const { return *link_.d; }
  CUcontext context() const { return link_.ctx; }
  CUdevice device() const { return link_.dev; }
  std::size_t granularity() const { return link_.granularity; }
  std::size_t chunk_bytes() const { return link_.chunk; }

 private:
  // One allocation, by concern: its range, its backup, the writes reported, its file pieces.
  struct DeviceAllocation {
    VmmRange range;
    RegionClass cls = RegionClass::weights;
    std::uint64_t serial = 0;  // tells a freed allocation from a later one at the same address
    PinnedBackup backup;       // weights: made at the first sleep (or ahead), kept until deallocate()
    // track_writes(): the engine reports every write (written()), so a wake keeps backup.valid,
    // and `dirty` (one flag per copy chunk) says which chunks were written since the backup was
    // last made whole; a sleep copies only those. Untracked, a wake clears backup.valid and a
    // sleep copies everything.
    bool tracked = false;
    std::vector<std::uint8_t> dirty;
    FileBacked files;  // tracked weights filled from files
    // The first release, prepared: its whole backup was queued for pinning, or pinning a chunk of
    // it failed (its first sleep then pins and says why): not tried again ahead.
    bool prepare_tried = false;
  };
  struct HostRange {
    void* base = nullptr;
    std::size_t size = 0;
    bool registered = false;
    bool owned = false;  // false when the engine had registered it itself: we never unregister
  };
  struct Set {
    std::vector<RegionDesc> members;  // committed
    std::vector<RegionDesc> staged_add;
    std::vector<RegionId> staged_remove;
    bool requested = false;
  };

  CudaBackend(const Driver* d, CUdevice dev, CUcontext ctx, const CudaBackendOptions& o, std::size_t granularity);
  Status init_streams();

  // One allocation (cuda_allocation.cpp); the context is current.
  Status wake(DeviceAllocation& a) RESIDENCY_REQUIRES(mu_);
  Status sleep(DeviceAllocation& a) RESIDENCY_REQUIRES(mu_);  // save, then drop
  // What a sleep keeps (the backup of weights), made while the memory is still mapped.
  Status save(DeviceAllocation& a) RESIDENCY_REQUIRES(mu_);
  // Copies the chunks of a made backup that need it, in pieces a call that begins can stop.
  Status copy_out(DeviceAllocation& a, bool only_written) RESIDENCY_REQUIRES(mu_);
  void drop(DeviceAllocation& a) RESIDENCY_REQUIRES(mu_);  // the memory given back
  void free_allocation(DeviceAllocation& a) RESIDENCY_REQUIRES(mu_);
  PinSettings pin_settings() const;
  DeviceAllocation* find(const void* base) RESIDENCY_REQUIRES(mu_);
  const DeviceAllocation* find(const void* base) const RESIDENCY_REQUIRES(mu_);
  // The tracked allocation that holds `addr`, with the chunks [first, last) touches flagged as
  // written and its file pieces cut there; null where no tracked allocation is.
  DeviceAllocation* note_write(const void* addr, std::size_t bytes, std::size_t& first, std::size_t& last)
      RESIDENCY_REQUIRES(mu_);
  // Unregisters, unmaps and closes the files no allocation's pieces refer to any more.
  void drop_unused_files() RESIDENCY_REQUIRES(mu_);
  void say(const std::string& line) const;
  void trace_wake(const DeviceAllocation& a, bool restored, std::chrono::nanoseconds total,
                  std::chrono::nanoseconds queued, std::chrono::nanoseconds gated, std::uint64_t staged) const;
  void trace_sleep(const DeviceAllocation& a, std::chrono::nanoseconds saved, std::chrono::nanoseconds dropped,
                   std::uint64_t copied) const;
  std::string device_figure() const;

  // The sets (cuda_backend.cpp); the context is made current by wake_members/sleep_members.
  Status wire_region(const RegionDesc& r) RESIDENCY_REQUIRES(mu_);
  Status unwire_region(const RegionDesc& r) RESIDENCY_REQUIRES(mu_);
  bool wanted(RegionId id) const RESIDENCY_REQUIRES(mu_);
  SetOutcome wake_members(const std::vector<RegionDesc>& members) RESIDENCY_REQUIRES(mu_);
  // With `interruptible` (end_residency), a call that begins before anything was given back
  // stops the release: ErrorCode::interrupted, every member still resident.
  Status sleep_members(const std::vector<RegionDesc>& members, bool interruptible = false) RESIDENCY_REQUIRES(mu_);
  void note_mapped(std::uint64_t bytes, bool added) RESIDENCY_REQUIRES(mu_);  // mapped_bytes_ and the process's book

  DeviceLink link_;                  // set in create(), constant afterwards (the streams are used under mu_)
  std::string uuid_;                 // Capabilities::device_uuid
  const int stream_count_;           // CudaBackendOptions::streams (init_streams() makes them)
  std::atomic<int> backup_threads_;  // read by the background thread without mu_
  std::atomic<BackupPipeline> pipeline_{BackupPipeline::workers};
  const CudaBackendOptions::Backup backup_mode_;
  const std::function<void(const std::string&)> notice_;
  const std::function<void(const std::string&)> info_;   // CudaBackendOptions::info
  const std::function<void(const std::string&)> trace_;  // CudaBackendOptions::trace

  // Background pinning (Backup::after_allocation): one thread, started at the first weights
  // allocation, takes (address, serial) pairs in order and pins each one's backup without mu_,
  // then attaches it if the allocation still exists and has none.
  void background_loop();
  void queue_background_pin(CUdeviceptr va, std::uint64_t serial) RESIDENCY_REQUIRES(mu_);
  void start_background_thread() RESIDENCY_REQUIRES(mu_);
  // The first release, prepared: one step of the work (a file's piece registered, a chunk of a
  // backup pinned), under mu_; false when nothing is left.
  bool prepare_step() RESIDENCY_REQUIRES(mu_);
  bool preparation_left() RESIDENCY_REQUIRES(mu_);
  void run_preparation();  // on the background thread, until done or stopped
  bool preparation_stopped() RESIDENCY_EXCLUDES(bg_mu_);
  Mutex bg_mu_;  // after mu_ (see mu_)
  std::condition_variable bg_cv_;
  std::deque<std::pair<CUdeviceptr, std::uint64_t>> bg_queue_ RESIDENCY_GUARDED_BY(bg_mu_);
  bool bg_busy_ RESIDENCY_GUARDED_BY(bg_mu_) = false;
  bool bg_stop_ RESIDENCY_GUARDED_BY(bg_mu_) = false;
  std::function<bool()> prep_stop_ RESIDENCY_GUARDED_BY(bg_mu_);  // prepare_release's; empty: stopped
  bool prep_wanted_ RESIDENCY_GUARDED_BY(bg_mu_) = false;
  bool prep_running_ RESIDENCY_GUARDED_BY(bg_mu_) = false;
  // The host tier: a sleep's registration was held back; the background thread makes room and
  // registers (run_host_room), unless a wake or a drop comes first (their counters change).
  void run_host_room();
  void queue_host_room() RESIDENCY_REQUIRES(mu_);
  bool room_wanted_ RESIDENCY_GUARDED_BY(bg_mu_) = false;
  bool room_running_ RESIDENCY_GUARDED_BY(bg_mu_) = false;
  std::atomic<std::uint64_t> wakes_{0}, drops_{0};
  std::atomic<std::uint64_t> room_runs_{0}, room_granted_{0};
  std::atomic<std::uint64_t> prep_runs_{0};
  std::atomic<std::uint64_t> prep_steps_{0};
  std::thread bg_thread_ RESIDENCY_GUARDED_BY(mu_);
  std::atomic<std::uint64_t> bg_done_{0};
  std::atomic<std::uint64_t> bg_failed_{0};

  // The manager serialises calls already; this covers direct users and the background thread.
  // Lock order: the manager's lock, then mu_, then bg_mu_ (allocate() queues a pinning); a wake's
  // gate calls the manager's budget share under mu_, which takes neither.
  mutable Mutex mu_;
  std::map<CUdeviceptr, DeviceAllocation> allocations_ RESIDENCY_GUARDED_BY(mu_);  // by base address
  std::unordered_map<RegionId, HostRange> host_ranges_ RESIDENCY_GUARDED_BY(mu_);
  std::map<SetId, Set> sets_ RESIDENCY_GUARDED_BY(mu_);
  BackingFiles files_ RESIDENCY_GUARDED_BY(mu_);
  StagingRing staging_ RESIDENCY_GUARDED_BY(mu_);  // wakes from files whose registration was given back
  std::uint64_t next_serial_ RESIDENCY_GUARDED_BY(mu_) = 1;
  std::uint64_t allocated_bytes_ RESIDENCY_GUARDED_BY(mu_) = 0;   // sum of reserved sizes
  std::uint64_t mapped_bytes_ RESIDENCY_GUARDED_BY(mu_) = 0;      // reserved sizes of resident allocations
  std::uint64_t host_wired_bytes_ RESIDENCY_GUARDED_BY(mu_) = 0;  // host bytes registered by us
  std::uint64_t copied_to_host_ RESIDENCY_GUARDED_BY(mu_) = 0;    // bytes sleeps copied device-to-host
  std::uint64_t copied_to_device_ RESIDENCY_GUARDED_BY(mu_) = 0;  // bytes wakes restored
  // Backend::set_wake_gate: asked before each chunk a wake maps, while a request is paced.
  WakeGate gate_ RESIDENCY_GUARDED_BY(mu_);
  // Backend::set_host_gate: files_ asks it before each registration (it points here).
  HostGate host_gate_ RESIDENCY_GUARDED_BY(mu_);
  Status last_release_ RESIDENCY_GUARDED_BY(mu_);
  std::atomic<bool> releasing_{false};  // end_residency() is running
  std::atomic<bool> interrupt_{false};  // a call began during it
  bool interrupt_wanted() const;        // both
  std::atomic<bool> nvml_said_{false};  // unmanaged_device_bytes() said once why it is unknown
};

}  // namespace residency::cuda
