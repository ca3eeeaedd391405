// SPDX-License-Identifier: MIT
#include "backends/cuda/vmm_range.hpp"

#include <algorithm>
#include <limits>

#include "residency/text.hpp"

namespace residency::cuda {

Status VmmRange::reserve(const DeviceLink& link, std::size_t bytes) {
  if (bytes > std::numeric_limits<std::size_t>::max() - link.granularity)
    return Status(ErrorCode::invalid_argument,
                  "cuda: allocation of " + std::to_string(bytes) + " bytes is larger than any address range");
  size = bytes;
  reserved = round_up(bytes, link.granularity);
  const CUresult r = link.d->cuMemAddressReserve(&va, reserved, link.granularity, 0, 0);
  if (r != CUDA_SUCCESS)
    return link.d->error(r, "reserving " + format_size(reserved) + " of device addresses", "cuMemAddressReserve");
  return {};
}

void VmmRange::free(const DeviceLink& link) {
  if (mapped) unmap(link);
  if (va != 0) (void)link.d->cuMemAddressFree(va, reserved);
  va = 0;
}

bool VmmRange::map(const DeviceLink& link, const BeforeChunk& before, const FillChunk& fill, MapFailure& failure) {
  const CUmemAllocationProp prop = device_prop(link.dev);
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = static_cast<int>(link.dev);
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const std::size_t n = link.chunks_of(reserved);
  chunks.clear();
  chunks.reserve(n);
  auto fail = [&](CUresult r, const char* call, std::size_t off) {
    failure = {r, call, off};
    unmap(link);
    return false;
  };
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t off = i * link.chunk;
    const std::size_t len = std::min(link.chunk, reserved - off);
    if (before) before(len);
    CUmemGenericAllocationHandle h = 0;
    CUresult r = link.d->cuMemCreate(&h, len, &prop, 0);
    if (r != CUDA_SUCCESS) return fail(r, "cuMemCreate", off);
    r = link.d->cuMemMap(va + off, len, 0, h, 0);
    if (r != CUDA_SUCCESS) {
      (void)link.d->cuMemRelease(h);
      return fail(r, "cuMemMap", off);
    }
    chunks.push_back(h);
    r = link.d->cuMemSetAccess(va + off, len, &access, 1);
    if (r != CUDA_SUCCESS) return fail(r, "cuMemSetAccess", off);
    if (fill) {
      r = fill(i, off, len);
      if (r != CUDA_SUCCESS) return fail(r, "cuMemcpyHtoDAsync", off);
    }
  }
  mapped = true;
  return true;
}

void VmmRange::unmap(const DeviceLink& link) {
  (void)link.sync();  // no copy may still target a chunk that goes away
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    const std::size_t off = i * link.chunk;
    (void)link.d->cuMemUnmap(va + off, std::min(link.chunk, reserved - off));
    (void)link.d->cuMemRelease(chunks[i]);
  }
  chunks.clear();
  mapped = false;
}

}  // namespace residency::cuda
