// SPDX-License-Identifier: MIT
// What of one ggml backend buffer residency registers: the decision, as a pure function of the
// facts ggml's public API tells about the buffer, so that every layout llama.cpp makes on any CPU
// (file-mapped, AMX, CPU_REPACK, plain CPU, a GPU's pinned host buffers, device memory) can be
// tested on every machine (tests/unit/buffer_plan_test.cpp).
//
// Why buffers and not the GGUF mapping: ggml's CPU backend does not always decode from the file.
// The AMX and CPU_REPACK buffer types take most weight matrices, copied (repacked) into anonymous
// memory at load, and decode reads only that copy; what is left in the file is a CPU_Mapped buffer
// over the mapping whose range spans the copied tensors' file ranges too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "residency/backend.hpp"

namespace residency::preload {

// ggml_backend_dev_type, plus "no device" (ggml's CPU buffer type has none).
enum class DeviceKind { none, cpu, gpu, igpu, accel };
// ggml_backend_buffer_usage.
enum class BufferUsage { any, weights, compute };

struct Extent {
  std::uintptr_t begin = 0;
  std::uintptr_t end = 0;  // exclusive
};

struct BufferFacts {
  std::uintptr_t base = 0;
  std::size_t size = 0;
  bool is_host = false;  // ggml_backend_buft_is_host (false for AMX and CPU_REPACK)
  DeviceKind device = DeviceKind::none;
  bool from_ptr = false;  // made over memory ggml does not own (ggml_backend_cpu_buffer_from_ptr)
  BufferUsage usage = BufferUsage::any;
  std::vector<Extent> tensors;  // from_ptr buffers: where its tensors were placed
};

// The plan: a buffer ggml allocated (its own memory) is registered whole; a buffer over memory
// that is not ggml's (from_ptr: a file mapping) as the pages of the tensors placed in it, merged,
// never the file ranges between them; a GPU's pinned host buffer (CUDA_Host) not at all (its
// driver keeps it pinned for its whole life); device memory is not host memory (the session's
// device side routes it). The class comes from the usage llama.cpp sets: WEIGHTS, COMPUTE
// (scratch); everything else (the KV cache, recurrent state, the output buffer) holds state that
// must survive a release: kv_cache.
struct BufferPlan {
  // To register, sorted and disjoint; empty: nothing. A from_ptr buffer's are whole pages, an
  // owned buffer's is its exact range (heap buffers may share a page; mlock rounds anyway).
  std::vector<Extent> ranges;
  RegionClass cls = RegionClass::weights;
  std::size_t registered_bytes = 0;
  // Empty when ranges are registered; else why not, for the log ("device memory", ...).
  std::string not_managed;
  bool worth_a_line = false;  // not_managed says something a user should read (not device memory)
};

// Host memory as ggml describes it: a buffer type without a device, or of the CPU device or an
// accelerator that computes from host memory (BLAS, AMX), whatever is_host says.
bool is_cpu_memory(DeviceKind device) noexcept;

// sysconf(_SC_PAGESIZE), read once (4096 if it fails).
std::size_t system_page_size() noexcept;

BufferPlan plan_buffer(const BufferFacts& facts, std::size_t page_size);

RegionClass class_of(BufferUsage usage) noexcept;

// The extents rounded out to whole pages, clipped to [clip_begin, clip_end) (itself rounded out),
// sorted and merged where they touch or overlap.
std::vector<Extent> page_runs(std::vector<Extent> extents, std::uintptr_t clip_begin, std::uintptr_t clip_end,
                              std::size_t page_size);

// [begin, end) minus the runs (sorted, disjoint), with every piece rounded in to whole pages:
// what of a file mapping no tensor is read from.
std::vector<Extent> page_gaps(std::uintptr_t begin, std::uintptr_t end, const std::vector<Extent>& runs,
                              std::size_t page_size);

}  // namespace residency::preload
