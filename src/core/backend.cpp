// SPDX-License-Identifier: MIT
// Defaults of the Backend interface's optional methods.
#include "residency/backend.hpp"

namespace residency {

Result<void*> Backend::allocate(std::size_t, RegionClass) {
  return Status(ErrorCode::unsupported, capabilities().name +
                                            " backend does not allocate memory; register memory you "
                                            "allocated with register_region() instead");
}
void Backend::deallocate(void*) {}
SetOutcome Backend::refresh(SetId set) { return request_residency(set); }
void Backend::after_release() {}
Status Backend::reserve_wired(std::uint64_t) { return Status::ok(); }
void Backend::unreserve_wired(std::uint64_t) {}
Result<PressureWatchId> Backend::watch_pressure(std::function<void()>) {
  return Status(ErrorCode::unsupported, capabilities().name + " backend cannot watch memory pressure");
}
void Backend::stop_pressure_watch(PressureWatchId) {}
std::string Backend::pressure_source() const { return {}; }

std::optional<std::uint64_t> Backend::memory_available() { return std::nullopt; }
std::uint64_t Backend::pinned_host_bytes() const { return 0; }
void Backend::track_writes(void* /*base*/) {}
void Backend::written(const void* /*addr*/, std::size_t /*bytes*/) {}
void Backend::filled_from_file(const void* addr, std::size_t bytes, int /*fd*/, std::uint64_t /*offset*/) {
  written(addr, bytes);
}
std::uint64_t Backend::file_backed_bytes() const { return 0; }
std::uint64_t Backend::registered_file_bytes() const { return 0; }
void Backend::interrupt_release() {}
void Backend::set_wake_gate(WakeGate) {}
Backend::Preparation Backend::prepare_release(std::function<bool()>) { return Preparation::nothing; }
void Backend::stop_preparation() {}
std::uint64_t Backend::unmanaged_device_bytes() { return 0; }
void Backend::set_host_gate(HostGate) {}
std::uint64_t Backend::drop_file_registrations() { return 0; }

}  // namespace residency
