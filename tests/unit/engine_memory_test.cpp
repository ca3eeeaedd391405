// SPDX-License-Identifier: MIT
// What of the process's own memory the preload holds as the engine's working memory
// (src/preload/engine_memory.hpp): the resident pages of private anonymous mappings (heap,
// stacks, malloc's chunks) and of the engine libraries' data, minus what is registered already;
// never a shared, read-only, executable or foreign file mapping, never a mapping over the cap.
#include "preload/engine_memory.hpp"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>

namespace {

using namespace residency::preload;

constexpr std::size_t kPage = 4096;

const char* const kMaps =
    "55d0c0000000-55d0c0021000 rw-p 00000000 00:00 0                          [heap]\n"
    "7f1000000000-7f1000004000 rw-p 00000000 00:00 0 \n"
    "7f1000004000-7f1000005000 ---p 00000000 00:00 0 \n"
    "7f1000005000-7f1000008000 rw-s 00000000 00:05 1234                       /dev/shm/ledger\n"
    "7f1000008000-7f100000a000 r--p 00000000 08:01 777                        /opt/llama/lib/libllama.so.0\n"
    "7f100000a000-7f100000c000 r-xp 00002000 08:01 777                        /opt/llama/lib/libllama.so.0\n"
    "7f100000c000-7f100000d000 r--p 00004000 08:01 777                        /opt/llama/lib/libllama.so.0\n"
    "7f100000d000-7f100000e000 rw-p 00005000 08:01 777                        /opt/llama/lib/libllama.so.0\n"
    "7f100000e000-7f100000f000 rw-p 00001000 08:01 888                        /usr/lib/libcurl.so.4\n"
    "7f1000010000-7f1000012000 r--p 00000000 00:00 0                          [anon:ro]\n"
    "7f1000012000-7f1000014000 rw-p 00000000 00:00 0                          [anon:glibc: malloc]\n"
    "7f1000020000-7f1000022000 rw-p 00000000 08:01 999                        /tmp/with space/model.gguf (deleted)\n"
    "7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]\n"
    "7ffd00030000-7ffd00032000 r--p 00000000 00:00 0                          [vvar]\n"
    "not a maps line\n"
    "ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]";

TEST(EngineMemory, MapsLinesAreParsedWithTheirPathsAndBadLinesSkipped) {
  const std::vector<MapsEntry> m = parse_maps(kMaps);
  ASSERT_EQ(m.size(), 15U);
  EXPECT_EQ(m[0].begin, 0x55d0c0000000U);
  EXPECT_EQ(m[0].end, 0x55d0c0021000U);
  EXPECT_TRUE(m[0].readable && m[0].writable && m[0].is_private && !m[0].executable);
  EXPECT_EQ(m[0].path, "[heap]");
  EXPECT_EQ(m[1].path, "");  // an unnamed mapping: the line ends in a space
  EXPECT_EQ(m[3].inode, 1234U);
  EXPECT_FALSE(m[3].is_private);
  EXPECT_TRUE(m[5].executable);
  EXPECT_EQ(m[11].path, "/tmp/with space/model.gguf (deleted)");
  EXPECT_EQ(m[14].path, "[vsyscall]");
  EXPECT_TRUE(parse_maps("").empty());
  EXPECT_TRUE(parse_maps("7f-7e rw-p 0 00:00 0\n").empty());  // end before begin
}

TEST(EngineMemory, OnlyPrivateWritableAnonymousMemoryAndTheEnginesDataAreCandidates) {
  const std::vector<MapsEntry> m = parse_maps(kMaps);
  std::vector<std::string> anonymous, data;
  for (const MapsEntry& e : m) {
    if (is_private_anonymous(e)) anonymous.push_back(e.path);
    if (is_engine_data(e)) data.push_back(e.path + (e.writable ? " rw" : " r"));
  }
  EXPECT_EQ(anonymous, (std::vector<std::string>{"[heap]", "", "[anon:glibc: malloc]", "[stack]"}));
  // libllama's r-- segments (read-only data, RELRO) and its .data; never its code, never libcurl's.
  EXPECT_EQ(data, (std::vector<std::string>{"/opt/llama/lib/libllama.so.0 r", "/opt/llama/lib/libllama.so.0 r",
                                            "/opt/llama/lib/libllama.so.0 rw"}));
}

TEST(EngineMemory, ThePlanLeavesOutWhatIsHeldAndMappingsOverTheCap) {
  const std::vector<MapsEntry> m = parse_maps(kMaps);
  // The heap's second page and libllama's first read-only segment are held already (a buffer,
  // the code).
  const std::vector<Extent> held = {{0x55d0c0001000, 0x55d0c0002000}, {0x7f1000008000, 0x7f100000a000}};
  // The engine made the unnamed mapping and malloc's chunk, and ran on the stack.
  EngineOwned owned;
  owned.made = {{0x7f1000000000, 0x7f1000004000}, {0x7f1000012000, 0x7f1000014000}};
  owned.stack_points = {0x7ffd00020f00};
  const MemoryPlan p = plan_engine_memory(m, held, owned, kPage, /*max_mapping=*/0x21000);
  ASSERT_EQ(p.ranges.size(), 6U);
  EXPECT_EQ(p.ranges[0].begin, 0x55d0c0000000U);
  EXPECT_EQ(p.ranges[0].end, 0x55d0c0001000U);
  EXPECT_EQ(p.ranges[1].begin, 0x55d0c0002000U);
  EXPECT_EQ(p.ranges[1].end, 0x55d0c0021000U);
  EXPECT_EQ(p.ranges[2].begin, 0x7f1000000000U);  // the unnamed mapping
  EXPECT_EQ(p.ranges[2].end, 0x7f1000004000U);
  EXPECT_EQ(p.ranges[3].begin, 0x7f100000c000U);  // libllama's RELRO and .data, one range
  EXPECT_EQ(p.ranges[3].end, 0x7f100000e000U);
  EXPECT_EQ(p.ranges[4].begin, 0x7f1000012000U);  // malloc's chunk
  EXPECT_EQ(p.ranges[5].begin, 0x7ffd00000000U);  // the stack
  EXPECT_EQ(p.left_out, 0U);
  std::uint64_t sum = 0;
  for (const Extent& r : p.ranges) sum += r.end - r.begin;
  EXPECT_EQ(p.bytes, sum);

  // A cap below the heap's and the stack's size leaves both out, and says how much.
  const MemoryPlan capped = plan_engine_memory(m, {}, owned, kPage, /*max_mapping=*/0x20000);
  EXPECT_EQ(capped.left_out, 2U * 0x21000);
  // What is held of a mapping over the cap (a repacked copy of the weights) is not left out: it is held.
  EXPECT_EQ(plan_engine_memory(m, held, owned, kPage, 0x20000).left_out, 2U * 0x21000 - 0x1000);
  for (const Extent& r : capped.ranges) {
    EXPECT_NE(r.begin, 0x55d0c0000000U);
    EXPECT_NE(r.begin, 0x7ffd00000000U);
  }
}

TEST(EngineMemory, WhatTheProgramMappedItselfIsNeverACandidate) {
  const std::vector<MapsEntry> m = parse_maps(kMaps);
  // Nothing made by the engine, no stack it ran on: the heap and libllama's data only.
  const MemoryPlan p = plan_engine_memory(m, {}, EngineOwned{}, kPage, 1ULL << 40);
  ASSERT_EQ(p.ranges.size(), 3U);
  EXPECT_EQ(p.ranges[0].begin, 0x55d0c0000000U);  // the heap
  EXPECT_EQ(p.ranges[0].end, 0x55d0c0021000U);
  EXPECT_EQ(p.ranges[1].begin, 0x7f1000008000U);  // libllama's read-only data
  EXPECT_EQ(p.ranges[1].end, 0x7f100000a000U);
  EXPECT_EQ(p.ranges[2].begin, 0x7f100000c000U);  // its RELRO and .data
  // The engine made part of a mapping (the kernel merged it with the program's): only that part.
  EngineOwned part;
  part.made = {{0x7f1000001000, 0x7f1000002000}};
  part.heap = false;
  const MemoryPlan q = plan_engine_memory(m, {}, part, kPage, 1ULL << 40);
  std::vector<std::uintptr_t> begins;
  for (const Extent& r : q.ranges) begins.push_back(r.begin);
  EXPECT_EQ(begins, (std::vector<std::uintptr_t>{0x7f1000001000, 0x7f1000008000, 0x7f100000c000}));
  EXPECT_EQ(q.ranges[0].end, 0x7f1000002000U);
}

TEST(EngineMemory, ResidentRunsMergeSmallGapsOnly) {
  const Extent range{0x10000, 0x10000 + 12 * kPage};
  // Pages: 1 1 0 1 0 0 0 1 1 0 0 0; only bit 0 counts (mincore's other bits are reserved).
  const std::vector<unsigned char> res = {1, 3, 0, 1, 2, 0, 0, 1, 1, 0, 0, 0};
  const std::vector<Extent> one_gap = resident_runs(range, res, kPage, /*max_gap=*/1);
  ASSERT_EQ(one_gap.size(), 2U);
  EXPECT_EQ(one_gap[0].begin, 0x10000U);
  EXPECT_EQ(one_gap[0].end, 0x10000U + 4 * kPage);  // the one-page gap is merged
  EXPECT_EQ(one_gap[1].begin, 0x10000U + 7 * kPage);
  EXPECT_EQ(one_gap[1].end, 0x10000U + 9 * kPage);
  EXPECT_EQ(resident_runs(range, res, kPage, 0).size(), 3U);
  EXPECT_EQ(resident_runs(range, res, kPage, 3).size(), 1U);
  EXPECT_TRUE(resident_runs(range, std::vector<unsigned char>(12, 0), kPage, 4).empty());
  // A vector shorter than the range: only the pages it describes.
  EXPECT_EQ(resident_runs(range, {1}, kPage, 4).size(), 1U);
}

TEST(EngineMemory, UnderTheCapsTheSmallestRunsAreHeldInAddressOrder) {
  const std::vector<Extent> runs = {{0, 1}, {10, 15}, {20, 22}, {30, 40}, {50, 51}};
  const std::vector<Extent> three = runs_to_hold(runs, 3, 1000);
  ASSERT_EQ(three.size(), 3U);
  EXPECT_EQ(three[0].begin, 0U);
  EXPECT_EQ(three[1].begin, 20U);
  EXPECT_EQ(three[2].begin, 50U);
  EXPECT_EQ(runs_to_hold(runs, 10, 1000).size(), 5U);
  // 1 + 1 + 2 + 5 = 9 bytes fit a cap of 9; the 10-byte run does not.
  const std::vector<Extent> capped = runs_to_hold(runs, 10, 9);
  ASSERT_EQ(capped.size(), 4U);
  EXPECT_EQ(capped[1].begin, 10U);
  EXPECT_TRUE(runs_to_hold(runs, 0, 1000).empty());
  EXPECT_TRUE(runs_to_hold({}, 10, 1000).empty());
}

// The real /proc/self/maps of this process: the heap page malloc just wrote is a candidate, a
// private file mapping of a foreign file is not.
TEST(EngineMemory, ThisProcessesHeapAndStackAreFoundInItsOwnMaps) {
  std::ifstream in("/proc/self/maps");
  ASSERT_TRUE(in.good());
  std::stringstream text;
  text << in.rdbuf();
  const std::vector<MapsEntry> m = parse_maps(text.str());
  ASSERT_FALSE(m.empty());
  int on_stack = 0;
  const auto here = reinterpret_cast<std::uintptr_t>(&on_stack);
  EngineOwned owned;
  owned.stack_points = {here};
  const MemoryPlan p = plan_engine_memory(m, {}, owned, static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)), 1ULL << 40);
  bool stack_found = false;
  for (const Extent& r : p.ranges) stack_found = stack_found || (r.begin <= here && here < r.end);
  EXPECT_TRUE(stack_found) << "this thread's stack is private anonymous memory";
  for (const MapsEntry& e : m) {
    if (e.inode == 0 || is_engine_data(e)) continue;
    for (const Extent& r : p.ranges) EXPECT_FALSE(r.begin < e.end && e.begin < r.end) << e.path;
  }
}

}  // namespace
