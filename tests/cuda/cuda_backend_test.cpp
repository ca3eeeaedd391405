// SPDX-License-Identifier: MIT
// The cuda backend against a real device: contents survive sleep/wake, kernels in flight
// finish before a release, a wake that meets out-of-memory loses nothing, teardown frees
// everything, discarded classes cost no copy, host ranges are wired and unwired. Without a
// driver or a device every GPU test skips with the reason; the driver-loading tests run
// everywhere.
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "cuda_test_support.hpp"
#include "residency/backends.hpp"
#include "residency/backends/cuda.hpp"

namespace residency::cuda::testing {
namespace {

// --- no GPU needed ----------------------------------------------------------------------

TEST(CudaDriverLoad, MissingLibraryIsAClearError) {
  auto d = Driver::load("libresidency-no-such-driver.so.1");
  ASSERT_FALSE(d);
  EXPECT_EQ(d.status().code(), ErrorCode::unsupported);
  EXPECT_NE(d.message().find("libresidency-no-such-driver.so.1 not found"), std::string::npos) << d.message();
  EXPECT_NE(d.message().find("no NVIDIA driver"), std::string::npos) << d.message();
  EXPECT_NE(d.message().find("posix"), std::string::npos) << "the message should name the alternative";
}

TEST(CudaDriverLoad, AutoPicksCudaOnlyWhereADeviceWorks) {
  auto cuda = make_backend("cuda");
  auto any = make_backend("auto");
  if (cuda) {
    ASSERT_TRUE(any) << any.message();
    EXPECT_EQ((*any)->capabilities().name, "cuda");
  } else {
    EXPECT_EQ(cuda.message().rfind("cuda: ", 0), 0u) << cuda.message();
    if (any) {
      EXPECT_NE((*any)->capabilities().name, "cuda");
    } else {
      EXPECT_NE(any.message().find("cuda: "), std::string::npos) << any.message();
    }
  }
}

TEST(CudaDriverLoad, BadOptionsAreRejectedWithTheAcceptedRange) {
  CudaBackendOptions o;
  o.streams = 0;
  auto b = make_cuda_backend(o);
  ASSERT_FALSE(b);
  if (b.status().code() == ErrorCode::unsupported) GTEST_SKIP() << "no driver: " << b.message();
  EXPECT_EQ(b.status().code(), ErrorCode::invalid_argument);
  EXPECT_NE(b.message().find("1 to 16"), std::string::npos) << b.message();
}

// --- on a GPU ---------------------------------------------------------------------------

TEST_F(CudaTest, CapabilitiesAndMemoryInfoFollowAllocations) {
  const Capabilities c = backend_->capabilities();
  EXPECT_EQ(c.name, "cuda");
  EXPECT_FALSE(c.needs_refresh);

  const MemoryInfo before = backend_->memory_info();
  EXPECT_GT(before.physical, 0u);
  EXPECT_EQ(before.recommended_working_set, before.physical);
  const std::uint64_t allocated0 = backend_->allocated_bytes(), resident0 = backend_->resident_bytes();
  const std::uint64_t free0 = device_free();
  EXPECT_LE(free0, before.physical);

  auto p = backend_->allocate(kGiB + 1, RegionClass::weights);
  ASSERT_TRUE(p) << p.message();
  EXPECT_GE(backend_->allocated_bytes() - allocated0, kGiB + 1);
  EXPECT_GE(backend_->resident_bytes() - resident0, kGiB + 1);
  EXPECT_GE(free0 - device_free(), kGiB) << "the allocation must be backed at once";
  backend_->deallocate(*p);
  EXPECT_EQ(backend_->allocated_bytes(), allocated0);
}

TEST_F(CudaTest, ZeroByteAllocationIsRejected) {
  auto p = backend_->allocate(0, RegionClass::weights);
  ASSERT_FALSE(p);
  EXPECT_EQ(p.status().code(), ErrorCode::invalid_argument);
}

// Issue 5, item 3: 200 cycles of an odd-sized 4 GiB weights allocation keep every byte, at
// the same address, and each sleep really gives the device memory back.
TEST_F(CudaTest, WeightsSurvive200SleepWakeCyclesAtTheSameAddress) {
  constexpr std::size_t kSize = 4 * kGiB + 4099;  // odd: the last copy ends mid-word
  constexpr std::uint64_t kSeed = 200;
  void* p = allocate_filled(*backend_, kSize, RegionClass::weights, kSeed);
  ASSERT_NE(p, nullptr);
  resident_set(*backend_, 0, device_region(1, p, kSize, RegionClass::weights));

  for (int cycle = 0; cycle < 200; ++cycle) {
    const std::uint64_t free_awake = device_free();
    EXPECT_TRUE(backend_->end_residency(0));
    ASSERT_TRUE(backend_->last_release_status()) << backend_->last_release_status().message();
    ASSERT_FALSE(backend_->is_resident(p));
    if (cycle == 0 || cycle == 199) {
      // The driver's own bookkeeping moves free memory by a few MiB either way.
      EXPECT_GE(device_free() - free_awake, 4 * kGiB - 64 * kMiB) << "sleep must release the physical memory";
    }
    auto out = backend_->request_residency(0);
    ASSERT_TRUE(out.ok()) << "cycle " << cycle << ": " << out.status.message();
    ASSERT_TRUE(backend_->is_resident(p));
    ASSERT_EQ(mismatches(p, kSize, kSeed), 0u) << "cycle " << cycle;
  }
  EXPECT_TRUE(backend_->destroy_set(0));
  backend_->deallocate(p);
}

// With a trace, each wake says where its time went and where its bytes came from; the copies it
// times are complete when it says so (the contents are there).
class CudaTraceTest : public CudaTest {
 protected:
  void SetUp() override {
    CudaBackendOptions o;
    o.trace = [this](const std::string& line) { lines_.push_back(line); };
    auto made = CudaBackend::create(o);
    if (!made) GTEST_SKIP() << "no usable CUDA device, skipping: " << made.message();
    backend_ = std::move(made.value());
    auto k = PatternKernels::load(backend_->driver(), backend_->context());
    ASSERT_TRUE(k) << k.message();
    kernels_.emplace(std::move(k.value()));
  }
  std::vector<std::string> lines_;
};

TEST_F(CudaTraceTest, EachWakeOfWeightsSaysItsPhasesAndItsBytes) {
  constexpr std::size_t kSize = 256 * kMiB + 12;
  void* p = allocate_filled(*backend_, kSize, RegionClass::weights, 7);
  ASSERT_NE(p, nullptr);
  resident_set(*backend_, 0, device_region(1, p, kSize, RegionClass::weights));
  lines_.clear();  // the allocation's own wake had nothing to copy
  ASSERT_TRUE(backend_->end_residency(0));
  ASSERT_EQ(lines_.size(), 1u);
  EXPECT_NE(lines_[0].find("sleep of 256.00 MiB weights"), std::string::npos) << lines_[0];
  EXPECT_NE(lines_[0].find("256.00 MiB copied to the host"), std::string::npos) << lines_[0];
  EXPECT_NE(lines_[0].find("on the device"), std::string::npos) << lines_[0];
  ASSERT_TRUE(backend_->request_residency(0).ok());
  ASSERT_EQ(lines_.size(), 2u);
  EXPECT_NE(lines_[1].find("wake of 256.00 MiB weights"), std::string::npos) << lines_[1];
  EXPECT_NE(lines_[1].find("copies done"), std::string::npos) << lines_[1];
  EXPECT_NE(lines_[1].find("256.00 MiB from pinned host memory"), std::string::npos) << lines_[1];
  EXPECT_EQ(mismatches(p, kSize, 7), 0u);
  EXPECT_TRUE(backend_->destroy_set(0));
  backend_->deallocate(p);
}

// A kernel still running when sleep is asked finishes, and what it wrote is what wakes up.
TEST_F(CudaTest, KernelInFlightWhenSleepIsAskedFinishesFirst) {
  constexpr std::size_t kSize = kGiB;
  void* p = allocate_filled(*backend_, kSize, RegionClass::weights, 1);
  ASSERT_NE(p, nullptr);
  resident_set(*backend_, 0, device_region(1, p, kSize, RegionClass::weights));

  CUstream s = nullptr;
  {
    ContextScope scope(d(), backend_->context());
    ASSERT_EQ(d().cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
  }
  constexpr std::uint64_t kWaitNs = 500'000'000;  // long enough that sleep surely starts first
  ASSERT_TRUE(kernels_->wait_then_fill(dptr(p), kSize, 2, kWaitNs, s));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(backend_->end_residency(0));
  const double took = seconds_since(t0);
  ASSERT_TRUE(backend_->last_release_status()) << backend_->last_release_status().message();
  EXPECT_GE(took, 0.4) << "sleep returned before the kernel could have finished";

  ASSERT_TRUE(backend_->request_residency(0).ok());
  EXPECT_EQ(mismatches(p, kSize, 2), 0u) << "the kernel's writes were lost or cut short";
  {
    ContextScope scope(d(), backend_->context());
    EXPECT_EQ(d().cuStreamDestroy(s), CUDA_SUCCESS);
  }
  EXPECT_TRUE(backend_->destroy_set(0));
  backend_->deallocate(p);
}

// A wake the device cannot hold fails at once, before it maps or copies anything; a paced wake
// that meets out-of-memory returns a clear error, rolls back its partial mapping, keeps the
// backup; once the memory is free a later wake succeeds with every byte intact.
TEST_F(CudaTest, WakeOutOfMemoryRollsBackKeepsTheBackupAndSucceedsLater) {
  constexpr std::size_t kSize = 8 * kGiB;
  constexpr std::uint64_t kSeed = 8;
  void* p = allocate_filled(*backend_, kSize, RegionClass::weights, kSeed);
  ASSERT_NE(p, nullptr);
  resident_set(*backend_, 0, device_region(7, p, kSize, RegionClass::weights));
  EXPECT_TRUE(backend_->end_residency(0));
  ASSERT_TRUE(backend_->last_release_status());

  // Another allocation takes all but 3 GiB: the wake maps some chunks, then fails.
  CUdeviceptr hog = 0;
  {
    ContextScope scope(d(), backend_->context());
    std::uint64_t want = device_free() - 3 * kGiB;
    while (d().cuMemAlloc(&hog, want) != CUDA_SUCCESS) {
      ASSERT_GT(want, 8 * kGiB) << "could not take the device memory for the test";
      want -= 256 * kMiB;
    }
  }
  const std::uint64_t free_before = device_free();
  const std::uint64_t wired_before = backend_->resident_bytes();
  const std::uint64_t copied_before = backend_->bytes_copied_to_device();
  // Not paced, the wake sees the device cannot hold it and fails before it maps or copies.
  auto fast = backend_->request_residency(0);
  EXPECT_EQ(fast.status.code(), ErrorCode::out_of_memory);
  EXPECT_NE(fast.status.message().find("nothing was mapped"), std::string::npos) << fast.status.message();
  EXPECT_NE(fast.status.message().find("host backup is kept"), std::string::npos) << fast.status.message();
  EXPECT_EQ(backend_->bytes_copied_to_device(), copied_before) << "nothing was copied";
  EXPECT_FALSE(backend_->is_resident(p));
  // Paced (as under a shared budget, where the others give way while it maps), it maps chunk by
  // chunk until the device runs out, and rolls back.
  int pieces = 0;
  backend_->set_wake_gate([&pieces](std::uint64_t) { ++pieces; });
  auto out = backend_->request_residency(0);
  backend_->set_wake_gate(nullptr);
  EXPECT_GT(pieces, 1);
  EXPECT_FALSE(out.ok());
  EXPECT_EQ(out.status.code(), ErrorCode::out_of_memory);
  ASSERT_EQ(out.failed.size(), 1u);
  EXPECT_EQ(out.failed[0], 7u);
  const std::string& msg = out.status.message();
  EXPECT_NE(msg.find("out of device memory"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rolled back"), std::string::npos) << msg;
  EXPECT_NE(msg.find("host backup is kept"), std::string::npos) << msg;
  EXPECT_NE(msg.find("request residency again"), std::string::npos) << msg;
  EXPECT_FALSE(backend_->is_resident(p));
  EXPECT_EQ(backend_->resident_bytes(), wired_before);
  EXPECT_GE(device_free() + 64 * kMiB, free_before) << "the partial mapping was not given back";
  EXPECT_NE(backend_->host_backup(p), nullptr);

  {
    ContextScope scope(d(), backend_->context());
    ASSERT_EQ(d().cuMemFree(hog), CUDA_SUCCESS);
  }
  out = backend_->request_residency(0);
  ASSERT_TRUE(out.ok()) << out.status.message();
  EXPECT_EQ(mismatches(p, kSize, kSeed), 0u);
  EXPECT_TRUE(backend_->destroy_set(0));
  backend_->deallocate(p);
}

// Destroying the backend while its memory sleeps frees the address ranges, the physical
// memory and the pinned backups.
TEST_F(CudaTest, DestroyWhileAsleepFreesDeviceAndPinnedHostMemory) {
  constexpr std::size_t kWeights = 4 * kGiB;
  const std::uint64_t free_before = device_free();
  const auto host_before = host_memory();
  {
    auto made = CudaBackend::create({});
    ASSERT_TRUE(made) << made.message();
    CudaBackend& b = **made;
    void* w = allocate_filled(b, kWeights, RegionClass::weights, 3);
    void* kv = allocate_filled(b, kGiB, RegionClass::kv_cache, 4);
    ASSERT_TRUE(w && kv);
    ASSERT_TRUE(b.create_set(0, kWeights + kGiB));
    b.add_region(0, device_region(1, w, kWeights, RegionClass::weights));
    b.add_region(0, device_region(2, kv, kGiB, RegionClass::kv_cache));
    ASSERT_TRUE(b.commit(0).ok());
    ASSERT_TRUE(b.request_residency(0).ok());
    EXPECT_TRUE(b.end_residency(0));
    ASSERT_TRUE(b.last_release_status());
    ASSERT_FALSE(b.is_resident(w));
    ASSERT_FALSE(b.is_resident(kv));
    const auto host_asleep = host_memory();
    if (host_before && host_asleep && host_before->total == host_asleep->total) {
      EXPECT_GE(static_cast<double>(host_before->available) - static_cast<double>(host_asleep->available), 0.75 * kWeights)
          << "the backup should hold pinned host memory";
    }
  }  // the backend goes here, asleep
  EXPECT_GE(device_free() + 64 * kMiB, free_before) << "device memory leaked";
  const auto host_after = host_memory();
  if (host_before && host_after && host_before->total == host_after->total) {
    EXPECT_GE(static_cast<double>(host_after->available), static_cast<double>(host_before->available) - 0.25 * kWeights)
        << "the pinned backup was not freed";
  } else {
    std::printf("host memory check skipped: MemTotal changed during the test (a VM growing its memory)\n");
  }
}

// kv_cache and scratch are dropped without a copy: no backup, and a sleep costs a fraction
// of what the same size of weights costs.
TEST_F(CudaTest, DiscardedClassesSleepWithoutACopy) {
  constexpr std::size_t kSize = 4 * kGiB;
  void* w = allocate_filled(*backend_, kSize, RegionClass::weights, 5);
  void* s = allocate_filled(*backend_, kSize, RegionClass::scratch, 6);
  void* kv = allocate_filled(*backend_, kSize, RegionClass::kv_cache, 7);
  ASSERT_TRUE(w && s && kv);
  resident_set(*backend_, 0, device_region(1, w, kSize, RegionClass::weights));
  resident_set(*backend_, 1, device_region(2, s, kSize, RegionClass::scratch));
  resident_set(*backend_, 2, device_region(3, kv, kSize, RegionClass::kv_cache));
  // Warm: the first weights sleep also pins the backup.
  EXPECT_TRUE(backend_->end_residency(0));
  ASSERT_TRUE(backend_->request_residency(0).ok());

  auto time_sleep = [&](SetId set) {
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_TRUE(backend_->end_residency(set));
    return seconds_since(t0);
  };
  const double weights_s = time_sleep(0);
  const double scratch_s = time_sleep(1);
  const double kv_s = time_sleep(2);
  std::printf("sleep of 4 GiB: weights %.1f ms, scratch %.1f ms, kv_cache %.1f ms\n", weights_s * 1e3, scratch_s * 1e3,
              kv_s * 1e3);
  EXPECT_LT(scratch_s, weights_s / 5);
  EXPECT_LT(kv_s, weights_s / 5);
  EXPECT_EQ(backend_->host_backup(s), nullptr);
  EXPECT_EQ(backend_->host_backup(kv), nullptr);

  // Woken discarded memory is usable at the same address.
  ASSERT_TRUE(backend_->request_residency(1).ok());
  ASSERT_TRUE(kernels_->fill(dptr(s), kSize, 9));
  EXPECT_EQ(mismatches(s, kSize, 9), 0u);
  ASSERT_TRUE(backend_->request_residency(0).ok());
  EXPECT_EQ(mismatches(w, kSize, 5), 0u);
  for (SetId set : {0u, 1u, 2u}) EXPECT_TRUE(backend_->destroy_set(set));
  for (void* p : {w, s, kv}) backend_->deallocate(p);
}

// An allocation whose writes the engine reports (track_writes / written) keeps its host backup
// across wakes: a sleep copies only the chunks written since the last one, none for weights left
// alone, and what wakes is what was there. An unreported write is lost at the next sleep: proof
// that the copy was skipped (the contract: every write must be reported).
TEST_F(CudaTest, TrackedAllocationSleepsCopyOnlyWhatWasWritten) {
  constexpr std::size_t kSize = 4 * kGiB + 4099;
  void* p = allocate_filled(*backend_, kSize, RegionClass::weights, 31);
  ASSERT_NE(p, nullptr);
  backend_->track_writes(p);
  resident_set(*backend_, 0, device_region(1, p, kSize, RegionClass::weights));
  const std::size_t chunk = backend_->chunk_bytes();
  ASSERT_GT(kSize, 4 * chunk) << "the test needs several copy chunks";

  auto sleep_copies = [&] {
    const std::uint64_t before = backend_->bytes_copied_to_host();
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_TRUE(backend_->end_residency(0));
    EXPECT_TRUE(backend_->last_release_status()) << backend_->last_release_status().message();
    const double s = seconds_since(t0);
    EXPECT_FALSE(backend_->is_resident(p));
    std::printf("sleep of %.1f GiB: copied %.1f MiB in %.1f ms\n", double(kSize) / kGiB,
                double(backend_->bytes_copied_to_host() - before) / kMiB, s * 1e3);
    return backend_->bytes_copied_to_host() - before;
  };
  auto wake = [&] {
    auto out = backend_->request_residency(0);
    ASSERT_TRUE(out.ok()) << out.status.message();
  };

  // The first sleep makes the backup: everything.
  EXPECT_EQ(sleep_copies(), kSize);
  wake();
  EXPECT_EQ(mismatches(p, kSize, 31), 0u);
  // Nothing written since: nothing copied, and the contents wake intact.
  EXPECT_EQ(sleep_copies(), 0u);
  wake();
  EXPECT_EQ(mismatches(p, kSize, 31), 0u);

  // A reported write across the border of chunks 1 and 2: those two chunks, and only them.
  const std::size_t at = 2 * chunk - 4096;
  const std::size_t len = 8192;
  backend_->written(static_cast<char*>(p) + at, len);
  ASSERT_TRUE(kernels_->fill(dptr(p) + at, len, 32));
  sync();
  EXPECT_EQ(sleep_copies(), 2 * chunk);
  wake();
  EXPECT_EQ(mismatches(static_cast<char*>(p) + at, len, 32), 0u) << "the reported write must survive";
  EXPECT_EQ(mismatches(p, at, 31), 0u) << "what was not written must wake as it was";

  // An unreported write: the backup still holds what was there, and that is what wakes.
  ASSERT_TRUE(kernels_->fill(dptr(p) + 3 * chunk, len, 33));
  sync();
  EXPECT_EQ(sleep_copies(), 0u);
  wake();
  EXPECT_NE(mismatches(static_cast<char*>(p) + 3 * chunk, len, 33), 0u) << "the sleep should not have copied";

  // An untracked allocation copies everything at every sleep.
  void* q = allocate_filled(*backend_, 64 * kMiB, RegionClass::weights, 34);
  ASSERT_NE(q, nullptr);
  resident_set(*backend_, 1, device_region(2, q, 64 * kMiB, RegionClass::weights));
  for (int i = 0; i < 2; ++i) {
    const std::uint64_t before = backend_->bytes_copied_to_host();
    EXPECT_TRUE(backend_->end_residency(1));
    EXPECT_EQ(backend_->bytes_copied_to_host() - before, 64 * kMiB);
    ASSERT_TRUE(backend_->request_residency(1).ok());
    EXPECT_EQ(mismatches(q, 64 * kMiB, 34), 0u);
  }
  for (SetId set : {0u, 1u}) EXPECT_TRUE(backend_->destroy_set(set));
  backend_->deallocate(p);
  backend_->deallocate(q);
}

// Host memory the GPU reads (mmap'd weights) is wired with cuMemHostRegister while its set
// is resident and unregistered when the residency ends.
TEST_F(CudaTest, HostRangeIsRegisteredWhileResidentAndUnregisteredAfter) {
  constexpr std::size_t kSize = 256 * kMiB;
  void* host = mmap(nullptr, kSize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(host, MAP_FAILED);
  auto* words = static_cast<std::uint64_t*>(host);
  for (std::size_t i = 0; i < kSize / 8; ++i) words[i] = mix(11 + i);

  RegionDesc r;
  r.id = 21;
  r.base = host;
  r.size = kSize;
  r.backend_allocated = false;
  const std::uint64_t wired0 = backend_->resident_bytes();
  resident_set(*backend_, 0, r);
  EXPECT_EQ(backend_->resident_bytes() - wired0, kSize);

  int direct = 0;
  ASSERT_EQ(d().cuDeviceGetAttribute(&direct, CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
                                     backend_->device()),
            CUDA_SUCCESS);
  if (direct != 0) {
    EXPECT_EQ(mismatches(host, kSize, 11), 0u) << "the GPU should read the registered host range";
  }
  {
    // Registered by us: registering it again is refused by the driver.
    ContextScope scope(d(), backend_->context());
    EXPECT_EQ(d().cuMemHostRegister(host, kSize, 0), CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
  }
  EXPECT_TRUE(backend_->end_residency(0));
  EXPECT_TRUE(backend_->last_release_status()) << backend_->last_release_status().message();
  EXPECT_EQ(backend_->resident_bytes(), wired0);
  {
    // Unregistered: the driver accepts it again.
    ContextScope scope(d(), backend_->context());
    EXPECT_EQ(d().cuMemHostRegister(host, kSize, 0), CUDA_SUCCESS);
    EXPECT_EQ(d().cuMemHostUnregister(host), CUDA_SUCCESS);
  }
  EXPECT_TRUE(backend_->destroy_set(0));
  munmap(host, kSize);
}

// A read-only file mapping (how engines map model files) is registered read-only.
TEST_F(CudaTest, ReadOnlyFileMappingIsRegistered) {
  int ro_ok = 0;
  ASSERT_EQ(d().cuDeviceGetAttribute(&ro_ok, CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED, backend_->device()),
            CUDA_SUCCESS);
  constexpr std::size_t kSize = 64 * kMiB;
  char path[] = "/tmp/residency_cuda_ro_XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  unlink(path);
  {
    std::vector<std::uint64_t> buf(kSize / 8);
    for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = mix(12 + i);
    ASSERT_EQ(write(fd, buf.data(), kSize), static_cast<ssize_t>(kSize));
  }
  void* host = mmap(nullptr, kSize, PROT_READ, MAP_SHARED, fd, 0);
  ASSERT_NE(host, MAP_FAILED);
  RegionDesc r;
  r.id = 22;
  r.base = host;
  r.size = kSize;
  ASSERT_TRUE(backend_->create_set(0, kSize));
  backend_->add_region(0, r);
  ASSERT_TRUE(backend_->commit(0).ok());
  auto out = backend_->request_residency(0);
  if (ro_ok != 0) {
    ASSERT_TRUE(out.ok()) << out.status.message();
    EXPECT_EQ(mismatches(host, kSize, 12), 0u);
  } else {
    EXPECT_FALSE(out.ok());
    EXPECT_NE(out.status.message().find("cuMemHostRegister"), std::string::npos) << out.status.message();
  }
  EXPECT_TRUE(backend_->end_residency(0));
  EXPECT_TRUE(backend_->destroy_set(0));
  munmap(host, kSize);
  close(fd);
}

// Membership changes of a resident set take effect at commit, and a region wanted by two
// resident sets stays resident until both end.
TEST_F(CudaTest, CommitWakesAddedAndReleasesRemovedRegions) {
  constexpr std::size_t kSize = 512 * kMiB;
  void* p = allocate_filled(*backend_, kSize, RegionClass::weights, 13);
  ASSERT_NE(p, nullptr);
  const RegionDesc r = device_region(31, p, kSize, RegionClass::weights);
  resident_set(*backend_, 0, r);
  ASSERT_TRUE(backend_->create_set(1, kSize));
  ASSERT_TRUE(backend_->request_residency(1).ok());  // empty, resident

  backend_->add_region(1, r);
  ASSERT_TRUE(backend_->commit(1).ok());
  EXPECT_TRUE(backend_->end_residency(0));
  EXPECT_TRUE(backend_->is_resident(p)) << "set 1 still wants it";

  backend_->remove_region(1, r.id);
  EXPECT_TRUE(backend_->is_resident(p)) << "staged only: effective at commit";
  ASSERT_TRUE(backend_->commit(1).ok());
  EXPECT_FALSE(backend_->is_resident(p)) << "no resident set holds it any more";

  backend_->add_region(1, r);
  ASSERT_TRUE(backend_->commit(1).ok());
  EXPECT_TRUE(backend_->is_resident(p));
  EXPECT_EQ(mismatches(p, kSize, 13), 0u);
  EXPECT_TRUE(backend_->destroy_set(0));
  EXPECT_TRUE(backend_->destroy_set(1));
  EXPECT_FALSE(backend_->is_resident(p)) << "destroying a resident set releases what it held";
  backend_->deallocate(p);
}

TEST_F(CudaTest, RegionNotAllocatedByTheBackendIsReportedNotWired) {
  RegionDesc r = device_region(41, reinterpret_cast<void*>(std::uintptr_t{0x1000}), 4096, RegionClass::weights);
  ASSERT_TRUE(backend_->create_set(0, 4096));
  backend_->add_region(0, r);
  ASSERT_TRUE(backend_->commit(0).ok());
  auto out = backend_->request_residency(0);
  EXPECT_FALSE(out.ok());
  ASSERT_EQ(out.failed.size(), 1u);
  EXPECT_EQ(out.failed[0], 41u);
  EXPECT_EQ(out.status.code(), ErrorCode::not_found);
  EXPECT_TRUE(backend_->destroy_set(0));
}

}  // namespace
}  // namespace residency::cuda::testing
