// SPDX-License-Identifier: MIT
#include "engine_code.hpp"

#include <elf.h>
#include <link.h>

#include <algorithm>

#include "residency/text.hpp"

namespace residency::preload {

namespace {

std::string_view file_name(std::string_view path) noexcept {
  const std::size_t slash = path.rfind('/');
  return slash == std::string_view::npos ? path : path.substr(slash + 1);
}

}  // namespace

bool is_engine_object(std::string_view path) noexcept {
  const std::string_view name = file_name(path);
  for (const std::string_view prefix :
       {"libllama", "libggml", "libgomp", "libresidency_preload", "libstdc++.", "libc.", "libc-", "libm.", "libm-"})
    if (name.substr(0, prefix.size()) == prefix) return true;
  return false;
}

CodePlan plan_engine_code(const std::vector<LoadedSegment>& segments, std::size_t page_size, std::uint64_t max_segment) {
  CodePlan plan;
  std::vector<Extent> kept;
  for (const LoadedSegment& s : segments) {
    if (s.writable || s.end <= s.begin || !is_engine_object(s.object)) continue;
    const std::vector<Extent> pages = page_runs({{s.begin, s.end}}, s.begin, s.end, page_size);
    if (pages.empty()) continue;  // the last page of the address space: nothing a library maps
    const std::uint64_t size = pages.front().end - pages.front().begin;
    if (size > max_segment) {
      plan.left_out += size;
      continue;
    }
    kept.push_back(pages.front());
    const std::string name(file_name(s.object));
    if (std::find(plan.objects.begin(), plan.objects.end(), name) == plan.objects.end()) plan.objects.push_back(name);
  }
  plan.ranges = page_runs(std::move(kept), 0, UINTPTR_MAX, page_size);
  for (const Extent& r : plan.ranges) plan.bytes += r.end - r.begin;
  return plan;
}

std::vector<LoadedSegment> loaded_segments() {
  std::vector<LoadedSegment> out;
  ::dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t, void* data) -> int {
        auto& v = *static_cast<std::vector<LoadedSegment>*>(data);
        try {
          for (ElfW(Half) i = 0; i < info->dlpi_phnum; ++i) {
            const ElfW(Phdr)& ph = info->dlpi_phdr[i];
            if (ph.p_type != PT_LOAD || ph.p_memsz == 0) continue;
            LoadedSegment s;
            s.object = info->dlpi_name != nullptr ? info->dlpi_name : "";
            s.begin = static_cast<std::uintptr_t>(info->dlpi_addr + ph.p_vaddr);
            s.end = s.begin + static_cast<std::uintptr_t>(ph.p_memsz);
            s.writable = (ph.p_flags & PF_W) != 0;
            v.push_back(std::move(s));
          }
        } catch (...) {
          return 1;  // out of memory: stop with what was listed
        }
        return 0;
      },
      &out);
  return out;
}

void EngineCode::register_once() noexcept {
  if (registered_) return;
  registered_ = true;
  try {
    const CodePlan plan = plan_engine_code(loaded_segments(), system_page_size(), kMaxSegment);
    std::uint64_t placed = 0;
    for (const Extent& r : plan.ranges)
      if (pieces_.add(r.begin, r.end, RegionClass::weights, /*owner=*/1)) placed += r.end - r.begin;
    if (placed == 0) return;
    std::string names;
    for (const std::string& o : plan.objects) names += (names.empty() ? "" : ", ") + o;
    std::string line = "engine code: " + format_size(placed) + " in " + std::to_string(plan.ranges.size()) +
                       " read-only range(s) of " + names +
                       ", registered with the model (a decode executes and reads it)";
    if (plan.left_out > 0)
      line += "; " + format_size(plan.left_out) + " of larger read-only segments left out (GPU device code)";
    log_->info(line);
  } catch (...) {
  }
}

void EngineCode::unregister() noexcept {
  if (!registered_) return;
  registered_ = false;
  pieces_.remove_owner(1);
}

}  // namespace residency::preload
