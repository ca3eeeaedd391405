// SPDX-License-Identifier: MIT
// The first sleep of a weights allocation builds its pinned host backup while it copies
// (issue 11, item 3): the backup is exactly the allocation's size (rounded up to the host
// page, never to a power of two as PyTorch's pinned allocator does), the contents survive it
// and later cycles, the host memory comes back when the allocation is freed, and a failure to
// pin part-way rolls back (everything registered is unregistered, the memory unmapped), keeps
// the allocation resident and says so. The failure is injected through a copy of the driver
// whose cuMemHostRegister fails on its N-th call; every other call is the real driver's.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>

#include "cuda_test_support.hpp"

namespace residency::cuda::testing {
namespace {

// 9 chunks of 256 MiB, the last one 4099 bytes into a page: a tail that is neither a whole
// chunk nor a whole page, and a size whose power-of-two rounding (4 GiB) is far off.
constexpr std::size_t kSize = 2 * kGiB + 4099;
constexpr std::uint64_t kSlack = 192 * kMiB;  // other host allocations of the process, the driver's own

std::size_t page_rounded(std::size_t n) {
  const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return (n + page - 1) / page * page;
}

// The driver with cuMemHostRegister / cuMemHostUnregister counted, and the N-th register
// failing with CUDA_ERROR_OUT_OF_MEMORY (as the driver does when it cannot pin).
namespace injected {
const Driver* real = nullptr;
std::atomic<int> fail_at{0};  // 1-based call number; 0: never
std::atomic<int> calls{0};
std::atomic<int> registered{0};
std::atomic<int> unregistered{0};
CUresult CUDAAPI host_register(void* p, std::size_t bytes, unsigned int flags) {
  const int call = ++calls;
  if (call == fail_at.load()) return CUDA_ERROR_OUT_OF_MEMORY;
  const CUresult r = real->cuMemHostRegister(p, bytes, flags);
  if (r == CUDA_SUCCESS) ++registered;
  return r;
}
CUresult CUDAAPI host_unregister(void* p) {
  const CUresult r = real->cuMemHostUnregister(p);
  if (r == CUDA_SUCCESS) ++unregistered;
  return r;
}
}  // namespace injected

bool same_total(const std::optional<HostMemory>& a, const std::optional<HostMemory>& b) {
  return a && b && a->total == b->total;
}

TEST_F(CudaTest, FirstSleepBackupIsExactInSizeKeepsTheContentsAndIsFreedWithTheAllocation) {
  constexpr std::uint64_t kSeed = 111;
  const auto host0 = host_memory();
  void* p = allocate_filled(*backend_, kSize, RegionClass::weights, kSeed);
  ASSERT_NE(p, nullptr);
  resident_set(*backend_, 0, device_region(1, p, kSize, RegionClass::weights));
  EXPECT_EQ(backend_->host_backup(p), nullptr) << "no backup before the first sleep";

  const auto host_awake = host_memory();
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(backend_->end_residency(0)) << backend_->last_release_status().message();
  const double took = seconds_since(t0);
  std::printf("first sleep of %.2f GiB: %.3f s, %.2f GB/s with %d pinning threads\n", static_cast<double>(kSize) / kGiB,
              took, kSize / took / 1e9, backend_->backup_threads());
  ASSERT_FALSE(backend_->is_resident(p));
  ASSERT_NE(backend_->host_backup(p), nullptr);
  EXPECT_EQ(backend_->host_backup_bytes(p), page_rounded(kSize)) << "the backup must be the allocation's size";
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(backend_->host_backup(p)) % (2 * kMiB), 0u)
      << "2 MiB aligned, so that transparent huge pages can back it";
  const auto host_asleep = host_memory();
  if (same_total(host_awake, host_asleep)) {
    const double used = static_cast<double>(host_awake->available) - static_cast<double>(host_asleep->available);
    std::printf("host memory taken by the backup: %.1f MiB for %.1f MiB\n", used / kMiB, static_cast<double>(kSize) / kMiB);
    EXPECT_GE(used, 0.9 * kSize) << "the backup should hold host memory";
    EXPECT_LE(used, static_cast<double>(kSize + kSlack)) << "the backup holds more than the allocation's size";
  } else {
    std::printf("host memory check skipped: MemTotal changed during the test (a VM growing its memory)\n");
  }

  // Contents survive the first sleep, and the cycles after it (which reuse the backup).
  for (int cycle = 0; cycle < 3; ++cycle) {
    ASSERT_TRUE(backend_->request_residency(0).ok());
    ASSERT_EQ(mismatches(p, kSize, kSeed + cycle), 0u) << "cycle " << cycle;
    // The engine writes between cycles: the next sleep must copy the new contents.
    ASSERT_TRUE(kernels_->fill(dptr(p), kSize, kSeed + cycle + 1));
    sync();
    ASSERT_TRUE(backend_->end_residency(0)) << backend_->last_release_status().message();
    EXPECT_EQ(backend_->host_backup_bytes(p), page_rounded(kSize));
  }
  ASSERT_TRUE(backend_->request_residency(0).ok());
  EXPECT_EQ(mismatches(p, kSize, kSeed + 3), 0u);
  ASSERT_TRUE(backend_->end_residency(0));

  // Freed while asleep: the backup goes with the allocation.
  EXPECT_TRUE(backend_->destroy_set(0));
  backend_->deallocate(p);
  const auto host_after = host_memory();
  if (same_total(host0, host_after)) {
    EXPECT_GE(static_cast<double>(host_after->available), static_cast<double>(host0->available) - kSlack)
        << "the backup was not given back with the allocation";
  }
}

TEST_F(CudaTest, PinFailureMidwayRollsBackKeepsTheAllocationResidentAndReports) {
  constexpr std::uint64_t kSeed = 222;
  static Driver driver;  // must outlive the backend; the test owns it
  driver = d();
  injected::real = &d();
  driver.cuMemHostRegister = &injected::host_register;
  driver.cuMemHostUnregister = &injected::host_unregister;
  injected::calls = 0;
  injected::registered = 0;
  injected::unregistered = 0;
  injected::fail_at = 5;  // chunk registrations 1-4 (of 9) succeed, in whatever order threads get there

  auto made = CudaBackend::create({}, driver);
  ASSERT_TRUE(made) << made.message();
  CudaBackend& b = **made;
  b.set_backup_threads(4);
  const auto host0 = host_memory();
  void* p = allocate_filled(b, kSize, RegionClass::weights, kSeed);
  ASSERT_NE(p, nullptr);
  resident_set(b, 0, device_region(2, p, kSize, RegionClass::weights));

  const Status st = b.end_residency(0);
  ASSERT_FALSE(st) << "the injected failure must be reported";
  EXPECT_EQ(st.code(), ErrorCode::out_of_memory);
  EXPECT_NE(st.message().find("cuMemHostRegister"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("rolled back"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("stays resident"), std::string::npos) << st.message();
  EXPECT_FALSE(b.last_release_status());
  EXPECT_TRUE(b.is_resident(p)) << "nothing may be released before the backup is whole";
  EXPECT_EQ(b.host_backup(p), nullptr);
  EXPECT_EQ(b.host_backup_bytes(p), 0u);
  EXPECT_GE(injected::registered.load(), 1) << "the failure should come part-way";
  EXPECT_EQ(injected::unregistered.load(), injected::registered.load())
      << "every chunk registered before the failure must be unregistered";
  const auto host_failed = host_memory();
  if (same_total(host0, host_failed)) {
    EXPECT_GE(static_cast<double>(host_failed->available), static_cast<double>(host0->available) - kSlack)
        << "the partial backup's host memory was not given back";
  }
  EXPECT_EQ(mismatches(p, kSize, kSeed), 0u) << "the resident contents must be untouched";

  // The set stays requested (end_residency failed), so a later release can try again.
  injected::fail_at = 0;
  ASSERT_TRUE(b.end_residency(0)) << b.last_release_status().message();
  EXPECT_FALSE(b.is_resident(p));
  EXPECT_EQ(b.host_backup_bytes(p), page_rounded(kSize));
  ASSERT_TRUE(b.request_residency(0).ok());
  EXPECT_EQ(mismatches(p, kSize, kSeed), 0u);
  EXPECT_TRUE(b.destroy_set(0));
  b.deallocate(p);
  EXPECT_EQ(injected::unregistered.load(), injected::registered.load()) << "deallocate must unregister the backup";
}

TEST_F(CudaTest, PrepareBackupPinsWithoutCopyingAndTheFirstSleepCopiesLaterWrites) {
  void* p = allocate_filled(*backend_, kSize, RegionClass::weights, 31);
  ASSERT_NE(p, nullptr);
  void* kv = allocate_filled(*backend_, kGiB, RegionClass::kv_cache, 32);
  ASSERT_NE(kv, nullptr);
  resident_set(*backend_, 0, device_region(3, p, kSize, RegionClass::weights));
  ASSERT_TRUE(backend_->prepare_backup(p));
  EXPECT_TRUE(backend_->is_resident(p));
  EXPECT_NE(backend_->host_backup(p), nullptr);
  EXPECT_EQ(backend_->host_backup_bytes(p), page_rounded(kSize));
  ASSERT_TRUE(backend_->prepare_backup(p)) << "a second call is a no-op";
  ASSERT_TRUE(backend_->prepare_backup(kv));
  EXPECT_EQ(backend_->host_backup(kv), nullptr) << "kv_cache is discarded: no backup";
  EXPECT_FALSE(backend_->prepare_backup(reinterpret_cast<void*>(std::uintptr_t{0x1000})));

  // Written after the backup was made: the first sleep must copy what is there now.
  ASSERT_TRUE(kernels_->fill(dptr(p), kSize, 33));
  sync();
  ASSERT_TRUE(backend_->end_residency(0));
  ASSERT_TRUE(backend_->request_residency(0).ok());
  EXPECT_EQ(mismatches(p, kSize, 33), 0u);
  EXPECT_TRUE(backend_->destroy_set(0));
  backend_->deallocate(p);
  backend_->deallocate(kv);
}

// Backup::after_allocation: a background thread pins the backup right after allocate(), without
// blocking the backend; the first sleep then only copies, and the contents written after the
// pinning survive it. Freeing an allocation while its backup is pinned in the background leaves
// nothing behind (the host memory comes back).
TEST_F(CudaTest, BackgroundBackupIsPinnedAfterAllocationAndTheFirstSleepOnlyCopies) {
  CudaBackendOptions o;
  o.backup = CudaBackendOptions::Backup::after_allocation;
  auto made = CudaBackend::create(o);
  ASSERT_TRUE(made) << made.message();
  CudaBackend& b = *made.value();
  const auto host0 = host_memory();
  void* p = allocate_filled(b, kSize, RegionClass::weights, 41);
  ASSERT_NE(p, nullptr);
  void* kv = allocate_filled(b, kGiB, RegionClass::kv_cache, 42);
  ASSERT_NE(kv, nullptr);
  ASSERT_TRUE(b.wait_background_backups(60'000)) << "the background pinning did not finish in 60 s";
  EXPECT_EQ(b.background_backups(), 1u);
  EXPECT_EQ(b.background_backup_failures(), 0u);
  EXPECT_NE(b.host_backup(p), nullptr) << "pinned before any sleep";
  EXPECT_EQ(b.host_backup_bytes(p), page_rounded(kSize));
  EXPECT_EQ(b.host_backup(kv), nullptr) << "kv_cache sleeps without a backup";

  ASSERT_TRUE(kernels_->fill(dptr(p), kSize, 43));  // written after the pinning
  sync();
  resident_set(b, 0, device_region(5, p, kSize, RegionClass::weights));
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(b.end_residency(0));
  const double first = seconds_since(t0);
  std::printf("first sleep of %.2f GiB with a background backup: %.3f s (%.1f GB/s)\n",
              static_cast<double>(kSize) / kGiB, first, static_cast<double>(kSize) / first / 1e9);
  EXPECT_FALSE(b.is_resident(p));
  ASSERT_TRUE(b.request_residency(0).ok());
  EXPECT_EQ(mismatches(p, kSize, 43), 0u);
  EXPECT_TRUE(b.destroy_set(0));
  b.deallocate(p);
  b.deallocate(kv);

  // Freed while the background thread may still be pinning it: nothing stays pinned.
  void* q = allocate_filled(b, kSize, RegionClass::weights, 44);
  ASSERT_NE(q, nullptr);
  b.deallocate(q);
  ASSERT_TRUE(b.wait_background_backups(60'000));
  const auto host1 = host_memory();
  if (host0 && host1) {
    EXPECT_LT(host0->available - std::min(host0->available, host1->available), kSlack);
  }
}

}  // namespace
}  // namespace residency::cuda::testing
