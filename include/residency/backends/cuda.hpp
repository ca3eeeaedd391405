// SPDX-License-Identifier: MIT
// residency: the cuda backend, device memory that sleeps and wakes at the link's bandwidth.
//
// Serving several models on one GPU needs "sleep" (give the device memory back) and a fast
// "wake", and the model's pointers (and CUDA graphs captured with them) must survive both.
// So device memory is allocated through the manager with the driver's virtual memory
// management API: the address range is reserved once and never moves; only the physical memory
// behind it is released on sleep (after `weights` are copied to a pinned host backup) and
// created, mapped and refilled on wake.
//
// The driver is loaded at run time (dlopen of libcuda.so.1), so binaries built with this
// backend start on machines without an NVIDIA driver; there make_cuda_backend() returns an
// error saying so and make_backend("auto") falls through to the next backend.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "residency/backend.hpp"
#include "residency/status.hpp"

namespace residency {

// Sleep (a set's residency ended) synchronizes the device, copies `weights` into the pinned host
// backup, then unmaps and releases the physical memory; `kv_cache` and `scratch` are dropped
// without a copy. Wake (residency requested) creates and maps physical memory again and restores
// the contents. Both directions are chunked over several streams, and wake overlaps the mapping
// of later chunks with the copies of earlier ones, which is what takes them from a fraction of
// the link's rate, where the peers (vLLM sleep mode, torch_memory_saver) run, to the link's rate
// (docs/measurements.md). A wake that runs out of device memory rolls back what it mapped, keeps
// the backup and returns an error. Host memory registered with the manager (e.g. mmap'd weights
// the GPU reads) is wired with cuMemHostRegister and released with cuMemHostUnregister.
struct CudaBackendOptions {
  // Which device (ordinal, as nvidia-smi numbers them unless CUDA_VISIBLE_DEVICES says
  // otherwise). Its primary context is used, the one the CUDA runtime uses, so the engine's
  // kernels and this backend's copies see the same memory.
  int device = 0;
  // Unit of physical memory and of one copy, rounded up to the allocation granularity
  // (2 MiB on current GPUs). 256 MiB: long enough that a copy's launch costs < 0.1% of it at
  // 55 GB/s, short enough that the first chunk's mapping, which nothing overlaps, is short.
  // A sweep of chunk sizes (docs/measurements.md): wake hardly depends on it; sleep loses more to
  // a plain copy below 256 MiB.
  std::size_t chunk_bytes = std::size_t{256} << 20;
  // Streams the chunks are spread over, round robin (1 to 16).
  int streams = 4;
  // When a weights allocation's pinned host backup is made; it is made once and kept between
  // cycles (re-pinning costs more than the copy). `at_first_sleep`: its first sleep
  // pins it while it copies (host memory is taken only by what sleeps). `after_allocation`: a
  // background thread pins it right after allocate(), so that even the first sleep only copies
  // (at the link's rate), at the price of host memory the size of the weights from the start; a
  // sleep that comes before the background pinning is done pins on its own, as at_first_sleep.
  enum class Backup { at_first_sleep, after_allocation };
  Backup backup = Backup::at_first_sleep;
  // Receives one line where weights filled from a file cannot sleep in it and are backed up in
  // pinned host memory instead (the file changed since load, or cannot be registered), and where a
  // file changed while the weights slept in it. Default: nothing is said.
  std::function<void(const std::string&)> notice;
  // (optional) Events an operator may want to see that are not problems: a wake from the host
  // tier below "asleep" (the model file read through the staging buffers). Default: not said.
  std::function<void(const std::string&)> info;
  // Receives the wake's timeline, one line per allocation woken: the time it waited for the
  // budget's room, mapped and queued its copies, and waited for them, and where the bytes came
  // from (the model file's pages, pinned host memory). For a debug log; default: not measured.
  std::function<void(const std::string&)> trace;
};

// Errors: no driver (libcuda.so.1 missing), driver older than CUDA 12.0, no such device,
// a device without virtual memory management support, bad options.
Result<std::shared_ptr<Backend>> make_cuda_backend(const CudaBackendOptions& options = {});

}  // namespace residency
