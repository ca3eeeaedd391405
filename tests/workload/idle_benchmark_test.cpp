// SPDX-License-Identifier: MIT
// The idle benchmark: its parsers, its output lines (llama-idle's format), the order of its
// blocks, and a real run on the posix target where each policy leaves the model where it should
// (resident or evicted) before every decode.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "support/fake_backend.hpp"
#include "workload/gguf_writer.hpp"
#include "workload/idle_benchmark.hpp"
#include "workload/idle_target.hpp"
#include "workload_test_util.hpp"

namespace residency::workload {
namespace {

using std::chrono::milliseconds;

TEST(IdleParsing, Pauses) {
  auto p = parse_pauses("0,800, 1600,2s,250ms");
  ASSERT_TRUE(p.is_ok()) << p.message();
  EXPECT_EQ(*p, (std::vector<Nanos>{milliseconds(0), milliseconds(800), milliseconds(1600), milliseconds(2000),
                                    milliseconds(250)}));
  EXPECT_EQ(parse_pauses("0,,800").message(),
            "--pauses '0,,800': item 2 is empty; accepted: comma-separated pauses in milliseconds (or with a unit: "
            "500ms, 2s), e.g. 0,800,1600");
  EXPECT_NE(parse_pauses("-5").message().find("item 1 '-5' is not a non-negative whole number"), std::string::npos);
  EXPECT_NE(parse_pauses("100x").message().find("has an unknown unit 'x'"), std::string::npos);
  EXPECT_NE(parse_pauses("4000s").message().find("longer than one hour"), std::string::npos);
  EXPECT_FALSE(parse_pauses("").is_ok());
  EXPECT_FALSE(parse_pauses("99999999999999").is_ok());
}

TEST(IdleParsing, Policies) {
  auto p = parse_policies("off,keep-alive,0,forever", std::chrono::seconds(2));
  ASSERT_TRUE(p.is_ok()) << p.message();
  ASSERT_EQ(p->size(), 4u);
  EXPECT_EQ((*p)[1].name, "keep-alive 2 s");
  EXPECT_EQ((*p)[1].keep_alive, KeepAlive::after(std::chrono::seconds(2)));
  EXPECT_EQ((*p)[2].keep_alive, KeepAlive::zero());
  EXPECT_EQ((*p)[3].keep_alive, KeepAlive::forever());
  EXPECT_EQ((*p)[0].keep_alive, KeepAlive::off());
  EXPECT_EQ(parse_policies("off,sometimes", std::chrono::seconds(2)).message(),
            "unknown policy 'sometimes' in 'off,sometimes'; accepted: a comma-separated list of off, keep-alive, "
            "pressure-aware, 0, forever");
  EXPECT_NE(parse_policies("off,off", std::chrono::seconds(2)).message().find("listed twice"), std::string::npos);
  auto pa = parse_policies("keep-alive,pressure-aware", std::chrono::seconds(2));
  ASSERT_TRUE(pa) << pa.message();
  EXPECT_FALSE((*pa)[0].release_on_pressure);
  EXPECT_TRUE((*pa)[1].release_on_pressure) << "pressure-aware is the keep-alive with release on pressure";
  EXPECT_EQ((*pa)[1].keep_alive, KeepAlive::after(std::chrono::seconds(2)));
  EXPECT_EQ((*pa)[1].name, "keep-alive 2 s + pressure");
  EXPECT_FALSE(parse_policies("off", Nanos(0)).is_ok());
  std::string accepted;
  for (const auto& b : idle_backends()) accepted += (accepted.empty() ? "" : ", ") + b;
  EXPECT_EQ(accepted.rfind("posix", 0), 0u) << "posix is the default and comes first";
  EXPECT_EQ(make_idle_target("metal2", {}).message(), "unknown backend 'metal2'; this build accepts: " + accepted);
}

TEST(IdleOutput, LlamaIdleLinesAndTable) {
  EXPECT_EQ(format_decode_line(12.3), "  - decode time:    12.30 ms");
  IdleCell c;
  c.n = 3;
  c.mean_ms = 95.3;
  c.sd_ms = 0.644;
  EXPECT_EQ(format_summary_line(c, milliseconds(800)),
            "iters:    3, pause:   800 ms, avg decode time:    95.30 +/- 0.64 ms");

  IdleResults r;
  r.policies = *parse_policies("off,keep-alive", std::chrono::seconds(2));
  r.schedule.pauses = {milliseconds(0), milliseconds(800)};
  r.schedule.iters = 2;
  r.samples = {{0, 0, 0, 10, 0, 0, 1, {}},  {0, 0, 1, 12, 0, 0, 1, {}},    {1, 0, 0, 9, 0, 0, 1, {}},
               {1, 0, 1, 11, 0, 0, 1, {}},  {0, 1, 0, 500, 801, 1, 0, {}}, {0, 1, 1, 700, 802, 1, 0.5, {}},
               {1, 1, 0, 10, 801, 1, 1, {}}};
  const IdleCell off800 = r.cell(0, 1);
  EXPECT_EQ(off800.n, 2);
  EXPECT_DOUBLE_EQ(off800.mean_ms, 600);
  EXPECT_NEAR(off800.sd_ms, 141.42, 0.01);
  EXPECT_DOUBLE_EQ(off800.resident_before, 0.25);
  EXPECT_EQ(r.cell(1, 1).sd_ms, 0.0);  // one sample: no spread
  const std::string table = format_idle_table(r);
  EXPECT_EQ(table.substr(0, table.find('\n', table.find('\n') + 1)),
            "| pause (ms) |               off | keep-alive 2 s |\n"
            "|-----------:|------------------:|---------------:|");
  EXPECT_NE(table.find("|          0 |    11.00 +/- 1.41 | 10.00 +/- 1.41 |"), std::string::npos) << table;
  EXPECT_NE(table.find("600.00 +/- 141.42 |"), std::string::npos);
  EXPECT_NE(table.find("10.00 +/- 0.00 |"), std::string::npos);
  std::size_t width = table.find('\n');
  for (std::size_t pos = 0; pos < table.size(); pos = table.find('\n', pos) + 1) {
    EXPECT_EQ(table.find('\n', pos) - pos, width) << "rows of different widths:\n" << table;
  }
  const std::string csv = format_idle_csv(r);
  EXPECT_EQ(csv.substr(0, csv.find('\n')), "policy,pause_ms,iter,decode_ms,idle_ms,pressure_ms,resident_before_pct");
  EXPECT_NE(csv.find("\noff,800,1,700.000,802.000,1.000,50.0\n"), std::string::npos) << csv;
}

// The line that says what the keep-alive did: after the longest pause it covers, against off; past
// it, whether the memory was given back.
TEST(IdleOutput, TheVerdictSaysWhatTheKeepAliveSavedAndWhereItEnded) {
  IdleResults r;
  r.policies = *parse_policies("off,keep-alive", std::chrono::seconds(2));
  r.schedule.pauses = {milliseconds(0), milliseconds(800), milliseconds(1600), milliseconds(3200)};
  r.schedule.iters = 1;
  r.samples = {{0, 0, 0, 10, 0, 0, 1, {}},  {1, 0, 0, 10, 0, 0, 1, {}},  {0, 1, 0, 500, 0, 0, 0, {}},
               {1, 1, 0, 10, 0, 0, 1, {}},  {0, 2, 0, 600, 0, 0, 0, {}}, {1, 2, 0, 12, 0, 0, 1, {}},
               {0, 3, 0, 610, 0, 0, 0, {}}, {1, 3, 0, 590, 0, 0, 0, {}}};
  EXPECT_EQ(format_idle_verdict(r),
            "verdict: keep-alive 2 s saved 588.00 ms per decode after a 1600 ms pause (12.00 ms against 600.00 ms "
            "with off, 50.0x faster); after 3200 ms, past the keep-alive, it decoded in 590.00 ms (the model was "
            "given back, as set)");
  // Without pressure the model may stay in the page cache either way: said so, not claimed.
  r.samples[4].decode_ms = 12;
  EXPECT_EQ(format_idle_verdict(r).rfind("verdict: keep-alive 2 s made no difference after a 1600 ms pause", 0), 0u)
      << format_idle_verdict(r);
  // No pair to compare, or no pause the keep-alive covers: nothing is claimed.
  IdleResults only_off = r;
  only_off.policies = *parse_policies("off,forever", std::chrono::seconds(2));
  EXPECT_EQ(format_idle_verdict(only_off), "");
  IdleResults long_pauses = r;
  long_pauses.schedule.pauses = {milliseconds(0), milliseconds(2400), milliseconds(3200), milliseconds(4000)};
  EXPECT_EQ(format_idle_verdict(long_pauses), "");
}

// Records what the benchmark asks of a target, over a FakeBackend on virtual time, to check the
// order of the blocks and that the benchmark (not the target) drives each policy's manager. The
// decode times are made up; the real targets are exercised by the tests below and in tests/sim.
class RecordingTarget final : public IdleTarget {
 public:
  std::string describe() const override { return "recording"; }
  Clock& clock() override { return clock_; }
  ManualClock* virtual_clock() override { return &clock_; }
  Status check_pressure(const Pressure&) const override { return {}; }
  Status prepare(const GgufFile&) override { return {}; }
  Result<std::shared_ptr<Backend>> policy_backend() override { return std::shared_ptr<Backend>(fake); }
  std::optional<Layout> layout() const override { return Layout::per_buffer; }
  Result<std::vector<RegionId>> place_model(Manager& m) override {
    keep_alive_ = m.config().keep_alive;
    calls.push_back("place " + keep_alive_.to_string() + (fake->live_sets() == 0 ? "" : " (a manager is still alive)"));
    auto id = m.register_region(model_, sizeof model_);
    if (!id) return id.status();
    region_ = *id;
    return std::vector<RegionId>{*id};
  }
  Result<double> decode_pass(IdleTime& time) override {
    calls.push_back(std::string("decode") + (fake->is_resident(region_) ? " resident" : ""));
    if (fail_after >= 0 && decodes_++ >= fail_after) return Status(ErrorCode::backend_error, "device lost");
    time.pass(milliseconds(keep_alive_ == KeepAlive::off() ? 100 : 10));
    return 0.0;
  }
  Status apply_pressure(const Pressure& p) override {
    calls.push_back("pressure " + p.to_string());
    return {};
  }
  double resident_fraction() override { return fake->is_resident(region_) ? 1.0 : 0.0; }

  std::shared_ptr<residency::testing::FakeBackend> fake = std::make_shared<residency::testing::FakeBackend>();
  std::vector<std::string> calls;
  int fail_after = -1;

 private:
  ManualClock clock_;
  KeepAlive keep_alive_ = KeepAlive::off();
  RegionId region_ = 0;
  int decodes_ = 0;
  alignas(4096) std::uint8_t model_[4096] = {};
};

IdleBenchmarkOptions bench(std::vector<Nanos> pauses, int iters, const std::string& policies, Nanos keep_alive,
                           residency::testing::LogCapture* logs = nullptr) {
  IdleBenchmarkOptions o;
  o.schedule = {std::move(pauses), iters};
  o.policies = *parse_policies(policies, keep_alive);
  if (logs) o.log = logs->callback();
  return o;
}

TEST(IdleRun, InterleavesPoliciesAndRotatesTheirOrder) {
  RecordingTarget t;
  auto r = run_idle_benchmark(t, bench({milliseconds(0), milliseconds(800), milliseconds(1600)}, 2,
                                       "off,keep-alive,forever", std::chrono::seconds(2)));
  ASSERT_TRUE(r.is_ok()) << r.message();
  std::vector<std::string> placements;
  for (const auto& c : t.calls) {
    if (c.rfind("place", 0) == 0) placements.push_back(c.substr(6));
  }
  // One manager per block, configured with the block's policy; the previous one is gone by then.
  EXPECT_EQ(placements,
            (std::vector<std::string>{"off", "2 s", "forever", "2 s", "forever", "off", "forever", "off", "2 s"}));
  // Each block: place the model, warm-up decode, (pause, decode) x iters. No pressure was asked for.
  EXPECT_EQ(std::vector<std::string>(t.calls.begin(), t.calls.begin() + 4),
            (std::vector<std::string>{"place off", "decode", "decode", "decode"}));
  EXPECT_EQ(r->samples.size(), 3u * 3 * 2);
  EXPECT_EQ(r->warmups.size(), 9u);
  EXPECT_DOUBLE_EQ(r->cell(0, 2).mean_ms, 100);
  EXPECT_DOUBLE_EQ(r->cell(1, 2).mean_ms, 10);
  EXPECT_DOUBLE_EQ(r->samples.back().idle_ms, 1600);
  EXPECT_EQ(t.fake->live_sets(), 0) << "the last manager outlived the run";
}

// The benchmark, not the target, decides when the model is used: touch() before each decode
// (re-wiring after the keep-alive expired), a use scope around the pass for policy 0.
TEST(IdleRun, TheBenchmarkTouchesOrOpensAUseScopeAroundEveryDecode) {
  RecordingTarget t;
  residency::testing::LogCapture logs;
  auto r = run_idle_benchmark(t, bench({milliseconds(1000), milliseconds(3000)}, 1, "keep-alive,0,off",
                                       std::chrono::seconds(2), &logs));
  ASSERT_TRUE(r.is_ok()) << r.message();
  std::map<std::string, std::vector<double>> resident_before;
  for (const auto& s : r->samples) resident_before[r->policies[s.policy].id].push_back(s.resident_before);
  EXPECT_EQ(resident_before["keep-alive"], (std::vector<double>{1.0, 0.0})) << "expires after 2 s, not before";
  EXPECT_EQ(resident_before["0"], (std::vector<double>{0.0, 0.0})) << "policy 0 releases after each decode";
  EXPECT_EQ(resident_before["off"], (std::vector<double>{0.0, 0.0}));
  // Every keep-alive and policy-0 decode found the model resident (touch() re-wired it after the
  // 3 s pause, the use scope wired it); no `off` decode did.
  std::string current;
  for (const auto& c : t.calls) {
    if (c.rfind("place", 0) == 0) current = c.substr(6);
    if (c.rfind("decode", 0) != 0) continue;
    EXPECT_EQ(c == "decode resident", current != "off") << current << ": " << c;
  }
  EXPECT_FALSE(logs.contains("still registered")) << "the benchmark left regions in a manager it destroyed";
}

TEST(IdleRun, PressureIsAppliedAfterEveryPauseLongerThanZero) {
  RecordingTarget t;
  IdleBenchmarkOptions o = bench({milliseconds(0), milliseconds(50)}, 2, "off", std::chrono::seconds(2));
  o.pressure = {Pressure::Kind::hog, 1u << 20};
  auto r = run_idle_benchmark(t, o);
  ASSERT_TRUE(r.is_ok()) << r.message();
  EXPECT_EQ(std::count(t.calls.begin(), t.calls.end(), "pressure hog:1 MiB"), 2) << "pressure after a pause of 0";
}

TEST(IdleRun, ATargetErrorStopsTheRunAndReleasesThePolicy) {
  RecordingTarget t;
  t.fail_after = 3;
  residency::testing::LogCapture logs;
  auto r = run_idle_benchmark(t, bench({milliseconds(0)}, 3, "forever", std::chrono::seconds(2), &logs));
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.message(), "device lost");
  EXPECT_EQ(t.fake->live_sets(), 0) << "the failed block's manager was not destroyed";
  EXPECT_FALSE(logs.contains("still registered"));
}

// A real run: the posix target, real managers and mlock, pageout pressure, a 4 MiB model.
class PosixIdle : public ::testing::Test {
 protected:
  void SetUp() override {
    if (on_memory_filesystem(dir_.path())) GTEST_SKIP() << dir_.path() << " is tmpfs: pages cannot be evicted there";
    auto s = plan_llama_shape(4u << 20, GgmlType::f16);
    ASSERT_TRUE(s.is_ok());
    ASSERT_TRUE(write_synthetic_model(dir_.file("m.gguf"), *s).is_ok());
    auto f = GgufFile::open(dir_.file("m.gguf"));
    ASSERT_TRUE(f.is_ok()) << f.message();
    model_.emplace(std::move(f).value());
    IdleTargetOptions o;
    o.threads = 2;
    auto t = make_idle_target("posix", o);
    ASSERT_TRUE(t.is_ok()) << t.message();
    target_ = std::move(t).value();
    ASSERT_TRUE(target_->prepare(*model_).is_ok());
  }
  IdleBenchmarkOptions options(std::vector<Nanos> pauses, int iters, const std::string& policies, Nanos keep_alive,
                               const Pressure& pressure) {
    IdleBenchmarkOptions o;
    o.schedule = {std::move(pauses), iters};
    o.policies = *parse_policies(policies, keep_alive);
    o.pressure = pressure;
    o.log = [this](LogLevel level, std::string_view m) {
      if (level <= LogLevel::warn) warnings_.emplace_back(m);
    };
    return o;
  }
  void skip_if_not_wired() {
    for (const auto& w : warnings_) {
      if (w.find("could be wired") != std::string::npos) GTEST_SKIP() << "mlock is refused here: " << w;
    }
  }
  testing::ScratchDir dir_;
  std::optional<GgufFile> model_;
  std::unique_ptr<IdleTarget> target_;
  std::vector<std::string> warnings_;
};

TEST_F(PosixIdle, EachPolicyLeavesTheModelWhereItShould) {
  const Pressure pageout{Pressure::Kind::pageout, 0};
  if (Status st = target_->check_pressure(pageout); !st) GTEST_SKIP() << st.message();
  // keep-alive 60 s never expires within this test: it must behave like forever.
  auto r = run_idle_benchmark(*target_, options({milliseconds(0), milliseconds(30)}, 2, "off,keep-alive,0,forever",
                                                std::chrono::seconds(60), pageout));
  ASSERT_TRUE(r.is_ok()) << r.message();
  skip_if_not_wired();
  ASSERT_EQ(r->samples.size(), 2u * 4 * 2);
  for (const auto& smp : r->samples) {
    const std::string& id = r->policies[smp.policy].id;
    SCOPED_TRACE(id + " pause " + std::to_string(smp.pause) + " iter " + std::to_string(smp.iter));
    EXPECT_GT(smp.decode_ms, 0);
    if (smp.pause == 0) {
      EXPECT_EQ(smp.resident_before, 1.0) << "no pause, no pressure: the model stays in memory";
      EXPECT_EQ(smp.pressure_ms, 0);
      continue;
    }
    EXPECT_GE(smp.idle_ms, 30);
    if (id == "off" || id == "0") {
      EXPECT_LT(smp.resident_before, 0.05) << "unlocked pages survived pageout";
    } else {
      EXPECT_EQ(smp.resident_before, 1.0) << "wired pages were evicted";
    }
  }
}

TEST_F(PosixIdle, HogPressureRunsAndWiredPagesSurviveIt) {
  const Pressure hog{Pressure::Kind::hog, 16u << 20};
  ASSERT_TRUE(target_->check_pressure(hog).is_ok());
  auto r = run_idle_benchmark(*target_, options({milliseconds(10)}, 1, "forever", std::chrono::seconds(1), hog));
  ASSERT_TRUE(r.is_ok()) << r.message();
  skip_if_not_wired();
  ASSERT_EQ(r->samples.size(), 1u);
  EXPECT_GT(r->samples[0].pressure_ms, 0);
  EXPECT_EQ(r->samples[0].resident_before, 1.0);
  ASSERT_TRUE(r->samples[0].hog.has_value()) << "the sample says what the hog got";
  EXPECT_TRUE(r->samples[0].hog->got);
  EXPECT_GE(r->samples[0].hog->attempts, 1);
  EXPECT_GT(r->samples[0].hog->waited_ms, 0);
  EXPECT_NE(format_hog_waits(*r).find("got it 1/1 times"), std::string::npos) << format_hog_waits(*r);
  EXPECT_FALSE(target_->check_pressure({Pressure::Kind::hog, 1ull << 60}).is_ok());
}

}  // namespace
}  // namespace residency::workload
