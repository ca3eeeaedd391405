// Strict parsing of keep-alive values, sizes and the RESIDENCY_* environment.
#include "residency/config.hpp"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

namespace residency {
namespace {

// Longest keep-alive accepted: 100 years fits easily in int64 nanoseconds (292 years), so a
// duration can never overflow (llama.cpp's int loop counter overflows past about 124 days).
constexpr double kMaxKeepAliveSeconds = 100.0 * 365.25 * 24 * 3600;
// Largest size accepted: 2^63 bytes, so every sum of a few sizes still fits in uint64.
constexpr double kMaxSizeBytes = 9223372036854775808.0;

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

// Reads a decimal number (optional sign, digits, optional fraction) from the front of `s`.
// Returns false when there is none. Rejects hex, exponents, inf and nan on purpose.
bool take_number(std::string_view& s, double& out) {
  std::size_t i = 0;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
  std::size_t digits = 0;
  while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i, ++digits;
  if (i < s.size() && s[i] == '.') {
    ++i;
    while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i, ++digits;
  }
  if (digits == 0) return false;
  std::string num(s.substr(0, i));
  out = std::strtod(num.c_str(), nullptr);
  s.remove_prefix(i);
  return true;
}

std::string take_unit(std::string_view& s) {
  std::size_t i = 0;
  while (i < s.size() && std::isalpha(static_cast<unsigned char>(s[i]))) ++i;
  std::string u(s.substr(0, i));
  s.remove_prefix(i);
  return u;
}

constexpr const char* kKeepAliveForms =
    "a duration with unit (500ms, 180s, 3m, 1h, 1h30m), a bare number of seconds, 0, "
    "forever (or a negative number), off";
constexpr const char* kSizeForms =
    "bytes with an optional unit: B, KiB, MiB, GiB, TiB (powers of 1024), KB, MB, GB, TB "
    "(powers of 1000), K, M, G, T (= KiB...), e.g. 8GiB, 512MB, 1.5G";

Status bad(std::string_view text, const std::string& what, const char* forms) {
  return Status(ErrorCode::invalid_argument,
                "\"" + std::string(text) + "\": " + what + "; accepted: " + forms);
}

}  // namespace

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

Result<KeepAlive> parse_keep_alive(std::string_view text) {
  std::string_view s = trim(text);
  if (s.empty()) return bad(text, "empty", kKeepAliveForms);
  const std::string l = lower(s);
  if (l == "off") return KeepAlive::off();
  if (l == "forever" || l == "inf" || l == "infinite") return KeepAlive::forever();

  double total_s = 0;
  bool negative = false;
  bool first = true;
  while (!s.empty()) {
    double v = 0;
    if (!take_number(s, v)) return bad(text, "not a duration", kKeepAliveForms);
    if (!first && v < 0) return bad(text, "a sign is only allowed at the start", kKeepAliveForms);
    if (v < 0) negative = true;
    const std::string unit = lower(take_unit(s));
    double scale = 0;
    if (unit.empty()) {
      if (!first || !s.empty()) return bad(text, "a number without a unit inside a duration", kKeepAliveForms);
      scale = 1;
    } else if (unit == "ns") {
      scale = 1e-9;
    } else if (unit == "us") {
      scale = 1e-6;
    } else if (unit == "ms") {
      scale = 1e-3;
    } else if (unit == "s" || unit == "sec") {
      scale = 1;
    } else if (unit == "m" || unit == "min") {
      scale = 60;
    } else if (unit == "h") {
      scale = 3600;
    } else {
      return bad(text, "unknown unit '" + unit + "'", kKeepAliveForms);
    }
    total_s += std::fabs(v) * scale;
    first = false;
    if (total_s > kMaxKeepAliveSeconds) {
      if (negative) return KeepAlive::forever();
      return bad(text, "longer than 100 years (use forever)", kKeepAliveForms);
    }
  }
  if (negative) return KeepAlive::forever();
  const auto ns = static_cast<std::int64_t>(std::llround(total_s * 1e9));
  if (ns == 0) {
    if (total_s != 0) return bad(text, "shorter than 1 ns", kKeepAliveForms);
    return KeepAlive::zero();
  }
  return KeepAlive{KeepAlive::Kind::duration, Nanos(ns)};
}

Result<std::uint64_t> parse_size(std::string_view text) {
  std::string_view s = trim(text);
  if (s.empty()) return bad(text, "empty", kSizeForms);
  double v = 0;
  if (!take_number(s, v)) return bad(text, "not a size", kSizeForms);
  if (v < 0) return bad(text, "negative", kSizeForms);
  while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
  const std::string unit = take_unit(s);
  if (!s.empty()) return bad(text, "unexpected '" + std::string(s) + "' after the unit", kSizeForms);
  const std::string u = lower(unit);
  double scale = 0;
  if (u.empty() || u == "b") scale = 1;
  else if (u == "kib" || u == "k") scale = 1024.0;
  else if (u == "mib" || u == "m") scale = 1024.0 * 1024;
  else if (u == "gib" || u == "g") scale = 1024.0 * 1024 * 1024;
  else if (u == "tib" || u == "t") scale = 1024.0 * 1024 * 1024 * 1024;
  else if (u == "kb") scale = 1e3;
  else if (u == "mb") scale = 1e6;
  else if (u == "gb") scale = 1e9;
  else if (u == "tb") scale = 1e12;
  else return bad(text, "unknown unit '" + unit + "'", kSizeForms);
  const double bytes = std::floor(v * scale);
  if (bytes >= kMaxSizeBytes) return bad(text, "larger than 2^63 bytes", kSizeForms);
  return static_cast<std::uint64_t>(bytes);
}

std::string format_size(std::uint64_t bytes) {
  static const char* units[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) return std::to_string(bytes) + " B";
  double v = static_cast<double>(bytes) / 1024;
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  char buf[32];
  if (v >= 100 || std::fabs(v - std::round(v)) < 0.05) {
    std::snprintf(buf, sizeof buf, "%.0f %s", v, units[u]);
  } else {
    std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  }
  return buf;
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

Result<WiredLimit> parse_wired_limit(std::string_view text) {
  std::string_view s = trim(text);
  constexpr const char* forms =
      "a size (8GiB, 512MB, 1073741824) or a percent of the recommended working set (75%)";
  if (!s.empty() && s.back() == '%') {
    std::string_view n = trim(s.substr(0, s.size() - 1));
    double v = 0;
    if (!take_number(n, v) || !n.empty()) return bad(text, "not a percent", forms);
    if (!(v > 0 && v <= 100)) return bad(text, "a percent must be above 0 and at most 100", forms);
    WiredLimit w;
    w.is_percent = true;
    w.percent = v;
    return w;
  }
  auto size = parse_size(s);
  if (!size) return bad(text, "not a size", forms);
  WiredLimit w;
  w.bytes = *size;
  return w;
}

namespace {
bool name_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
}
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

Result<SharedBudget> parse_shared_budget(std::string_view text) {
  constexpr const char* forms =
      "NAME:SIZE or NAME:SIZE:GROUP; NAME and GROUP of letters, digits, '.', '_', '-' (NAME up to 64, "
      "GROUP up to 32 characters, not starting with '.' or '-'); SIZE bytes with a unit (8GiB, 512MB) or a "
      "percent of RAM (50%), more than 0; e.g. llm:48GiB or llm:60%:inference";
  const std::string_view s = trim(text);
  const std::size_t c1 = s.find(':');
  if (c1 == std::string_view::npos) return bad(text, "no ':' between the name and the size", forms);
  const std::size_t c2 = s.find(':', c1 + 1);
  if (c2 != std::string_view::npos && s.find(':', c2 + 1) != std::string_view::npos)
    return bad(text, "more than three ':'-separated fields", forms);
  SharedBudget b;
  b.name = std::string(s.substr(0, c1));
  if (!valid_name(b.name, 64)) return bad(text, "the name '" + b.name + "' is not accepted", forms);
  const std::string_view size = s.substr(c1 + 1, c2 == std::string_view::npos ? std::string_view::npos : c2 - c1 - 1);
  auto w = parse_wired_limit(size);
  if (!w) return bad(text, "the size '" + std::string(size) + "' is not a size or a percent", forms);
  if (!w->is_percent && w->bytes == 0) return bad(text, "the size is 0", forms);
  b.size = *w;
  if (c2 != std::string_view::npos) {
    b.group = std::string(s.substr(c2 + 1));
    if (!valid_name(b.group, 32)) return bad(text, "the group '" + b.group + "' is not accepted", forms);
  }
  return b;
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

namespace {

Result<bool> parse_flag(std::string_view text, const char* forms) {
  const std::string l = lower(trim(text));
  if (l == "1" || l == "true" || l == "yes" || l == "on") return true;
  if (l == "0" || l == "false" || l == "no" || l == "off") return false;
  return bad(text, "not a flag", forms);
}

Result<double> parse_number(std::string_view text) {
  std::string_view s = trim(text);
  double v = 0;
  if (!take_number(s, v) || !s.empty()) return bad(text, "not a number", "a decimal number such as 5 or 2.5");
  return v;
}

}  // namespace

Result<Config> Config::from_env() {
  return from_env([](const char* name) { return std::getenv(name); });
}

Result<Config> Config::from_env(const EnvLookup& getenv) {
  Config c;
  std::string errors;
  auto fail = [&](const char* var, const Status& st) {
    errors += (errors.empty() ? "" : "\n") + std::string(var) + "=" + st.message();
  };
  auto get = [&](const char* name) -> const char* { return getenv ? getenv(name) : nullptr; };

  // Keep-alive: ours wins over the aliases; each alias is parsed strictly.
  const char* ka = get("RESIDENCY_KEEP_ALIVE");
  const char* ggml_ka = get("GGML_METAL_RESIDENCY_KEEP_ALIVE_S");
  const char* ggml_off = get("GGML_METAL_NO_RESIDENCY");
  if (ka) {
    auto v = parse_keep_alive(ka);
    if (v) c.keep_alive = *v; else fail("RESIDENCY_KEEP_ALIVE", v.status());
    if (ggml_ka) c.notes.push_back("GGML_METAL_RESIDENCY_KEEP_ALIVE_S is ignored: RESIDENCY_KEEP_ALIVE is set");
    if (ggml_off) c.notes.push_back("GGML_METAL_NO_RESIDENCY is ignored: RESIDENCY_KEEP_ALIVE is set");
  } else {
    bool off = false;
    if (ggml_off) {
      auto v = parse_flag(*ggml_off ? ggml_off : "1", "set (empty, 1, true, yes, on) to turn residency off; 0, false, no, off to keep it");
      if (!v) fail("GGML_METAL_NO_RESIDENCY", v.status());
      else if (*v) {
        off = true;
        c.keep_alive = KeepAlive::off();
        c.notes.push_back("GGML_METAL_NO_RESIDENCY is set: keep_alive = off (alias of RESIDENCY_KEEP_ALIVE=off)");
      }
    }
    if (ggml_ka && !off) {
      // llama.cpp reads whole seconds with atoi; we accept a number of seconds, strictly.
      auto n = parse_number(ggml_ka);
      if (!n) {
        fail("GGML_METAL_RESIDENCY_KEEP_ALIVE_S",
             bad(ggml_ka, "not a number of seconds", "a number of seconds; 0 = release after each use, negative = forever"));
      } else {
        auto v = parse_keep_alive(std::string(trim(ggml_ka)) + (*n < 0 ? "" : "s"));
        if (v) {
          c.keep_alive = *v;
          c.notes.push_back("GGML_METAL_RESIDENCY_KEEP_ALIVE_S=" + std::string(ggml_ka) +
                            " read as RESIDENCY_KEEP_ALIVE=" + v->to_string() +
                            " (unlike llama.cpp, 0 means 0 and text is an error)");
        } else {
          fail("GGML_METAL_RESIDENCY_KEEP_ALIVE_S", v.status());
        }
      }
    } else if (ggml_ka) {
      c.notes.push_back("GGML_METAL_RESIDENCY_KEEP_ALIVE_S is ignored: GGML_METAL_NO_RESIDENCY is set");
    }
  }

  if (const char* v = get("RESIDENCY_WIRED_LIMIT")) {
    auto w = parse_wired_limit(v);
    if (w) c.wired_limit = *w; else fail("RESIDENCY_WIRED_LIMIT", w.status());
  }

  const char* pct = get("RESIDENCY_SET_MAX_PCT");
  const char* mlx_pct = get("MLX_RESIDENCY_SET_MAX_PCT");
  if (pct || mlx_pct) {
    const char* var = pct ? "RESIDENCY_SET_MAX_PCT" : "MLX_RESIDENCY_SET_MAX_PCT";
    auto n = parse_number(pct ? pct : mlx_pct);
    if (n) c.set_max_pct = *n; else fail(var, n.status());
    if (pct && mlx_pct) c.notes.push_back("MLX_RESIDENCY_SET_MAX_PCT is ignored: RESIDENCY_SET_MAX_PCT is set");
    else if (!pct && n) c.notes.push_back("MLX_RESIDENCY_SET_MAX_PCT read as RESIDENCY_SET_MAX_PCT");
  }

  if (const char* v = get("RESIDENCY_LAYOUT")) {
    auto l = parse_layout(v);
    if (l) c.layout = *l; else fail("RESIDENCY_LAYOUT", l.status());
  }
  if (const char* v = get("RESIDENCY_RELEASE_ON_PRESSURE")) {
    auto f = parse_flag(v, "0 or 1");
    if (f) c.release_on_pressure = *f; else fail("RESIDENCY_RELEASE_ON_PRESSURE", f.status());
  }
  if (const char* v = get("RESIDENCY_PRESSURE_FLOOR")) {
    auto w = parse_wired_limit(v);
    if (w) c.pressure_floor = *w; else fail("RESIDENCY_PRESSURE_FLOOR", w.status());
  }
  if (const char* v = get("RESIDENCY_PRESSURE_QUIET")) {
    auto k = parse_keep_alive(v);
    if (k && k->kind == KeepAlive::Kind::duration) c.pressure_quiet = k->duration;
    else fail("RESIDENCY_PRESSURE_QUIET", k ? Status(ErrorCode::invalid_argument, "\"" + std::string(v) +
                                                      "\": not a duration; accepted: a duration with unit (10s, 2m), "
                                                      "or a bare number of seconds, more than 0")
                                            : k.status());
  }
  if (const char* v = get("RESIDENCY_SHARED_BUDGET")) {
    auto b = parse_shared_budget(v);
    if (b) c.shared_budget = *b; else fail("RESIDENCY_SHARED_BUDGET", b.status());
  }
  if (const char* v = get("RESIDENCY_SHARED_PRIORITY")) {
    auto n = parse_number(v);
    if (n && *n == std::floor(*n) && *n >= -1000 && *n <= 1000) {
      c.shared_priority = static_cast<int>(*n);
    } else {
      fail("RESIDENCY_SHARED_PRIORITY", bad(v, "not an integer from -1000 to 1000",
                                            "an integer from -1000 to 1000; default 0, higher keeps its share longer"));
    }
  }
  const char* log = get("RESIDENCY_LOG");
  const char* mlx_debug = get("MLX_RESIDENCY_DEBUG");
  if (log) {
    auto l = parse_log_level(log);
    if (l) c.log_level = *l; else fail("RESIDENCY_LOG", l.status());
    if (mlx_debug) c.notes.push_back("MLX_RESIDENCY_DEBUG is ignored: RESIDENCY_LOG is set");
  } else if (mlx_debug) {
    auto f = parse_flag(mlx_debug, "1 (debug log) or 0");
    if (!f) fail("MLX_RESIDENCY_DEBUG", f.status());
    else if (*f) {
      c.log_level = LogLevel::debug;
      c.notes.push_back("MLX_RESIDENCY_DEBUG=1 read as RESIDENCY_LOG=debug");
    }
  }

  if (!errors.empty()) return Status(ErrorCode::invalid_argument, errors);
  return c;
}

}  // namespace residency
