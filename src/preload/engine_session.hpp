// SPDX-License-Identifier: MIT
// The preload's one engine session per process (docs/design.md, "The engine session"): every
// decision the preload takes about llama.cpp's memory, in one object the hooks only feed with
// events.
//
// The hooks (interpose.cpp) keep the re-entry, errno and fork guards and the real functions;
// they tell this session what the engine did (a model file mapped, a buffer made or freed, a model
// loaded, a decode begun or ended, memory unmapped, a device allocation, a fork) and do what it
// answers. The session owns the host manager, one manager per GPU, the buffer table, the GGUF
// mappings, the engine's code and working memory, and the snapshot schedule. It knows neither
// llama.h nor ggml nor CUDA: its backends come from a factory and its time from a Clock, so a test
// drives it with the fake backend, a manual clock and synthetic events (engine_session_test.cpp).
#pragma once

#include <sys/types.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "buffer_plan.hpp"
#include "engine_code.hpp"
#include "engine_memory.hpp"
#include "ggml_buffers.hpp"
#include "memory_events.hpp"
#include "piece_table.hpp"
#include "platform/thread_annotations.hpp"
#include "residency/residency.hpp"
#include "session_log.hpp"

namespace residency::preload {

// The decisions, as named constants with their reason.
struct SessionRules {
  // Device allocations below this stay the runtime's: the cuda backend maps whole 2 MiB granules,
  // and smaller ones are cuBLAS workspaces and the like.
  static constexpr std::size_t kMinRoutedDeviceBytes = std::size_t{2} << 20;
  // Devices a session manages (cudaGetDevice's index below this).
  static constexpr int kMaxDevices = 64;
  // The engine memory's snapshot is taken after the 1st, 2nd, 4th ... kLastSnapshotDecode-th
  // decode since the memory was last wired: the working set of each new prompt length, then no
  // more work per token.
  static constexpr std::uint32_t kLastSnapshotDecode = 64;
  static bool snapshot_after(std::uint32_t decodes_since_wire) noexcept {
    const std::uint32_t n = decodes_since_wire;
    return n >= 1 && n <= kLastSnapshotDecode && (n & (n - 1)) == 0;
  }
  // A mapping that may be a model file: a file, mapped readable and not writable.
  static bool may_be_model_file(int prot, int flags, int fd, std::size_t len) noexcept;
  // The bytes of [off, off + len) of `fd` that are a GGUF file's: 0 unless `fd` is a regular file
  // that starts with "GGUF" and the range starts inside it (past its end there are no pages).
  static std::size_t gguf_bytes(int fd, off64_t off, std::size_t len) noexcept;
};

class EngineSession {
 public:
  // Where memory lives: the host (llama.cpp's host buffers) or a GPU, by the runtime's index.
  static constexpr int kHost = -1;
  // The backend for the host (where == kHost: the posix backend in the preload, which locks) or
  // for GPU `where` (the cuda backend; `device_config` is Config::for_device_memory()).
  using BackendFactory = std::function<Result<std::shared_ptr<Backend>>(int where, const Config& device_config)>;
  // llama_synchronize(ctx) behind the preload: what a manager waits on under keep-alive 0.
  using SynchronizeFn = void (*)(void* ctx);

  struct Options {
    Config config;                          // RESIDENCY_* as read at start-up
    BackendFactory backends;                // required
    Clock* clock = nullptr;                 // required; must outlive the session
    const BufferReader* buffers = nullptr;  // ggml's answers about its buffers (required for the host side)
    SynchronizeFn synchronize = nullptr;
    SessionLog::Sink log;  // default: stderr
    // Why llama.cpp's host buffers cannot be followed (ggml is not a shared library here), said
    // once when the host side would start; empty: they can.
    std::string host_unavailable;
    bool machine_has_swap = true;  // false: repacked weights under pressure get a warning
    bool start_schedulers = true;  // false: managers run nothing on their own (tests)
    bool engine_memory = true;     // false: no snapshot of the engine's working memory
    // Run first on the session's worker thread (the preload marks it as inside a hook, so that
    // its own memory calls pass straight through).
    void (*worker_init)() = nullptr;
  };

  explicit EngineSession(Options options);
  ~EngineSession();
  EngineSession(const EngineSession&) = delete;
  EngineSession& operator=(const EngineSession&) = delete;

  const SessionLog& log() const noexcept { return log_; }

  // ---- Events (each noexcept; the hooks call them outside re-entry) ----

  // A GGUF file's `bytes` are mapped at `addr` (SessionRules::gguf_bytes said so): remembered,
  // not registered; starts the host side on first need. With `fd` (the mapping's file, from
  // `offset`), a tensor later copied from this mapping into tracked device weights is reported as
  // filled from the file (device_filled), so that the file is those weights' backup.
  void file_mapped(void* addr, std::size_t bytes, int fd = -1, std::uint64_t offset = 0) noexcept RESIDENCY_EXCLUDES(mu_);
  // Lock-free: whether [begin, end) touches memory the session tracks (hooks of munmap and
  // MAP_FIXED skip everything else).
  bool tracks(std::uintptr_t begin, std::uintptr_t end) const noexcept;

  // ---- The program's memory calls (docs/design.md, "The preload's memory hooks") ----
  // An allocator makes these calls while it holds its own lock, so none of these waits for the
  // session's lock or allocates: what changes is queued (memory_events.hpp) and applied under the
  // lock, in order, by the next event or the session's worker thread. What must happen before
  // the program's call (letting go of a lock the call would trip on) is done here with system
  // calls only. The session holds only the engine's memory and unlocks only what it locked
  // (docs/design.md, "The engine session").

  // [begin, end) no longer holds what it held: unmapped (munmap, or an mmap with MAP_FIXED over
  // it), taken back (see below), or a new mapping landed there (the old one went through calls no
  // hook sees, such as glibc's own munmap). What the session tracked there is forgotten.
  void memory_gone(std::uintptr_t begin, std::uintptr_t end) noexcept;
  // Before the program takes [begin, end) back (madvise DONTNEED/FREE/PAGEOUT/COLD/REMOVE,
  // mprotect to PROT_NONE, mremap's old range): what the session locked there is unlocked now, so
  // that the call does what it would without the preload (a locked page makes
  // madvise(MADV_DONTNEED) fail, and V8 aborts on that). Follow the call with memory_gone().
  void unlock_before_take_back(std::uintptr_t begin, std::uintptr_t end) const noexcept RESIDENCY_EXCLUDES(program_mu_);
  // A private anonymous mapping made inside the engine's calls, or heap the engine grew: the
  // engine's own memory.
  void engine_mapped(std::uintptr_t begin, std::uintptr_t end) noexcept;
  // The program locks [begin, end) (mlock, mlock2; `call` makes the call and returns whether the
  // kernel may hold a lock of the program's there now: the call worked, or it failed after
  // marking part of the range locked, as a failure with ENOMEM or EAGAIN may have). Noted first,
  // so that the session never registers it (it would unlock it later); what the session held
  // there is let go of once the event is applied, and the program's lock is made again after
  // that let-go. A failure that locked nothing forgets the note, and keeps what the program had
  // locked there before (all of the range, where that was in more than kKept pieces).
  template <class Call>
  bool program_locks(std::uintptr_t begin, std::uintptr_t end, Call&& call) noexcept RESIDENCY_EXCLUDES(program_mu_) {
    bool locked = false;
    {
      MutexLock lock(program_mu_);
      constexpr std::size_t kKept = 8;  // on the stack: a hook allocates nothing
      std::array<Extent, kKept> before{};
      std::size_t n = 0;
      program_locked_.for_each_overlap(begin, end, [&](std::uintptr_t b, std::uintptr_t e) {
        before[n < kKept ? n : kKept - 1] = Extent{b, e};
        ++n;
      });
      const bool noted = program_locked_.add(begin, end, RegionClass::weights, 0);
      locked = call();
      if (!locked && noted && n <= kKept) {
        program_locked_.subtract(begin, end);
        for (std::size_t i = 0; i < n; ++i)
          program_locked_.add(before[i].begin, before[i].end, RegionClass::weights, 0);
      }
    }
    if (locked && tracks(begin, end)) queue({MemoryEvents::Kind::program_locked, begin, end});
    return locked;
  }
  // The program unlocks [begin, end) (munlock; `call` makes the call and returns whether it
  // worked): its lock no longer stands.
  template <class Call>
  bool program_unlocks(std::uintptr_t begin, std::uintptr_t end, Call&& call) noexcept RESIDENCY_EXCLUDES(program_mu_) {
    MutexLock lock(program_mu_);
    const bool unlocked = call();
    if (unlocked) program_locked_.subtract(begin, end);
    return unlocked;
  }
  // [begin, end) was unmapped, or mapped anew without MAP_LOCKED: the program's locks there ended
  // with the old mapping, and the memory now there may be the engine's to hold (llama.cpp's
  // mmap+mlock load mode locks the GGUF header's pages, then unmaps them; a buffer mapped there
  // later is not locked). Takes program_mu_ only where the program locked something.
  void program_locks_end(std::uintptr_t begin, std::uintptr_t end) noexcept RESIDENCY_EXCLUDES(program_mu_) {
    if (!program_locked_.overlaps(begin, end)) return;
    MutexLock lock(program_mu_);
    program_locked_.subtract(begin, end);
  }
  // mlockall(flags) succeeded: the program locks everything itself; the session lets go of
  // everything (and locks it again as the program asked) and holds nothing from then on.
  void program_locked_all(int flags) noexcept;
  // A lock of the program's own (mlock, mlock2, mmap with MAP_LOCKED) failed on RLIMIT_MEMLOCK,
  // which the session's locks count against: the program's locks come first. Everything the
  // session locked is unlocked now (system calls only; the caller then makes the program's call
  // again), and the session lets go of its memory and holds none from then on. False when the
  // session holds no host memory, or when the limit does not apply to this process (CAP_IPC_LOCK,
  // or no finite limit): then the failure is the program's own (llama.cpp's mlock load mode locks
  // a buffer's size rounded up to a page from its unaligned base, and fails with ENOMEM where the
  // page past the buffer's mapping is unmapped or PROT_NONE).
  bool step_aside_for_program_lock() noexcept RESIDENCY_EXCLUDES(program_mu_);
  // Lock-free: whether [begin, end) touches what the program locked itself.
  bool program_locked(std::uintptr_t begin, std::uintptr_t end) const noexcept {
    return program_locked_.overlaps(begin, end);
  }
  // Lock-free: a snapshot of the engine memory is being taken. Every mapping made meanwhile is
  // reported (memory_gone) whatever it lands on: between the snapshot's read of the maps and its
  // locks, an address the program unmapped and mapped again must not stay locked for it.
  bool snapshotting() const noexcept { return snapshotting_.load(std::memory_order_seq_cst); }
  // Applies every queued memory event now (the worker does it on its own; tests call this).
  void settle() noexcept RESIDENCY_EXCLUDES(mu_);

  // ggml made buffer `b` (from_ptr: over memory that is not ggml's); starts the host side.
  void buffer_created(BufferId b, bool from_ptr) noexcept RESIDENCY_EXCLUDES(mu_);
  // Lock-free: whether tensor placements in `b` matter (ggml places every graph node too).
  bool wants_tensor_placements(BufferId b) const noexcept;
  void tensor_placed(BufferId b, std::uintptr_t begin, std::uintptr_t end) noexcept RESIDENCY_EXCLUDES(mu_);
  void buffer_usage(BufferId b, BufferUsage usage) noexcept RESIDENCY_EXCLUDES(mu_);
  // Before ggml frees `b`: its regions are unregistered while it exists.
  void buffer_freed(BufferId b) noexcept RESIDENCY_EXCLUDES(mu_);
  // A model was loaded: its buffers are registered, the engine's code with them, and the file
  // pages no buffer reads are given back.
  void model_loaded() noexcept RESIDENCY_EXCLUDES(mu_);
  // A context was made: its KV cache and compute buffers are registered.
  void context_made() noexcept RESIDENCY_EXCLUDES(mu_);
  // Around one engine call: llama_decode / llama_encode on context `ctx` (passed to the synchronize
  // function), or, where the program calls llama_decode past the preload (a pointer from dlsym,
  // as ctypes bindings do), a ggml graph compute (ctx null: nothing to synchronize; the compute
  // has finished when it returns). decode_ended ends exactly what decode_began began (a manager
  // that started during the call never saw its begin). `stack`: an address on the caller's stack.
  // `device_asleep`: device memory of this process could not be woken (the GPU full and nobody
  // could give way): the engine must not run the decode on unmapped memory (it would fault on
  // the GPU and abort the program); the caller refuses the decode with an error and ends the scope.
  struct DecodeScope {
    bool host = false;
    bool devices = false;
    bool device_asleep = false;
    std::int64_t began_ns = 0;  // RESIDENCY_LOG=debug: when the decode began (steady clock)
  };
  DecodeScope decode_began(std::uintptr_t stack = 0) noexcept RESIDENCY_EXCLUDES(mu_);
  void decode_ended(DecodeScope scope, void* ctx) noexcept RESIDENCY_EXCLUDES(mu_);
  // A graph compute stands in for decodes (said once, at info).
  void decodes_seen_as_graph_computes() noexcept;
  // A ggml call outside a decode may read or write device memory: what sleeps wakes.
  void device_access() noexcept;
  // cudaMalloc of `size` on device `device`; `compute`: inside ggml's graph allocator.
  struct DeviceAllocation {
    enum class Outcome { pass_through, routed, out_of_memory } outcome = Outcome::pass_through;
    void* ptr = nullptr;
  };
  DeviceAllocation device_allocate(int device, std::size_t size, bool compute) noexcept RESIDENCY_EXCLUDES(mu_);
  // cudaFree: true when `ptr` was routed (it is freed); false: the runtime's.
  bool device_free(void* ptr) noexcept RESIDENCY_EXCLUDES(mu_);
  // Write tracking (Manager::track_writes): llama.cpp marked the device buffer at [base, base +
  // size) as weights. When it is routed device memory, every write into it is reported from now
  // on (device_written), so that its sleeps copy only what was written since the last one.
  void device_weights_buffer(std::uintptr_t base, std::size_t size) noexcept RESIDENCY_EXCLUDES(mu_);
  // Lock-free: whether any device range's writes are tracked (the hooks skip the work if not).
  bool tracks_device_writes() const noexcept { return tracked_count_.load(std::memory_order_acquire) != 0; }
  // Lock-free: [begin, end) of device memory is about to be written (a tensor set, memset, copy,
  // buffer clear, or a node of a graph about to run); reported where it overlaps a tracked range.
  void device_written(std::uintptr_t begin, std::uintptr_t end) noexcept;
  // Lock-free: the tracked device ranges as they are now, for a caller with many writes to check at
  // once (a graph's nodes): only a write that meets one of them needs device_written(). The ranges
  // change at a model's load and free, never during a decode.
  static constexpr std::size_t kMaxTracked = 8;  // more ranges stay untracked (copied at each sleep)
  class TrackedRanges {
   public:
    bool meets(std::uintptr_t begin, std::uintptr_t end) const noexcept {
      for (std::size_t i = 0; i < n_; ++i)
        if (begin < r_[i].end && end > r_[i].begin) return true;
      return false;
    }
    std::size_t size() const noexcept { return n_; }

   private:
    friend class EngineSession;
    struct Range {
      std::uintptr_t begin = 0, end = 0;
    };
    std::array<Range, kMaxTracked> r_{};
    std::size_t n_ = 0;
  };
  TrackedRanges tracked_ranges() const noexcept;
  // The same for a copy from host memory at `src` (a tensor set): where the source lies in one GGUF
  // mapping and the destination in one tracked range, reported as filled from that file
  // (Manager::filled_from_file); otherwise as a write.
  void device_filled(std::uintptr_t begin, std::uintptr_t end, std::uintptr_t src) noexcept RESIDENCY_EXCLUDES(mu_);
  // In a fork child: from now on every event is ignored (the child must not touch the managers
  // of its parent's threads).
  void forked() noexcept;

  // ---- What a test (and only a test) reads ----
  // Null until the host side started (or when it could not).
  Manager* host_manager() const noexcept { return host_.load(std::memory_order_acquire); }
  Manager* device_manager(int device) const noexcept;
  // Whether memory is held between decodes (a duration or forever), decided once at start.
  bool holds_between_calls() const noexcept { return holds_between_calls_; }
  std::uint64_t engine_memory_bytes() const noexcept RESIDENCY_EXCLUDES(mu_);
  std::uint32_t snapshots_taken() const noexcept { return snapshots_.load(std::memory_order_relaxed); }

 private:
  enum class Side : int { untried = 0, active = 1, pass_through = 2 };
  struct Device {
    std::atomic<Side> state{Side::untried};
    std::atomic<Manager*> manager{nullptr};
  };
  // The host side's parts, made with its manager.
  struct Host {
    Host(Manager& m, const BufferReader& reader, const SessionLog& log, bool pressure_without_swap)
        : buffers(m, reader, log, pressure_without_swap), code(m, log), memory(m, log) {}
    GgmlBuffers buffers;  // llama.cpp's host buffers
    EngineCode code;      // the engine's read-only code, while a model is loaded
    EngineMemory memory;  // the engine's working memory (snapshots)
  };
  struct Cuts {
    PieceTable::Cut buffers, code, memory, files, made;
  };

  // One way to start a manager, for the host and for each device: null (with one warning) when
  // it cannot, and the side passes through for good.
  std::unique_ptr<Manager> start_manager(int where) RESIDENCY_REQUIRES(mu_);
  Host* host_locked() RESIDENCY_REQUIRES(mu_);  // started on first need; null: pass through
  Manager* device_locked(int device) RESIDENCY_REQUIRES(mu_);
  Host* active_host() const noexcept;                   // lock-free
  Host* active_locked() const RESIDENCY_REQUIRES(mu_);  // without starting it
  Cuts cut_locked(std::uintptr_t begin, std::uintptr_t end) noexcept RESIDENCY_REQUIRES(mu_);
  void after_unmap_locked(const Cuts& cut, std::uintptr_t begin, std::uintptr_t end, bool gone) noexcept
      RESIDENCY_REQUIRES(mu_);
  void flush_locked(const char* why, bool model_loaded) noexcept RESIDENCY_REQUIRES(mu_);
  void drop_engine_memory_locked() noexcept RESIDENCY_REQUIRES(mu_);
  void give_back_unread_file_pages_locked() noexcept RESIDENCY_REQUIRES(mu_);
  void let_go_of_everything_locked(const char* why) noexcept RESIDENCY_REQUIRES(mu_);
  EngineOwned engine_owned_locked() const RESIDENCY_REQUIRES(mu_);
  void note_stack(std::uintptr_t stack) noexcept RESIDENCY_EXCLUDES(mu_);
  std::vector<Extent> held_extents_locked() const RESIDENCY_REQUIRES(mu_);
  // Memory events: queued by the hooks, applied under the lock (drain_locked: every locked section
  // starts with it), on the worker thread soon after they are queued.
  void queue(MemoryEvents::Event e) noexcept;
  void drain_locked() noexcept RESIDENCY_REQUIRES(mu_);
  void apply_locked(const MemoryEvents::Event& e) noexcept RESIDENCY_REQUIRES(mu_);
  void check_tracked_against_maps_locked() noexcept RESIDENCY_REQUIRES(mu_);
  void start_worker() noexcept RESIDENCY_REQUIRES(mu_);
  void worker_loop() noexcept;
  template <class F>
  void for_each_device(F&& f) noexcept;

  const Options options_;
  const SessionLog log_;
  const bool holds_between_calls_;
  std::atomic<bool> forked_{false};

  // Guards starting managers and every change of the tracked buffers, mappings and routed device
  // memory. Lock order: this, then a manager's. Never taken by a hook that only forwards, nor for
  // memory that is not tracked (piece_table.hpp says why munmap must not wait for it).
  mutable Mutex mu_;
  Side host_state_ RESIDENCY_GUARDED_BY(mu_) = Side::untried;
  std::unique_ptr<Manager> host_owner_ RESIDENCY_GUARDED_BY(mu_);
  std::atomic<Manager*> host_{nullptr};  // host_owner_'s, readable without the lock
  std::unique_ptr<Host> host_parts_ RESIDENCY_GUARDED_BY(mu_);
  std::atomic<Host*> host_parts_ready_{nullptr};  // host_parts_, once active (lock-free reads)
  PieceTable files_;                              // the GGUF mappings (not registered)
  // The file of each GGUF mapping (a piece of files_ has owner = index + 1): our own descriptor
  // (-1 once none of its mapping is left) and the file offset at the mapping's start `begin`.
  struct FileOfMapping {
    std::uintptr_t begin = 0;
    int fd = -1;
    std::uint64_t offset = 0;
  };
  std::vector<FileOfMapping> file_of_mapping_ RESIDENCY_GUARDED_BY(mu_);
  PieceTable engine_made_;  // anonymous mappings made inside engine calls, and heap they grew
  // What the program locked itself (mlock), changed by the mlock and munlock hooks under
  // program_mu_: a lock under which nothing allocates (a hook may hold the program's allocator's
  // lock) and nothing waits but the program's own mlock and munlock calls. Lock order: mu_, then
  // program_mu_.
  mutable Mutex program_mu_ RESIDENCY_ACQUIRED_AFTER(mu_);
  PieceTable program_locked_;
  bool program_locks_all_ RESIDENCY_GUARDED_BY(mu_) = false;
  MemoryEvents events_;
  // The worker: applies queued events soon after they are queued (it sleeps on wake_, a futex
  // word, while there are none: no wake-ups while idle).
  std::atomic<std::uint32_t> wake_{0};
  std::atomic<bool> stop_worker_{false};
  std::thread worker_ RESIDENCY_GUARDED_BY(mu_);
  // Addresses on the stacks engine calls ran on (one per stack; 0: free), and the thread each
  // stack belongs to: a stack is held only while its thread lives (a dead thread's stack may be
  // unmapped and the address reused by the program), and a dead thread's slot is free again.
  static constexpr std::size_t kMaxStacks = 64;
  std::array<std::atomic<std::uintptr_t>, kMaxStacks> stacks_{};
  std::array<std::atomic<int>, kMaxStacks> stack_threads_{};
  std::atomic<bool> said_graph_computes_{false};
  // Whether the host backend's locks are held to a limit (RLIMIT_MEMLOCK without CAP_IPC_LOCK),
  // read when the host side starts: only then can the program's failed lock be the session's doing.
  std::atomic<bool> lock_limit_applies_{false};
  std::atomic<bool> snapshotting_{false};
  bool warned_unwired_ RESIDENCY_GUARDED_BY(mu_) = false;

  std::array<Device, SessionRules::kMaxDevices> devices_{};
  std::vector<std::unique_ptr<Manager>> device_owners_ RESIDENCY_GUARDED_BY(mu_);
  std::atomic<int> active_devices_{0};                               // hooks skip the device table while 0
  std::unordered_map<void*, int> routed_ RESIDENCY_GUARDED_BY(mu_);  // routed pointer -> device
  bool warned_device_refusal_ RESIDENCY_GUARDED_BY(mu_) = false;
  // Device ranges whose writes are tracked, read lock-free by the write hooks, changed under mu_
  // (at a model's load and free, never during a decode); begin 0: a free slot. More than
  // kMaxTracked ranges: the rest stay untracked (their sleeps copy everything).
  struct Tracked {
    std::atomic<std::uintptr_t> begin{0};
    std::atomic<std::uintptr_t> end{0};
    std::atomic<int> device{0};
  };
  std::array<Tracked, kMaxTracked> tracked_{};
  std::atomic<int> tracked_count_{0};
  std::atomic<bool> warned_device_asleep_{false};
  // RESIDENCY_LOG=debug: when the last wake of device memory ended (steady ns; 0: the decode
  // after it has been timed already), for the switch's timeline.
  std::atomic<std::int64_t> device_woke_ns_{0};
  // Runs `wake` (an access or a call's begin on every device); with a debug log, says how long it
  // took when it found device memory asleep, and notes when it ended.
  template <typename F>
  void timed_device_wake(const char* what, F&& wake) noexcept;

  // Decodes since the memory was last wired by a decode (or since the engine memory was dropped).
  std::atomic<std::uint32_t> decodes_since_wire_{0};
  std::atomic<std::uint32_t> snapshots_{0};
};

}  // namespace residency::preload
