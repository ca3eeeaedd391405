// SPDX-License-Identifier: MIT
// `residency idle` and `residency make-model` as a user runs them: bad input gives one line,
// exit status 2 and no files; a run writes its results and removes its model; an interrupt
// removes everything.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>

#include "workload/gguf_writer.hpp"
#include "workload_test_util.hpp"

namespace residency::workload {
namespace {

namespace fs = std::filesystem;
const std::string kTool = RESIDENCY_TOOL_PATH;

struct ToolRun {
  int exit_code = -1;  // -1: killed by a signal
  int signal = 0;
  std::string out, err;
};

// Starts the tool with `args`, TMPDIR=`tmpdir`, stdout/stderr to files in `logs`, in `cwd` if given.
pid_t start(const std::vector<std::string>& args, const std::string& tmpdir, const std::string& logs,
            const std::string& cwd = "") {
  const pid_t pid = fork();
  if (pid != 0) return pid;
  if (!cwd.empty() && chdir(cwd.c_str()) != 0) _exit(126);
  const int out = ::open((logs + "/out").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  const int err = ::open((logs + "/err").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  dup2(out, 1);
  dup2(err, 2);
  setenv("TMPDIR", tmpdir.c_str(), 1);
  std::vector<char*> argv{const_cast<char*>(kTool.c_str())};
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  execv(kTool.c_str(), argv.data());
  _exit(127);
}

ToolRun finish(pid_t pid, const std::string& logs) {
  ToolRun r;
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
  auto text = [](const std::string& p) {
    const auto b = testing::read_bytes(p);
    return std::string(b.begin(), b.end());
  };
  r.out = text(logs + "/out");
  r.err = text(logs + "/err");
  return r;
}

class ToolCli : public ::testing::Test {
 protected:
  void SetUp() override {
    fs::create_directory(tmp_);
    fs::create_directory(logs_);
  }
  ToolRun run(const std::vector<std::string>& args) { return finish(start(args, tmp_, logs_), logs_); }
  // Exit 2, one line on stderr starting with the command's name, nothing on stdout, nothing left
  // in TMPDIR, no --out directory.
  void expect_bad_input(const std::vector<std::string>& args, const std::string& says) {
    std::string joined;
    for (const auto& a : args) joined += a + " ";
    SCOPED_TRACE(joined);
    const ToolRun r = run(args);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_EQ(r.err.rfind("residency " + args[0] + ": ", 0), 0u) << r.err;
    EXPECT_NE(r.err.find(says), std::string::npos) << r.err;
    EXPECT_EQ(r.out, "");
    EXPECT_TRUE(fs::is_empty(tmp_)) << "bad input left files in TMPDIR";
    EXPECT_FALSE(fs::exists(out_)) << "bad input created --out";
  }
  std::string small_model(GgmlType type = GgmlType::f16) {
    const std::string path = dir_.file("model.gguf");
    if (!fs::exists(path)) {
      auto s = plan_llama_shape(3u << 20, type);
      EXPECT_TRUE(write_synthetic_model(path, *s).is_ok());
    }
    return path;
  }
  testing::ScratchDir dir_;
  std::string tmp_ = dir_.file("tmp");
  std::string logs_ = dir_.file("logs");
  std::string out_ = dir_.file("out");
};

TEST_F(ToolCli, IdleBadInputIsOneLineAndExitTwo) {
  const std::string model = small_model();
  testing::write_bytes(dir_.file("notes.txt"), {'n', 'o', 't', 'e', 's', '\n'});
  GgufBuilder q4;
  q4.add_tensor({"blk.0.attn_q.weight", GgmlType::q4_k, {256, 4}});
  testing::write_bytes(dir_.file("q4k.gguf"), testing::file_bytes(q4));

  expect_bad_input({"idle", dir_.file("missing.gguf"), "--out", out_},
                   "missing.gguf: cannot open: No such file or directory");
  expect_bad_input({"idle", dir_.file("notes.txt"), "--out", out_}, "byte 0 (magic): expected 'GGUF'");
  expect_bad_input({"idle", dir_.file("q4k.gguf"), "--out", out_},
                   "is Q4_K; the decode pass computes F32, F16, BF16, Q8_0 and Q4_0");
  expect_bad_input({"idle", model, "--pauses", "0,,800", "--out", out_}, "--pauses '0,,800': item 2 is empty");
  expect_bad_input({"idle", model, "--pauses", "0,1x", "--out", out_}, "unknown unit 'x'");
  expect_bad_input({"idle", model, "--pressure", "hog:100TiB", "--out", out_}, "of memory available now");
  expect_bad_input({"idle", model, "--pressure", "squeeze", "--out", out_}, "unknown pressure 'squeeze'");
  expect_bad_input({"idle", model, "--policies", "off,sometimes", "--out", out_}, "unknown policy 'sometimes'");
  // posix first, then whichever other targets this build has.
  expect_bad_input({"idle", model, "--backend", "metal2", "--out", out_},
                   "unknown backend 'metal2'; this build accepts: posix");
  expect_bad_input({"idle", model, "--keep-alive", "0", "--out", out_}, "needs a duration above 0");
  expect_bad_input({"idle", model, "--keep-alive", "soon", "--out", out_}, "--keep-alive: ");
  expect_bad_input({"idle", model, "--iters", "0", "--out", out_}, "--iters '0': too small; accepted: 1 to 1000");
  expect_bad_input({"idle", "--type", "q4_k", "--out", out_}, "--type: unknown model type 'q4_k'");
  expect_bad_input({"idle", "--model-size", "1KiB", "--out", out_}, "is too small for a llama-shaped F16 model");
  expect_bad_input({"idle", "--model-size", "1ZiB", "--out", out_}, "--model-size: ");
}

TEST_F(ToolCli, MakeModelBadInputIsOneLineAndExitTwo) {
  expect_bad_input({"make-model", "--size", "lots", dir_.file("a.gguf")}, "--size: ");
  expect_bad_input({"make-model", "--type", "q4_k", dir_.file("a.gguf")},
                   "--type: unknown model type 'q4_k'; accepted: f32, f16, bf16, q8_0, q4_0");
  expect_bad_input({"make-model", "--size", "1MiB", dir_.file("no/such/a.gguf")}, "no such directory");
  const std::string model = small_model();
  expect_bad_input({"make-model", "--size", "1MiB", model}, "already exists; choose another name or pass --force");
  EXPECT_FALSE(fs::exists(dir_.file("a.gguf")));
}

// --force replaces a regular file and nothing else: a directory, a FIFO, a character device (made
// here with mknod where that is allowed, never /dev/null itself) or a symbolic link is refused with
// exit 2 and one line, before anything is written, and is left as it was (before: a directory
// failed with exit 1 after the whole file was written; a device was replaced by a regular file).
TEST_F(ToolCli, MakeModelForceRefusesWhatIsNotARegularFile) {
  struct stat null_before {};
  ASSERT_EQ(::stat("/dev/null", &null_before), 0);
  const std::string d = dir_.file("dir.gguf"), fifo = dir_.file("fifo.gguf"), chr = dir_.file("null.gguf"),
                    link = dir_.file("link.gguf"), target = dir_.file("target.gguf");
  fs::create_directory(d);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  testing::write_bytes(target, {'x'});
  fs::create_symlink(target, link);
  const bool have_chr = ::mknod(chr.c_str(), S_IFCHR | 0666, null_before.st_rdev) == 0;  // root only
  std::vector<std::pair<std::string, std::string>> cases = {{d, "is a directory"},
                                                            {fifo, "is a FIFO"},
                                                            {link, "is a symbolic link"}};
  if (have_chr) cases.emplace_back(chr, "is a character device");
  for (const auto& [path, what] : cases) {
    expect_bad_input({"make-model", "--size", "1MiB", "--force", path},
                     path + " " + what +
                         "; overwriting (--force) replaces only a regular file: remove it or choose "
                         "another name");
    struct stat st {};
    ASSERT_EQ(::lstat(path.c_str(), &st), 0) << path;
    EXPECT_FALSE(S_ISREG(st.st_mode)) << path << " was replaced";
  }
  EXPECT_EQ(testing::read_bytes(target).size(), 1u) << "the link's target is untouched";
  for (const auto& e : fs::directory_iterator(dir_.path()))
    EXPECT_EQ(e.path().filename().string().find(".partial-"), std::string::npos) << "nothing written: " << e.path();
  struct stat null_after {};
  ASSERT_EQ(::stat("/dev/null", &null_after), 0);
  EXPECT_TRUE(S_ISCHR(null_after.st_mode));
  EXPECT_EQ(null_after.st_rdev, null_before.st_rdev);
  EXPECT_EQ(null_after.st_ino, null_before.st_ino);
  if (!have_chr) std::printf("note: mknod is not allowed here; the character device case was not run\n");
}

TEST_F(ToolCli, MakeModelWritesAModelOurReaderAccepts) {
  const ToolRun r = run({"make-model", "--size", "2MiB", "--type", "q8_0", dir_.file("m.gguf")});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("wrote " + dir_.file("m.gguf") + ": "), std::string::npos) << r.out;
  auto f = GgufFile::open(dir_.file("m.gguf"));
  ASSERT_TRUE(f.is_ok()) << f.message();
  EXPECT_LE(f->size(), 2u << 20);
  EXPECT_EQ(f->model().find_tensor("blk.0.ffn_down.weight")->type, GgmlType::q8_0);
  EXPECT_EQ(run({"make-model", "--size", "2MiB", "--force", dir_.file("m.gguf")}).exit_code, 0);
}

// Q4_0: the type llama.cpp's CPU backend repacks into a CPU_REPACK buffer; idle decodes it.
TEST_F(ToolCli, MakeModelQ4_0AndIdleDecodesIt) {
  const ToolRun r = run({"make-model", "--size", "2MiB", "--type", "q4_0", dir_.file("m.gguf")});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("llama, Q4_0, n_vocab "), std::string::npos) << r.out;
  auto f = GgufFile::open(dir_.file("m.gguf"));
  ASSERT_TRUE(f.is_ok()) << f.message();
  EXPECT_LE(f->size(), 2u << 20);
  EXPECT_EQ(f->model().find_tensor("blk.0.ffn_down.weight")->type, GgmlType::q4_0);
  EXPECT_EQ(f->model().find_tensor("token_embd.weight")->type, GgmlType::q4_0);
  EXPECT_EQ(f->model().find_tensor("blk.0.attn_norm.weight")->type, GgmlType::f32);
  const ToolRun idle = run({"idle", dir_.file("m.gguf"), "--pauses", "0", "--iters", "1", "--policies", "off",
                            "--pressure", "none", "--out", out_});
  ASSERT_EQ(idle.exit_code, 0) << idle.err;
  EXPECT_NE(idle.out.find("warm-up decode: "), std::string::npos) << idle.out;
}

TEST_F(ToolCli, IdleOnAModelWritesResultsWhereAsked) {
  const std::string model = small_model();
  const ToolRun r = run({"idle", model, "--pauses", "0,20", "--iters", "2", "--policies", "off,forever", "--out", out_});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("policy forever, pause 20 ms:\n  warm-up decode: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\n  - decode time: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\niters:    2, pause:    20 ms, avg decode time: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("| pause (ms) | "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(out_ + "/idle.json"), std::string::npos) << r.out;
  auto json = nlohmann::json::parse(testing::read_bytes(out_ + "/idle.json"));
  EXPECT_EQ(json["samples"].size(), 2u * 2 * 2);
  EXPECT_EQ(json["summary"].size(), 2u * 2);
  EXPECT_EQ(json["pressure"], "pageout");
  EXPECT_EQ(json["schedule"]["pauses_ms"], nlohmann::json::array({0.0, 20.0}));
  const auto csv = testing::read_bytes(out_ + "/idle.csv");
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 1 + 8);
  EXPECT_TRUE(fs::exists(model)) << "a model the user gave was removed";
  EXPECT_TRUE(fs::is_empty(tmp_));
}

// The entry point of the bug where results landed in the current directory (or `/`): every path
// printed under "results:" is a file in a new temporary directory, and the directory holds no other.
TEST_F(ToolCli, IdleOnAModelWithoutOutPrintsExactlyTheFilesItWrote) {
  const std::string model = small_model();
  const std::string cwd = dir_.file("cwd");
  fs::create_directory(cwd);
  const ToolRun r =
      finish(start({"idle", model, "--pauses", "0,20", "--iters", "1", "--policies", "off", "--pressure", "none"}, tmp_,
                   logs_, cwd),
             logs_);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::size_t at = r.out.find("\nresults:\n");
  ASSERT_NE(at, std::string::npos) << r.out;
  std::vector<std::string> printed;
  for (std::size_t pos = at + 10; r.out.compare(pos, 2, "  ") == 0;) {
    const std::size_t end = r.out.find('\n', pos);
    printed.push_back(r.out.substr(pos + 2, end - pos - 2));
    pos = end + 1;
  }
  std::vector<fs::path> dirs(fs::directory_iterator(tmp_), fs::directory_iterator{});
  ASSERT_EQ(dirs.size(), 1u);
  std::vector<std::string> written;
  for (const auto& e : fs::directory_iterator(dirs[0])) written.push_back(e.path().string());
  std::sort(printed.begin(), printed.end());
  std::sort(written.begin(), written.end());
  EXPECT_EQ(printed, written) << r.out;
  EXPECT_GE(written.size(), 2u);
  EXPECT_TRUE(fs::is_empty(cwd)) << "results were written into the current directory";
}

TEST_F(ToolCli, IdleOnASyntheticModelRemovesItAndKeepsTheResults) {
  const ToolRun r = run({"idle", "--model-size", "4MiB", "--pauses", "0,20", "--iters", "1", "--policies",
                         "off,keep-alive", "--keep-alive", "2s", "--no-plot"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<fs::path> dirs(fs::directory_iterator(tmp_), fs::directory_iterator{});
  ASSERT_EQ(dirs.size(), 1u);
  EXPECT_EQ(dirs[0].filename().string().rfind("residency-idle-", 0), 0u);
  EXPECT_FALSE(fs::exists(dirs[0] / "model.gguf"));
  EXPECT_TRUE(fs::exists(dirs[0] / "idle.json"));
  EXPECT_TRUE(fs::exists(dirs[0] / "idle.csv"));
  EXPECT_NE(r.out.find((dirs[0] / "idle.csv").string()), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("the synthetic model was removed"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("keep-alive 2 s"), std::string::npos) << r.out;
}

TEST_F(ToolCli, AnInterruptRemovesEverything) {
  const pid_t pid = start({"idle", "--model-size", "8MiB", "--pauses", "5000", "--iters", "3", "--policies", "off"},
                          tmp_, logs_);
  // Wait until the run is under way (the model written and the first block started).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (;;) {
    const auto out = testing::read_bytes(logs_ + "/out");
    if (std::string(out.begin(), out.end()).find("warm-up decode") != std::string::npos) break;
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "the run did not start";
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_FALSE(fs::is_empty(tmp_));
  kill(pid, SIGINT);
  const ToolRun r = finish(pid, logs_);
  EXPECT_EQ(r.signal, SIGINT) << "exit " << r.exit_code << ": " << r.err;
  EXPECT_TRUE(fs::is_empty(tmp_)) << "the interrupted run left files in TMPDIR";
}

}  // namespace
}  // namespace residency::workload
