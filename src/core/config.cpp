// SPDX-License-Identifier: MIT
// Strict parsing of keep-alive values, sizes, limits and names (the RESIDENCY_* environment is read
// by the key table, config_keys.cpp, with these parsers).
#include "residency/config.hpp"
#include "core/config_keys.hpp"
#include "residency/text.hpp"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <vector>

namespace residency {
namespace {

// Longest keep-alive accepted: 100 years fits easily in int64 nanoseconds (292 years), so a
// duration can never overflow (llama.cpp's int loop counter overflows past about 124 days).
constexpr double kMaxKeepAliveSeconds = 100.0 * 365.25 * 24 * 3600;
// Largest size accepted: 2^63 bytes, so every sum of a few sizes still fits in uint64.

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (auto& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

bool ascii_digit(char c) { return c >= '0' && c <= '9'; }  // not isdigit: no locale's digits

// A decimal number as written: optional sign, digits, optional fraction. Kept as digit strings so
// that sizes and durations are computed exactly (0.5 B is not silently 0 B, and 0.000...1 s is not
// silently 0).
struct Decimal {
  bool negative = false;
  std::string whole;     // digits before the point, leading zeros removed
  std::string fraction;  // digits after the point, trailing zeros removed
  bool zero() const { return whole.empty() && fraction.empty(); }
  double value() const {
    const std::string text = (negative ? "-" : "") + (whole.empty() ? std::string("0") : whole) + "." + fraction + "0";
    return std::strtod(text.c_str(), nullptr);
  }
};

// Reads a decimal number from the front of `s`. Returns false when there is none. Rejects hex,
// exponents, inf and nan on purpose.
bool take_number(std::string_view& s, Decimal& out) {
  std::size_t i = 0;
  out = Decimal{};
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) out.negative = s[i++] == '-';
  std::size_t digits = 0;
  const std::size_t whole_start = i;
  while (i < s.size() && ascii_digit(s[i])) ++i, ++digits;
  out.whole = std::string(s.substr(whole_start, i - whole_start));
  if (i < s.size() && s[i] == '.') {
    const std::size_t frac_start = ++i;
    while (i < s.size() && ascii_digit(s[i])) ++i, ++digits;
    out.fraction = std::string(s.substr(frac_start, i - frac_start));
  }
  if (digits == 0) return false;
  out.whole.erase(0, std::min(out.whole.find_first_not_of('0'), out.whole.size()));
  while (!out.fraction.empty() && out.fraction.back() == '0') out.fraction.pop_back();
  s.remove_prefix(i);
  return true;
}

// 128-bit arithmetic for exact sizes and durations (GCC and Clang; __extension__ keeps -Wpedantic quiet).
__extension__ typedef unsigned __int128 u128;

// d x scale exactly, when that is a whole number below `limit`.
enum class Scaled { ok, too_large, not_whole };
Scaled scale_exactly(const Decimal& d, std::uint64_t scale, u128 limit, u128& out) {
  if (d.whole.size() > 20) return Scaled::too_large;  // 10^20 x scale stays far inside 128 bits
  u128 whole = 0;
  for (char c : d.whole) whole = whole * 10 + static_cast<unsigned>(c - '0');
  u128 total = whole * scale;
  if (total >= limit) return Scaled::too_large;
  if (!d.fraction.empty()) {
    // scale < 2^42 and 10^26 < 2^87: the product fits; a longer fraction is no whole number here.
    if (d.fraction.size() > 26) return Scaled::not_whole;
    u128 f = 0, ten_k = 1;
    for (char c : d.fraction) f = f * 10 + static_cast<unsigned>(c - '0'), ten_k *= 10;
    const u128 product = f * scale;
    if (product % ten_k != 0) return Scaled::not_whole;
    total += product / ten_k;
    if (total >= limit) return Scaled::too_large;
  }
  out = total;
  return Scaled::ok;
}

std::string take_unit(std::string_view& s) {
  std::size_t i = 0;
  while (i < s.size() && std::isalpha(static_cast<unsigned char>(s[i]))) ++i;
  std::string u(s.substr(0, i));
  s.remove_prefix(i);
  return u;
}

constexpr const char* kKeepAliveForms =
    "a number with a unit ns, us, ms, s (sec), m (min) or h, a space allowed before the unit (500ms, 180s, 5 s, "
    "1.5h); units combined largest first, each once (1h30m); a bare number of seconds; 0; forever or a negative "
    "number; off";
constexpr const char* kSizeForms =
    "a whole number of bytes with an optional unit: B, KiB, MiB, GiB, TiB (powers of 1024), KB, MB, GB, TB "
    "(powers of 1000), K, M, G, T (= KiB...), e.g. 8GiB, 512MB, 1.5G; at most 2^63 bytes";

Status bad(std::string_view text, const std::string& what, const char* forms) {
  return Status(ErrorCode::invalid_argument, "\"" + printable(text) + "\": " + what + "; accepted: " + forms);
}

// A size's value, or why it is none (for messages that name their own accepted forms).
struct SizeParse {
  std::uint64_t bytes = 0;
  std::string why;  // empty: ok
};

SizeParse parse_size_value(std::string_view text) {
  std::string_view s = trim(text);
  if (s.empty()) return {0, "empty"};
  Decimal d;
  if (!take_number(s, d)) return {0, "not a number of bytes"};
  if (d.negative && !d.zero()) return {0, "negative"};
  while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
  const std::string unit = take_unit(s);
  if (!s.empty()) return {0, "unexpected '" + printable(trim(s)) + "' after the " + (unit.empty() ? "number" : "unit")};
  const std::string u = lower(unit);
  std::uint64_t scale = 0;
  if (u.empty() || u == "b") scale = 1;
  else if (u == "kib" || u == "k") scale = 1ull << 10;
  else if (u == "mib" || u == "m") scale = 1ull << 20;
  else if (u == "gib" || u == "g") scale = 1ull << 30;
  else if (u == "tib" || u == "t") scale = 1ull << 40;
  else if (u == "kb") scale = 1'000;
  else if (u == "mb") scale = 1'000'000;
  else if (u == "gb") scale = 1'000'000'000;
  else if (u == "tb") scale = 1'000'000'000'000;
  else return {0, "unknown unit '" + printable(unit) + "'"};
  u128 bytes = 0;
  switch (scale_exactly(d, scale, static_cast<u128>(1) << 63, bytes)) {
    case Scaled::too_large: return {0, "too large: more than 2^63 bytes (8 EiB)"};
    case Scaled::not_whole: {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.6g", d.value() * static_cast<double>(scale));
      return {0, std::string("not a whole number of bytes (") + buf + " B)"};
    }
    case Scaled::ok: break;
  }
  return {static_cast<std::uint64_t>(bytes), ""};
}

}  // namespace

namespace core {

// Keep-alive text; `forms` names what the variable being read accepts. The grammar is the one
// parse_keep_alive's comment states (config.hpp); every refusal is bad(): the value, why, `forms`.
Result<KeepAlive> parse_keep_alive_as(std::string_view text, const char* forms) {
  std::string_view s = trim(text);
  if (s.empty()) return bad(text, "empty", forms);
  const std::string l = lower(s);
  if (l == "off") return KeepAlive::off();
  if (l == "forever") return KeepAlive::forever();
  if (l == "inf" || l == "infinite" || l == "infinity")
    return bad(text, "not a duration (no expiry is written forever)", forms);

  // Exact nanoseconds: 100 years is 3.2e18 ns, inside int64.
  constexpr u128 kLimitNs = static_cast<u128>(kMaxKeepAliveSeconds) * 1'000'000'000u + 1;
  // The units, largest first: a duration of several parts names each once, in this order.
  struct Unit {
    const char* name;
    const char* alias;
    std::uint64_t ns;
  };
  static constexpr Unit kUnits[] = {{"h", nullptr, 3'600'000'000'000},
                                    {"m", "min", 60'000'000'000},
                                    {"s", "sec", 1'000'000'000},
                                    {"ms", nullptr, 1'000'000},
                                    {"us", nullptr, 1'000},
                                    {"ns", nullptr, 1}};
  constexpr std::size_t kNoUnit = std::size(kUnits);
  auto skip_spaces = [](std::string_view& v) {
    while (!v.empty() && std::isspace(static_cast<unsigned char>(v.front()))) v.remove_prefix(1);
  };
  u128 total_ns = 0;
  bool negative = false, nonzero = false, first = true;
  std::size_t previous = kNoUnit;  // the unit of the part before, as an index into kUnits
  while (!s.empty()) {
    Decimal d;
    if (!take_number(s, d)) return bad(text, "not a duration", forms);
    if (!first && d.negative) return bad(text, "a sign is only allowed at the start", forms);
    negative = negative || (d.negative && !d.zero());
    nonzero = nonzero || !d.zero();
    skip_spaces(s);
    const std::string unit = lower(take_unit(s));
    skip_spaces(s);
    std::uint64_t scale_ns = 0;
    if (unit.empty()) {
      if (!first || !s.empty()) return bad(text, "a number without a unit inside a duration", forms);
      scale_ns = 1'000'000'000;
    } else {
      std::size_t k = 0;
      while (k < kNoUnit && unit != kUnits[k].name && !(kUnits[k].alias && unit == kUnits[k].alias)) ++k;
      if (k == kNoUnit) return bad(text, "unknown unit '" + printable(unit) + "'", forms);
      if (!first && k == previous) return bad(text, "the unit '" + unit + "' is given twice", forms);
      if (!first && k < previous)
        return bad(text, "'" + unit + "' after a smaller unit (combine units largest first)", forms);
      previous = k;
      scale_ns = kUnits[k].ns;
    }
    first = false;
    u128 part = 0;
    const Scaled r = scale_exactly(d, scale_ns, kLimitNs, part);
    if (r == Scaled::too_large || total_ns + part >= kLimitNs) {
      if (negative) return KeepAlive::forever();
      return bad(text, "too long: more than 100 years (use forever)", forms);
    }
    if (r == Scaled::not_whole) {
      if (negative) return KeepAlive::forever();
      const bool below_1ns = total_ns == 0 && d.value() * static_cast<double>(scale_ns) < 1.0;
      return bad(text, below_1ns ? "shorter than 1 ns, but not 0" : "not a whole number of nanoseconds", forms);
    }
    total_ns += part;
  }
  if (negative) return KeepAlive::forever();
  if (total_ns == 0) {
    if (nonzero) return bad(text, "shorter than 1 ns, but not 0", forms);
    return KeepAlive::zero();
  }
  return KeepAlive{KeepAlive::Kind::duration, Nanos(static_cast<std::int64_t>(total_ns))};
}

}  // namespace core

std::string KeepAlive::to_string() const {
  switch (kind) {
    case Kind::zero: return "0";
    case Kind::forever: return "forever";
    case Kind::off: return "off";
    case Kind::duration: break;
  }
  const auto ns = duration.count();
  char buf[64];
  if (ns % 1'000'000'000 == 0) {
    std::snprintf(buf, sizeof buf, "%lld s", static_cast<long long>(ns / 1'000'000'000));
  } else if (ns % 1'000'000 == 0) {
    std::snprintf(buf, sizeof buf, "%lld ms", static_cast<long long>(ns / 1'000'000));
  } else {
    std::snprintf(buf, sizeof buf, "%.6g s", static_cast<double>(ns) / 1e9);
  }
  return buf;
}

Result<KeepAlive> parse_keep_alive(std::string_view text) { return core::parse_keep_alive_as(text, kKeepAliveForms); }

Result<std::uint64_t> parse_size(std::string_view text) {
  const SizeParse p = parse_size_value(text);
  if (!p.why.empty()) return bad(text, p.why, kSizeForms);
  return p.bytes;
}

std::uint64_t WiredLimit::resolve(std::uint64_t recommended) const {
  if (!is_percent) return bytes;
  return static_cast<std::uint64_t>(static_cast<double>(recommended) * percent / 100.0);
}

std::string WiredLimit::to_string() const {
  if (!is_percent) return format_size(bytes);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g%%", percent);
  return buf;
}

namespace {
// Bytes or a percent; `why` says what is wrong (empty: ok), for callers that name their own forms.
struct LimitParse {
  WiredLimit limit;
  std::string why;
};

// What follows a number that is not accepted: an exponent gets its own reason (1e2 is a number,
// only not a form accepted here).
std::string after_number(std::string_view rest, const char* what) {
  if (!rest.empty() && (rest.front() == 'e' || rest.front() == 'E'))
    return "an exponent ('" + printable(rest) + "') is not accepted; write the number out (100, not 1e2)";
  return std::string("not ") + what;
}

LimitParse parse_limit_value(std::string_view text) {
  std::string_view s = trim(text);
  LimitParse out;
  if (!s.empty() && s.back() == '%') {
    std::string_view n = trim(s.substr(0, s.size() - 1));
    Decimal d;
    if (!take_number(n, d) || !n.empty())
      return {{}, d.whole.empty() && d.fraction.empty() ? "not a percent" : after_number(n, "a percent")};
    const double v = d.value();
    if ((d.negative && !d.zero()) || !(v <= 100)) return {{}, "a percent must be from 0 to 100"};
    if (d.zero()) return out;  // 0% is 0 bytes, whatever it is a percent of (WiredLimit's rule for 0)
    if (!(v >= 1e-9)) return {{}, "too small a percent (below 1e-9 %)"};
    out.limit.is_percent = true;
    out.limit.percent = v;
    return out;
  }
  const SizeParse size = parse_size_value(s);
  out.why = size.why;
  out.limit.bytes = size.bytes;
  return out;
}
}  // namespace

Result<WiredLimit> parse_wired_limit(std::string_view text) {
  constexpr const char* forms =
      "a whole number of bytes with a unit (8GiB, 512MB, 1073741824) or a percent of the recommended working set "
      "(75%); 0 or 0% wires nothing";
  LimitParse p = parse_limit_value(text);
  if (!p.why.empty()) return bad(text, p.why, forms);
  return p.limit;
}

namespace {
bool name_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-'; }
bool valid_name(std::string_view s, std::size_t max) {
  if (s.empty() || s.size() > max || s.front() == '.' || s.front() == '-') return false;
  for (char c : s)
    if (!name_char(c)) return false;
  return true;
}
}  // namespace

std::string SharedBudget::to_string() const {
  return name + ":" + size.to_string() + (group.empty() ? "" : ":" + group);
}

namespace core {

// RESIDENCY_SHARED_BUDGET's and RESIDENCY_GPU_BUDGET's grammar, with the longest NAME each accepts:
// the check and its message both come from `name_max`.
Result<SharedBudget> parse_budget(std::string_view text, std::size_t name_max, const char* size_of) {
  const std::string forms_text =
      "NAME:SIZE or NAME:SIZE:GROUP; NAME and GROUP of letters, digits, '.', '_', '-' (NAME up to " +
      std::to_string(name_max) +
      ", GROUP up to 32 characters, not starting with '.' or '-'); SIZE bytes with a unit "
      "(8GiB, 512MB) or a percent of " +
      size_of + " (50%), more than 0; e.g. llm:48GiB or llm:60%:inference";
  const char* forms = forms_text.c_str();
  const std::string_view s = trim(text);
  const std::size_t c1 = s.find(':');
  if (c1 == std::string_view::npos) return bad(text, "no ':' between the name and the size", forms);
  const std::size_t c2 = s.find(':', c1 + 1);
  if (c2 != std::string_view::npos && s.find(':', c2 + 1) != std::string_view::npos)
    return bad(text, "more than three ':'-separated fields", forms);
  SharedBudget b;
  b.name = std::string(s.substr(0, c1));
  if (b.name.size() > name_max && valid_name(b.name, b.name.size()))
    return bad(text, "the name '" + printable(b.name) + "' is longer than " + std::to_string(name_max) + " characters",
               forms);
  if (!valid_name(b.name, name_max)) return bad(text, "the name '" + printable(b.name) + "' is not accepted", forms);
  const std::string_view size = s.substr(c1 + 1, c2 == std::string_view::npos ? std::string_view::npos : c2 - c1 - 1);
  const LimitParse w = parse_limit_value(size);
  if (!w.why.empty()) return bad(text, "the size '" + printable(size) + "': " + w.why, forms);
  if (!w.limit.is_percent && w.limit.bytes == 0) return bad(text, "the size is 0", forms);
  b.size = w.limit;
  if (c2 != std::string_view::npos) {
    b.group = std::string(s.substr(c2 + 1));
    if (!valid_name(b.group, 32)) return bad(text, "the group '" + printable(b.group) + "' is not accepted", forms);
  }
  return b;
}

}  // namespace core

Result<SharedBudget> parse_shared_budget(std::string_view text) {
  return core::parse_budget(text, kSharedBudgetNameMax, "RAM");
}

Result<HostBudget> parse_host_budget(std::string_view text) {
  HostBudget h;
  const std::string_view s = trim(text);
  if (lower(s) == "off") {
    h.off = true;
    return h;
  }
  if (s.find(':') != std::string_view::npos) {
    auto b = parse_shared_budget(s);
    if (!b) return b.status();
    h.budget = *b;
    return h;
  }
  constexpr const char* forms =
      "`off`, a size with unit (48GiB) or a percent of RAM (50%) for the ledger `host`, or NAME:SIZE[:GROUP] as "
      "RESIDENCY_SHARED_BUDGET";
  const LimitParse w = parse_limit_value(s);
  if (!w.why.empty()) return bad(text, w.why, forms);
  if (!w.limit.is_percent && w.limit.bytes == 0) return bad(text, "the size is 0", forms);
  h.budget = SharedBudget{kDefaultHostBudgetName, w.limit, ""};
  return h;
}

Result<Layout> parse_layout(std::string_view text) {
  const std::string l = lower(trim(text));
  if (l == "per_buffer") return Layout::per_buffer;
  if (l == "sharded") return Layout::sharded;
  return bad(text, "unknown layout", "per_buffer, sharded");
}

Result<LogLevel> parse_log_level(std::string_view text) {
  const std::string l = lower(trim(text));
  if (l == "error") return LogLevel::error;
  if (l == "warn" || l == "warning") return LogLevel::warn;
  if (l == "info") return LogLevel::info;
  if (l == "debug") return LogLevel::debug;
  return bad(text, "unknown log level", "error, warn, info, debug");
}

Result<CudaBackup> parse_cuda_backup(std::string_view text) {
  const std::string l = lower(trim(text));
  if (l == "after-allocation") return CudaBackup::after_allocation;
  if (l == "at-first-sleep") return CudaBackup::at_first_sleep;
  return bad(text, "unknown backup mode", "after-allocation, at-first-sleep");
}

namespace core {

Status bad_value(std::string_view text, const std::string& what, const char* forms) { return bad(text, what, forms); }

Result<bool> parse_flag(std::string_view text, const char* forms) {
  const std::string l = lower(trim(text));
  if (l == "1" || l == "true" || l == "yes" || l == "on") return true;
  if (l == "0" || l == "false" || l == "no" || l == "off") return false;
  return bad(text, "not a flag", forms);
}

Result<double> parse_number(std::string_view text) {
  std::string_view s = trim(text);
  Decimal d;
  if (!take_number(s, d)) return bad(text, "not a number", "a decimal number such as 5 or 2.5");
  if (!s.empty()) return bad(text, after_number(s, "a number"), "a decimal number such as 5 or 2.5");
  return d.value();
}

}  // namespace core
}  // namespace residency
