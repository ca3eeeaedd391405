// SPDX-License-Identifier: MIT
// The metal backend on a Mac (macOS 15+, a Metal3 GPU): what the system's wired memory does
// when residency sets are created, requested and ended, with the real manager on the real
// clock. Skips with its reason elsewhere. Compile-checked on Linux by scripts/metal-check; it
// has not run on Apple hardware yet.
#include <Foundation/Foundation.hpp>
#include <Metal/Metal.hpp>

#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

extern char** environ;

#include "metal/metal_test_support.hpp"
#include "residency/residency.hpp"

namespace residency {
namespace {

using namespace std::chrono_literals;
using metal_test::eventually;
using metal_test::gives_back;
using metal_test::grew_by_about;
using metal_test::HostMemory;
using metal_test::kGiveBackShare;
using metal_test::kGiveBackWithin;
using metal_test::kMiB;
using metal_test::kRegionBytes;
using metal_test::wired_now;

std::shared_ptr<MetalBackend> backend_with(MetalOptions o = {}) {
  auto b = make_metal_backend(std::move(o));
  EXPECT_TRUE(b) << b.message();
  return b ? *b : nullptr;
}

RegionDesc host_region(RegionId id, const HostMemory& m) {
  RegionDesc d;
  d.id = id;
  d.base = m.base();
  d.size = m.size();
  return d;
}

// Waits for wired memory to grow by about `bytes` over `before`; returns the peak.
std::uint64_t wait_wired(std::uint64_t before, std::uint64_t bytes) {
  std::uint64_t now = before;
  eventually(10s, [&] {
    now = wired_now();
    return grew_by_about(before, now, bytes);
  });
  EXPECT_TRUE(grew_by_about(before, now, bytes));
  return now;
}

std::unique_ptr<Manager> manager_on(std::shared_ptr<Backend> backend, KeepAlive keep_alive) {
  ManagerOptions o;
  o.config.keep_alive = keep_alive;
  o.config.layout = Layout::per_buffer;
  o.backend = std::move(backend);
  auto m = Manager::create(std::move(o));
  EXPECT_TRUE(m) << m.message();
  return m ? std::move(m.value()) : nullptr;
}

// Sets created, requested and ended: requestResidency wires the registered bytes (the 1-byte blit
// at initialisation ran), endResidency gives at least 75 % of them back within 10 s.
TEST(MetalBackend, RequestWiresAndEndGivesBack) {
  RESIDENCY_METAL_REQUIRE();
  auto backend = backend_with();
  ASSERT_TRUE(backend);
  HostMemory mem(kRegionBytes);
  ASSERT_TRUE(mem.ok());
  ASSERT_TRUE(backend->create_set(1, mem.size()));
  backend->add_region(1, host_region(1, mem));
  ASSERT_TRUE(backend->commit(1).ok());

  const std::uint64_t before = wired_now();
  ASSERT_TRUE(backend->request_residency(1).ok());
  const std::uint64_t peak = wait_wired(before, mem.size());
  ASSERT_TRUE(backend->end_residency(1));
  backend->after_release();
  EXPECT_TRUE(gives_back(before, peak, kGiveBackShare, kGiveBackWithin));
  EXPECT_TRUE(backend->destroy_set(1));
}

TEST(MetalBackend, UnknownSetsAndDuplicatesAreErrors) {
  RESIDENCY_METAL_REQUIRE();
  auto backend = backend_with();
  ASSERT_TRUE(backend);
  EXPECT_EQ(backend->commit(7).status.code(), ErrorCode::not_found);
  EXPECT_EQ(backend->request_residency(7).status.code(), ErrorCode::not_found);
  EXPECT_EQ(backend->end_residency(7).code(), ErrorCode::not_found);
  ASSERT_TRUE(backend->create_set(7, 0));
  EXPECT_EQ(backend->create_set(7, 0).code(), ErrorCode::invalid_argument);
  // Host memory that does not start on a page cannot be wrapped without a copy: refused, named.
  std::vector<std::uint8_t> heap(3 * static_cast<std::size_t>(getpagesize()));
  RegionDesc d;
  d.id = 9;
  d.base = heap.data() + (reinterpret_cast<std::uintptr_t>(heap.data()) % getpagesize() == 0 ? 1 : 0);
  d.size = 100;
  backend->add_region(7, d);
  const SetOutcome out = backend->commit(7);
  ASSERT_EQ(out.failed.size(), 1u);
  EXPECT_NE(out.status.message().find("does not start on a page"), std::string::npos) << out.status.message();
  EXPECT_TRUE(backend->destroy_set(7));
}

// Attached to a command queue, at most 32 sets (MLX's kMaxSets): the 33rd is refused with the
// limit named, and a queue cannot be added while more sets exist than it accepts.
TEST(MetalBackend, QueueAttachmentAndTheSetLimit) {
  RESIDENCY_METAL_REQUIRE();
  MetalOptions o;
  o.attach_to_queues = true;
  auto backend = backend_with(o);
  ASSERT_TRUE(backend);
  EXPECT_EQ(backend->capabilities().max_sets, kMetalMaxSetsPerQueue);
  auto* device = static_cast<MTL::Device*>(backend->device());
  NS::SharedPtr<MTL::CommandQueue> queue = NS::TransferPtr(device->newCommandQueue());
  ASSERT_TRUE(queue);
  EXPECT_EQ(backend->add_command_queue(nullptr).code(), ErrorCode::invalid_argument);
  ASSERT_TRUE(backend->add_command_queue(queue.get()));
  for (SetId s = 0; s < kMetalMaxSetsPerQueue; ++s) ASSERT_TRUE(backend->create_set(s, 0)) << "set " << s;
  const Status over = backend->create_set(kMetalMaxSetsPerQueue, 0);
  EXPECT_EQ(over.code(), ErrorCode::limit_exceeded);
  EXPECT_NE(over.message().find("at most 32"), std::string::npos) << over.message();

  ASSERT_TRUE(backend->remove_command_queue(queue.get()));
  EXPECT_EQ(backend->remove_command_queue(queue.get()).code(), ErrorCode::not_found);
  ASSERT_TRUE(backend->create_set(kMetalMaxSetsPerQueue, 0));  // no queue: no limit
  EXPECT_EQ(backend->add_command_queue(queue.get()).code(), ErrorCode::limit_exceeded);
  for (SetId s = 0; s <= kMetalMaxSetsPerQueue; ++s) EXPECT_TRUE(backend->destroy_set(s));
  EXPECT_TRUE(backend->add_command_queue(queue.get()));
}

// A mapping larger than maxBufferLength (virtual memory only: nothing is touched or wired) is
// split by the view planner into views no longer than maxBufferLength, each a no-copy buffer
// over the mapping itself, with every tensor whole in one of them.
TEST(MetalHostViews, MappingLargerThanMaxBufferLength) {
  RESIDENCY_METAL_REQUIRE();
  const MetalDeviceInfo dev = read_metal_device_info();
  ASSERT_TRUE(dev.found);
  const auto page = static_cast<std::uint64_t>(getpagesize());
  const std::uint64_t max_len = dev.max_buffer_length / page * page;
  const std::uint64_t size = max_len + 256 * kMiB;
  void* base = mmap(nullptr, size, PROT_READ, MAP_ANON | MAP_PRIVATE, -1, 0);
  ASSERT_NE(base, MAP_FAILED) << "reserving " << size / kMiB << " MiB of address space";
  // Tensors straddling where a plain split would cut, and one at the very end.
  const std::vector<Extent> tensors{{0, 64 * kMiB},
                                    {max_len - 32 * kMiB + 96, 64 * kMiB},
                                    {max_len - 8, 16},
                                    {size - 128 * kMiB, 128 * kMiB}};
  auto backend = backend_with();
  ASSERT_TRUE(backend);
  {
    auto views = MetalHostViews::make(backend->device(), base, size, tensors);
    ASSERT_TRUE(views) << views.message();
    const auto& vs = views->views();
    ASSERT_GE(vs.size(), 2u);
    for (std::size_t i = 0; i < vs.size(); ++i) {
      auto* b = static_cast<MTL::Buffer*>(views->buffer(i));
      ASSERT_NE(b, nullptr);
      EXPECT_LE(vs[i].length, max_len);
      EXPECT_EQ(b->length(), vs[i].length);
      EXPECT_EQ(b->contents(), static_cast<std::uint8_t*>(base) + vs[i].offset) << "view " << i << " is a copy";
    }
    for (const Extent& t : tensors) EXPECT_TRUE(find_view(vs, t).has_value()) << "tensor at " << t.offset;
  }  // the buffers go before the mapping
  munmap(base, size);
}

// The same split, made small (views capped at 64 MiB), wired for real: a region registered as
// the array of its overlapping views wires its pages once (about its size, not the views' sum),
// and every tensor is read from one view by a kernel-sized check (contents of the view).
TEST(MetalHostViews, OverlappingViewsWireTheMappingOnce) {
  RESIDENCY_METAL_REQUIRE();
  HostMemory mem(kRegionBytes);
  ASSERT_TRUE(mem.ok());
  std::vector<Extent> tensors;
  for (std::uint64_t off = 3 * kMiB; off + 5 * kMiB < mem.size(); off += 37 * kMiB) tensors.push_back({off, 5 * kMiB});
  auto backend = backend_with();
  ASSERT_TRUE(backend);
  auto views = MetalHostViews::make(backend->device(), mem.base(), mem.size(), tensors, 64 * kMiB);
  ASSERT_TRUE(views) << views.message();
  std::uint64_t sum = 0;
  for (const View& v : views->views()) sum += v.length;
  ASSERT_GT(sum, mem.size()) << "the views should overlap";
  for (const Extent& t : tensors) {
    const auto i = find_view(views->views(), t);
    ASSERT_TRUE(i.has_value());
    const auto* contents = static_cast<const std::uint8_t*>(static_cast<MTL::Buffer*>(views->buffer(*i))->contents());
    EXPECT_EQ(contents[t.offset - views->views()[*i].offset], 0x5a);
  }

  auto m = manager_on(backend, KeepAlive::forever());
  ASSERT_TRUE(m);
  const std::uint64_t before = wired_now();
  auto id = m->register_region(mem.base(), mem.size(), RegionClass::weights, 0, views->array());
  ASSERT_TRUE(id) << id.message();
  m->touch();
  const std::uint64_t peak = wait_wired(before, mem.size());
  ASSERT_TRUE(m->unregister_region(*id));
  EXPECT_TRUE(gives_back(before, peak, kGiveBackShare, kGiveBackWithin));
}

// The backend's own wrap of host memory, split because the view length is capped.
TEST(MetalBackend, HostRegionSplitIntoViewsIsWired) {
  RESIDENCY_METAL_REQUIRE();
  MetalOptions o;
  o.max_view_length = 64 * kMiB;
  auto backend = backend_with(o);
  ASSERT_TRUE(backend);
  HostMemory mem(kRegionBytes);
  ASSERT_TRUE(mem.ok());
  auto m = manager_on(backend, KeepAlive::forever());
  ASSERT_TRUE(m);
  const std::uint64_t before = wired_now();
  auto id = m->register_region(mem.base(), mem.size());
  ASSERT_TRUE(id) << id.message();
  m->touch();
  const std::uint64_t peak = wait_wired(before, mem.size());
  m.reset();  // teardown with the region still registered: released and reported, no abort
  EXPECT_TRUE(gives_back(before, peak, kGiveBackShare, kGiveBackWithin));
}

// Teardown in any order: the backend dropped with a requested set (its destructor ends and
// frees it), a queue removed before the sets on it, a manager outliving the caller's backend
// pointer.
TEST(MetalBackend, TeardownInAnyOrder) {
  RESIDENCY_METAL_REQUIRE();
  HostMemory mem(kRegionBytes);
  ASSERT_TRUE(mem.ok());
  {
    MetalOptions o;
    o.attach_to_queues = true;
    auto backend = backend_with(o);
    ASSERT_TRUE(backend);
    NS::SharedPtr<MTL::CommandQueue> queue = NS::TransferPtr(
        static_cast<MTL::Device*>(backend->device())->newCommandQueue());
    ASSERT_TRUE(backend->add_command_queue(queue.get()));
    ASSERT_TRUE(backend->create_set(1, mem.size()));
    backend->add_region(1, host_region(1, mem));
    ASSERT_TRUE(backend->commit(1).ok());
    const std::uint64_t before = wired_now();
    ASSERT_TRUE(backend->request_residency(1).ok());
    const std::uint64_t peak = wait_wired(before, mem.size());
    ASSERT_TRUE(backend->remove_command_queue(queue.get()));  // queue first, set still requested
    queue.reset();
    backend.reset();  // the backend last, with the set requested
    EXPECT_TRUE(gives_back(before, peak, kGiveBackShare, kGiveBackWithin));
  }
  {
    auto backend = backend_with();
    ASSERT_TRUE(backend);
    auto m = manager_on(backend, KeepAlive::forever());
    ASSERT_TRUE(m);
    backend.reset();  // the caller's pointer first: the manager's share keeps the backend alive
    const std::uint64_t before = wired_now();
    ASSERT_TRUE(m->register_region(mem.base(), mem.size()));
    m->touch();
    const std::uint64_t peak = wait_wired(before, mem.size());
    m.reset();
    EXPECT_TRUE(gives_back(before, peak, kGiveBackShare, kGiveBackWithin));
  }
}

// Keep-alive expiry on the real clock (the one real-clock test of the suite): wired while used,
// given back after 1 s without a use, wired again by the next use.
TEST(MetalManager, KeepAliveExpiresOnTheRealClock) {
  RESIDENCY_METAL_REQUIRE();
  auto backend = backend_with();
  ASSERT_TRUE(backend);
  HostMemory mem(kRegionBytes);
  ASSERT_TRUE(mem.ok());
  auto m = manager_on(backend, KeepAlive::after(1s));
  ASSERT_TRUE(m);
  const std::uint64_t before = wired_now();
  auto id = m->register_region(mem.base(), mem.size());
  ASSERT_TRUE(id) << id.message();
  m->touch();
  const std::uint64_t peak = wait_wired(before, mem.size());
  EXPECT_TRUE(m->stats().resident);
  EXPECT_TRUE(eventually(5s, [&] { return m->stats().releases == 1; })) << "the keep-alive did not expire";
  EXPECT_FALSE(m->stats().resident);
  EXPECT_TRUE(gives_back(before, peak, kGiveBackShare, kGiveBackWithin));
  const std::uint64_t low = wired_now();
  m->touch();
  EXPECT_EQ(m->stats().rewires, 1u);
  wait_wired(low, mem.size());
  ASSERT_TRUE(m->unregister_region(*id));
}

// The pressure watch starts on the dispatch source, serves several watchers and stops at once.
// Real pressure is opt-in (RESIDENCY_METAL_PRESSURE_TEST=1, as root): `memory_pressure -l warn`
// allocates until the system reports warn (gigabytes on a large Mac), and the watcher must be
// called within 60 s.
TEST(MetalBackend, PressureWatch) {
  RESIDENCY_METAL_REQUIRE();
  auto backend = backend_with();
  ASSERT_TRUE(backend);
  std::atomic<int> calls{0};
  const auto level_before = read_apple_system_info().pressure_level;
  auto a = backend->watch_pressure([&] { ++calls; });
  ASSERT_TRUE(a) << a.message();
  auto b = backend->watch_pressure([&] { ++calls; });
  ASSERT_TRUE(b) << b.message();
  backend->stop_pressure_watch(*a);
  backend->stop_pressure_watch(*a);  // twice: no effect
  const auto level_after = read_apple_system_info().pressure_level;
  ASSERT_TRUE(level_after.has_value());
  EXPECT_TRUE(*level_after == "normal" || *level_after == "warn" || *level_after == "critical") << *level_after;
  if (level_before == std::optional<std::string>("normal") && level_after == level_before) {
    EXPECT_EQ(calls.load(), 0) << "called although the system reported no pressure while watched";
  }

  const char* opt_in = std::getenv("RESIDENCY_METAL_PRESSURE_TEST");
  if (opt_in == nullptr || std::string(opt_in) != "1" || geteuid() != 0) {
    backend->stop_pressure_watch(*b);
    GTEST_SKIP() << "real pressure not applied: set RESIDENCY_METAL_PRESSURE_TEST=1 and run as root "
                    "(sudo) to have `memory_pressure -l warn` drive the system to warn";
  }
  pid_t pid = 0;
  char arg0[] = "memory_pressure", arg1[] = "-l", arg2[] = "warn";
  char* argv[] = {arg0, arg1, arg2, nullptr};
  ASSERT_EQ(posix_spawn(&pid, "/usr/bin/memory_pressure", nullptr, nullptr, argv, environ), 0);
  const bool reported = eventually(60s, [&] { return calls.load() > 0; });
  kill(pid, SIGINT);
  int status = 0;
  waitpid(pid, &status, 0);
  backend->stop_pressure_watch(*b);
  EXPECT_TRUE(reported) << "no pressure report within 60 s of `memory_pressure -l warn`";
}

TEST(MetalSystem, StatFiguresAreRead) {
  RESIDENCY_METAL_REQUIRE();
  const AppleSystemInfo sys = read_apple_system_info();
  ASSERT_TRUE(sys.physical && sys.wired) << (sys.problems.empty() ? "" : sys.problems.front());
  EXPECT_GT(*sys.wired, 0u);
  EXPECT_LT(*sys.wired, *sys.physical);
  EXPECT_TRUE(sys.iogpu_wired_limit_mb.has_value()) << "iogpu.wired_limit_mb exists from macOS 14";
  const MetalDeviceInfo dev = read_metal_device_info();
  ASSERT_TRUE(dev.found);
  EXPECT_GT(dev.recommended_working_set, 0u);
  EXPECT_LE(dev.recommended_working_set, *sys.physical);
  EXPECT_TRUE(dev.residency_sets.available);
}

}  // namespace
}  // namespace residency
