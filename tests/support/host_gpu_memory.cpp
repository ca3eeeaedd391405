// SPDX-License-Identifier: MIT
// HostGpu's device memory, host registrations and copies (host_gpu.hpp says how each is emulated).
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "support/host_gpu_state.hpp"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14; older headers lack the names
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace residency::cuda::testing::host_gpu {
namespace {

void* at(CUdeviceptr p) { return reinterpret_cast<void*>(static_cast<std::uintptr_t>(p)); }

// Whether [p, p + n) is mapped throughout, with at least `prot` access.
bool device_ok(const State& s, CUdeviceptr p, std::size_t n, int prot) {
  auto it = s.mappings.upper_bound(p);
  if (it == s.mappings.begin()) return false;
  --it;
  for (CUdeviceptr cur = p; cur < p + n; ++it) {
    if (it == s.mappings.end() || it->first > cur || it->first + it->second.size <= cur) return false;
    if ((it->second.prot & prot) != prot) return false;
    cur = it->first + it->second.size;
  }
  return true;
}

bool overlaps_registration(const State& s, std::uintptr_t p, std::size_t n) {
  auto it = s.registrations.lower_bound(p);
  if (it != s.registrations.end() && it->first < p + n) return true;
  if (it == s.registrations.begin()) return false;
  --it;
  return it->first + it->second.size > p;
}

void free_physical(State& s, CUmemGenericAllocationHandle h) {
  auto it = s.physical.find(h);
  if (it == s.physical.end() || !it->second.released || it->second.mappings > 0) return;
  const Physical& p = it->second;
  if (s.spare_bytes + p.size <= s.config.capacity) {
    s.spare.emplace(p.size, p.fd);
    s.spare_bytes += p.size;
  } else {
    (void)close(p.fd);
  }
  s.used -= p.size;
  s.physical.erase(it);
}

// A memfd of `size` bytes filled with kPoison, as fresh device memory holds whatever it held
// (never zeros to rely on): a spare one if there is, else a new one. -1 if none can be made.
constexpr unsigned char kPoison = 0xa5;
int make_physical(State& s, std::size_t size) {
  int fd = -1;
  if (auto it = s.spare.find(size); it != s.spare.end()) {
    fd = it->second;
    s.spare.erase(it);
    s.spare_bytes -= size;
  } else {
    fd = memfd_create("host_gpu", MFD_CLOEXEC);
    if (fd < 0) return -1;
    if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
      (void)close(fd);
      return -1;
    }
  }
  // Written, not mapped and set: no page faults (each costs more than its page's copy on a VM).
  static const std::vector<char> poison(std::size_t{2} << 20, static_cast<char>(kPoison));
  for (std::size_t at = 0; at < size;) {
    const ssize_t n = pwrite(fd, poison.data(), std::min(poison.size(), size - at), static_cast<off_t>(at));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      (void)close(fd);
      return -1;
    }
    at += static_cast<std::size_t>(n);
  }
  return fd;
}

// Back to a bare reservation: no access, no memory behind it.
void unmap_locked(State& s, std::map<CUdeviceptr, Mapping>::iterator it) {
  (void)mmap(at(it->first), it->second.size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  const CUmemGenericAllocationHandle h = it->second.handle;
  s.mappings.erase(it);
  if (auto p = s.physical.find(h); p != s.physical.end()) --p->second.mappings;
  free_physical(s, h);
}

bool aligned(const State& s, std::uint64_t v) { return v % s.config.granularity == 0; }

// Whether the kernel has MADV_POPULATE_READ/WRITE (Linux 5.14): asked once, on memory that takes it.
bool can_populate() {
  static const bool yes = [] {
    const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    void* m = mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return false;
    const bool ok = madvise(m, page, MADV_POPULATE_WRITE) == 0;
    (void)munmap(m, page);
    return ok;
  }();
  return yes;
}

// Faults a registration's pages in as the driver pins them: for reading where it is read-only
// (a file mapping), for writing otherwise, which memory that is not mapped, or mapped read-only,
// refuses (as the driver does). 0, or the errno. Without MADV_POPULATE_* nothing is checked.
int pin_pages(void* p, std::size_t n, bool read_only) {
  if (!can_populate()) return 0;
  const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const std::uintptr_t b = reinterpret_cast<std::uintptr_t>(p) / page * page;
  const std::uintptr_t e = (reinterpret_cast<std::uintptr_t>(p) + n + page - 1) / page * page;
  for (;;) {
    if (madvise(reinterpret_cast<void*>(b), e - b, read_only ? MADV_POPULATE_READ : MADV_POPULATE_WRITE) == 0) return 0;
    if (errno != EINTR && errno != EAGAIN) return errno;
  }
}

}  // namespace

const Registration* registration_of(const State& s, std::uintptr_t p, std::size_t n) {
  auto it = s.registrations.upper_bound(p);
  if (it == s.registrations.begin()) return nullptr;
  --it;
  return p >= it->first && p + n <= it->first + it->second.size ? &it->second : nullptr;
}

void release_memory(State& s) {
  while (!s.mappings.empty()) unmap_locked(s, s.mappings.begin());
  for (auto& [base, size] : s.reservations) (void)munmap(at(base), size);
  for (auto& [h, p] : s.physical) (void)close(p.fd);
  for (auto& [size, fd] : s.spare) (void)close(fd);
  for (auto& [base, r] : s.registrations)
    if (r.host_alloc) (void)munmap(reinterpret_cast<void*>(base), r.size);
  s.reservations.clear();
  s.physical.clear();
  s.spare.clear();
  s.spare_bytes = 0;
  s.used = 0;
  s.registrations.clear();
  s.allocs.clear();
}

CUresult CUDAAPI host_cuMemGetInfo(std::size_t* free_b, std::size_t* total_b) {
  if (free_b == nullptr || total_b == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!has_context()) return CUDA_ERROR_INVALID_CONTEXT;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  *total_b = s.config.capacity;
  *free_b = s.config.capacity - s.used;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuMemAddressReserve(CUdeviceptr* ptr, std::size_t size, std::size_t alignment, CUdeviceptr,
                                          unsigned long long flags) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (ptr == nullptr || size == 0 || !aligned(s, size) || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  const std::size_t align = std::max(alignment, s.config.granularity);
  void* raw = mmap(nullptr, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  const auto r = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t base = (r + align - 1) / align * align;
  if (base > r) (void)munmap(raw, base - r);
  if (r + size + align > base + size)
    (void)munmap(reinterpret_cast<void*>(base + size), r + size + align - base - size);
  s.reservations[base] = size;
  *ptr = base;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuMemAddressFree(CUdeviceptr ptr, std::size_t size) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.reservations.find(ptr);
  if (it == s.reservations.end() || it->second != size) return CUDA_ERROR_INVALID_VALUE;
  auto m = s.mappings.lower_bound(ptr);
  if (m != s.mappings.end() && m->first < ptr + size) return CUDA_ERROR_INVALID_VALUE;  // still mapped
  (void)munmap(at(ptr), size);
  s.reservations.erase(it);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuMemCreate(CUmemGenericAllocationHandle* h, std::size_t size, const CUmemAllocationProp* prop,
                                  unsigned long long flags) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (h == nullptr || prop == nullptr || size == 0 || !aligned(s, size) || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
    return CUDA_ERROR_INVALID_VALUE;
  if (prop->location.id != 0) return CUDA_ERROR_INVALID_DEVICE;
  if (s.used + size > s.config.capacity) return CUDA_ERROR_OUT_OF_MEMORY;
  const int fd = make_physical(s, size);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *h = s.next_handle++;
  s.physical[*h] = Physical{fd, size, 0, false};
  s.used += size;
  ++s.counters.mem_creates;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuMemRelease(CUmemGenericAllocationHandle h) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.physical.find(h);
  if (it == s.physical.end() || it->second.released) return CUDA_ERROR_INVALID_VALUE;
  it->second.released = true;
  free_physical(s, h);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuMemMap(CUdeviceptr ptr, std::size_t size, std::size_t offset, CUmemGenericAllocationHandle h,
                               unsigned long long flags) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto p = s.physical.find(h);
  if (p == s.physical.end() || p->second.released || flags != 0 || size == 0 || !aligned(s, ptr) || !aligned(s, size) ||
      !aligned(s, offset) || offset + size > p->second.size)
    return CUDA_ERROR_INVALID_VALUE;
  auto r = s.reservations.upper_bound(ptr);  // the reservation must hold the whole range
  if (r == s.reservations.begin()) return CUDA_ERROR_INVALID_VALUE;
  --r;
  if (ptr + size > r->first + r->second) return CUDA_ERROR_INVALID_VALUE;
  auto m = s.mappings.upper_bound(ptr);  // and nothing of it be mapped already
  if (m != s.mappings.end() && m->first < ptr + size) return CUDA_ERROR_INVALID_VALUE;
  if (m != s.mappings.begin() && std::prev(m)->first + std::prev(m)->second.size > ptr) return CUDA_ERROR_INVALID_VALUE;
  if (mmap(at(ptr), size, PROT_NONE, MAP_SHARED | MAP_FIXED, p->second.fd, static_cast<off_t>(offset)) == MAP_FAILED)
    return CUDA_ERROR_OUT_OF_MEMORY;
  s.mappings[ptr] = Mapping{size, h, PROT_NONE};
  ++p->second.mappings;
  ++s.counters.maps;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuMemUnmap(CUdeviceptr ptr, std::size_t size) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  // Whole mappings only, one after the other from ptr to ptr + size.
  auto it = s.mappings.find(ptr);
  for (CUdeviceptr cur = ptr; cur < ptr + size;) {
    auto m = s.mappings.find(cur);
    if (m == s.mappings.end() || cur + m->second.size > ptr + size) return CUDA_ERROR_INVALID_VALUE;
    cur += m->second.size;
  }
  if (it == s.mappings.end()) return CUDA_ERROR_INVALID_VALUE;
  while (it != s.mappings.end() && it->first < ptr + size) {
    auto next = std::next(it);
    unmap_locked(s, it);
    it = next;
  }
  ++s.counters.unmaps;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuMemSetAccess(CUdeviceptr ptr, std::size_t size, const CUmemAccessDesc* desc, std::size_t count) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (desc == nullptr || count == 0 || size == 0) return CUDA_ERROR_INVALID_VALUE;
  if (desc[0].location.type != CU_MEM_LOCATION_TYPE_DEVICE || desc[0].location.id != 0)
    return CUDA_ERROR_INVALID_DEVICE;
  int prot = PROT_NONE;
  if (desc[0].flags == CU_MEM_ACCESS_FLAGS_PROT_READ) prot = PROT_READ;
  else if (desc[0].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE) prot = PROT_READ | PROT_WRITE;
  else if (desc[0].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE) return CUDA_ERROR_INVALID_VALUE;
  // Whole mappings, one after the other.
  for (CUdeviceptr cur = ptr; cur < ptr + size;) {
    auto m = s.mappings.find(cur);
    if (m == s.mappings.end() || cur + m->second.size > ptr + size) return CUDA_ERROR_INVALID_VALUE;
    cur += m->second.size;
  }
  for (auto m = s.mappings.find(ptr); m != s.mappings.end() && m->first < ptr + size; ++m) {
    if (mprotect(at(m->first), m->second.size, prot) != 0) return CUDA_ERROR_UNKNOWN;
    m->second.prot = prot;
  }
  // Device memory is there once mapped: its page tables are filled now, in one call, rather than
  // by a fault per page at the first copy.
  if (prot != PROT_NONE && can_populate())
    (void)madvise(at(ptr), size, (prot & PROT_WRITE) != 0 ? MADV_POPULATE_WRITE : MADV_POPULATE_READ);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuMemGetAllocationGranularity(std::size_t* g, const CUmemAllocationProp* prop,
                                                    CUmemAllocationGranularity_flags) {
  if (g == nullptr || prop == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop->location.id != 0) return CUDA_ERROR_INVALID_DEVICE;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  *g = s.config.granularity;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuMemHostRegister(void* p, std::size_t size, unsigned int flags) {
  if (!has_context()) return CUDA_ERROR_INVALID_CONTEXT;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (p == nullptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
  const HostGpu::RegisterFault& f = s.fault;
  if (s.faulting && (flags & f.flags) == f.flags && size > f.over_bytes) {
    ++s.fault_seen;
    if (f.nth == 0 || s.fault_seen == f.nth) {
      ++s.counters.failed_registrations;
      return f.result;
    }
  }
  const auto b = reinterpret_cast<std::uintptr_t>(p);
  if (overlaps_registration(s, b, size)) {
    ++s.counters.failed_registrations;
    return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
  }
  const bool read_only = (flags & CU_MEMHOSTREGISTER_READ_ONLY) != 0;
  if (pin_pages(p, size, read_only) != 0) {  // not mapped, or read-only where a writable pin was asked
    ++s.counters.failed_registrations;
    return CUDA_ERROR_INVALID_VALUE;
  }
  s.registrations[b] = Registration{size, flags, false};
  ++s.counters.registrations;
  if (read_only) ++s.counters.read_only_registrations;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuMemHostUnregister(void* p) {
  if (!has_context()) return CUDA_ERROR_INVALID_CONTEXT;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.registrations.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == s.registrations.end() || it->second.host_alloc) return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
  s.registrations.erase(it);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuMemHostAlloc(void** pp, std::size_t size, unsigned int flags) {
  if (pp == nullptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
  if (!has_context()) return CUDA_ERROR_INVALID_CONTEXT;
  void* m = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.registrations[reinterpret_cast<std::uintptr_t>(m)] = Registration{size, flags, true};
  *pp = m;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuMemFreeHost(void* p) {
  if (!has_context()) return CUDA_ERROR_INVALID_CONTEXT;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.registrations.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == s.registrations.end() || !it->second.host_alloc) return CUDA_ERROR_INVALID_VALUE;
  (void)munmap(p, it->second.size);
  s.registrations.erase(it);
  return CUDA_SUCCESS;
}

// cuMemAlloc is cuMemAddressReserve + cuMemCreate + cuMemMap + cuMemSetAccess of the size rounded
// up to the granularity, undone by cuMemFree.
CUresult CUDAAPI host_cuMemAlloc(CUdeviceptr* dptr, std::size_t bytes) {
  if (dptr == nullptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  if (!has_context()) return CUDA_ERROR_INVALID_CONTEXT;
  std::size_t g = 0;
  const CUmemAllocationProp prop = [] {
    CUmemAllocationProp p{};
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = 0;
    return p;
  }();
  (void)host_cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  const std::size_t size = (bytes + g - 1) / g * g;
  CUdeviceptr va = 0;
  CUmemGenericAllocationHandle h = 0;
  CUresult r = host_cuMemAddressReserve(&va, size, 0, 0, 0);
  if (r != CUDA_SUCCESS) return r;
  r = host_cuMemCreate(&h, size, &prop, 0);
  if (r == CUDA_SUCCESS) {
    r = host_cuMemMap(va, size, 0, h, 0);
    (void)host_cuMemRelease(h);  // freed with the mapping
  }
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (r == CUDA_SUCCESS) r = host_cuMemSetAccess(va, size, &access, 1);
  if (r != CUDA_SUCCESS) {
    (void)host_cuMemUnmap(va, size);
    (void)host_cuMemAddressFree(va, size);
    return r;
  }
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.allocs[va] = size;
  *dptr = va;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuMemFree(CUdeviceptr dptr) {
  if (!has_context()) return CUDA_ERROR_INVALID_CONTEXT;
  std::size_t size = 0;
  {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.allocs.find(dptr);
    if (it == s.allocs.end()) return CUDA_ERROR_INVALID_VALUE;
    size = it->second;
    s.allocs.erase(it);
  }
  (void)host_cuMemUnmap(dptr, size);
  return host_cuMemAddressFree(dptr, size);
}

// A copy between host memory and [dev, dev + n): checked, counted, done at once.
static CUresult copy_bytes(CUdeviceptr dev, void* host, std::size_t n, bool to_device, CUstream stream) {
  if (!has_context()) return CUDA_ERROR_INVALID_CONTEXT;
  State& s = state();
  HostGpu::CopyHook hook;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    hook = s.hook;
  }
  if (hook) hook(to_device, n);
  std::lock_guard<std::mutex> lock(s.mu);
  if (!stream_ok(s, stream)) return CUDA_ERROR_INVALID_HANDLE;
  if (host == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (n == 0) return CUDA_SUCCESS;
  if (!device_ok(s, dev, n, to_device ? PROT_WRITE : PROT_READ)) {
    ++s.counters.failed_copies;
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (registration_of(s, reinterpret_cast<std::uintptr_t>(host), n) == nullptr) {
    ++s.counters.pageable_copies;
    s.counters.pageable_bytes += n;
  }
  if (to_device) {
    std::memcpy(at(dev), host, n);
    ++s.counters.copies_to_device;
    s.counters.bytes_to_device += n;
  } else {
    std::memcpy(host, at(dev), n);
    ++s.counters.copies_to_host;
    s.counters.bytes_to_host += n;
  }
  return CUDA_SUCCESS;
}

CUresult CUDAAPI host_cuMemcpyHtoD(CUdeviceptr dst, const void* src, std::size_t n) {
  return copy_bytes(dst, const_cast<void*>(src), n, true, nullptr);
}
CUresult CUDAAPI host_cuMemcpyDtoH(void* dst, CUdeviceptr src, std::size_t n) {
  return copy_bytes(src, dst, n, false, nullptr);
}
CUresult CUDAAPI host_cuMemcpyHtoDAsync(CUdeviceptr dst, const void* src, std::size_t n, CUstream st) {
  return copy_bytes(dst, const_cast<void*>(src), n, true, st);
}
CUresult CUDAAPI host_cuMemcpyDtoHAsync(void* dst, CUdeviceptr src, std::size_t n, CUstream st) {
  return copy_bytes(src, dst, n, false, st);
}

CUresult CUDAAPI host_cuMemsetD8(CUdeviceptr dst, unsigned char v, std::size_t n) {
  if (!has_context()) return CUDA_ERROR_INVALID_CONTEXT;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (n == 0) return CUDA_SUCCESS;
  if (!device_ok(s, dst, n, PROT_WRITE)) {
    ++s.counters.failed_copies;
    return CUDA_ERROR_INVALID_VALUE;
  }
  std::memset(at(dst), v, n);
  return CUDA_SUCCESS;
}

}  // namespace residency::cuda::testing::host_gpu
