// SPDX-License-Identifier: MIT
// The posix backend against the real kernel: mlock through sets shows in VmLck, locked pages
// survive reclaim and unlocked ones do not, a page shared by two regions stays locked while
// either holds it, RLIMIT_MEMLOCK refusals come back as a Status naming the limit and the fix,
// and the PSI watch starts and stops at once.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>
#include <vector>

#include "backends/posix/proc_info.hpp"
#include "backends/posix/system_info.hpp"
#include "posix_test_support.hpp"
#include "residency/backends/posix.hpp"
#include "support/proc_cgroup.hpp"

namespace residency {
namespace {

using namespace posix_test;
using Clock = std::chrono::steady_clock;

std::shared_ptr<Backend> make_backend_or_fail(const PosixOptions& o = {}) {
  auto b = make_posix_backend(o);
  EXPECT_TRUE(b) << b.message();
  return b ? *b : nullptr;
}

RegionDesc region(RegionId id, void* base, std::size_t size) {
  RegionDesc d;
  d.id = id;
  d.base = base;
  d.size = size;
  return d;
}

// Within a page or two: VmLck counts whole pages, and other code may lock a page meanwhile.
void expect_near(std::uint64_t got, std::uint64_t want, const char* what) {
  const std::uint64_t slack = 2 * page_size();
  EXPECT_LE(got, want + slack) << what;
  EXPECT_GE(got + slack, want) << what;
}

TEST(PosixBackend, CapabilitiesSayWhatItIs) {
  auto b = make_backend_or_fail();
  ASSERT_TRUE(b);
  const Capabilities c = b->capabilities();
  EXPECT_EQ(c.name, "posix");
  EXPECT_FALSE(c.needs_refresh);
  EXPECT_EQ(c.max_sets, 0u);
  EXPECT_FALSE(b->allocate(4096, RegionClass::weights));
}

TEST(PosixBackend, InvalidOptionsAreRefusedWithTheReason) {
  PosixOptions o;
  o.recommended_pct = 0;
  auto b = make_posix_backend(o);
  ASSERT_FALSE(b);
  EXPECT_NE(b.message().find("recommended_pct"), std::string::npos) << b.message();
  o = {};
  o.pressure_window = std::chrono::seconds(20);
  auto w = make_posix_backend(o);
  ASSERT_FALSE(w);
  EXPECT_NE(w.message().find("window"), std::string::npos) << w.message();
}

TEST(PosixBackend, MemoryInfoComesFromProcAndRlimit) {
  auto b = make_backend_or_fail();
  ASSERT_TRUE(b);
  auto meminfo = posix::read_meminfo();
  if (!meminfo) GTEST_SKIP() << "no /proc/meminfo: " << meminfo.message();
  const MemoryInfo mi = b->memory_info();
  EXPECT_EQ(mi.physical, meminfo->mem_total);
  const auto figures = posix::read_memory_figures();
  EXPECT_EQ(mi.recommended_working_set, posix_recommended_working_set(figures.limit_base, 75.0));
  EXPECT_LE(mi.recommended_working_set, mi.physical * 3 / 4);
  EXPECT_EQ(mi.hard_limit_name, "RLIMIT_MEMLOCK");
  EXPECT_NE(mi.hard_limit_fix.find("ulimit -l"), std::string::npos);
  EXPECT_NE(mi.hard_limit_fix.find("LimitMEMLOCK="), std::string::npos);
  EXPECT_NE(mi.hard_limit_fix.find("--cap-add IPC_LOCK"), std::string::npos);
  const auto lim = posix::read_memlock_limit();
  if (lim.cap_ipc_lock || lim.soft == posix::MemlockLimit::kUnlimited) {
    EXPECT_EQ(mi.hard_limit, 0u) << "no limit applies with CAP_IPC_LOCK or an unlimited RLIMIT_MEMLOCK";
  } else {
    EXPECT_EQ(mi.hard_limit, lim.soft);
  }
}

TEST(PosixBackend, RecommendedWorkingSetIsThreeQuartersByDefault) {
  EXPECT_EQ(posix_recommended_working_set(16ULL << 30), 12ULL << 30);
  EXPECT_EQ(posix_recommended_working_set(1000, 50), 500u);
  EXPECT_EQ(posix_recommended_working_set(1000, 100), 1000u);
  EXPECT_EQ(posix_recommended_working_set(1000, 0), 0u);
}

// 256 MiB of a mapped file: mlock of the whole set raises VmLck by exactly that, munlock
// lowers it again.
TEST(PosixBackend, RequestResidencyLocksTheSetAndEndResidencyUnlocksIt) {
  constexpr std::size_t kSize = 256 * MiB;
  if (auto why = ensure_memlock(kSize)) GTEST_SKIP() << *why;
  TempMappedFile file(kSize);
  ASSERT_TRUE(file.ok()) << file.error();
  file.touch_all();
  auto b = make_backend_or_fail();
  ASSERT_TRUE(b);

  ASSERT_TRUE(b->create_set(0, kSize));
  b->add_region(0, region(1, file.data(), kSize));
  EXPECT_TRUE(b->commit(0).ok());

  const std::uint64_t before = vm_lck();
  const auto t0 = Clock::now();
  const SetOutcome req = b->request_residency(0);
  const double lock_ms = ms_since(t0);
  ASSERT_TRUE(req.ok()) << req.status.message();
  expect_near(vm_lck(), before + kSize, "VmLck after request_residency");

  const auto t1 = Clock::now();
  EXPECT_TRUE(b->end_residency(0));
  const double unlock_ms = ms_since(t1);
  expect_near(vm_lck(), before, "VmLck after end_residency");
  std::printf("[ measured ] mlock of a resident 256 MiB file mapping: %.2f ms; munlock: %.2f ms\n", lock_ms, unlock_ms);
  RecordProperty("mlock_256MiB_resident_ms", std::to_string(lock_ms));

  EXPECT_TRUE(b->destroy_set(0));
}

// Membership changes while resident take effect at commit: added regions lock, removed ones
// unlock; nothing happens before the commit.
TEST(PosixBackend, CommitWhileRequestedLocksAddedAndUnlocksRemovedRegions) {
  constexpr std::size_t kSize = 8 * MiB;
  if (auto why = ensure_memlock(kSize)) GTEST_SKIP() << *why;
  TempMappedFile file(kSize);
  ASSERT_TRUE(file.ok()) << file.error();
  auto b = make_backend_or_fail();
  ASSERT_TRUE(b);
  const std::uint64_t before = vm_lck();
  char* half = file.data() + kSize / 2;

  ASSERT_TRUE(b->create_set(3, 0));
  ASSERT_TRUE(b->request_residency(3).ok());  // an empty set may be requested
  b->add_region(3, region(10, file.data(), kSize / 2));
  expect_near(vm_lck(), before, "staged add does nothing before commit");
  ASSERT_TRUE(b->commit(3).ok());
  expect_near(vm_lck(), before + kSize / 2, "after commit of the first half");

  b->add_region(3, region(11, half, kSize / 2));
  b->remove_region(3, 10);
  ASSERT_TRUE(b->commit(3).ok());
  expect_near(vm_lck(), before + kSize / 2, "second half in, first half out");

  // An add and a remove of the same region inside one batch cancel out.
  b->add_region(3, region(12, file.data(), 4096));
  b->remove_region(3, 12);
  ASSERT_TRUE(b->commit(3).ok());
  expect_near(vm_lck(), before + kSize / 2, "add+remove in one commit");

  EXPECT_TRUE(b->destroy_set(3));  // ends residency of what it holds
  expect_near(vm_lck(), before, "after destroy_set");
}

// Two regions that share a page (neither is page-aligned at the seam), in two sets: ending
// one set must not unlock the other's part of the shared page.
TEST(PosixBackend, PageSharedByTwoSetsStaysLockedUntilBothEnd) {
  const std::size_t ps = page_size();
  const std::size_t size = 8 * ps;
  if (auto why = ensure_memlock(size)) GTEST_SKIP() << *why;
  TempMappedFile file(size);
  ASSERT_TRUE(file.ok()) << file.error();
  auto b = make_backend_or_fail();
  ASSERT_TRUE(b);
  const std::uint64_t before = vm_lck();
  const std::size_t seam = 3 * ps + ps / 2;  // inside page 3

  ASSERT_TRUE(b->create_set(0, 0));
  ASSERT_TRUE(b->create_set(1, 0));
  b->add_region(0, region(1, file.data(), seam));                // pages 0..3
  b->add_region(1, region(2, file.data() + seam, size - seam));  // pages 3..7
  ASSERT_TRUE(b->commit(0).ok());
  ASSERT_TRUE(b->commit(1).ok());
  ASSERT_TRUE(b->request_residency(0).ok());
  ASSERT_TRUE(b->request_residency(1).ok());
  EXPECT_EQ(vm_lck(), before + size);

  EXPECT_TRUE(b->end_residency(0));
  // Pages 3..7 still held by set 1: 5 pages; a plain munlock of set 0's pages would have
  // left 4.
  EXPECT_EQ(vm_lck(), before + 5 * ps);
  EXPECT_TRUE(b->end_residency(1));
  EXPECT_EQ(vm_lck(), before);
}

// MADV_PAGEOUT is what memory pressure does to a mapping, made repeatable: while the set is
// resident nothing is evicted; after end_residency the same request evicts the pages; a new
// request brings them back (the re-wire: a read from disk).
TEST(PosixBackend, LockedPagesSurvivePageoutAndUnlockedOnesDoNot) {
  if (auto why = pageout_unsupported_reason()) GTEST_SKIP() << *why;
  constexpr std::size_t kSize = 256 * MiB;
  if (auto why = ensure_memlock(kSize)) GTEST_SKIP() << *why;
  TempMappedFile file(kSize);
  ASSERT_TRUE(file.ok()) << file.error();
  file.touch_all();
  auto b = make_backend_or_fail();
  ASSERT_TRUE(b);
  ASSERT_TRUE(b->create_set(0, kSize));
  b->add_region(0, region(1, file.data(), kSize));
  ASSERT_TRUE(b->commit(0).ok());
  ASSERT_TRUE(b->request_residency(0).ok());

  const int err = file.page_out();
  EXPECT_TRUE(err == 0 || err == EINVAL) << "madvise: " << std::strerror(err);  // EINVAL: locked
  EXPECT_EQ(file.resident_fraction(), 1.0) << "a locked page was evicted";

  EXPECT_TRUE(b->end_residency(0));
  ASSERT_EQ(file.page_out(), 0);
  const double after = file.resident_fraction();
  EXPECT_LT(after, 0.10) << "MADV_PAGEOUT + FADV_DONTNEED left " << after * 100 << " % resident";

  const auto t0 = Clock::now();
  ASSERT_TRUE(b->request_residency(0).ok());
  const double rewire_ms = ms_since(t0);
  EXPECT_EQ(file.resident_fraction(), 1.0) << "request_residency must fault every page back in";
  std::printf(
      "[ measured ] resident after pageout while unlocked: %.1f %%; re-wire (mlock) of 256 MiB "
      "after pageout: %.2f ms\n",
      after * 100, rewire_ms);
  RecordProperty("rewire_256MiB_after_pageout_ms", std::to_string(rewire_ms));
  EXPECT_TRUE(b->destroy_set(0));
}

TEST(PosixBackend, BadRangesFailTheRegionNotTheSet) {
  constexpr std::size_t kSize = 1 * MiB;
  if (auto why = ensure_memlock(kSize)) GTEST_SKIP() << *why;
  TempMappedFile file(kSize);
  ASSERT_TRUE(file.ok()) << file.error();
  auto b = make_backend_or_fail();
  ASSERT_TRUE(b);
  const std::uint64_t before = vm_lck();

  // An address range with nothing mapped: reserve and unmap it.
  void* hole = ::mmap(nullptr, kSize, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(hole, MAP_FAILED);
  ::munmap(hole, kSize);

  ASSERT_TRUE(b->create_set(0, 0));
  b->add_region(0, region(1, file.data(), kSize));
  b->add_region(0, region(2, nullptr, 4096));
  b->add_region(0, region(3, hole, kSize));
  ASSERT_TRUE(b->commit(0).ok());
  const SetOutcome out = b->request_residency(0);
  EXPECT_FALSE(out.ok());
  EXPECT_EQ(out.failed, (std::vector<RegionId>{2, 3}));
  EXPECT_EQ(out.status.code(), ErrorCode::invalid_argument);
  EXPECT_NE(out.status.message().find("region 2"), std::string::npos) << out.status.message();
  EXPECT_NE(out.status.message().find("1 more region"), std::string::npos) << out.status.message();
  expect_near(vm_lck(), before + kSize, "the good region is locked, the bad ones are not");

  // A second request retries only what is not locked, and fails the same way.
  const SetOutcome again = b->request_residency(0);
  EXPECT_EQ(again.failed, (std::vector<RegionId>{2, 3}));
  EXPECT_TRUE(b->end_residency(0));
  expect_near(vm_lck(), before, "after end_residency");
}

TEST(PosixBackend, UnknownSetsAreReportedNotFatal) {
  auto b = make_backend_or_fail();
  ASSERT_TRUE(b);
  const SetOutcome c = b->commit(42);
  EXPECT_EQ(c.status.code(), ErrorCode::not_found);
  EXPECT_EQ(b->request_residency(42).status.code(), ErrorCode::not_found);
  EXPECT_EQ(b->end_residency(42).code(), ErrorCode::not_found);
  EXPECT_TRUE(b->destroy_set(42)) << "destroying what is not there leaves nothing to report";
  ASSERT_TRUE(b->create_set(1, 0));
  EXPECT_EQ(b->create_set(1, 0).code(), ErrorCode::invalid_argument);
}

// RLIMIT_MEMLOCK without CAP_IPC_LOCK, in a child so that the test process keeps its limits:
// the mlock is refused, the region is reported failed with the limit and the fix, the rest
// of the set is locked, and memory_info().hard_limit is the limit.
TEST(PosixBackend, RlimitMemlockRefusalNamesTheLimitAndTheFix) {
  TempMappedFile file(64 * MiB);
  ASSERT_TRUE(file.ok()) << file.error();
  const auto r = run_in_child([&](std::string& report) {
    if (auto e = drop_cap_ipc_lock(); !e.empty()) {
      report = "cannot drop CAP_IPC_LOCK: " + e;
      return kChildSkip;
    }
    if (auto e = set_memlock_limit(1 * MiB); !e.empty()) {
      report = "cannot lower RLIMIT_MEMLOCK: " + e;
      return 1;
    }
    if (has_cap_ipc_lock()) {
      report = "CAP_IPC_LOCK still effective after capset";
      return kChildSkip;
    }
    auto b = make_posix_backend();
    if (!b) {
      report = "make_posix_backend: " + b.message();
      return 1;
    }
    Backend& be = **b;
    const MemoryInfo mi = be.memory_info();
    if (mi.hard_limit != 1 * MiB) {
      report = "hard_limit = " + std::to_string(mi.hard_limit) + ", want 1 MiB";
      return 1;
    }
    (void)be.create_set(0, 0);
    be.add_region(0, region(1, file.data(), 64 * KiB));              // fits the limit
    be.add_region(0, region(2, file.data() + MiB, 64 * MiB - MiB));  // does not
    (void)be.commit(0);
    const SetOutcome out = be.request_residency(0);
    report = out.status.message();
    if (out.failed != std::vector<RegionId>{2}) return 2;
    if (out.status.code() != ErrorCode::limit_exceeded) return 3;
    for (const char* needle : {"RLIMIT_MEMLOCK = 1048576", "ulimit -l", "LimitMEMLOCK=", "--cap-add IPC_LOCK",
                               "region 2", "stays tracked but not resident"}) {
      if (report.find(needle) == std::string::npos) return 4;
    }
    if (vm_lck() < 64 * KiB) {
      report += "\nregion 1 was not locked";
      return 5;
    }
    EXPECT_TRUE(be.end_residency(0));
    if (vm_lck() != 0) {
      report += "\nVmLck not 0 after end_residency";
      return 6;
    }
    // RLIMIT_MEMLOCK = 0: EPERM, still a clear message.
    (void)set_memlock_limit(0);
    const SetOutcome zero = be.request_residency(0);
    if (zero.failed.size() != 2 || zero.status.code() != ErrorCode::permission_denied ||
        zero.status.message().find("RLIMIT_MEMLOCK = 0") == std::string::npos) {
      report += "\nwith limit 0: " + zero.status.message();
      return 7;
    }
    return 0;
  });
  if (r.exit_code == kChildSkip) GTEST_SKIP() << r.report;
  EXPECT_EQ(r.signal, 0) << "child crashed";
  EXPECT_EQ(r.exit_code, 0) << r.report;
  std::printf("[ message  ] %s\n", r.report.c_str());
}

TEST(PosixBackend, PressureWatchStartsAndStopsAtOnceOrSaysWhyNot) {
  auto b = make_backend_or_fail();
  ASSERT_TRUE(b);
  std::atomic<int> calls{0};
  const auto st = b->watch_pressure([&] { calls.fetch_add(1); });
  const PressureInfo psi = posix::read_pressure("/proc/pressure/memory");
  if (!st) {
    EXPECT_EQ(st.status().code(), ErrorCode::unsupported) << st.message();
    EXPECT_NE(st.message().find("pressure"), std::string::npos) << st.message();
    // As root a readable PSI file is also writable and the 2 s window is accepted.
    if (psi.available && ::geteuid() == 0)
      ADD_FAILURE() << "PSI is readable here but the watch failed: " << st.message();
    GTEST_SKIP() << st.message();
  }
  // Two managers add two watchers to the one system watch; the watch ends with the last.
  const auto second = b->watch_pressure([&] { calls.fetch_add(1); });
  ASSERT_TRUE(second) << second.message();
  EXPECT_NE(*second, *st);
  b->stop_pressure_watch(*st);
  const auto t0 = Clock::now();
  b->stop_pressure_watch(*second);
  const double stop_ms = ms_since(t0);
  // The watch thread sleeps in poll() with no timeout; only the stop pipe can end it early.
  EXPECT_LT(stop_ms, 1000.0);
  // Restartable, and stopping twice is harmless.
  const auto again = b->watch_pressure([&] { calls.fetch_add(1); });
  EXPECT_TRUE(again);
  if (again) {
    b->stop_pressure_watch(*again);
    b->stop_pressure_watch(*again);
  }
}

// Real pressure from a child thrashing in a small memory cgroup: the kernel's source fires (the
// PSI trigger, or on a cgroup v1 machine the memory.pressure_level of this process's cgroup, to
// which the child cgroup's events rise) and the callback runs on the watch thread; while the
// thrashing goes on, the calls come at most once per window (2 s), as a PSI trigger's do. A
// sensitive trigger (10 ms stalled in 2 s) keeps the test short; the default (150 ms) is for
// production.
TEST(PosixBackend, PressureWatchReportsRealMemoryPressure) {
  PosixOptions o;
  o.pressure_stall = std::chrono::milliseconds(10);
  auto b = make_backend_or_fail(o);
  ASSERT_TRUE(b);
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Clock::time_point> calls;
  const auto st = b->watch_pressure([&] {
    std::lock_guard<std::mutex> g(mu);
    calls.push_back(Clock::now());
    cv.notify_all();
  });
  if (!st) GTEST_SKIP() << st.message();
  const std::string source = b->pressure_source();
  EXPECT_FALSE(source.empty()) << "a running watch says what it listens to";
  MemoryThrasher thrasher;
  if (auto why = thrasher.start()) {
    b->stop_pressure_watch(*st);
    GTEST_SKIP() << "cannot make memory pressure here: " << *why;
  }
  const auto t0 = Clock::now();
  bool fired = false;
  {
    std::unique_lock<std::mutex> lock(mu);
    // A real kernel event: nothing to inject, so wait for it (typically under 2 s).
    fired = cv.wait_for(lock, std::chrono::seconds(15), [&] { return !calls.empty(); });
  }
  const double after_ms = ms_since(t0);
  if (fired) std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // thrashing goes on
  thrasher.stop();
  b->stop_pressure_watch(*st);
  EXPECT_TRUE(fired) << "no pressure event within 15 s of thrashing in a 16 MiB cgroup; source: " << source;
  for (std::size_t i = 1; i < calls.size(); ++i)
    EXPECT_GE(calls[i] - calls[i - 1], std::chrono::milliseconds(1990)) << "call " << i << " came inside the 2 s window";
  std::printf(
      "[ measured ] pressure watch (%s) fired %.0f ms after the thrashing began; %zu call(s) in the next 2.5 s\n",
      source.c_str(), after_ms, calls.empty() ? 0 : calls.size() - 1);
}

// The watch listens where the memory controller that governs this process is, read here from
// /proc/self/cgroup without the library: a cgroup v1 memory cgroup other than the root has no PSI
// of its own (its kernel source is memory.pressure_level); a cgroup v2 one has memory.pressure;
// the root, the system's /proc/pressure/memory.
TEST(PosixBackend, PressureWatchListensWhereTheMemoryControllerIs) {
  auto b = make_backend_or_fail();
  ASSERT_TRUE(b);
  const auto st = b->watch_pressure([] {});
  if (!st) GTEST_SKIP() << st.message();
  const std::string source = b->pressure_source();
  b->stop_pressure_watch(*st);
  EXPECT_TRUE(b->pressure_source().empty()) << "no source once the watch has stopped";
  const auto proc = testing::read_proc_self_cgroup();
  const std::string& v1_path = proc.v1_memory;
  const std::string& v2_path = proc.v2;
  std::printf("[ source   ] %s\n", source.c_str());
  if (!v1_path.empty() && v1_path != "/" && ::geteuid() == 0) {
    EXPECT_NE(source.find("cgroup v1 memory.pressure_level"), std::string::npos) << source;
    EXPECT_NE(source.find(v1_path + "/memory.pressure_level"), std::string::npos) << source;
  } else if (v1_path.empty() && !v2_path.empty() && v2_path != "/") {
    EXPECT_NE(source.find(v2_path + "/memory.pressure"), std::string::npos) << source;
  } else if (v1_path.empty() || v1_path == "/") {
    EXPECT_NE(source.find("/proc/pressure/memory"), std::string::npos) << source;
  }
}

TEST(PosixBackend, PressureWatchOnAMissingFileIsUnsupportedWithThePath) {
  PosixOptions o;
  o.pressure_file = "/proc/pressure/no-such-resource";
  auto b = make_backend_or_fail(o);
  ASSERT_TRUE(b);
  const auto st = b->watch_pressure([] {});
  ASSERT_FALSE(st);
  EXPECT_EQ(st.status().code(), ErrorCode::unsupported);
  EXPECT_NE(st.message().find("/proc/pressure/no-such-resource"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace residency
