// SPDX-License-Identifier: MIT
// `residency idle` as a library call: its input is checked in one place (the tool's
// parse_idle_options, then IdleRun::create for what the machine must allow), and the result files
// go where the run says they are, never into the current directory or `/`.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <mutex>
#include <set>

#include "idle_options.hpp"
#include "workload/gguf_writer.hpp"
#include "workload/idle_run.hpp"
#include "workload_test_util.hpp"

namespace residency::workload {
namespace {

using tool::idle_demo_request;
using tool::IdleRequest;
using tool::parse_idle_options;

namespace fs = std::filesystem;

class Collect final : public IdleReporter {
 public:
  void line(const std::string& text) override { lines.push_back(text); }
  void warning(const std::string& text) override { warnings.push_back(text); }
  void log(LogLevel level, std::string_view message) override {
    std::lock_guard<std::mutex> g(m_);
    if (level <= LogLevel::warn) warnings.emplace_back(message);
  }
  std::vector<std::string> lines, warnings;

 private:
  std::mutex m_;
};

std::string error_of(const IdleRequest& r) {
  auto o = parse_idle_options(r);
  return o ? std::string("(accepted)") : o.message();
}

TEST(IdleOptions, EachBadFieldIsOneMessageNamingIt) {
  auto with = [](auto change) {
    IdleRequest r;
    change(r);
    return error_of(r);
  };
  EXPECT_EQ(with([](IdleRequest& r) {
              r.backend = "metal2";
            }).rfind("--backend: unknown backend 'metal2'; this build accepts: posix", 0),
            0u);
  EXPECT_NE(with([](IdleRequest& r) { r.keep_alive = "0"; }).find("needs a duration above 0"), std::string::npos);
  EXPECT_EQ(with([](IdleRequest& r) { r.keep_alive = "soon"; }).rfind("--keep-alive: ", 0), 0u);
  EXPECT_EQ(with([](IdleRequest& r) { r.policies = "off,sometimes"; }).rfind("--policies: unknown policy 'sometimes'", 0),
            0u);
  EXPECT_EQ(with([](IdleRequest& r) { r.pauses = "0,,800"; }).rfind("--pauses '0,,800': item 2 is empty", 0), 0u);
  EXPECT_EQ(with([](IdleRequest& r) { r.iters = 0; }), "--iters 0: out of range; accepted: 1 to 1000");
  EXPECT_EQ(with([](IdleRequest& r) { r.threads = 5000; }),
            "--threads 5000: out of range; accepted: 0 (one per core) to 1024");
  EXPECT_EQ(with([](IdleRequest& r) { r.profile = "m2-ultra-8b-f16"; }),
            "--profile and --decaying-requests apply to --backend sim only, not to --backend posix");
  EXPECT_EQ(with([](IdleRequest& r) { r.pressure = "squeeze"; }).rfind("--pressure: unknown pressure 'squeeze'", 0), 0u);
  EXPECT_EQ(with([](IdleRequest& r) { r.type = "q4_k"; }).rfind("--type: unknown model type 'q4_k'", 0), 0u);
  EXPECT_NE(with([](IdleRequest& r) { r.model_size = "1KiB"; }).find("too small"), std::string::npos);
  for (const auto& e : {with([](IdleRequest&) {}), with([](IdleRequest& r) { r.backend = "sim"; })})
    EXPECT_EQ(e, "(accepted)");
}

TEST(IdleOptions, DefaultsFollowTheBackendAndTheDemonstration) {
  IdleRequest posix;
  auto o = parse_idle_options(posix);
  ASSERT_TRUE(o) << o.message();
  EXPECT_EQ(o->benchmark.pressure.kind, Pressure::Kind::pageout);
  EXPECT_EQ(o->benchmark.schedule.pauses.size(), 6u) << "llama-idle's schedule";
  ASSERT_TRUE(o->synthetic.has_value());
  EXPECT_NE(o->synthetic->to_string().find("F16"), std::string::npos) << o->synthetic->to_string();
  EXPECT_TRUE(o->out_dir.empty());
  IdleRequest sim;
  sim.backend = "sim";
  auto s = parse_idle_options(sim);
  ASSERT_TRUE(s) << s.message();
  EXPECT_EQ(s->benchmark.pressure.kind, Pressure::Kind::none);
  auto demo = parse_idle_options(idle_demo_request());
  ASSERT_TRUE(demo) << demo.message();
  ASSERT_EQ(demo->benchmark.policies.size(), 2u);
  EXPECT_EQ(demo->benchmark.policies[0].id, "off");
  EXPECT_EQ(demo->benchmark.policies[1].name, "keep-alive 2 s");
  // scripts/run passes --out: the demonstration keeps it, and what it measures stays the demo's.
  IdleRequest given;
  given.out = "/tmp/x";
  given.iters = 1;
  const IdleRequest kept = idle_demo_request(given);
  EXPECT_EQ(kept.out, "/tmp/x");
  EXPECT_EQ(kept.iters, 1);
  EXPECT_EQ(kept.policies, "off,keep-alive");
  for (const char* output : {"--out", "--no-plot", "-v,--verbose", "--iters", "--threads"})
    EXPECT_TRUE(tool::idle_option_keeps_demo(output)) << output;
  for (const char* choice :
       {"MODEL", "--policies", "--keep-alive", "--pressure", "--pauses", "--backend", "--model-size"})
    EXPECT_FALSE(tool::idle_option_keeps_demo(choice)) << choice;
}

// Runs in a scratch current directory with TMPDIR pointing elsewhere; restores both.
class IdleRunFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    fs::create_directory(cwd_);
    fs::create_directory(tmp_);
    old_cwd_ = fs::current_path();
    const char* t = std::getenv("TMPDIR");
    if (t) old_tmpdir_ = t;
    setenv("TMPDIR", tmp_.c_str(), 1);
    fs::current_path(cwd_);
    root_had_results_ = fs::exists("/idle.json") || fs::exists("/idle.csv") || fs::exists("/idle.png");
    auto shape = plan_llama_shape(3u << 20, GgmlType::f16);
    ASSERT_TRUE(shape);
    ASSERT_TRUE(write_synthetic_model(model_, *shape));
  }
  void TearDown() override {
    fs::current_path(old_cwd_);
    if (old_tmpdir_) {
      setenv("TMPDIR", old_tmpdir_->c_str(), 1);
    } else {
      unsetenv("TMPDIR");
    }
  }
  // A short real run on the posix backend.
  IdleRequest small(const std::string& model) {
    IdleRequest r;
    r.model = model;
    if (model.empty()) r.model_size = "3MiB";  // a given model with --model-size is refused
    r.pauses = "0,20";
    r.iters = 1;
    r.policies = "off,forever";
    r.pressure = "none";
    return r;
  }
  Result<IdleOutcome> run(const IdleRequest& r) {
    auto options = parse_idle_options(r);
    if (!options) return options.status();
    auto idle = IdleRun::create(std::move(options).value());
    if (!idle) return idle.status();
    return (*idle)->run(reporter_);
  }
  static std::set<std::string> listing(const std::string& dir) {
    std::set<std::string> out;
    for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().string());
    return out;
  }
  void expect_nothing_stray() {
    EXPECT_TRUE(fs::is_empty(cwd_)) << "results were written into the current directory";
    if (!root_had_results_) {
      EXPECT_FALSE(fs::exists("/idle.json") || fs::exists("/idle.csv") || fs::exists("/idle.png")) << "results in /";
    }
  }

  testing::ScratchDir dir_;
  std::string cwd_ = dir_.file("cwd"), tmp_ = dir_.file("tmp"), model_ = dir_.file("model.gguf");
  fs::path old_cwd_;
  std::optional<std::string> old_tmpdir_;
  bool root_had_results_ = false;
  Collect reporter_;
};

TEST_F(IdleRunFiles, AGivenModelWithoutOutGoesToANewTemporaryDirectory) {
  auto o = run(small(model_));
  ASSERT_TRUE(o) << o.message();
  EXPECT_EQ(fs::path(o->out_dir).parent_path(), fs::path(tmp_));
  EXPECT_EQ(fs::path(o->out_dir).filename().string().rfind("residency-idle-", 0), 0u) << o->out_dir;
  // The announced files are exactly what the directory holds.
  EXPECT_EQ(std::set<std::string>(o->files.begin(), o->files.end()), listing(o->out_dir));
  EXPECT_EQ(o->files.front(), o->out_dir + "/idle.json");
  EXPECT_GE(o->files.size(), 2u);
  EXPECT_EQ(listing(tmp_).size(), 1u);
  EXPECT_TRUE(fs::exists(model_)) << "the user's model was removed";
  EXPECT_FALSE(o->synthetic_model_removed);
  EXPECT_EQ(o->results.samples.size(), 2u * 2);
  expect_nothing_stray();
}

TEST_F(IdleRunFiles, ARelativeModelFromTheCurrentDirectoryStillLeavesItAlone) {
  fs::copy_file(model_, cwd_ + "/m.gguf");
  IdleRequest r = small("m.gguf");
  r.plot = false;
  auto o = run(r);
  ASSERT_TRUE(o) << o.message();
  EXPECT_EQ(listing(cwd_), (std::set<std::string>{cwd_ + "/m.gguf"}));
  EXPECT_EQ(o->files, (std::vector<std::string>{o->out_dir + "/idle.json", o->out_dir + "/idle.csv"}));
  EXPECT_EQ(std::set<std::string>(o->files.begin(), o->files.end()), listing(o->out_dir));
}

TEST_F(IdleRunFiles, OutIsCreatedAndHoldsExactlyTheResults) {
  IdleRequest r = small(model_);
  r.out = dir_.file("out");
  auto o = run(r);
  ASSERT_TRUE(o) << o.message();
  EXPECT_EQ(o->out_dir, r.out);
  EXPECT_EQ(std::set<std::string>(o->files.begin(), o->files.end()), listing(r.out));
  EXPECT_TRUE(fs::is_empty(tmp_)) << "a temporary directory was left although --out was given";
  expect_nothing_stray();
}

TEST_F(IdleRunFiles, ASyntheticModelIsRemovedAndTheResultsStayBesideWhereItWas) {
  IdleRequest r = small("");
  r.plot = false;
  auto o = run(r);
  ASSERT_TRUE(o) << o.message();
  EXPECT_TRUE(o->synthetic_model_removed);
  EXPECT_EQ(fs::path(o->out_dir).parent_path(), fs::path(tmp_));
  EXPECT_EQ(listing(o->out_dir), (std::set<std::string>{o->out_dir + "/idle.json", o->out_dir + "/idle.csv"}));
  EXPECT_NE(std::find(reporter_.lines.begin(), reporter_.lines.end(), "backend: " + o->info.backend),
            reporter_.lines.end());
  expect_nothing_stray();
}

TEST_F(IdleRunFiles, BadInputFoundOnTheMachineCreatesNothing) {
  IdleRequest missing = small(dir_.file("missing.gguf"));
  auto a = run(missing);
  ASSERT_FALSE(a);
  EXPECT_EQ(a.status().code(), ErrorCode::invalid_argument);
  EXPECT_NE(a.message().find("missing.gguf: cannot open"), std::string::npos) << a.message();
  IdleRequest no_parent = small(model_);
  no_parent.out = dir_.file("no/such/out");
  auto b = run(no_parent);
  ASSERT_FALSE(b);
  EXPECT_EQ(b.status().code(), ErrorCode::invalid_argument);
  EXPECT_NE(b.message().find("--out " + no_parent.out + ": cannot create the directory"), std::string::npos)
      << b.message();
  IdleRequest hog = small(model_);
  hog.pressure = "hog:100TiB";
  auto c = run(hog);
  ASSERT_FALSE(c);
  EXPECT_NE(c.message().find("of memory available now"), std::string::npos) << c.message();
  EXPECT_TRUE(fs::is_empty(tmp_));
  expect_nothing_stray();
}

}  // namespace
}  // namespace residency::workload
