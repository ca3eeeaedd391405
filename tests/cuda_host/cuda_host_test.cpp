// SPDX-License-Identifier: MIT
// The cuda backend's own code, run on a machine without a GPU: CudaBackend::create(options, driver)
// over HostGpu (tests/support/host_gpu.hpp), one device emulated in host memory. What each test
// asserts is what a GPU would show: the device range mapped or not, the device memory given back
// (cuMemGetInfo), the bytes a wake restores, the copies it makes (none pageable from a model file),
// the host memory registered, and what the backend says. tests/cuda runs the same backend on a GPU.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "backends/cuda/cuda_backend.hpp"
#include "core/host_tier.hpp"
#include "ledger/ledger.hpp"
#include "support/host_gpu.hpp"

namespace residency::cuda::testing {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kSmallChunk = 8 * kMiB;  // tests of one allocation's chunks: several of them in 40 MiB

CUdeviceptr dptr(const void* p) { return static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p)); }
std::size_t round_up(std::size_t v, std::size_t unit) { return (v + unit - 1) / unit * unit; }

// The pattern the GPU tests' kernels write (tests/cuda/cuda_test_support.hpp).
std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A model file laid out as GGUF lays out tensors (32-byte aligned) and a device buffer as ggml lays
// them out (128-byte aligned, so gaps between tensors), as in tests/cuda/cuda_file_backing_test.cpp.
struct Layout {
  struct Tensor {
    std::size_t dev_off, file_off, len;
  };
  std::vector<Tensor> tensors;
  std::size_t device_bytes = 0;
  std::size_t file_bytes = 0;
  std::size_t gap_bytes = 0;  // device bytes no tensor fills
};

Layout lay_out(const std::vector<std::size_t>& sizes) {
  Layout l;
  std::size_t d = 0, f = 4096, filled = 0;  // a header first
  for (std::size_t len : sizes) {
    l.tensors.push_back({d, f, len});
    filled += len;
    d = (d + len + 127) / 128 * 128;
    f = (f + len + 31) / 32 * 32;
  }
  l.device_bytes = d + 100;  // and a tail nothing fills
  l.file_bytes = f;
  l.gap_bytes = l.device_bytes - filled;
  return l;
}

// Seven tensors of about 85 MiB: a model file of about 595 MiB, three registration pieces
// (kRegisterPiece), with tensors across both piece borders. Fewer: the same file's first tensors.
Layout model_layout(std::size_t count = 7) {
  std::vector<std::size_t> sizes;
  for (std::size_t i = 0; sizes.size() < count; ++i) sizes.push_back(85 * kMiB + 4099 * i + 33);
  return lay_out(sizes);
}
constexpr std::uint64_t kFileSeed = 7;

class HostGpuTest : public ::testing::Test {
 protected:
  // The model file, written by the first test of the process that loads it (new page cache costs
  // more than anything else here on a small VM; ctest runs each test in a process of its own) and
  // never changed: each test opens and maps it afresh.
  static void write_model_file() {
    if (!path_.empty()) return;
    dir_ = std::filesystem::temp_directory_path() / ("residency-host-gpu-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
    const std::string path = (dir_ / "model.gguf").string();
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ASSERT_GE(fd, 0);
    const std::size_t bytes = model_layout().file_bytes;
    std::vector<std::uint64_t> block(kSmallChunk / 8);
    for (std::size_t at = 0; at < bytes; at += kSmallChunk) {
      for (std::size_t i = 0; i < block.size(); ++i) block[i] = mix(kFileSeed + at / 8 + i);
      const std::size_t n = std::min(bytes - at, kSmallChunk);
      ASSERT_EQ(::pwrite(fd, block.data(), n, static_cast<off_t>(at)), static_cast<ssize_t>(n));
    }
    ::close(fd);
    path_ = path;
  }
  static void TearDownTestSuite() {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  void SetUp() override { gpu().reset(); }
  void TearDown() override {
    backend_.reset();
    EXPECT_EQ(gpu().live(), "") << "the backend must give back everything it made";
    close_file();
  }

  static HostGpu& gpu() { return HostGpu::instance(); }
  static const Driver& d() { return gpu().driver(); }

  static CudaBackendOptions small_chunks() {
    CudaBackendOptions o;
    o.chunk_bytes = kSmallChunk;
    return o;
  }
  // A backend over HostGpu that says its notices into said().
  CudaBackend& make(CudaBackendOptions o = {}) {
    o.notice = [this](const std::string& line) {
      std::lock_guard<std::mutex> lock(said_mu_);
      said_.push_back(line);
    };
    auto made = CudaBackend::create(o, d());
    if (!made) throw std::runtime_error("CudaBackend::create over HostGpu failed: " + made.message());
    backend_ = *made;
    return *backend_;
  }
  std::vector<std::string> said() {
    std::lock_guard<std::mutex> lock(said_mu_);
    return said_;
  }

  // Device memory written and read with the driver's copies, as an engine's would be; large ranges
  // go through one reused buffer (fresh host memory costs more than the copies on a small VM).
  void put(void* p, const void* src, std::size_t n) {
    ContextScope scope(d(), backend_->context());
    ASSERT_EQ(d().cuMemcpyHtoD(dptr(p), src, n), CUDA_SUCCESS);
  }
  std::vector<char> read(const void* p, std::size_t n) {
    std::vector<char> out(n);
    ContextScope scope(d(), backend_->context());
    EXPECT_EQ(d().cuMemcpyDtoH(out.data(), dptr(p), n), CUDA_SUCCESS);
    return out;
  }
  void fill(void* p, std::size_t n, std::uint64_t seed) {
    buffer_.resize(kSmallChunk / 8);
    for (std::size_t at = 0; at < n; at += kSmallChunk) {
      for (std::size_t i = 0; i < buffer_.size(); ++i) buffer_[i] = mix(seed + at / 8 + i);
      put(static_cast<char*>(p) + at, buffer_.data(), std::min(kSmallChunk, n - at));
    }
  }
  // Whether the device holds exactly `expected` at `p`.
  bool holds(const void* p, const std::vector<char>& expected) {
    buffer_.resize(kSmallChunk / 8);
    ContextScope scope(d(), backend_->context());
    for (std::size_t at = 0; at < expected.size(); at += kSmallChunk) {
      const std::size_t n = std::min(kSmallChunk, expected.size() - at);
      if (d().cuMemcpyDtoH(buffer_.data(), dptr(p) + at, n) != CUDA_SUCCESS) return false;
      if (std::memcmp(buffer_.data(), expected.data() + at, n) != 0) return false;
    }
    return true;
  }
  void* allocate_filled(std::size_t n, RegionClass cls, std::uint64_t seed) {
    auto p = backend_->allocate(n, cls);
    EXPECT_TRUE(p) << p.message();
    if (!p) return nullptr;
    fill(*p, n, seed);
    return *p;
  }

  static RegionDesc device_region(RegionId id, void* p, std::size_t size, RegionClass cls) {
    RegionDesc r;
    r.id = id;
    r.base = p;
    r.size = size;
    r.cls = cls;
    r.backend_allocated = true;
    return r;
  }
  // One set holding `regions`, with residency requested.
  void resident_set(SetId set, const std::vector<RegionDesc>& regions) {
    ASSERT_TRUE(backend_->create_set(set, 0));
    for (const RegionDesc& r : regions) backend_->add_region(set, r);
    ASSERT_TRUE(backend_->commit(set).ok());
    auto out = backend_->request_residency(set);
    ASSERT_TRUE(out.ok()) << out.status.message();
  }

  // The model file, opened and mapped read-only (map_) as an engine maps its model.
  void open_file() {
    write_model_file();
    if (HasFatalFailure()) return;
    fd_ = ::open(path_.c_str(), O_RDONLY);
    ASSERT_GE(fd_, 0);
    file_bytes_ = model_layout().file_bytes;
    map_ = static_cast<char*>(::mmap(nullptr, file_bytes_, PROT_READ, MAP_SHARED, fd_, 0));
    ASSERT_NE(map_, MAP_FAILED);
  }
  // The engine lets go of its mapping and descriptor after load (llama.cpp does); the backend keeps its own.
  void close_file() {
    if (map_ != nullptr) ::munmap(map_, file_bytes_);
    if (fd_ >= 0) ::close(fd_);
    map_ = nullptr;
    fd_ = -1;
  }

  // A tracked weights allocation in set 0 laid out as `l` and filled from the model file, as
  // llama.cpp's loader fills it (each tensor said, then copied from the mapping); the gaps keep the
  // pattern of `seed`. Returns the allocation; `before` gets what the device holds.
  void* load(const Layout& l, std::uint64_t seed, std::vector<char>& before) {
    open_file();
    if (HasFatalFailure()) return nullptr;
    void* p = allocate_filled(l.device_bytes, RegionClass::weights, seed);
    if (p == nullptr) return nullptr;
    backend_->track_writes(p);
    resident_set(0, {device_region(1, p, l.device_bytes, RegionClass::weights)});
    for (const auto& t : l.tensors) {
      backend_->filled_from_file(static_cast<char*>(p) + t.dev_off, t.len, fd_, t.file_off);
      put(static_cast<char*>(p) + t.dev_off, map_ + t.file_off, t.len);
    }
    before = read(p, l.device_bytes);
    for (const auto& t : l.tensors) EXPECT_EQ(std::memcmp(before.data() + t.dev_off, map_ + t.file_off, t.len), 0);
    close_file();
    return p;
  }

  std::shared_ptr<CudaBackend> backend_;
  std::vector<std::uint64_t> buffer_;
  std::mutex said_mu_;
  std::vector<std::string> said_;
  static inline std::filesystem::path dir_;
  static inline std::string path_;
  int fd_ = -1;
  char* map_ = nullptr;
  std::size_t file_bytes_ = 0;
};

std::uint64_t file_pages(const Layout& l) { return round_up(l.file_bytes, static_cast<std::size_t>(::getpagesize())); }

// The backend starts where there is no libcuda and no NVML: the fake's device, its UUID, its size;
// what the process holds besides the allocations is unknown, said once.
TEST_F(HostGpuTest, TheBackendStartsWithoutLibcudaOrNvml) {
  CudaBackend& b = make();
  EXPECT_EQ(b.capabilities().device_uuid, "GPU-f4ce0000-0000-4000-8000-000000000001");
  EXPECT_EQ(b.capabilities().wire_granularity, HostGpu::Config{}.granularity);
  EXPECT_EQ(b.memory_info().physical, HostGpu::Config{}.capacity);
  EXPECT_EQ(b.unmanaged_device_bytes(), 0u);
  EXPECT_EQ(b.unmanaged_device_bytes(), 0u);
  ASSERT_EQ(said().size(), 1u);
  EXPECT_NE(said()[0].find("is unknown"), std::string::npos) << said()[0];
}

// 1. A sleep unmaps the range and gives the device memory back; a wake maps it again and restores
// exactly the same bytes. A KV cache in the same set is dropped without a copy.
TEST_F(HostGpuTest, SleepGivesTheMemoryBackAndWakeRestoresTheSameBytes) {
  CudaBackend& b = make(small_chunks());
  const std::size_t size = 40 * kMiB + 12345, kv_size = 6 * kMiB;  // the weights: not whole granules
  const std::size_t reserved = round_up(size, b.granularity());
  void* p = allocate_filled(size, RegionClass::weights, 1);
  void* kv = allocate_filled(kv_size, RegionClass::kv_cache, 2);
  ASSERT_NE(p, nullptr);
  ASSERT_NE(kv, nullptr);
  resident_set(0, {device_region(1, p, size, RegionClass::weights), device_region(2, kv, kv_size, RegionClass::kv_cache)});
  const std::vector<char> before = read(p, size);
  EXPECT_EQ(gpu().mapped_bytes(dptr(p), reserved), reserved);
  EXPECT_EQ(gpu().used(), reserved + kv_size);

  ASSERT_TRUE(b.end_residency(0)) << b.last_release_status().message();
  EXPECT_FALSE(b.is_resident(p));
  EXPECT_FALSE(b.is_resident(kv));
  EXPECT_EQ(gpu().mapped_bytes(dptr(p), reserved), 0u) << "a use of the range would fault";
  EXPECT_EQ(gpu().mapped_bytes(dptr(kv), kv_size), 0u);
  {
    ContextScope scope(d(), b.context());
    std::size_t free_b = 0, total_b = 0;
    ASSERT_EQ(d().cuMemGetInfo(&free_b, &total_b), CUDA_SUCCESS);
    EXPECT_EQ(free_b, total_b) << "the device memory must be given back";
    char byte = 0;
    EXPECT_EQ(d().cuMemcpyDtoH(&byte, dptr(p), 1), CUDA_ERROR_INVALID_VALUE) << "an unmapped range is not copied from";
  }
  EXPECT_EQ(b.bytes_copied_to_host(), size) << "the weights are copied, the KV cache is not";
  EXPECT_NE(b.host_backup(p), nullptr);

  const HostGpu::Counters c0 = gpu().counters();
  ASSERT_TRUE(b.request_residency(0).ok());
  const HostGpu::Counters c1 = gpu().counters();
  EXPECT_TRUE(b.is_resident(p));
  EXPECT_EQ(gpu().mapped_bytes(dptr(p), reserved), reserved);
  EXPECT_EQ(c1.bytes_to_device - c0.bytes_to_device, size);
  EXPECT_EQ(c1.copies_to_device - c0.copies_to_device, (size + kSmallChunk - 1) / kSmallChunk) << "one copy a chunk";
  EXPECT_EQ(c1.pageable_copies - c0.pageable_copies, 0u) << "the backup is registered chunk by chunk";
  EXPECT_TRUE(holds(p, before)) << "the device must hold exactly what it held before the sleep";
  EXPECT_EQ(b.bytes_copied_to_device(), size);

  EXPECT_TRUE(b.destroy_set(0));
  b.deallocate(p);
  b.deallocate(kv);
  EXPECT_EQ(gpu().used(), 0u);
  EXPECT_EQ(gpu().registrations(), 0u) << "the backup is unregistered with its allocation";
}

// track_writes / written: a tracked allocation's sleep copies only the chunks written since the last one.
TEST_F(HostGpuTest, ATrackedAllocationCopiesOnlyWhatWasWritten) {
  CudaBackend& b = make(small_chunks());
  const std::size_t size = 40 * kMiB;
  void* p = allocate_filled(size, RegionClass::weights, 3);
  ASSERT_NE(p, nullptr);
  b.track_writes(p);
  resident_set(0, {device_region(1, p, size, RegionClass::weights)});
  ASSERT_TRUE(b.end_residency(0));
  EXPECT_EQ(b.bytes_copied_to_host(), size) << "the first sleep copies everything";
  ASSERT_TRUE(b.request_residency(0).ok());
  ASSERT_TRUE(b.end_residency(0));
  EXPECT_EQ(b.bytes_copied_to_host(), size) << "nothing written: nothing copied";
  ASSERT_TRUE(b.request_residency(0).ok());
  char* at = static_cast<char*>(p) + 2 * kSmallChunk + 100;
  const std::vector<char> word(4096, 'w');
  b.written(at, word.size());
  put(at, word.data(), word.size());
  const std::vector<char> written = read(p, size);
  ASSERT_TRUE(b.end_residency(0));
  EXPECT_EQ(b.bytes_copied_to_host(), size + kSmallChunk) << "only the written chunk";
  ASSERT_TRUE(b.request_residency(0).ok());
  EXPECT_TRUE(holds(p, written));
  EXPECT_TRUE(b.destroy_set(0));
  b.deallocate(p);
}

// 2. Weights filled from a model file sleep in it: the first sleep copies only the gaps and
// registers the file (in pieces), and the wake copies from it without one pageable copy and
// restores exactly. A reported write survives.
TEST_F(HostGpuTest, WeightsFilledFromTheirFileSleepInItAndWakeWithoutPageableCopies) {
  CudaBackend& b = make();
  const Layout l = model_layout();
  ASSERT_GT(l.file_bytes, 2 * kRegisterPiece);
  std::vector<char> before;
  void* p = load(l, 8, before);
  ASSERT_NE(p, nullptr);
  std::uint64_t filled = 0;
  for (const auto& t : l.tensors) filled += t.len;

  const HostGpu::Counters c0 = gpu().counters();
  ASSERT_TRUE(b.end_residency(0)) << b.last_release_status().message();
  const HostGpu::Counters c1 = gpu().counters();
  EXPECT_EQ(b.bytes_copied_to_host(), l.gap_bytes) << "the file's bytes must not be copied";
  EXPECT_EQ(b.registered_file_bytes(), file_pages(l));
  EXPECT_EQ(gpu().read_only_registrations(), (file_pages(l) + kRegisterPiece - 1) / kRegisterPiece);
  EXPECT_EQ(b.file_backed_bytes(), filled);
  EXPECT_LT(b.pinned_host_bytes(), kMiB) << "no pinned copy of the file's bytes, only of the gaps";
  EXPECT_EQ(c1.pageable_copies - c0.pageable_copies, 0u);
  EXPECT_EQ(gpu().used(), 0u);
  EXPECT_TRUE(said().empty());

  auto wake_exactly = [&](const std::vector<char>& expected, const char* what) {
    const HostGpu::Counters w0 = gpu().counters();
    ASSERT_TRUE(b.request_residency(0).ok());
    const HostGpu::Counters w1 = gpu().counters();
    EXPECT_EQ(w1.pageable_copies - w0.pageable_copies, 0u) << what << ": a wake from the model file is never staged";
    EXPECT_EQ(w1.bytes_to_device - w0.bytes_to_device, l.device_bytes) << what;
    EXPECT_TRUE(holds(p, expected)) << what << ": the device must hold exactly what it held";
  };
  wake_exactly(before, "the first wake");

  ASSERT_TRUE(b.end_residency(0));
  EXPECT_EQ(b.bytes_copied_to_host(), l.gap_bytes) << "nothing written since: nothing copied";
  wake_exactly(before, "the second wake");

  // A reported write into a file tensor: its bytes are no longer the file's, and survive.
  char* t3 = static_cast<char*>(p) + l.tensors[3].dev_off;
  const std::vector<char> word(4096, 'w');
  b.written(t3 + 128, word.size());
  put(t3 + 128, word.data(), word.size());
  std::memcpy(before.data() + l.tensors[3].dev_off + 128, word.data(), word.size());
  ASSERT_TRUE(b.end_residency(0));
  const std::uint64_t third = b.bytes_copied_to_host() - l.gap_bytes;
  EXPECT_GE(third, word.size());
  EXPECT_LE(third, word.size() + l.gap_bytes) << "the write and its chunk's gaps";
  wake_exactly(before, "the wake after a write");

  EXPECT_TRUE(b.destroy_set(0));
  b.deallocate(p);
  EXPECT_EQ(b.registered_file_bytes(), 0u) << "the file is given back with the last allocation filled from it";
  EXPECT_EQ(gpu().registrations(), 0u);
}

// The host tier below "asleep": the model file's registration given back (its pages may be
// evicted), the weights asleep in it wake through the staging ring, reading the file, exactly; no
// copy comes from unregistered memory, the registration is not taken again by the wake, and the
// next sleep registers the file again.
TEST_F(HostGpuTest, WeightsWhoseFileRegistrationWasGivenBackWakeThroughTheStagingRing) {
  CudaBackend& b = make();
  const Layout l = model_layout();
  std::vector<char> before;
  void* p = load(l, 9, before);
  ASSERT_NE(p, nullptr);
  std::uint64_t filled = 0;
  for (const auto& t : l.tensors) filled += t.len;
  ASSERT_TRUE(b.end_residency(0)) << b.last_release_status().message();
  EXPECT_EQ(b.unregister_files(), file_pages(l));
  EXPECT_EQ(b.registered_file_bytes(), 0u);
  EXPECT_EQ(gpu().read_only_registrations(), 0u) << "the driver holds none of the file";
  const HostGpu::Counters w0 = gpu().counters();
  ASSERT_TRUE(b.request_residency(0).ok());
  const HostGpu::Counters w1 = gpu().counters();
  EXPECT_TRUE(holds(p, before)) << "the device must hold exactly what it held";
  EXPECT_EQ(b.staged_bytes(), filled) << "every byte of the file's came through the ring";
  EXPECT_EQ(w1.pageable_copies - w0.pageable_copies, 0u) << "the ring's buffers are registered";
  EXPECT_EQ(w1.bytes_to_device - w0.bytes_to_device, l.device_bytes);
  EXPECT_EQ(b.registered_file_bytes(), 0u) << "a wake does not register the file again";
  ASSERT_TRUE(b.end_residency(0));
  EXPECT_EQ(b.registered_file_bytes(), file_pages(l)) << "the next sleep does";
  ASSERT_TRUE(b.request_residency(0).ok());
  EXPECT_EQ(b.staged_bytes(), filled) << "woken from the registered file this time";
  EXPECT_TRUE(holds(p, before));
  EXPECT_TRUE(b.destroy_set(0));
  b.deallocate(p);
  EXPECT_EQ(gpu().registrations(), 1u) << "the file went with its allocation; the ring stays for the backend's "
                                          "life (TearDown checks that it goes with the backend)";
}

// The host tier's budget, shared with another holder (a ledger slot of this test, as another
// server's model would be) and exactly one model file large. The other holds it all: the sleep
// does not register the file (nothing waits on the sleep's path), and the background thread asks
// the other holder, which gives way, and registers the file; the wake then copies from it. The
// other asks back: the registration is given back (the host tier's listener does what the
// manager's does), and, the other no longer giving way, the next sleep stays unregistered and its
// wake comes through the ring, exactly. The driver never holds more of the file than the budget.
TEST_F(HostGpuTest, TheHostBudgetBoundsTheRegisteredModelFilesAndTheHolderAskedGivesWay) {
  CudaBackend& b = make();
  const Layout l = model_layout();
  std::vector<char> before;
  void* p = load(l, 14, before);
  ASSERT_NE(p, nullptr);
  std::uint64_t filled = 0;
  for (const auto& t : l.tensors) filled += t.len;
  const std::uint64_t budget = file_pages(l);

  const std::string name = "host-tier-test-" + std::to_string(::getpid());
  Config c;
  WiredLimit size;
  size.bytes = budget;
  c.host_budget.budget = SharedBudget{name, size, ""};
  std::mutex lines_mu;
  std::vector<std::string> lines;
  const core::LogSink log(
      [&](LogLevel, std::string_view m) {
        std::lock_guard<std::mutex> lock(lines_mu);
        lines.emplace_back(m);
      },
      LogLevel::debug);
  std::shared_ptr<core::HostTier> tier = core::HostTier::join(c, SteadyClock::instance(), log);
  ASSERT_NE(tier, nullptr);
  EXPECT_EQ(tier->budget(), budget);
  auto other = ledger::Ledger::attach({name, budget, "", 0});
  ASSERT_TRUE(other) << other.message();
  ASSERT_EQ((*other)->acquire(budget, 0, std::chrono::nanoseconds(0), false), budget);
  std::atomic<bool> give_way{true};
  std::atomic<int> other_asked{0};
  ledger::Ledger& o = **other;
  o.listen([&](int) {
    other_asked.fetch_add(1);
    if (give_way.load()) o.release(o.held());
  });
  b.set_host_gate(tier->gate());
  tier->listen([&](int) {
    b.drop_file_registrations();
    tier->give_back_spare();
  });
  auto within_budget = [&] { return tier->held() + o.held() <= budget && b.registered_file_bytes() <= budget; };

  ASSERT_TRUE(b.end_residency(0)) << b.last_release_status().message();
  EXPECT_EQ(b.registered_file_bytes(), 0u) << "no room: the sleep does not register the file";
  EXPECT_EQ(b.bytes_copied_to_host(), l.gap_bytes) << "and still keeps the file's bytes in the file";
  EXPECT_EQ(tier->refusals(), 1u);
  ASSERT_TRUE(b.wait_host_room(20000));
  EXPECT_EQ(other_asked.load(), 1) << "the background thread asked the other holder";
  EXPECT_EQ(b.host_room_granted(), 1u);
  EXPECT_EQ(b.registered_file_bytes(), budget) << "and registered the file in the room it gave";
  EXPECT_EQ(tier->held(), budget);
  EXPECT_EQ(tier->registered(), budget);
  EXPECT_EQ(o.held(), 0u);
  EXPECT_TRUE(within_budget());
  ASSERT_TRUE(b.request_residency(0).ok());
  EXPECT_EQ(b.staged_bytes(), 0u) << "woken from the registered file";
  EXPECT_TRUE(holds(p, before));

  // The other needs its room back: the registration goes (awake, it costs nothing until a wake).
  give_way = false;
  EXPECT_EQ(o.acquire(budget, 0, ledger::kAskWait, false, ledger::kNoMinimumIdle), budget);
  EXPECT_EQ(b.registered_file_bytes(), 0u);
  EXPECT_EQ(gpu().read_only_registrations(), 0u) << "the driver holds none of the file";
  EXPECT_EQ(tier->held(), 0u);
  EXPECT_TRUE(within_budget());
  ASSERT_TRUE(b.end_residency(0));
  EXPECT_EQ(b.registered_file_bytes(), 0u);
  ASSERT_TRUE(b.wait_host_room(20000));
  EXPECT_EQ(other_asked.load(), 2) << "asked again; it does not give way this time";
  EXPECT_EQ(b.registered_file_bytes(), 0u);
  EXPECT_TRUE(within_budget());
  const HostGpu::Counters w0 = gpu().counters();
  ASSERT_TRUE(b.request_residency(0).ok());
  const HostGpu::Counters w1 = gpu().counters();
  EXPECT_EQ(b.staged_bytes(), filled) << "the wake read the file through the staging ring";
  EXPECT_EQ(w1.pageable_copies - w0.pageable_copies, 0u);
  EXPECT_TRUE(holds(p, before)) << "exactly what the device held";
  {
    std::lock_guard<std::mutex> lock(lines_mu);
    bool said = false;
    for (const std::string& m : lines) said = said || m.find("host tier 2") != std::string::npos;
    EXPECT_TRUE(said) << "the refusal after asking is said";
  }

  tier->stop_listening();
  o.stop_listening();
  b.set_host_gate({});
  EXPECT_TRUE(b.destroy_set(0));
  b.deallocate(p);
}

// 3. The first release, prepared in the background: a `stop` that says yes after two polls leaves
// part of the file registered; one that never does registers the rest and pins the KV cache's
// backup; then nothing is left to prepare, and the first sleep copies only gaps and the KV cache.
TEST_F(HostGpuTest, TheFirstReleasePreparedAheadCanStopPartWayAndLeavesTheSleepOnlyCopies) {
  CudaBackend& b = make();
  b.set_backup_threads(1);  // one registration piece a step
  const Layout l = model_layout();
  std::vector<char> before;
  void* p = load(l, 11, before);
  ASSERT_NE(p, nullptr);
  const std::size_t kv_size = 24 * kMiB;  // untracked weights-class memory: a KV cache
  void* kv = allocate_filled(kv_size, RegionClass::weights, 12);
  ASSERT_NE(kv, nullptr);
  resident_set(1, {device_region(2, kv, kv_size, RegionClass::weights)});
  const std::vector<char> kv_before = read(kv, kv_size);
  EXPECT_EQ(b.registered_file_bytes(), 0u) << "nothing is registered before a release or a preparation";

  std::atomic<int> polls{0};
  ASSERT_EQ(b.prepare_release([&polls] { return polls.fetch_add(1) >= 2; }), Backend::Preparation::started);
  ASSERT_TRUE(b.wait_preparation(60000));
  EXPECT_EQ(b.registered_file_bytes(), 2 * kRegisterPiece) << "two steps of one piece, then stopped";
  EXPECT_EQ(gpu().read_only_registrations(), 2u);

  ASSERT_EQ(b.prepare_release([] { return false; }), Backend::Preparation::started);
  ASSERT_TRUE(b.wait_preparation(60000));
  ASSERT_TRUE(b.wait_background_backups(60000));
  EXPECT_EQ(b.registered_file_bytes(), file_pages(l));
  EXPECT_EQ(gpu().read_only_registrations(), 3u);
  EXPECT_NE(b.host_backup(kv), nullptr) << "the KV cache's backup is pinned ahead";
  EXPECT_EQ(b.prepare_release([] { return false; }), Backend::Preparation::nothing);
  EXPECT_EQ(b.preparation_runs(), 2u);
  EXPECT_EQ(b.bytes_copied_to_host(), 0u) << "a preparation copies nothing";

  const HostGpu::Counters c0 = gpu().counters();
  ASSERT_TRUE(b.end_residency(0)) << b.last_release_status().message();
  ASSERT_TRUE(b.end_residency(1)) << b.last_release_status().message();
  const HostGpu::Counters c1 = gpu().counters();
  EXPECT_EQ(c1.read_only_registrations - c0.read_only_registrations, 0u) << "the file was registered ahead";
  EXPECT_EQ(b.bytes_copied_to_host(), l.gap_bytes + kv_size) << "only the gaps and the KV cache";
  EXPECT_EQ(gpu().used(), 0u);

  const HostGpu::Counters w0 = gpu().counters();
  ASSERT_TRUE(b.request_residency(0).ok());
  ASSERT_TRUE(b.request_residency(1).ok());
  EXPECT_EQ(gpu().counters().pageable_copies - w0.pageable_copies, 0u);
  EXPECT_TRUE(holds(p, before));
  EXPECT_TRUE(holds(kv, kv_before));
  EXPECT_TRUE(b.destroy_set(0));
  EXPECT_TRUE(b.destroy_set(1));
  b.deallocate(p);
  b.deallocate(kv);
}

// 4. The driver refuses the file's second registration piece: the first is given back, the weights
// sleep in the pinned backup instead, the backend says so once, and the contents are exact.
TEST_F(HostGpuTest, AFileRegistrationRefusedFallsBackToThePinnedBackupAndIsSaidOnce) {
  CudaBackend& b = make();
  HostGpu::RegisterFault fault;
  fault.flags = CU_MEMHOSTREGISTER_READ_ONLY;
  fault.nth = 2;
  fault.result = CUDA_ERROR_NOT_PERMITTED;
  gpu().fail_host_register(fault);
  const Layout l = model_layout(2);  // the file's first two tensors: it is registered whole all the same
  std::vector<char> before;
  void* p = load(l, 13, before);
  ASSERT_NE(p, nullptr);

  ASSERT_TRUE(b.end_residency(0)) << b.last_release_status().message();
  EXPECT_EQ(gpu().counters().failed_registrations, 1u);
  EXPECT_EQ(gpu().read_only_registrations(), 0u) << "the piece registered before the refusal is given back";
  EXPECT_EQ(b.registered_file_bytes(), 0u);
  EXPECT_EQ(b.file_backed_bytes(), 0u);
  EXPECT_EQ(b.bytes_copied_to_host(), l.device_bytes) << "everything goes to the pinned backup";
  EXPECT_GE(b.pinned_host_bytes(), l.device_bytes);
  ASSERT_EQ(said().size(), 1u);
  EXPECT_NE(said()[0].find("cannot register " + path_ + " read-only"), std::string::npos) << said()[0];
  EXPECT_NE(said()[0].find("CUDA_ERROR_NOT_PERMITTED"), std::string::npos) << said()[0];
  EXPECT_NE(said()[0].find("pinned host memory instead"), std::string::npos) << said()[0];

  for (int cycle = 0; cycle < 2; ++cycle) {
    const HostGpu::Counters c0 = gpu().counters();
    ASSERT_TRUE(b.request_residency(0).ok());
    EXPECT_EQ(gpu().counters().pageable_copies - c0.pageable_copies, 0u);
    EXPECT_TRUE(holds(p, before));
    if (cycle == 0) {
      ASSERT_TRUE(b.end_residency(0));
    }
  }
  EXPECT_EQ(said().size(), 1u) << "said once";
  EXPECT_TRUE(b.destroy_set(0));
  b.deallocate(p);
}

// A pinned backup that cannot be registered part-way: the sleep fails, what it registered is given
// back, the allocation stays resident with its contents; the next sleep succeeds.
TEST_F(HostGpuTest, APinningFailurePartWayRollsBackAndKeepsTheAllocationResident) {
  CudaBackend& b = make(small_chunks());
  HostGpu::RegisterFault fault;
  fault.nth = 3;
  fault.result = CUDA_ERROR_OUT_OF_MEMORY;
  gpu().fail_host_register(fault);
  const std::size_t size = 40 * kMiB;
  void* p = allocate_filled(size, RegionClass::weights, 5);
  ASSERT_NE(p, nullptr);
  resident_set(0, {device_region(1, p, size, RegionClass::weights)});
  const std::vector<char> before = read(p, size);

  const Status st = b.end_residency(0);
  EXPECT_EQ(st.code(), ErrorCode::out_of_memory) << st.message();
  EXPECT_NE(st.message().find("rolled back"), std::string::npos) << st.message();
  EXPECT_TRUE(b.is_resident(p));
  EXPECT_EQ(gpu().mapped_bytes(dptr(p), size), size);
  EXPECT_EQ(gpu().registrations(), 0u) << "the chunks registered before the failure are given back";
  EXPECT_EQ(b.host_backup(p), nullptr);
  EXPECT_TRUE(holds(p, before));

  ASSERT_TRUE(b.end_residency(0)) << b.last_release_status().message();
  ASSERT_TRUE(b.request_residency(0).ok());
  EXPECT_TRUE(holds(p, before));
  EXPECT_TRUE(b.destroy_set(0));
  b.deallocate(p);
}

// 5. A device too full for a wake: without a gate the wake fails before it maps anything, keeps the
// backup, and succeeds once memory is freed.
TEST_F(HostGpuTest, AWakeThatDoesNotFitFailsBeforeMappingAndSucceedsOnceMemoryIsFree) {
  HostGpu::Config small;
  small.capacity = 64 * kMiB;
  gpu().reset(small);
  CudaBackend& b = make(small_chunks());
  const std::size_t size = 40 * kMiB;
  void* p = allocate_filled(size, RegionClass::weights, 21);
  ASSERT_NE(p, nullptr);
  resident_set(0, {device_region(1, p, size, RegionClass::weights)});
  const std::vector<char> before = read(p, size);
  ASSERT_TRUE(b.end_residency(0));
  auto other = b.allocate(size, RegionClass::scratch);  // someone else takes the memory meanwhile
  ASSERT_TRUE(other) << other.message();

  const HostGpu::Counters c0 = gpu().counters();
  const SetOutcome out = b.request_residency(0);
  const HostGpu::Counters c1 = gpu().counters();
  EXPECT_FALSE(out.ok());
  EXPECT_EQ(out.status.code(), ErrorCode::out_of_memory) << out.status.message();
  EXPECT_NE(out.status.message().find("nothing was mapped and the host backup is kept"), std::string::npos)
      << out.status.message();
  EXPECT_EQ(c1.mem_creates - c0.mem_creates, 0u) << "no physical memory asked for";
  EXPECT_EQ(c1.maps - c0.maps, 0u);
  EXPECT_FALSE(b.is_resident(p));
  EXPECT_EQ(gpu().mapped_bytes(dptr(p), size), 0u);
  EXPECT_NE(b.host_backup(p), nullptr);
  EXPECT_EQ(gpu().used(), size);

  b.deallocate(*other);
  ASSERT_TRUE(b.request_residency(0).ok());
  EXPECT_TRUE(holds(p, before));
  EXPECT_TRUE(b.destroy_set(0));
  b.deallocate(p);
}

// With a wake gate (a paced wake), the gate is asked before each chunk and the wake maps what fits:
// on a full device it fails part-way, rolls back what it mapped and keeps the backup.
TEST_F(HostGpuTest, AGatedWakeOnAFullDeviceRollsBackWhatItMapped) {
  HostGpu::Config small;
  small.capacity = 64 * kMiB;
  gpu().reset(small);
  CudaBackend& b = make(small_chunks());
  std::uint64_t asked = 0, calls = 0;
  b.set_wake_gate([&](std::uint64_t bytes) { asked += bytes, ++calls; });
  const std::size_t size = 40 * kMiB;
  void* p = allocate_filled(size, RegionClass::weights, 31);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(calls, size / kSmallChunk) << "an allocation's wake passes the gate too";
  resident_set(0, {device_region(1, p, size, RegionClass::weights)});
  const std::vector<char> before = read(p, size);
  ASSERT_TRUE(b.end_residency(0));
  auto other = b.allocate(size, RegionClass::scratch);
  ASSERT_TRUE(other) << other.message();

  asked = calls = 0;
  const SetOutcome out = b.request_residency(0);
  EXPECT_EQ(out.status.code(), ErrorCode::out_of_memory) << out.status.message();
  EXPECT_NE(out.status.message().find("rolled back and the host backup is kept"), std::string::npos)
      << out.status.message();
  EXPECT_EQ(calls, 4u) << "three chunks fit in the 24 MiB left, the fourth does not";
  EXPECT_EQ(gpu().mapped_bytes(dptr(p), size), 0u);
  EXPECT_EQ(gpu().used(), size) << "only the other allocation";
  EXPECT_NE(b.host_backup(p), nullptr);

  b.deallocate(*other);
  asked = calls = 0;
  ASSERT_TRUE(b.request_residency(0).ok());
  EXPECT_EQ(asked, size);
  EXPECT_TRUE(holds(p, before));
  EXPECT_TRUE(b.destroy_set(0));
  b.deallocate(p);
}

// interrupt_release(): a call that begins during a release stops it before anything is given back,
// both after a first sleep's pinning and within a later sleep's copies; nothing is lost.
TEST_F(HostGpuTest, ACallThatBeginsDuringAReleaseStopsIt) {
  CudaBackend& b = make(small_chunks());
  const std::size_t size = 40 * kMiB;
  void* p = allocate_filled(size, RegionClass::weights, 41);
  ASSERT_NE(p, nullptr);
  resident_set(0, {device_region(1, p, size, RegionClass::weights)});
  const std::vector<char> before = read(p, size);
  gpu().on_copy([&b](bool to_device, std::size_t) {
    if (!to_device) b.interrupt_release();  // the engine's next call begins as the backup is made
  });
  for (int sleep = 0; sleep < 2; ++sleep) {
    const std::uint64_t copied = b.bytes_copied_to_host();
    EXPECT_EQ(b.end_residency(0).code(), ErrorCode::interrupted);
    EXPECT_TRUE(b.is_resident(p));
    EXPECT_EQ(gpu().mapped_bytes(dptr(p), size), size);
    // The first sleep pins and copies the backup whole, then stops before unmapping; a later one
    // stops within its copies, a piece per stream.
    if (sleep == 1) {
      EXPECT_LT(b.bytes_copied_to_host() - copied, size);
    }
  }
  gpu().on_copy(nullptr);
  EXPECT_TRUE(holds(p, before));
  ASSERT_TRUE(b.end_residency(0)) << b.last_release_status().message();
  ASSERT_TRUE(b.request_residency(0).ok());
  EXPECT_TRUE(holds(p, before));
  EXPECT_TRUE(b.destroy_set(0));
  b.deallocate(p);
}

// The driver itself: what the backend relies on it to refuse.
TEST_F(HostGpuTest, TheDriverRefusesWhatARealOneRefuses) {
  CudaBackend& b = make();
  ContextScope scope(d(), b.context());
  std::vector<char> host(5 * kMiB);
  ASSERT_EQ(d().cuMemHostRegister(host.data(), kMiB, 0), CUDA_SUCCESS);
  EXPECT_EQ(d().cuMemHostRegister(host.data() + kMiB / 2, kMiB, 0), CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
  EXPECT_EQ(d().cuMemHostUnregister(host.data() + 4096), CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
  EXPECT_TRUE(gpu().registered(host.data() + 100, 1000));
  EXPECT_FALSE(gpu().registered(host.data() + kMiB - 10, 20));
  EXPECT_EQ(d().cuMemHostUnregister(host.data()), CUDA_SUCCESS);
  // A read-only mapping can be registered only read-only.
  void* ro = ::mmap(nullptr, kMiB, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(ro, MAP_FAILED);
  EXPECT_EQ(d().cuMemHostRegister(ro, kMiB, 0), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(d().cuMemHostRegister(ro, kMiB, CU_MEMHOSTREGISTER_READ_ONLY), CUDA_SUCCESS);
  EXPECT_EQ(d().cuMemHostUnregister(ro), CUDA_SUCCESS);
  ::munmap(ro, kMiB);
  // Device memory past the capacity, and kernels, are refused.
  CUdeviceptr va = 0;
  EXPECT_EQ(d().cuMemAlloc(&va, HostGpu::Config{}.capacity + 1), CUDA_ERROR_OUT_OF_MEMORY);
  CUmodule m = nullptr;
  EXPECT_EQ(d().cuModuleLoadData(&m, host.data()), CUDA_ERROR_NOT_SUPPORTED);
  // Copies outside mapped device memory are errors, not crashes.
  ASSERT_EQ(d().cuMemAlloc(&va, 3 * kMiB), CUDA_SUCCESS);
  EXPECT_EQ(d().cuMemcpyHtoD(va, host.data(), 4 * kMiB + 1), CUDA_ERROR_INVALID_VALUE) << "past the mapping";
  EXPECT_EQ(d().cuMemcpyHtoD(va, host.data(), 4 * kMiB), CUDA_SUCCESS) << "3 MiB rounded up to the granularity";
  EXPECT_EQ(d().cuMemsetD8(va + 4 * kMiB, 0, 1), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(d().cuMemFree(va), CUDA_SUCCESS);
  EXPECT_EQ(d().cuMemcpyDtoH(host.data(), va, 1), CUDA_ERROR_INVALID_VALUE) << "freed";
}

}  // namespace
}  // namespace residency::cuda::testing
