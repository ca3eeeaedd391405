// SPDX-License-Identifier: MIT
// The CUDA preload's one session per process (docs/design.md, "Any CUDA program"): every decision
// about an unmodified CUDA program's device memory, in one object the hooks (cuda_hooks.hpp) only
// feed with events: a device allocation or free, a use (a kernel or graph launch, a copy, a memset),
// the destination of a copy, a tag, a call the preload cannot serve.
//
// Allocations of kMinRoutedBytes or more are made by the cuda backend instead of the runtime: a
// reserved address range with physical memory mapped behind it, which sleeps (copied to the host,
// unmapped) and wakes (mapped, copied back) at the same address, so that the pointers and CUDA
// graphs the program keeps stay valid. Every use opens a call on each device's manager for the time
// it takes to enqueue the work: a use while asleep wakes first, and the keep-alive counts from the
// last use (a sleep synchronizes the device before it unmaps, so work still queued finishes first).
//
// It knows no CUDA: its backends come from a factory and its time from a Clock, so a test drives it
// with the fake backend and a manual clock (tests/unit/program_session_test.cpp).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "platform/thread_annotations.hpp"
#include "preload/session_log.hpp"
#include "residency/residency.hpp"

namespace residency::cudapreload {

// What an allocation holds, as the program says it (a region open on the allocating thread, or a
// tag given afterwards). It decides what a sleep does with the allocation's bytes.
enum class Tag : std::uint8_t {
  unknown,  // written by kernels the preload cannot see into: copied to the host at every sleep
  weights,  // read-only from now on: copied at the first sleep, then only what a copy or memset wrote
  kv,       // the same as unknown, said explicitly (a cache the program reuses after an idle pause)
  scratch,  // nothing to keep: dropped at sleep, not copied (a workspace the program refills)
};
// "weights", "kv", "scratch", "unknown" (also ""): the tag; anything else: nullopt.
std::optional<Tag> parse_tag(std::string_view name) noexcept;
const char* to_string(Tag t) noexcept;

struct ProgramRules {
  // Device allocations below this stay the runtime's: the cuda backend maps whole 2 MiB granules.
  static constexpr std::size_t kMinRoutedBytes = std::size_t{2} << 20;
  // Devices a session manages (the runtime's device index below this).
  static constexpr int kMaxDevices = 64;
};

class ProgramSession {
 public:
  // The cuda backend for device `device` (`device_config` is Config::for_device_memory()).
  using BackendFactory = std::function<Result<std::shared_ptr<Backend>>(int device, const Config& device_config)>;

  struct Options {
    Config config;            // RESIDENCY_* as read at start-up
    BackendFactory backends;  // required
    // (optional) The backend for the memory a program maps itself on a device (cuMemCreate and
    // cuMemMap: ProgramMappings); without it such memory is never managed.
    BackendFactory mapping_backends;
    Clock* clock = nullptr;         // required; must outlive the session
    preload::SessionLog::Sink log;  // default: stderr
    bool start_schedulers = true;   // false: managers run nothing on their own (tests)
  };

  struct Allocation {
    enum class Outcome { pass_through, routed, out_of_memory };
    Outcome outcome = Outcome::pass_through;
    void* ptr = nullptr;
  };

  explicit ProgramSession(Options options);
  ~ProgramSession();
  ProgramSession(const ProgramSession&) = delete;
  ProgramSession& operator=(const ProgramSession&) = delete;

  const preload::SessionLog& log() const noexcept { return log_; }

  // ---- Events (each noexcept) ----

  // The program asks for `size` bytes on `device`: routed (the backend's memory, at `ptr`),
  // out_of_memory (the device or the budget has no room: the program gets the runtime's
  // out-of-memory error, as without the preload), or pass_through (the runtime makes it: too small,
  // residency off, the session stood aside, the backend could not start).
  Allocation allocate(int device, std::size_t size, Tag tag = Tag::unknown) noexcept RESIDENCY_EXCLUDES(mu_);
  // The program frees `ptr`: true when it was routed (the backend let it go, after the device
  // finished with it), false when it is the runtime's to free.
  bool free(void* ptr) noexcept RESIDENCY_EXCLUDES(mu_);
  // The program mapped [va, va + size) on `device` itself, in a way its mapping backend can put to
  // sleep: registered with that device's second manager (started on first need), so that the
  // keep-alive, the budget and every use cover it as they cover routed memory. False: not managed.
  bool mapping_made(int device, void* va, std::size_t size) noexcept RESIDENCY_EXCLUDES(mu_);
  // The program unmapped the mapping at `va` (it was awake: an unmap is a use).
  void mapping_gone(void* va) noexcept RESIDENCY_EXCLUDES(mu_);
  // Whether [ptr, ptr + bytes) touches routed memory.
  bool routed(const void* ptr, std::size_t bytes = 1) const noexcept RESIDENCY_EXCLUDES(mu_);

  // A use: open while the program's call enqueues work on the device (a launch, a copy, a memset).
  // While asleep, opening it wakes the device memory first; the keep-alive counts from its end.
  class Use {
   public:
    Use() = default;
    Use(Use&& o) noexcept : s_(o.s_) { o.s_ = nullptr; }
    Use& operator=(Use&&) = delete;
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;
    ~Use();
    // ok, or why device memory could not be woken: the hooks then fail the call with out of
    // memory rather than run it on memory that is not there.
    const Status& status() const { return status_; }

   private:
    friend class ProgramSession;
    ProgramSession* s_ = nullptr;
    std::array<std::uint64_t, 2> begun_{};  // the managers (by slot) this use opened a call on
    Status status_;
  };
  Use use() noexcept;

  // A stream capture (a CUDA graph being recorded) began on `stream`: everything is woken now and
  // held until capture_ended(stream), so that no sleep or wake (whose copies and synchronizations
  // a capture forbids) falls inside it. Either may come on any thread.
  void capture_began(const void* stream) noexcept RESIDENCY_EXCLUDES(mu_);
  void capture_ended(const void* stream) noexcept RESIDENCY_EXCLUDES(mu_);

  // A copy or memset wrote [dst, dst + bytes): reported to the backend where it lands in memory
  // tagged weights (whose other bytes are not copied again at a sleep). Lock-free when nothing is.
  void written(const void* dst, std::size_t bytes) noexcept RESIDENCY_EXCLUDES(mu_);
  // Tags every routed allocation that lies wholly inside [ptr, ptr + bytes). Only `weights` changes
  // anything after the allocation was made (its bytes are read-only from now on); the others are
  // set when the allocation is made. Returns the bytes tagged (0: none lies wholly inside).
  std::uint64_t tag(const void* ptr, std::size_t bytes, Tag tag) noexcept RESIDENCY_EXCLUDES(mu_);

  // Explicit: every device's memory sleeps now, whatever the keep-alive (a program about to idle),
  // or wakes now (before a burst of work, so that its first launch does not wait).
  void sleep_now() noexcept RESIDENCY_EXCLUDES(mu_);
  Status wake_now() noexcept RESIDENCY_EXCLUDES(mu_);

  // The program did something the session cannot serve (a CUDA IPC export of routed memory, for
  // one): said once, with `why`; from then on nothing sleeps (what is routed is woken and held for
  // the process's life) and new allocations are the runtime's.
  void stand_aside(const std::string& why) noexcept RESIDENCY_EXCLUDES(mu_);
  bool stood_aside() const noexcept { return aside_.load(std::memory_order_acquire); }
  // Whether an allocation may be routed now (residency on, not stood aside, not a forked child):
  // the hooks ask before they ask the runtime which device is current.
  bool routes() const noexcept {
    return options_.config.keep_alive.manages() && !aside_.load(std::memory_order_acquire) &&
           !forked_.load(std::memory_order_relaxed);
  }
  // In a forked child: everything passes through (the parent's managers are not the child's).
  void forked() noexcept { forked_.store(true, std::memory_order_relaxed); }

  // The manager of `device`, null when none was started (tests and the tool's figures).
  Manager* manager(int device) const noexcept;
  // Bytes routed now (allocated through the backend, awake or asleep), and bytes of the program's
  // own mappings managed now.
  std::uint64_t routed_bytes() const noexcept RESIDENCY_EXCLUDES(mu_);
  std::uint64_t mapping_bytes() const noexcept RESIDENCY_EXCLUDES(mu_);
  // The manager of the program's own mappings on `device`, null when none was started.
  Manager* mapping_manager(int device) const noexcept;

 private:
  struct Routed {
    std::size_t size = 0;
    int device = 0;
    Tag tag = Tag::unknown;
  };
  Manager* device_locked(int device) RESIDENCY_REQUIRES(mu_);
  // A device's managers have slots: `device` for routed allocations, `device + kMaxDevices` for
  // the program's own mappings.
  static constexpr int kSlots = 2 * ProgramRules::kMaxDevices;
  Manager* slot_locked(int slot) RESIDENCY_REQUIRES(mu_);
  std::unique_ptr<Manager> start_manager(int slot);
  template <typename F>
  void for_each_device(F&& f) noexcept;
  void end_use(const std::array<std::uint64_t, 2>& begun) noexcept;

  Options options_;
  preload::SessionLog log_;
  mutable Mutex mu_;
  std::map<std::uintptr_t, Routed> routed_ RESIDENCY_GUARDED_BY(mu_);  // by base address
  std::vector<std::unique_ptr<Manager>> owners_ RESIDENCY_GUARDED_BY(mu_);
  std::vector<UseScope> held_ RESIDENCY_GUARDED_BY(mu_);  // after stand_aside(): held for good
  // Captures in progress, by stream, each with the scopes that hold every device awake.
  std::vector<std::pair<const void*, std::vector<UseScope>>> captures_ RESIDENCY_GUARDED_BY(mu_);
  // Per slot: its manager (null until first needed), and whether starting one failed (then that
  // slot passes through, said once).
  std::array<std::atomic<Manager*>, kSlots> managers_{};
  // The started slots in order, the first active_ of them (written before active_ is raised): a
  // use walks these, not every slot.
  std::array<int, kSlots> started_{};
  std::array<bool, kSlots> failed_ RESIDENCY_GUARDED_BY(mu_){};
  struct Mapped {
    std::size_t size = 0;
    int device = 0;
  };
  std::map<std::uintptr_t, Mapped> mapped_ RESIDENCY_GUARDED_BY(mu_);  // the program's own mappings
  std::atomic<int> active_{0};
  std::atomic<int> tagged_weights_{0};  // routed allocations tagged weights
  std::atomic<bool> aside_{false};
  std::atomic<bool> forked_{false};
  std::atomic<bool> warned_wake_{false};
  bool warned_refusal_ RESIDENCY_GUARDED_BY(mu_) = false;
};

}  // namespace residency::cudapreload
