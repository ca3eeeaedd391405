// SPDX-License-Identifier: MIT
// The CUDA preload's driver wrappers, as a program obtains them through cuGetProcAddress
// (wrap_driver), in front of a ProgramSession over the real cuda backend and HostGpu (one device
// emulated in host memory: unmapped device memory faults, copies to it fail). The "real" functions
// behind the wrappers are HostGpu's, or a test's own where HostGpu has none (launches). What is
// asserted is what the program would see: its allocation at the same address with the same bytes
// after a sleep, the device range mapped when its launch or copy runs, the device memory given back
// while asleep, and what a sleep copies.
#include <gtest/gtest.h>

#include <cudaTypedefs.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backends/cuda/cuda_backend.hpp"
#include "backends/cuda/cuda_process.hpp"
#include "backends/cuda/program_mappings.hpp"
#include "cudapreload/cuda_hooks.hpp"
#include "residency/shared_budget.hpp"
#include "support/fake_backend.hpp"
#include "support/host_gpu.hpp"

namespace residency::cudapreload {
namespace {

using cuda::ContextScope;
using cuda::CudaBackend;
using cuda::testing::HostGpu;

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr int kVersion = 12080;  // what a CUDA 12.8 runtime asks for

HostGpu& gpu() { return HostGpu::instance(); }

// The test's session, and what the "real" functions saw (the wrappers are process-wide: the same
// real functions in every test).
ProgramSession* g_session = nullptr;
cuda::ProgramMappings* g_mappings = nullptr;
std::atomic<int> g_real_allocs{0};
std::atomic<std::uint64_t> g_mapped_at_launch{0};
CUdeviceptr g_launch_reads = 0;
std::size_t g_launch_bytes = 0;
std::atomic<int> g_ipc_calls{0};

CUresult CUDAAPI real_alloc(CUdeviceptr* p, size_t n) {
  ++g_real_allocs;
  return gpu().driver().cuMemAlloc(p, n);
}
// A kernel that reads its buffer: what of it the device maps when it runs.
std::atomic<int> g_launches{0};
CUresult CUDAAPI real_launch(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                             void**, void**) {
  ++g_launches;
  g_mapped_at_launch = gpu().mapped_bytes(g_launch_reads, g_launch_bytes);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI real_graph_launch(CUgraphExec, CUstream) {
  g_mapped_at_launch = gpu().mapped_bytes(g_launch_reads, g_launch_bytes);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI real_begin_capture(CUstream, CUstreamCaptureMode) {
  g_mapped_at_launch = gpu().mapped_bytes(g_launch_reads, g_launch_bytes);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI real_end_capture(CUstream, CUgraph*) { return CUDA_SUCCESS; }
// Three functions of one ABI, as the driver's default-stream and per-thread variants are two.
// (cuLaunchKernelEx: no other test of this process binds it)
CUresult CUDAAPI variant_a(const CUlaunchConfig*, CUfunction, void**, void**) { return CUDA_SUCCESS; }
CUresult CUDAAPI variant_b(const CUlaunchConfig*, CUfunction, void**, void**) { return CUDA_ERROR_NOT_READY; }
CUresult CUDAAPI variant_c(const CUlaunchConfig*, CUfunction, void**, void**) { return CUDA_ERROR_NOT_FOUND; }
CUresult CUDAAPI real_managed(CUdeviceptr*, size_t, unsigned) { return CUDA_ERROR_NOT_SUPPORTED; }
CUresult CUDAAPI real_ipc(CUipcMemHandle*, CUdeviceptr) {
  ++g_ipc_calls;
  return CUDA_SUCCESS;
}

class CudaHooksTest : public ::testing::Test {
 protected:
  ManualClock clock{Nanos(std::chrono::hours(1))};
  std::shared_ptr<CudaBackend> backend;
  std::shared_ptr<cuda::ProgramMappings> mappings;
  std::unique_ptr<ProgramSession> session;
  testing::LogCapture logs;

  std::uint64_t device_bytes_ = std::uint64_t{4} << 30;  // HostGpu's default
  void SetUp() override {
    HostGpu::Config gc;
    gc.capacity = device_bytes_;
    gpu().reset(gc);
    g_real_allocs = 0;
    g_ipc_calls = 0;
    CudaBackendOptions o;
    o.chunk_bytes = 8 * kMiB;
    auto made = CudaBackend::create(o, gpu().driver());
    ASSERT_TRUE(made) << made.message();
    backend = *made;
    auto pm = cuda::ProgramMappings::create(gpu().driver(), 0);
    ASSERT_TRUE(pm) << pm.message();
    mappings = *pm;
    g_mappings = mappings.get();
    ProgramSession::Options so;
    so.config.keep_alive = KeepAlive::after(std::chrono::seconds(10));
    so.config.release_on_pressure = false;
    so.config.log_level = LogLevel::debug;
    so.backends = [this](int, const Config&) -> Result<std::shared_ptr<Backend>> {
      return std::shared_ptr<Backend>(backend);
    };
    so.mapping_backends = [this](int, const Config&) -> Result<std::shared_ptr<Backend>> {
      return std::shared_ptr<Backend>(mappings);
    };
    so.clock = &clock;
    so.log = [this](LogLevel l, std::string_view line) { logs.callback()(l, line); };
    so.start_schedulers = false;
    session = std::make_unique<ProgramSession>(std::move(so));
    g_session = session.get();
    HookEnv env;
    env.mappings = [](int) noexcept { return g_mappings; };
    env.session = []() noexcept { return g_session; };
    env.driver_device = []() noexcept { return 0; };
    env.warn_once = [](int, const char* line) noexcept { g_session->log().warn(line); };
    set_hook_env(env);
  }
  void TearDown() override {
    set_hook_env(HookEnv{});
    session.reset();
    g_session = nullptr;
    mappings.reset();
    g_mappings = nullptr;
    backend.reset();
    EXPECT_EQ(gpu().live(), "") << "everything the backend made is given back";
  }

  template <class Fn>
  static Fn wrapped(const char* name, Fn real) {
    return reinterpret_cast<Fn>(wrap_driver(name, kVersion, false, reinterpret_cast<void*>(real)));
  }
  // The keep-alive runs out.
  void idle() {
    clock.advance(std::chrono::seconds(11));
    session->manager(0)->run_due();
  }
  ContextScope context() { return ContextScope(gpu().driver(), backend->context()); }

  static std::vector<char> pattern(std::size_t n, char seed) {
    std::vector<char> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<char>(seed + static_cast<char>(i * 131 % 251));
    return v;
  }
};

TEST_F(CudaHooksTest, OnlyTheHookedFunctionsAtTheirAbiAreWrapped) {
  const auto real = reinterpret_cast<void*>(&real_alloc);
  EXPECT_NE(wrap_driver("cuMemAlloc", kVersion, false, real), real);
  EXPECT_EQ(wrap_driver("cuMemAlloc", 3010, false, real), real) << "before 3.2 it had another ABI (32-bit sizes)";
  EXPECT_EQ(wrap_driver("cuCtxCreate", kVersion, false, real), real) << "not hooked";
  EXPECT_EQ(wrap_driver(nullptr, kVersion, false, real), real);
  EXPECT_EQ(wrap_driver("cuMemAlloc", kVersion, false, nullptr), nullptr);
  EXPECT_TRUE(hooks_driver_function("cuLaunchKernel"));
  EXPECT_TRUE(hooks_driver_function("cuGraphLaunch"));
  EXPECT_FALSE(hooks_driver_function("cuMemAlloc_v2")) << "cuGetProcAddress names functions without the suffix";
  EXPECT_FALSE(session->stood_aside());
}

TEST_F(CudaHooksTest, AnAllocationSleepsAndWakesAtItsAddressWithItsBytesWhenTheProgramCopiesFromIt) {
  const auto alloc = wrapped("cuMemAlloc", &real_alloc);
  const auto free_ = wrapped("cuMemFree", gpu().driver().cuMemFree);
  const auto htod = wrapped("cuMemcpyHtoD", gpu().driver().cuMemcpyHtoD);
  const auto dtoh = wrapped("cuMemcpyDtoH", gpu().driver().cuMemcpyDtoH);
  const std::size_t n = 24 * kMiB;
  CUdeviceptr p = 0;
  ASSERT_EQ(alloc(&p, n), CUDA_SUCCESS);
  EXPECT_EQ(g_real_allocs, 0) << "routed: the driver's own cuMemAlloc was not called";
  EXPECT_EQ(gpu().mapped_bytes(p, n), n);
  const auto bytes = pattern(n, 3);
  {
    auto c = context();
    ASSERT_EQ(htod(p, bytes.data(), n), CUDA_SUCCESS);
  }
  const std::uint64_t used_awake = gpu().used();
  idle();
  EXPECT_EQ(gpu().mapped_bytes(p, n), 0u) << "asleep: nothing mapped at its address";
  EXPECT_LE(gpu().used() + n, used_awake) << "the device memory went back to the driver";

  std::vector<char> back(n);
  {
    auto c = context();
    ASSERT_EQ(dtoh(back.data(), p, n), CUDA_SUCCESS) << "the copy woke the memory first";
  }
  EXPECT_EQ(gpu().mapped_bytes(p, n), n);
  EXPECT_TRUE(back == bytes) << "the same bytes at the same address";

  {
    auto c = context();
    CUdeviceptr small = 0;
    ASSERT_EQ(alloc(&small, kMiB), CUDA_SUCCESS);
    EXPECT_EQ(g_real_allocs, 1) << "below 2 MiB: the driver's";
    EXPECT_EQ(free_(small), CUDA_SUCCESS);
  }
  EXPECT_EQ(free_(p), CUDA_SUCCESS);
  EXPECT_EQ(session->routed_bytes(), 0u);
}

TEST_F(CudaHooksTest, ALaunchWhileAsleepRunsOnMappedMemory) {
  const auto alloc = wrapped("cuMemAlloc", &real_alloc);
  const auto launch = wrapped("cuLaunchKernel", &real_launch);
  const auto graph = wrapped("cuGraphLaunch", &real_graph_launch);
  const std::size_t n = 16 * kMiB;
  CUdeviceptr p = 0;
  ASSERT_EQ(alloc(&p, n), CUDA_SUCCESS);
  g_launch_reads = p;
  g_launch_bytes = n;
  idle();
  ASSERT_EQ(gpu().mapped_bytes(p, n), 0u);
  ASSERT_EQ(launch(nullptr, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr), CUDA_SUCCESS);
  EXPECT_EQ(g_mapped_at_launch, n) << "the kernel ran on mapped memory";
  idle();
  ASSERT_EQ(gpu().mapped_bytes(p, n), 0u);
  g_mapped_at_launch = 0;
  ASSERT_EQ(graph(nullptr, nullptr), CUDA_SUCCESS);
  EXPECT_EQ(g_mapped_at_launch, n) << "a graph launch wakes it first too";
  ASSERT_EQ(session->free(reinterpret_cast<void*>(p)), true);
}

// A wake the device cannot serve (it is full of another program's memory): the launch fails with
// out of memory, and never reaches the driver on memory that is not there (on a GPU: an illegal
// address, which ruins the context for good).
class CudaHooksSmallGpuTest : public CudaHooksTest {
 protected:
  void SetUp() override {
    device_bytes_ = std::uint64_t{96} << 20;  // room for one 64 MiB allocation, not two
    CudaHooksTest::SetUp();
  }
};

TEST_F(CudaHooksSmallGpuTest, ALaunchWhoseWakeFailsIsRefusedWithOutOfMemoryNotRunUnmapped) {
  const auto alloc = wrapped("cuMemAlloc", &real_alloc);
  const auto launch = wrapped("cuLaunchKernel", &real_launch);
  const std::size_t n = 64 * kMiB;
  CUdeviceptr p = 0;
  ASSERT_EQ(alloc(&p, n), CUDA_SUCCESS);
  idle();
  ASSERT_EQ(gpu().mapped_bytes(p, n), 0u);
  CUdeviceptr other = 0;  // another program takes the device's memory meanwhile
  {
    auto c = context();
    ASSERT_EQ(gpu().driver().cuMemAlloc(&other, 64 * kMiB), CUDA_SUCCESS);
  }
  g_launches = 0;
  EXPECT_EQ(launch(nullptr, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr), CUDA_ERROR_OUT_OF_MEMORY);
  EXPECT_EQ(g_launches, 0) << "the kernel was not launched on unmapped memory";
  EXPECT_TRUE(logs.contains(LogLevel::warn, "fails with out of memory instead of running on memory that is not there"));
  {
    auto c = context();
    ASSERT_EQ(gpu().driver().cuMemFree(other), CUDA_SUCCESS);
  }
  EXPECT_EQ(launch(nullptr, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr), CUDA_SUCCESS) << "room again: it wakes";
  EXPECT_EQ(g_launches, 1);
  EXPECT_TRUE(session->free(reinterpret_cast<void*>(p)));
}

TEST_F(CudaHooksTest, AGraphCaptureBeginsOnMappedMemoryAndNothingSleepsUntilItEnds) {
  const auto alloc = wrapped("cuMemAlloc", &real_alloc);
  const auto begin = wrapped("cuStreamBeginCapture", &real_begin_capture);
  const auto end = wrapped("cuStreamEndCapture", &real_end_capture);
  const std::size_t n = 16 * kMiB;
  CUdeviceptr p = 0;
  ASSERT_EQ(alloc(&p, n), CUDA_SUCCESS);
  g_launch_reads = p;
  g_launch_bytes = n;
  idle();
  ASSERT_EQ(gpu().mapped_bytes(p, n), 0u);
  g_mapped_at_launch = 0;
  auto* stream = reinterpret_cast<CUstream>(std::uintptr_t{0x5e});
  ASSERT_EQ(begin(stream, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
  EXPECT_EQ(g_mapped_at_launch, n) << "awake when the capture begins";
  idle();
  EXPECT_EQ(gpu().mapped_bytes(p, n), n) << "nothing sleeps during the capture";
  CUgraph graph = nullptr;
  ASSERT_EQ(end(stream, &graph), CUDA_SUCCESS);
  idle();
  EXPECT_EQ(gpu().mapped_bytes(p, n), 0u) << "after it, the keep-alive again";
  EXPECT_TRUE(session->free(reinterpret_cast<void*>(p)));
}

// PyTorch's expandable segments: the program reserves a range, creates physical memory, maps it and
// sets its access itself. Its mapping sleeps (the physical memory given back to the device) and
// wakes at the same address with the same bytes, through the program's own handle; its unmap and
// release, awake or after the release of a handle still mapped while asleep, leave nothing behind.
TEST_F(CudaHooksTest, MemoryTheProgramMapsItselfSleepsAndWakesAtItsAddressUnderItsHandle) {
  const auto create = wrapped("cuMemCreate", gpu().driver().cuMemCreate);
  const auto map = wrapped("cuMemMap", gpu().driver().cuMemMap);
  const auto set_access = wrapped("cuMemSetAccess", gpu().driver().cuMemSetAccess);
  const auto unmap = wrapped("cuMemUnmap", gpu().driver().cuMemUnmap);
  const auto release = wrapped("cuMemRelease", gpu().driver().cuMemRelease);
  const auto htod = wrapped("cuMemcpyHtoD", gpu().driver().cuMemcpyHtoD);
  const auto dtoh = wrapped("cuMemcpyDtoH", gpu().driver().cuMemcpyDtoH);
  const std::size_t n = 20 * kMiB;
  CUdeviceptr va = 0;
  ASSERT_EQ(gpu().driver().cuMemAddressReserve(&va, 2 * n, 0, 0, 0), CUDA_SUCCESS);
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUmemGenericAllocationHandle h1 = 0, h2 = 0;
  const auto bytes = pattern(n, 7);
  {
    auto c = context();
    ASSERT_EQ(create(&h1, n, &prop, 0), CUDA_SUCCESS);
    ASSERT_EQ(create(&h2, n, &prop, 0), CUDA_SUCCESS);
    ASSERT_EQ(map(va, n, 0, h1, 0), CUDA_SUCCESS);
    ASSERT_EQ(map(va + n, n, 0, h2, 0), CUDA_SUCCESS);
    ASSERT_EQ(set_access(va, 2 * n, &access, 1), CUDA_SUCCESS);
    ASSERT_EQ(htod(va, bytes.data(), n), CUDA_SUCCESS);
    ASSERT_EQ(htod(va + n, bytes.data(), n), CUDA_SUCCESS);
  }
  EXPECT_EQ(session->mapping_bytes(), 2 * n);
  auto& process = cuda::CudaProcess::instance();
  const std::uint64_t books_awake = process.mapped(0);  // what a GPU budget counts as the backends'
  EXPECT_GE(books_awake, 2 * n) << "the program's mappings are in the backends' books, not 'unmanaged'";
  const std::uint64_t used_awake = gpu().used();
  clock.advance(std::chrono::seconds(11));
  session->mapping_manager(0)->run_due();
  EXPECT_EQ(gpu().mapped_bytes(va, 2 * n), 0u) << "asleep: nothing mapped at the program's addresses";
  EXPECT_LE(gpu().used() + 2 * n, used_awake) << "its physical memory went back to the device";
  EXPECT_EQ(mappings->asleep(), 2u);
  EXPECT_EQ(process.mapped(0), books_awake - 2 * n);

  // The program releases one handle while its mapping sleeps (as it may while mapped).
  EXPECT_EQ(release(h2), CUDA_SUCCESS);
  std::vector<char> back(n);
  {
    auto c = context();
    ASSERT_EQ(dtoh(back.data(), va, n), CUDA_SUCCESS) << "the copy woke it first";
  }
  EXPECT_TRUE(back == bytes) << "the same bytes at the same address";
  EXPECT_EQ(gpu().mapped_bytes(va, 2 * n), 2 * n);
  {
    auto c = context();
    ASSERT_EQ(dtoh(back.data(), va + n, n), CUDA_SUCCESS);
  }
  EXPECT_TRUE(back == bytes) << "the released-while-mapped handle's memory too, until its unmap";
  {
    auto c = context();
    ASSERT_EQ(unmap(va, 2 * n), CUDA_SUCCESS);
    ASSERT_EQ(release(h1), CUDA_SUCCESS);
  }
  EXPECT_EQ(session->mapping_bytes(), 0u);
  EXPECT_EQ(process.mapped(0), books_awake - 2 * n) << "unmapped: out of the books";
  ASSERT_EQ(gpu().driver().cuMemAddressFree(va, 2 * n), CUDA_SUCCESS);
  EXPECT_EQ(gpu().used(), used_awake - 2 * n) << "both physical handles are gone, none twice";
}

TEST_F(CudaHooksTest, AWeightsRegionIsCopiedAtItsFirstSleepThenOnlyWhereTheProgramWrote) {
  const auto alloc = wrapped("cuMemAlloc", &real_alloc);
  const auto htod = wrapped("cuMemcpyHtoD", gpu().driver().cuMemcpyHtoD);
  const auto memset8 = wrapped("cuMemsetD8", gpu().driver().cuMemsetD8);
  const auto dtoh = wrapped("cuMemcpyDtoH", gpu().driver().cuMemcpyDtoH);
  const std::size_t n = 32 * kMiB;  // four 8 MiB chunks
  CUdeviceptr w = 0, k = 0;
  ASSERT_TRUE(push_region(Tag::weights));
  ASSERT_EQ(alloc(&w, n), CUDA_SUCCESS);
  ASSERT_TRUE(pop_region());
  ASSERT_EQ(alloc(&k, n), CUDA_SUCCESS);  // no region: its writes cannot be known
  auto bytes = pattern(n, 9);
  {
    auto c = context();
    ASSERT_EQ(htod(w, bytes.data(), n), CUDA_SUCCESS);
    ASSERT_EQ(htod(k, bytes.data(), n), CUDA_SUCCESS);
  }
  std::uint64_t before = backend->bytes_copied_to_host();
  idle();
  EXPECT_EQ(backend->bytes_copied_to_host() - before, 2 * n) << "the first sleep copies both";

  {
    auto c = context();
    ASSERT_EQ(memset8(w + 9 * kMiB, 0x5a, 4096), CUDA_SUCCESS);  // wakes both; writes one chunk of w
  }
  std::memset(bytes.data() + 9 * kMiB, 0x5a, 4096);
  before = backend->bytes_copied_to_host();
  idle();
  EXPECT_EQ(backend->bytes_copied_to_host() - before, n + 8 * kMiB)
      << "the untagged allocation whole, of the weights only the chunk the memset wrote";

  std::vector<char> back(n);
  {
    auto c = context();
    ASSERT_EQ(dtoh(back.data(), w, n), CUDA_SUCCESS);
  }
  EXPECT_TRUE(back == bytes) << "the weights after two sleeps, the memset's bytes included";
  EXPECT_TRUE(session->free(reinterpret_cast<void*>(w)));
  EXPECT_TRUE(session->free(reinterpret_cast<void*>(k)));
}

TEST_F(CudaHooksTest, AnIpcExportOfManagedMemoryStandsAsideAndTheCallGoesThrough) {
  const auto alloc = wrapped("cuMemAlloc", &real_alloc);
  const auto ipc = wrapped("cuIpcGetMemHandle", &real_ipc);
  CUdeviceptr p = 0, q = 0;
  ASSERT_EQ(alloc(&p, 8 * kMiB), CUDA_SUCCESS);
  CUipcMemHandle h{};
  int outside = 0;
  EXPECT_EQ(ipc(&h, reinterpret_cast<CUdeviceptr>(&outside)), CUDA_SUCCESS);
  EXPECT_FALSE(session->stood_aside()) << "memory the preload does not manage: nothing to say";
  idle();
  EXPECT_EQ(ipc(&h, p), CUDA_SUCCESS);
  EXPECT_EQ(g_ipc_calls, 2) << "forwarded both times";
  EXPECT_TRUE(session->stood_aside());
  EXPECT_TRUE(logs.contains(LogLevel::warn, "over CUDA IPC (cuIpcGetMemHandle)"));
  EXPECT_EQ(gpu().mapped_bytes(p, 8 * kMiB), 8 * kMiB) << "woken, and held from then on";
  idle();
  EXPECT_EQ(gpu().mapped_bytes(p, 8 * kMiB), 8 * kMiB);
  {
    auto c = context();
    ASSERT_EQ(alloc(&q, 8 * kMiB), CUDA_SUCCESS);
    EXPECT_EQ(g_real_allocs, 1) << "new allocations are the driver's";
    EXPECT_EQ(gpu().driver().cuMemFree(q), CUDA_SUCCESS);
  }
  EXPECT_TRUE(session->free(reinterpret_cast<void*>(p)));
}

TEST_F(CudaHooksTest, TheDefaultAndPerThreadVariantsEachGetAWrapperOfTheirOwnAndAThirdStandsAside) {
  const auto a = reinterpret_cast<void*>(&variant_a);
  const auto b = reinterpret_cast<void*>(&variant_b);
  void* wa = wrap_driver("cuGraphLaunchKernelNode", kVersion, false, a);
  EXPECT_EQ(wa, a) << "not hooked";
  wa = wrap_driver("cuLaunchKernelEx", kVersion, false, a);
  void* wb = wrap_driver("cuLaunchKernelEx", kVersion, true, b);
  ASSERT_NE(wa, a);
  ASSERT_NE(wb, b);
  EXPECT_NE(wa, wb);
  EXPECT_EQ(wrap_driver("cuLaunchKernelEx", kVersion, false, a), wa) << "the same function, the same wrapper";
  using Fn = CUresult(CUDAAPI*)(const CUlaunchConfig*, CUfunction, void**, void**);
  EXPECT_EQ(reinterpret_cast<Fn>(wa)(nullptr, nullptr, nullptr, nullptr), CUDA_SUCCESS) << "each calls its own";
  EXPECT_EQ(reinterpret_cast<Fn>(wb)(nullptr, nullptr, nullptr, nullptr), CUDA_ERROR_NOT_READY);
  EXPECT_FALSE(session->stood_aside());
  const auto c = reinterpret_cast<void*>(&variant_c);
  EXPECT_EQ(wrap_driver("cuLaunchKernelEx", kVersion, false, c), c);
  EXPECT_TRUE(session->stood_aside()) << "a third function of one name cannot be wrapped: nothing may sleep unseen";
  EXPECT_TRUE(logs.contains(LogLevel::warn, "a third variant of the driver's cuLaunchKernelEx"));
}

TEST_F(CudaHooksTest, AFunctionOfANewerCudaThanThePreloadKnowsIsNotWrappedAndTheSessionStandsAside) {
  const auto real = reinterpret_cast<void*>(&real_launch);
  EXPECT_EQ(wrap_driver("cuLaunchKernel", 99000, false, real), real);
  EXPECT_TRUE(session->stood_aside());
  EXPECT_TRUE(logs.contains(LogLevel::warn, "cuLaunchKernel of CUDA 99.0, newer than this preload knows"));
}

TEST_F(CudaHooksTest, ManagedMemoryIsSaidOnceAndForwarded) {
  const auto managed = wrapped("cuMemAllocManaged", &real_managed);
  CUdeviceptr p = 0;
  EXPECT_EQ(managed(&p, 4 * kMiB, CU_MEM_ATTACH_GLOBAL), CUDA_ERROR_NOT_SUPPORTED) << "the driver's answer, as it is";
  EXPECT_TRUE(logs.contains(LogLevel::warn, "managed (unified) memory (cuMemAllocManaged)"));
  EXPECT_FALSE(session->stood_aside());
}

// One GPU budget across engines (DESIGN: "different engines share one byte budget"): the program's
// session and another engine's device manager (a llama-server's, as the llama.cpp preload makes it:
// Config::for_device_memory of the same RESIDENCY_GPU_BUDGET) on one emulated GPU, each with a
// backend of its own. The budget holds one of the two 24 MiB models: whichever is used asks the
// other to give way, both ways, and the ledger lists them side by side as `residency stat` reads it.
TEST_F(CudaHooksTest, AProgramAndAnotherEngineShareOneGpuBudgetAndAskEachOtherBothWays) {
  const std::string name = "unit-cuda-hooks-" + std::to_string(::getpid());
  Config shared;
  shared.keep_alive = KeepAlive::after(std::chrono::seconds(10));
  shared.release_on_pressure = false;
  shared.host_budget.off = true;
  shared.budget_wait = std::chrono::seconds(5);
  shared.gpu_budget = SharedBudget{name, WiredLimit{false, 40 * kMiB, 0}, ""};

  // The program's session, made again with the budget.
  session.reset();
  ProgramSession::Options so;
  so.config = shared;
  so.backends = [this](int, const Config&) -> Result<std::shared_ptr<Backend>> {
    return std::shared_ptr<Backend>(backend);
  };
  so.clock = &clock;
  so.log = [this](LogLevel l, std::string_view line) { logs.callback()(l, line); };
  so.start_schedulers = false;
  session = std::make_unique<ProgramSession>(std::move(so));
  g_session = session.get();

  // The other engine: its own backend on the same GPU, and a device manager under the same budget.
  CudaBackendOptions eo;
  eo.chunk_bytes = 8 * kMiB;
  auto other_backend = CudaBackend::create(eo, gpu().driver());
  ASSERT_TRUE(other_backend) << other_backend.message();
  ManagerOptions mo;
  mo.backend = *other_backend;
  mo.clock = &clock;
  mo.start_scheduler = false;
  mo.config = shared.for_device_memory((*other_backend)->capabilities().device_uuid);
  ASSERT_TRUE(mo.config.shared_budget) << "the GPU's budget, named by its UUID";
  auto engine = Manager::create(std::move(mo));
  ASSERT_TRUE(engine) << engine.message();
  Manager& other = **engine;
  auto theirs = other.allocate(24 * kMiB);
  ASSERT_TRUE(theirs) << theirs.message();
  const auto their_va = reinterpret_cast<CUdeviceptr>(theirs->ptr);
  ASSERT_EQ(gpu().mapped_bytes(their_va, 24 * kMiB), 24 * kMiB);

  // The program allocates: the other engine is asked and gives way.
  const auto alloc = wrapped("cuMemAlloc", &real_alloc);
  const auto htod = wrapped("cuMemcpyHtoD", gpu().driver().cuMemcpyHtoD);
  CUdeviceptr mine = 0;
  ASSERT_EQ(alloc(&mine, 24 * kMiB), CUDA_SUCCESS);
  EXPECT_EQ(g_real_allocs, 0);
  EXPECT_EQ(gpu().mapped_bytes(their_va, 24 * kMiB), 0u) << "the other engine slept to make room";
  EXPECT_EQ(gpu().mapped_bytes(mine, 24 * kMiB), 24 * kMiB);

  bool listed = false;
  for (const SharedBudgetInfo& info : list_shared_budgets()) {
    if (info.name.rfind(name + ".", 0) != 0) continue;
    listed = true;
    EXPECT_EQ(info.holders.size(), 2u) << "side by side: the program and the other engine";
    EXPECT_LE(info.used, 40 * kMiB);
  }
  EXPECT_TRUE(listed) << "the GPU's ledger is listed as residency stat lists it";

  // The other engine is used again: the program is asked and gives way, its bytes kept.
  const auto bytes = pattern(24 * kMiB, 5);
  {
    auto c = context();
    ASSERT_EQ(htod(mine, bytes.data(), bytes.size()), CUDA_SUCCESS);
  }
  other.begin_call();
  EXPECT_EQ(gpu().mapped_bytes(their_va, 24 * kMiB), 24 * kMiB);
  EXPECT_EQ(gpu().mapped_bytes(mine, 24 * kMiB), 0u) << "the program slept to make room";
  other.end_call();

  // And the program's next copy asks back.
  const auto dtoh = wrapped("cuMemcpyDtoH", gpu().driver().cuMemcpyDtoH);
  std::vector<char> back(bytes.size());
  {
    auto c = context();
    ASSERT_EQ(dtoh(back.data(), mine, back.size()), CUDA_SUCCESS);
  }
  EXPECT_TRUE(back == bytes);
  EXPECT_EQ(gpu().mapped_bytes(their_va, 24 * kMiB), 0u) << "the other engine gave way again";
  EXPECT_TRUE(session->free(reinterpret_cast<void*>(mine)));
  EXPECT_TRUE(other.deallocate(theirs->ptr));
  engine->reset();
  other_backend->reset();
}

}  // namespace
}  // namespace residency::cudapreload
