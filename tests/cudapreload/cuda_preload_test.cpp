// SPDX-License-Identifier: MIT
// libresidency_cuda.so in a real process: fake_cuda_host loads libfakeext.so with RTLD_LOCAL (as
// Python loads PyTorch's extension), whose CUDA runtime (libfakecudart.so) is then in no global
// scope. Run with and without the preload, the program must get exactly the same answers and the
// runtime must see exactly the same calls: every export found the runtime's definition through its
// caller's scope and forwarded the call. CUDA_VISIBLE_DEVICES is empty, so the preload has no
// device to manage on any machine (a GPU's would be real device memory the fake runtime cannot
// copy into): it says so once and passes everything through.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "residency/shared_budget.hpp"
#include "support/child_process.hpp"

namespace {

struct Outcome {
  int status = -1;
  std::string out, err;
};

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// A file name of this test process's own: ctest runs this binary's tests in parallel processes.
std::string own_temp(const std::string& what) {
  static int serial = 0;
  return ::testing::TempDir() + "cuda_preload_" + std::to_string(::getpid()) + "_" + std::to_string(serial++) + "_" + what;
}

Outcome run(const std::string& env, const std::string& libs = "'" RESIDENCY_FAKE_EXT "'") {
  const std::string err = own_temp("run.err");
  const std::string cmd = "env -u LD_PRELOAD CUDA_VISIBLE_DEVICES= " + env + " '" RESIDENCY_FAKE_CUDA_HOST "' " + libs +
                          " 2>'" + err + "'";
  Outcome r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[1024];
  while (std::fgets(buf, sizeof buf, p) != nullptr) r.out += buf;
  r.status = ::pclose(p);
  r.err = slurp(err);
  std::remove(err.c_str());
  return r;
}

std::size_t count(const std::string& s, const std::string& needle) {
  std::size_t n = 0;
  for (auto at = s.find(needle); at != std::string::npos; at = s.find(needle, at + 1)) ++n;
  return n;
}

// The byte sum fake_ext's kernel computes over its 64 MiB of (i * 7) mod 256.
unsigned long long expected_sum() {
  unsigned long long s = 0;
  for (std::size_t i = 0; i < (std::size_t{64} << 20); ++i) s += static_cast<unsigned char>(i * 7);
  return s;
}

const std::string kPreload = std::string("LD_PRELOAD=") + RESIDENCY_CUDA_PRELOAD;

TEST(CudaPreload, EveryCallReachesTheRuntimeInTheCallersScopeAndTheProgramGetsWhatItWould) {
  const Outcome plain = run("");
  ASSERT_EQ(plain.status, 0) << plain.err;
  ASSERT_NE(plain.out.find("malloc=0 htod=0 launch=0 dtoh=0 sum=" + std::to_string(expected_sum()) + " "), std::string::npos)
      << plain.out;
  const Outcome pre = run(kPreload + " RESIDENCY_LOG=info");
  EXPECT_EQ(pre.status, 0) << pre.err;
  // The preload asks the runtime once which device is current (the first count: cudaGetDevice) when
  // it would route an allocation; every other count is the program's calls.
  const auto program_calls = [](const std::string& out) {
    const auto at = out.find("calls=");
    return at == std::string::npos ? out : out.substr(0, at) + out.substr(out.find(',', at));
  };
  EXPECT_EQ(program_calls(pre.out), program_calls(plain.out))
      << "the same answers and the same calls seen by the runtime; stderr: " << pre.err;
}

// Two libraries, each with a CUDA runtime of its own, both loaded RTLD_LOCAL: each runtime sees its
// own library's calls and no other's, with the preload as without it (a target cached for one
// calling library is never another's).
TEST(CudaPreload, TwoRuntimesInOneProcessEachGetTheirOwnCallersCalls) {
  const std::string both = "'" RESIDENCY_FAKE_EXT "' '" RESIDENCY_FAKE_EXT2 "'";
  const Outcome plain = run("", both);
  ASSERT_EQ(plain.status, 0) << plain.err;
  ASSERT_NE(plain.out.find("runtime 1: "), std::string::npos);
  ASSERT_NE(plain.out.find("\nruntime 2: "), std::string::npos);
  const Outcome pre = run(kPreload + " RESIDENCY_KEEP_ALIVE=off", both);
  EXPECT_EQ(pre.status, 0) << pre.err;
  EXPECT_EQ(pre.out, plain.out) << pre.err;
  const Outcome managed = run(kPreload, both);
  EXPECT_EQ(managed.status, 0) << managed.err;
  const auto lines_without_device_queries = [](std::string out) {
    for (std::size_t at = out.find("calls="); at != std::string::npos; at = out.find("calls=", at + 1))
      out.erase(at + 6, out.find(',', at) - (at + 6));
    return out;
  };
  EXPECT_EQ(lines_without_device_queries(managed.out), lines_without_device_queries(plain.out)) << managed.err;
}

// Libraries closed between their runs, each with a runtime of its own (without the preload the
// third lands where the second was): each call reaches its own library's runtime, and the program
// gets the same answers. Under the preload a library whose scope served a call stays loaded (a
// cached target must never dangle), so none lands on another's span; a dlclose also drops the
// caches, for the targets found in the global scope.
TEST(CudaPreload, LibrariesClosedBetweenRunsEachReachTheirOwnRuntime) {
  const std::string three = "--close '" RESIDENCY_FAKE_EXT "' '" RESIDENCY_FAKE_EXT2 "' '" RESIDENCY_FAKE_EXT3 "'";
  const Outcome plain = run("", three);
  ASSERT_EQ(plain.status, 0) << plain.err;
  ASSERT_NE(plain.out.find("\nruntime 3: "), std::string::npos);
  const Outcome pre = run(kPreload + " RESIDENCY_KEEP_ALIVE=off", three);
  EXPECT_EQ(pre.status, 0) << pre.err;
  EXPECT_EQ(pre.out, plain.out) << pre.err;
}

TEST(CudaPreload, WithNoDeviceToManageItSaysWhyOnceAndWhatItNeverManages) {
  const Outcome pre = run(kPreload);
  EXPECT_EQ(pre.status, 0);
  EXPECT_EQ(count(pre.err, "CUDA device 0: "), 1u) << pre.err;
  EXPECT_EQ(count(pre.err, "its device memory stays the CUDA runtime's (no sleep)"), 1u) << pre.err;
  EXPECT_EQ(count(pre.err, "managed (unified) memory (cudaMallocManaged)"), 1u) << pre.err;
  EXPECT_EQ(pre.err.find("CUDA IPC"), std::string::npos) << "nothing it manages was exported: " << pre.err;
}

TEST(CudaPreload, ABadVariableIsNamedAndTheProgramRunsWithoutResidency) {
  const Outcome plain = run("");
  const Outcome pre = run(kPreload + " RESIDENCY_KEEP_ALIVE=soon");
  EXPECT_EQ(pre.status, 0);
  EXPECT_EQ(pre.out, plain.out);
  EXPECT_NE(pre.err.find("RESIDENCY_KEEP_ALIVE"), std::string::npos) << pre.err;
  EXPECT_NE(pre.err.find("the program runs without residency"), std::string::npos) << pre.err;
  EXPECT_EQ(pre.err.find("CUDA device 0"), std::string::npos) << "no session, no backend: " << pre.err;
  EXPECT_EQ(pre.err.find("managed (unified)"), std::string::npos) << "nothing more is said: " << pre.err;
}

TEST(CudaPreload, OffPassesEverythingThroughSilently) {
  const Outcome plain = run("");
  const Outcome pre = run(kPreload + " RESIDENCY_KEEP_ALIVE=off");
  EXPECT_EQ(pre.status, 0);
  EXPECT_EQ(pre.out, plain.out);
  EXPECT_EQ(pre.err.find("CUDA device"), std::string::npos) << pre.err;
}

// The whole chain on an emulated GPU: fake_gpu_program over a fake runtime over a fake libcuda.so.1
// (HostGpu: unmapped device memory faults), the preload's own cuda backend in the process. Under
// a keep-alive shorter than the program's idle pause the "GPU" maps nothing while it idles, and
// the kernel after the pause finds its memory woken, with its bytes.
// The same, with the program's memory mapped by the program itself (PyTorch's expandable
// segments: reserve, cuMemCreate, cuMemMap, cuMemSetAccess through the runtime's driver entry
// points): "vmm".
class CudaPreloadGpu : public ::testing::TestWithParam<const char*> {};
INSTANTIATE_TEST_SUITE_P(Memory, CudaPreloadGpu, ::testing::Values("malloc", "vmm"));

TEST_P(CudaPreloadGpu, AProgramsMemorySleepsWhileItIdlesAndItsNextKernelFindsItAwakeWithItsBytes) {
  const std::string program = std::string("'") + RESIDENCY_FAKE_GPU_PROGRAM + "' 1500 " + GetParam();
  const std::string libcuda = std::string("LD_LIBRARY_PATH='") + RESIDENCY_FAKE_LIBCUDA_DIR + "'";
  const auto exec = [&](const std::string& env) {
    const std::string err = own_temp("gpu.err");
    Outcome r;
    FILE* p = ::popen(("env -u LD_PRELOAD " + libcuda + " " + env + " " + program + " 2>'" + err + "'").c_str(), "r");
    if (p == nullptr) return r;
    char buf[512];
    while (std::fgets(buf, sizeof buf, p) != nullptr) r.out += buf;
    r.status = ::pclose(p);
    r.err = slurp(err);
    std::remove(err.c_str());
    return r;
  };
  const std::string sums = "sum=8556380160 again=8556380160 same_bytes=1 mapped_awake=67108864 ";
  const Outcome plain = exec("");
  ASSERT_EQ(plain.status, 0) << plain.err;
  EXPECT_NE(plain.out.find(sums + "mapped_idle=67108864 mapped_after=67108864"), std::string::npos) << plain.out;

  const Outcome pre = exec(kPreload + " RESIDENCY_KEEP_ALIVE=500ms RESIDENCY_LOG=info");
  ASSERT_EQ(pre.status, 0) << pre.out << pre.err;
  EXPECT_NE(pre.out.find(sums + "mapped_idle=0 mapped_after=67108864"), std::string::npos) << pre.out << pre.err;
  EXPECT_NE(pre.err.find("released 64.00 MiB"), std::string::npos) << pre.err;
  EXPECT_NE(pre.err.find("re-wired 64.00 MiB"), std::string::npos) << pre.err;
  EXPECT_EQ(pre.err.find("host tier"), std::string::npos) << "no model files here: " << pre.err;
  EXPECT_EQ(pre.err.find("warn"), std::string::npos) << pre.err;
}

// One GPU budget across processes: two programs under the preload on their emulated GPUs (one
// UUID, so one ledger), a budget for one of their two 64 MiB allocations. The second's allocation
// asks the first to sleep; `residency ps` lists both side by side; the first's next kernel wakes it
// and asks the second to sleep; each gets its own sums back.
TEST(CudaPreload, TwoProgramsShareOneGpuBudgetAskEachOtherAndPsListsBoth) {
  const std::string name = "unit-cuda-pre-" + std::to_string(::getpid());
  const auto spec = [&](const std::string& who) {
    residency::testing::ChildSpec c;
    c.argv = {RESIDENCY_FAKE_GPU_PROGRAM, "wait"};
    c.env = {std::string("LD_LIBRARY_PATH=") + RESIDENCY_FAKE_LIBCUDA_DIR,
             std::string("LD_PRELOAD=") + RESIDENCY_CUDA_PRELOAD,
             "RESIDENCY_KEEP_ALIVE=10m",
             "RESIDENCY_GPU_BUDGET=" + name + ":100MiB",
             "RESIDENCY_LOG=debug",
             "RESIDENCY_LOG_TIME=1",
             "RESIDENCY_BUDGET_WAIT=20s"};
    c.drop_env_prefixes = {"LD_PRELOAD=", "RESIDENCY_", "CUDA_VISIBLE_DEVICES="};
    c.stdin_pipe = true;
    c.stderr_path = own_temp(who + ".err");
    return c;
  };
  // The GPU's ledger goes at the end, passed or failed (after the programs: declared first).
  struct Ledgers {
    std::string prefix;
    ~Ledgers() {
      for (const auto& info : residency::list_shared_budgets())
        if (info.name.rfind(prefix, 0) == 0) std::remove(info.path.c_str());
    }
  } ledgers{name + "."};
  const auto a_spec = spec("a"), b_spec = spec("b");
  residency::testing::ChildProcess a(a_spec);
  ASSERT_TRUE(a.wait_for("ready", 60)) << slurp(a_spec.stderr_path);
  residency::testing::ChildProcess b(b_spec);
  ASSERT_TRUE(b.wait_for("ready", 60)) << "exit " << b.finish(10) << ": " << slurp(b_spec.stderr_path);

  const std::string ps = std::string("'") + RESIDENCY_TOOL_PATH + "' ps 2>&1";
  std::string listing;
  if (FILE* p = ::popen(ps.c_str(), "r")) {
    char buf[1024];
    while (std::fgets(buf, sizeof buf, p) != nullptr) listing += buf;
    ::pclose(p);
  }
  EXPECT_NE(listing.find(std::to_string(a.pid())), std::string::npos) << listing;
  EXPECT_NE(listing.find(std::to_string(b.pid())), std::string::npos) << listing;

  ASSERT_TRUE(a.send_line("go"));
  const auto a_out = a.wait_for("sum=", 60);
  ASSERT_TRUE(a_out) << slurp(a_spec.stderr_path);
  EXPECT_NE(a_out->find("sum=8556380160 again=8556380160 same_bytes=1 mapped_awake=67108864 mapped_idle=0 "
                        "mapped_after=67108864"),
            std::string::npos)
      << *a_out << "\n"
      << slurp(a_spec.stderr_path);
  ASSERT_TRUE(b.send_line("go"));
  const auto b_out = b.wait_for("sum=", 60);
  ASSERT_TRUE(b_out) << slurp(b_spec.stderr_path);
  EXPECT_NE(b_out->find("sum=8556380160 again=8556380160 same_bytes=1 mapped_awake=67108864 mapped_idle=0 "
                        "mapped_after=67108864"),
            std::string::npos)
      << "the first's wake asked the second to sleep: " << *b_out << "\n"
      << slurp(b_spec.stderr_path);
  EXPECT_EQ(a.finish(60), 0);
  EXPECT_EQ(b.finish(60), 0);
  std::remove(a_spec.stderr_path.c_str());
  std::remove(b_spec.stderr_path.c_str());
}

}  // namespace
