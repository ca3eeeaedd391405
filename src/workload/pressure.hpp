// SPDX-License-Identifier: MIT
// Memory pressure for the idle benchmark, made repeatable.
//
// What a pause costs on Linux depends on what happens to the model's pages while the engine is
// idle: nothing (no pressure), or the kernel reclaims the ones that are not locked (pressure). Real
// pressure comes and goes with whatever else runs, so the benchmark applies it on purpose at the
// end of each pause, in one of two ways:
//   pageout  asks the kernel to reclaim every page of the model mapping (MADV_PAGEOUT) and to drop
//            the file's cached pages (POSIX_FADV_DONTNEED): what heavy pressure does, exactly and
//            quickly. The kernel skips locked (wired) pages, which is the point being measured.
//   hog:SIZE a second process allocates SIZE bytes, touches every page and exits: real pressure,
//            as another application would apply it, reclaiming whatever the kernel chooses.
// resident_fraction() (mincore) tells how much of the model was still in memory just before a
// decode, so every sample says what the pause left behind.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "residency/status.hpp"

namespace residency::workload {

struct Pressure {
  enum class Kind : std::uint8_t { none, pageout, hog };
  Kind kind = Kind::none;
  std::uint64_t hog_bytes = 0;    // for hog
  std::string to_string() const;  // "none", "pageout", "hog:2 GiB"
};

// Accepted: "none", "pageout", "hog:SIZE" with SIZE as residency::parse_size reads it ("hog:4GiB").
Result<Pressure> parse_pressure(std::string_view text);

// MemAvailable from /proc/meminfo, in bytes.
Result<std::uint64_t> mem_available();
// A hog must fit in the memory available now, or the OOM killer would end it (or something else).
Status check_hog_fits(std::uint64_t bytes);
// Whether this kernel has MADV_PAGEOUT (Linux 5.4+); the error says what to use instead.
Status pageout_supported();

struct PageoutResult {
  std::uint64_t advised_bytes = 0;  // asked to reclaim
  std::uint64_t locked_bytes = 0;   // skipped: locked by mlock (the kernel refuses MADV_PAGEOUT there)
};
// Reclaims the unlocked pages of [base, base + len) (a mapping of `fd`) and drops the file's
// unmapped cached pages.
Result<PageoutResult> page_out(const void* base, std::size_t len, int fd);

// Fraction (0..1) of the pages of [base, base + len) resident in memory now.
Result<double> resident_fraction(const void* base, std::size_t len);

// What one hog run got: the hog is a batch job beside the engine, expendable (oom_score_adj 1000:
// in a memory cgroup the OOM killer takes it, not the engine) and retried by its supervisor until
// it gets its memory or `give_up` has passed.
struct HogRun {
  bool got = false;      // every page was touched
  double waited_ms = 0;  // from the first attempt until it got everything, or until it gave up
  int attempts = 0;
  int oom_killed = 0;  // attempts ended by SIGKILL (the OOM killer)
};
// The default bound: long enough for a release on pressure (one PSI window, 2 s, and the
// unlock), short enough that a benchmark with `forever` beside a hog that cannot fit ends.
inline constexpr double kHogGiveUpSeconds = 10.0;

// Runs the hog in child processes (one per attempt, `bytes` anonymous memory touched page by page)
// and waits for them. Each child is registered with CleanupRegistry so that an interrupt kills it
// too. An attempt killed by SIGKILL (the OOM killer) is retried after 100 ms until `give_up_s`;
// not getting the memory is a result, not an error. Errors: fork failed, the child could not map
// the memory, or it ended otherwise abnormally. `hold` (a test hook: 0 in every real use) keeps the
// memory that long after touching it, so that a test can watch the hog outlive, or not, a parent
// killed meanwhile. The hog dies with this process (PR_SET_PDEATHSIG), even when it is SIGKILLed.
Result<HogRun> run_hog(std::uint64_t bytes, double give_up_s = kHogGiveUpSeconds, std::chrono::milliseconds hold = {});

// True when `path` is on tmpfs or ramfs, where file pages live in memory and cannot be reclaimed
// without swap: a model there would never pay a re-read.
bool on_memory_filesystem(const std::string& path);

}  // namespace residency::workload
