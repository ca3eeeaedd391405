// SPDX-License-Identifier: MIT
// The one table of configuration keys (src/core/config_keys.cpp) is what the documentation says:
// the README's configuration table has exactly its rows, the README names every peer alias, and
// residency.h's comment for residency_config_set names exactly its C API keys. Each of these
// lists was once a copy that drifted; now a key added to the table and not to the docs (or the
// other way round) fails here, with the rows the README should have.
#include <gtest/gtest.h>

#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "core/config_keys.hpp"
#include "residency/config.hpp"

namespace {

using namespace residency;

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// The README's row for a key, as the table says it.
std::string readme_row(const core::ConfigKey& k) {
  const std::string key = k.name ? "`" + std::string(k.name) + "`" : "none";
  return "| `" + std::string(k.variable) + "` | " + key + " | " + k.meaning + " | " + k.values + " |";
}

// The lines of the README's "## Configuration (environment)" section.
std::vector<std::string> readme_configuration_section() {
  const std::string readme = read_file(std::string(RESIDENCY_SOURCE_DIR) + "/README.md");
  std::vector<std::string> section;
  bool in = false;
  for (const std::string& line : lines_of(readme)) {
    if (line.rfind("## ", 0) == 0) {
      if (in) break;
      in = line == "## Configuration (environment)";
      continue;
    }
    if (in) section.push_back(line);
  }
  return section;
}

TEST(ConfigKeys, TheReadmeTableIsTheKeyTable) {
  const std::vector<std::string> section = readme_configuration_section();
  ASSERT_FALSE(section.empty()) << "README.md has no '## Configuration (environment)' section";
  // The first table of the section, without its header and separator rows.
  std::vector<std::string> rows;
  bool table = false;
  for (const std::string& line : section) {
    if (line.rfind("|", 0) == 0) {
      table = true;
      rows.push_back(line);
    } else if (table) {
      break;
    }
  }
  ASSERT_GE(rows.size(), 2u) << "no table in README.md's configuration section";
  EXPECT_EQ(rows[0], "| variable | key (`residency_config_set`) | meaning | values |");
  rows.erase(rows.begin(), rows.begin() + 2);
  std::vector<std::string> expected;
  for (const core::ConfigKey& k : core::config_keys()) expected.push_back(readme_row(k));
  std::string want;
  for (const std::string& r : expected) want += r + "\n";
  EXPECT_EQ(rows, expected) << "README.md's configuration table differs from src/core/config_keys.cpp; its rows "
                               "should be:\n"
                            << want;
}

TEST(ConfigKeys, TheReadmeNamesEveryPeerAlias) {
  std::string section;
  for (const std::string& line : readme_configuration_section()) section += line + "\n";
  for (const core::ConfigKey& k : core::config_keys())
    for (const char* alias : k.aliases)
      if (alias) {
        EXPECT_NE(section.find("`" + std::string(alias) + "`"), std::string::npos) << alias;
      }
}

TEST(ConfigKeys, ResidencyHNamesExactlyTheCApiKeys) {
  const std::string header = read_file(std::string(RESIDENCY_SOURCE_DIR) + "/include/residency/residency.h");
  const std::size_t decl = header.find("residency_config_set(residency_config* cfg");
  ASSERT_NE(decl, std::string::npos);
  const std::size_t open = header.rfind("/*", decl);
  ASSERT_NE(open, std::string::npos);
  const std::string comment = header.substr(open, decl - open);
  std::set<std::string> named;
  const std::regex quoted("\"([a-z_]+)\"");
  for (auto it = std::sregex_iterator(comment.begin(), comment.end(), quoted); it != std::sregex_iterator(); ++it)
    named.insert((*it)[1]);
  std::set<std::string> keys;
  for (const core::ConfigKey& k : core::config_keys())
    if (k.name) keys.insert(k.name);
  EXPECT_EQ(named, keys) << "the comment of residency_config_set in residency.h:\n" << comment;
}

TEST(ConfigKeys, NamesAndVariablesAreUnique) {
  std::set<std::string> names, variables;
  for (const core::ConfigKey& k : core::config_keys()) {
    if (k.name) {
      EXPECT_TRUE(names.insert(k.name).second) << k.name;
    }
    EXPECT_TRUE(variables.insert(k.variable).second) << k.variable;
    for (const char* alias : k.aliases)
      if (alias) {
        EXPECT_TRUE(variables.insert(alias).second) << alias;
      }
    EXPECT_NE(k.read, nullptr);
    EXPECT_NE(k.merge, nullptr);
  }
  EXPECT_EQ(core::config_key_names(),
            "keep_alive, wired_limit, set_max_pct, layout, release_on_pressure, pressure_floor, pressure_quiet, "
            "shared_budget, shared_priority, budget_wait, state_file, log, log_time, host_budget");
}

TEST(ConfigKeys, SetChangesOnlyItsOwnFieldAndParsesAsTheVariable) {
  Config c;
  const core::ConfigKey* layout = core::find_config_key("layout");
  ASSERT_NE(layout, nullptr);
  EXPECT_TRUE(layout->set(c, "per_buffer"));
  EXPECT_EQ(c.layout, Layout::per_buffer);
  EXPECT_EQ(c.keep_alive, KeepAlive::after(std::chrono::seconds(180)));
  const core::ConfigKey* log = core::find_config_key("log");
  ASSERT_NE(log, nullptr);
  const Status bad = log->set(c, "loud");
  EXPECT_FALSE(bad);
  EXPECT_EQ(bad.message(), "RESIDENCY_LOG=\"loud\": unknown log level; accepted: error, warn, info, debug");
  EXPECT_EQ(c.log_level, LogLevel::info) << "a bad value changes nothing";
  EXPECT_TRUE(log->set(c, "debug"));
  EXPECT_EQ(c.log_level, LogLevel::debug);
  EXPECT_EQ(c.layout, Layout::per_buffer) << "an earlier key's field is kept";
  EXPECT_EQ(core::find_config_key("RESIDENCY_LOG"), nullptr) << "keys are looked up by their C API name";
  EXPECT_EQ(core::find_config_key("cuda_backup"), nullptr) << "RESIDENCY_CUDA_BACKUP has no C API key";
}

TEST(ConfigKeys, AKeyIsSetByItsVariableOrAnAlias) {
  auto only = [](const char* var) {
    return Config::EnvLookup([var](const char* n) -> const char* { return std::string(n) == var ? "1" : nullptr; });
  };
  for (const char* var : {"RESIDENCY_KEEP_ALIVE", "GGML_METAL_RESIDENCY_KEEP_ALIVE_S", "GGML_METAL_NO_RESIDENCY"})
    EXPECT_TRUE(core::config_key_set("keep_alive", only(var))) << var;
  EXPECT_FALSE(core::config_key_set("keep_alive", only("RESIDENCY_LOG")));
  EXPECT_TRUE(core::config_key_set("log", only("MLX_RESIDENCY_DEBUG")));
  EXPECT_TRUE(core::config_key_set("release_on_pressure", only("RESIDENCY_RELEASE_ON_PRESSURE")));
  EXPECT_FALSE(core::config_key_set("keep_alive", Config::EnvLookup()));
  EXPECT_FALSE(core::config_key_set("no_such_key", only("RESIDENCY_KEEP_ALIVE")));
}

// The budget NAME limits the table (and so the README) states are the constants the parsers check.
TEST(ConfigKeys, TheBudgetNameLimitsAreTheCheckedConstants) {
  for (const core::ConfigKey& k : core::config_keys()) {
    const std::string v = k.values;
    if (std::string(k.variable) == "RESIDENCY_SHARED_BUDGET") {
      EXPECT_NE(v.find("(up to " + std::to_string(kSharedBudgetNameMax) + ")"), std::string::npos) << v;
    }
    if (std::string(k.variable) == "RESIDENCY_GPU_BUDGET") {
      EXPECT_NE(v.find("NAME up to " + std::to_string(kGpuBudgetNameMax) + " characters"), std::string::npos) << v;
    }
  }
}

}  // namespace
