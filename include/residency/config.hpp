// SPDX-License-Identifier: MIT
// residency: configuration, and the strict parsers behind RESIDENCY_* variables.
//
// One KeepAlive value covers every peer's policy: a duration (llama.cpp's 180 s), 0 (mlx-lm's
// wired-only-while-generating), forever (mlx_lm.server) and off (GGML_METAL_NO_RESIDENCY).
// Parsing is strict on purpose: llama.cpp reads its keep-alive with atoi, so "0", "-1" and
// "abc" all silently become 180 s. Here every bad value is one error that names the variable,
// the value and the forms that are accepted, and nothing falls back silently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "residency/clock.hpp"
#include "residency/status.hpp"

namespace residency {

enum class LogLevel : std::uint8_t { error = 0, warn = 1, info = 2, debug = 3 };
const char* to_string(LogLevel l) noexcept;

enum class Layout : std::uint8_t {
  per_buffer,  // one set per registered region (llama.cpp)
  sharded,     // sets capped at set_max_pct % of the working set, at most 32 (MLX)
};
const char* to_string(Layout l) noexcept;

struct KeepAlive {
  enum class Kind : std::uint8_t {
    duration,  // resident from use until `duration` after the last touch()
    zero,      // resident only inside Manager::use() scopes
    forever,   // resident until the manager is destroyed
    off,       // no residency management at all (the baseline)
  };
  Kind kind = Kind::duration;
  Nanos duration = std::chrono::seconds(180);

  // The policy a value means: a duration of 0 (or less) is the 0 policy. The one place that says so.
  Kind in_effect() const { return kind == Kind::duration && duration.count() <= 0 ? Kind::zero : kind; }
  // The questions callers ask of a policy; nothing outside this struct and src/core/keep_alive.*
  // branches on `kind` itself.
  // Residency is managed at all (not the `off` baseline).
  bool manages() const { return kind != Kind::off; }
  // Memory stays wired between uses: a duration above 0, or forever.
  bool holds_between_uses() const { return in_effect() == Kind::duration || in_effect() == Kind::forever; }
  // Wired only inside use scopes (keep-alive 0).
  bool wires_only_in_use() const { return in_effect() == Kind::zero; }
  // Released `duration` after the last use (a duration above 0).
  bool expires() const { return in_effect() == Kind::duration; }
  // Never released by the keep-alive.
  bool never_expires() const { return in_effect() == Kind::forever; }
  static KeepAlive after(Nanos d) {
    KeepAlive k{Kind::duration, d};
    k.kind = k.in_effect();
    return k;
  }
  static KeepAlive zero() { return {Kind::zero, Nanos(0)}; }
  static KeepAlive forever() { return {Kind::forever, Nanos(0)}; }
  static KeepAlive off() { return {Kind::off, Nanos(0)}; }
  // "180 s", "500 ms", "0", "forever", "off": the form used in logs.
  std::string to_string() const;
  bool operator==(const KeepAlive&) const = default;
};

// Accepted (case does not matter, spaces around the value are dropped):
//   - a number with one unit: ns, us, ms, s (or sec), m (or min), h; a space may stand between
//     the number and its unit ("500ms", "180s", "5 s", "1.5h");
//   - parts of several units, largest first and each unit once ("1h30m", "1m 30s"); "1s1s" and
//     "30m1h" are refused;
//   - a bare number = seconds ("180", "0.5");
//   - "0" (or 0 with any unit): resident only inside calls and use scopes;
//   - "forever", or any negative number ("-1", "-5m"); "inf" is refused (write forever);
//   - "off".
// Durations up to 100 years, in whole nanoseconds (computed exactly: 0.000...1 s is an error, not
// 0); no overflow. Every refusal is one message: the value, why, and these forms.
Result<KeepAlive> parse_keep_alive(std::string_view text);

// Accepted: an integer or decimal number of bytes with an optional unit B, KiB, MiB, GiB, TiB
// (powers of 1024), KB, MB, GB, TB (powers of 1000), K, M, G, T (= KiB...). Up to 2^63 bytes.
// The value must be a whole number of bytes, computed exactly: 1.5GiB is, 0.5 (B) is not.
Result<std::uint64_t> parse_size(std::string_view text);

struct WiredLimit {
  bool is_percent = false;
  std::uint64_t bytes = 0;  // when !is_percent
  double percent = 0;       // of the recommended working set, when is_percent (0 < p <= 100)
  // The limit in bytes for a backend whose recommended working set is `recommended`.
  std::uint64_t resolve(std::uint64_t recommended) const;
  std::string to_string() const;
};
// Accepted: a size (see parse_size) or a percent of the recommended working set ("75%"). 0 and
// 0% are the same limit, 0 bytes: nothing is wired (until Manager::set_wired_limit raises it).
Result<WiredLimit> parse_wired_limit(std::string_view text);

// A machine-wide wired budget that the processes naming it share
// (docs/design.md, "The ledger protocol"): each reserves its wired bytes in a ledger in shared
// memory before wiring them, so that together they never wire more than `size`. Linux only
// (futexes, /proc); elsewhere Manager::create refuses it. The longest NAME of
// RESIDENCY_SHARED_BUDGET, and of RESIDENCY_GPU_BUDGET, whose ledger is NAME.GPU-UUID: 41
// characters more ('.', "GPU-" and the UUID's 36). The checks and their messages both use these.
inline constexpr std::size_t kSharedBudgetNameMax = 64;
inline constexpr std::size_t kGpuBudgetNameMax = 31;

struct SharedBudget {
  std::string name;               // [A-Za-z0-9._-], 1 to kSharedBudgetNameMax characters, not starting with '.' or '-'
  WiredLimit size;                // bytes, or a percent of physical memory (RAM: the budget is machine-wide)
  std::string group;              // "": the ledger is private to its user (mode 0600); else 0660 for this group
  std::string to_string() const;  // "NAME:SIZE[:GROUP]"
};
// Accepted: NAME:SIZE or NAME:SIZE:GROUP, SIZE a size (see parse_size, more than 0) or a percent
// of RAM ("50%"), GROUP a group name ([A-Za-z0-9._-], 1 to 32 characters).
Result<SharedBudget> parse_shared_budget(std::string_view text);

// The host tier's budget (RESIDENCY_HOST_BUDGET; docs/design.md, "The host tier"): the model files
// that devices keep registered (pinned page cache, which the kernel cannot evict) count against a
// budget of RAM shared by the processes naming it; beyond it the least recently used model gives
// its registration back. Not set: the ledger RESIDENCY_SHARED_BUDGET names, when it names one,
// else kDefaultHostBudget.
struct HostBudget {
  bool off = false;                    // `off`: registrations are not bounded
  std::optional<SharedBudget> budget;  // set: this ledger
};
// The default: half of RAM, under the ledger `host`.
inline constexpr double kDefaultHostBudgetPercent = 50.0;
inline constexpr const char* kDefaultHostBudgetName = "host";
// Accepted: `off`; SIZE or a percent of RAM (the ledger `host`); or NAME:SIZE[:GROUP] as
// RESIDENCY_SHARED_BUDGET.
Result<HostBudget> parse_host_budget(std::string_view text);

Result<Layout> parse_layout(std::string_view text);       // "per_buffer" | "sharded"
Result<LogLevel> parse_log_level(std::string_view text);  // "error" | "warn" | "info" | "debug"

// When the preload makes the pinned host backup of a CUDA device's weights
// (CudaBackendOptions::Backup; RESIDENCY_CUDA_BACKUP, read by the preload only).
enum class CudaBackup : std::uint8_t {
  automatic,         // not set: after_allocation, unless the keep-alive is forever (nothing sleeps)
  after_allocation,  // a background thread pins the backup right after allocation
  at_first_sleep,    // no host memory until the first sleep, which pins as it copies
};
Result<CudaBackup> parse_cuda_backup(std::string_view text);  // "after-allocation" | "at-first-sleep"

// RESIDENCY_BUDGET_WAIT's default: long enough for the decodes of the holders ahead to end (a
// burst of four requests to four models waited 1.1 s at the 99th percentile on an H200), short of
// an HTTP client's patience.
inline constexpr Nanos kDefaultBudgetWait = std::chrono::seconds(30);

struct Config {
  KeepAlive keep_alive;                   // default 180 s
  std::optional<WiredLimit> wired_limit;  // default: the recommended working set
  double set_max_pct = 5.0;               // sharded set cap; <= 0 or >= 100: one set
  Layout layout = Layout::sharded;
  bool release_on_pressure = false;  // release early under memory pressure, gradually:
  // each pressure event gives back one step (scratch, then kv_cache, then weights by priority and
  // least recent use) down to the floor; the reduced budget holds until pressure has been quiet
  // for `pressure_quiet`, then what was given back is wired again.
  std::optional<WiredLimit> pressure_floor;  // bytes or percent of the wired limit; default 0
  Nanos pressure_quiet = std::chrono::seconds(30);
  LogLevel log_level = LogLevel::info;
  bool log_time = false;                      // RESIDENCY_LOG_TIME=1: the default log lines carry the local time
  std::optional<std::uint64_t> memory_limit;  // cap on tracked bytes; default min(1.5 x recommended, 0.95 x physical)
  // A wired budget shared with the other processes naming it; none by default. When it is full,
  // the holder idle longest among those of priority <= ours is asked to give back (see README).
  std::optional<SharedBudget> shared_budget;
  int shared_priority = 0;  // higher: asked later, and never by a holder of lower priority
  // A wake or allocation of device memory that finds a shared budget full once the idle holders
  // were asked: a duration (30 s, the default) waits for room, in order of arrival across the
  // processes, at most that long, and then refuses it; nullopt (`over`, opt-in) wakes it over the
  // budget, a debt repaid as the calls end (RESIDENCY_BUDGET_WAIT).
  std::optional<Nanos> budget_wait = kDefaultBudgetWait;
  // Publish this manager's state for `residency stat --pid` (a 0600 file in /dev/shm, Linux;
  // src/core/state_file.hpp).
  bool state_file = true;
  CudaBackup cuda_backup = CudaBackup::automatic;  // the preload's CUDA devices only
  // The preload only: hold the engine's working memory with the model (its libraries' data, the
  // heap, the stacks its calls ran on, what it mapped inside its calls). RESIDENCY_ENGINE_MEMORY=0.
  bool engine_memory = true;
  // One budget per GPU, shared by the device managers of every process that names it (the
  // preload's): the ledger of a GPU is NAME.<its UUID>, its SIZE bytes or a percent of that GPU's
  // memory. Empty: GPU memory is not budgeted.
  std::optional<SharedBudget> gpu_budget;
  // The host tier: what bounds the model files a device manager keeps registered.
  HostBudget host_budget;
  // Notes made while reading the environment (a peer alias used, a variable overriding
  // another); the manager logs them at start-up.
  std::vector<std::string> notes;

  using EnvLookup = std::function<const char*(const char* name)>;
  // Reads every RESIDENCY_* variable and the peer aliases of the key table (src/core/config_keys.cpp,
  // the README's configuration table), in its order. On error the message has one line per bad
  // variable.
  static Result<Config> from_env();
  static Result<Config> from_env(const EnvLookup& getenv);

  // The configuration of a manager of one GPU's memory, made from the process's: the device's
  // memory is its budget (the wired limit, memory limit, pressure and shared budget settings are
  // about RAM), each allocation is its own set (llama.cpp's buffers), the notes are logged by the
  // process's host manager, and cuda_backup is never `automatic` (config_device.cpp says why).
  // With gpu_budget and the GPU's `device_uuid` (Capabilities::device_uuid), the device's manager
  // shares the GPU's budget: shared_budget is NAME.UUID with gpu_budget's size and group. Its
  // host_budget is resolved: the one set, else RESIDENCY_SHARED_BUDGET's ledger, else the default.
  Config for_device_memory(std::string_view device_uuid = {}) const;
};

}  // namespace residency
