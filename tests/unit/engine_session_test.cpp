// SPDX-License-Identifier: MIT
// The preload's decisions without llama.cpp: an EngineSession driven with the fake backend, a
// manual clock and synthetic events (buffers made over memory this test maps, a GGUF file it
// writes, decodes). What is asserted is what the backend was asked to hold, and for the file
// pages no buffer reads, what the kernel holds (mincore). The llama.cpp tests
// (tests/preload/preload_test.cpp) are the end-to-end proof of the same rules.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "preload/engine_session.hpp"
#include "residency/text.hpp"
#include "support/fake_backend.hpp"
#include "support/temp_dir.hpp"

namespace residency::preload {
namespace {

using testing::FakeBackend;
using testing::LogCapture;

constexpr std::size_t kMiB = std::size_t{1} << 20;

// ggml's answers, as a test sets them.
class FakeReader final : public BufferReader {
 public:
  struct Buffer {
    BufferFacts facts;
    std::string type = "CPU";
  };
  BufferFacts facts(BufferId b, bool from_ptr) const override {
    BufferFacts f = buffers.at(b).facts;
    f.from_ptr = from_ptr;
    return f;
  }
  std::string type_name(BufferId b) const override { return buffers.at(b).type; }
  std::map<BufferId, Buffer> buffers;
};

// A disk-backed directory, removed with its files.
struct TempDir {
  TempDir() {
    std::string error;
    dir = testing::make_disk_temp_dir("engine-session", error);
    EXPECT_FALSE(dir.empty()) << error;
  }
  ~TempDir() {
    if (!dir.empty()) std::filesystem::remove_all(dir);
  }
  const std::string& path() const { return dir; }
  std::string dir;
};

// Anonymous memory of its own, unmapped at the end unless the test unmapped it.
struct Mapping {
  explicit Mapping(std::size_t n) : size(n) {
    void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    EXPECT_NE(p, MAP_FAILED);
    base = static_cast<char*>(p);
    std::memset(base, 1, n);
  }
  ~Mapping() {
    if (base != nullptr) ::munmap(base, size);
  }
  std::uintptr_t begin() const { return reinterpret_cast<std::uintptr_t>(base); }
  std::uintptr_t end() const { return begin() + size; }
  char* base = nullptr;
  std::size_t size;
};

class EngineSessionTest : public ::testing::Test {
 protected:
  ManualClock clock{Nanos(std::chrono::hours(1))};
  std::shared_ptr<FakeBackend> host = std::make_shared<FakeBackend>();
  std::map<int, std::shared_ptr<FakeBackend>> gpus;
  FakeReader reader;
  LogCapture logs;
  bool host_backend_fails = false;
  bool engine_memory = true;
  std::vector<int> backends_asked;  // kHost or a device index, in order

  std::unique_ptr<EngineSession> make(KeepAlive keep_alive = KeepAlive::after(std::chrono::seconds(10))) {
    EngineSession::Options o;
    o.config.keep_alive = keep_alive;
    o.config.log_level = LogLevel::debug;
    o.config.release_on_pressure = false;
    o.backends = [this](int where, const Config&) -> Result<std::shared_ptr<Backend>> {
      backends_asked.push_back(where);
      if (where == EngineSession::kHost) {
        if (host_backend_fails) return Status(ErrorCode::unsupported, "no host backend here");
        return std::shared_ptr<Backend>(host);
      }
      auto& g = gpus[where];
      if (!g) g = std::make_shared<FakeBackend>();
      return std::shared_ptr<Backend>(g);
    };
    o.clock = &clock;
    o.buffers = &reader;
    o.log = logs.callback();
    o.start_schedulers = false;
    o.engine_memory = engine_memory;
    return std::make_unique<EngineSession>(std::move(o));
  }

  // A buffer ggml made over memory it owns (the CPU buffer type), with a usage.
  BufferId buffer(EngineSession& s, const Mapping& m, BufferUsage usage, const std::string& type = "CPU") {
    const BufferId id = m.begin();
    reader.buffers[id] = {BufferFacts{m.begin(), m.size, true, DeviceKind::cpu, false, BufferUsage::any, {}}, type};
    s.buffer_created(id, false);
    s.buffer_usage(id, usage);
    return id;
  }

  // What the host backend holds now, by region class: committed members of requested sets.
  std::map<RegionClass, std::uint64_t> resident_by_class(const FakeBackend& b) const {
    std::lock_guard<std::recursive_mutex> g(b.mu);
    std::map<RegionClass, std::uint64_t> out;
    for (const auto& [id, set] : b.sets)
      if (set.exists && set.requested)
        for (const auto& [rid, r] : set.members) out[r.cls] += r.size;
    return out;
  }
  // Whether a committed member of any set starts at `base`, and its size.
  std::optional<std::size_t> member_at(const FakeBackend& b, std::uintptr_t base) const {
    std::lock_guard<std::recursive_mutex> g(b.mu);
    for (const auto& [id, set] : b.sets)
      for (const auto& [rid, r] : set.members)
        if (reinterpret_cast<std::uintptr_t>(r.base) == base) return r.size;
    return std::nullopt;
  }
  bool any_member_overlaps(const FakeBackend& b, std::uintptr_t begin, std::uintptr_t end) const {
    std::lock_guard<std::recursive_mutex> g(b.mu);
    for (const auto& [id, set] : b.sets)
      for (const auto& [rid, r] : set.members) {
        const auto rb = reinterpret_cast<std::uintptr_t>(r.base);
        if (rb < end && begin < rb + r.size) return true;
      }
    return false;
  }

  void decode(EngineSession& s) { s.decode_ended(s.decode_began(), nullptr); }
};

TEST(SessionRules, TheSnapshotIsTakenAfterPowersOfTwoDecodesUpTo64) {
  std::vector<std::uint32_t> after;
  for (std::uint32_t n = 0; n <= 200; ++n)
    if (SessionRules::snapshot_after(n)) after.push_back(n);
  EXPECT_EQ(after, (std::vector<std::uint32_t>{1, 2, 4, 8, 16, 32, 64}));
}

TEST(SessionRules, OnlyReadOnlyFileMappingsMayBeModelFiles) {
  EXPECT_TRUE(SessionRules::may_be_model_file(PROT_READ, MAP_PRIVATE, 3, 4096));
  EXPECT_TRUE(SessionRules::may_be_model_file(PROT_READ, MAP_SHARED | MAP_POPULATE, 3, 4096));
  EXPECT_FALSE(SessionRules::may_be_model_file(PROT_READ | PROT_WRITE, MAP_PRIVATE, 3, 4096));
  EXPECT_FALSE(SessionRules::may_be_model_file(PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 4096));
  EXPECT_FALSE(SessionRules::may_be_model_file(PROT_NONE, MAP_PRIVATE, 3, 4096));
  EXPECT_FALSE(SessionRules::may_be_model_file(PROT_READ, MAP_PRIVATE, 3, 0));
}

TEST(SessionRules, AFileIsAModelFileByItsGgufMagicAndOnlyUpToItsEnd) {
  TempDir dir;
  const std::string gguf = dir.path() + "/m.gguf", other = dir.path() + "/m.bin";
  for (const auto& [path, magic] : {std::pair{gguf, "GGUF"}, std::pair{other, "GGML"}}) {
    const int fd = ::open(path.c_str(), O_CREAT | O_WRONLY | O_TRUNC, 0600);
    ASSERT_GE(fd, 0);
    std::string bytes(10000, 'x');
    std::memcpy(bytes.data(), magic, 4);
    ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
    ::close(fd);
  }
  const int g = ::open(gguf.c_str(), O_RDONLY);
  const int o = ::open(other.c_str(), O_RDONLY);
  EXPECT_EQ(SessionRules::gguf_bytes(g, 0, 8192), 8192u);
  EXPECT_EQ(SessionRules::gguf_bytes(g, 8192, 8192), 10000u - 8192u);  // the part past the end has no pages
  EXPECT_EQ(SessionRules::gguf_bytes(g, 12288, 4096), 0u);
  EXPECT_EQ(SessionRules::gguf_bytes(o, 0, 8192), 0u);
  EXPECT_EQ(SessionRules::gguf_bytes(-1, 0, 8192), 0u);
  ::close(g);
  ::close(o);
}

TEST_F(EngineSessionTest, NothingStartsBeforeTheEngineMakesABufferOrMapsAModel) {
  auto s = make();
  decode(*s);
  s->device_access();
  EXPECT_EQ(s->host_manager(), nullptr);
  EXPECT_TRUE(backends_asked.empty());
  Mapping m(kMiB);
  buffer(*s, m, BufferUsage::weights);
  ASSERT_NE(s->host_manager(), nullptr);
  EXPECT_EQ(backends_asked, std::vector<int>{EngineSession::kHost});
}

TEST_F(EngineSessionTest, BufferClassesComeFromTheUsageLlamaCppSets) {
  auto s = make();
  Mapping w(2 * kMiB), kv(kMiB), compute(kMiB / 2);
  buffer(*s, w, BufferUsage::weights, "CPU_REPACK");
  buffer(*s, kv, BufferUsage::any);
  buffer(*s, compute, BufferUsage::compute);
  // Nothing is registered before a flush point.
  EXPECT_FALSE(member_at(*host, w.begin()));
  s->context_made();
  EXPECT_EQ(member_at(*host, w.begin()), w.size);
  EXPECT_EQ(member_at(*host, kv.begin()), kv.size);
  EXPECT_EQ(member_at(*host, compute.begin()), compute.size);
  const auto held = resident_by_class(*host);
  EXPECT_GE(held.at(RegionClass::weights), w.size);  // and the engine's code, held as weights with a model
  EXPECT_EQ(held.at(RegionClass::kv_cache), kv.size);
  EXPECT_EQ(held.at(RegionClass::scratch), compute.size);
  // The buffer type is read at registration (CPU_REPACK takes a CPU buffer over after ggml made it).
  EXPECT_TRUE(logs.contains(LogLevel::info, "weights 2 MiB (CPU_REPACK)")) << "the flush's summary line";
  // A freed buffer is unregistered before its memory goes.
  s->buffer_freed(kv.begin());
  EXPECT_FALSE(member_at(*host, kv.begin()));
}

TEST_F(EngineSessionTest, DeviceMemoryAndPinnedHostBuffersAreNotHostMemoryToLock) {
  auto s = make();
  Mapping pinned(kMiB);
  reader.buffers[pinned.begin()] = {BufferFacts{pinned.begin(), pinned.size, true, DeviceKind::gpu, false, {}, {}},
                                    "CUDA_Host"};
  s->buffer_created(pinned.begin(), false);
  s->buffer_usage(pinned.begin(), BufferUsage::weights);
  s->context_made();
  EXPECT_FALSE(any_member_overlaps(*host, pinned.begin(), pinned.end()));
}

TEST_F(EngineSessionTest, AFileBackedBufferHoldsItsTensorsPagesAndTheUnreadPagesAreGivenBack) {
  // A GGUF file of 512 pages on a disk-backed file system, mapped and read whole, as llama.cpp does.
  TempDir dir;
  const std::size_t page = system_page_size(), pages = 512;
  const std::string path = dir.path() + "/model.gguf";
  {
    std::string bytes(pages * page, 'w');
    std::memcpy(bytes.data(), "GGUF", 4);
    const int fd = ::open(path.c_str(), O_CREAT | O_WRONLY | O_TRUNC, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
    ::fsync(fd);
    ::close(fd);
  }
  const int fd = ::open(path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  const std::size_t len = pages * page;
  auto* map = static_cast<char*>(::mmap(nullptr, len, PROT_READ, MAP_PRIVATE, fd, 0));
  ASSERT_NE(map, MAP_FAILED);
  // Read in single pages: written pages may sit in large folios, which a pageout of part of one
  // cannot take (the kernel does not split them for it).
  ASSERT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
  ::close(fd);
  ASSERT_EQ(::madvise(map, len, MADV_RANDOM), 0);
  volatile char sink = 0;
  for (std::size_t i = 0; i < len; i += page) sink = sink + map[i];
  {
    std::vector<unsigned char> before(pages);
    ASSERT_EQ(::mincore(map, len, before.data()), 0);
    std::size_t resident = 0;
    for (unsigned char v : before) resident += v & 1U;
    ASSERT_EQ(resident, pages) << "the whole file was read in";
  }
  auto s = make();
  const auto b = reinterpret_cast<std::uintptr_t>(map);
  s->file_mapped(map, len);
  // A CPU_Mapped buffer over the whole mapping; two tensors in it, at pages 64-127 and 320-383 (the
  // rest: the header, and tensors that were copied into other buffers).
  reader.buffers[b] = {BufferFacts{b, len, true, DeviceKind::cpu, true, {}, {}}, "CPU_Mapped"};
  s->buffer_created(b, true);
  ASSERT_TRUE(s->wants_tensor_placements(b));
  s->tensor_placed(b, b + 64 * page, b + 128 * page);
  s->tensor_placed(b, b + 320 * page + 100, b + 384 * page - 100);
  s->buffer_usage(b, BufferUsage::weights);
  s->model_loaded();

  // Registered: the tensors' pages only.
  EXPECT_EQ(member_at(*host, b + 64 * page), 64 * page);
  EXPECT_EQ(member_at(*host, b + 320 * page), 64 * page);
  EXPECT_FALSE(any_member_overlaps(*host, b, b + 64 * page));
  EXPECT_FALSE(any_member_overlaps(*host, b + 128 * page, b + 320 * page));
  EXPECT_FALSE(any_member_overlaps(*host, b + 384 * page, b + len));
  // What the kernel holds: the unread pages were given back, the tensors' pages stay.
  std::vector<unsigned char> vec(pages);
  ASSERT_EQ(::mincore(map, len, vec.data()), 0);
  std::size_t unread_resident = 0, read_resident = 0;
  for (std::size_t i = 0; i < pages; ++i) {
    const bool read = (i >= 64 && i < 128) || (i >= 320 && i < 384);
    if ((vec[i] & 1U) == 0) continue;
    if (read) ++read_resident;
    else ++unread_resident;
  }
  EXPECT_EQ(read_resident, 128u);
  // A pageout is best-effort: the kernel skips a page it cannot isolate at that moment (one still
  // in a per-CPU LRU batch); seen 0-5 of these 384 left. Without the give-back all 384 stay.
  EXPECT_LE(unread_resident, 384u / 10) << "pages no buffer reads stay in memory";
  EXPECT_TRUE(logs.contains(LogLevel::info, "model file pages no buffer reads"));
  s->buffer_freed(b);
  ::munmap(map, len);
}

TEST_F(EngineSessionTest, AnUnmapTakesItsPartOfARegionAndLeavesTheRestRegistered) {
  auto s = make();
  const std::size_t page = system_page_size();
  auto m = std::make_unique<Mapping>(16 * page);
  buffer(*s, *m, BufferUsage::weights);
  s->context_made();
  ASSERT_EQ(member_at(*host, m->begin()), 16 * page);
  ASSERT_TRUE(s->tracks(m->begin() + 4 * page, m->begin() + 5 * page));
  // The middle four pages go. The hook only queues it (it may run inside the program's allocator):
  // nothing changes until the session applies it, then two pieces are left.
  const std::uintptr_t b = m->begin() + 6 * page, e = b + 4 * page;
  ASSERT_EQ(::munmap(reinterpret_cast<void*>(b), e - b), 0);
  s->memory_gone(b, e);
  EXPECT_EQ(member_at(*host, m->begin()), 16 * page);
  s->settle();
  EXPECT_EQ(member_at(*host, m->begin()), 6 * page);
  EXPECT_EQ(member_at(*host, e), 6 * page);
  EXPECT_FALSE(any_member_overlaps(*host, b, e));
  s->buffer_freed(m->begin());
  ::munmap(m->base, 6 * page);
  ::munmap(reinterpret_cast<void*>(e), 6 * page);
  m->base = nullptr;
}

TEST_F(EngineSessionTest, UnderADurationTheEngineMemoryIsSnapshotAfterPowersOfTwoDecodesSinceEachWire) {
  auto s = make(KeepAlive::after(std::chrono::seconds(10)));
  ASSERT_TRUE(s->holds_between_calls());
  Mapping w(kMiB);
  buffer(*s, w, BufferUsage::weights);
  s->model_loaded();
  std::vector<std::uint32_t> taken_after;
  for (std::uint32_t n = 1; n <= 70; ++n) {
    const std::uint32_t before = s->snapshots_taken();
    decode(*s);
    if (s->snapshots_taken() > before) taken_after.push_back(n);
  }
  EXPECT_EQ(taken_after, (std::vector<std::uint32_t>{1, 2, 4, 8, 16, 32, 64}));
  // The snapshot holds this process's own anonymous memory that is resident (its stack at least).
  EXPECT_GT(s->engine_memory_bytes(), 0u);
  EXPECT_GT(resident_by_class(*host)[RegionClass::scratch], 0u);
}

TEST_F(EngineSessionTest, WithTheEngineMemorySwitchedOffNoSnapshotIsTaken) {
  engine_memory = false;
  auto s = make();
  Mapping w(kMiB);
  buffer(*s, w, BufferUsage::weights);
  s->model_loaded();
  for (int i = 0; i < 4; ++i) decode(*s);
  EXPECT_EQ(s->snapshots_taken(), 0u);
  EXPECT_EQ(s->engine_memory_bytes(), 0u);
  EXPECT_EQ(resident_by_class(*host)[RegionClass::scratch], 0u);
}

TEST_F(EngineSessionTest, WhatTheProgramLockedItselfIsNeverRegisteredSoNeverUnlocked) {
  auto s = make();
  const std::size_t page = system_page_size();
  Mapping w(16 * page);
  buffer(*s, w, BufferUsage::weights);
  s->context_made();
  ASSERT_EQ(member_at(*host, w.begin()), 16 * page);
  // The program locks pages 4-7 itself: the session lets go of them first, keeps the rest.
  bool called = false;
  EXPECT_TRUE(s->program_locks(w.begin() + 4 * page, w.begin() + 8 * page, [&] { return called = true; }));
  EXPECT_TRUE(called);
  s->settle();
  EXPECT_FALSE(any_member_overlaps(*host, w.begin() + 4 * page, w.begin() + 8 * page));
  EXPECT_EQ(member_at(*host, w.begin()), 4 * page);
  EXPECT_EQ(member_at(*host, w.begin() + 8 * page), 8 * page);
  // A later registration (a flush after usage changes) leaves them out too.
  s->buffer_usage(w.begin(), BufferUsage::any);
  s->context_made();
  EXPECT_FALSE(any_member_overlaps(*host, w.begin() + 4 * page, w.begin() + 8 * page));
  // Once the program unlocks them, they may be held again at the next registration.
  EXPECT_TRUE(s->program_unlocks(w.begin() + 4 * page, w.begin() + 8 * page, [] { return true; }));
  s->buffer_usage(w.begin(), BufferUsage::weights);
  s->context_made();
  EXPECT_EQ(member_at(*host, w.begin()), 16 * page);
}

// llama.cpp's mmap+mlock load mode locks its file mapping one tensor at a time (each lock grows
// the last one: llama_mlock::grow_to), over 2048 calls for a large model: they are one range of the
// program's, so none is dropped for want of room and registered by the session (which would unlock
// it after the keep-alive), and a tensor of a CPU_Mapped buffer there is left to the program, with
// one info line naming what.
TEST_F(EngineSessionTest, AProgramLockGrownTensorByTensorStaysTheProgramsPastTheTableSize) {
  auto s = make();
  const std::size_t page = system_page_size();
  const std::size_t calls = PieceTable::kMaxPieces + 500;
  Mapping map(calls * page + 64 * page);
  const std::uintptr_t b = map.begin();
  reader.buffers[b] = {BufferFacts{b, map.size, true, DeviceKind::cpu, true, {}, {}}, "CPU_Mapped"};
  s->buffer_created(b, true);
  for (std::size_t i = 0; i < calls; ++i) {
    ASSERT_TRUE(s->program_locks(b + i * page, b + (i + 1) * page, [] { return true; }));
    s->tensor_placed(b, b + i * page, b + (i + 1) * page);
  }
  s->tensor_placed(b, b + calls * page, b + (calls + 64) * page);  // one the program did not lock
  s->buffer_usage(b, BufferUsage::weights);
  s->model_loaded();
  EXPECT_FALSE(any_member_overlaps(*host, b, b + calls * page)) << "a lock of the program's was registered";
  EXPECT_EQ(member_at(*host, b + calls * page), 64 * page);
  EXPECT_FALSE(logs.contains(LogLevel::warn, "pieces of the program's locked ranges")) << "the table ran out";
  EXPECT_TRUE(logs.contains(LogLevel::info, "registered 1 buffer: weights " + format_size(64 * page) + " (CPU_Mapped)"))
      << "the rest only";
  EXPECT_TRUE(logs.contains(LogLevel::info, "left to the program, which locks it itself")) << "said once";
  EXPECT_TRUE(logs.contains(LogLevel::info, "(llama.cpp's load mode mlock or mmap+mlock): weights " +
                                                format_size(calls * page) + " (CPU_Mapped)"));
}

// A program lock that fails may still have locked: the kernel marks the mappings up to a hole or
// up to a page it cannot fault in (llama.cpp's mlock load mode locks a buffer's size rounded up to
// a page from its unaligned base, one page past its mapping) before it returns ENOMEM; the hook
// then says it may have locked, and the session leaves the range to the program. A failure that
// locked nothing keeps what the program had locked there before.
TEST_F(EngineSessionTest, AProgramLockThatMayHaveLockedPartOfItsRangeIsNeverRegistered) {
  auto s = make();
  const std::size_t page = system_page_size();
  Mapping w(16 * page), v(16 * page);
  ASSERT_TRUE(s->program_locks(w.begin(), w.end() + page, [] { return true; }));  // ENOMEM: may have locked
  buffer(*s, w, BufferUsage::weights);
  s->model_loaded();
  EXPECT_FALSE(any_member_overlaps(*host, w.begin(), w.end()));
  // The program locks pages 4-7 of v, then fails (EINVAL: nothing locked) over the whole of it.
  ASSERT_TRUE(s->program_locks(v.begin() + 4 * page, v.begin() + 8 * page, [] { return true; }));
  EXPECT_FALSE(s->program_locks(v.begin(), v.end(), [] { return false; }));
  buffer(*s, v, BufferUsage::weights);
  s->model_loaded();
  EXPECT_EQ(member_at(*host, v.begin()), 4 * page);
  EXPECT_EQ(member_at(*host, v.begin() + 8 * page), 8 * page);
  EXPECT_FALSE(any_member_overlaps(*host, v.begin() + 4 * page, v.begin() + 8 * page)) << "the earlier lock";
}

// A program's lock ends with its mapping: llama.cpp's mmap+mlock load mode locks the GGUF header's
// pages with the first tensors, then unmaps them, and a buffer mapped there later is the engine's to
// hold (a KV cache there went unlocked while its decodes read it).
TEST_F(EngineSessionTest, AProgramsLockEndsWithItsMapping) {
  auto s = make();
  const std::size_t page = system_page_size();
  Mapping kv(16 * page);
  ASSERT_TRUE(s->program_locks(kv.begin(), kv.begin() + 8 * page, [] { return true; }));
  s->program_locks_end(kv.begin() - 4 * page, kv.begin() + 8 * page);  // unmapped, and kv mapped there
  buffer(*s, kv, BufferUsage::any);
  s->context_made();
  EXPECT_EQ(member_at(*host, kv.begin()), 16 * page);
}

// A lock of the program's that fails where RLIMIT_MEMLOCK does not apply (CAP_IPC_LOCK) was not
// failed by the session's locks: the session keeps what it holds rather than stepping aside for
// good. Where the limit applies, it steps aside (tests/preload/memory_calls_test.cpp runs that).
TEST_F(EngineSessionTest, AProgramLockFailingWithoutALockLimitNeverMakesTheSessionStepAside) {
  for (const std::uint64_t limit : {std::uint64_t{0}, std::uint64_t{64} * kMiB}) {
    SCOPED_TRACE(limit == 0 ? "no limit" : "RLIMIT_MEMLOCK 64 MiB");
    host = std::make_shared<FakeBackend>();
    host->hard_limit = limit;
    auto s = make();
    Mapping w(kMiB);
    buffer(*s, w, BufferUsage::weights);
    s->model_loaded();
    ASSERT_TRUE(member_at(*host, w.begin()));
    EXPECT_EQ(s->step_aside_for_program_lock(), limit != 0);
    s->settle();
    EXPECT_EQ(member_at(*host, w.begin()).has_value(), limit == 0);
  }
}

// What the program takes back (madvise DONTNEED, mprotect PROT_NONE, mremap): the hook unlocks what
// the session locked there before the call, with system calls only (the kernel's locks are checked
// here: the fake backend locks nothing, so this test locks the pages the session holds itself), and
// what the program locked itself stays locked; the session forgets the range once the event applies.
TEST_F(EngineSessionTest, WhatTheProgramTakesBackIsUnlockedBeforeItsCallAndForgottenAfter) {
  auto s = make();
  const std::size_t page = system_page_size();
  Mapping w(16 * page);
  buffer(*s, w, BufferUsage::weights);
  s->context_made();
  ASSERT_TRUE(s->program_locks(w.begin() + 2 * page, w.begin() + 3 * page,
                               [&] { return ::mlock(w.base + 2 * page, page) == 0; }));
  s->settle();
  ASSERT_EQ(::mlock(w.base, 2 * page), 0) << "as the session's backend would have";
  ASSERT_EQ(::mlock(w.base + 3 * page, page), 0);
  auto locked = [&](std::size_t first_page) {
    // madvise(MADV_DONTNEED) as a system call fails with EINVAL on a locked page.
    return ::syscall(SYS_madvise, w.base + first_page * page, page, MADV_DONTNEED) != 0 && errno == EINVAL;
  };
  s->unlock_before_take_back(w.begin(), w.begin() + 4 * page);
  EXPECT_FALSE(locked(0));
  EXPECT_FALSE(locked(1));
  EXPECT_TRUE(locked(2)) << "the program's own lock stays";
  EXPECT_FALSE(locked(3));
  s->memory_gone(w.begin(), w.begin() + 4 * page);
  s->settle();
  EXPECT_FALSE(any_member_overlaps(*host, w.begin(), w.begin() + 4 * page));
  EXPECT_EQ(member_at(*host, w.begin() + 4 * page), 12 * page);
  EXPECT_TRUE(s->program_unlocks(w.begin() + 2 * page, w.begin() + 3 * page,
                                 [&] { return ::munlock(w.base + 2 * page, page) == 0; }));
  // mlockall: everything is let go of, nothing is held from then on. (Flags 0: the session's
  // mlockall again after the let-go fails with EINVAL here rather than lock this test.)
  s->program_locked_all(0);
  s->settle();
  EXPECT_FALSE(any_member_overlaps(*host, w.begin(), w.end()));
  Mapping other(kMiB);
  buffer(*s, other, BufferUsage::weights);
  s->context_made();
  EXPECT_FALSE(member_at(*host, other.begin()));
}

TEST_F(EngineSessionTest, OnlyWhatTheEngineMappedInsideItsCallsIsHeldOfAnonymousMappings) {
  auto s = make();
  Mapping w(kMiB), engine(4 * kMiB), program(4 * kMiB);
  buffer(*s, w, BufferUsage::weights);
  s->model_loaded();
  s->engine_mapped(engine.begin(), engine.end());
  decode(*s);
  EXPECT_TRUE(any_member_overlaps(*host, engine.begin(), engine.end())) << "mapped inside an engine call";
  EXPECT_FALSE(any_member_overlaps(*host, program.begin(), program.end())) << "the program's own mapping";
}

// An address the session held, unmapped behind the hooks (glibc's own munmap) and mapped again by
// the program (a shared file): the hook of the new mapping says so, and nothing is held there
// any more, so no later wire locks the program's file for it.
TEST_F(EngineSessionTest, AMappingTheProgramMakesWhereHeldMemoryWasIsForgotten) {
  auto s = make();
  Mapping w(kMiB);
  buffer(*s, w, BufferUsage::weights);
  s->model_loaded();
  auto* engine = static_cast<char*>(::mmap(nullptr, 4 * kMiB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(engine, MAP_FAILED);
  std::memset(engine, 1, 4 * kMiB);
  const auto e = reinterpret_cast<std::uintptr_t>(engine);
  s->engine_mapped(e, e + 4 * kMiB);
  decode(*s);
  ASSERT_TRUE(any_member_overlaps(*host, e, e + 4 * kMiB)) << "held after the decode";
  // Behind the hooks: unmapped, and a shared file mapped at the same address.
  TempDir dir;
  const std::string path = dir.path() + "/shared";
  const int fd = ::open(path.c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 4 * kMiB), 0);
  ASSERT_EQ(::munmap(engine, 4 * kMiB), 0);
  void* file = ::mmap(engine, 4 * kMiB, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED_NOREPLACE, fd, 0);
  ::close(fd);
  ASSERT_EQ(file, engine);
  EXPECT_TRUE(s->tracks(e, e + 4 * kMiB));
  s->memory_gone(e, e + 4 * kMiB);
  s->settle();
  EXPECT_FALSE(any_member_overlaps(*host, e, e + 4 * kMiB)) << "the program's file mapping stays unlocked";
  EXPECT_FALSE(s->tracks(e, e + 4 * kMiB));
  ::munmap(file, 4 * kMiB);
}

TEST_F(EngineSessionTest, WithoutAModelsWeightsNoSnapshotIsTaken) {
  auto s = make();
  Mapping kv(kMiB);
  buffer(*s, kv, BufferUsage::any);
  s->context_made();
  for (int i = 0; i < 4; ++i) decode(*s);
  EXPECT_EQ(s->snapshots_taken(), 0u);
  EXPECT_EQ(s->engine_memory_bytes(), 0u);
}

TEST_F(EngineSessionTest, UnderKeepAliveZeroNothingIsHeldBetweenCallsAndNoSnapshotIsTaken) {
  auto s = make(KeepAlive::zero());
  EXPECT_FALSE(s->holds_between_calls());
  Mapping w(kMiB);
  buffer(*s, w, BufferUsage::weights);
  s->model_loaded();
  EXPECT_EQ(resident_by_class(*host)[RegionClass::weights], 0u) << "wired outside a call";
  const auto scope = s->decode_began();
  EXPECT_GE(resident_by_class(*host)[RegionClass::weights], w.size) << "not wired inside a call";
  s->decode_ended(scope, nullptr);
  EXPECT_EQ(resident_by_class(*host)[RegionClass::weights], 0u);
  for (int i = 0; i < 4; ++i) decode(*s);
  EXPECT_EQ(s->snapshots_taken(), 0u);
}

TEST_F(EngineSessionTest, ForeverAndADurationHoldBetweenCallsAndOffManagesNoDevice) {
  EXPECT_TRUE(make(KeepAlive::forever())->holds_between_calls());
  EXPECT_TRUE(make(KeepAlive::after(std::chrono::milliseconds(1)))->holds_between_calls());
  EXPECT_FALSE(make(KeepAlive::after(Nanos(0)))->holds_between_calls());
  auto off = make(KeepAlive::off());
  EXPECT_FALSE(off->holds_between_calls());
  EXPECT_EQ(off->device_allocate(0, 64 * kMiB, false).outcome, EngineSession::DeviceAllocation::Outcome::pass_through);
  EXPECT_EQ(off->device_manager(0), nullptr);
}

TEST_F(EngineSessionTest, TheEngineMemoryIsDroppedBeforeADecodeWiresAgainAndSnapshotAnewAfterIt) {
  auto s = make(KeepAlive::after(std::chrono::seconds(1)));
  Mapping w(kMiB);
  buffer(*s, w, BufferUsage::weights);
  s->model_loaded();
  decode(*s);
  decode(*s);
  ASSERT_EQ(s->snapshots_taken(), 2u);
  ASSERT_GT(s->engine_memory_bytes(), 0u);
  // The keep-alive expires: everything is released.
  clock.advance(std::chrono::seconds(2));
  s->host_manager()->run_due();
  ASSERT_FALSE(s->host_manager()->wants_resident());
  EXPECT_EQ(resident_by_class(*host)[RegionClass::weights], 0u);
  // The next decode wires the model again, but not the old snapshot (it may be unmapped since).
  const auto scope = s->decode_began();
  EXPECT_EQ(s->engine_memory_bytes(), 0u);
  EXPECT_EQ(resident_by_class(*host)[RegionClass::scratch], 0u);
  EXPECT_GE(resident_by_class(*host)[RegionClass::weights], w.size);
  s->decode_ended(scope, nullptr);
  // ... and the schedule starts over: a snapshot after this first decode since the wire.
  EXPECT_EQ(s->snapshots_taken(), 3u);
  EXPECT_GT(s->engine_memory_bytes(), 0u);
}

TEST_F(EngineSessionTest, AFreedBufferDropsTheEngineMemory) {
  auto s = make();
  Mapping w(kMiB), compute(kMiB);
  buffer(*s, w, BufferUsage::weights);
  buffer(*s, compute, BufferUsage::compute);
  s->model_loaded();
  decode(*s);
  ASSERT_GT(s->engine_memory_bytes(), 0u);
  s->buffer_freed(compute.begin());
  EXPECT_EQ(s->engine_memory_bytes(), 0u);
  EXPECT_EQ(resident_by_class(*host)[RegionClass::scratch], 0u);
  decode(*s);
  EXPECT_GT(s->engine_memory_bytes(), 0u) << "snapshot again after the next decode";
}

// Weights in device memory: their writes are tracked from the moment llama.cpp marks the buffer,
// and each write (a tensor set, a graph node) reaches the backend clipped to the tracked range;
// writes elsewhere (compute buffers, memory that is not routed) do not; a freed buffer stops it.
TEST_F(EngineSessionTest, WritesIntoDeviceWeightsAreReportedToTheBackendAndNothingElse) {
  auto s = make();
  using Outcome = EngineSession::DeviceAllocation::Outcome;
  const auto weights = s->device_allocate(0, 8 * kMiB, false);
  const auto compute = s->device_allocate(0, 4 * kMiB, true);
  ASSERT_EQ(weights.outcome, Outcome::routed);
  ASSERT_EQ(compute.outcome, Outcome::routed);
  const auto w = reinterpret_cast<std::uintptr_t>(weights.ptr);
  const auto c = reinterpret_cast<std::uintptr_t>(compute.ptr);
  auto* gpu = gpus.at(0).get();
  auto writes = [&] {
    std::lock_guard<std::recursive_mutex> g(gpu->mu);
    return gpu->writes;
  };

  // Before llama.cpp marks the buffer: nothing is tracked, no write is reported.
  s->device_written(w, w + 4096);
  EXPECT_FALSE(s->tracks_device_writes());
  EXPECT_TRUE(writes().empty());

  // Not routed (a host buffer's base): not tracked.
  int not_routed = 0;
  s->device_weights_buffer(reinterpret_cast<std::uintptr_t>(&not_routed), sizeof not_routed);
  EXPECT_FALSE(s->tracks_device_writes());

  s->device_weights_buffer(w, 8 * kMiB);
  ASSERT_TRUE(s->tracks_device_writes());
  {
    std::lock_guard<std::recursive_mutex> g(gpu->mu);
    EXPECT_EQ(gpu->tracked, std::set<char*>{static_cast<char*>(weights.ptr)});
  }
  s->device_written(w + 100, w + 200);                     // inside
  s->device_written(w - 50, w + 10);                       // across the start: clipped
  s->device_written(w + 8 * kMiB - 5, w + 8 * kMiB + 99);  // across the end: clipped
  s->device_written(c, c + 4 * kMiB);                      // the compute buffer: not reported
  s->device_written(w + 8 * kMiB, w + 9 * kMiB);           // just past it: not reported
  using W = std::pair<std::uintptr_t, std::size_t>;
  EXPECT_EQ(writes(), (std::vector<W>{{w + 100, 100}, {w, 10}, {w + 8 * kMiB - 5, 5}}));

  // Freed: no longer tracked, and a later allocation at any address is not either.
  EXPECT_TRUE(s->device_free(weights.ptr));
  EXPECT_FALSE(s->tracks_device_writes());
  s->device_written(w, w + 4096);
  EXPECT_EQ(writes().size(), 3u);
  EXPECT_TRUE(s->device_free(compute.ptr));
}

// docs/design.md, "Weights backed by their file": a weight copied from a GGUF mapping into tracked
// device weights is reported as filled from the file (its device, inode and offset, through a
// descriptor valid during the call), so that the backend keeps no pinned copy of it; a copy from
// anywhere else is a write, and so is a copy from a mapping the program unmapped since.
TEST_F(EngineSessionTest, ATensorCopiedFromAModelFileIntoDeviceWeightsIsReportedAsFilledFromThatFile) {
  TempDir dir;
  const std::string path = dir.path() + "/model.gguf";
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  const std::size_t len = 64 * page;
  {
    std::string bytes(len, 'w');
    bytes.replace(0, 4, "GGUF");
    std::FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(std::fwrite(bytes.data(), 1, bytes.size(), f), bytes.size());
    std::fclose(f);
  }
  const int fd = ::open(path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  struct stat st {};
  ASSERT_EQ(::fstat(fd, &st), 0);
  // Mapped from the file's 8th page on, as llama.cpp maps a split model's later part.
  char* map = static_cast<char*>(::mmap(nullptr, len - 8 * page, PROT_READ, MAP_SHARED, fd, 8 * page));
  ASSERT_NE(map, MAP_FAILED);
  auto s = make();
  s->file_mapped(map, len - 8 * page, fd, 8 * page);  // as the mmap hook says it, with the fd open
  ::close(fd);                                        // the session keeps its own descriptor
  using Outcome = EngineSession::DeviceAllocation::Outcome;
  const auto weights = s->device_allocate(0, 8 * kMiB, false);
  ASSERT_EQ(weights.outcome, Outcome::routed);
  const auto w = reinterpret_cast<std::uintptr_t>(weights.ptr);
  s->device_weights_buffer(w, 8 * kMiB);
  auto* gpu = gpus.at(0).get();
  const auto m = reinterpret_cast<std::uintptr_t>(map);

  s->device_filled(w + 128, w + 128 + 3 * page, m + page + 5);  // from the file: page 9, byte 5 on
  std::vector<char> heap(4096, 'h');
  s->device_filled(w + 8192, w + 8192 + 4096, reinterpret_cast<std::uintptr_t>(heap.data()));  // not a file
  s->device_filled(w + 16384, w + 16384 + 2 * page, m + (len - 9 * page));  // runs past the mapping's end
  using Fill = FakeBackend::FileFill;
  using W = std::pair<std::uintptr_t, std::size_t>;
  {
    std::lock_guard<std::recursive_mutex> g(gpu->mu);
    EXPECT_EQ(gpu->fills, (std::vector<Fill>{{w + 128, 3 * page, st.st_dev, st.st_ino, 9 * page + 5}}));
    EXPECT_EQ(gpu->writes, (std::vector<W>{{w + 8192, 4096}, {w + 16384, 2 * page}}));
  }
  // Unmapped by the program: a copy from there is a plain write (the address may be reused).
  ASSERT_EQ(::munmap(map, len - 8 * page), 0);
  s->memory_gone(m, m + len - 8 * page);
  s->device_filled(w + 128, w + 256, m + page);
  {
    std::lock_guard<std::recursive_mutex> g(gpu->mu);
    EXPECT_EQ(gpu->fills.size(), 1u);
    EXPECT_EQ(gpu->writes.back(), (W{w + 128, 128}));
  }
  EXPECT_TRUE(s->device_free(weights.ptr));
}

TEST_F(EngineSessionTest, DeviceAllocationsAreRoutedFrom2MiBAndComputeBuffersAreScratch) {
  auto s = make();
  using Outcome = EngineSession::DeviceAllocation::Outcome;
  EXPECT_EQ(s->device_allocate(0, 2 * kMiB - 1, false).outcome, Outcome::pass_through);
  EXPECT_EQ(s->device_manager(0), nullptr) << "a small allocation starts nothing";
  const auto weights = s->device_allocate(0, 2 * kMiB, false);
  ASSERT_EQ(weights.outcome, Outcome::routed);
  const auto compute = s->device_allocate(0, 8 * kMiB, true);
  ASSERT_EQ(compute.outcome, Outcome::routed);
  ASSERT_NE(s->device_manager(0), nullptr);
  EXPECT_EQ(s->host_manager(), nullptr) << "device memory does not start the host side";
  EXPECT_EQ(s->device_allocate(-1, 8 * kMiB, false).outcome, Outcome::pass_through);
  EXPECT_EQ(s->device_allocate(SessionRules::kMaxDevices, 8 * kMiB, false).outcome, Outcome::pass_through);
  // Classes: the graph allocator's memory is scratch, the rest keeps its contents across a sleep.
  const auto* gpu = gpus.at(0).get();
  std::map<std::uintptr_t, RegionClass> cls;
  {
    std::lock_guard<std::recursive_mutex> g(gpu->mu);
    for (const auto& [id, set] : gpu->sets)
      for (const auto& [rid, r] : set.members) cls[reinterpret_cast<std::uintptr_t>(r.base)] = r.cls;
  }
  EXPECT_EQ(cls.at(reinterpret_cast<std::uintptr_t>(weights.ptr)), RegionClass::weights);
  EXPECT_EQ(cls.at(reinterpret_cast<std::uintptr_t>(compute.ptr)), RegionClass::scratch);
  // A decode is a call on the device's manager too.
  const auto scope = s->decode_began();
  EXPECT_TRUE(scope.devices);
  EXPECT_FALSE(scope.host);
  s->decode_ended(scope, nullptr);
  // Frees: routed pointers are the session's, others the runtime's.
  int other = 0;
  EXPECT_FALSE(s->device_free(&other));
  EXPECT_TRUE(s->device_free(weights.ptr));
  EXPECT_FALSE(s->device_free(weights.ptr)) << "freed once";
  EXPECT_TRUE(s->device_free(compute.ptr));
  EXPECT_TRUE(gpus.at(0)->allocated.empty());
}

// Device memory that cannot be woken (the GPU full, nobody to give way) is never computed on: the
// decode is refused (the hook returns an error from llama_decode) rather than run on unmapped
// memory, which faults on the GPU and aborts the program; said once, and the next decode tries again.
TEST_F(EngineSessionTest, ADecodeIsRefusedWhileItsDeviceMemoryCannotBeWoken) {
  auto s = make();
  const auto weights = s->device_allocate(0, 8 * kMiB, false);
  ASSERT_EQ(weights.outcome, EngineSession::DeviceAllocation::Outcome::routed);
  auto ok = s->decode_began();
  EXPECT_FALSE(ok.device_asleep);
  s->decode_ended(ok, nullptr);
  s->device_manager(0)->release_now();
  gpus.at(0)->device_full = [] { return true; };
  auto refused = s->decode_began();
  EXPECT_TRUE(refused.device_asleep);
  {
    std::lock_guard<std::recursive_mutex> g(gpus.at(0)->mu);
    EXPECT_EQ(gpus.at(0)->resident_bytes(), 0u) << "nothing could be woken";
  }
  s->decode_ended(refused, nullptr);
  EXPECT_TRUE(logs.contains(LogLevel::warn, "the decode is refused with an error rather than run on unmapped memory"));
  gpus.at(0)->device_full = nullptr;  // room again: the next decode wakes it
  auto again = s->decode_began();
  EXPECT_FALSE(again.device_asleep);
  s->decode_ended(again, nullptr);
  EXPECT_TRUE(s->device_free(weights.ptr));
}

TEST_F(EngineSessionTest, EachDeviceGetsItsOwnManagerStartedOnce) {
  auto s = make();
  const auto a = s->device_allocate(1, 4 * kMiB, false);
  const auto b = s->device_allocate(3, 4 * kMiB, false);
  const auto c = s->device_allocate(1, 4 * kMiB, false);
  ASSERT_EQ(a.outcome, EngineSession::DeviceAllocation::Outcome::routed);
  ASSERT_EQ(b.outcome, EngineSession::DeviceAllocation::Outcome::routed);
  ASSERT_EQ(c.outcome, EngineSession::DeviceAllocation::Outcome::routed);
  EXPECT_EQ(backends_asked, (std::vector<int>{1, 3}));
  EXPECT_NE(s->device_manager(1), s->device_manager(3));
  for (void* p : {a.ptr, b.ptr, c.ptr}) EXPECT_TRUE(s->device_free(p));
}

TEST_F(EngineSessionTest, AHostSideThatCannotStartWarnsOnceAndPassesThrough) {
  host_backend_fails = true;
  auto s = make();
  Mapping a(kMiB), b(kMiB);
  buffer(*s, a, BufferUsage::weights);
  buffer(*s, b, BufferUsage::weights);
  s->model_loaded();
  decode(*s);
  EXPECT_EQ(s->host_manager(), nullptr);
  EXPECT_EQ(backends_asked, std::vector<int>{EngineSession::kHost}) << "tried once";
  int warnings = 0;
  for (const auto& [level, line] : logs.lines)
    if (level == LogLevel::warn && line.find("no host backend here; the program runs without residency") != std::string::npos)
      ++warnings;
  EXPECT_EQ(warnings, 1);
}

TEST_F(EngineSessionTest, AForkChildTouchesNothing) {
  auto s = make();
  Mapping w(kMiB);
  buffer(*s, w, BufferUsage::weights);
  s->model_loaded();
  ASSERT_TRUE(s->tracks(w.begin(), w.end()));
  s->forked();
  EXPECT_FALSE(s->tracks(w.begin(), w.end()));
  Mapping other(kMiB);
  buffer(*s, other, BufferUsage::weights);
  s->context_made();
  EXPECT_FALSE(member_at(*host, other.begin()));
  EXPECT_EQ(s->device_allocate(0, 4 * kMiB, false).outcome, EngineSession::DeviceAllocation::Outcome::pass_through);
  const auto scope = s->decode_began();
  EXPECT_FALSE(scope.host);
  EXPECT_FALSE(scope.devices);
}

}  // namespace
}  // namespace residency::preload
