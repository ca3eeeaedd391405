// The idle benchmark: its parsers, its output lines (llama-idle's format), the order of its
// blocks, and a real run on the posix target where each policy leaves the model where it should
// (resident or evicted) before every decode.
#include <gtest/gtest.h>

#include <map>

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
            "--pauses '0,,800': item 2 is empty; expected comma-separated pauses in milliseconds (or with a unit: "
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
            "unknown policy 'sometimes' in 'off,sometimes'; accepted: a comma-separated list of off, keep-alive, 0, forever");
  EXPECT_NE(parse_policies("off,off", std::chrono::seconds(2)).message().find("listed twice"), std::string::npos);
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
  EXPECT_EQ(format_summary_line(c, milliseconds(800)), "iters:    3, pause:   800 ms, avg decode time:    95.30 +/- 0.64 ms");

  IdleResults r;
  r.policies = *parse_policies("off,keep-alive", std::chrono::seconds(2));
  r.schedule.pauses = {milliseconds(0), milliseconds(800)};
  r.schedule.iters = 2;
  r.samples = {{0, 0, 0, 10, 0, 0, 1}, {0, 0, 1, 12, 0, 0, 1},   {1, 0, 0, 9, 0, 0, 1},
               {1, 0, 1, 11, 0, 0, 1}, {0, 1, 0, 500, 801, 1, 0}, {0, 1, 1, 700, 802, 1, 0.5},
               {1, 1, 0, 10, 801, 1, 1}};
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

// Records what the benchmark asks of a target, to check the order of the blocks. The decode times
// are made up; the real target is exercised by the tests below.
class RecordingTarget final : public IdleTarget {
 public:
  std::string describe() const override { return "recording"; }
  Clock& clock() override { return clock_; }
  Status check_pressure(const Pressure&) const override { return {}; }
  Status prepare(const GgufFile&) override { return {}; }
  Status activate(const IdlePolicy& p) override {
    calls.push_back("activate " + p.id);
    active_ = p.id;
    return {};
  }
  void deactivate() override { calls.push_back("deactivate"); }
  Result<PauseOutcome> pause(Nanos d, const Pressure&) override {
    calls.push_back("pause " + std::to_string(d.count() / 1'000'000));
    clock_.advance(d);
    return PauseOutcome{d, Nanos(0), 1.0};
  }
  Result<DecodeOutcome> decode() override {
    calls.push_back("decode");
    if (fail_after >= 0 && decodes_++ >= fail_after) return Status(ErrorCode::backend_error, "device lost");
    return DecodeOutcome{milliseconds(active_ == "off" ? 100 : 10), 0};
  }
  std::vector<std::string> calls;
  int fail_after = -1;

 private:
  ManualClock clock_;
  std::string active_;
  int decodes_ = 0;
};

TEST(IdleRun, InterleavesPoliciesAndRotatesTheirOrder) {
  RecordingTarget t;
  IdleSchedule s{{milliseconds(0), milliseconds(800), milliseconds(1600)}, 2};
  auto r = run_idle_benchmark(t, s, *parse_policies("off,keep-alive,forever", std::chrono::seconds(2)), Pressure{});
  ASSERT_TRUE(r.is_ok()) << r.message();
  std::vector<std::string> activations;
  for (const auto& c : t.calls) {
    if (c.rfind("activate", 0) == 0) activations.push_back(c.substr(9));
  }
  EXPECT_EQ(activations, (std::vector<std::string>{"off", "keep-alive", "forever", "keep-alive", "forever", "off",
                                                   "forever", "off", "keep-alive"}));
  // Each block: activate, warm-up decode, (pause, decode) x iters, deactivate.
  EXPECT_EQ(std::vector<std::string>(t.calls.begin(), t.calls.begin() + 7),
            (std::vector<std::string>{"activate off", "decode", "pause 0", "decode", "pause 0", "decode", "deactivate"}));
  EXPECT_EQ(r->samples.size(), 3u * 3 * 2);
  EXPECT_EQ(r->warmups.size(), 9u);
  EXPECT_DOUBLE_EQ(r->cell(0, 2).mean_ms, 100);
  EXPECT_DOUBLE_EQ(r->cell(1, 2).mean_ms, 10);
  EXPECT_DOUBLE_EQ(r->samples.back().idle_ms, 1600);
}

TEST(IdleRun, ATargetErrorStopsTheRunAndReleasesThePolicy) {
  RecordingTarget t;
  t.fail_after = 3;
  auto r = run_idle_benchmark(t, {{milliseconds(0)}, 3}, *parse_policies("off", std::chrono::seconds(2)), Pressure{});
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.message(), "device lost");
  EXPECT_EQ(t.calls.back(), "deactivate");
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
    o.log = [this](LogLevel level, std::string_view m) {
      if (level <= LogLevel::warn) warnings_.emplace_back(m);
    };
    auto t = make_idle_target("posix", o);
    ASSERT_TRUE(t.is_ok()) << t.message();
    target_ = std::move(t).value();
    ASSERT_TRUE(target_->prepare(*model_).is_ok());
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
  IdleSchedule s{{milliseconds(0), milliseconds(30)}, 2};
  // keep-alive 60 s never expires within this test: it must behave like forever.
  auto policies = parse_policies("off,keep-alive,0,forever", std::chrono::seconds(60));
  auto r = run_idle_benchmark(*target_, s, *policies, pageout);
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
  auto r = run_idle_benchmark(*target_, {{milliseconds(10)}, 1}, *parse_policies("forever", std::chrono::seconds(1)), hog);
  ASSERT_TRUE(r.is_ok()) << r.message();
  skip_if_not_wired();
  ASSERT_EQ(r->samples.size(), 1u);
  EXPECT_GT(r->samples[0].pressure_ms, 0);
  EXPECT_EQ(r->samples[0].resident_before, 1.0);
  EXPECT_FALSE(target_->check_pressure({Pressure::Kind::hog, 1ull << 60}).is_ok());
}

}  // namespace
}  // namespace residency::workload
