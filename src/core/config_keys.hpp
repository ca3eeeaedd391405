// SPDX-License-Identifier: MIT
// The configuration keys, in one table: for each key its C API name, its environment variable,
// the peers' spellings read in its place, its documentation, and how it is read into Config.
//
// Everything that lists the keys comes from this table (as Redis declares every option once, in
// its standardConfig table): Config::from_env reads the keys in table order; residency_config_set
// looks a key up by its name, names the accepted keys from the table and merges the one field the
// key sets; the tools ask whether the user set a key (the keep-alive, or its aliases) here; and
// tests/unit/config_keys_test.cpp fails when the README's table, or the key list in residency.h's
// comment, differs from it. Adding a key is one entry in config_keys.cpp (and a Config field).
#pragma once

#include <array>
#include <span>
#include <string>
#include <string_view>

#include "residency/config.hpp"
#include "residency/status.hpp"

namespace residency::core {

// What a key's reader works with: the environment, and the errors of the keys read so far.
class EnvReader {
 public:
  explicit EnvReader(const Config::EnvLookup& lookup) : lookup_(lookup) {}
  // The variable's value, or nullptr when it is not set (or there is no environment).
  const char* get(const char* name) const { return lookup_ ? lookup_(name) : nullptr; }
  // Records "NAME=<message>", one line per bad variable.
  void fail(const char* name, const Status& st);
  const std::string& errors() const { return errors_; }

 private:
  const Config::EnvLookup& lookup_;
  std::string errors_;
};

struct ConfigKey {
  const char* name;      // the C API's key ("keep_alive"); nullptr: none (a key only the preload reads)
  const char* variable;  // its environment variable ("RESIDENCY_KEEP_ALIVE")
  // Peers' variables read in its place when `variable` is not set (ours wins, with a note); nullptr: none.
  std::array<const char*, 2> aliases;
  const char* meaning;  // the README table's "meaning" column (Markdown)
  const char* values;   // the README table's "values" column: what is accepted, the default (Markdown)
  // Reads `variable` (and the aliases) from `env` into its Config field; a bad value is one error
  // naming the variable, the value and the accepted forms; alias notes go to config.notes.
  void (*read)(const ConfigKey& key, EnvReader& env, Config& config);
  // Copies the one field this key sets from `from` to `to`.
  void (*merge)(Config& to, const Config& from);

  // Whether `variable` or one of the aliases is set in `env`.
  bool set_in(const Config::EnvLookup& env) const;
  // Parses `value` exactly as the environment variable would be read, then sets the one field of
  // `config` (residency_config_set). On error `config` is unchanged.
  Status set(Config& config, const char* value) const;
};

// Every key, in the order Config::from_env reads them (and its errors and notes come).
std::span<const ConfigKey> config_keys();
// The key whose C API name is `name`; nullptr when there is none.
const ConfigKey* find_config_key(std::string_view name);
// "keep_alive, wired_limit, ...": the C API's names, in table order (its "accepted:" list).
std::string config_key_names();
// Whether the key named `name` (a C API name) is set in `env`, by its variable or an alias: the
// tools' "did the user give a keep-alive". False for a name that is not in the table.
bool config_key_set(std::string_view name, const Config::EnvLookup& env);

// The value parsers' variants the readers share (config.cpp), each error naming its forms.
Status bad_value(std::string_view text, const std::string& what, const char* forms);
Result<KeepAlive> parse_keep_alive_as(std::string_view text, const char* forms);
Result<bool> parse_flag(std::string_view text, const char* forms);
Result<double> parse_number(std::string_view text);
// A budget NAME:SIZE[:GROUP] whose NAME is at most `name_max` characters and whose SIZE is bytes
// or a percent of `size_of` ("RAM"): parse_shared_budget, and RESIDENCY_GPU_BUDGET's reader.
Result<SharedBudget> parse_budget(std::string_view text, std::size_t name_max, const char* size_of);

}  // namespace residency::core
