// SPDX-License-Identifier: MIT
// residency cuda backend: the Backend implementation (see include/residency/backends/cuda.hpp
// for what it is for).
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

#include <sys/types.h>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "backends/cuda/driver.hpp"
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
  // One copy of a release in flight per stream is at most this: how long a call that begins
  // waits for the copies already issued (about 1.2 ms at 55 GB/s).
  static constexpr std::size_t kCopyPiece = std::size_t{64} << 20;
  // The most bytes of a copy chunk that may be gaps (not from a file) for the chunk to sleep in
  // its file: 1/16 of a 256 MiB chunk.
  static constexpr std::size_t kMaxGapBytes = std::size_t{16} << 20;
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
  // Backups the background thread pinned, and background pinnings that failed (the first sleep
  // of that allocation then pins its own).
  std::uint64_t background_backups() const { return bg_done_.load(); }
  std::uint64_t background_backup_failures() const { return bg_failed_.load(); }
  // Host threads that fault in and register a backup (default: half the hardware threads, at
  // most 16; clamped to 1..64).
  void set_backup_threads(int threads);
  int backup_threads() const;
  // Who registers a backup's chunks: the faulting thread that completed the chunk (workers,
  // the default), or the thread that issues the copies, in order, while the others fault
  // memory in (registrar). Both ran at the same rate with 8 threads (docs/measurements.md);
  // the choice is kept for measurements.
  enum class BackupPipeline { registrar, workers };
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
  const Driver& driver() const { return *d_; }
  CUcontext context() const { return ctx_; }
  CUdevice device() const { return dev_; }
  std::size_t granularity() const { return granularity_; }
  std::size_t chunk_bytes() const { return chunk_; }

 private:
  // A file that backs device ranges: our own descriptor of it (dup'ed), what it was when first
  // seen, and, from the first sleep that needs it, the whole file mapped read-only and registered.
  struct BackingFile {
    int fd = -1;
    std::string name;  // the path /proc/self/fd gave, for the log
    dev_t dev = 0;
    ino_t ino = 0;
    off_t size = 0;
    std::int64_t mtime_ns = 0;
    char* map = nullptr;  // registered read-only while non-null
    std::size_t map_len = 0;
    bool unusable = false;  // changed, or cannot be mapped or registered: backs nothing from now on
  };
  // Device bytes [off, off + len) of an allocation equal the file's bytes at file_off.
  struct Piece {
    std::size_t off = 0;
    std::size_t len = 0;
    BackingFile* file = nullptr;
    std::uint64_t file_off = 0;
  };
  // The bytes of a copy chunk that sleeps in its file but are not the file's: [off, off + len)
  // ranges of the allocation, kept one after the other in a small pinned buffer.
  struct Gaps {
    char* buf = nullptr;
    std::size_t mapped = 0;
    std::vector<std::pair<std::size_t, std::size_t>> ranges;
  };
  struct DeviceAllocation {
    CUdeviceptr va = 0;
    std::size_t size = 0;      // what the engine asked for
    std::size_t reserved = 0;  // size rounded up to the granularity
    RegionClass cls = RegionClass::weights;
    // One physical handle per chunk while resident; empty while asleep.
    std::vector<CUmemGenericAllocationHandle> chunks;
    bool resident = false;
    // Pinned host memory, `backup_mapped` bytes (size rounded up to the host page), registered
    // in chunks of chunk_ bytes; made at the first sleep of a weights allocation (or by
    // prepare_backup) and kept until deallocate(). Invariant: backup_valid implies backup !=
    // nullptr and the backup holds the contents (true from a sleep until the next write can
    // happen, i.e. a wake).
    char* backup = nullptr;
    std::size_t backup_mapped = 0;
    bool backup_valid = false;
    // track_writes(): the engine reports every write (written()), so a wake keeps backup_valid,
    // and `dirty` (one flag per copy chunk of chunk_ bytes) says which chunks were written since
    // the backup was last made whole; a sleep copies only those. Untracked, a wake clears
    // backup_valid and a sleep copies everything.
    bool tracked = false;
    std::vector<std::uint8_t> dirty;
    std::uint64_t serial = 0;  // tells a freed allocation from a later one at the same address
    // Which chunks of the backup mapping are pinned (registered): all after a whole pin_backup;
    // only those that sleep in it for an allocation with file pieces. Empty: none.
    std::vector<std::uint8_t> pinned;
    // Tracked allocations filled from files: the pieces (sorted by off, disjoint); per copy chunk,
    // whether its last sleep kept it in its file (1) or in the pinned backup (0), and its gaps.
    std::vector<Piece> pieces;
    std::vector<std::uint8_t> from_file;
    std::vector<Gaps> gaps;
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

  // Callers hold mu_ and have the context current.
  Status wake(DeviceAllocation& a);
  Status sleep(DeviceAllocation& a);  // save, then drop
  Status save(DeviceAllocation& a);   // the backup (weights), the memory still mapped
  void drop(DeviceAllocation& a);     // the memory given back
  // Maps, faults in and registers a's backup chunk by chunk on backup_threads_ host threads;
  // with `copy`, each chunk's device-to-host copy is issued as soon as it is registered and
  // the call returns once all copies are done. On failure everything is undone.
  //
  // The backup is anonymous host memory of exactly the allocation's size (rounded up to the host
  // page), 2 MiB aligned and advised for transparent huge pages, pinned with cuMemHostRegister
  // one copy chunk at a time, so that pinning runs at many threads' rate and overlaps the copies
  // (cuMemHostAlloc pins on one thread, far below the link's rate, docs/measurements.md, and
  // rounds nothing, but PyTorch's pinned allocator rounds to a power of two). A failure to pin
  // part-way rolls back: whatever was registered is unregistered, the memory is unmapped, and the
  // allocation stays resident.
  // With `need` (one flag per chunk), only those chunks are pinned (and copied), in the backup
  // mapping made by the first call; the others stay unpinned. Pinned chunks are flagged in a.pinned.
  Status pin_backup(DeviceAllocation& a, bool copy, const std::vector<std::uint8_t>* need = nullptr);
  void free_backup(DeviceAllocation& a);
  // The sleep of a tracked allocation with file pieces: each written chunk is saved in its file and
  // gap buffer, or in the pinned backup (see filled_from_file).
  Status sleep_from_files(DeviceAllocation& a);
  // Issues the copies that refill chunk `i` from its file pieces and gaps on `stream`.
  CUresult restore_from_file(const DeviceAllocation& a, std::size_t i, CUstream stream) const;
  // Whether `f` can back ranges now: unchanged since first seen, mapped and registered (done
  // here the first time). When not, it is marked unusable and the notice says why, once.
  bool file_ready(BackingFile& f);
  // Whether `f`, as its descriptor sees it now, is still what was first seen.
  static bool file_unchanged(const BackingFile& f);
  void cut_pieces(DeviceAllocation& a, std::size_t begin, std::size_t end);
  DeviceAllocation* note_write_locked(const void* addr, std::size_t bytes, std::size_t& first, std::size_t& last);
  void free_gaps(Gaps& g);
  // Unregisters, unmaps and closes the files no allocation's pieces refer to any more.
  void drop_unused_files();
  void say(const std::string& line) const;
  void unmap_chunks(DeviceAllocation& a, std::size_t count);
  Status wire_region(const RegionDesc& r);
  Status unwire_region(const RegionDesc& r);
  bool wanted(RegionId id) const;
  SetOutcome wake_members(const std::vector<RegionDesc>& members);
  // With `interruptible` (end_residency), a call that begins before anything was given back
  // stops the release: ErrorCode::interrupted, every member still resident.
  Status sleep_members(const std::vector<RegionDesc>& members, bool interruptible = false);
  Status sync_streams();
  void note_mapped(std::uint64_t bytes, bool added);  // mapped_bytes_ and the process's book

  const Driver* d_;
  CUdevice dev_;
  std::string uuid_;  // Capabilities::device_uuid
  CUcontext ctx_;
  std::size_t granularity_;
  std::size_t chunk_;
  int stream_count_;
  std::atomic<int> backup_threads_;  // read by the background thread without mu_
  std::atomic<BackupPipeline> pipeline_{BackupPipeline::workers};
  const CudaBackendOptions::Backup backup_mode_;
  std::uint64_t next_serial_ = 1;

  // Background pinning (Backup::after_allocation): one thread, started at the first weights
  // allocation, takes (address, serial) pairs in order and pins each one's backup without mu_,
  // then attaches it if the allocation still exists and has none.
  void background_loop();
  std::mutex bg_mu_;
  std::condition_variable bg_cv_;
  std::deque<std::pair<CUdeviceptr, std::uint64_t>> bg_queue_;  // under bg_mu_
  bool bg_busy_ = false;                                        // under bg_mu_
  bool bg_stop_ = false;                                        // under bg_mu_
  std::thread bg_thread_;                                       // started under mu_
  std::atomic<std::uint64_t> bg_done_{0};
  std::atomic<std::uint64_t> bg_failed_{0};
  std::vector<CUstream> streams_;

  mutable std::mutex mu_;  // the manager serialises calls already; this covers direct users
  std::map<CUdeviceptr, DeviceAllocation> allocations_;  // by base address
  std::unordered_map<RegionId, HostRange> host_ranges_;
  std::map<SetId, Set> sets_;
  std::uint64_t allocated_bytes_ = 0;   // sum of reserved sizes
  std::uint64_t mapped_bytes_ = 0;      // reserved sizes of resident allocations
  std::uint64_t host_wired_bytes_ = 0;  // host bytes registered by us
  std::uint64_t copied_to_host_ = 0;    // bytes sleeps copied device-to-host
  std::uint64_t copied_to_device_ = 0;  // bytes wakes restored
  std::map<std::pair<dev_t, ino_t>, std::unique_ptr<BackingFile>> files_;
  std::function<void(const std::string&)> notice_;
  std::atomic<bool> releasing_{false};  // end_residency() is running
  std::atomic<bool> interrupt_{false};  // a call began during it
  // Backend::set_wake_gate: asked before each chunk a wake maps, while a request is paced (mu_).
  WakeGate gate_;
  std::atomic<bool> nvml_said_{false};  // unmanaged_device_bytes() said once why it is unknown
  bool interrupt_wanted() const;        // both
  Status last_release_;
};

}  // namespace residency::cuda
