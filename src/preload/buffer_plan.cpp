// SPDX-License-Identifier: MIT
#include "buffer_plan.hpp"

#include <unistd.h>

#include <algorithm>

namespace residency::preload {

namespace {

std::uintptr_t round_down(std::uintptr_t v, std::size_t page) noexcept { return v & ~(std::uintptr_t{page} - 1); }
std::uintptr_t round_up(std::uintptr_t v, std::size_t page) noexcept {
  const std::uintptr_t r = round_down(v + page - 1, page);
  return r < v ? round_down(UINTPTR_MAX, page) : r;  // no wrap at the top of the address space
}

}  // namespace

std::size_t system_page_size() noexcept {
  static const std::size_t page = [] {
    const long p = ::sysconf(_SC_PAGESIZE);
    return p > 0 ? static_cast<std::size_t>(p) : std::size_t{4096};
  }();
  return page;
}

bool is_cpu_memory(DeviceKind device) noexcept {
  return device == DeviceKind::none || device == DeviceKind::cpu || device == DeviceKind::accel;
}

RegionClass class_of(BufferUsage usage) noexcept {
  switch (usage) {
    case BufferUsage::weights: return RegionClass::weights;
    case BufferUsage::compute: return RegionClass::scratch;
    case BufferUsage::any: break;
  }
  return RegionClass::kv_cache;
}

std::vector<Extent> page_runs(std::vector<Extent> extents, std::uintptr_t clip_begin, std::uintptr_t clip_end,
                              std::size_t page_size) {
  const std::uintptr_t lo = round_down(clip_begin, page_size), hi = round_up(clip_end, page_size);
  std::vector<Extent> out;
  for (Extent& e : extents) {
    e.begin = std::max(round_down(e.begin, page_size), lo);
    e.end = std::min(round_up(e.end, page_size), hi);
  }
  extents.erase(std::remove_if(extents.begin(), extents.end(), [](const Extent& e) { return e.end <= e.begin; }),
                extents.end());
  std::sort(extents.begin(), extents.end(), [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
  for (const Extent& e : extents) {
    if (!out.empty() && e.begin <= out.back().end) {
      out.back().end = std::max(out.back().end, e.end);
    } else {
      out.push_back(e);
    }
  }
  return out;
}

std::vector<Extent> page_gaps(std::uintptr_t begin, std::uintptr_t end, const std::vector<Extent>& runs,
                              std::size_t page_size) {
  std::vector<Extent> out;
  auto emit = [&](std::uintptr_t b, std::uintptr_t e) {
    b = round_up(b, page_size);
    e = round_down(e, page_size);
    if (b < e) out.push_back({b, e});
  };
  std::uintptr_t at = begin;
  for (const Extent& r : runs) {
    if (r.end <= at) continue;
    if (r.begin >= end) break;
    if (r.begin > at) emit(at, r.begin);
    at = std::max(at, r.end);
  }
  if (at < end) emit(at, end);
  return out;
}

BufferPlan plan_buffer(const BufferFacts& f, std::size_t page_size) {
  BufferPlan p;
  p.cls = class_of(f.usage);
  if (f.size == 0) {
    p.not_managed = "empty";
    return p;
  }
  if (!is_cpu_memory(f.device)) {
    p.not_managed = f.is_host ? "pinned host memory of a GPU: its driver keeps it resident for the buffer's life"
                              : "device memory";
    p.worth_a_line = f.is_host;  // device memory is the session's device side (engine_session.hpp)
    return p;
  }
  const std::uintptr_t end = f.base + f.size < f.base ? UINTPTR_MAX : f.base + f.size;
  if (f.from_ptr) {
    p.ranges = page_runs(f.tensors, f.base, end, page_size);
    if (p.ranges.empty()) {
      p.not_managed = "no tensor placed in it";
      p.worth_a_line = true;
    }
  } else {
    p.ranges = {Extent{f.base, end}};  // exact: two heap buffers may share a page
  }
  for (const Extent& r : p.ranges) p.registered_bytes += r.end - r.begin;
  return p;
}

}  // namespace residency::preload
