// SPDX-License-Identifier: MIT
// The library's text forms (residency/text.hpp, core/text.hpp): a user's value made printable, a
// size for users, and the fixed-unit forms of the log lines that follow llama.cpp's wording.
#include "core/text.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

namespace residency {

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

std::string printable(std::string_view value, std::size_t max_bytes) {
  // Each input character becomes one piece of output; pieces are never split when shortening.
  std::vector<std::string> pieces;
  pieces.reserve(value.size());
  auto hex = [](unsigned char c) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "\\x%02X", c);
    return std::string(buf);
  };
  for (std::size_t i = 0; i < value.size();) {
    const auto c = static_cast<unsigned char>(value[i]);
    if (c == '\n') pieces.emplace_back("\\n"), ++i;
    else if (c == '\r') pieces.emplace_back("\\r"), ++i;
    else if (c == '\t') pieces.emplace_back("\\t"), ++i;
    else if (c == '\\') pieces.emplace_back("\\\\"), ++i;
    else if (c < 0x20 || c == 0x7f) pieces.push_back(hex(c)), ++i;
    else if (c < 0x80) pieces.emplace_back(1, static_cast<char>(c)), ++i;
    else {
      // UTF-8: a well-formed sequence passes, except the C1 controls (U+0080-U+009F: a terminal may
      // read U+009B as an escape sequence); anything else is escaped byte by byte.
      const std::size_t n = c >= 0xF0 && c <= 0xF4 ? 4 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xC2 && c <= 0xDF ? 2 : 0;
      bool ok = n != 0 && i + n <= value.size();
      for (std::size_t k = 1; ok && k < n; ++k) ok = (static_cast<unsigned char>(value[i + k]) & 0xC0) == 0x80;
      if (ok && n == 2 && c == 0xC2 && static_cast<unsigned char>(value[i + 1]) < 0xA0) ok = false;   // C1
      if (ok && n == 3 && c == 0xE0 && static_cast<unsigned char>(value[i + 1]) < 0xA0) ok = false;   // overlong
      if (ok && n == 3 && c == 0xED && static_cast<unsigned char>(value[i + 1]) >= 0xA0) ok = false;  // surrogate
      if (ok && n == 4 && c == 0xF0 && static_cast<unsigned char>(value[i + 1]) < 0x90) ok = false;   // overlong
      if (ok && n == 4 && c == 0xF4 && static_cast<unsigned char>(value[i + 1]) >= 0x90) ok = false;  // > U+10FFFF
      if (ok) {
        pieces.emplace_back(value.substr(i, n));
        i += n;
      } else {
        pieces.push_back(hex(c));
        ++i;
      }
    }
  }
  std::size_t total = 0;
  for (const auto& p : pieces) total += p.size();
  max_bytes = std::max<std::size_t>(max_bytes, 24);
  if (total <= max_bytes) {
    std::string out;
    for (const auto& p : pieces) out += p;
    return out;
  }
  // Long: the start and the end (where a path's file name is), and how long it was.
  std::string head, tail;
  std::size_t front = 0, back = pieces.size();
  while (front < back && head.size() + pieces[front].size() <= max_bytes * 2 / 3) head += pieces[front++];
  std::vector<std::string> end_pieces;
  std::size_t tail_size = 0;
  while (back > front && tail_size + pieces[back - 1].size() <= max_bytes / 3 - 3) {
    tail_size += pieces[back - 1].size();
    end_pieces.push_back(pieces[--back]);
  }
  for (auto it = end_pieces.rbegin(); it != end_pieces.rend(); ++it) tail += *it;
  return head + "..." + tail + " (" + std::to_string(value.size()) + " bytes)";
}

namespace core {

std::string mib(std::uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buf;
}

std::string ms(Nanos d) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f ms", static_cast<double>(d.count()) / 1e6);
  return buf;
}

}  // namespace core
}  // namespace residency
