// SPDX-License-Identifier: MIT
// libresidency_preload.so in unmodified programs: decode_loop (plain C on llama.h, linked to
// libllama, knowing nothing about residency) and map_file (mmaps a file, no libllama), run as
// child processes with LD_PRELOAD and observed from outside: VmLck in /proc/<pid>/status, the
// model file's mapping in /proc/<pid>/maps, the page cache through mincore on our own mapping of
// the same file after the child's pages were paged out from here (process_madvise).
//
// Every run is compared with the same program run without the preload: same tokens, same exit
// code; the residency lines on stderr are counted.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/capability.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "llama/llama_server.hpp"
#include "support/child_process.hpp"
#include "support/memlock_privileges.hpp"
#include "support/strict.hpp"
#include "support/synthetic_model.hpp"
#include "support/temp_dir.hpp"
#include "workload/gguf_writer.hpp"

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;
constexpr std::uint64_t kMiB = 1024 * 1024;
constexpr int kTokens = 6;  // decodes per run
// What decode_loop is asked, as a user asks llama.cpp: text, tokenized by llama.cpp (the first
// decode is this prompt's tokens in one batch, the others one generated token each).
constexpr const char* kPrompt = "Once upon a time, in a small town,\n";

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  for (std::string line; std::getline(ss, line);) out.push_back(line);
  return out;
}

// Residency's lines start "residency[PID]: " (and, with RESIDENCY_LOG_TIME=1, the time).
const std::regex kResidencyLine(
    R"(^residency\[[0-9]+\]: (?:[0-9]{4}-[0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{3} )?([a-z]+): )");

std::vector<std::string> residency_lines(const std::string& err, const std::string& level) {
  std::vector<std::string> out;
  std::smatch m;
  for (auto& l : lines_of(err))
    if (std::regex_search(l, m, kResidencyLine) && m[1] == level) out.push_back(l);
  return out;
}

std::size_t count_containing(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t p = text.find(what); p != std::string::npos; p = text.find(what, p + 1)) ++n;
  return n;
}

// VmLck of `pid`, bytes; nullopt once the process is gone.
std::optional<std::uint64_t> vm_lck(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmLck:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return std::nullopt;
}

// The pieces of `pid`'s address space that map `path`: address, length, file offset.
struct MappedPiece {
  std::uintptr_t addr = 0;
  std::size_t len = 0;
  std::uint64_t offset = 0;
};
std::vector<MappedPiece> mapped_pieces(pid_t pid, const std::string& path) {
  std::vector<MappedPiece> out;
  std::ifstream in("/proc/" + std::to_string(pid) + "/maps");
  for (std::string line; std::getline(in, line);) {
    if (line.size() < path.size() || line.compare(line.size() - path.size(), path.size(), path) != 0) continue;
    std::istringstream ls(line);
    std::string range, perms, offset;
    ls >> range >> perms >> offset;
    const auto dash = range.find('-');
    MappedPiece p;
    p.addr = std::stoull(range.substr(0, dash), nullptr, 16);
    p.len = std::stoull(range.substr(dash + 1), nullptr, 16) - p.addr;
    p.offset = std::stoull(offset, nullptr, 16);
    out.push_back(p);
  }
  return out;
}

// What decode read, as decode_loop --reads prints it: one tensor per "read" line (llama.cpp's
// eval callback saw it as a node or a source of the first decode's graph).
struct Read {
  std::string usage, buffer_type;
  std::uintptr_t addr = 0, buffer_base = 0;
  std::size_t bytes = 0, buffer_size = 0;
};
std::vector<Read> reads_of(const std::string& out) {
  std::vector<Read> r;
  std::stringstream ss(out);
  for (std::string line; std::getline(ss, line);) {
    if (line.rfind("read ", 0) != 0) continue;
    std::istringstream ls(line.substr(5));
    Read x;
    std::string addr, base;
    ls >> x.usage >> x.buffer_type >> addr >> x.bytes >> base >> x.buffer_size;
    x.addr = std::stoull(addr, nullptr, 16);
    x.buffer_base = std::stoull(base, nullptr, 16);
    r.push_back(x);
  }
  return r;
}

// One mapping of /proc/PID/smaps: its header line, and whether its VmFlags say locked ("lo").
struct SmapsVma {
  std::uintptr_t b = 0, e = 0;
  std::string perms, inode, path;
};
bool is_locked_flags(const std::string& line) {
  return line.rfind("VmFlags:", 0) == 0 && (line + " ").find(" lo ") != std::string::npos;
}
// Walks `pid`'s smaps: `header(vma)` at each mapping's first line, `field(vma, line)` at each
// line after it.
template <class Header, class Field>
void walk_smaps(pid_t pid, Header&& header, Field&& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/smaps");
  SmapsVma v;
  for (std::string line; std::getline(in, line);) {
    const auto dash = line.find('-');
    if (dash != std::string::npos && dash > 0 && std::isxdigit(static_cast<unsigned char>(line[0])) &&
        line.find(' ') > dash) {
      std::istringstream ls(line);
      std::string range, offset, dev;
      v = SmapsVma{};
      ls >> range >> v.perms >> offset >> dev >> v.inode >> v.path;
      v.b = std::stoull(range.substr(0, dash), nullptr, 16);
      v.e = std::stoull(range.substr(dash + 1), nullptr, 16);
      header(v);
    } else {
      field(v, line);
    }
  }
}

// The address ranges of `pid`'s locked VMAs (VmFlags "lo" in /proc/PID/smaps), sorted.
std::vector<std::pair<std::uintptr_t, std::uintptr_t>> locked_vmas(pid_t pid) {
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> out;
  walk_smaps(
      pid, [](const SmapsVma&) {},
      [&](const SmapsVma& v, const std::string& line) {
        if (is_locked_flags(line)) out.emplace_back(v.b, v.e);
      });
  std::sort(out.begin(), out.end());
  return out;
}

// The engine's own libraries in `pid`'s smaps (libllama*, libggml*, and libgomp, the C and C++
// runtimes and the preload, which the preload holds with them: src/preload/engine_code.hpp): the
// executable mappings of libllama and ggml
// (what a decode executes), how much of those is locked and resident (Rss), and the locked bytes
// of all their mappings (what the preload adds to VmLck besides llama.cpp's buffers).
struct EngineVmas {
  std::uint64_t code = 0, code_locked = 0, code_rss = 0, locked = 0;
  std::vector<std::pair<std::uintptr_t, std::size_t>> code_ranges;  // for a pageout
};
EngineVmas engine_vmas(pid_t pid) {
  auto engine = [](const std::string& path, bool with_ours) {
    const std::string name = path.substr(path.rfind('/') + 1);
    for (const char* prefix : {"libllama", "libggml"})
      if (name.rfind(prefix, 0) == 0) return true;
    if (!with_ours) return false;
    for (const char* prefix : {"libgomp", "libresidency_preload", "libstdc++.", "libc.", "libc-", "libm.", "libm-"})
      if (name.rfind(prefix, 0) == 0) return true;
    return false;
  };
  EngineVmas v;
  bool any = false, code = false;
  walk_smaps(
      pid,
      [&](const SmapsVma& m) {
        any = !m.path.empty() && engine(m.path, true) && m.perms.size() >= 2 && m.perms[1] != 'w';  // never a writable one
        code = !m.path.empty() && engine(m.path, false) && m.perms.size() >= 3 && m.perms[2] == 'x';
        if (code) {
          v.code += m.e - m.b;
          v.code_ranges.emplace_back(m.b, m.e - m.b);
        }
      },
      [&](const SmapsVma& m, const std::string& line) {
        if (is_locked_flags(line)) {
          // The whole VMA, as VmLck counts it ("Locked:" divides pages shared with other processes).
          if (any) v.locked += m.e - m.b;
          if (code) v.code_locked += m.e - m.b;
        } else if (code && line.rfind("Rss:", 0) == 0) {
          v.code_rss += std::stoull(line.substr(4)) * 1024;
        }
      });
  return v;
}

// Bytes of [b, e) not inside the sorted ranges.
std::uint64_t uncovered(std::uintptr_t b, std::uintptr_t e,
                        const std::vector<std::pair<std::uintptr_t, std::uintptr_t>>& r) {
  std::uint64_t missing = 0;
  std::uintptr_t at = b;
  for (auto& [rb, re] : r) {
    if (re <= at) continue;
    if (rb >= e) break;
    if (rb > at) missing += rb - at;
    at = std::max(at, re);
    if (at >= e) break;
  }
  if (at < e) missing += e - at;
  return missing;
}

// The engine's working memory the preload holds with the model (src/preload/engine_memory.hpp),
// as the kernel shows it in `pid`'s smaps: the locked VMAs of private anonymous memory (heap,
// stacks, malloc's chunks) and of the engine libraries' writable data, minus those that hold one
// of `buffers` (llama.cpp's buffers, counted as such); and the locked part of the main stack,
// where decode_loop decodes.
struct EngineMemoryVmas {
  std::uint64_t locked = 0, stack_locked = 0;
};
EngineMemoryVmas engine_memory_vmas(pid_t pid, const std::vector<std::pair<std::uintptr_t, std::size_t>>& buffers) {
  const std::uintptr_t page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> buffer_pages;
  for (auto& [bb, bs] : buffers) buffer_pages.emplace_back(bb & ~(page - 1), (bb + bs + page - 1) & ~(page - 1));
  std::sort(buffer_pages.begin(), buffer_pages.end());
  EngineMemoryVmas v;
  bool candidate = false;
  walk_smaps(
      pid,
      [&](const SmapsVma& m) {
        const std::string name = m.path.substr(m.path.rfind('/') + 1);
        const bool rw_private = m.perms.size() >= 4 && m.perms[0] == 'r' && m.perms[1] == 'w' && m.perms[3] == 'p';
        const bool anonymous = m.inode == "0" && (m.path.empty() || m.path == "[heap]" || m.path == "[stack]" ||
                                                  m.path.rfind("[anon:", 0) == 0);
        bool engine_data = false;
        for (const char* prefix : {"libllama", "libggml", "libgomp", "libresidency_preload", "libstdc++.", "libc.",
                                   "libc-", "libm.", "libm-"})
          engine_data = engine_data || (m.inode != "0" && name.rfind(prefix, 0) == 0);
        candidate = rw_private && (anonymous || engine_data);
      },
      [&](const SmapsVma& m, const std::string& line) {
        if (!candidate || !is_locked_flags(line)) return;
        // A buffer in the heap and the heap pages beside it locked too are one VMA: only the part
        // outside the buffers' pages is the engine memory.
        const std::uint64_t outside = uncovered(m.b, m.e, buffer_pages);
        v.locked += outside;
        if (m.path == "[stack]") v.stack_locked += outside;
      });
  return v;
}

// What the kernel holds locked against what decode read, from outside the process: every byte
// decode read from host memory is in a locked mapping (`unlocked_read` 0), so is the code of
// libllama and ggml that it executes, and VmLck is at most what decode reads: the pages of the
// tensors read from the model file's mapping, whole buffers elsewhere (a repacked copy of the
// weights, the KV cache, the compute buffers), and the engine libraries' read-only segments.
struct LockCheck {
  std::uint64_t vm_lck = 0, read_bytes = 0, unlocked_read = 0, bound = 0, file_read = 0, other_buffers = 0;
  EngineVmas engine;
  EngineMemoryVmas memory;
  std::size_t reads = 0;
  std::string buffers;  // "CPU_REPACK weights 51.0 MiB, ..." for the log
};
LockCheck check_locks(pid_t pid, const std::vector<Read>& reads, const std::string& model) {
  LockCheck c;
  const std::uintptr_t page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto locked = locked_vmas(pid);
  const auto file = mapped_pieces(pid, model);
  auto in_file = [&](std::uintptr_t a) {
    for (auto& p : file)
      if (a >= p.addr && a < p.addr + p.len) return true;
    return false;
  };
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> file_pages;
  std::vector<std::pair<std::uintptr_t, std::size_t>> bufs;
  for (const Read& r : reads) {
    c.reads++;
    c.read_bytes += r.bytes;
    c.unlocked_read += uncovered(r.addr, r.addr + r.bytes, locked);
    if (in_file(r.addr)) {
      file_pages.emplace_back(r.addr & ~(page - 1), (r.addr + r.bytes + page - 1) & ~(page - 1));
    } else if (std::find_if(bufs.begin(), bufs.end(), [&](auto& b) { return b.first == r.buffer_base; }) == bufs.end()) {
      bufs.emplace_back(r.buffer_base, r.buffer_size);
      c.other_buffers += ((r.buffer_size + page - 1) & ~(page - 1)) + page;  // a heap buffer may straddle a page
      c.buffers += (c.buffers.empty() ? "" : ", ") + r.buffer_type + " " + r.usage + " " +
                   std::to_string(r.buffer_size / 1024) + " KiB";
    }
  }
  std::sort(file_pages.begin(), file_pages.end());
  std::uintptr_t at = 0;
  for (auto& [b, e] : file_pages) {
    const std::uintptr_t from = std::max(b, at);
    if (e > from) c.file_read += e - from;
    at = std::max(at, e);
  }
  c.engine = engine_vmas(pid);
  c.memory = engine_memory_vmas(pid, bufs);
  c.bound = c.file_read + c.other_buffers + c.engine.locked + c.memory.locked;
  c.vm_lck = vm_lck(pid).value_or(0);
  return c;
}
#define EXPECT_LOCKS_WHAT_DECODE_READS(c)                                                                             \
  do {                                                                                                                \
    EXPECT_GT((c).reads, 0U) << "decode_loop --reads printed nothing";                                                \
    EXPECT_EQ((c).unlocked_read, 0U) << "bytes decode read that are not locked";                                      \
    EXPECT_GT((c).engine.code, 0U) << "no executable mapping of libllama or libggml in the child";                    \
    EXPECT_EQ((c).engine.code_locked, (c).engine.code) << "libllama's and ggml's code is not all locked";             \
    EXPECT_LE((c).vm_lck, (c).bound) << "VmLck above what decode reads (file pages " << (c).file_read << ", buffers " \
                                     << (c).other_buffers << ": " << (c).buffers << ", engine memory "                \
                                     << (c).memory.locked << ")";                                                     \
    EXPECT_GT((c).memory.stack_locked, 0U) << "the stack decode runs on is not locked";                               \
    EXPECT_LE((c).memory.locked, 64 * kMiB) << "the engine memory held is not small next to the model";               \
  } while (0)

// A child process: argv/env as given, stdout through a pipe read line by line, stderr into a
// file, stdin a pipe when asked for. Optionally with RLIMIT_MEMLOCK lowered and CAP_IPC_LOCK
// dropped (bounding set first: a root child would get it back at exec otherwise).
struct SpawnOptions {
  std::vector<std::string> argv;
  std::vector<std::pair<std::string, std::string>> env;  // added to ours, minus RESIDENCY_* and LD_PRELOAD
  bool stdin_pipe = false;
  std::optional<std::uint64_t> memlock_limit;
  bool drop_cap_ipc_lock = false;
};

// The program started with `o`, under residency::testing::ChildProcess; "token I ID" lines are
// what decode_loop prints per decode.
class Child : public residency::testing::ChildProcess {
 public:
  Child(const SpawnOptions& o, const std::string& stderr_path) : ChildProcess(spec(o, stderr_path)) {}
  // The "token I ID" lines seen so far, as "I ID".
  std::vector<std::string> tokens() const {
    std::vector<std::string> t;
    for (auto& l : lines_of(stdout_text()))
      if (l.rfind("token ", 0) == 0) t.push_back(l.substr(6));
    return t;
  }

 private:
  static residency::testing::ChildSpec spec(const SpawnOptions& o, const std::string& stderr_path) {
    residency::testing::ChildSpec s;
    s.argv = o.argv;
    for (auto& [k, v] : o.env) s.env.push_back(k + "=" + v);
    s.drop_env_prefixes = {"RESIDENCY_", "LD_PRELOAD=", "GGML_METAL_"};
    s.stdin_pipe = o.stdin_pipe;
    s.stderr_path = stderr_path;
    const bool drop = o.drop_cap_ipc_lock;
    const std::optional<std::uint64_t> limit = o.memlock_limit;
    s.before_exec = [drop, limit] {
      if (drop) residency::testing::drop_cap_ipc_lock();
      if (limit) residency::testing::set_memlock_limit(*limit);
      return true;
    };
    return s;
  }
};

// The page cache's view of [offset, offset + len) of the file mapped at `base` (our own mapping):
// fraction of its pages resident.
double resident_fraction(const unsigned char* base, std::uint64_t offset, std::size_t len) {
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> vec((len + page - 1) / page);
  if (::mincore(const_cast<unsigned char*>(base) + offset, len, vec.data()) != 0) return -1;
  std::size_t n = 0;
  for (unsigned char v : vec) n += v & 1U;
  return static_cast<double>(n) / static_cast<double>(vec.size());
}

class PreloadTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // A disk-backed directory: the pages of a tmpfs file cannot be paged out without swap.
    dir_ = residency::testing::make_disk_temp_dir("residency-preload", setup_error_);
    if (dir_.empty()) return;
    struct statfs sfs {};
    if (::statfs(dir_.c_str(), &sfs) == 0 && static_cast<long>(sfs.f_type) == 0x01021994) on_tmpfs_ = true;

    // Q4_0: llama.cpp repacks its matrices (CPU_REPACK on AVX2 x86 and ARM, AMX on Xeons), so
    // the extra-buffer-types-on runs test the repacked layout on those CPUs.
    model_ = dir_ + "/model-q4_0.gguf";
    auto shape = residency::workload::plan_llama_shape(64 * kMiB, residency::workload::GgmlType::q4_0);
    if (!shape) {
      setup_error_ = shape.message();
      return;
    }
    if (auto st = residency::workload::write_synthetic_model(model_, *shape, residency::workload::kSyntheticSeed, 2); !st) {
      setup_error_ = st.message();
      return;
    }
    // The tokens without the preload, with llama.cpp's extra buffer types on and off (repacked
    // weights may round differently): what every run must print.
    baseline_out_.clear();  // (each suite of this fixture runs this once)
    for (int nr = 0; nr < 2; ++nr) {
      SpawnOptions o;
      o.argv = {DECODE_LOOP_PATH, "--prompt", kPrompt, model_, std::to_string(kTokens)};
      if (nr == 1) o.argv.insert(o.argv.begin() + 1, "--no-repack");
      Child c(o, dir_ + "/baseline.err");
      if (!c.started()) {
        setup_error_ = "cannot start decode_loop";
        return;
      }
      baseline_exit_ = std::max(baseline_exit_, c.finish());
      (nr == 0 ? baseline_tokens_ : baseline_tokens_nr_) = c.tokens();
      baseline_err_ += c.stderr_text();
      baseline_out_ += c.stdout_text();
    }
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
  }
  void SetUp() override {
    ASSERT_TRUE(setup_error_.empty()) << setup_error_;
    ASSERT_EQ(baseline_exit_, 0) << "decode_loop without the preload failed:\n" << baseline_err_;
    ASSERT_EQ(baseline_tokens_.size(), static_cast<std::size_t>(kTokens)) << baseline_err_;
    ASSERT_EQ(baseline_tokens_nr_.size(), static_cast<std::size_t>(kTokens)) << baseline_err_;
    // The prompt went in as text: BOS and more than one token of it, in both runs.
    ASSERT_EQ(count_containing(baseline_out_, "\nprompt "), 2U) << baseline_out_ << baseline_err_;
    ASSERT_EQ(baseline_out_.find("\nprompt 1\n"), std::string::npos) << baseline_out_;
    // The baseline itself is the engine's business; without the preload residency never speaks.
    ASSERT_TRUE(residency_lines(baseline_err_, "warn").empty()) << baseline_err_;
  }

  // decode_loop under the preload, printing what its first decode reads; no_repack: llama.cpp's
  // extra buffer types off (the weights stay in the file mapping on every CPU).
  static SpawnOptions decode_loop(std::vector<std::pair<std::string, std::string>> env, bool stepped,
                                  bool no_repack = false) {
    SpawnOptions o;
    o.argv = {DECODE_LOOP_PATH, "--reads", "--prompt", kPrompt, model_, std::to_string(kTokens)};
    if (no_repack) o.argv.insert(o.argv.begin() + 1, "--no-repack");
    if (stepped) o.argv.push_back("stdin");
    o.stdin_pipe = stepped;
    o.env = std::move(env);
    o.env.emplace_back("LD_PRELOAD", PRELOAD_PATH);
    return o;
  }
  static std::string err_file(const char* name) { return dir_ + "/" + name + ".err"; }
  std::vector<std::string> baseline_prefix(std::size_t n) const {
    return {baseline_tokens_.begin(),
            baseline_tokens_.begin() + static_cast<std::ptrdiff_t>(std::min(n, baseline_tokens_.size()))};
  }

  static inline std::string dir_, model_, setup_error_, baseline_err_;
  static std::string layout_of(const std::vector<Read>& reads) {
    std::string types;
    for (const Read& r : reads)
      if (r.usage == "weights" && types.find(r.buffer_type) == std::string::npos)
        types += (types.empty() ? "" : "+") + r.buffer_type;
    return types;
  }
  static inline bool on_tmpfs_ = false;
  static inline int baseline_exit_ = -1;
  static inline std::string baseline_out_;
  static inline std::vector<std::string> baseline_tokens_, baseline_tokens_nr_;
};

// The tests whose meaning depends on where llama.cpp keeps the weights run with its extra buffer
// types on (AMX on Intel Xeons, CPU_REPACK for Q4_0 on AVX2 x86 and ARM: most weights copied into
// anonymous memory) and off (every weight read from the file mapping), on every CPU.
class PreloadLayoutTest : public PreloadTest, public ::testing::WithParamInterface<bool> {
 protected:
  static bool no_repack() { return GetParam(); }
  const std::vector<std::string>& baseline() const { return no_repack() ? baseline_tokens_nr_ : baseline_tokens_; }
};
INSTANTIATE_TEST_SUITE_P(Layouts, PreloadLayoutTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return std::string(i.param ? "ExtraBufferTypesOff" : "ExtraBufferTypesOn");
                         });

// (1) With a 1 s keep-alive what decode reads is locked from load (and nothing more), released
// about a second after the last decode, and locked again by the next decode; tokens unchanged.
TEST_P(PreloadLayoutTest, KeepAliveLocksWhatDecodeReadsReleasesItAfterTheKeepAliveAndRelocksOnTheNextDecode) {
  Child c(decode_loop({{"RESIDENCY_KEEP_ALIVE", "1s"}}, true, no_repack()), err_file("keep-alive"));
  ASSERT_TRUE(c.started());
  ASSERT_TRUE(c.wait_for("loaded")) << c.stderr_text();
  const auto t_sent = Clock::now();  // the decode's touch() comes after this
  ASSERT_TRUE(c.send_line());
  ASSERT_TRUE(c.wait_for("token 0")) << c.stderr_text();
  const auto t_decode = Clock::now();
  const double decode_s = std::chrono::duration<double>(t_decode - t_sent).count();
  const std::vector<Read> reads = reads_of(c.stdout_text());
  const LockCheck first = check_locks(c.pid(), reads, model_);
  EXPECT_LOCKS_WHAT_DECODE_READS(first);
  EXPECT_GT(first.read_bytes, 48 * kMiB) << "the model is ~64 MiB: decode reads all of its weights";

  // Released after the keep-alive, not before: poll VmLck.
  // The last use is the touch() just before the decode: after t_sent, before t_decode.
  std::optional<double> released_after;  // since t_sent
  while (seconds_since(t_decode) < 5) {
    if (vm_lck(c.pid()).value_or(1) == 0) {
      released_after = seconds_since(t_sent);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_TRUE(released_after) << "VmLck still " << vm_lck(c.pid()).value_or(0) << " bytes 5 s after the decode";
  EXPECT_GE(*released_after, 1.0) << "released earlier than the 1 s keep-alive";
  EXPECT_LE(*released_after - decode_s, 2.0) << "released long after the 1 s keep-alive (after the decode's end)";

  ASSERT_TRUE(c.send_line());
  ASSERT_TRUE(c.wait_for("token 1")) << c.stderr_text();
  const LockCheck again = check_locks(c.pid(), reads, model_);
  EXPECT_LOCKS_WHAT_DECODE_READS(again);
  // The engine memory is a new snapshot after each wire (the heap may have grown): the rest is the same.
  EXPECT_EQ(again.vm_lck - again.memory.locked, first.vm_lck - first.memory.locked)
      << "not locked again by the next decode";
  for (int i = 2; i < kTokens; ++i) ASSERT_TRUE(c.send_line());
  EXPECT_EQ(c.finish(), 0);
  EXPECT_EQ(c.tokens(), baseline());
  const std::string err = c.stderr_text();
  EXPECT_TRUE(residency_lines(err, "warn").empty()) << err;
  EXPECT_EQ(count_containing(err, "creating a residency set collection"), 1U) << err;
  // At least the release and re-wire seen above (more if this machine stalled a step past 1 s).
  EXPECT_GE(count_containing(err, "(keep-alive 1 s expired)"), 1U) << err;
  EXPECT_GE(count_containing(err, "(touch after release)"), 1U) << err;
  std::cerr << "[ measured ] weights in " << layout_of(reads) << "; decode read " << first.read_bytes << " bytes in "
            << first.reads << " tensors (file pages " << first.file_read << ", buffers " << first.buffers << "); VmLck "
            << first.vm_lck << " bytes (bound " << first.bound << "); first decode " << decode_s << " s; VmLck 0 "
            << *released_after << " s after the decode was asked for; locked again by the next decode\n";
}

// (2) While resident, paging the model out from outside evicts none of what decode reads from
// the file; the same pageout once the keep-alive released it does evict (so the check can fail).
TEST_P(PreloadLayoutTest, PageoutFromOutsideEvictsNothingOfTheResidentModel) {
#if !defined(SYS_pidfd_open) || !defined(SYS_process_madvise)
  GTEST_SKIP() << "no pidfd_open / process_madvise in these headers";
#else
  if (on_tmpfs_) GTEST_SKIP() << dir_ << " is tmpfs: its pages cannot be paged out without swap";
  const int fd = ::open(model_.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  const auto size = static_cast<std::size_t>(std::filesystem::file_size(model_));
  auto* ours = static_cast<unsigned char*>(::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0));  // never touched
  ASSERT_NE(ours, MAP_FAILED);

  Child c(decode_loop({{"RESIDENCY_KEEP_ALIVE", "1s"}}, true, no_repack()), err_file("pageout"));
  ASSERT_TRUE(c.started());
  ASSERT_TRUE(c.wait_for("loaded")) << c.stderr_text();
  ASSERT_TRUE(c.send_line());
  ASSERT_TRUE(c.wait_for("token 0")) << c.stderr_text();
  const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, c.pid(), 0));
  ASSERT_GE(pidfd, 0) << "pidfd_open: " << std::strerror(errno);

  // The file ranges decode reads (tensors in the file mapping), as offsets in the file.
  const std::vector<Read> reads = reads_of(c.stdout_text());
  std::vector<std::pair<std::uint64_t, std::size_t>> live;
  for (auto& p : mapped_pieces(c.pid(), model_))
    for (const Read& r : reads)
      if (r.addr >= p.addr && r.addr + r.bytes <= p.addr + p.len)
        live.emplace_back(p.offset + (r.addr - p.addr), r.bytes);
  ASSERT_FALSE(live.empty()) << "decode reads nothing from the file mapping (the token embeddings stay there)";
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  // Pages the child out (MADV_PAGEOUT on its mappings of the model, Linux >= 5.10), drops the
  // file's unmapped pages from the page cache, and returns what stays resident of what decode
  // reads from the file.
  auto page_out = [&](int* madvise_errno) {
    const auto pieces = mapped_pieces(c.pid(), model_);
    // One piece per call: the kernel stops a vector at the first range it refuses (a locked
    // one), which would spare the pieces after it and let this check pass for that reason alone.
    *madvise_errno = 0;
    for (auto& p : pieces) {
      iovec one{reinterpret_cast<void*>(p.addr), p.len};
      if (::syscall(SYS_process_madvise, pidfd, &one, 1, MADV_PAGEOUT, 0U) < 0 && *madvise_errno == 0)
        *madvise_errno = errno;
    }
    // The engine's code too (a pageout of every mapping, as under pressure).
    for (auto& [addr, len] : engine_vmas(c.pid()).code_ranges) {
      iovec one{reinterpret_cast<void*>(addr), len};
      (void)::syscall(SYS_process_madvise, pidfd, &one, 1, MADV_PAGEOUT, 0U);
    }
    ::posix_fadvise(fd, 0, static_cast<off_t>(size), POSIX_FADV_DONTNEED);
    double resident = 0, total = 0;
    for (auto& [off, len] : live) {
      const std::uint64_t b = off & ~(page - 1);
      const std::size_t n = static_cast<std::size_t>(off + len - b);
      resident += resident_fraction(ours, b, n) * static_cast<double>(n);
      total += static_cast<double>(n);
    }
    return total > 0 ? resident / total : -1.0;
  };

  const auto locked_before = vm_lck(c.pid()).value_or(0);
  int err_locked = 0;
  const double kept = page_out(&err_locked);
  const auto locked_after = vm_lck(c.pid()).value_or(0);
  ASSERT_GT(locked_before, 0U);
  ASSERT_EQ(locked_after, locked_before) << "the keep-alive ran out during the check: it proves nothing";
  EXPECT_EQ(kept, 1.0) << "resident fraction of what decode reads from the file after a pageout from outside";
  const EngineVmas code_kept = engine_vmas(c.pid());
  EXPECT_GT(code_kept.code, 0U);
  EXPECT_EQ(code_kept.code_rss, code_kept.code)
      << "libllama's and ggml's code was paged out while the model was resident";

  // Control: once released, the same pageout evicts.
  const auto t0 = Clock::now();
  while (vm_lck(c.pid()).value_or(1) != 0 && seconds_since(t0) < 5)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(vm_lck(c.pid()).value_or(1), 0U);
  int err_released = 0;
  const double left = page_out(&err_released);
  if (err_released == ENOSYS || err_released == EPERM) {
    GTEST_SKIP() << "process_madvise(MADV_PAGEOUT) failed with " << std::strerror(err_released)
                 << " (needs Linux >= 5.10 and CAP_SYS_NICE): the control cannot run";
  }
  EXPECT_LT(left, 0.5) << "a pageout of the released model evicted little (process_madvise: "
                       << std::strerror(err_released) << "): the locked check above proves nothing";
  // Not asserted: the kernel skips pages another process maps too (a llama.cpp program of a test
  // running beside this one maps the same libraries).
  const EngineVmas code_left = engine_vmas(c.pid());

  // The next decode wires it again: everything resident.
  ASSERT_TRUE(c.send_line());
  ASSERT_TRUE(c.wait_for("token 1")) << c.stderr_text();
  const LockCheck back = check_locks(c.pid(), reads, model_);
  EXPECT_LOCKS_WHAT_DECODE_READS(back);
  ::close(pidfd);
  EXPECT_EQ(c.finish(), 0);
  EXPECT_EQ(c.tokens(), std::vector<std::string>(baseline().begin(), baseline().begin() + 2));
  ::munmap(ours, size);
  ::close(fd);
  std::cerr << "[ measured ] resident after pageout: locked " << kept
            << " (process_madvise: " << (err_locked ? std::strerror(err_locked) : "ok") << "), released " << left
            << "; engine code resident " << code_kept.code_rss << " of " << code_kept.code << " bytes while locked, "
            << code_left.code_rss << " once released\n";
#endif
}

// (3) RLIMIT_MEMLOCK 64 KiB and no CAP_IPC_LOCK: the manager's clamp warning is the one line,
// no more than the limit is locked (llama.cpp's small buffers may fit it), the tokens are the same.
TEST_P(PreloadLayoutTest, TooLowMemlockLimitIsOneWarningAndTheProgramRunsAsWithout) {
  SpawnOptions o = decode_loop({}, true, no_repack());
  o.memlock_limit = 64 * 1024;
  o.drop_cap_ipc_lock = true;
  Child c(o, err_file("memlock"));
  ASSERT_TRUE(c.started());
  ASSERT_TRUE(c.wait_for("loaded")) << c.stderr_text();
  ASSERT_TRUE(c.send_line());
  ASSERT_TRUE(c.wait_for("token 0")) << c.stderr_text();
  EXPECT_LE(vm_lck(c.pid()).value_or(UINT64_MAX), 64U * 1024);
  for (int i = 1; i < kTokens; ++i) ASSERT_TRUE(c.send_line());
  EXPECT_EQ(c.finish(), 0);
  EXPECT_EQ(c.tokens(), baseline());
  const std::string err = c.stderr_text();
  const auto warns = residency_lines(err, "warn");
  ASSERT_EQ(warns.size(), 1U) << err;
  EXPECT_NE(warns[0].find("RLIMIT_MEMLOCK = 64 KiB"), std::string::npos) << warns[0];
  // The preload's own line names the same cause.
  std::size_t unlocked = 0;
  for (const std::string& l : residency_lines(err, "info")) {
    if (l.find("registered is not locked") == std::string::npos) continue;
    ++unlocked;
    EXPECT_NE(l.find("is not locked: over RLIMIT_MEMLOCK, 64 KiB (no CAP_IPC_LOCK)"), std::string::npos) << l;
  }
  EXPECT_GE(unlocked, 1U) << err;
}

// (4) A program that maps a GGUF file but has no llama_decode behind the preload: one warning,
// nothing registered (no manager), output unchanged.
TEST_F(PreloadTest, ProgramWithoutLlamaDecodeIsOneWarningAndUnchanged) {
  SpawnOptions plain;
  plain.argv = {MAP_FILE_PATH, model_};
  Child without(plain, err_file("map-plain"));
  ASSERT_TRUE(without.started());
  ASSERT_EQ(without.finish(), 0) << without.stderr_text();

  SpawnOptions o = plain;
  o.env = {{"LD_PRELOAD", PRELOAD_PATH}};
  Child with(o, err_file("map-preload"));
  ASSERT_TRUE(with.started());
  EXPECT_EQ(with.finish(), 0);
  EXPECT_EQ(with.stdout_text(), without.stdout_text());
  EXPECT_FALSE(with.stdout_text().empty());
  const std::string err = with.stderr_text();
  const auto warns = residency_lines(err, "warn");
  ASSERT_EQ(warns.size(), 1U) << err;
  EXPECT_NE(warns[0].find("llama_decode is not reachable"), std::string::npos) << warns[0];
  EXPECT_NE(warns[0].find("Residency starts when one is"), std::string::npos) << warns[0];
  EXPECT_EQ(lines_of(err).size(), 1U) << "no manager, no other line:\n" << err;
}

// (5) Keep-alive 0: wired only during each decode (a use scope around it), so nothing is locked
// between decodes; one release per decode; tokens unchanged.
TEST_F(PreloadTest, KeepAliveZeroLocksOnlyDuringEachDecode) {
  Child c(decode_loop({{"RESIDENCY_KEEP_ALIVE", "0"}}, true), err_file("zero"));
  ASSERT_TRUE(c.started());
  ASSERT_TRUE(c.wait_for("loaded")) << c.stderr_text();
  EXPECT_EQ(vm_lck(c.pid()).value_or(1), 0U) << "after load";
  std::vector<std::uint64_t> between;
  for (int i = 0; i < kTokens; ++i) {
    ASSERT_TRUE(c.send_line());
    ASSERT_TRUE(c.wait_for("token " + std::to_string(i))) << c.stderr_text();
    between.push_back(vm_lck(c.pid()).value_or(1));
  }
  EXPECT_EQ(between, std::vector<std::uint64_t>(kTokens, 0));
  EXPECT_EQ(c.finish(), 0);
  EXPECT_EQ(c.tokens(), baseline_tokens_);
  const std::string err = c.stderr_text();
  EXPECT_TRUE(residency_lines(err, "warn").empty()) << err;
  // Each decode wired (the first one wires for the first time, the others re-wire) and released.
  EXPECT_EQ(count_containing(err, "]: info: released "), static_cast<std::size_t>(kTokens)) << err;
  EXPECT_EQ(count_containing(err, "(use scope)"), static_cast<std::size_t>(kTokens - 1)) << err;
}

// At info, the load is told before anything is released: one summary line per registration
// (how much of each class, in which buffer types) and one line per wire, each line of
// residency's starting with "residency[PID]: " on a line of its own (stderr is a file here, so
// a host's unfinished line is seen and ended first); RESIDENCY_LOG_TIME=1 adds the local time.
TEST_F(PreloadTest, AtInfoTheLoadIsOneSummaryAndOneWireLineWithThePidOnFreshLines) {
  for (const bool with_time : {false, true}) {
    SCOPED_TRACE(with_time ? "RESIDENCY_LOG_TIME=1" : "without time");
    std::vector<std::pair<std::string, std::string>> env = {{"RESIDENCY_KEEP_ALIVE", "forever"}};
    if (with_time) env.emplace_back("RESIDENCY_LOG_TIME", "1");
    Child c(decode_loop(env, false), err_file(with_time ? "summary-time" : "summary"));
    ASSERT_TRUE(c.started());
    EXPECT_EQ(c.finish(), 0);
    EXPECT_EQ(c.tokens(), baseline_tokens_);
    const std::string err = c.stderr_text();
    const std::vector<std::string> info = residency_lines(err, "info");
    const std::string pid = "residency[" + std::to_string(c.pid()) + "]: ";
    std::size_t summaries = 0, wires = 0;
    for (const std::string& l : info) {
      EXPECT_EQ(l.rfind(pid, 0), 0U) << "the pid of the process: " << l;
      if (with_time) {
        EXPECT_TRUE(std::regex_search(l, std::regex(R"(^residency\[[0-9]+\]: 20[0-9]{2}-[0-9]{2}-[0-9]{2} [0-9:]{8}\.[0-9]{3} info: )")))
            << l;
      }
      if (l.find("preload: registered ") != std::string::npos) {
        ++summaries;
        EXPECT_TRUE(std::regex_search(
            l, std::regex(R"(preload: registered [0-9]+ buffers?: (weights|kv_cache|scratch) [0-9.]+ [KMG]iB \()")))
            << l;
      }
      if (l.find("preload: wired ") != std::string::npos) {
        ++wires;
        EXPECT_TRUE(std::regex_search(l, std::regex(R"(preload: wired [0-9.]+ [KMG]iB in [0-9.]+ ms \((model loaded|context made)\))")))
            << l;
      }
    }
    EXPECT_GE(summaries, 2U) << "the model, then the context:\n" << err;
    EXPECT_LE(summaries, 3U) << err;
    EXPECT_EQ(wires, summaries) << "forever wires what each registration added:\n" << err;
    EXPECT_NE(err.find("registered "), std::string::npos);
    EXPECT_NE(err.find("weights "), std::string::npos) << err;
    EXPECT_NE(err.find("kv_cache "), std::string::npos) << err;
    // Never glued to someone else's line.
    for (const std::string& l : lines_of(err))
      EXPECT_TRUE(l.find("residency[") == std::string::npos || l.rfind("residency[", 0) == 0) << l;
  }
}

// A wired limit below the model wires nothing of it, and says so once, at warn.
TEST_F(PreloadTest, AWiredLimitBelowTheModelIsOneWarning) {
  Child c(decode_loop({{"RESIDENCY_KEEP_ALIVE", "forever"},
                       {"RESIDENCY_WIRED_LIMIT", "1MiB"},
                       {"RESIDENCY_LOG", "warn"}},
                      true),
          err_file("below-limit"));
  ASSERT_TRUE(c.started());
  ASSERT_TRUE(c.wait_for("loaded")) << c.stderr_text();
  for (int i = 0; i < kTokens; ++i) ASSERT_TRUE(c.send_line());
  ASSERT_TRUE(c.wait_for("token " + std::to_string(kTokens - 1))) << c.stderr_text();
  EXPECT_LE(vm_lck(c.pid()).value_or(0), std::uint64_t{1} << 20) << "at most the 1 MiB limit is locked";
  EXPECT_EQ(c.finish(), 0);
  const std::string err = c.stderr_text();
  const auto warns = residency_lines(err, "warn");
  ASSERT_EQ(warns.size(), 1U) << err;
  EXPECT_NE(warns[0].find("stays unwired: it is over the wired limit of 1 MiB (RESIDENCY_WIRED_LIMIT="), std::string::npos)
      << warns[0];
}

// (6) A bad RESIDENCY_KEEP_ALIVE: one warning naming it, then pass-through.
TEST_F(PreloadTest, BadKeepAliveIsOneWarningAndPassThrough) {
  Child c(decode_loop({{"RESIDENCY_KEEP_ALIVE", "soon"}}, true), err_file("bad"));
  ASSERT_TRUE(c.started());
  ASSERT_TRUE(c.wait_for("loaded")) << c.stderr_text();
  ASSERT_TRUE(c.send_line());
  ASSERT_TRUE(c.wait_for("token 0")) << c.stderr_text();
  EXPECT_EQ(vm_lck(c.pid()).value_or(1), 0U);
  for (int i = 1; i < kTokens; ++i) ASSERT_TRUE(c.send_line());
  EXPECT_EQ(c.finish(), 0);
  EXPECT_EQ(c.tokens(), baseline_tokens_);
  const std::string err = c.stderr_text();
  const auto warns = residency_lines(err, "warn");
  ASSERT_EQ(warns.size(), 1U) << err;
  EXPECT_NE(warns[0].find("RESIDENCY_KEEP_ALIVE=\"soon\""), std::string::npos) << warns[0];
  EXPECT_EQ(lines_of(err).size(), 1U) << "no manager, no other line:\n" << err;
}

// The default keep-alive (180 s) with pauses between decodes: the model stays locked through the
// whole run, and the tokens are the same.
TEST_P(PreloadLayoutTest, DefaultKeepAliveKeepsTheModelLockedAcrossPauses) {
  SpawnOptions o = decode_loop({}, false, no_repack());
  o.argv.push_back("200");
  Child c(o, err_file("default"));
  ASSERT_TRUE(c.started());
  ASSERT_TRUE(c.wait_for("token 2")) << c.stderr_text();
  const LockCheck l = check_locks(c.pid(), reads_of(c.stdout_text()), model_);
  EXPECT_LOCKS_WHAT_DECODE_READS(l);
  EXPECT_EQ(c.finish(), 0);
  EXPECT_EQ(c.tokens(), baseline());
  const std::string err = c.stderr_text();
  EXPECT_TRUE(residency_lines(err, "warn").empty()) << err;
  EXPECT_EQ(count_containing(err, "keep_alive = 180 s"), 1U) << err;
}

// (shared budget) Left out by a full shared budget, the preload's line says so, naming the budget,
// and names neither the wired limit nor RLIMIT_MEMLOCK, which did not apply (a server run as root
// was once told "not locked: over the wired limit of 17.7 GiB (RLIMIT_MEMLOCK is 8 MiB)"). The
// first program holds the budget at a priority the second may not ask, so that nothing gives way.
TEST_F(PreloadTest, AFullSharedBudgetIsNamedAsWhatLeftMemoryUnlocked) {
  const std::uint64_t model_bytes = std::filesystem::file_size(model_);
  const std::uint64_t budget = model_bytes * 3 / 2;  // one model fits, two do not
  if (::geteuid() != 0) {
    rlimit rl{};
    ::getrlimit(RLIMIT_MEMLOCK, &rl);
    if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < model_bytes + 16 * kMiB)
      GTEST_SKIP() << "RLIMIT_MEMLOCK is " << rl.rlim_cur / kMiB << " MiB; each program locks its "
                   << model_bytes / kMiB << " MiB model (ulimit -l unlimited, or run as root)";
  }
  const std::string name = "preload-full-" + std::to_string(::getpid());
  std::vector<std::pair<std::string, std::string>> env = {{"RESIDENCY_KEEP_ALIVE", "forever"},
                                                          {"RESIDENCY_SHARED_BUDGET", name + ":" + std::to_string(budget)}};
  auto env_a = env;
  env_a.emplace_back("RESIDENCY_SHARED_PRIORITY", "1000");
  Child a(decode_loop(env_a, true), err_file("full-a"));
  ASSERT_TRUE(a.started());
  ASSERT_TRUE(a.wait_for("loaded")) << a.stderr_text();
  Child b(decode_loop(env, true), err_file("full-b"));
  ASSERT_TRUE(b.started());
  ASSERT_TRUE(b.wait_for("loaded")) << b.stderr_text();
  ASSERT_TRUE(b.send_line());
  ASSERT_TRUE(b.wait_for("token 0")) << b.stderr_text();
  for (int i = 1; i < kTokens; ++i) ASSERT_TRUE(b.send_line());
  for (int i = 0; i < kTokens; ++i) ASSERT_TRUE(a.send_line());
  EXPECT_EQ(b.finish(), 0) << b.stderr_text();
  EXPECT_EQ(a.finish(), 0) << a.stderr_text();
  EXPECT_EQ(b.tokens(), baseline_tokens_);
  const std::string err = b.stderr_text();
  std::size_t unlocked = 0;
  for (const std::string& l : residency_lines(err, "info")) {
    if (l.find("registered is not locked") == std::string::npos) continue;
    ++unlocked;
    EXPECT_NE(l.find("is not locked: the shared budget " + name + " ("), std::string::npos) << l;
    EXPECT_NE(l.find(") is full: this process holds "), std::string::npos) << l;
    EXPECT_EQ(l.find("RLIMIT_MEMLOCK"), std::string::npos) << l;
    EXPECT_EQ(l.find("wired limit"), std::string::npos) << l;
  }
  EXPECT_GE(unlocked, 1U) << "the second program's model does not fit beside the first's\n" << err;
}

// (shared budget) Two llama.cpp programs under the preload naming one budget smaller than their
// two models together (RESIDENCY_SHARED_BUDGET): their VmLck, sampled continuously, never sums
// above it; the idle one, asked, gives its model back to the one that starts decoding, and when
// it decodes again while the other is busy it runs unwired (same tokens) instead of taking it.
TEST_F(PreloadTest, TwoProgramsUnderOneSharedBudgetNeverLockMoreThanItAndTheIdleOneGivesWay) {
  const std::uint64_t model_bytes = std::filesystem::file_size(model_);
  const std::uint64_t budget = model_bytes * 3 / 2;  // one model fits, two do not
  if (::geteuid() != 0) {
    rlimit rl{};
    ::getrlimit(RLIMIT_MEMLOCK, &rl);
    if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < model_bytes + 16 * kMiB)
      GTEST_SKIP() << "RLIMIT_MEMLOCK is " << rl.rlim_cur / kMiB << " MiB; each program locks its "
                   << model_bytes / kMiB << " MiB model (ulimit -l unlimited, or run as root)";
  }
  const std::string name = "preload-test-" + std::to_string(::getpid());
  const std::vector<std::pair<std::string, std::string>> env = {{"RESIDENCY_KEEP_ALIVE", "forever"},
                                                                {"RESIDENCY_SHARED_BUDGET",
                                                                 name + ":" + std::to_string(budget)}};
  Child a(decode_loop(env, true), err_file("shared-a"));
  ASSERT_TRUE(a.started());
  ASSERT_TRUE(a.wait_for("loaded")) << a.stderr_text();
  ASSERT_TRUE(a.send_line());
  ASSERT_TRUE(a.wait_for("token 0")) << a.stderr_text();
  const LockCheck la = check_locks(a.pid(), reads_of(a.stdout_text()), model_);
  EXPECT_LOCKS_WHAT_DECODE_READS(la);
  ASSERT_LE(la.vm_lck, budget) << a.stderr_text();

  // Both sampled from here on: each sample reads a, b, b, a and keeps each one's smaller reading
  // (memory moving between them within a sweep is not counted twice).
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> max_sum{0}, samples{0};
  std::atomic<pid_t> pid_b{0};
  std::thread sampler([&] {
    while (!stop) {
      const pid_t pb = pid_b.load();
      const std::uint64_t a1 = vm_lck(a.pid()).value_or(0), b1 = pb > 0 ? vm_lck(pb).value_or(0) : 0;
      const std::uint64_t b2 = pb > 0 ? vm_lck(pb).value_or(0) : 0, a2 = vm_lck(a.pid()).value_or(0);
      max_sum = std::max(max_sum.load(), std::min(a1, a2) + std::min(b1, b2));
      ++samples;
    }
  });
  // a idle for more than a second: the one to ask.
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  Child b(decode_loop(env, true), err_file("shared-b"));
  ASSERT_TRUE(b.started());
  pid_b = b.pid();
  ASSERT_TRUE(b.wait_for("loaded")) << b.stderr_text();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(b.send_line());
  ASSERT_TRUE(b.wait_for("token 2")) << b.stderr_text();
  const LockCheck lb = check_locks(b.pid(), reads_of(b.stdout_text()), model_);
  EXPECT_EQ(lb.unlocked_read, 0U) << "the decoding program got the budget\n" << b.stderr_text();
  const std::uint64_t mapped_b = lb.vm_lck;
  EXPECT_EQ(vm_lck(a.pid()).value_or(1), 0u) << "the idle program gave its model back";
  EXPECT_EQ(count_containing(a.stderr_text(), "asked by process " + std::to_string(b.pid())), 1U) << a.stderr_text();

  // a decodes again while b is busy (used less than a second ago): a is not allowed to take b's
  // share, so it decodes unwired, with the same tokens. Checked after a's first decode: by the
  // end of all of them b may have been idle for over a second on a loaded machine, and then giving
  // way is right (seen under ctest -j12 on the GPU machine's host).
  ASSERT_TRUE(a.send_line());
  ASSERT_TRUE(a.wait_for("token 1")) << a.stderr_text();
  EXPECT_EQ(vm_lck(b.pid()).value_or(0), mapped_b) << "b was busy: nobody may take its share";
  for (int i = 2; i < kTokens; ++i) ASSERT_TRUE(a.send_line());
  ASSERT_TRUE(a.wait_for("token " + std::to_string(kTokens - 1))) << a.stderr_text();
  for (int i = 3; i < kTokens; ++i) ASSERT_TRUE(b.send_line());
  EXPECT_EQ(a.finish(), 0) << a.stderr_text();
  EXPECT_EQ(b.finish(), 0) << b.stderr_text();
  stop = true;
  sampler.join();
  EXPECT_EQ(a.tokens(), baseline_tokens_);
  EXPECT_EQ(b.tokens(), baseline_tokens_);
  EXPECT_GT(samples.load(), 100u);
  EXPECT_LE(max_sum.load(), budget) << "the two programs together locked more than the shared budget";
  EXPECT_GE(count_containing(a.stderr_text(), "shared budget " + name), 1U) << a.stderr_text();
  EXPECT_FALSE(std::filesystem::exists("/dev/shm/residency-budget-" + name)) << "the last holder removes the ledger";
  std::cerr << "[ measured ] model " << model_bytes << " bytes, budget " << budget << "; most locked by both at once "
            << max_sum.load() << " bytes over " << samples.load() << " samples\n";
}

// ---- llama.cpp's load modes (llama_model_params.load_mode; llama-server's --load-mode) ----
// Where each keeps the weights (docs/llama-cpp.md, "Load modes"): mmap in CPU_Mapped buffers over
// the file mapping; none, mlock and dio in a CPU buffer of anonymous memory, read from the file
// (dio with O_DIRECT); mlock and mmap+mlock lock the weights themselves, for the model's life. The
// model is F16 and llama.cpp's extra buffer types are off (--no-repack), so that every CPU keeps
// all the weights in those buffers (no CPU_REPACK or AMX copy, which llama.cpp never locks).

// The weights' reads of `reads` (what decode read from the buffers llama.cpp marked as weights).
std::vector<Read> weight_reads(const std::vector<Read>& reads) {
  std::vector<Read> w;
  for (const Read& r : reads)
    if (r.usage == "weights") w.push_back(r);
  return w;
}
// Bytes of the reads not inside `locked`, and the pages the reads span (each page once).
struct ReadPages {
  std::uint64_t unlocked = 0, pages = 0;
};
ReadPages read_pages(const std::vector<Read>& reads, const std::vector<std::pair<std::uintptr_t, std::uintptr_t>>& locked) {
  const std::uintptr_t page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  ReadPages p;
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> spans;
  for (const Read& r : reads) {
    p.unlocked += uncovered(r.addr, r.addr + r.bytes, locked);
    spans.emplace_back(r.addr & ~(page - 1), (r.addr + r.bytes + page - 1) & ~(page - 1));
  }
  std::sort(spans.begin(), spans.end());
  std::uintptr_t at = 0;
  for (auto& [b, e] : spans) {
    if (e > std::max(b, at)) p.pages += e - std::max(b, at);
    at = std::max(at, e);
  }
  return p;
}

class PreloadLoadModeTest : public ::testing::TestWithParam<const char*> {
 protected:
  static void SetUpTestSuite() {
    dir_ = residency::testing::make_disk_temp_dir("residency-load-mode", setup_error_);
    if (dir_.empty()) return;
    model_ = dir_ + "/model-f16.gguf";
    setup_error_ = residency::testing::write_f16_model(model_, 48 * kMiB);
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
  }
  void SetUp() override {
    ASSERT_TRUE(setup_error_.empty()) << setup_error_;
#if !RESIDENCY_LLAMA_HAS_LOAD_MODE
    if (mode() == "dio") GTEST_SKIP() << "this llama.cpp has no load_mode, so no direct I/O (b6431)";
#endif
  }
  static std::string mode() { return GetParam(); }
  static bool llama_locks() { return mode() == "mlock" || mode() == "mmap+mlock"; }
  static bool mapped() { return mode() == "mmap" || mode() == "mmap+mlock"; }
  // decode_loop in this load mode, stepped, printing what its first decode reads.
  static SpawnOptions decode_loop(bool preload) {
    SpawnOptions o;
    o.argv = {DECODE_LOOP_PATH, "--no-repack", "--reads", "--load-mode",           mode(),
              "--prompt",       kPrompt,       model_,    std::to_string(kTokens), "stdin"};
    o.stdin_pipe = true;
    if (preload) o.env = {{"RESIDENCY_KEEP_ALIVE", "1s"}, {"LD_PRELOAD", PRELOAD_PATH}};
    return o;
  }
  static std::string err_file(const std::string& name) {
    std::string m = mode();
    std::replace(m.begin(), m.end(), '+', '-');
    return dir_ + "/" + m + "-" + name + ".err";
  }
  // Whether the model file can be opened with O_DIRECT here (else llama.cpp's dio falls back to
  // buffered reads, one warning of its own: the weights land in the same buffer either way).
  static bool direct_io() {
    const int fd = ::open(model_.c_str(), O_RDONLY | O_DIRECT);
    if (fd >= 0) ::close(fd);
    return fd >= 0;
  }
  static inline std::string dir_, model_, setup_error_;
};

// Each load mode, with a 1 s keep-alive: what decode reads is locked while it runs; once the
// keep-alive has passed what residency locked is unlocked (the engine's code with it) and only
// llama.cpp's own lock of the weights stays (mlock, mmap+mlock), or nothing (mmap, none, dio); the
// next decode locks it all again; the tokens are those of the same load mode without the preload.
TEST_P(PreloadLoadModeTest, HoldsWhatDecodeReadsAndAfterTheKeepAliveLeavesOnlyLlamaCppsOwnLock) {
  Child plain(decode_loop(false), err_file("plain"));
  ASSERT_TRUE(plain.started());
  for (int i = 0; i < kTokens; ++i) ASSERT_TRUE(plain.send_line());
  ASSERT_EQ(plain.finish(), 0) << plain.stderr_text();
  ASSERT_EQ(plain.tokens().size(), static_cast<std::size_t>(kTokens)) << plain.stderr_text();

  Child c(decode_loop(true), err_file("preload"));
  ASSERT_TRUE(c.started());
  ASSERT_TRUE(c.wait_for("loaded")) << c.stderr_text();
  ASSERT_TRUE(c.send_line());
  ASSERT_TRUE(c.wait_for("token 0")) << c.stderr_text();
  const std::vector<Read> reads = reads_of(c.stdout_text());
  const std::vector<Read> weights = weight_reads(reads);
  const LockCheck first = check_locks(c.pid(), reads, model_);
  EXPECT_LOCKS_WHAT_DECODE_READS(first);
  const ReadPages w = read_pages(weights, locked_vmas(c.pid()));
  EXPECT_GT(w.pages, 40 * kMiB) << "the model is ~48 MiB: decode reads all of its weights";
  // The mode took effect: the weights are read from the file's mapping, or from anonymous memory.
  std::uint64_t from_file = 0;
  for (const MappedPiece& p : mapped_pieces(c.pid(), model_))
    for (const Read& r : weights)
      if (r.addr >= p.addr && r.addr < p.addr + p.len) from_file += r.bytes;
  if (mapped()) EXPECT_GT(from_file, 40 * kMiB) << "the weights are not read from the model's mapping";
  else EXPECT_EQ(from_file, 0U) << "the weights are read from the model's mapping";

  // After the keep-alive (its release line, at most 10 s after the decode): what is locked now.
  const auto t0 = Clock::now();
  while (count_containing(c.stderr_text(), "(keep-alive 1 s expired)") == 0 && seconds_since(t0) < 10)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_GE(count_containing(c.stderr_text(), "(keep-alive 1 s expired)"), 1U) << c.stderr_text();
  const std::uint64_t after = vm_lck(c.pid()).value_or(0);
  const ReadPages w_after = read_pages(weights, locked_vmas(c.pid()));
  const EngineVmas code_after = engine_vmas(c.pid());
  EXPECT_EQ(code_after.code_locked, 0U) << "the engine's code, residency's, is still locked after the keep-alive";
  if (llama_locks()) {
    EXPECT_EQ(w_after.unlocked, 0U) << "llama.cpp's own lock of the weights was undone by the keep-alive's release";
    // llama.cpp's lock alone: the weights' pages, and a page past each buffer (llama_mlock rounds
    // the size up from an unaligned base).
    const auto page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
    EXPECT_LE(after, w.pages + 16 * page) << "more than llama.cpp's lock of the weights is locked after the keep-alive";
  } else {
    EXPECT_EQ(after, 0U) << "still locked after the keep-alive";
  }

  ASSERT_TRUE(c.send_line());
  ASSERT_TRUE(c.wait_for("token 1")) << c.stderr_text();
  const LockCheck again = check_locks(c.pid(), reads, model_);
  EXPECT_LOCKS_WHAT_DECODE_READS(again);
  for (int i = 2; i < kTokens; ++i) ASSERT_TRUE(c.send_line());
  EXPECT_EQ(c.finish(), 0) << c.stderr_text();
  EXPECT_EQ(c.tokens(), plain.tokens()) << "other tokens than without the preload";
  const std::string err = c.stderr_text();
  EXPECT_TRUE(residency_lines(err, "warn").empty()) << err;
  EXPECT_TRUE(residency_lines(err, "error").empty()) << err;
  // Only residency's lines (decode_loop shows llama.cpp's errors).
  for (const std::string& l : lines_of(err)) EXPECT_EQ(l.rfind("residency[", 0), 0U) << l;
  EXPECT_EQ(count_containing(err, "left to the program, which locks it itself"), llama_locks() ? 1U : 0U) << err;
  std::cerr << "[ measured ] load mode " << mode() << ": weights " << w.pages << " bytes of pages, "
            << (mapped() ? "in the file mapping" : "in anonymous memory")
            << (mode() == "dio" ? (direct_io() ? " (read with O_DIRECT)" : " (no O_DIRECT here: buffered)") : "")
            << "; VmLck " << first.vm_lck << " after the first decode, " << after << " after the keep-alive\n";
}

// A test's name for its mode ("mmap+mlock": mmap_mlock).
std::string load_mode_name(const ::testing::TestParamInfo<const char*>& i) {
  std::string n = i.param;
  std::replace(n.begin(), n.end(), '+', '_');
  return n;
}
INSTANTIATE_TEST_SUITE_P(LoadModes, PreloadLoadModeTest,
                         ::testing::Values("mmap", "none", "mlock", "mmap+mlock", "dio"), load_mode_name);

// (9) An unmodified llama-server under the preload, asked as a user asks it (a text prompt over
// HTTP): it answers 200 with the tokens asked for, the model is locked while it serves, given
// back once the keep-alive (1 s) has passed with no request, and locked again by the next one.
TEST_F(PreloadTest, LlamaServerAnswersTextAndHoldsTheModelOnlyWhileServing) {
  if (::access(LLAMA_SERVER_PATH, X_OK) != 0) {
    GTEST_SKIP() << "no llama-server at " << LLAMA_SERVER_PATH << " (a scripts/llama-cpp --libs-only install has none)";
  }
  std::string error;
  auto server = residency::testing::start_llama_server(LLAMA_SERVER_PATH, model_, err_file("server"), error, {},
                                                       {"LD_PRELOAD=" PRELOAD_PATH, "RESIDENCY_KEEP_ALIVE=1s"},
                                                       {"RESIDENCY_", "LD_PRELOAD=", "GGML_METAL_"});
  ASSERT_TRUE(server) << error;
  const pid_t pid = server->process->pid();
  const std::string request = R"({"prompt":"Hello, world!\nOnce upon a time","n_predict":8,"ignore_eos":true})";
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE("request " + std::to_string(round + 1));
    const auto r = residency::testing::http_request(server->port, "/completion", request);
    ASSERT_EQ(r.status, 200) << r.body << "\n" << server->process->stderr_text();
    EXPECT_EQ(residency::testing::json_number(r.body, "tokens_predicted"), 8) << r.body;
    EXPECT_GT(vm_lck(pid).value_or(0), 0U) << "nothing locked right after a request\n"
                                           << server->process->stderr_text();
    // Given back after the keep-alive: VmLck 0 within a few seconds of the last request.
    const auto t0 = Clock::now();
    while (vm_lck(pid).value_or(0) != 0 && seconds_since(t0) < 10)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_EQ(vm_lck(pid).value_or(1), 0U) << "still locked 10 s after the last request";
  }
  EXPECT_TRUE(server->process->alive()) << server->process->stderr_text();
  // llama-server loads a model without weights first (its vocabulary): the engine's code is held
  // with the model that has them, once.
  const std::string err = server->process->stderr_text();
  EXPECT_EQ(count_containing(err, "preload: engine code: "), 1U) << err;
}

// llama-server --load-mode mlock: llama.cpp reads the weights into a CPU buffer and locks it
// itself. Its lock rounds the buffer's size up to a page from an unaligned base, so it reaches a
// page past the buffer's mapping; where that page is unmapped or PROT_NONE (with this model on the
// EPYC VM, v0.4.0 and v0.5.0, with and without the preload), mlock fails with ENOMEM after the
// kernel has locked the buffer, and llama.cpp says "failed to mlock". Either way the weights stay
// locked for the server's life: the keep-alive's release unlocks only what residency locked (before
// 2026-12-05 it unlocked that buffer: VmLck 4 kB after the keep-alive). Same answers as without
// the preload.
// (mmap+mlock, where the lock is the file mapping's, ran the same by hand: 64752 kB stayed locked;
// decode_loop's test above covers it.)
class LlamaServerLoadModeTest : public PreloadLoadModeTest {};
INSTANTIATE_TEST_SUITE_P(LlamaLocks, LlamaServerLoadModeTest, ::testing::Values("mlock"), load_mode_name);
TEST_P(LlamaServerLoadModeTest, LeavesLlamaCppsOwnLockOfTheWeightsThroughTheKeepAlive) {
  if (::access(LLAMA_SERVER_PATH, X_OK) != 0)
    GTEST_SKIP() << "no llama-server at " << LLAMA_SERVER_PATH << " (a scripts/llama-cpp --libs-only install has none)";
  const std::string request =
      R"({"prompt":"Once upon a time","n_predict":8,"ignore_eos":true,"temperature":0,"top_k":1,"seed":1})";
  auto content = [](const std::string& body) {
    const auto at = body.find("\"content\":");
    return at == std::string::npos ? std::string() : body.substr(at, body.find("\",", at) - at);
  };
  const std::vector<std::string> args = {"--load-mode", mode(), "-nr"};
  const std::vector<std::string> drop = {"RESIDENCY_", "LD_PRELOAD=", "GGML_METAL_"};
  std::string error, without;
  {
    auto plain = residency::testing::start_llama_server(LLAMA_SERVER_PATH, model_, err_file("server-plain"), error,
                                                        args, {}, drop);
    ASSERT_TRUE(plain) << error;
    const auto r = residency::testing::http_request(plain->port, "/completion", request);
    ASSERT_EQ(r.status, 200) << r.body;
    without = content(r.body);
    ASSERT_FALSE(without.empty()) << r.body;
  }
  auto server = residency::testing::start_llama_server(LLAMA_SERVER_PATH, model_, err_file("server"), error, args,
                                                       {"LD_PRELOAD=" PRELOAD_PATH, "RESIDENCY_KEEP_ALIVE=1s"}, drop);
  ASSERT_TRUE(server) << error;
  const pid_t pid = server->process->pid();
  const std::uint64_t model_bytes = std::filesystem::file_size(model_);
  std::uint64_t serving = 0, idle = 0;
  for (int round = 1; round <= 2; ++round) {
    SCOPED_TRACE("request " + std::to_string(round));
    const auto r = residency::testing::http_request(server->port, "/completion", request);
    ASSERT_EQ(r.status, 200) << r.body << "\n" << server->process->stderr_text();
    EXPECT_EQ(content(r.body), without) << "another answer than without the preload";
    serving = vm_lck(pid).value_or(0);
    const auto t0 = Clock::now();
    while (count_containing(server->process->stderr_text(), "(keep-alive 1 s expired)") < static_cast<std::size_t>(round) &&
           seconds_since(t0) < 10)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    idle = vm_lck(pid).value_or(0);
    EXPECT_LT(idle, serving) << "residency released nothing after the keep-alive\n" << server->process->stderr_text();
    EXPECT_GE(idle, model_bytes * 9 / 10) << "llama.cpp's own lock of the weights was undone\n"
                                          << server->process->stderr_text();
    EXPECT_LE(idle, model_bytes + kMiB) << "more than llama.cpp's lock stays locked";
    EXPECT_EQ(engine_vmas(pid).code_locked, 0U) << "the engine's code, residency's, is still locked";
  }
  EXPECT_TRUE(server->process->alive()) << server->process->stderr_text();
  const std::string err = server->process->stderr_text();
  EXPECT_TRUE(residency_lines(err, "warn").empty()) << err;
  EXPECT_EQ(count_containing(err, "left to the program, which locks it itself"), 1U) << err;
  std::cerr << "[ measured ] llama-server --load-mode " << mode() << ": VmLck " << serving << " serving, " << idle
            << " after the keep-alive (model file " << model_bytes << " bytes); llama.cpp's mlock "
            << (err.find("failed to mlock") != std::string::npos ? "failed (ENOMEM) but locked" : "worked") << "\n";
}

}  // namespace
