// SPDX-License-Identifier: MIT
// The preload in hosts it must never break (docs/design.md, "The engine session"): real third-party
// hosts that load llama.cpp with dlopen (node-llama-cpp from npm with its prebuilt binaries; a
// Python ctypes host of libllama, which also calls llama_decode through dlsym, past the preload),
// and a C program with memory of its own (own_memory.c). Each runs with and without the preload:
// the same tokens, the model locked while generating and released while idle, and the program's own
// memory never locked, its madvise never failing, its own locks never undone.
#include <gtest/gtest.h>

#include <llama.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "support/child_process.hpp"
#include "support/strict.hpp"
#include "support/synthetic_model.hpp"
#include "support/temp_dir.hpp"

namespace {

using residency::testing::ChildProcess;
using residency::testing::ChildSpec;

constexpr std::uint64_t kMiB = 1024 * 1024;
constexpr int kRounds = 3;
constexpr int kIdleMs = 2500;  // past the keep-alive of 1 s

// One round a host printed: {"round":R,"tokens":[...],"locked_while_generating_kb":N,"locked_after_idle_kb":M}
struct Round {
  std::string tokens;
  std::uint64_t locked_while_generating_kb = 0;
  std::uint64_t locked_after_idle_kb = 0;
};

std::vector<Round> rounds_of(const std::string& out) {
  static const std::regex line(
      R"re(\{"round":\s*\d+,\s*"tokens":\s*(\[[^\]]*\]),\s*"locked_while_generating_kb":\s*(\d+),\s*"locked_after_idle_kb":\s*(\d+)\})re");
  std::vector<Round> rounds;
  std::stringstream ss(out);
  for (std::string l; std::getline(ss, l);) {
    std::smatch m;
    if (!std::regex_search(l, m, line)) continue;
    std::string tokens = m[1];
    tokens.erase(std::remove(tokens.begin(), tokens.end(), ' '), tokens.end());
    rounds.push_back({tokens, std::stoull(m[2]), std::stoull(m[3])});
  }
  return rounds;
}

// key=value lines (own_memory.c).
std::map<std::string, std::string> values_of(const std::string& out) {
  std::map<std::string, std::string> v;
  std::stringstream ss(out);
  for (std::string l; std::getline(ss, l);)
    if (const auto eq = l.find('='); eq != std::string::npos) v[l.substr(0, eq)] = l.substr(eq + 1);
  return v;
}

class HostTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::string error;
    dir_ = residency::testing::make_disk_temp_dir("preload-hosts", error);
    if (dir_.empty()) {
      setup_error_ = error;
      return;
    }
    model_ = dir_ + "/model-f16.gguf";
    setup_error_ = residency::testing::write_f16_model(model_, 96 * kMiB);
  }
  static void TearDownTestSuite() {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  void SetUp() override {
    if (!setup_error_.empty()) GTEST_SKIP() << setup_error_;
  }

  struct Run {
    int status = -1;
    std::string out, err;
  };
  Run run(std::vector<std::string> argv, bool preload, const std::string& name, double timeout_s = 300,
          std::vector<std::string> env = {"RESIDENCY_KEEP_ALIVE=1s", "RESIDENCY_LOG=info"}) {
    ChildSpec s;
    s.argv = std::move(argv);
    s.drop_env_prefixes = {"RESIDENCY_", "LD_PRELOAD"};
    if (preload) {
      s.env = std::move(env);
      s.env.push_back(std::string("LD_PRELOAD=") + PRELOAD_PATH);
    }
    s.stderr_path = dir_ + "/" + name + (preload ? "-preload" : "-plain") + ".err";
    ChildProcess c(s);
    Run r;
    if (!c.started()) return r;
    r.status = c.finish(timeout_s);
    r.out = c.stdout_text();
    r.err = c.stderr_text();
    return r;
  }

  // The same host without and with the preload: same tokens each round; with it, the model
  // locked while generating and nothing locked after each idle; exit 0 both times.
  void expect_managed_like_without(const std::vector<std::string>& argv, const std::string& name) {
    const Run plain = run(argv, false, name);
    ASSERT_EQ(plain.status, 0) << plain.out << plain.err;
    const std::vector<Round> base = rounds_of(plain.out);
    ASSERT_EQ(base.size(), static_cast<std::size_t>(kRounds)) << plain.out << plain.err;
    for (int attempt = 0; attempt < 2; ++attempt) {  // twice: Node aborted in some runs only
      const Run with = run(argv, true, name);
      ASSERT_EQ(with.status, 0) << "the host must run as without the preload\n" << with.out << with.err;
      const std::vector<Round> got = rounds_of(with.out);
      ASSERT_EQ(got.size(), base.size()) << with.out << with.err;
      EXPECT_NE(with.err.find("preload: wired"), std::string::npos) << "the model was never managed\n" << with.err;
      for (std::size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(got[i].tokens, base[i].tokens) << "round " << i;
        EXPECT_GE(got[i].locked_while_generating_kb * 1024, 90 * kMiB) << "round " << i << ": the model locked\n"
                                                                       << with.err;
        EXPECT_EQ(got[i].locked_after_idle_kb, 0u) << "round " << i << ": released while idle\n" << with.err;
      }
    }
  }

  static std::string dir_, model_, setup_error_;
};
std::string HostTest::dir_, HostTest::model_, HostTest::setup_error_;

TEST_F(HostTest, NodeLlamaCppFromNpmLoadsGeneratesIdlesAndGeneratesAgain) {
  const std::string dir = NODE_LLAMA_CPP_DIR;
  if (dir.empty() || !std::filesystem::exists(dir + "/node_modules/node-llama-cpp"))
    RESIDENCY_SKIP_OR_FAIL_IN_CI(
        "node-llama-cpp is not installed (scripts/node-llama-cpp; configure with "
        "-DRESIDENCY_NODE_LLAMA_CPP_DIR=its output)");
  expect_managed_like_without({NODE_PATH, HOSTS_DIR "/node_host.mjs", dir, model_, std::to_string(kRounds),
                               std::to_string(kIdleMs)},
                              "node");
}

TEST_F(HostTest, APythonCtypesHostOfLibllamaIsManagedThoughItsDecodesGoPastThePreload) {
  if (std::string(PYTHON_PATH).empty()) RESIDENCY_SKIP_OR_FAIL_IN_CI("no python3 found at configure time");
  expect_managed_like_without({PYTHON_PATH, HOSTS_DIR "/ctypes_host.py", LIBLLAMA_PATH, model_, std::to_string(kRounds),
                               std::to_string(kIdleMs), std::to_string(sizeof(llama_model_params)),
                               std::to_string(sizeof(llama_context_params)), std::to_string(sizeof(llama_batch))},
                              "ctypes");
}

// The program's own memory (docs/design.md, "The engine session"): never locked, its calls never
// changed, its locks kept.
TEST_F(HostTest, TheProgramsOwnMemoryIsNeverHeldItsCallsWorkAndItsLocksStay) {
  const Run plain = run({OWN_MEMORY_PATH, model_, std::to_string(kIdleMs)}, false, "own");
  ASSERT_EQ(plain.status, 0) << plain.out << plain.err;
  const Run with = run({OWN_MEMORY_PATH, model_, std::to_string(kIdleMs)}, true, "own");
  ASSERT_EQ(with.status, 0) << with.out << with.err;
  auto v = values_of(with.out);
  EXPECT_GE(std::stoull(v["model_locked_kb"]) * 1024, 90 * kMiB) << "the model was managed\n" << with.err;
  EXPECT_EQ(v["A_locked_kb"], "0") << "a 64 MiB buffer the program mapped before decoding";
  EXPECT_EQ(v["B_locked_kb"], "0") << "32 MiB the program malloc'ed";
  EXPECT_EQ(v["R_locked_kb"], "0") << "the committed part of a PROT_NONE reservation";
  EXPECT_EQ(v["madvise_dontneed"], "0") << "madvise(MADV_DONTNEED) on the program's memory";
  EXPECT_EQ(v["mprotect_none"], "0");
  EXPECT_EQ(v["B_grown_locked_kb"], "0") << "realloc moved the block: nothing of it populated and locked";
  EXPECT_EQ(v["L_locked_kb"], "16384");
  EXPECT_EQ(v["L_locked_after_idle_kb"], "16384") << "the program's own mlock survives the keep-alive's release";
  EXPECT_EQ(v["vm_lck_after_idle_kb"], "16384") << "after the release only the program's own lock is left";
}

// Addresses reused while the engine decodes (issue 28, item 3): two threads of the program map
// anonymous memory, unmap it and map a file MAP_SHARED at the same address, hundreds of times a
// second, while a third decodes in bursts under a keep-alive shorter than the pauses (each burst
// wires the model again and the engine memory is snapshot after the 1st, 2nd, 4th, ... decode).
// The file's mapping must never be found locked: the preload holds only memory made inside the
// engine's calls, forgets what a program mapping lands on, and the program's mmap waits while a
// snapshot is taken. (The issue saw it locked 2-3 times in 25,000 iterations at 8da179e; this
// probe did not catch that rare race there in 3 runs on a 2-core VM, so it guards the class and
// engine_session_test's AMappingTheProgramMakesWhereHeldMemoryWasIsForgotten pins the mechanism.)
TEST_F(HostTest, AFileMappedWhereTheProgramsMemoryWasIsNeverLocked) {
  const std::string file = dir_ + "/reused.bin";
  {
    std::ofstream f(file, std::ios::binary);
    const std::string mib(kMiB, 'r');
    f << mib;
  }
  ChildSpec s;
  s.argv = {ADDRESS_REUSE_PATH, model_, file, "6", "300"};
  s.drop_env_prefixes = {"RESIDENCY_", "LD_PRELOAD"};
  s.env = {std::string("LD_PRELOAD=") + PRELOAD_PATH, "RESIDENCY_KEEP_ALIVE=200ms", "RESIDENCY_LOG=info"};
  s.stderr_path = dir_ + "/reuse.err";
  ChildProcess c(s);
  ASSERT_TRUE(c.started());
  ASSERT_EQ(c.finish(300), 0) << c.stdout_text() << c.stderr_text();
  auto v = values_of(c.stdout_text());
  EXPECT_NE(c.stderr_text().find("preload: wired"), std::string::npos) << "the model was managed\n" << c.stderr_text();
  EXPECT_GE(std::stoll(v["iterations"]), 200) << c.stdout_text();
  EXPECT_GE(std::stoll(v["same_address"]), 100) << "the file landed where the memory was\n" << c.stdout_text();
  EXPECT_EQ(v["file_seen_locked"], "0") << c.stdout_text() << c.stderr_text();
  EXPECT_EQ(v["vm_lck_at_end_kb"], "0") << "nothing left locked once the model is freed";
}

// The preload loaded twice, from two paths: one manager, one charge to a shared budget; the second
// copy says so once and stays out of the way.
TEST_F(HostTest, ASecondCopyOfThePreloadStaysInert) {
  const std::string copy = dir_ + "/libresidency_preload_copy.so";
  std::filesystem::copy_file(PRELOAD_PATH, copy, std::filesystem::copy_options::overwrite_existing);
  ChildSpec s;
  s.argv = {OWN_MEMORY_PATH, model_, "100"};
  s.drop_env_prefixes = {"RESIDENCY_", "LD_PRELOAD"};
  s.env = {std::string("LD_PRELOAD=") + PRELOAD_PATH + ":" + copy, "RESIDENCY_KEEP_ALIVE=1s", "RESIDENCY_LOG=info"};
  s.stderr_path = dir_ + "/twice.err";
  ChildProcess c(s);
  ASSERT_TRUE(c.started());
  ASSERT_EQ(c.finish(300), 0) << c.stdout_text() << c.stderr_text();
  const std::string err = c.stderr_text();
  std::size_t managers = 0;
  for (std::size_t p = err.find("creating a residency set collection"); p != std::string::npos;
       p = err.find("creating a residency set collection", p + 1))
    ++managers;
  EXPECT_EQ(managers, 1u) << err;
  EXPECT_NE(err.find("a second copy of the preload is loaded"), std::string::npos) << err;
  auto v = values_of(c.stdout_text());
  EXPECT_GE(std::stoull(v["model_locked_kb"]) * 1024, 90 * kMiB) << "the first copy manages the model\n" << err;
}

// llama.cpp's mmap+mlock load mode (llama-server --load-mode mmap+mlock): llama.cpp locks the model
// itself, and the preload's release after the keep-alive must not unlock it (every load mode:
// preload_test.cpp's PreloadLoadModeTest).
TEST_F(HostTest, LlamaCppsOwnMlockModeKeepsTheModelLockedThroughTheKeepAlive) {
  const Run with = run({OWN_MEMORY_PATH, model_, std::to_string(kIdleMs), "mlock"}, true, "own-mlock");
  ASSERT_EQ(with.status, 0) << with.out << with.err;
  auto v = values_of(with.out);
  EXPECT_GE(std::stoull(v["vm_lck_after_idle_kb"]) * 1024, 16 * kMiB + 90 * kMiB)
      << "the program's 16 MiB and llama.cpp's locked model stay locked after the keep-alive\n"
      << with.err;
}

// ---- Hosts shaped unlike ours (issue 37) ----

std::string value(const std::string& out, const std::string& key) {
  auto v = values_of(out);
  return v.count(key) != 0 ? v[key] : std::string("(missing)");
}
std::uint64_t kb(const std::string& out, const std::string& key) {
  const std::string v = value(out, key);
  return v.find_first_not_of("0123456789") == std::string::npos && !v.empty() ? std::stoull(v) : ~0ULL;
}

// An allocator that maps and unmaps under its own lock (tcmalloc's shape) in a thread that churns
// 2 MiB blocks while the engine decodes 70 tokens and the preload snapshots its memory 7 times: a
// hook that waited for a lock under which the preload allocates deadlocked here at the first
// snapshot (92b9934). The run is bounded; the tokens are those of the run without the preload.
TEST_F(HostTest, AnAllocatorThatMapsUnderItsOwnLockNeverDeadlocksAgainstTheEngineMemorySnapshot) {
  const Run plain = run({OWN_ALLOCATOR_PATH, model_, "70"}, false, "allocator", 120);
  ASSERT_EQ(plain.status, 0) << plain.out << plain.err;
  for (int attempt = 0; attempt < 2; ++attempt) {
    const Run with = run({OWN_ALLOCATOR_PATH, model_, "70"}, true, "allocator", 120);
    ASSERT_EQ(with.status, 0) << "the program must finish as without the preload (a deadlock is killed after 120 s)\n"
                              << with.out << with.err;
    EXPECT_EQ(value(with.out, "tokens"), value(plain.out, "tokens"));
    EXPECT_GT(kb(with.out, "blocks"), 0u) << with.out;
    EXPECT_NE(with.err.find("preload: wired"), std::string::npos) << "the model was managed\n" << with.err;
    EXPECT_NE(with.err.find("engine memory:"), std::string::npos) << "snapshots were taken\n" << with.err;
  }
}

// A plugin loaded RTLD_LOCAL with ggml functions of its own (tests/preload/plugin), next to libllama
// loaded RTLD_LOCAL, in both orders: each call reaches the definition its caller's scope reaches.
// On 92b9934 the first caller's definition served both: plugin first, llama's logits were copied
// by the plugin's function (other tokens, no error); llama first, the plugin's call went into
// libggml-base and aborted. The plugin first also started the session without a libllama, which
// turned residency off for good (item 8): the model must be managed in both orders.
TEST_F(HostTest, APluginsOwnGgmlFunctionsAndLibllamasEachReachTheirOwnDefinitionInEitherOrder) {
  for (const char* order : {"plugin-first", "plugin-last"}) {
    SCOPED_TRACE(order);
    const std::vector<std::string> argv = {DLOPEN_HOST_PATH, LIBLLAMA_PATH, model_, order, GGML_PLUGIN_PATH};
    const Run plain = run(argv, false, std::string("plugin-") + order, 120);
    ASSERT_EQ(plain.status, 0) << plain.out << plain.err;
    ASSERT_EQ(value(plain.out, "plugin_ok"), "1") << plain.out;
    const Run with = run(argv, true, std::string("plugin-") + order, 120);
    ASSERT_EQ(with.status, 0) << with.out << with.err;
    EXPECT_EQ(value(with.out, "tokens"), value(plain.out, "tokens")) << with.err;
    EXPECT_EQ(value(with.out, "plugin_ok"), "1") << "the plugin's calls reach the plugin's functions";
    EXPECT_GE(kb(with.out, "locked_while_generating_kb") * 1024, 90 * kMiB) << "the model was managed\n" << with.err;
  }
}

// A program that maps the model itself before libllama is loaded (gguf-py's reader, numpy.memmap):
// residency starts once libllama is there (92b9934: off for the process's life, VmLck 0).
TEST_F(HostTest, AModelMappedBeforeLibllamaIsLoadedDoesNotTurnResidencyOff) {
  const std::vector<std::string> argv = {DLOPEN_HOST_PATH, LIBLLAMA_PATH, model_, "map-first"};
  const Run plain = run(argv, false, "map-first", 120);
  ASSERT_EQ(plain.status, 0) << plain.out << plain.err;
  const Run with = run(argv, true, "map-first", 120);
  ASSERT_EQ(with.status, 0) << with.out << with.err;
  EXPECT_EQ(value(with.out, "tokens"), value(plain.out, "tokens"));
  EXPECT_GE(kb(with.out, "locked_while_generating_kb") * 1024, 90 * kMiB) << "the model was managed\n" << with.err;
}

// libllama loaded with RTLD_DEEPBIND binds its calls past the preload: one warning says so and
// why, and the program runs as without the preload (92b9934: silence).
TEST_F(HostTest, LibllamaLoadedWithDeepbindIsOneWarningAndTheProgramRunsAsWithout) {
  const std::vector<std::string> argv = {DLOPEN_HOST_PATH, LIBLLAMA_PATH, model_, "deepbind"};
  const Run plain = run(argv, false, "deepbind", 120);
  ASSERT_EQ(plain.status, 0) << plain.out << plain.err;
  const Run with = run(argv, true, "deepbind", 120, {"RESIDENCY_KEEP_ALIVE=1s", "RESIDENCY_LOG=warn"});
  ASSERT_EQ(with.status, 0) << with.out << with.err;
  EXPECT_EQ(value(with.out, "tokens"), value(plain.out, "tokens"));
  std::size_t warnings = 0;
  std::stringstream lines(with.err);
  for (std::string l; std::getline(lines, l);)
    if (l.find("warn") != std::string::npos && l.find("RTLD_DEEPBIND") != std::string::npos) ++warnings;
  EXPECT_EQ(warnings, 1u) << with.err;
  EXPECT_NE(with.err.find("load it without RTLD_DEEPBIND"), std::string::npos) << with.err;
}

// ---- What is held as the engine's memory is the engine's (issue 37, item 7) ----

// A thread that decoded on a stack the program mapped, then ended; the program maps a buffer where
// that stack was. 92b9934 still took the stack's point for an engine stack and locked the buffer.
TEST_F(HostTest, AStackIsHeldOnlyWhileItsThreadLives) {
  const Run with = run({ENGINE_MEMORY_PATH, model_, "stack", "1500"}, true, "stack", 120);
  ASSERT_EQ(with.status, 0) << with.out << with.err;
  EXPECT_NE(with.err.find("engine memory:"), std::string::npos) << "snapshots were taken\n" << with.err;
  EXPECT_EQ(kb(with.out, "buffer_locked_kb"), 0u) << "the program's buffer where a dead thread's stack was\n"
                                                  << with.out << with.err;
}

// 150 MiB of the program's own heap, made between decodes: never the engine's (92b9934 locked all
// of [heap]: 6 MB became 156 MB in a Python host).
TEST_F(HostTest, HeapTheProgramGrowsBetweenDecodesIsNeverHeld) {
  const Run with = run({ENGINE_MEMORY_PATH, model_, "heap", "0"}, true, "heap", 120);
  ASSERT_EQ(with.status, 0) << with.out << with.err;
  ASSERT_GE(kb(with.out, "program_heap_kb") * 1024, 140 * kMiB) << "the program's heap grew\n" << with.out;
  EXPECT_NE(with.err.find("engine memory:"), std::string::npos) << with.err;
  EXPECT_LT(kb(with.out, "heap_locked_kb") * 1024, 64 * kMiB) << with.out << with.err;
}

// A Python server's shape: a thread per request (each round generates on a new thread) and a cache
// the main thread grows by 20 MiB of small objects between requests (60 MiB over three rounds):
// what is locked while generating must not grow with the cache (92b9934 held the heap it lives in;
// a server like it had 43 MiB of its 60 MiB cache locked).
TEST_F(HostTest, APythonServersThreadsAndCacheAreNeverTheEngines) {
  if (std::string(PYTHON_PATH).empty()) RESIDENCY_SKIP_OR_FAIL_IN_CI("no python3 found at configure time");
  const Run with = run({PYTHON_PATH, HOSTS_DIR "/ctypes_host.py", LIBLLAMA_PATH, model_, "4", "1500",
                        std::to_string(sizeof(llama_model_params)), std::to_string(sizeof(llama_context_params)),
                        std::to_string(sizeof(llama_batch)), "threads-cache"},
                       true, "python-threads", 180);
  ASSERT_EQ(with.status, 0) << with.out << with.err;
  const std::vector<Round> rounds = rounds_of(with.out);
  ASSERT_EQ(rounds.size(), 4u) << with.out << with.err;
  EXPECT_GE(rounds[0].locked_while_generating_kb * 1024, 90 * kMiB) << "the model was managed\n" << with.err;
  // Round 0 before any cache, round 3 after 60 MiB of it.
  const std::uint64_t grown_kb = rounds[3].locked_while_generating_kb -
                                 std::min(rounds[3].locked_while_generating_kb, rounds[0].locked_while_generating_kb);
  EXPECT_LT(grown_kb * 1024, 16 * kMiB) << "locked grew with the program's cache\n" << with.out << with.err;
}

// Memory the program maps inside its abort callback, which ggml calls from inside the decode's
// compute, is the program's (92b9934 counted it as made by the engine and locked it).
TEST_F(HostTest, MemoryTheProgramsCallbackMapsInsideADecodeIsNotTheEngines) {
  const Run with = run({ENGINE_MEMORY_PATH, model_, "callback", "0"}, true, "callback", 120);
  ASSERT_EQ(with.status, 0) << with.out << with.err;
  ASSERT_GT(kb(with.out, "callback_calls"), 0u) << "ggml called the program's callback\n" << with.out;
  EXPECT_NE(with.err.find("engine memory:"), std::string::npos) << with.err;
  EXPECT_EQ(kb(with.out, "callback_locked_kb"), 0u) << with.out << with.err;
}

// ---- Another llama.cpp than the one the preload was built against (engine_abi.hpp) ----

// A fake libllama that is not the build's llama.cpp (tests/preload/fake_engine): another ggml or
// llama.cpp version, a larger llama_model_params (a newer llama.cpp's, passed by value), two
// functions the preload needs missing. Each is one warning that names the library's version and what
// differs, and the program runs exactly as without the preload: no other line, its struct's tail and
// its own callback reach the library as it passed them (a C++ hook of the build's signature cuts a
// larger struct and wraps the callback, as the last case shows), the same output.
TEST_F(HostTest, AnotherLlamaCppIsOneWarningAndItsCallsReachItAsTheProgramMadeThem) {
  struct Case {
    const char* name;
    const char* host;
    std::vector<std::string> env;
    std::vector<std::string> said;  // in the warning
  };
  const std::string built = "(llama.cpp " BUILT_LLAMA_VERSION ", ggml " BUILT_GGML_VERSION ", commit ";
  std::vector<Case> cases = {
      {"ggml",
       FAKE_HOST_PATH,
       {"FAKE_GGML_VERSION=9.9.9"},
       {"(ggml 9.9.9, commit fake, ", "ggml 9.9.9, not " BUILT_GGML_VERSION}},
      {"newer", FAKE_NEWER_HOST_PATH, {}, {"llama_model_default_params() writes ", " bytes of llama_model_params, "}},
      {"lacking",
       FAKE_LACKING_HOST_PATH,
       {},
       {"(ggml without ggml_version(), ", "it lacks llama_synchronize ggml_version"}},
  };
  if (BUILT_HAS_LLAMA_VERSION)
    cases.push_back(
        {"llama", FAKE_HOST_PATH, {"FAKE_LLAMA_VERSION=0.0.9"}, {"llama.cpp 0.0.9 (", "llama.cpp 0.0.9, not "}});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const Run plain = run({c.host, model_}, false, std::string("abi-") + c.name, 60);
    ASSERT_EQ(plain.status, 0) << plain.out << plain.err;
    EXPECT_EQ(value(plain.out, "tail_intact"), "1") << plain.out;
    std::vector<std::string> env = c.env;
    env.push_back("RESIDENCY_KEEP_ALIVE=1s");
    env.push_back("RESIDENCY_LOG=debug");  // nothing else said, at any level
    const Run with = run({c.host, model_}, true, std::string("abi-") + c.name, 60, env);
    ASSERT_EQ(with.status, 0) << with.out << with.err;
    EXPECT_EQ(with.out, plain.out) << "the library saw what it sees without the preload\n" << with.err;
    std::vector<std::string> lines;
    std::stringstream ss(with.err);
    for (std::string l; std::getline(ss, l);) lines.push_back(l);
    ASSERT_EQ(lines.size(), 1u) << "one warning, nothing else:\n" << with.err;
    EXPECT_NE(lines[0].find("warn: preload: llama.cpp "), std::string::npos) << lines[0];
    EXPECT_NE(lines[0].find(" is not the llama.cpp this preload was built against " + built), std::string::npos)
        << lines[0];
    EXPECT_NE(lines[0].find("; the program runs without residency"), std::string::npos) << lines[0];
    for (const std::string& said : c.said)
      EXPECT_NE(lines[0].find(said), std::string::npos) << said << "\n" << lines[0];
  }
  // The control: the fake as the build's llama.cpp is served, and the hook, of the build's
  // signature, then passes the build's struct on (the tail cut, the callback wrapped).
  const Run served = run({FAKE_HOST_PATH, model_}, true, "abi-served", 60);
  ASSERT_EQ(served.status, 0) << served.out << served.err;
  EXPECT_EQ(served.err.find("is not the llama.cpp"), std::string::npos) << served.err;
  EXPECT_EQ(value(served.out, "callback_untouched"), "0") << served.out;
}

}  // namespace
