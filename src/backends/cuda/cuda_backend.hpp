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
//
// Residency rule: a region is wanted resident while any set that holds it has its residency
// requested. request_residency / commit wake what is wanted and asleep; end_residency /
// commit put to sleep what is no longer wanted. A backend allocation starts resident (an
// engine fills it right after allocating) and stays so until a set holding it is released.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "backends/cuda/driver.hpp"
#include "residency/backend.hpp"
#include "residency/backends/cuda.hpp"

namespace residency::cuda {

class CudaBackend final : public Backend {
 public:
  static Result<std::shared_ptr<CudaBackend>> create(const CudaBackendOptions& options);
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
  SetOutcome commit(SetId set) override;
  SetOutcome request_residency(SetId set) override;
  Status end_residency(SetId set) override;

  // --- cuda-specific, for tests, benchmarks and tools that hold the concrete backend ---
  // Whether the physical memory of the allocation at `base` is mapped now.
  bool is_resident(const void* base) const;
  // The pinned host buffer the allocation's weights sleep in, or nullptr before its first
  // sleep (benchmarks copy from it to measure the plain pinned copy on the same bytes).
  void* host_backup(const void* base) const;
  // The last release's Status (also returned by end_residency / destroy_set): a failure (no
  // pinned memory for the backup) leaves the region resident, nothing is lost.
  Status last_release_status() const;
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
  struct DeviceAllocation {
    CUdeviceptr va = 0;
    std::size_t size = 0;      // what the engine asked for
    std::size_t reserved = 0;  // size rounded up to the granularity
    RegionClass cls = RegionClass::weights;
    // One physical handle per chunk while resident; empty while asleep.
    std::vector<CUmemGenericAllocationHandle> chunks;
    bool resident = false;
    // Pinned, `size` bytes, allocated at the first sleep of a weights allocation and kept
    // until deallocate(). Invariant: backup_valid implies backup != nullptr and the backup
    // holds the contents (true from a sleep until the next write can happen, i.e. a wake).
    void* backup = nullptr;
    bool backup_valid = false;
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

  CudaBackend(const Driver* d, CUdevice dev, CUcontext ctx, const CudaBackendOptions& o,
              std::size_t granularity);
  Status init_streams();

  // Callers hold mu_ and have the context current.
  Status wake(DeviceAllocation& a);
  Status sleep(DeviceAllocation& a);
  void unmap_chunks(DeviceAllocation& a, std::size_t count);
  Status wire_region(const RegionDesc& r);
  Status unwire_region(const RegionDesc& r);
  bool wanted(RegionId id) const;
  SetOutcome wake_members(const std::vector<RegionDesc>& members);
  Status sleep_members(const std::vector<RegionDesc>& members);
  Status sync_streams();

  const Driver* d_;
  CUdevice dev_;
  CUcontext ctx_;
  std::size_t granularity_;
  std::size_t chunk_;
  int stream_count_;
  std::vector<CUstream> streams_;

  mutable std::mutex mu_;  // the manager serialises calls already; this covers direct users
  std::map<CUdeviceptr, DeviceAllocation> allocations_;  // by base address
  std::unordered_map<RegionId, HostRange> host_ranges_;
  std::map<SetId, Set> sets_;
  std::uint64_t allocated_bytes_ = 0;  // sum of reserved sizes
  std::uint64_t mapped_bytes_ = 0;     // reserved sizes of resident allocations
  std::uint64_t host_wired_bytes_ = 0; // host bytes registered by us
  Status last_release_;
};

}  // namespace residency::cuda
