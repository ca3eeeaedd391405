// SPDX-License-Identifier: MIT
// The /proc and cgroup parsers on fixed texts: what real kernels print, and the ways the
// text can be malformed. A wrong parse here becomes a wrong budget or a silent "no pressure".
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "backends/posix/proc_info.hpp"

namespace residency::posix {
namespace {

constexpr std::uint64_t KiB = 1024;

// From a Linux 6.x machine with 24 GiB (trimmed, order kept).
constexpr const char* kMeminfo =
    "MemTotal:       24684096 kB\n"
    "MemFree:        24206072 kB\n"
    "MemAvailable:   24355756 kB\n"
    "Buffers:            3784 kB\n"
    "Unevictable:       12336 kB\n"
    "Mlocked:           11456 kB\n"
    "HugePages_Total:       0\n"
    "Hugepagesize:       2048 kB\n";

TEST(ParseMeminfo, ReadsTotalAvailableAndMlockedInBytes) {
  auto mi = parse_meminfo(kMeminfo);
  ASSERT_TRUE(mi) << mi.message();
  EXPECT_EQ(mi->mem_total, 24684096 * KiB);
  EXPECT_EQ(mi->mem_available, 24355756 * KiB);
  EXPECT_EQ(mi->mlocked, 11456 * KiB);
}

TEST(ParseMeminfo, OldKernelWithoutMemAvailableIsNotAnError) {
  auto mi = parse_meminfo("MemTotal: 1024 kB\nMemFree: 512 kB\n");
  ASSERT_TRUE(mi) << mi.message();
  EXPECT_EQ(mi->mem_total, 1024 * KiB);
  EXPECT_FALSE(mi->mem_available.has_value());
  EXPECT_FALSE(mi->mlocked.has_value());
}

TEST(ParseMeminfo, MalformedInputIsAnErrorThatQuotesTheLine) {
  auto no_total = parse_meminfo("MemFree: 512 kB\n");
  ASSERT_FALSE(no_total);
  EXPECT_NE(no_total.message().find("MemTotal"), std::string::npos);

  auto bad_number = parse_meminfo("MemTotal: 12x4 kB\n");
  ASSERT_FALSE(bad_number);
  EXPECT_NE(bad_number.message().find("'MemTotal: 12x4 kB'"), std::string::npos) << bad_number.message();

  EXPECT_FALSE(parse_meminfo("MemTotal: 1024\n"));                     // unit missing
  EXPECT_FALSE(parse_meminfo("MemTotal: 1024 MB\n"));                  // wrong unit
  EXPECT_FALSE(parse_meminfo("MemTotal 1024 kB\n"));                   // no colon
  EXPECT_FALSE(parse_meminfo("MemTotal: -5 kB\n"));                    // negative
  EXPECT_FALSE(parse_meminfo("MemTotal: 99999999999999999999 kB\n"));  // overflows
  EXPECT_FALSE(parse_meminfo(""));
}

TEST(ParseMeminfo, TruncatedLastLineWithoutNewlineStillParses) {
  auto mi = parse_meminfo("MemTotal: 2048 kB\nMemAvailable: 1024 kB");
  ASSERT_TRUE(mi) << mi.message();
  EXPECT_EQ(mi->mem_available, 1024 * KiB);
}

constexpr const char* kStatus =
    "Name:\tresidency_test\n"
    "Umask:\t0022\n"
    "State:\tR (running)\n"
    "VmPeak:\t  123456 kB\n"
    "VmLck:\t  262144 kB\n"
    "VmPin:\t       0 kB\n"
    "CapInh:\t0000000000000000\n"
    "CapPrm:\t000001fffeffffff\n"
    "CapEff:\t000001fffeffffff\n"
    "Cpus_allowed_list:\t0-1\n";

TEST(ParseProcStatus, ReadsVmLckAndCapabilities) {
  auto st = parse_proc_status(kStatus);
  ASSERT_TRUE(st) << st.message();
  EXPECT_EQ(st->vm_lck, 262144 * KiB);
  ASSERT_TRUE(st->cap_eff.has_value());
  EXPECT_EQ(*st->cap_eff, 0x000001fffeffffffULL);
  EXPECT_TRUE(has_cap_ipc_lock(*st->cap_eff));
}

TEST(ParseProcStatus, CapIpcLockIsBit14) {
  EXPECT_TRUE(has_cap_ipc_lock(1ULL << 14));
  EXPECT_FALSE(has_cap_ipc_lock(0x000001fffeffffffULL & ~(1ULL << 14)));
  EXPECT_FALSE(has_cap_ipc_lock(0));
  auto st = parse_proc_status("CapEff:\t0000000000004000\n");
  ASSERT_TRUE(st);
  EXPECT_TRUE(has_cap_ipc_lock(*st->cap_eff));
}

TEST(ParseProcStatus, KernelThreadWithoutVmLinesHasNoVmLck) {
  auto st = parse_proc_status("Name:\tkthreadd\nCapEff:\t000001ffffffffff\n");
  ASSERT_TRUE(st) << st.message();
  EXPECT_FALSE(st->vm_lck.has_value());
}

TEST(ParseProcStatus, MalformedValuesAreErrors) {
  EXPECT_FALSE(parse_proc_status("VmLck:\t  12 MB\n"));
  EXPECT_FALSE(parse_proc_status("VmLck:\t  kB\n"));
  EXPECT_FALSE(parse_proc_status("CapEff:\tzzzz\n"));
  EXPECT_FALSE(parse_proc_status("CapEff:\t00000000000000000001ffff\n"));  // more than 64 bits
  auto e = parse_proc_status("CapEff:\t\n");
  ASSERT_FALSE(e);
  EXPECT_NE(e.message().find("CapEff"), std::string::npos);
}

TEST(ParsePressure, ReadsSomeAndFull) {
  auto p = parse_pressure(
      "some avg10=1.50 avg60=0.25 avg300=0.00 total=123456\n"
      "full avg10=0.75 avg60=0.10 avg300=0.01 total=6543\n");
  ASSERT_TRUE(p) << p.message();
  EXPECT_DOUBLE_EQ(p->some.avg10, 1.5);
  EXPECT_DOUBLE_EQ(p->some.avg60, 0.25);
  EXPECT_EQ(p->some.total_us, 123456u);
  ASSERT_TRUE(p->full.has_value());
  EXPECT_DOUBLE_EQ(p->full->avg300, 0.01);
  EXPECT_EQ(p->full->total_us, 6543u);
  EXPECT_EQ(p->some_line, "some avg10=1.50 avg60=0.25 avg300=0.00 total=123456");
}

TEST(ParsePressure, FullLineIsOptional) {
  auto p = parse_pressure("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n");
  ASSERT_TRUE(p) << p.message();
  EXPECT_FALSE(p->full.has_value());
}

TEST(ParsePressure, MalformedInputIsAnError) {
  EXPECT_FALSE(parse_pressure(""));
  EXPECT_FALSE(parse_pressure("full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"));  // no some
  EXPECT_FALSE(parse_pressure("some avg10=0.00 avg60=0.00 total=0\n"));              // no avg300
  EXPECT_FALSE(parse_pressure("some avg10=x avg60=0.00 avg300=0.00 total=0\n"));
  EXPECT_FALSE(parse_pressure("some avg10=0.00 avg60=0.00 avg300=0.00 total=-1\n"));
  EXPECT_FALSE(parse_pressure("some avg10 0.00\n"));
  EXPECT_FALSE(parse_pressure("many avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"));
}

TEST(ParseCgroup, FindsTheV2EntryAmongV1Ones) {
  auto p = parse_cgroup_v2_path(
      "9:name=systemd:/\n"
      "4:memory:/process_api/dd3a\n"
      "0::/system.slice/ollama.service\n");
  ASSERT_TRUE(p) << p.message();
  ASSERT_TRUE(p->has_value());
  EXPECT_EQ(**p, "/system.slice/ollama.service");
}

TEST(ParseCgroup, PathWithColonAndDeletedSuffix) {
  auto p = parse_cgroup_v2_path("0::/a:b/c (deleted)\n");
  ASSERT_TRUE(p) << p.message();
  EXPECT_EQ(p->value(), "/a:b/c");
}

TEST(ParseCgroup, PureV1HasNoPathAndGarbageIsAnError) {
  auto v1 = parse_cgroup_v2_path("4:memory:/x\n1:cpu:/\n");
  ASSERT_TRUE(v1) << v1.message();
  EXPECT_FALSE(v1->has_value());
  EXPECT_FALSE(parse_cgroup_v2_path("garbage\n"));
  EXPECT_FALSE(parse_cgroup_v2_path("x::/y\n"));
  EXPECT_FALSE(parse_cgroup_v2_path("0::relative\n"));
}

TEST(ParseMountinfo, FindsCgroup2MountAndRoot) {
  auto m = parse_cgroup2_mount(
      "22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
      "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime shared:9 - cgroup2 cgroup2 rw\n");
  ASSERT_TRUE(m) << m.message();
  ASSERT_TRUE(m->has_value());
  EXPECT_EQ((*m)->mount_point, "/sys/fs/cgroup/unified");
  EXPECT_EQ((*m)->root, "/");
}

TEST(ParseMountinfo, DecodesOctalEscapes) {
  auto m = parse_cgroup2_mount("41 31 0:38 /sub /mnt/my\\040cgroup rw - cgroup2 cgroup2 rw\n");
  ASSERT_TRUE(m) << m.message();
  EXPECT_EQ((*m)->mount_point, "/mnt/my cgroup");
  EXPECT_EQ((*m)->root, "/sub");
}

TEST(ParseMountinfo, NoCgroup2AndMalformedLines) {
  auto none = parse_cgroup2_mount("22 1 253:1 / / rw,relatime - ext4 /dev/vda rw\n");
  ASSERT_TRUE(none) << none.message();
  EXPECT_FALSE(none->has_value());
  EXPECT_FALSE(parse_cgroup2_mount("22 1 253:1 / / rw,relatime ext4 /dev/vda rw\n"));  // no '-'
  EXPECT_FALSE(parse_cgroup2_mount("22 1\n"));
}

TEST(CgroupDir, JoinsMountAndPathAndHonoursTheMountRoot) {
  EXPECT_EQ(cgroup_dir({"/sys/fs/cgroup", "/"}, "/"), "/sys/fs/cgroup");
  EXPECT_EQ(cgroup_dir({"/sys/fs/cgroup", "/"}, "/user.slice/x"), "/sys/fs/cgroup/user.slice/x");
  EXPECT_EQ(cgroup_dir({"/sys/fs/cgroup/", "/"}, "/a/"), "/sys/fs/cgroup/a");
  EXPECT_EQ(cgroup_dir({"/sys/fs/cgroup", "/kubepods/pod1"}, "/kubepods/pod1/c"), "/sys/fs/cgroup/c");
  EXPECT_EQ(cgroup_dir({"/sys/fs/cgroup", "/kubepods/pod1"}, "/kubepods/pod1"), "/sys/fs/cgroup");
  EXPECT_FALSE(cgroup_dir({"/sys/fs/cgroup", "/kubepods/pod1"}, "/kubepods/pod12").has_value());
  EXPECT_FALSE(cgroup_dir({"/sys/fs/cgroup", "/a"}, "/b").has_value());
}

TEST(ParseMemoryMax, NumberOrMax) {
  auto max = parse_memory_max("max\n");
  ASSERT_TRUE(max);
  EXPECT_FALSE(max->has_value());
  auto n = parse_memory_max("8589934592\n");
  ASSERT_TRUE(n);
  EXPECT_EQ(n->value(), 8589934592ULL);
  EXPECT_FALSE(parse_memory_max("8G\n"));
  EXPECT_FALSE(parse_memory_max(""));
}

TEST(PsiTrigger, BuildsTheKernelsFormat) {
  using namespace std::chrono_literals;
  auto t = make_psi_trigger(150ms, 2s, false);
  ASSERT_TRUE(t) << t.message();
  EXPECT_EQ(*t, "some 150000 2000000");
  auto p = make_psi_trigger(100ms, 1s, true);
  ASSERT_TRUE(p) << p.message();
  EXPECT_EQ(*p, "some 100000 1000000");
}

TEST(PsiTrigger, RejectsWhatTheKernelWouldRejectWithTheReason) {
  using namespace std::chrono_literals;
  auto unpriv = make_psi_trigger(150ms, 1s, false);
  ASSERT_FALSE(unpriv);
  EXPECT_NE(unpriv.message().find("multiples of 2 s"), std::string::npos) << unpriv.message();
  EXPECT_FALSE(make_psi_trigger(150ms, 400ms, true));  // window below 500 ms
  EXPECT_FALSE(make_psi_trigger(150ms, 12s, true));    // window above 10 s
  EXPECT_FALSE(make_psi_trigger(0ms, 2s, true));       // no stall
  EXPECT_FALSE(make_psi_trigger(3s, 2s, true));        // stall longer than the window
}

TEST(Readers, ReadTheLiveFilesOfThisMachine) {
  // Not a check of the machine's numbers, only that the live files parse where they exist.
  auto mi = read_meminfo();
  if (!mi) GTEST_SKIP() << "no /proc/meminfo here: " << mi.message();
  EXPECT_GT(mi->mem_total, 0u);
  auto st = read_proc_status();
  ASSERT_TRUE(st) << st.message();
  EXPECT_TRUE(st->vm_lck.has_value());
  EXPECT_TRUE(st->cap_eff.has_value());
  auto missing = read_text_file("/proc/does-not-exist");
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.message().find("/proc/does-not-exist"), std::string::npos);
  auto psi = read_pressure("/proc/does-not-exist");
  EXPECT_FALSE(psi.available);
  EXPECT_NE(psi.reason.find("No such file"), std::string::npos) << psi.reason;
}

}  // namespace
}  // namespace residency::posix

namespace residency::posix {
namespace {

// A VM guest's layout: cgroup v1's memory controller beside an unrelated cgroup v2 mount. The
// memory cgroup is the v1 one; the v2 "0::/" entry says nothing about memory there.
TEST(ParseCgroupV1, FindsTheMemoryControllersHierarchyBesideAV2Mount) {
  const char* cgroup = "9:name=systemd:/\n8:pids:/\n4:memory:/process_api/f7c2\n3:cpuset:/\n2:cpuacct,cpu:/\n0::/\n";
  auto p = parse_cgroup_v1_memory_path(cgroup);
  ASSERT_TRUE(p) << p.message();
  ASSERT_TRUE(p->has_value());
  EXPECT_EQ(**p, "/process_api/f7c2");
  auto none = parse_cgroup_v1_memory_path("0::/user.slice\n");
  ASSERT_TRUE(none);
  EXPECT_FALSE(none->has_value());
  EXPECT_FALSE(parse_cgroup_v1_memory_path("garbage\n"));

  const char* mountinfo =
      "30 25 0:26 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
      "33 30 0:29 / /sys/fs/cgroup/cpu rw,relatime shared:9 - cgroup cgroup rw,cpu\n"
      "36 30 0:32 / /sys/fs/cgroup/memory rw,relatime shared:12 - cgroup cgroup rw,memory\n"
      "41 30 0:37 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";
  auto m = parse_cgroup_v1_memory_mount(mountinfo);
  ASSERT_TRUE(m) << m.message();
  ASSERT_TRUE(m->has_value());
  EXPECT_EQ((*m)->mount_point, "/sys/fs/cgroup/memory");
  EXPECT_EQ(*cgroup_dir(**m, "/process_api/f7c2"), "/sys/fs/cgroup/memory/process_api/f7c2");
}

TEST(ParseCgroupV1, MemoryLimitInBytesWithTheKernelsNoLimit) {
  auto l = parse_memory_limit_v1("2147483648\n");
  ASSERT_TRUE(l);
  EXPECT_EQ(l->value(), 2147483648u);
  auto none = parse_memory_limit_v1("9223372036854771712\n");  // LONG_MAX rounded down to a page
  ASSERT_TRUE(none);
  EXPECT_FALSE(none->has_value());
  EXPECT_FALSE(parse_memory_limit_v1("max\n")) << "that is cgroup v2's spelling";
}

TEST(ParseMemoryStat, FindsTheKeyOnItsOwnLine) {
  const char* v1 = "cache 100\ninactive_file 7\ntotal_inactive_file 4096\nhierarchical_memory_limit 9\n";
  EXPECT_EQ(parse_memory_stat_value(v1, "total_inactive_file").value_or(0), 4096u);
  EXPECT_EQ(parse_memory_stat_value(v1, "inactive_file").value_or(0), 7u) << "not the total_ line";
  EXPECT_FALSE(parse_memory_stat_value(v1, "active_file"));
  EXPECT_FALSE(parse_memory_stat_value("inactive_file lots\n", "inactive_file"));
  EXPECT_FALSE(parse_memory_stat_value("", "inactive_file"));
}

// The headroom walks up the hierarchy and takes the tightest limited level: here the parent
// (1 GiB, 900 MiB used of which 100 MiB is page cache on the LRU lists), not the unlimited leaf. Real
// files in a directory laid out as a cgroup v2 mount.
TEST(MemoryCgroupHeadroom, TheTightestLimitedLevelWinsAndPageCacheCountsAsRoom) {
  char tmpl[] = "/tmp/residency-cgroup-test-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string mount = tmpl;
  struct Cleanup {
    std::string dir;
    ~Cleanup() { std::filesystem::remove_all(dir); }
  } cleanup{mount};
  auto write = [](const std::string& path, const std::string& text) {
    std::FILE* f = std::fopen(path.c_str(), "w");
    ASSERT_NE(f, nullptr) << path;
    std::fputs(text.c_str(), f);
    std::fclose(f);
  };
  constexpr std::uint64_t MiB = 1 << 20;
  ASSERT_EQ(::mkdir((mount + "/srv").c_str(), 0700), 0);
  ASSERT_EQ(::mkdir((mount + "/srv/llama").c_str(), 0700), 0);
  write(mount + "/srv/memory.max", std::to_string(1024 * MiB) + "\n");
  write(mount + "/srv/memory.current", std::to_string(900 * MiB) + "\n");
  write(mount + "/srv/memory.stat", "anon 1\ninactive_file " + std::to_string(60 * MiB) + "\nactive_file " +
                                        std::to_string(40 * MiB) + "\nunevictable 5\n");
  write(mount + "/srv/llama/memory.max", "max\n");
  write(mount + "/srv/llama/memory.current", std::to_string(600 * MiB) + "\n");
  write(mount + "/srv/llama/memory.stat", "inactive_file 0\n");
  const MemoryCgroup leaf{2, "/srv/llama", mount + "/srv/llama"};
  EXPECT_EQ(memory_cgroup_headroom(leaf).value_or(0), 224 * MiB);  // 1024 - 900 + 60 + 40

  write(mount + "/srv/llama/memory.max", std::to_string(700 * MiB) + "\n");      // tighter still
  EXPECT_EQ(memory_cgroup_headroom(leaf).value_or(0), 100 * MiB);                // 700 - 600 + 0
  write(mount + "/srv/llama/memory.current", std::to_string(800 * MiB) + "\n");  // over its limit
  EXPECT_EQ(memory_cgroup_headroom(leaf).value_or(1), 0u);

  EXPECT_FALSE(memory_cgroup_headroom(MemoryCgroup{2, "/", mount})) << "the root has no limit";
  EXPECT_FALSE(memory_cgroup_headroom(MemoryCgroup{2, "/srv/llama", mount + "/elsewhere"}))
      << "dir not ending in the path";
  const MemoryCgroup unlimited{2, "/other", mount + "/other"};
  EXPECT_FALSE(memory_cgroup_headroom(unlimited)) << "no limit anywhere (and no files)";
}

// On this machine, whatever it has: the memory cgroup found is one whose limit file exists.
TEST(FindMemoryCgroup, ReadsTheControllerThisProcessIsIn) {
  auto cg = find_memory_cgroup();
  if (!cg) GTEST_SKIP() << cg.message();
  EXPECT_TRUE(cg->version == 1 || cg->version == 2);
  if (cg->cgroup_path != "/") {
    const std::string file = cg->dir + (cg->version == 1 ? "/memory.limit_in_bytes" : "/memory.max");
    EXPECT_TRUE(read_text_file(file)) << file;
  }
}

}  // namespace
}  // namespace residency::posix
