// SPDX-License-Identifier: MIT
// The CUDA preload's hooks (docs/design.md, "Any CUDA program"): what each intercepted CUDA call
// tells the program session, and the driver API's wrappers.
//
// A program reaches the driver in three ways, and each is covered:
//   - by symbol (a program or library linked with -lcuda): the preload exports the functions
//     (cuda_preload.cpp), each forwarding to the next definition;
//   - through cuGetProcAddress and cudaGetDriverEntryPoint[ByVersion] (how recent PyTorch gets its
//     driver entry points, expandable segments included): the preload hands out its wrapper of the
//     function asked for, bound to the real function the driver gave (wrap_driver below);
//   - through the runtime (libcudart as a shared library, as PyTorch loads it): the preload exports
//     cudaMalloc, cudaLaunchKernel and the others (cuda_preload.cpp), which call the actions below.
// The runtime's own calls into the driver go through entry points it looked up itself, past the
// preload, so one program call is seen once.
//
// The actions never wait on a lock the program may hold: the session's lock is the preload's own,
// and while it is held nothing calls back into the program.
#pragma once

#include <cuda.h>

#include <cstddef>

#include "backends/cuda/program_mappings.hpp"
#include "program_session.hpp"

namespace residency::cudapreload {

// What the hooks need besides the functions they forward to. The preload sets its own
// (cuda_preload.cpp); tests set theirs.
struct HookEnv {
  // The session, made on first need; null: everything passes through (not made, or refused).
  ProgramSession* (*session)() noexcept = nullptr;
  // The device the calling thread's next allocation goes to (the current context's), -1: unknown.
  int (*driver_device)() noexcept = nullptr;
  // One line, said once per `key` (a warning about a call the preload does not manage).
  void (*warn_once)(int key, const char* line) noexcept = nullptr;
  // (optional) The backend of the memory the program maps itself on `device` (the one the
  // session's mapping manager holds), made on first need; null: such memory is not managed.
  cuda::ProgramMappings* (*mappings)(int device) noexcept = nullptr;
};
void set_hook_env(const HookEnv& env) noexcept;
const HookEnv& hook_env() noexcept;

// ---- The actions, shared by the runtime's and the driver's hooks ----

// Whether an allocation of `size` bytes may be routed (asked before the current device is).
bool may_route(std::size_t size) noexcept;
// An allocation of `size` bytes on `device`, with the tag of the region open on this thread.
ProgramSession::Allocation route_allocation(int device, std::size_t size) noexcept;
// A free: true when `ptr` was routed (the session let it go).
bool route_free(void* ptr) noexcept;
// Open for the time a launch, copy or memset is enqueued (wakes first where asleep).
ProgramSession::Use use_device() noexcept;
// A stream capture begins (before the call) or ended (after it) on `stream`.
void capture_began(const void* stream) noexcept;
void capture_ended(const void* stream) noexcept;
// A copy or memset is about to write [dst, dst + bytes).
void device_written(const void* dst, std::size_t bytes) noexcept;
// The program exports [ptr, ...) over CUDA IPC: where it is routed, the session stands aside (the
// export of memory the preload maps itself cannot be opened by another process as the program
// expects). Either way the call goes ahead.
void ipc_export(const void* ptr, const char* call) noexcept;
// Memory the preload does not manage, said once per kind: managed (unified) memory, physical
// memory the program maps itself (cuMemCreate: PyTorch's expandable_segments).
void unmanaged_memory(int key, const char* call) noexcept;
enum UnmanagedKey : int { kManagedMemory = 1, kOwnMappings = 2 };

// The region open on this thread (residency_cuda_region_push/pop): the tag of the allocations it
// makes meanwhile. Nested regions stack (up to kMaxRegionDepth; deeper pushes are refused).
constexpr int kMaxRegionDepth = 16;
bool push_region(Tag tag) noexcept;
bool pop_region() noexcept;
Tag current_region() noexcept;

// ---- The driver API's wrappers ----

// The preload's wrapper of driver function `name` (as cuGetProcAddress names it: "cuMemAlloc"), for
// a caller that asked for ABI `cuda_version` (per_thread: the per-thread default stream variant),
// forwarding to `real` (what the driver gave for that request). `real` itself where the preload does
// not hook `name` at that ABI, or where a different function was bound to the same wrapper already.
void* wrap_driver(const char* name, int cuda_version, bool per_thread, void* real) noexcept;
// Whether wrap_driver() hooks `name` (tests).
bool hooks_driver_function(const char* name) noexcept;

}  // namespace residency::cudapreload
