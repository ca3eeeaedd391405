// libresidency_preload.so's exported symbols, the only ones it exports (exports.map): the
// functions it interposes. Each forwards to the session (preload_session.hpp); nothing here
// decides anything.
#include <sys/mman.h>

#include <cstddef>
#include <cstdint>

#include <llama.h>

#include "preload_session.hpp"

#define RESIDENCY_PRELOAD_EXPORT __attribute__((visibility("default")))

using residency::preload::Entry;

extern "C" {

RESIDENCY_PRELOAD_EXPORT void* mmap(void* addr, std::size_t len, int prot, int flags, int fd, off_t off) noexcept {
  return residency::preload::map_hook(addr, len, prot, flags, fd, off, false);
}

#if defined(__GLIBC__)
RESIDENCY_PRELOAD_EXPORT void* mmap64(void* addr, std::size_t len, int prot, int flags, int fd, off64_t off) noexcept {
  return residency::preload::map_hook(addr, len, prot, flags, fd, off, true);
}
#endif

RESIDENCY_PRELOAD_EXPORT int munmap(void* addr, std::size_t len) noexcept {
  return residency::preload::unmap_hook(addr, len);
}

RESIDENCY_PRELOAD_EXPORT std::int32_t llama_decode(llama_context* ctx, llama_batch batch) {
  return residency::preload::decode_hook(Entry::decode, ctx, batch);
}

RESIDENCY_PRELOAD_EXPORT std::int32_t llama_encode(llama_context* ctx, llama_batch batch) {
  return residency::preload::decode_hook(Entry::encode, ctx, batch);
}

}  // extern "C"
