// SPDX-License-Identifier: MIT
#include "backends/cuda/device_link.hpp"

#include <cinttypes>
#include <cstdio>

namespace residency::cuda {

Status DeviceLink::sync() const {
  Status first;
  for (CUstream s : streams) {
    const CUresult r = d->cuStreamSynchronize(s);
    if (r != CUDA_SUCCESS && first) first = d->error(r, "waiting for copies", "cuStreamSynchronize");
  }
  return first;
}

std::string hex(std::uintptr_t p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%" PRIxPTR, p);
  return buf;
}

std::size_t round_up(std::size_t v, std::size_t unit) { return (v + unit - 1) / unit * unit; }

CUmemAllocationProp device_prop(CUdevice dev) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = static_cast<int>(dev);
  return prop;
}

std::string device_uuid(const Driver& d, CUdevice dev) {
  std::string uuid;
  CUuuid u{};
  if (d.cuDeviceGetUuid != nullptr && d.cuDeviceGetUuid(&u, dev) == CUDA_SUCCESS) {
    static constexpr char kHex[] = "0123456789abcdef";
    uuid = "GPU-";
    for (int i = 0; i < 16; ++i) {
      if (i == 4 || i == 6 || i == 8 || i == 10) uuid += '-';
      const auto byte = static_cast<unsigned char>(u.bytes[i]);
      uuid += kHex[byte >> 4];
      uuid += kHex[byte & 15];
    }
  }
  return uuid;
}

}  // namespace residency::cuda
