// SPDX-License-Identifier: MIT
#include "engine_memory.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>

#include "engine_code.hpp"
#include "residency/text.hpp"

namespace residency::preload {

namespace {

bool parse_hex(std::string_view s, std::uint64_t& out) noexcept {
  const auto r = std::from_chars(s.data(), s.data() + s.size(), out, 16);
  return r.ec == std::errc{} && r.ptr == s.data() + s.size();
}

// The next space-separated field of `s` from `at` (spaces before it skipped); empty at the end.
std::string_view field(std::string_view s, std::size_t& at) noexcept {
  while (at < s.size() && s[at] == ' ') ++at;
  const std::size_t b = at;
  while (at < s.size() && s[at] != ' ') ++at;
  return s.substr(b, at - b);
}

}  // namespace

// The whole of /proc/self/maps; empty when it cannot be read.
std::string read_own_maps() {
  std::string text;
  const int fd = ::open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return text;
  char buf[16384];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return text;
}

std::vector<MapsEntry> parse_maps(std::string_view text) {
  std::vector<MapsEntry> out;
  std::size_t b = 0;
  while (b < text.size()) {
    std::size_t e = text.find('\n', b);
    if (e == std::string_view::npos) e = text.size();
    const std::string_view line = text.substr(b, e - b);
    b = e + 1;
    std::size_t at = 0;
    const std::string_view range = field(line, at), perms = field(line, at);
    field(line, at);  // offset
    field(line, at);  // device
    const std::string_view inode = field(line, at);
    const std::size_t dash = range.find('-');
    std::uint64_t lo = 0, hi = 0, ino = 0;
    if (dash == std::string_view::npos || perms.size() < 4 || !parse_hex(range.substr(0, dash), lo) ||
        !parse_hex(range.substr(dash + 1), hi) || hi <= lo)
      continue;
    if (std::from_chars(inode.data(), inode.data() + inode.size(), ino).ec != std::errc{}) continue;
    while (at < line.size() && line[at] == ' ') ++at;
    MapsEntry m;
    m.begin = static_cast<std::uintptr_t>(lo);
    m.end = static_cast<std::uintptr_t>(hi);
    m.readable = perms[0] == 'r';
    m.writable = perms[1] == 'w';
    m.executable = perms[2] == 'x';
    m.is_private = perms[3] == 'p';
    m.inode = ino;
    m.path = std::string(line.substr(at));
    out.push_back(std::move(m));
  }
  return out;
}

bool is_private_anonymous(const MapsEntry& m) noexcept {
  if (!m.is_private || !m.readable || !m.writable || m.inode != 0) return false;
  const std::string_view p = m.path;
  return p.empty() || p == "[heap]" || p == "[stack]" || p.substr(0, 6) == "[anon:";
}

bool is_engine_data(const MapsEntry& m) noexcept {
  return m.is_private && m.readable && !m.executable && m.inode != 0 && is_engine_object(m.path);
}

namespace {

bool holds_a_point(const MapsEntry& m, const std::vector<std::uintptr_t>& points) noexcept {
  return std::any_of(points.begin(), points.end(), [&](std::uintptr_t p) { return m.begin <= p && p < m.end; });
}

// The parts of [begin, end) inside the sorted extents `in`.
std::vector<Extent> intersect(std::uintptr_t begin, std::uintptr_t end, const std::vector<Extent>& in) {
  std::vector<Extent> out;
  for (const Extent& x : in) {
    const std::uintptr_t b = std::max(begin, x.begin), e = std::min(end, x.end);
    if (b < e) out.push_back({b, e});
  }
  return out;
}

}  // namespace

MemoryPlan plan_engine_memory(const std::vector<MapsEntry>& maps, const std::vector<Extent>& held,
                              const EngineOwned& owned, std::size_t page_size, std::uint64_t max_mapping) {
  MemoryPlan plan;
  std::vector<Extent> kept;
  for (const MapsEntry& m : maps) {
    std::vector<Extent> parts;  // of this mapping, the engine's
    if (is_engine_data(m) ||
        (is_private_anonymous(m) && ((owned.heap && m.path == "[heap]") || holds_a_point(m, owned.stack_points))))
      parts.push_back({m.begin, m.end});
    else if (is_private_anonymous(m)) parts = intersect(m.begin, m.end, owned.made);
    if (parts.empty()) continue;
    // Minus what is held, in whole pages; a mapping over the cap is left out, but for what is held
    // of it (a repacked copy of the weights).
    std::vector<Extent> gaps;
    for (const Extent& part : parts)
      for (const Extent& g : page_gaps(part.begin, part.end, held, page_size)) gaps.push_back(g);
    if (m.end - m.begin > max_mapping) {
      for (const Extent& g : gaps) plan.left_out += g.end - g.begin;
      continue;
    }
    for (const Extent& g : gaps) kept.push_back(g);
  }
  plan.ranges = page_runs(std::move(kept), 0, UINTPTR_MAX, page_size);
  for (const Extent& r : plan.ranges) plan.bytes += r.end - r.begin;
  return plan;
}

std::vector<Extent> resident_runs(const Extent& range, const std::vector<unsigned char>& resident,
                                  std::size_t page_size, std::size_t max_gap) {
  std::vector<Extent> runs;
  const std::size_t pages = std::min<std::size_t>(resident.size(), (range.end - range.begin) / page_size);
  for (std::size_t i = 0; i < pages;) {
    if ((resident[i] & 1U) == 0) {
      ++i;
      continue;
    }
    std::size_t j = i;
    while (j < pages && (resident[j] & 1U) != 0) ++j;
    const Extent run{range.begin + i * page_size, range.begin + j * page_size};
    if (!runs.empty() && run.begin - runs.back().end <= max_gap * page_size) runs.back().end = run.end;
    else runs.push_back(run);
    i = j;
  }
  return runs;
}

std::vector<Extent> runs_to_hold(std::vector<Extent> runs, std::size_t max_runs, std::uint64_t max_bytes) {
  std::stable_sort(runs.begin(), runs.end(),
                   [](const Extent& a, const Extent& b) { return a.end - a.begin < b.end - b.begin; });
  std::vector<Extent> kept;
  std::uint64_t bytes = 0;
  for (const Extent& r : runs) {
    if (kept.size() == max_runs || bytes + (r.end - r.begin) > max_bytes) break;
    kept.push_back(r);
    bytes += r.end - r.begin;
  }
  std::sort(kept.begin(), kept.end(), [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
  return kept;
}

void EngineMemory::snapshot(const std::vector<Extent>& held, const EngineOwned& owned, const char* why) noexcept {
  try {
    // One batch for the old pieces and the new: an old piece that waited over the wired limit
    // (and may be unmapped since) is never wired because another one left room.
    const auto t0 = std::chrono::steady_clock::now();
    Batch batch = manager_->batch();
    unregister();
    const std::size_t page = system_page_size();
    const std::vector<MapsEntry> maps = parse_maps(read_own_maps());
    const MemoryPlan plan = plan_engine_memory(maps, held, owned, page, kMaxMapping);
    std::vector<Extent> runs;
    std::vector<unsigned char> vec;
    for (const Extent& r : plan.ranges) {
      vec.assign((r.end - r.begin) / page, 0);
      if (::mincore(reinterpret_cast<void*>(r.begin), r.end - r.begin, vec.data()) != 0) continue;  // unmapped since
      for (const Extent& run : resident_runs(r, vec, page, kMaxGapPages)) runs.push_back(run);
    }
    std::uint64_t found_bytes = 0;
    for (const Extent& r : runs) found_bytes += r.end - r.begin;
    const std::size_t found = runs.size();
    runs = runs_to_hold(std::move(runs), kMaxRuns, kMaxBytes);
    // What each held run is, by the mapping it lies in (maps and runs are sorted).
    std::uint64_t stacks = 0, data = 0, made = 0;
    std::size_t at = 0;
    for (const Extent& r : runs) {
      if (!pieces_.add(r.begin, r.end, RegionClass::scratch, /*owner=*/1)) continue;
      bytes_ += r.end - r.begin;
      while (at < maps.size() && maps[at].end <= r.begin) ++at;
      const MapsEntry* m = at < maps.size() && maps[at].begin <= r.begin ? &maps[at] : nullptr;
      if (m != nullptr && is_engine_data(*m)) data += r.end - r.begin;
      else if (m != nullptr && holds_a_point(*m, owned.stack_points)) stacks += r.end - r.begin;
      else made += r.end - r.begin;
    }
    char took[32];
    std::snprintf(took, sizeof took, "%.2f ms",
                  std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    std::string line = "engine memory: " + format_size(bytes_) + " in " + std::to_string(runs.size()) +
                       " range(s), registered with the model: " + format_size(stacks) + " of the " +
                       std::to_string(owned.stack_points.size()) + " live thread stack(s) the engine ran on, " +
                       format_size(made) + " the engine mapped or grew of the heap inside its calls, " +
                       format_size(data) + " of its libraries' data (" + why + "; " + took + ")";
    if (found > runs.size()) {
      std::uint64_t kept_bytes = 0;
      for (const Extent& r : runs) kept_bytes += r.end - r.begin;
      line += "; " + std::to_string(found - runs.size()) + " larger range(s), " + format_size(found_bytes - kept_bytes) +
              ", left out (at most " + std::to_string(kMaxRuns) + " ranges and " + format_size(kMaxBytes) + ")";
    }
    if (plan.left_out > 0)
      line += "; " + format_size(plan.left_out) + " of anonymous mappings over " + format_size(kMaxMapping) +
              " left out";
    // Said whenever it grows past what was said before (what is held is bounded, and never silent).
    if (bytes_ > said_bytes_) {
      said_bytes_ = bytes_;
      log_->info(line);
    } else {
      log_->debug(line);
    }
  } catch (...) {
    // Out of memory: what was registered stays.
  }
}

void EngineMemory::unregister() noexcept {
  if (bytes_ == 0) return;
  bytes_ = 0;
  try {
    Batch batch = manager_->batch();  // as in snapshot(): nothing of it is wired on the way out
    pieces_.remove_owner(1);
  } catch (...) {
    pieces_.remove_owner(1);
  }
}

}  // namespace residency::preload
