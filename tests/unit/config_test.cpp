// SPDX-License-Identifier: MIT
// The strict parsers and Config::from_env over tables of good and bad values, aliases included.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "residency/config.hpp"
#include "residency/text.hpp"

using namespace residency;
using namespace std::chrono_literals;
using namespace std::string_literals;

namespace {
Config::EnvLookup env(std::map<std::string, std::string> vars) {
  auto shared = std::make_shared<std::map<std::string, std::string>>(std::move(vars));
  return [shared](const char* name) -> const char* {
    auto it = shared->find(name);
    return it == shared->end() ? nullptr : it->second.c_str();
  };
}
}  // namespace

TEST(KeepAliveParse, GoodValues) {
  struct Case {
    const char* text;
    KeepAlive expect;
  } cases[] = {
      {"180s", KeepAlive::after(180s)},   {"180", KeepAlive::after(180s)},
      {"500ms", KeepAlive::after(500ms)}, {"3m", KeepAlive::after(3min)},
      {"1h", KeepAlive::after(1h)},       {"1h30m", KeepAlive::after(90min)},
      {"1.5s", KeepAlive::after(1500ms)}, {" 2s ", KeepAlive::after(2s)},
      {"250us", KeepAlive::after(250us)}, {"0", KeepAlive::zero()},
      {"0s", KeepAlive::zero()},          {"0ms", KeepAlive::zero()},
      {"forever", KeepAlive::forever()},  {"FOREVER", KeepAlive::forever()},
      {"-1", KeepAlive::forever()},       {"-5m", KeepAlive::forever()},
      {"off", KeepAlive::off()},          {"8760h", KeepAlive::after(std::chrono::hours(8760))},  // a year: no overflow
  };
  for (const auto& c : cases) {
    auto r = parse_keep_alive(c.text);
    ASSERT_TRUE(r.is_ok()) << c.text << ": " << r.message();
    EXPECT_EQ(*r, c.expect) << c.text;
  }
}

TEST(KeepAliveParse, BadValuesNameTheValueAndTheAcceptedForms) {
  for (const char* text :
       {"", "abc", "10x", "s", "1h-5m", "5 minutes", "1e3", "0x10", "nan", "inf s", "200y", "999999999h", "1.", "--1"}) {
    auto r = parse_keep_alive(text);
    if (std::string(text) == "1.") {
      EXPECT_TRUE(r.is_ok());  // "1." is one second, as strtod reads it
      continue;
    }
    ASSERT_FALSE(r.is_ok()) << "accepted: '" << text << "'";
    EXPECT_NE(r.message().find(std::string("\"") + text + "\""), std::string::npos) << r.message();
    EXPECT_NE(r.message().find("accepted:"), std::string::npos) << r.message();
  }
}

TEST(KeepAliveParse, PrintsAsTheLogsShowIt) {
  EXPECT_EQ(KeepAlive::after(180s).to_string(), "180 s");
  EXPECT_EQ(KeepAlive::after(500ms).to_string(), "500 ms");
  EXPECT_EQ(KeepAlive::zero().to_string(), "0");
  EXPECT_EQ(KeepAlive::forever().to_string(), "forever");
  EXPECT_EQ(KeepAlive::off().to_string(), "off");
}

TEST(SizeParse, GoodAndBadValues) {
  struct Case {
    const char* text;
    std::uint64_t bytes;
  } good[] = {{"0", 0},
              {"4096", 4096},
              {"8GiB", 8ull << 30},
              {"8gib", 8ull << 30},
              {"512MB", 512'000'000},
              {"1.5G", 3ull << 29},
              {"64 MiB", 64ull << 20},
              {"1KB", 1000},
              {"1k", 1024},
              {"2T", 2ull << 40},
              {"7B", 7}};
  for (const auto& c : good) {
    auto r = parse_size(c.text);
    ASSERT_TRUE(r.is_ok()) << c.text << ": " << r.message();
    EXPECT_EQ(*r, c.bytes) << c.text;
  }
  for (const char* text : {"", "-1", "GiB", "8XB", "8 GiB extra", "1e9", "99999999999T", "1.2.3"}) {
    auto r = parse_size(text);
    EXPECT_FALSE(r.is_ok()) << "accepted: '" << text << "'";
  }
}

TEST(SizeFormat, IsReadable) {
  EXPECT_EQ(format_size(100), "100 B");
  EXPECT_EQ(format_size(64ull << 20), "64 MiB");
  EXPECT_EQ(format_size(3ull << 29), "1.5 GiB");
  EXPECT_EQ(format_size(8ull << 20), "8 MiB");
}

TEST(WiredLimitParse, BytesAndPercents) {
  auto a = parse_wired_limit("75%");
  ASSERT_TRUE(a.is_ok());
  EXPECT_TRUE(a->is_percent);
  EXPECT_EQ(a->resolve(1000), 750u);
  auto b = parse_wired_limit("8GiB");
  ASSERT_TRUE(b.is_ok());
  EXPECT_EQ(b->resolve(1), 8ull << 30);
  for (const char* bad : {"101%", "-5%", "%", "abc%", "lots"}) {
    EXPECT_FALSE(parse_wired_limit(bad).is_ok()) << bad;
  }
}

// One rule for 0: 0 and 0% are the same limit, 0 bytes (nothing is wired), from the variable as
// from the parser (before, 0 was accepted and 0% refused).
TEST(WiredLimitParse, ZeroAndZeroPercentAreTheSameLimit) {
  for (const char* zero : {"0", "0%", "0 %", "0B", "0.0%", "-0%"}) {
    auto z = parse_wired_limit(zero);
    ASSERT_TRUE(z.is_ok()) << zero << ": " << z.message();
    EXPECT_FALSE(z->is_percent) << zero;
    EXPECT_EQ(z->resolve(1000), 0u) << zero;
    auto c = Config::from_env(env({{"RESIDENCY_WIRED_LIMIT", zero}}));
    ASSERT_TRUE(c.is_ok()) << zero << ": " << c.message();
    EXPECT_EQ(c->wired_limit->resolve(1000), 0u) << zero;
  }
  const auto r = parse_wired_limit("101%");
  EXPECT_NE(r.message().find("\"101%\": a percent must be from 0 to 100; accepted: "), std::string::npos) << r.message();
  EXPECT_NE(r.message().find("0 or 0% wires nothing"), std::string::npos) << r.message();
}

// One keep-alive grammar (config.hpp): a space may stand before a unit, units combine largest first
// and each once, inf is no spelling of forever; every refusal quotes the value and lists the forms.
TEST(KeepAliveParse, OneGrammarOneMessage) {
  struct Good {
    const char* text;
    KeepAlive expect;
  } good[] = {{"5 s", KeepAlive::after(5s)},       {"5s", KeepAlive::after(5s)},
              {"1h 30m", KeepAlive::after(90min)}, {"1m30s", KeepAlive::after(90s)},
              {"2 min", KeepAlive::after(2min)},   {"1h30m15s500ms", KeepAlive::after(5415500ms)},
              {"-1 s", KeepAlive::forever()},      {"Forever", KeepAlive::forever()}};
  for (const auto& c : good) {
    auto r = parse_keep_alive(c.text);
    ASSERT_TRUE(r.is_ok()) << c.text << ": " << r.message();
    EXPECT_EQ(*r, c.expect) << c.text;
  }
  struct Bad {
    const char* text;
    const char* why;
  } bad[] = {{"1s1s", "the unit 's' is given twice"},
             {"1m1min", "the unit 'min' is given twice"},
             {"30m1h", "'h' after a smaller unit (combine units largest first)"},
             {"inf", "not a duration (no expiry is written forever)"},
             {"infinity", "not a duration (no expiry is written forever)"},
             {"INF", "not a duration (no expiry is written forever)"},
             {"5 s 3", "a number without a unit inside a duration"},
             {"5 minutes", "unknown unit 'minutes'"}};
  std::string forms;
  for (const auto& c : bad) {
    auto r = parse_keep_alive(c.text);
    ASSERT_FALSE(r.is_ok()) << "accepted: '" << c.text << "' as " << r->to_string();
    EXPECT_EQ(r.message().rfind(std::string("\"") + c.text + "\": " + c.why + "; accepted: ", 0), 0u) << r.message();
    const std::string f = r.message().substr(r.message().find("; accepted: "));
    if (forms.empty()) forms = f;
    EXPECT_EQ(f, forms) << "one list of forms for every refusal";
  }
  EXPECT_NE(forms.find("1h30m"), std::string::npos) << forms;
  EXPECT_NE(forms.find("forever"), std::string::npos) << forms;
}

// RESIDENCY_GPU_BUDGET's NAME limit is one constant, in its check and in every refusal's text
// (before: the check said 31, a refusal for a bad name quoted RESIDENCY_SHARED_BUDGET's 64).
TEST(ConfigFromEnv, GpuBudgetRefusalsQuoteItsOwnNameLimit) {
  const std::string limit = "NAME up to " + std::to_string(kGpuBudgetNameMax) + ",";
  for (const std::string& v : {std::string("a/b:1GiB"), std::string(kGpuBudgetNameMax + 1, 'n') + ":1GiB",
                               std::string(kSharedBudgetNameMax + 1, 'n') + ":1GiB", std::string("models")}) {
    auto c = Config::from_env(env({{"RESIDENCY_GPU_BUDGET", v}}));
    ASSERT_FALSE(c.is_ok()) << v;
    EXPECT_NE(c.message().find(limit), std::string::npos) << c.message();
    EXPECT_EQ(c.message().find("up to " + std::to_string(kSharedBudgetNameMax)), std::string::npos) << c.message();
  }
  auto long_name = Config::from_env(env({{"RESIDENCY_GPU_BUDGET", std::string(kGpuBudgetNameMax + 1, 'n') + ":1GiB"}}));
  EXPECT_NE(long_name.message().find("is longer than " + std::to_string(kGpuBudgetNameMax) + " characters"), std::string::npos)
      << long_name.message();
  EXPECT_TRUE(Config::from_env(env({{"RESIDENCY_GPU_BUDGET", std::string(kGpuBudgetNameMax, 'n') + ":1GiB"}})));
  auto shared = Config::from_env(env({{"RESIDENCY_SHARED_BUDGET", "a/b:1GiB"}}));
  EXPECT_NE(shared.message().find("NAME up to " + std::to_string(kSharedBudgetNameMax) + ","), std::string::npos)
      << shared.message();
}

TEST(ConfigFromEnv, DefaultsWhenNothingIsSet) {
  auto c = Config::from_env(env({}));
  ASSERT_TRUE(c.is_ok());
  EXPECT_EQ(c->keep_alive, KeepAlive::after(180s));
  EXPECT_FALSE(c->wired_limit.has_value());
  EXPECT_EQ(c->set_max_pct, 5.0);
  EXPECT_EQ(c->layout, Layout::sharded);
  EXPECT_FALSE(c->release_on_pressure);
  EXPECT_EQ(c->log_level, LogLevel::info);
  EXPECT_TRUE(c->notes.empty());
}

TEST(ConfigFromEnv, ReadsEveryVariable) {
  auto c = Config::from_env(env({{"RESIDENCY_KEEP_ALIVE", "5m"},
                                 {"RESIDENCY_WIRED_LIMIT", "75%"},
                                 {"RESIDENCY_SET_MAX_PCT", "10"},
                                 {"RESIDENCY_LAYOUT", "per_buffer"},
                                 {"RESIDENCY_RELEASE_ON_PRESSURE", "1"},
                                 {"RESIDENCY_LOG", "debug"}}));
  ASSERT_TRUE(c.is_ok()) << c.message();
  EXPECT_EQ(c->keep_alive, KeepAlive::after(5min));
  ASSERT_TRUE(c->wired_limit.has_value());
  EXPECT_TRUE(c->wired_limit->is_percent);
  EXPECT_EQ(c->set_max_pct, 10.0);
  EXPECT_EQ(c->layout, Layout::per_buffer);
  EXPECT_TRUE(c->release_on_pressure);
  EXPECT_EQ(c->log_level, LogLevel::debug);
}

TEST(ConfigFromEnv, EachBadValueIsOneLineNamingTheVariable) {
  auto c = Config::from_env(env({{"RESIDENCY_KEEP_ALIVE", "soon"},
                                 {"RESIDENCY_WIRED_LIMIT", "lots"},
                                 {"RESIDENCY_LAYOUT", "striped"},
                                 {"RESIDENCY_RELEASE_ON_PRESSURE", "maybe"},
                                 {"RESIDENCY_LOG", "loud"},
                                 {"RESIDENCY_SET_MAX_PCT", "five"}}));
  ASSERT_FALSE(c.is_ok());
  const std::string& msg = c.message();
  for (const char* var :
       {"RESIDENCY_KEEP_ALIVE=\"soon\"", "RESIDENCY_WIRED_LIMIT=\"lots\"", "RESIDENCY_LAYOUT=\"striped\"",
        "RESIDENCY_RELEASE_ON_PRESSURE=\"maybe\"", "RESIDENCY_LOG=\"loud\"", "RESIDENCY_SET_MAX_PCT=\"five\""}) {
    EXPECT_NE(msg.find(var), std::string::npos) << var << " missing in:\n" << msg;
  }
  EXPECT_EQ(std::count(msg.begin(), msg.end(), '\n'), 5);  // six lines
}

TEST(ConfigFromEnv, LlamaCppAliasesAreHonouredStrictly) {
  struct Case {
    const char* value;
    bool ok;
    KeepAlive expect;
  } cases[] = {
      {"180", true, KeepAlive::after(180s)},
      {"0", true, KeepAlive::zero()},  // llama.cpp: falls back to 180
      {"-1", true, KeepAlive::forever()},
      {"2.5", true, KeepAlive::after(2500ms)},
      {"abc", false, {}},  // llama.cpp: atoi -> 0 -> 180 s, silently
      {"10s", false, {}},  // seconds only, as the name says
      {"", false, {}},
  };
  for (const auto& c : cases) {
    auto r = Config::from_env(env({{"GGML_METAL_RESIDENCY_KEEP_ALIVE_S", c.value}}));
    ASSERT_EQ(r.is_ok(), c.ok) << c.value << ": " << r.message();
    if (!c.ok) {
      EXPECT_NE(r.message().find("GGML_METAL_RESIDENCY_KEEP_ALIVE_S"), std::string::npos);
      continue;
    }
    EXPECT_EQ(r->keep_alive, c.expect) << c.value;
    ASSERT_EQ(r->notes.size(), 1u);
    EXPECT_NE(r->notes[0].find("GGML_METAL_RESIDENCY_KEEP_ALIVE_S"), std::string::npos);
  }
  auto off = Config::from_env(env({{"GGML_METAL_NO_RESIDENCY", "1"}}));
  ASSERT_TRUE(off.is_ok());
  EXPECT_EQ(off->keep_alive, KeepAlive::off());
  auto empty = Config::from_env(env({{"GGML_METAL_NO_RESIDENCY", ""}}));  // set but empty: llama.cpp checks presence
  ASSERT_TRUE(empty.is_ok());
  EXPECT_EQ(empty->keep_alive, KeepAlive::off());
  auto zero = Config::from_env(env({{"GGML_METAL_NO_RESIDENCY", "0"}}));
  ASSERT_TRUE(zero.is_ok());
  EXPECT_EQ(zero->keep_alive, KeepAlive::after(180s));
  EXPECT_FALSE(Config::from_env(env({{"GGML_METAL_NO_RESIDENCY", "please"}})).is_ok());
}

TEST(ConfigFromEnv, OurVariablesWinOverAliasesWithANote) {
  auto c = Config::from_env(env({{"RESIDENCY_KEEP_ALIVE", "10s"},
                                 {"GGML_METAL_RESIDENCY_KEEP_ALIVE_S", "99"},
                                 {"RESIDENCY_SET_MAX_PCT", "7"},
                                 {"MLX_RESIDENCY_SET_MAX_PCT", "20"},
                                 {"RESIDENCY_LOG", "warn"},
                                 {"MLX_RESIDENCY_DEBUG", "1"}}));
  ASSERT_TRUE(c.is_ok()) << c.message();
  EXPECT_EQ(c->keep_alive, KeepAlive::after(10s));
  EXPECT_EQ(c->set_max_pct, 7.0);
  EXPECT_EQ(c->log_level, LogLevel::warn);
  EXPECT_EQ(c->notes.size(), 3u);
}

TEST(ConfigFromEnv, MlxAliases) {
  auto c = Config::from_env(env({{"MLX_RESIDENCY_SET_MAX_PCT", "0"}, {"MLX_RESIDENCY_DEBUG", "1"}}));
  ASSERT_TRUE(c.is_ok()) << c.message();
  EXPECT_EQ(c->set_max_pct, 0.0);
  EXPECT_EQ(c->log_level, LogLevel::debug);
  EXPECT_FALSE(Config::from_env(env({{"MLX_RESIDENCY_DEBUG", "verbose"}})).is_ok());
  EXPECT_FALSE(Config::from_env(env({{"MLX_RESIDENCY_SET_MAX_PCT", "5%"}})).is_ok());
}

TEST(SharedBudgetParse, NameSizeAndGroup) {
  auto a = parse_shared_budget("llm:48GiB");
  ASSERT_TRUE(a) << a.message();
  EXPECT_EQ(a->name, "llm");
  EXPECT_FALSE(a->size.is_percent);
  EXPECT_EQ(a->size.bytes, 48ull << 30);
  EXPECT_EQ(a->group, "");
  auto b = parse_shared_budget(" servers.v2_x-1:60%:inference ");
  ASSERT_TRUE(b) << b.message();
  EXPECT_EQ(b->name, "servers.v2_x-1");
  EXPECT_TRUE(b->size.is_percent);
  EXPECT_DOUBLE_EQ(b->size.percent, 60);
  EXPECT_EQ(b->group, "inference");
  EXPECT_EQ(b->to_string(), "servers.v2_x-1:60%:inference");
  EXPECT_TRUE(parse_shared_budget(std::string(64, 'n') + ":1G"));

  struct Bad {
    const char* text;
    const char* why;
  };
  const std::string long_name = std::string(65, 'n') + ":1G";
  for (const Bad& c :
       {Bad{"llm", "no ':'"}, Bad{":1G", "the name '' is not accepted"},
        Bad{"a/b:1G", "the name 'a/b' is not accepted"}, Bad{"-x:1G", "the name '-x'"}, Bad{".x:1G", "the name '.x'"},
        Bad{"x:", "the size '': empty"}, Bad{"x:lots", "the size 'lots'"}, Bad{"x:0", "the size is 0"},
        Bad{"x:150%", "the size '150%': a percent must be from 0 to 100"}, Bad{"x:0%", "the size is 0"},
        Bad{"x:18446744073709551615", "the size '18446744073709551615': too large"},
        Bad{"x:1e2%", "the size '1e2%': an exponent ('e2') is not accepted"},
        Bad{"x:1G:a b", "the group 'a b' is not accepted"}, Bad{"x:1G:g:h", "more than three"},
        Bad{long_name.c_str(), "is longer than 64 characters"}}) {
    auto r = parse_shared_budget(c.text);
    ASSERT_FALSE(r) << c.text;
    EXPECT_NE(r.message().find(c.why), std::string::npos) << c.text << ": " << r.message();
    EXPECT_NE(r.message().find("accepted: NAME:SIZE or NAME:SIZE:GROUP"), std::string::npos) << r.message();
    EXPECT_EQ(r.message().find('\n'), std::string::npos) << "one line: " << r.message();
  }
}

TEST(ConfigFromEnv, SharedBudgetAndPriority) {
  auto c = Config::from_env(env({{"RESIDENCY_SHARED_BUDGET", "llm:8GiB"}, {"RESIDENCY_SHARED_PRIORITY", "-3"}}));
  ASSERT_TRUE(c) << c.message();
  ASSERT_TRUE(c->shared_budget);
  EXPECT_EQ(c->shared_budget->name, "llm");
  EXPECT_EQ(c->shared_priority, -3);
  EXPECT_FALSE(Config::from_env(env({}))->shared_budget) << "none by default";
  auto bad = Config::from_env(env({{"RESIDENCY_SHARED_BUDGET", "llm"}, {"RESIDENCY_SHARED_PRIORITY", "1.5"}}));
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.message().find("RESIDENCY_SHARED_BUDGET=\"llm\""), std::string::npos) << bad.message();
  EXPECT_NE(bad.message().find("RESIDENCY_SHARED_PRIORITY=\"1.5\": not an integer from -1000 to 1000"), std::string::npos)
      << bad.message();
  EXPECT_EQ(std::count(bad.message().begin(), bad.message().end(), '\n'), 1);
}

// RESIDENCY_BUDGET_WAIT: a duration above 0 (30 s, the default: strict) or `over`; anything else
// one line.
TEST(ConfigFromEnv, BudgetWaitIsADurationOrOver) {
  EXPECT_EQ(Config::from_env(env({}))->budget_wait, Nanos(std::chrono::seconds(30))) << "strict by default";
  EXPECT_FALSE(Config::from_env(env({{"RESIDENCY_BUDGET_WAIT", "over"}}))->budget_wait);
  auto c = Config::from_env(env({{"RESIDENCY_BUDGET_WAIT", "2m"}}));
  ASSERT_TRUE(c) << c.message();
  EXPECT_EQ(c->budget_wait, Nanos(std::chrono::minutes(2)));
  for (const char* bad : {"0", "-1", "soon", "forever", "off"}) {
    auto b = Config::from_env(env({{"RESIDENCY_BUDGET_WAIT", bad}}));
    ASSERT_FALSE(b) << bad;
    EXPECT_EQ(b.message().rfind("RESIDENCY_BUDGET_WAIT=\"" + std::string(bad) + "\"", 0), 0u) << b.message();
    EXPECT_NE(b.message().find("a duration above 0 with unit (30s, the default; 2m), or `over`"), std::string::npos)
        << b.message();
  }
}

TEST(ConfigFromEnv, StateFileIsOnByDefaultAndTurnsOff) {
  EXPECT_TRUE(Config::from_env(env({}))->state_file);
  auto off = Config::from_env(env({{"RESIDENCY_STATE_FILE", "0"}}));
  ASSERT_TRUE(off) << off.message();
  EXPECT_FALSE(off->state_file);
  auto bad = Config::from_env(env({{"RESIDENCY_STATE_FILE", "sometimes"}}));
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.message().find("RESIDENCY_STATE_FILE=\"sometimes\""), std::string::npos) << bad.message();
  EXPECT_NE(bad.message().find("or 0"), std::string::npos) << "names what is accepted: " << bad.message();
}

// RESIDENCY_CUDA_BACKUP goes through Config like every variable (the preload reads the field):
// unset is automatic (after-allocation unless the keep-alive is forever, decided by the preload),
// a bad value is one line naming the variable, the value and the two modes.
TEST(ConfigFromEnv, CudaBackupIsAConfigField) {
  EXPECT_EQ(Config::from_env(env({}))->cuda_backup, CudaBackup::automatic);
  auto after = Config::from_env(env({{"RESIDENCY_CUDA_BACKUP", "after-allocation"}}));
  ASSERT_TRUE(after) << after.message();
  EXPECT_EQ(after->cuda_backup, CudaBackup::after_allocation);
  auto first = Config::from_env(env({{"RESIDENCY_CUDA_BACKUP", "at-first-sleep"}}));
  ASSERT_TRUE(first) << first.message();
  EXPECT_EQ(first->cuda_backup, CudaBackup::at_first_sleep);
  auto bad = Config::from_env(env({{"RESIDENCY_CUDA_BACKUP", "eventually\n"}, {"RESIDENCY_LOG", "loud"}}));
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.message().find("RESIDENCY_CUDA_BACKUP=\"eventually\\n\": unknown backup mode; accepted: "
                               "after-allocation, at-first-sleep"),
            std::string::npos)
      << bad.message();
  EXPECT_EQ(std::count(bad.message().begin(), bad.message().end(), '\n'), 1) << "two lines: " << bad.message();
}

// Issue 13, items 1 and 7: every echoed value is printable and short; errors say why.
TEST(Printable, EscapesControlCharactersAndKeepsText) {
  EXPECT_EQ(printable("model.gguf"), "model.gguf");
  EXPECT_EQ(printable("a\nb"), "a\\nb");
  EXPECT_EQ(printable("\x1b[2Jx"), "\\x1B[2Jx");
  EXPECT_EQ(printable("tab\there\r"), "tab\\there\\r");
  EXPECT_EQ(printable("del\x7f"), "del\\x7F");
  EXPECT_EQ(printable("back\\slash"), "back\\\\slash");
  EXPECT_EQ(printable("caf\xc3\xa9 \xe6\x97\xa5"), "caf\xc3\xa9 \xe6\x97\xa5");  // UTF-8 passes
  EXPECT_EQ(printable("csi\xc2\x9b"
                      "2J"),
            "csi\\xC2\\x9B2J");                          // C1 control (U+009B)
  EXPECT_EQ(printable("bad\xff\xc3"), "bad\\xFF\\xC3");  // not UTF-8
  const std::string long_value = "/" + std::string(5000, 'a') + "\n/name.gguf";
  const std::string p = printable(long_value);
  EXPECT_LE(p.size(), 120u) << p;
  EXPECT_NE(p.find("name.gguf"), std::string::npos) << "the end (a file name) is kept: " << p;
  EXPECT_NE(p.find("(5012 bytes)"), std::string::npos) << p;
  for (char c : p) EXPECT_FALSE(static_cast<unsigned char>(c) < 0x20 || c == 0x7f) << p;
}

TEST(Printable, ParserMessagesAreOneLineWithoutRawControlCharacters) {
  const std::string hostile = "1\n\x1b]0;owned\x07s" + std::string(3000, '9');
  for (const Status& st :
       {parse_keep_alive(hostile).status(), parse_size(hostile).status(), parse_wired_limit(hostile).status(),
        parse_layout(hostile).status(), parse_log_level(hostile).status()}) {
    ASSERT_FALSE(st.is_ok());
    EXPECT_LT(st.message().size(), 600u) << st.message();
    for (char c : st.message()) ASSERT_FALSE(static_cast<unsigned char>(c) < 0x20 || c == 0x7f) << st.message();
  }
  auto c = Config::from_env(env({{"RESIDENCY_KEEP_ALIVE", hostile}, {"RESIDENCY_LOG", "a\nb"}}));
  ASSERT_FALSE(c.is_ok());
  EXPECT_EQ(std::count(c.message().begin(), c.message().end(), '\n'), 1) << "one line per variable: " << c.message();
}

TEST(SizeParse, ExactWholeBytesAndWhyNot) {
  EXPECT_EQ(*parse_size("0.3GB"), 300'000'000u);  // exact, where a double gives 299999999.99...
  EXPECT_EQ(*parse_size("1.5GiB"), 3ull << 29);
  EXPECT_EQ(*parse_size("0.5KiB"), 512u);
  EXPECT_EQ(*parse_size("000012"), 12u);
  EXPECT_EQ(*parse_size("9223372036854775807"), 9223372036854775807ull);
  struct Case {
    const char* text;
    const char* why;
  } bad[] = {
      {"0.5", "not a whole number of bytes (0.5 B)"},
      {"1.1KiB", "not a whole number of bytes (1126.4 B)"},
      {"0.0000000000000000000000000000001", "not a whole number of bytes"},
      {"9223372036854775808", "too large: more than 2^63 bytes"},
      {"99999999999T", "too large"},
      {"1000000000000000000000000000000000000000GiB", "too large"},
      {"8XB", "unknown unit 'XB'"},
      {"12 GiB extra", "unexpected 'extra' after the unit"},
      {"\xef\xbc\x91\xef\xbc\x92", "not a number of bytes"},  // fullwidth digits
      {"\xd9\xa3", "not a number of bytes"},                  // Arabic-Indic three
      {"-4K", "negative"},
  };
  for (const auto& c : bad) {
    auto r = parse_size(c.text);
    ASSERT_FALSE(r.is_ok()) << c.text;
    EXPECT_NE(r.message().find(c.why), std::string::npos) << c.text << ": " << r.message();
  }
}

TEST(WiredLimitParse, AFractionOfAByteIsRefusedNotZero) {
  auto r = parse_wired_limit("0.5");
  ASSERT_FALSE(r.is_ok()) << "0.5 became " << r->bytes << " bytes";
  EXPECT_NE(r.message().find("not a whole number of bytes"), std::string::npos) << r.message();
  EXPECT_NE(parse_wired_limit("99999999999999999999999GiB").message().find("too large"), std::string::npos);
  auto c = Config::from_env(env({{"RESIDENCY_WIRED_LIMIT", "0.5"}}));
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.message().find("RESIDENCY_WIRED_LIMIT=\"0.5\": not a whole number of bytes"), std::string::npos)
      << c.message();
}

TEST(KeepAliveParse, TinyAndHugeValuesAreRefusedNotRounded) {
  const std::string tiny = "0." + std::string(400, '0') + "1";
  auto t = parse_keep_alive(tiny);
  ASSERT_FALSE(t.is_ok()) << "became " << t->to_string();
  EXPECT_NE(t.message().find("shorter than 1 ns, but not 0"), std::string::npos) << t.message();
  EXPECT_NE(parse_keep_alive("0.5ns").message().find("shorter than 1 ns"), std::string::npos);
  EXPECT_NE(parse_keep_alive("1.5ns").message().find("not a whole number of nanoseconds"), std::string::npos);
  EXPECT_NE(parse_keep_alive("1" + std::string(400, '0')).message().find("too long: more than 100 years"),
            std::string::npos);
  EXPECT_EQ(*parse_keep_alive("-0"), KeepAlive::zero());
  EXPECT_EQ(*parse_keep_alive("-" + std::string(400, '9')), KeepAlive::forever());
  EXPECT_EQ(*parse_keep_alive("0.000000001"), KeepAlive::after(1ns));
  EXPECT_EQ(*parse_keep_alive("1h30m"), KeepAlive::after(90min));
  EXPECT_FALSE(parse_keep_alive("\xd9\xa3s").is_ok());  // a digit in another script is no digit
}

TEST(ConfigFromEnv, AnAliasErrorQuotesWhatWasTypedAndOnlyWhatItAccepts) {
  auto r = Config::from_env(env({{"GGML_METAL_RESIDENCY_KEEP_ALIVE_S", "99999999999999999999"}}));
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.message().find("GGML_METAL_RESIDENCY_KEEP_ALIVE_S=\"99999999999999999999\": too long"), std::string::npos)
      << r.message();
  EXPECT_EQ(r.message().find("off"), std::string::npos) << "the alias does not accept off: " << r.message();
  EXPECT_EQ(r.message().find("500ms"), std::string::npos) << "the alias takes seconds only: " << r.message();
  auto q = Config::from_env(env({{"RESIDENCY_PRESSURE_QUIET", "0"}}));
  ASSERT_FALSE(q.is_ok());
  EXPECT_NE(q.message().find("RESIDENCY_PRESSURE_QUIET=\"0\": not a duration above 0"), std::string::npos) << q.message();
}

// RESIDENCY_HOST_BUDGET: `off`, a size or percent (the ledger `host`), or a named budget; a device
// manager's resolves to it, else to RESIDENCY_SHARED_BUDGET's ledger, else to host:50%.
TEST(HostBudgetParse, FormsAndTheDeviceManagersResolution) {
  auto off = parse_host_budget("off");
  ASSERT_TRUE(off);
  EXPECT_TRUE(off->off);
  auto size = parse_host_budget("48GiB");
  ASSERT_TRUE(size);
  ASSERT_TRUE(size->budget);
  EXPECT_EQ(size->budget->name, "host");
  EXPECT_EQ(size->budget->size.bytes, 48ull << 30);
  auto named = parse_host_budget("models-host:60%:inference");
  ASSERT_TRUE(named);
  EXPECT_EQ(named->budget->name, "models-host");
  EXPECT_TRUE(named->budget->size.is_percent);
  EXPECT_EQ(named->budget->group, "inference");
  for (const char* badv : {"", "0", "lots", "a:b", "-5GiB"}) {
    auto b = parse_host_budget(badv);
    EXPECT_FALSE(b) << badv;
    if (!b) {
      EXPECT_NE(b.message().find("accepted"), std::string::npos) << b.message();
      EXPECT_EQ(b.message().find('\n'), std::string::npos) << b.message();
    }
  }

  Config c;
  Config d = c.for_device_memory("GPU-x");
  ASSERT_TRUE(d.host_budget.budget);
  EXPECT_EQ(d.host_budget.budget->name, "host");
  EXPECT_TRUE(d.host_budget.budget->size.is_percent);
  EXPECT_EQ(d.host_budget.budget->size.percent, 50.0);
  c.shared_budget = SharedBudget{"ram", WiredLimit{false, 64ull << 30, 0}, ""};
  d = c.for_device_memory("GPU-x");
  EXPECT_FALSE(d.shared_budget && d.shared_budget->name == "ram") << "RAM's budget is not the device's";
  ASSERT_TRUE(d.host_budget.budget);
  EXPECT_EQ(d.host_budget.budget->name, "ram") << "the operator's RAM budget bounds the registered files";
  c.host_budget = *size;
  EXPECT_EQ(c.for_device_memory("GPU-x").host_budget.budget->name, "host");
  c.host_budget = *off;
  EXPECT_FALSE(c.for_device_memory("GPU-x").host_budget.budget);

  auto env = Config::from_env(
      [](const char* k) -> const char* { return std::string(k) == "RESIDENCY_HOST_BUDGET" ? "nonsense" : nullptr; });
  ASSERT_FALSE(env);
  EXPECT_NE(env.message().find("RESIDENCY_HOST_BUDGET"), std::string::npos) << env.message();
}
