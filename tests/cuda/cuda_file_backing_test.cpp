// SPDX-License-Identifier: MIT
// A model file as the backup of the weights it filled
// (docs/design.md, "Weights backed by their file"): a tracked allocation whose ranges were filled
// from a model file keeps no pinned copy of them. Its sleep copies only what is not the file's
// (alignment gaps, a tensor written from elsewhere), its wake copies the rest from the file, mapped
// read-only and registered, and the device holds exactly what it held before. A file that changed
// since load, or that the driver will not register read-only, falls back to the pinned backup, and
// the backend says which. What is checked is what the GPU and the host hold: the device's bytes
// after a wake, the bytes copied, the pinned host bytes.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "cuda_test_support.hpp"

namespace residency::cuda::testing {
namespace {

// A model file laid out as GGUF lays out tensors (32-byte aligned) and a device buffer as ggml
// lays them out (128-byte aligned, so gaps between tensors), one tensor per `sizes` entry.
struct Layout {
  struct Tensor {
    std::size_t dev_off, file_off, len;
  };
  std::vector<Tensor> tensors;
  std::size_t device_bytes = 0;
  std::size_t file_bytes = 0;
};

Layout lay_out(const std::vector<std::size_t>& sizes) {
  Layout l;
  std::size_t d = 0, f = 4096;  // a header first
  for (std::size_t len : sizes) {
    l.tensors.push_back({d, f, len});
    d = (d + len + 127) / 128 * 128;
    f = (f + len + 31) / 32 * 32;
  }
  l.device_bytes = d + 100;  // and a tail nothing fills
  l.file_bytes = f;
  return l;
}

class FileBackingTest : public CudaTest {
 protected:
  void SetUp() override {
    CudaTest::SetUp();
    if (IsSkipped()) return;
    dir_ = std::filesystem::temp_directory_path() / ("residency-file-backing-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  // Writes a file of `bytes` with the pattern of `seed` and maps it read-only.
  void make_file(const std::string& name, std::size_t bytes, std::uint64_t seed) {
    path_ = (dir_ / name).string();
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0644);
    ASSERT_GE(fd_, 0);
    std::vector<std::uint64_t> block(std::size_t{8} << 20);
    for (std::size_t at = 0; at < bytes; at += block.size() * 8) {
      for (std::size_t i = 0; i < block.size(); ++i) block[i] = mix(seed + at / 8 + i);
      const std::size_t n = std::min(bytes - at, block.size() * 8);
      ASSERT_EQ(::pwrite(fd_, block.data(), n, static_cast<off_t>(at)), static_cast<ssize_t>(n));
    }
    file_bytes_ = bytes;
    map_ = static_cast<char*>(::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd_, 0));
    ASSERT_NE(map_, MAP_FAILED);
  }
  void close_file() {
    if (map_ != nullptr) ::munmap(map_, file_bytes_);
    if (fd_ >= 0) ::close(fd_);
    map_ = nullptr;
    fd_ = -1;
  }

  // Fills the tensors of `l` at `p` from the file, as llama.cpp's loader does (a tensor set from
  // its mapping), saying so first.
  void fill_from_file(CudaBackend& b, void* p, const Layout& l) {
    ContextScope scope(d(), backend_->context());
    for (const auto& t : l.tensors) {
      b.filled_from_file(static_cast<char*>(p) + t.dev_off, t.len, fd_, t.file_off);
      ASSERT_EQ(d().cuMemcpyHtoD(dptr(p) + t.dev_off, map_ + t.file_off, t.len), CUDA_SUCCESS);
    }
  }

  // A model file laid out as `l`, an allocation of `b` tracked in set 0 and filled from it (the
  // bytes between tensors from the pattern of seed + 1).
  void* load(CudaBackend& b, const Layout& l, const char* name, std::uint64_t seed) {
    make_file(name, l.file_bytes, seed);
    if (HasFatalFailure()) return nullptr;
    void* p = allocate_filled(b, l.device_bytes, RegionClass::weights, seed + 1);
    EXPECT_NE(p, nullptr);
    if (p == nullptr) return nullptr;
    b.track_writes(p);
    resident_set(b, 0, device_region(1, p, l.device_bytes, RegionClass::weights));
    fill_from_file(b, p, l);
    return p;
  }

  std::vector<char> read_device(const void* p, std::size_t bytes) {
    std::vector<char> out(bytes);
    ContextScope scope(d(), backend_->context());
    EXPECT_EQ(d().cuMemcpyDtoH(out.data(), dptr(p), bytes), CUDA_SUCCESS);
    return out;
  }

  std::filesystem::path dir_;
  std::string path_;
  int fd_ = -1;
  char* map_ = nullptr;
  std::size_t file_bytes_ = 0;
};

TEST_F(FileBackingTest, WeightsFilledFromTheirFileSleepInItAndWakeFromItExactly) {
  // 4 GiB of tensors of uneven sizes (so that they straddle chunk borders), then one 300 MiB
  // tensor written from elsewhere (not the file's), as a repacked or converted one would be.
  std::vector<std::size_t> sizes;
  for (int i = 0; sizes.size() < 48; ++i) sizes.push_back((std::size_t{85} << 20) + 4099 * i + 33);
  const Layout l = lay_out(sizes);
  constexpr std::size_t kOther = std::size_t{300} << 20;
  const std::size_t other_off = (l.device_bytes + 255) / 256 * 256;  // the pattern kernel writes 8-byte words
  const std::size_t size = other_off + kOther;
  make_file("model.gguf", l.file_bytes, 7);
  if (HasFatalFailure()) return;
  void* p = allocate_filled(*backend_, size, RegionClass::weights, 41);  // the gaps keep this
  ASSERT_NE(p, nullptr);
  backend_->track_writes(p);
  resident_set(*backend_, 0, device_region(1, p, size, RegionClass::weights));
  fill_from_file(*backend_, p, l);
  if (HasFatalFailure()) return;
  char* other = static_cast<char*>(p) + other_off;
  backend_->written(other, kOther);
  ASSERT_TRUE(kernels_->fill(dptr(other), kOther, 42));
  sync();
  const std::vector<char> before = read_device(p, size);
  for (const auto& t : l.tensors) ASSERT_EQ(std::memcmp(before.data() + t.dev_off, map_ + t.file_off, t.len), 0);
  close_file();  // the engine unmaps its mapping (llama.cpp does after load); the backend keeps its own

  const std::size_t chunk = backend_->chunk_bytes();
  const std::size_t other_chunks = (size + chunk - 1) / chunk - l.device_bytes / chunk;
  auto sleep = [&](const char* what) {
    const std::uint64_t copied = backend_->bytes_copied_to_host();
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_TRUE(backend_->end_residency(0)) << backend_->last_release_status().message();
    const double s = seconds_since(t0);
    EXPECT_FALSE(backend_->is_resident(p));
    const std::uint64_t n = backend_->bytes_copied_to_host() - copied;
    std::printf("%s sleep of %.2f GiB: copied %.1f MiB in %.1f ms; pinned %.1f MiB, in the file %.1f MiB\n", what,
                double(size) / kGiB, double(n) / kMiB, s * 1e3, double(backend_->pinned_host_bytes()) / kMiB,
                double(backend_->file_backed_bytes()) / kMiB);
    return n;
  };
  auto wake = [&](const char* what) {
    const auto t0 = std::chrono::steady_clock::now();
    auto out = backend_->request_residency(0);
    const double s = seconds_since(t0);
    EXPECT_TRUE(out.ok()) << out.status.message();
    std::printf("%s wake of %.2f GiB: %.1f ms, %.1f GB/s\n", what, double(size) / kGiB, s * 1e3, double(size) / s / 1e9);
    return s;
  };

  // First sleep: the chunks of file tensors copy only their gaps; the other tensor's chunks are
  // copied whole into pinned memory (one of them shares file tensors' bytes: at most two chunks).
  const std::uint64_t first = sleep("first");
  EXPECT_LE(first, other_chunks * chunk + (std::size_t{2} << 20)) << "the file's bytes must not be copied";
  EXPECT_GE(first, kOther);
  EXPECT_LE(backend_->pinned_host_bytes(), (other_chunks + 1) * chunk) << "no pinned copy of the file's bytes";
  EXPECT_GE(backend_->file_backed_bytes(), l.device_bytes - 2 * chunk);
  const double from_file = wake("from the file:");
  EXPECT_TRUE(read_device(p, size) == before) << "the device must hold exactly what it held before the sleep";

  // Nothing written since: nothing copied.
  EXPECT_EQ(sleep("second"), 0u);
  wake("again:");
  EXPECT_TRUE(read_device(p, size) == before);

  // A reported write into a file tensor: the bytes are no longer the file's, and survive.
  char* t3 = static_cast<char*>(p) + l.tensors[3].dev_off;
  backend_->written(t3 + 128, 4096);
  ASSERT_TRUE(kernels_->fill(dptr(t3 + 128), 4096, 43));
  sync();
  const std::vector<char> written = read_device(p, size);
  const std::uint64_t third = sleep("after a write,");
  EXPECT_GT(third, 0u);
  EXPECT_LE(third, 2 * chunk);
  wake("after a write:");
  EXPECT_TRUE(read_device(p, size) == written) << "the write must survive and nothing else change";

  // The same bytes from a pinned backup (an untracked allocation): the wake to compare with.
  EXPECT_TRUE(backend_->destroy_set(0));
  backend_->deallocate(p);
  void* q = allocate_filled(*backend_, size, RegionClass::weights, 44);
  ASSERT_NE(q, nullptr);
  resident_set(*backend_, 1, device_region(2, q, size, RegionClass::weights));
  EXPECT_TRUE(backend_->end_residency(1));
  EXPECT_TRUE(backend_->request_residency(1).ok());  // the first wake after pinning
  EXPECT_TRUE(backend_->end_residency(1));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(backend_->request_residency(1).ok());
  const double pinned = seconds_since(t0);
  std::printf("wake from the file %.1f ms, from pinned memory %.1f ms: %.3f x the pinned rate\n", from_file * 1e3,
              pinned * 1e3, pinned / from_file);
  EXPECT_EQ(mismatches(q, size, 44), 0u);
  EXPECT_TRUE(backend_->destroy_set(1));
  backend_->deallocate(q);
  EXPECT_EQ(backend_->pinned_host_bytes(), 0u);
}

TEST_F(FileBackingTest, AFileChangedSinceLoadIsNotTrustedTheWeightsSleepPinnedAndItIsSaid) {
  std::vector<std::string> said;
  CudaBackendOptions o;
  o.notice = [&said](const std::string& line) { said.push_back(line); };
  auto made = CudaBackend::create(o);
  ASSERT_TRUE(made) << made.message();
  CudaBackend& b = **made;
  const Layout l = lay_out({std::size_t{100} << 20, std::size_t{200} << 20, 12345});
  void* p = load(b, l, "changed.gguf", 9);
  if (HasFatalFailure()) return;
  const std::vector<char> before = read_device(p, l.device_bytes);
  // Written in place after the load (one byte of the first tensor, a new modification time).
  const char x = 'x';
  ASSERT_EQ(::pwrite(fd_, &x, 1, static_cast<off_t>(l.tensors[0].file_off)), 1);
  const timespec later[2] = {{0, UTIME_OMIT}, {::time(nullptr) + 5, 0}};
  ASSERT_EQ(::futimens(fd_, later), 0);
  close_file();

  const std::uint64_t copied = b.bytes_copied_to_host();
  ASSERT_TRUE(b.end_residency(0)) << b.last_release_status().message();
  EXPECT_EQ(b.bytes_copied_to_host() - copied, l.device_bytes) << "everything must go to the pinned backup";
  EXPECT_GE(b.pinned_host_bytes(), l.device_bytes);
  EXPECT_EQ(b.file_backed_bytes(), 0u);
  ASSERT_EQ(said.size(), 1u);
  EXPECT_NE(said[0].find(path_), std::string::npos) << said[0];
  EXPECT_NE(said[0].find("changed since the weights were loaded"), std::string::npos) << said[0];
  EXPECT_NE(said[0].find("pinned host memory instead"), std::string::npos) << said[0];
  ASSERT_TRUE(b.request_residency(0).ok());
  EXPECT_TRUE(read_device(p, l.device_bytes) == before) << "what was loaded wakes, not the changed file";
  EXPECT_TRUE(b.destroy_set(0));
  b.deallocate(p);
}

// The driver with read-only registration refused, as reported on some GPUs and drivers.
namespace refused {
const Driver* real = nullptr;
CUresult CUDAAPI host_register(void* p, std::size_t bytes, unsigned int flags) {
  if ((flags & CU_MEMHOSTREGISTER_READ_ONLY) != 0) return CUDA_ERROR_NOT_SUPPORTED;
  return real->cuMemHostRegister(p, bytes, flags);
}
}  // namespace refused

TEST_F(FileBackingTest, AFileTheDriverWillNotRegisterFallsBackToThePinnedBackupAndItIsSaid) {
  static Driver driver;  // must outlive the backend
  driver = d();
  refused::real = &d();
  driver.cuMemHostRegister = &refused::host_register;
  std::vector<std::string> said;
  CudaBackendOptions o;
  o.notice = [&said](const std::string& line) { said.push_back(line); };
  auto made = CudaBackend::create(o, driver);
  ASSERT_TRUE(made) << made.message();
  CudaBackend& b = **made;
  const Layout l = lay_out({std::size_t{300} << 20, 777});
  void* p = load(b, l, "refused.gguf", 11);
  if (HasFatalFailure()) return;
  const std::vector<char> before = read_device(p, l.device_bytes);
  close_file();
  ASSERT_TRUE(b.end_residency(0)) << b.last_release_status().message();
  EXPECT_EQ(b.file_backed_bytes(), 0u);
  EXPECT_GE(b.pinned_host_bytes(), l.device_bytes);
  ASSERT_EQ(said.size(), 1u);
  EXPECT_NE(said[0].find("cannot register " + path_ + " read-only"), std::string::npos) << said[0];
  EXPECT_NE(said[0].find("CUDA_ERROR_NOT_SUPPORTED"), std::string::npos) << said[0];
  ASSERT_TRUE(b.request_residency(0).ok());
  EXPECT_TRUE(read_device(p, l.device_bytes) == before);
  EXPECT_TRUE(b.destroy_set(0));
  b.deallocate(p);
}

}  // namespace
}  // namespace residency::cuda::testing

namespace residency::cuda::testing {
namespace {

// The first release, prepared (docs/design.md): ahead of the first sleep, on the backend's own
// thread, the model file is registered piece by piece and the KV-like untracked memory's backup is
// pinned; the first sleep then registers and pins nothing and costs what a later one does. A
// `stop` that says yes part-way keeps what was done, and the first sleep finishes the rest; either
// way the device holds exactly what it held.
TEST_F(FileBackingTest, TheFirstReleasePreparedAheadRegistersTheFileAndCanBeStoppedPartWay) {
  std::vector<std::size_t> sizes;
  for (int i = 0; sizes.size() < 24; ++i) sizes.push_back((std::size_t{85} << 20) + 4099 * i + 33);  // ~2 GiB
  const Layout l = lay_out(sizes);
  void* p = load(*backend_, l, "model.gguf", 7);
  ASSERT_NE(p, nullptr);
  const std::size_t kv_bytes = std::size_t{300} << 20;  // untracked weights-class memory: a KV cache
  void* kv = allocate_filled(*backend_, kv_bytes, RegionClass::weights, 9);
  ASSERT_NE(kv, nullptr);
  resident_set(*backend_, 1, device_region(2, kv, kv_bytes, RegionClass::weights));
  sync();
  const std::vector<char> before = read_device(p, l.device_bytes);
  close_file();
  const std::uint64_t file_pages = (l.file_bytes + 4095) / 4096 * 4096;
  EXPECT_EQ(backend_->registered_file_bytes(), 0u) << "nothing is registered before a release or a preparation";

  // Stopped after three steps of one piece each: part of the file registered, the rest left.
  const int threads = backend_->backup_threads();
  backend_->set_backup_threads(1);
  std::atomic<int> polls{0};
  ASSERT_EQ(backend_->prepare_release([&] { return polls.fetch_add(1) >= 3; }), Backend::Preparation::started);
  ASSERT_TRUE(backend_->wait_preparation(60000));
  const std::uint64_t part = backend_->registered_file_bytes();
  std::printf("stopped after 3 steps: %.1f of %.1f MiB of the file registered\n", double(part) / kMiB,
              double(file_pages) / kMiB);
  EXPECT_EQ(part, 3 * kRegisterPiece);

  // Let it go on, a piece per thread at each step: the whole file, and the KV cache's backup pinned.
  backend_->set_backup_threads(threads);
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(backend_->prepare_release([] { return false; }), Backend::Preparation::started);
  ASSERT_TRUE(backend_->wait_preparation(60000));
  ASSERT_TRUE(backend_->wait_background_backups(60000));
  std::printf("prepared the rest in %.1f ms\n", seconds_since(t0) * 1e3);
  EXPECT_EQ(backend_->registered_file_bytes(), file_pages);
  EXPECT_NE(backend_->host_backup(kv), nullptr) << "the KV cache's backup is pinned ahead";
  EXPECT_EQ(backend_->prepare_release([] { return false; }), Backend::Preparation::nothing);

  // The first sleep registers nothing more and copies only gaps and the KV cache.
  const std::uint64_t copied = backend_->bytes_copied_to_host();
  const auto t1 = std::chrono::steady_clock::now();
  EXPECT_TRUE(backend_->end_residency(0)) << backend_->last_release_status().message();
  EXPECT_TRUE(backend_->end_residency(1)) << backend_->last_release_status().message();
  std::printf("first sleep after the preparation: %.1f ms\n", seconds_since(t1) * 1e3);
  EXPECT_EQ(backend_->registered_file_bytes(), file_pages);
  EXPECT_FALSE(backend_->is_resident(p));
  EXPECT_LE(backend_->bytes_copied_to_host() - copied, kv_bytes + (std::size_t{1} << 20)) << "the KV cache and gaps";
  EXPECT_TRUE(backend_->request_residency(0).ok());
  EXPECT_TRUE(backend_->request_residency(1).ok());
  EXPECT_TRUE(read_device(p, l.device_bytes) == before) << "the device must hold exactly what it held";
  EXPECT_EQ(mismatches(kv, kv_bytes, 9), 0u);
  EXPECT_EQ(backend_->preparation_runs(), 2u);
}

// Without a preparation, a first sleep registers the file in the same pieces, on one host thread
// per piece, and wakes exactly; a copy never spans two pieces. Printed: the sleep's time with one
// thread and with the backend's threads, each on a file of its own.
TEST_F(FileBackingTest, AFirstSleepWithoutPreparationRegistersTheWholeFileInPieces) {
  std::vector<std::size_t> sizes;
  for (int i = 0; sizes.size() < 20; ++i) sizes.push_back((std::size_t{100} << 20) + 8191 * i + 5);
  const Layout l = lay_out(sizes);
  const int threads = backend_->backup_threads();
  for (int run = 0; run < 2; ++run) {
    backend_->set_backup_threads(run == 0 ? 1 : threads);
    void* p = load(*backend_, l, run == 0 ? "one.gguf" : "many.gguf", 11 + run);
    ASSERT_NE(p, nullptr);
    sync();
    const std::vector<char> before = read_device(p, l.device_bytes);
    close_file();
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_TRUE(backend_->end_residency(0)) << backend_->last_release_status().message();
    std::printf("first sleep of %.2f GiB, registering its %.2f GiB file on %d thread(s): %.1f ms\n",
                double(l.device_bytes) / kGiB, double(l.file_bytes) / kGiB, run == 0 ? 1 : threads,
                seconds_since(t0) * 1e3);
    EXPECT_EQ(backend_->registered_file_bytes(), (l.file_bytes + 4095) / 4096 * 4096);
    EXPECT_GT(backend_->file_backed_bytes(), 0u);
    EXPECT_TRUE(backend_->request_residency(0).ok());
    EXPECT_TRUE(read_device(p, l.device_bytes) == before);
    EXPECT_TRUE(backend_->destroy_set(0));
    backend_->deallocate(p);
    EXPECT_EQ(backend_->registered_file_bytes(), 0u)
        << "the file is given back with the last allocation filled from it";
  }
  EXPECT_EQ(backend_->preparation_runs(), 0u);
}

// The host tier below "asleep": the registration of the model file given back, the weights asleep
// in it wake through the staging ring, reading the file, exactly; the next sleep registers it again.
// Printed: the staged wake's rate against the registered one's.
TEST_F(FileBackingTest, WeightsWhoseFileRegistrationWasGivenBackWakeThroughTheStagingRingExactly) {
  std::vector<std::size_t> sizes;
  for (int i = 0; sizes.size() < 24; ++i) sizes.push_back((std::size_t{85} << 20) + 4099 * i + 33);  // ~2 GiB
  const Layout l = lay_out(sizes);
  void* p = load(*backend_, l, "model.gguf", 21);
  ASSERT_NE(p, nullptr);
  sync();
  const std::vector<char> before = read_device(p, l.device_bytes);
  close_file();
  EXPECT_TRUE(backend_->end_residency(0)) << backend_->last_release_status().message();
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(backend_->request_residency(0).ok());
  const double registered = seconds_since(t0);
  EXPECT_EQ(backend_->staged_bytes(), 0u);
  EXPECT_TRUE(backend_->end_residency(0));
  const std::uint64_t file_pages = (l.file_bytes + 4095) / 4096 * 4096;
  EXPECT_EQ(backend_->unregister_files(), file_pages);
  EXPECT_EQ(backend_->registered_file_bytes(), 0u);
  t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(backend_->request_residency(0).ok());
  const double staged = seconds_since(t0);
  EXPECT_TRUE(read_device(p, l.device_bytes) == before) << "the device must hold exactly what it held";
  EXPECT_GE(backend_->staged_bytes(), l.device_bytes - 2 * backend_->chunk_bytes());
  std::printf(
      "wake of %.2f GiB: from the registered file %.1f ms (%.1f GB/s), through the staging ring %.1f ms "
      "(%.1f GB/s)\n",
      double(l.device_bytes) / kGiB, registered * 1e3, double(l.device_bytes) / registered / 1e9, staged * 1e3,
      double(l.device_bytes) / staged / 1e9);
  EXPECT_TRUE(backend_->end_residency(0));
  EXPECT_EQ(backend_->registered_file_bytes(), file_pages) << "a sleep registers the file again";
  EXPECT_TRUE(backend_->request_residency(0).ok());
  EXPECT_TRUE(read_device(p, l.device_bytes) == before);
}

}  // namespace
}  // namespace residency::cuda::testing
