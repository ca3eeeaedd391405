// SPDX-License-Identifier: MIT
// The preload on CUDA builds of llama.cpp: the device memory the engine allocates goes through
// the manager's cuda backend, at addresses that never move, so that the process can sleep (its
// GPU memory given back after the keep-alive) and wake at the same addresses before it next
// touches the memory. CUDA graphs llama.cpp captured stay valid: they hold those addresses.
//
// What llama.cpp (ggml-cuda) does, and what is interposed for it:
// - Every buffer of its CUDA buffer type (the model's weights, the KV cache, the compute buffers
//   of its graph allocator) is one cudaMalloc, freed with cudaFree. cudaMalloc calls of 2 MiB or
//   more become Manager::allocate() on the current device (cudaGetDevice); smaller ones (cuBLAS
//   workspaces and the like) stay the runtime's.
// - Its compute buffers are allocated inside ggml_gallocr_reserve_n / ggml_gallocr_alloc_graph:
//   cudaMalloc calls made there are `scratch` (dropped at sleep, nothing copied). Everything else
//   keeps its contents across a sleep (copied to the pinned host backup): the weights, and the KV
//   cache too, because a server reuses its cached prompt after an idle pause, so dropping it would
//   silently corrupt the next answer.
// - The temporary pool ggml-cuda keeps for single operations is mapped with the driver's virtual
//   memory API directly (cuMemCreate/cuMemMap) and is not interposed: it stays, like the CUDA
//   context itself (both are measured in bench/results; they are what an asleep process holds).
// - Before any access to device memory the memory must be mapped: llama_decode / llama_encode
//   (a use, like on the host), and every ggml entry point that reads or writes a backend buffer
//   outside a decode (tensor get/set/memset/copy, buffer clear, graph compute: state save and
//   load, KV clears, multimodal encoders) wakes it first.
//
// Under keep-alive 0 the device memory sleeps at the end of every decode, and an access outside a
// decode keeps it awake until the end of the next decode. Pressure on host memory never releases
// device memory (a sleep would need more host memory, not less).
//
// Any failure (no driver, a device without virtual memory management, an allocation the backend
// refuses) is one warning, and that memory is the runtime's as without the preload.
#pragma once

#include <cstddef>

#include <llama.h>

#include "next_calls.hpp"

namespace residency::preload {

// cudaMalloc / cudaFree as the preload defines them (return values are cudaError_t).
int device_malloc_hook(void** ptr, std::size_t size) noexcept;
int device_free_hook(void* ptr) noexcept;

// Before a ggml call that may read or write device memory: wakes what sleeps.
void device_access() noexcept;

// While one is open on this thread, routed allocations are scratch (ggml's graph allocator).
class ComputeAllocationScope {
 public:
  ComputeAllocationScope() noexcept;
  ~ComputeAllocationScope();
  ComputeAllocationScope(const ComputeAllocationScope&) = delete;
  ComputeAllocationScope& operator=(const ComputeAllocationScope&) = delete;
};

// Around llama_decode / llama_encode: the device memory is awake for the call (one engine call,
// Manager::begin_call() to end_call(), on each device's manager).
class DeviceDecodeScope {
 public:
  explicit DeviceDecodeScope(llama_context* ctx) noexcept;
  ~DeviceDecodeScope();
  DeviceDecodeScope(const DeviceDecodeScope&) = delete;
  DeviceDecodeScope& operator=(const DeviceDecodeScope&) = delete;

 private:
  bool active_ = false;
  llama_context* ctx_ = nullptr;
};

}  // namespace residency::preload
