// SPDX-License-Identifier: MIT
// HostGpu's insides (host_gpu.hpp says what it is and why), shared by its two halves:
// host_gpu.cpp (the device, contexts, streams, events, error names and the HostGpu object) and
// host_gpu_memory.cpp (device memory, host registrations, copies). Every entry point takes
// State::mu for what it reads or changes; copies run under it too, so a copy never races with the
// unmapping of its range.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <sys/mman.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <type_traits>

#include "support/host_gpu.hpp"

namespace residency::cuda::testing::host_gpu {

using Clock = std::chrono::steady_clock;

struct Physical {  // cuMemCreate: a memfd of the size
  int fd = -1;
  std::size_t size = 0;
  int mappings = 0;
  bool released = false;  // freed once its last mapping goes
};
struct Mapping {  // cuMemMap into a reservation
  std::size_t size = 0;
  CUmemGenericAllocationHandle handle = 0;
  int prot = PROT_NONE;  // cuMemSetAccess
};
struct Registration {  // cuMemHostRegister, or cuMemHostAlloc (then the memory is ours to unmap)
  std::size_t size = 0;
  unsigned flags = 0;
  bool host_alloc = false;
};

struct State {
  mutable std::mutex mu;
  HostGpu::Config config;
  std::map<CUdeviceptr, std::size_t> reservations;  // base -> size
  std::map<CUmemGenericAllocationHandle, Physical> physical;
  CUmemGenericAllocationHandle next_handle = 1;
  std::uint64_t used = 0;  // bytes of `physical`
  // The memfds of freed physical memory, by size, for cuMemCreate to use again (at most
  // `capacity` bytes of them): their pages are there already, and fresh pages cost more than a
  // wake's copies on a small VM.
  std::multimap<std::size_t, int> spare;
  std::uint64_t spare_bytes = 0;
  std::map<CUdeviceptr, Mapping> mappings;
  std::map<std::uintptr_t, Registration> registrations;  // by base address
  std::map<CUdeviceptr, std::size_t> allocs;             // cuMemAlloc: base -> size
  std::map<std::uintptr_t, bool> streams;                // handle -> (unused)
  std::map<std::uintptr_t, Clock::time_point> events;    // handle -> last record (epoch: none)
  std::uintptr_t next_token = 0x5000;
  int context_retains = 0;
  bool faulting = false;
  HostGpu::RegisterFault fault;
  int fault_seen = 0;
  HostGpu::CopyHook hook;
  HostGpu::Counters counters;
};

// The one State, never destroyed (a backend may outlive static destructors).
State& state();
// Whether this thread has made a context current (cuCtxPushCurrent).
bool has_context();
// Whether `st` is a stream: made and not destroyed, or one of the predefined ones.
bool stream_ok(const State& s, CUstream st);
// The registration that holds [p, p + n) whole, or null.
const Registration* registration_of(const State& s, std::uintptr_t p, std::size_t n);
// Frees every reservation, mapping, piece of physical memory and registration (HostGpu::reset()).
void release_memory(State& s);

// The entry points, one per RESIDENCY_CUDA_DRIVER_FUNCTIONS line, each of its PFN_ type; defined
// in the two halves.
#define HOST_GPU_DECLARE(name, version) std::remove_pointer_t<PFN_##name##_v##version> host_##name;
RESIDENCY_CUDA_DRIVER_FUNCTIONS(HOST_GPU_DECLARE)
#undef HOST_GPU_DECLARE

}  // namespace residency::cuda::testing::host_gpu
