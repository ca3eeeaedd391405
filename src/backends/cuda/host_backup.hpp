// SPDX-License-Identifier: MIT
// The pinned host backup of a weights allocation: where its contents sleep while its physical
// memory is gone.
//
// The backup is anonymous host memory of exactly the allocation's size (rounded up to the host
// page), 2 MiB aligned and advised for transparent huge pages, pinned with cuMemHostRegister one
// copy chunk at a time, so that pinning runs at many threads' rate and overlaps the copies
// (cuMemHostAlloc pins on one thread, far below the link's rate, docs/measurements.md, and rounds
// nothing, but PyTorch's pinned allocator rounds to a power of two). It is made at the first
// sleep (or ahead of it) and kept until the allocation is freed.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "backends/cuda/device_link.hpp"
#include "residency/status.hpp"

namespace residency::cuda {

// Who registers a chunk of a backup: the faulting thread that completed it (workers, the default),
// or the thread that issues the copies, in order, while the others fault memory in (registrar).
// Both ran at the same rate with 8 threads (docs/measurements.md); the choice is kept for
// measurements.
enum class BackupPipeline { registrar, workers };

// How a backup is pinned: host threads that fault it in and register it (clamped to 1..64), and
// who registers.
struct PinSettings {
  int threads = 1;
  BackupPipeline pipeline = BackupPipeline::workers;
};

struct PinnedBackup {
  char* base = nullptr;
  std::size_t mapped = 0;            // bytes the mapping holds (the size rounded up to the host page)
  std::vector<std::uint8_t> pinned;  // per copy chunk, whether it is registered (empty: none)
  // The backup holds the contents: from a sleep until the next write can happen (a wake, unless
  // the engine reports its writes). Implies base != nullptr.
  bool valid = false;

  // Maps (the first time), faults in and registers the chunks [0, size) needs (`need`, one flag
  // per chunk; null: all) on settings.threads host threads. With `copy`, each chunk's copy from
  // the device range at `va` is issued as soon as it is registered, and the call returns once all
  // copies are done. A failure part-way rolls back (what this call registered is unregistered, a
  // fresh mapping unmapped) and returns why; the device memory was not touched.
  Status pin(const DeviceLink& link, CUdeviceptr va, std::size_t size, bool copy, const std::vector<std::uint8_t>* need,
             const PinSettings& settings);
  // Unpins chunk i and gives its pages back (it sleeps elsewhere from now on).
  void unpin_chunk(const DeviceLink& link, std::size_t i);
  // Unregisters and unmaps everything.
  void free(const DeviceLink& link);
  std::uint64_t pinned_bytes(const DeviceLink& link) const;
};

// The host page size.
std::size_t host_page();
// Faults [p, p + len) in for writing (MADV_POPULATE_WRITE, or a write to each page on kernels
// before 5.14). Returns 0 or an errno.
int fault_in(char* p, std::size_t len);
// Half the hardware threads, at most 16: past half the cores the faulting threads slow each other
// down, and far fewer leave the pinning behind the copies (docs/measurements.md).
int default_backup_threads();

}  // namespace residency::cuda
