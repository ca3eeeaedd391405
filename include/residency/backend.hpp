// SPDX-License-Identifier: MIT
// residency: the Backend interface, everything a platform must do, in one list.
//
// The manager (src/core) decides *what* should be resident and *when*: set layout, budget,
// keep-alive. A backend only does it: it groups regions into sets and requests or ends the
// residency of a set as a unit, because that is how every platform we serve works
// (MTL::ResidencySet; a set of mlock'd ranges; a group of CUDA VMM mappings). The core never
// asks which backend it has; it asks capabilities().
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "residency/clock.hpp"
#include "residency/status.hpp"

// The version of this interface, for backends kept outside this repository: 2 since
// end_residency / destroy_set return Status, pressure watches have ids and the hard limit is
// reserved per manager (1: before those changes).
#define RESIDENCY_BACKEND_INTERFACE_VERSION 2

namespace residency {

// What the memory holds, which decides what release may do with it.
enum class RegionClass : std::uint8_t {
  weights = 0,   // must be preserved across a release
  kv_cache = 1,  // may be discarded on release where the backend supports it
  scratch = 2,   // may be discarded on release where the backend supports it
};
const char* to_string(RegionClass c) noexcept;

using RegionId = std::uint64_t;  // 0 is never a valid id
using SetId = std::uint32_t;     // chosen by the manager, unique among the managers of a process

// A region as the backend sees it.
struct RegionDesc {
  RegionId id = 0;
  void* base = nullptr;  // host address, or the device address of a backend allocation
  std::size_t size = 0;  // bytes
  RegionClass cls = RegionClass::weights;
  bool backend_allocated = false;  // made by Backend::allocate (device memory), not by the caller
  void* backend_object = nullptr;  // optional handle the engine passed (e.g. an MTL::Buffer*)
};

// What the manager asks of a backend; everything here is read by the core.
struct Capabilities {
  std::string name;            // "posix", "sim", "metal", "cuda", ...: for logs and messages
  bool needs_refresh = false;  // residency requests decay and must be repeated while in use
  Nanos refresh_period{0};     // how often, when needs_refresh
  std::uint32_t max_sets = 0;  // most sets of one manager at once (Metal: 32 per queue); 0 = no limit
  // A GPU's UUID as nvidia-smi prints it ("GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"): what names
  // its budget (Config::gpu_budget), never its index. Empty for host memory, or when unknown.
  std::string device_uuid;
  // The unit the backend wires in (posix: the page size, since mlock locks whole pages): a region
  // is charged to the wired limit and a shared budget as the whole units it touches, so that what
  // the kernel holds (VmLck) never exceeds them. 1: exactly its bytes. A power of two.
  std::uint64_t wire_granularity = 1;
  // The backend calls the wake gate (Backend::set_wake_gate) before it maps each piece of a wake,
  // so that the manager may start a wake in the room a shared budget has and make the rest
  // while it runs. False: the manager makes all the room first.
  bool paced_wake = false;
  // The backend can do part of a first release ahead (Backend::prepare_release): the manager asks
  // it once the holder is idle. False: never asked (no wake-up spent on it).
  bool prepares_release = false;
  // The backend keeps model files registered with a device (pinned page cache the kernel cannot
  // evict) and asks a host gate first (Backend::set_host_gate): the manager counts them against
  // the host budget (docs/design.md, "The host tier"). False: no host tier is joined.
  bool registers_files = false;
};

// Sizes in bytes, for the budget, limits and warnings. 0 means "unknown" for every field but
// hard_limit, where 0 means "none".
struct MemoryInfo {
  std::uint64_t physical = 0;                 // RAM, or device memory for a discrete GPU
  std::uint64_t recommended_working_set = 0;  // what one process should keep resident at most
  std::uint64_t hard_limit = 0;               // most the process may wire (RLIMIT_MEMLOCK); 0 = none
  std::string hard_limit_name;                // e.g. "RLIMIT_MEMLOCK", for messages
  std::string hard_limit_fix;                 // how to raise it, for messages
};

using PressureWatchId = std::uint64_t;

// The result of an operation over a set: regions that could not be made resident stay
// tracked-but-unwired, the rest of the set is resident. `status` explains the first failure.
struct SetOutcome {
  Status status;
  std::vector<RegionId> failed;
  bool ok() const { return status.is_ok() && failed.empty(); }
};

// Sharing and threads: a process has one backend of a kind (make_backend() returns the same
// instance to every caller), shared by all its managers, because what a backend controls is
// process-wide (the kernel's page locks and RLIMIT_MEMLOCK, a GPU context). So every method may
// be called from several threads at once and a backend locks for itself. Set ids and region ids
// are unique in the process (the managers draw them from one counter), so the sets of two
// managers never collide; a set is only ever touched by the manager that created it, one call at
// a time, under that manager's mutex.
//
// add_region / remove_region are staged and take effect at commit(); the manager commits each
// touched set once per batch. Methods never throw and never abort: failures come back as Status,
// with a message that says what failed and what to do, and a failed release leaves the set as it
// was (still requested) so that the manager's view stays true.
class Backend {
 public:
  virtual ~Backend() = default;

  // What this backend is and can do. Constant for the backend's life.
  virtual Capabilities capabilities() const = 0;
  // Current memory figures; called at start-up and for limits, warnings and stats.
  virtual MemoryInfo memory_info() = 0;

  // (optional) Allocates `size` bytes of backend memory (device memory) that the backend can
  // release and restore at the same address. Default: unsupported.
  virtual Result<void*> allocate(std::size_t size, RegionClass cls);
  // (optional) Frees what allocate() returned, resident or not, without preserving its
  // contents, and takes it out of every set: the manager calls it *before* removing the region
  // from its set, so a later remove_region / destroy_set for it must be a no-op for it.
  virtual void deallocate(void* base);

  // (optional) Reserves `bytes` of the process's hard limit (memory_info().hard_limit) for one
  // manager before it admits a region, so that the managers of a process together never plan to
  // wire more than the limit allows. Errors (limit_exceeded) name the limit and what holds it.
  // Default: no limit, always granted.
  virtual Status reserve_wired(std::uint64_t bytes);
  // (optional) Gives back what reserve_wired() granted.
  virtual void unreserve_wired(std::uint64_t bytes);

  // Creates an empty set that will hold up to about `capacity_bytes` (a hint).
  virtual Status create_set(SetId set, std::uint64_t capacity_bytes) = 0;
  // Ends the set's residency if requested, empties and destroys it. On error the set is gone
  // from the manager's view anyway (its regions are leaving); the message says what is still held.
  virtual Status destroy_set(SetId set) = 0;
  // Stages a region's entry into / exit from a set; effective at commit().
  virtual void add_region(SetId set, const RegionDesc& region) = 0;
  virtual void remove_region(SetId set, RegionId region) = 0;
  // Applies the staged changes. If the set's residency is requested, added regions become
  // resident now and removed ones stop being resident (unless another set holds them).
  virtual SetOutcome commit(SetId set) = 0;
  // Makes every region of the set resident (re-wiring what was released: the re-wire cost).
  virtual SetOutcome request_residency(SetId set) = 0;
  // Gives the set's memory back. Weights are preserved; kv_cache / scratch may be discarded
  // where the backend can (cuda). On error the set's residency stays requested and resident
  // (nothing was given back, or what was is restored), so a later release can try again.
  virtual Status end_residency(SetId set) = 0;
  // (optional) Repeats a residency request that decays (needs_refresh). Default: request.
  virtual SetOutcome refresh(SetId set);
  // (optional) Called once after a release of one or more sets, e.g. the tiny GPU operation
  // without which Metal keeps ended sets wired. Default: nothing.
  virtual void after_release();

  // (optional) Starts watching for system memory pressure (Linux PSI, a Mach memory-pressure
  // source, ...) and calls `on_pressure` from a backend thread when it is reported. Each manager
  // of the process adds its own watcher; one system watch serves them all. The manager starts
  // it only with release_on_pressure. Default: unsupported.
  virtual Result<PressureWatchId> watch_pressure(std::function<void()> on_pressure);
  // (optional) Removes a watcher; its on_pressure is not called after this returns.
  virtual void stop_pressure_watch(PressureWatchId id);
  // (optional) What the running pressure watch listens to, in one line for the manager's
  // start-up log ("PSI some 150 ms in 2 s on /proc/pressure/memory (system-wide)"); empty when
  // no watch runs. Default: empty.
  virtual std::string pressure_source() const;
  // (optional) Bytes this process could wire now without taking memory that others use: the
  // headroom of its memory cgroup or the system's available memory, reclaimable page cache
  // included. Read when a pressure cap lifts, so that the re-wire takes back only what fits
  // (the program that caused the pressure may still hold its memory). Default: unknown.
  virtual std::optional<std::uint64_t> memory_available();
  // (optional) Pinned host memory the backend holds for this process now (a GPU's host backups of
  // device memory): for `residency stat`. Default: 0.
  virtual std::uint64_t pinned_host_bytes() const;
  // (optional) Write tracking for memory allocate() returned. By default every wake counts as a
  // write of the whole allocation: its next release copies all of it back to the host. An engine
  // that sees every write into an allocation says so once with track_writes(base) and reports
  // each write, before it happens, with written(); the backend may then keep the host copy it made
  // at a release valid across wakes and copy back at the next release only what was written since
  // (weights, written at load and never again: nothing). Unknown addresses are ignored. Default:
  // nothing is tracked.
  virtual void track_writes(void* base);
  virtual void written(const void* addr, std::size_t bytes);
  // (optional) A write whose source is a file: [addr, addr + bytes) of a tracked allocation is
  // about to be filled with the bytes at `offset` of the file open as `fd` (borrowed, valid for
  // the call only; the backend dups it if it keeps it). A backend that can restore the range from
  // the file keeps no host copy of it while the file is unchanged. Default: a write (written()).
  virtual void filled_from_file(const void* addr, std::size_t bytes, int fd, std::uint64_t offset);
  // (optional) Bytes of this process's device memory whose backup is a file (filled_from_file),
  // not pinned host memory: for `residency stat`. Default: 0.
  virtual std::uint64_t file_backed_bytes() const;
  // (optional) Bytes of model files the backend keeps registered with a device (pinned page cache:
  // the kernel cannot evict it) so that what sleeps in them wakes at the link's rate: host memory
  // that sleeping models hold, for `residency stat`. Default: 0.
  virtual std::uint64_t registered_file_bytes() const;
  // (optional) A call began on another thread while end_residency() may be running: the backend
  // may stop that release before it gives anything back (the memory is still mapped while its
  // backup is copied), leave the set resident and return ErrorCode::interrupted, so that the call
  // finds its memory in place instead of waiting for the release and then a wake. Lock-free, from
  // any thread; ignored when no release is running. Default: releases run to the end.
  virtual void interrupt_release();
  // (optional) The holder is idle and its memory has never been released: the backend may do
  // ahead, on a thread of its own, what its first release would otherwise do (the cuda backend
  // registers the model files and pins the backups of what they do not hold), so that the first
  // release costs what later ones do. Returns at once: `started` when work was queued, `nothing`
  // when nothing is left to prepare (the manager does not ask again until new memory is
  // registered). The backend polls `stop` between pieces of the work, each a few milliseconds
  // long, and stops when it returns true (a call began), keeping what it completed; a later call
  // of prepare_release() goes on from there. `stop` stays callable until stop_preparation()
  // returns. Default: nothing to prepare.
  enum class Preparation { nothing, started };
  virtual Preparation prepare_release(std::function<bool()> stop);
  // (optional) Stops the work prepare_release() started and returns once it no longer calls its
  // `stop` (the manager calls it before it goes away). Default: nothing runs.
  virtual void stop_preparation();
  // (optional) A wake paced by a budget (Capabilities::paced_wake). The manager sets a gate around
  // one request of backend-allocated memory whose room in a shared budget is still being made:
  // the backend calls gate(bytes) before it maps each piece of physical memory it wakes, and maps
  // the piece once the gate returns (the budget then holds room for it). Copies already started
  // go on meanwhile, so the wake overlaps the other process's release. Set to nullptr after the
  // request; never called from another thread than the request's. Default: ignored.
  using WakeGate = std::function<void(std::uint64_t bytes)>;
  virtual void set_wake_gate(WakeGate gate);
  // (optional) Device memory this process holds besides what allocate() returned and is awake
  // (a GPU context, libraries' workspaces), as the device reports it: a shared budget counts it
  // for this holder always, since no sleep gives it back. Read before each wake or allocation
  // under a shared budget. Default: 0 (unknown).
  virtual std::uint64_t unmanaged_device_bytes();
  // (optional) The host tier (Capabilities::registers_files; docs/design.md, "The host tier"). The
  // manager sets a gate that counts registered model files against the host budget. The backend
  // calls reserve(bytes, false, file) before it registers `bytes` more of the file `file` names (a
  // nonzero key of its device and inode; 0 for several files): false means not now (the file
  // stays the backup of what was filled from it, and a wake reads it through a staging buffer).
  // reserve(bytes, true, file) makes room for registrations to come, which then take it: only on
  // a thread that holds no lock a call may need (the backend's background thread), since the
  // other holders may be asked to give back and waited for, boundedly. Registrations of one file
  // by several processes are one file's page cache: the budget counts them once. It calls
  // give_back(bytes) after it gave a registration back. Set before any registration and cleared
  // (empty functions) before the manager goes away; never called after that returns.
  struct HostGate {
    std::function<bool(std::uint64_t bytes, bool may_wait, std::uint64_t file)> reserve;
    std::function<void(std::uint64_t bytes)> give_back;
  };
  virtual void set_host_gate(HostGate gate);
  // (optional) The host budget asks for room: gives back the registration of every model file,
  // whose pages the kernel may then evict (what sleeps in them stays there; the next wake reads
  // them through a staging buffer, and the next sleep registers them again if the budget has room).
  // Returns the bytes given back. Default: 0.
  virtual std::uint64_t drop_file_registrations();
};

}  // namespace residency
