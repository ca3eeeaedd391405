// SPDX-License-Identifier: MIT
// libFuzzer target: every parser of a user's text (the RESIDENCY_* configuration, sizes, durations,
// wired limits, the idle options) on hostile input. Accepting is fine; what may never happen is a
// crash, a sanitizer report, a hang, or an error that is not one printable line of bounded length
// (issue 13: a value echoed raw could break a message into lines or drive the terminal).
//
// The input is split at its first 0x00 byte: the first part is the value, the second picks which
// variable of Config::from_env gets it (so aliases and their interplay are reached too).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "core/config_keys.hpp"
#include "residency/config.hpp"
#include "residency/text.hpp"
#include "workload/gguf.hpp"
#include "workload/idle_benchmark.hpp"
#include "workload/idle_target.hpp"
#include "workload/pressure.hpp"

namespace {

using namespace residency;

// One line, no control character, bounded: what every message must be.
// A message is never empty; printable() of an empty value is (allow_empty).
void check_line(const std::string& message, std::size_t lines = 1, bool allow_empty = false) {
  std::size_t newlines = 0;
  for (char c : message) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '\n') {
      ++newlines;
      continue;
    }
    if (u < 0x20 || u == 0x7f) __builtin_trap();  // a raw control character in a message
  }
  if (newlines + 1 > lines) __builtin_trap();           // more lines than bad values
  if (message.size() > 1000 * lines) __builtin_trap();  // a long value was not shortened
  if (message.empty() && !allow_empty) __builtin_trap();
}

template <typename R>
void check(const R& r) {
  if (!r.is_ok()) check_line(r.message());
}

// Every variable Config::from_env reads: the key table's, and each key's peer aliases.
const std::vector<const char*>& variables() {
  static const std::vector<const char*> all = [] {
    std::vector<const char*> v;
    for (const auto& key : core::config_keys()) {
      v.push_back(key.variable);
      for (const char* alias : key.aliases)
        if (alias) v.push_back(alias);
    }
    return v;
  }();
  return all;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view all(reinterpret_cast<const char*>(data), size);
  const std::size_t zero = all.find('\0');
  const std::string value(all.substr(0, zero));
  const std::string_view selector = zero == std::string_view::npos ? std::string_view() : all.substr(zero + 1);

  // printable() itself: nothing raw comes out, and a long value comes out short.
  const std::string p = printable(value);
  check_line(p, 1, /*allow_empty=*/true);
  if (value.empty() != p.empty()) __builtin_trap();
  if (p.size() > 200) __builtin_trap();

  check(parse_keep_alive(value));
  auto size_r = parse_size(value);
  check(size_r);
  if (size_r.is_ok() && *size_r > (std::uint64_t{1} << 63)) __builtin_trap();
  check(parse_wired_limit(value));
  check(parse_layout(value));
  check(parse_log_level(value));
  check(workload::parse_pressure(value));
  check(workload::parse_pauses(value));
  check(workload::parse_policies(value, std::chrono::seconds(2)));
  check(workload::parse_model_type(value));

  // The environment: the value in one to three variables chosen by the selector bytes.
  const std::vector<const char*>& vars = variables();
  std::vector<bool> set(vars.size(), false);
  std::size_t chosen = 0;
  for (std::size_t i = 0; i < selector.size() && i < 3; ++i) {
    const std::size_t k = static_cast<unsigned char>(selector[i]) % vars.size();
    if (!set[k]) ++chosen;
    set[k] = true;
  }
  if (chosen == 0) set[0] = true, chosen = 1;
  auto c = Config::from_env([&](const char* name) -> const char* {
    for (std::size_t k = 0; k < vars.size(); ++k)
      if (set[k] && std::string_view(name) == vars[k]) return value.c_str();
    return nullptr;
  });
  if (!c.is_ok()) check_line(c.message(), chosen);
  return 0;
}
