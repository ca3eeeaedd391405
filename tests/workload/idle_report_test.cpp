// SPDX-License-Identifier: MIT
// The idle plot says what a reader needs to read the result off the picture: whose run it is and
// the real model size in the title, the zero-pause baseline and the target band, a keep-alive's
// expiry as a step (its points joined only within a regime), what "off" is, and a legend out of
// the data. The script is checked as text; the PNG is drawn with gnuplot where it is installed.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>

#include "support/temp_dir.hpp"
#include "workload/idle_report.hpp"
#include "workload/idle_target.hpp"

namespace residency::workload {
namespace {

using std::chrono::milliseconds;

// llama-idle's schedule, policies off, keep-alive 2 s and 0: decodes take 10 ms at pause 0, 11 ms
// while the keep-alive holds the model, 40 ms after it (and always under off).
IdleResults results() {
  IdleResults r;
  r.schedule = llama_idle_schedule();
  auto policies = parse_policies("off,keep-alive,0", std::chrono::seconds(2));
  EXPECT_TRUE(policies.is_ok());
  r.policies = *policies;
  for (std::size_t k = 0; k < r.policies.size(); ++k) {
    for (std::size_t p = 0; p < r.schedule.pauses.size(); ++p) {
      const auto pause = r.schedule.pauses[p];
      for (int i = 0; i < r.schedule.iters; ++i) {
        IdleSample s;
        s.policy = k;
        s.pause = p;
        s.iter = i;
        const bool warm = pause.count() == 0 || (r.policies[k].id == "keep-alive" && pause < std::chrono::seconds(2));
        s.decode_ms = (pause.count() == 0 ? 10.0 : warm ? 11.0 : 40.0) + 0.1 * i;
        if (pause.count() == 0 && r.policies[k].id == "0") s.decode_ms += 2;  // it wires even then
        r.samples.push_back(s);
      }
    }
  }
  return r;
}

// The data block of policy k ("$pK << EOD" .. "EOD").
std::string block(const std::string& script, std::size_t k) {
  const std::string open = "$p" + std::to_string(k) + " << EOD\n";
  const auto a = script.find(open);
  if (a == std::string::npos) return "";
  const auto b = script.find("EOD\n", a + open.size());
  return script.substr(a + open.size(), b - a - open.size());
}

TEST(IdlePlot, TitleNamesTheToolAndTheRealModelSize) {
  IdleRunInfo info;
  info.tool = "residency llama-idle";
  info.model_bytes = 63800ull << 10;  // 62.3 MiB
  info.backend = "llama.cpp llama-idle";
  IdleResults r = results();
  r.pressure.kind = Pressure::Kind::pageout;
  const std::string s = idle_plot_script("pngcairo", "llama-idle.png", r, info);
  // Whole, though longer than 80 bytes (it was cut there: "(63.8...odel, pressure pageout) (82 bytes)").
  EXPECT_NE(s.find("set title 'residency llama-idle: decode time after a pause (62.3 MiB model, pressure pageout)'"),
            std::string::npos)
      << s;
  EXPECT_EQ(s.find("(0 B model"), std::string::npos) << s;
  // Whole, however long: the backend's line too.
  EXPECT_NE(s.find(".\"\\n\".'llama.cpp llama-idle'\n"), std::string::npos) << s;
  // The default stays `residency idle`'s own.
  EXPECT_NE(idle_plot_script("png", "idle.png", results(), IdleRunInfo{}).find("set title 'residency idle: "),
            std::string::npos);
}

TEST(IdlePlot, KeepAliveIsAStepAtItsExpiryNotARamp) {
  const std::string s = idle_plot_script("pngcairo", "idle.png", results(), IdleRunInfo{});
  // keep-alive 2 s (policy 1): 1600 ms is held, 2400 ms is after the expiry; a blank line between
  // them ends the line there.
  const std::string ka = block(s, 1);
  EXPECT_NE(ka.find("1600 11.1000 0.1000\n\n2400 40.1000"), std::string::npos) << ka;
  EXPECT_EQ(ka.find("\n\n", ka.find("2400")), std::string::npos) << "one break only: " << ka;
  // off and 0 have no regimes: one line each.
  EXPECT_EQ(block(s, 0).find("\n\n"), std::string::npos) << block(s, 0);
  EXPECT_EQ(block(s, 2).find("\n\n"), std::string::npos) << block(s, 2);
  EXPECT_NE(s.find("set arrow from 2000.000000, graph 0"), std::string::npos) << "the expiry's dashed line";
}

TEST(IdlePlot, BaselineTargetBandAndLegend) {
  const std::string s = idle_plot_script("pngcairo", "idle.png", results(), IdleRunInfo{});
  // The fastest policy's pause-0 mean (10.0, 10.1, 10.2 ms: 10.1 ms; policy 0 is 2 ms slower).
  EXPECT_NE(s.find("'+' using 1:(10.1000):(11.1100) with filledcurves"), std::string::npos) << s;
  EXPECT_NE(s.find("title 'target: within 1.10x the baseline'"), std::string::npos) << s;
  EXPECT_NE(s.find("10.1000 with lines dashtype 3"), std::string::npos) << s;
  EXPECT_NE(s.find("'zero-pause baseline 10.10 ms (the fastest policy at pause 0)'"), std::string::npos) << s;
  EXPECT_NE(s.find("title 'off (no residency: nothing locked, the kernel''s paging alone)'"), std::string::npos) << s;
  EXPECT_NE(s.find("set key at screen 0.5, screen 0.02 center bottom"), std::string::npos)
      << "the legend is out of the data: " << s;
  EXPECT_NE(s.find("set bmargin at screen 0.2"), std::string::npos) << "the plot ends above it (5 entries): " << s;
  // Each policy its own colour-blind-safe colour and dash type (issue 30: a pale yellow line, two
  // blues alike).
  std::set<std::string> colours, dashes;
  for (std::size_t at = s.find("with yerrorlines"); at != std::string::npos; at = s.find("with yerrorlines", at + 1)) {
    const std::size_t c = s.find("linecolor rgb '", at), d = s.find("dashtype ", at);
    ASSERT_NE(c, std::string::npos) << s;
    ASSERT_NE(d, std::string::npos) << s;
    colours.insert(s.substr(c + 15, 7));
    dashes.insert(s.substr(d + 9, 1));
  }
  EXPECT_EQ(colours.size(), results().policies.size()) << s;
  EXPECT_EQ(dashes.size(), results().policies.size()) << s;
  EXPECT_EQ(colours.count("#F0E442"), 0u) << "no yellow on white";
  // A log axis with the right one in multiples of the baseline, 1.1x among them.
  EXPECT_NE(s.find("set logscale y\n"), std::string::npos) << s;
  EXPECT_NE(s.find("set y2tics ('1.1x' 11.1100, '2x' 20.2000"), std::string::npos) << s;
  EXPECT_EQ(s.find("set key top left"), std::string::npos) << s;
}

TEST(IdlePlot, GnuplotDrawsIt) {
  std::string error;
  const std::string dir = testing::make_disk_temp_dir("residency-idle-plot", error);
  ASSERT_FALSE(dir.empty()) << error;
  struct Remove {  // however the test ends
    std::string dir;
    ~Remove() {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  } remove{dir};
  IdleRunInfo info;
  info.model_bytes = 1ull << 30;
  info.backend = "posix (mlock)";
  const std::string png = dir + "/idle.png";
  const std::string why = write_idle_plot(png, results(), info);
  if (why.find("not installed") != std::string::npos) GTEST_SKIP() << why;
  EXPECT_EQ(why, "");
  std::ifstream f(png, std::ios::binary);
  const std::string head(std::istreambuf_iterator<char>(f), {});
  EXPECT_GT(head.size(), 1000u);
  EXPECT_EQ(head.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  // RESIDENCY_KEEP_PLOT=FILE: a copy to look at.
  if (const char* keep = std::getenv("RESIDENCY_KEEP_PLOT"); keep && *keep && !head.empty()) {
    std::error_code ec;
    std::filesystem::copy_file(png, keep, std::filesystem::copy_options::overwrite_existing, ec);
  }
}

}  // namespace
}  // namespace residency::workload
