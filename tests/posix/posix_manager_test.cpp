// SPDX-License-Identifier: MIT
// The posix backend under the Manager, as an engine uses it: a mapped model stays resident
// through reclaim while the keep-alive runs, is given back when it expires (virtual time, no
// sleeping), comes back on the next touch(); and with RLIMIT_MEMLOCK low and no
// CAP_IPC_LOCK the budget is clamped to the limit and every refusal is a warning that names
// the limit and the fix, never a crash.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <thread>

#include "posix_test_support.hpp"
#include "residency/backends.hpp"
#include "residency/backends/posix.hpp"
#include "residency/residency.hpp"
#include "support/fake_backend.hpp"  // LogCapture
#include "support/strict.hpp"

namespace residency {
namespace {

using namespace posix_test;
using namespace std::chrono_literals;
using residency::testing::LogCapture;

struct Fixture {
  ManualClock clock{Nanos(std::chrono::hours(1))};
  LogCapture logs;

  Result<std::unique_ptr<Manager>> make(const char* keep_alive, std::shared_ptr<Backend> backend = nullptr,
                                        bool release_on_pressure = false) {
    if (!backend) {
      auto b = make_posix_backend();
      if (!b) return b.status();
      backend = *b;
    }
    ManagerOptions o;
    o.config.keep_alive = *parse_keep_alive(keep_alive);
    o.config.release_on_pressure = release_on_pressure;
    o.backend = std::move(backend);
    o.clock = &clock;
    o.log = logs.callback();
    o.start_scheduler = false;
    return Manager::create(std::move(o));
  }
  std::string all_logs() {
    std::lock_guard<std::mutex> g(logs.m);
    std::string s;
    for (auto& [l, line] : logs.lines) s += std::string(to_string(l)) + ": " + line + "\n";
    return s;
  }
};

TEST(PosixManager, KeepAliveHoldsTheModelThroughPageoutAndExpiryGivesItBack) {
  if (auto why = pageout_unsupported_reason()) GTEST_SKIP() << *why;
  constexpr std::size_t kSize = 128 * MiB;
  if (auto why = ensure_memlock(kSize)) GTEST_SKIP() << *why;
  TempMappedFile model(kSize);
  ASSERT_TRUE(model.ok()) << model.error();
  model.touch_all();

  Fixture f;
  auto m = f.make("10s");
  ASSERT_TRUE(m) << m.message();
  Manager& mgr = **m;
  const std::uint64_t before = vm_lck();
  auto id = mgr.register_region(model.data(), kSize);
  ASSERT_TRUE(id) << id.message();
  Stats s = mgr.stats();
  EXPECT_TRUE(s.resident);
  EXPECT_EQ(s.wired_bytes, kSize);
  EXPECT_EQ(s.wire_failures, 0u) << f.all_logs();
  EXPECT_GE(vm_lck(), before + kSize);

  // Pressure while the keep-alive runs: nothing is evicted.
  model.page_out();
  EXPECT_EQ(model.resident_fraction(), 1.0);

  // 11 s of idle in virtual time: the keep-alive expires and the memory is given back.
  f.clock.advance(11s);
  mgr.run_due();
  s = mgr.stats();
  EXPECT_FALSE(s.resident);
  EXPECT_EQ(s.releases, 1u);
  EXPECT_LE(vm_lck(), before + 2 * page_size());
  ASSERT_EQ(model.page_out(), 0);
  const double evicted_left = model.resident_fraction();
  EXPECT_LT(evicted_left, 0.10);

  // The next use re-wires: every page is read back and locked again.
  const auto t0 = std::chrono::steady_clock::now();
  mgr.touch();
  const double rewire_ms = ms_since(t0);
  s = mgr.stats();
  EXPECT_TRUE(s.resident);
  EXPECT_EQ(s.rewires, 1u);
  EXPECT_EQ(model.resident_fraction(), 1.0);
  EXPECT_GE(vm_lck(), before + kSize);
  std::printf(
      "[ measured ] through the Manager: %.1f %% resident after expiry + pageout; touch() re-wire of "
      "128 MiB: %.2f ms\n",
      evicted_left * 100, rewire_ms);

  ASSERT_TRUE(mgr.unregister_region(*id));
  EXPECT_LE(vm_lck(), before + 2 * page_size());
}

TEST(PosixManager, ReleaseOnPressureStartsThePsiWatchOrWarnsWhy) {
  Fixture f;
  PosixOptions o;
  o.pressure_file = "/proc/pressure/no-such-resource";
  auto b = make_posix_backend(o);
  ASSERT_TRUE(b) << b.message();
  auto m = f.make("180s", *b, /*release_on_pressure=*/true);
  ASSERT_TRUE(m) << m.message();
  EXPECT_TRUE(f.logs.contains(LogLevel::warn, "/proc/pressure/no-such-resource")) << f.all_logs();

  const PressureInfo psi = posix::read_pressure("/proc/pressure/memory");
  if (!psi.available || ::geteuid() != 0) GTEST_SKIP() << "PSI watch needs a writable /proc/pressure/memory";
  Fixture g;
  auto m2 = g.make("180s", nullptr, /*release_on_pressure=*/true);
  ASSERT_TRUE(m2) << m2.message();
  EXPECT_FALSE(g.logs.contains("release_on_pressure is set but")) << g.all_logs();
  m2->reset();  // stops the watch thread at once
}

// release_on_pressure end to end: real memory pressure (a child thrashing in a small memory
// cgroup) makes the PSI watch call the manager, which gives the model's memory back; the next
// touch() re-wires it.
TEST(PosixManager, RealMemoryPressureReleasesAndTouchRewires) {
  constexpr std::size_t kSize = 32 * MiB;
  if (auto why = ensure_memlock(kSize)) GTEST_SKIP() << *why;
  TempMappedFile model(kSize);
  ASSERT_TRUE(model.ok()) << model.error();
  PosixOptions o;
  o.pressure_stall = std::chrono::milliseconds(10);  // sensitive, to keep the test short
  auto b = make_posix_backend(o);
  ASSERT_TRUE(b) << b.message();

  Fixture f;
  auto m = f.make("forever", *b, /*release_on_pressure=*/true);
  ASSERT_TRUE(m) << m.message();
  if (f.logs.contains("release_on_pressure is set but")) RESIDENCY_SKIP_OR_FAIL_IN_CI(f.all_logs());
  Manager& mgr = **m;
  const std::uint64_t before = vm_lck();
  ASSERT_TRUE(mgr.register_region(model.data(), kSize));
  ASSERT_TRUE(mgr.stats().resident);
  EXPECT_GE(vm_lck(), before + kSize);

  MemoryThrasher thrasher;
  if (auto why = thrasher.start()) GTEST_SKIP() << "cannot make memory pressure here: " << *why;
  // The release happens on the watch thread; wait for it (a real kernel event, typically
  // under 2 s) by watching the stats.
  const auto t0 = std::chrono::steady_clock::now();
  while (mgr.stats().pressure_releases == 0 && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(15)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const double after_ms = ms_since(t0);
  thrasher.stop();
  Stats s = mgr.stats();
  ASSERT_GE(s.pressure_releases, 1u) << "no release within 15 s of real memory pressure\n" << f.all_logs();
  EXPECT_FALSE(s.resident) << "32 MiB is one step: all of it goes";
  EXPECT_LE(vm_lck(), before + 2 * page_size());
  EXPECT_TRUE(f.logs.contains(LogLevel::info, "under memory pressure")) << f.all_logs();

  // The reduced budget holds until pressure has been quiet for 30 s (virtual time here).
  mgr.touch();
  EXPECT_LE(vm_lck(), before + 2 * page_size());
  f.clock.advance(std::chrono::seconds(31));
  mgr.run_due();
  s = mgr.stats();
  EXPECT_TRUE(s.resident);
  EXPECT_EQ(s.pressure_restores, 1u);
  EXPECT_GE(vm_lck(), before + kSize);
  std::printf("[ measured ] release on real PSI pressure %.0f ms after the thrashing began\n", after_ms);
}

// Fraction of [p, p+n) that mincore reports resident.
double resident_fraction(const char* p, std::size_t n) {
  const std::size_t ps = page_size();
  std::vector<unsigned char> vec((n + ps - 1) / ps);
  if (::mincore(const_cast<char*>(p), n, vec.data()) != 0) return -1;
  std::size_t r = 0;
  for (unsigned char v : vec) r += v & 1U;
  return static_cast<double>(r) / static_cast<double>(vec.size());
}

// Two models in one server: two managers over overlapping pages of one file mapping, through
// the process's one posix backend. Releasing one must not munlock what the other still holds.
TEST(PosixManager, TwoManagersOverOverlappingPagesNeverUndoEachOther) {
  if (auto why = pageout_unsupported_reason()) GTEST_SKIP() << *why;
  constexpr std::size_t kSize = 64 * MiB;
  if (auto why = ensure_memlock(kSize)) GTEST_SKIP() << *why;
  TempMappedFile model(kSize);
  ASSERT_TRUE(model.ok()) << model.error();
  model.touch_all();
  auto b1 = make_backend("posix");
  auto b2 = make_backend("posix");
  ASSERT_TRUE(b1 && b2) << b1.message();
  EXPECT_EQ(b1->get(), b2->get()) << "one backend of a kind per process";

  Fixture f;
  auto a = f.make("10s", *b1);
  auto b = f.make("10s", *b2);
  ASSERT_TRUE(a && b);
  const std::uint64_t before = vm_lck();
  // A: [0, 40 MiB), B: [24 MiB, 64 MiB); 16 MiB shared, and the boundaries fall inside pages
  // of each other's regions only at page granularity.
  ASSERT_TRUE((*a)->register_region(model.data(), 40 * MiB));
  ASSERT_TRUE((*b)->register_region(model.data() + 24 * MiB, 40 * MiB));
  EXPECT_EQ(vm_lck() - before, kSize) << "the shared pages are counted once by the kernel";

  (*a)->release_now();
  EXPECT_EQ(vm_lck() - before, 40 * MiB) << "B's pages, shared ones included, stay locked";
  model.page_out();
  EXPECT_EQ(resident_fraction(model.data() + 24 * MiB, 40 * MiB), 1.0) << "pageout evicted pages B holds";
  EXPECT_LT(resident_fraction(model.data(), 24 * MiB), 0.10) << "A's own pages were given back";

  (*b)->release_now();
  EXPECT_EQ(vm_lck(), before);
  (*a)->touch();
  EXPECT_EQ(vm_lck() - before, 40 * MiB);
  a->reset();
  b->reset();
  EXPECT_EQ(vm_lck(), before);
}

// mlock locks whole pages, so a region that starts inside a page is charged every page it
// touches: under a wired limit of 3 pages, two regions of 1.5 pages that start mid-page (2 pages
// each to the kernel) are not both wired, and VmLck stays within the limit. Counting their bytes
// (3 pages together) would wire both: 4 pages locked under a limit of 3.
TEST(PosixManager, ARegionIsChargedTheWholePagesItTouchesAndVmLckStaysUnderTheLimit) {
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  if (auto why = ensure_memlock(16 * page)) GTEST_SKIP() << *why;
  TempMappedFile model(16 * page);
  ASSERT_TRUE(model.ok()) << model.error();
  model.touch_all();
  Fixture f;
  ManagerOptions o;
  auto backend = make_posix_backend();
  ASSERT_TRUE(backend) << backend.message();
  o.config.keep_alive = KeepAlive::forever();
  o.config.wired_limit = WiredLimit{false, 3 * page, 0};
  o.backend = *backend;
  o.clock = &f.clock;
  o.log = f.logs.callback();
  o.start_scheduler = false;
  auto m = Manager::create(std::move(o));
  ASSERT_TRUE(m) << m.message();
  const std::uint64_t before = vm_lck();
  const std::size_t len = page + page / 2;
  auto r1 = (*m)->register_region(model.data() + page / 2, len);             // pages 0-1
  auto r2 = (*m)->register_region(model.data() + 4 * page + page / 2, len);  // pages 4-5
  ASSERT_TRUE(r1 && r2) << r1.message() << r2.message();
  EXPECT_EQ(vm_lck() - before, 2 * page) << "the first region's two pages, and not the second's";
  const Stats st = (*m)->stats();
  EXPECT_EQ(st.wired_bytes, 2 * page) << "charged as the two pages it touches";
  EXPECT_EQ(st.tracked_bytes, 2 * len);
  EXPECT_EQ(st.pending_bytes, len) << "the second region's own bytes wait";
  ASSERT_TRUE((*m)->unregister_region(*r1));
  EXPECT_EQ(vm_lck() - before, 2 * page) << "freeing the first lets the second in";
  m->reset();
  EXPECT_EQ(vm_lck(), before);
}

// Two managers under one RLIMIT_MEMLOCK: it is split between them, not counted twice.
TEST(PosixManager, TwoManagersSplitRlimitMemlock) {
  TempMappedFile model(16 * MiB);
  ASSERT_TRUE(model.ok()) << model.error();
  model.touch_all();
  const auto r = run_in_child([&](std::string& report) {
    if (auto e = drop_cap_ipc_lock(); !e.empty()) {
      report = "cannot drop CAP_IPC_LOCK: " + e;
      return kChildSkip;
    }
    if (auto e = set_memlock_limit(8 * MiB); !e.empty()) {
      report = e;
      return 1;
    }
    auto backend = make_backend("posix");
    if (!backend) {
      report = backend.message();
      return 1;
    }
    Fixture f;
    auto a = f.make("180s", *backend);
    auto b = f.make("180s", *backend);
    if (!a || !b) {
      report = "Manager::create failed";
      return 1;
    }
    auto fail = [&](int code, const std::string& what) {
      report = what + "\n--- log ---\n" + f.all_logs();
      return code;
    };
    if ((*a)->wired_limit() > 8 * MiB || (*b)->wired_limit() > 8 * MiB) return fail(2, "budget above the limit");
    if (!(*a)->register_region(model.data(), 6 * MiB)) return fail(3, "register A");
    if (!(*b)->register_region(model.data() + 8 * MiB, 6 * MiB)) return fail(4, "register B");
    const Stats sa = (*a)->stats(), sb = (*b)->stats();
    if (sa.admitted_bytes + sb.admitted_bytes > 8 * MiB)
      return fail(5, "admitted together " + std::to_string(sa.admitted_bytes + sb.admitted_bytes) + " > 8 MiB");
    if (sa.wired_bytes != 6 * MiB || sb.wired_bytes != 0 || sb.pending_bytes != 6 * MiB)
      return fail(6, "A wired " + std::to_string(sa.wired_bytes) + ", B wired " + std::to_string(sb.wired_bytes));
    if (vm_lck() > 8 * MiB) return fail(7, "VmLck " + std::to_string(vm_lck()));
    if (sb.wire_failures != 0) return fail(8, "B asked the kernel for what the limit could not give");
    if (!f.logs.contains(LogLevel::warn, "already reserved")) return fail(9, "no warning naming the shared limit");
    // A gives its share back; B takes it at its next use.
    a->reset();
    (*b)->release_now();
    (*b)->touch();
    if ((*b)->stats().wired_bytes != 6 * MiB || vm_lck() != 6 * MiB)
      return fail(10, "B did not take the freed share: wired " + std::to_string((*b)->stats().wired_bytes));
    report = f.all_logs();
    return 0;
  });
  if (r.exit_code == kChildSkip) GTEST_SKIP() << r.report;
  EXPECT_EQ(r.signal, 0) << "child crashed\n" << r.report;
  EXPECT_EQ(r.exit_code, 0) << r.report;
}

// A child without CAP_IPC_LOCK and RLIMIT_MEMLOCK = 1 MiB: what users hit in Docker.
TEST(PosixManager, LowRlimitMemlockClampsTheBudgetAndWarnsInsteadOfFailing) {
  TempMappedFile model(64 * MiB);
  ASSERT_TRUE(model.ok()) << model.error();
  const auto r = run_in_child([&](std::string& report) {
    if (auto e = drop_cap_ipc_lock(); !e.empty()) {
      report = "cannot drop CAP_IPC_LOCK: " + e;
      return kChildSkip;
    }
    if (auto e = set_memlock_limit(1 * MiB); !e.empty()) {
      report = e;
      return 1;
    }
    Fixture f;
    auto m = f.make("180s");
    if (!m) {
      report = "Manager::create: " + m.message();
      return 1;
    }
    Manager& mgr = **m;
    auto fail = [&](int code, const std::string& what) {
      report = what + "\n--- log ---\n" + f.all_logs();
      return code;
    };
    // The budget is clamped to the limit, with a warning that says how to raise it.
    if (mgr.stats().wired_limit != 1 * MiB) return fail(2, "wired_limit = " + std::to_string(mgr.stats().wired_limit));
    if (!f.logs.contains(LogLevel::warn, "RLIMIT_MEMLOCK") || !f.logs.contains(LogLevel::warn, "ulimit -l") ||
        !f.logs.contains(LogLevel::warn, "--cap-add IPC_LOCK")) {
      return fail(3, "no warning naming RLIMIT_MEMLOCK and the fix");
    }
    // 64 MiB does not fit: tracked, not admitted, nothing locked, no crash.
    auto big = mgr.register_region(model.data(), 64 * MiB);
    if (!big) return fail(4, "register_region: " + big.message());
    Stats s = mgr.stats();
    if (s.tracked_bytes != 64 * MiB || s.pending_bytes != 64 * MiB || s.admitted_bytes != 0 || s.wired_bytes != 0) {
      return fail(5, "64 MiB over a 1 MiB budget: tracked " + std::to_string(s.tracked_bytes) + " pending " +
                         std::to_string(s.pending_bytes) + " admitted " + std::to_string(s.admitted_bytes));
    }
    if (vm_lck() != 0) return fail(6, "VmLck = " + std::to_string(vm_lck()));
    if (!mgr.unregister_region(*big)) return fail(7, "unregister_region");

    // Something else in the process already locks 768 KiB: a 512 KiB region fits the budget
    // but the kernel refuses it. The manager warns with the backend's message and keeps it
    // tracked but unwired.
    if (raw_mlock(model.data() + 32 * MiB, 768 * KiB) != 0) return fail(8, "mlock of 768 KiB failed");
    auto small = mgr.register_region(model.data(), 512 * KiB);
    if (!small) return fail(9, "register_region: " + small.message());
    s = mgr.stats();
    if (s.wire_failures != 1 || s.wired_bytes != 0 || s.pending_bytes != 512 * KiB) {
      return fail(10, "after a refused mlock: wire_failures " + std::to_string(s.wire_failures) + " wired " +
                          std::to_string(s.wired_bytes) + " pending " + std::to_string(s.pending_bytes));
    }
    if (!f.logs.contains(LogLevel::warn, "RLIMIT_MEMLOCK = 1048576") ||
        !f.logs.contains(LogLevel::warn, "stays tracked but not resident")) {
      return fail(11, "no warning with the backend's RLIMIT_MEMLOCK message");
    }
    // The process goes on: the region is still there and can be unregistered.
    if (!mgr.unregister_region(*small)) return fail(12, "unregister_region");
    report = f.all_logs();
    return 0;
  });
  if (r.exit_code == kChildSkip) GTEST_SKIP() << r.report;
  EXPECT_EQ(r.signal, 0) << "child crashed\n" << r.report;
  EXPECT_EQ(r.exit_code, 0) << r.report;
  std::printf("%s", r.report.c_str());
}

}  // namespace
}  // namespace residency
