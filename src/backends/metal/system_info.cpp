// SPDX-License-Identifier: MIT
// macOS memory figures: see system_info.hpp and residency/backends/metal.hpp.
#include "backends/metal/system_info.hpp"

#include <mach/mach.h>
#include <sys/sysctl.h>

#include <cerrno>
#include <cstring>

#include "residency/backends/metal.hpp"

namespace residency {
namespace metal {

std::optional<std::int64_t> read_sysctl_integer(const char* name, std::string* why) {
  unsigned char buf[8] = {0};
  std::size_t len = sizeof buf;
  if (sysctlbyname(name, buf, &len, nullptr, 0) != 0) {
    if (why != nullptr) *why = std::string("sysctl ") + name + ": " + std::strerror(errno);
    return std::nullopt;
  }
  if (len == 4) {
    std::int32_t v = 0;
    std::memcpy(&v, buf, 4);
    return v;
  }
  if (len == 8) {
    std::int64_t v = 0;
    std::memcpy(&v, buf, 8);
    return v;
  }
  if (why != nullptr) *why = std::string("sysctl ") + name + " has " + std::to_string(len) + " bytes, not an integer";
  return std::nullopt;
}

std::optional<PressureLevel> read_memory_pressure_level() {
  const auto v = read_sysctl_integer("kern.memorystatus_vm_pressure_level");
  if (!v) return std::nullopt;
  switch (*v) {
    case 1: return PressureLevel::normal;
    case 2: return PressureLevel::warn;
    case 4: return PressureLevel::critical;
    default: return std::nullopt;
  }
}

}  // namespace metal

std::optional<std::uint64_t> apple_wired_bytes(std::string* why) {
  const mach_port_t host = mach_host_self();
  vm_size_t page = 0;
  vm_statistics64_data_t vm{};
  mach_msg_type_number_t count = HOST_VM_INFO64_COUNT;
  const kern_return_t kp = host_page_size(host, &page);
  const kern_return_t ks = host_statistics64(host, HOST_VM_INFO64, reinterpret_cast<host_info64_t>(&vm), &count);
  (void)mach_port_deallocate(mach_task_self(), host);
  if (kp != KERN_SUCCESS || ks != KERN_SUCCESS || page == 0) {
    if (why != nullptr) {
      *why = "host_statistics64(HOST_VM_INFO64) / host_page_size failed (kern_return_t " +
             std::to_string(ks != KERN_SUCCESS ? ks : kp) + ")";
    }
    return std::nullopt;
  }
  return static_cast<std::uint64_t>(vm.wire_count) * static_cast<std::uint64_t>(page);
}

AppleSystemInfo read_apple_system_info() {
  AppleSystemInfo info;
  std::string why;
  if (auto v = metal::read_sysctl_integer("hw.memsize", &why); v && *v > 0) {
    info.physical = static_cast<std::uint64_t>(*v);
  } else {
    info.problems.push_back(why);
  }
  if (auto w = apple_wired_bytes(&why)) {
    info.wired = *w;
  } else {
    info.problems.push_back(why);
  }
  // macOS 14 and later; before, the same knob was debug.iogpu.wired_limit (bytes).
  if (auto v = metal::read_sysctl_integer("iogpu.wired_limit_mb", &why)) {
    info.iogpu_wired_limit_mb = *v;
  } else {
    info.problems.push_back(why + " (macOS 14 and later have it; before, debug.iogpu.wired_limit)");
  }
  if (auto v = metal::read_sysctl_integer("iogpu.disable_wired_collector", &why)) {
    info.iogpu_disable_wired_collector = *v;
  } else {
    info.problems.push_back(why);
  }
  if (auto level = metal::read_memory_pressure_level()) {
    info.pressure_level = metal::to_string(*level);
  } else {
    info.problems.push_back("sysctl kern.memorystatus_vm_pressure_level: unreadable or an unknown level");
  }
  return info;
}

}  // namespace residency
