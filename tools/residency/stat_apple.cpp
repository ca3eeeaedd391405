// SPDX-License-Identifier: MIT
// residency stat on macOS; see stat_apple.hpp. Built where the metal backend is (an Apple build
// with RESIDENCY_METAL_CPP_DIR); compile-checked on Linux by scripts/metal-check.
#if RESIDENCY_TOOL_HAVE_METAL
#include "stat_apple.hpp"

#include <algorithm>
#include <cstdio>
#include <optional>
#include <utility>
#include <vector>

#include "command.hpp"
#include "json_text.hpp"
#include "residency/backends/metal.hpp"
#include "residency/config.hpp"
#include "residency/text.hpp"

namespace residency::tool {
namespace {

template <class T>
nlohmann::json or_null(const std::optional<T>& v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}

std::string wired_limit_text(const std::optional<std::int64_t>& mb) {
  if (!mb) return "unknown";
  if (*mb == 0) return "0 (the system's default)";
  return std::to_string(*mb) + " MiB (set with `sudo sysctl iogpu.wired_limit_mb=N`; 0 restores the default)";
}

std::string collector_text(const std::optional<std::int64_t>& v) {
  if (!v) return "unknown";
  if (*v == 0) return "0 (the collector unwires GPU memory about 1 s after its last use)";
  return std::to_string(*v) + " (the wired-memory collector is off)";
}

}  // namespace

int run_stat_apple(bool json, const std::string& backends_line, const nlohmann::json& backends) {
  const AppleSystemInfo sys = read_apple_system_info();
  const MetalDeviceInfo dev = read_metal_device_info();

  if (json) {
    nlohmann::json j;
    j["physical"] = or_null(sys.physical);
    j["wired"] = or_null(sys.wired);
    j["iogpu_wired_limit_mb"] = or_null(sys.iogpu_wired_limit_mb);
    j["iogpu_disable_wired_collector"] = or_null(sys.iogpu_disable_wired_collector);
    j["memory_pressure"] = or_null(sys.pressure_level);
    if (dev.found) {
      j["metal_device"] = {{"name", dev.name},
                           {"recommended_working_set", dev.recommended_working_set},
                           {"current_allocated", dev.current_allocated},
                           {"max_buffer_length", dev.max_buffer_length},
                           {"unified_memory", dev.unified_memory},
                           {"residency_sets", dev.residency_sets.available}};
      if (!dev.residency_sets.available) j["metal_device"]["residency_sets_reason"] = dev.residency_sets.reason;
    } else {
      j["metal_device"] = nullptr;
    }
    for (const auto& [k, v] : backends.items()) j[k] = v;
    j["problems"] = sys.problems;
    std::printf("%s\n", json_text(j).c_str());
    return kExitOk;
  }

  std::vector<std::pair<std::string, std::string>> rows;
  rows.emplace_back("physical memory", sys.physical ? format_size(*sys.physical) : "unknown");
  rows.emplace_back("wired (system)",
                    sys.wired ? format_size(*sys.wired) + " (host_statistics64 wire_count x page size, as `top -l 1`)"
                              : std::string("unknown"));
  rows.emplace_back("iogpu.wired_limit_mb", wired_limit_text(sys.iogpu_wired_limit_mb));
  rows.emplace_back("iogpu.disable_wired_collector", collector_text(sys.iogpu_disable_wired_collector));
  rows.emplace_back("memory pressure", sys.pressure_level ? *sys.pressure_level : std::string("unknown"));
  if (dev.found) {
    rows.emplace_back("Metal device", dev.name + (dev.unified_memory ? " (unified memory)" : ""));
    rows.emplace_back("recommended working set",
                      format_size(dev.recommended_working_set) + " (recommendedMaxWorkingSetSize)");
    rows.emplace_back("allocated (this process)", format_size(dev.current_allocated) + " (currentAllocatedSize)");
    rows.emplace_back("maxBufferLength", format_size(dev.max_buffer_length));
    rows.emplace_back("residency sets",
                      dev.residency_sets.available ? std::string("yes") : "no (" + dev.residency_sets.reason + ")");
  } else {
    rows.emplace_back("Metal device", "none (MTLCreateSystemDefaultDevice returned nil)");
  }
  rows.emplace_back("backends", backends_line);
  for (const auto& p : sys.problems) rows.emplace_back("note", p);

  std::size_t width = 0;
  for (const auto& [k, v] : rows) width = std::max(width, k.size());
  for (const auto& [k, v] : rows) std::printf("%-*s  %s\n", static_cast<int>(width), k.c_str(), v.c_str());
  return kExitOk;
}

}  // namespace residency::tool
#endif  // RESIDENCY_TOOL_HAVE_METAL
