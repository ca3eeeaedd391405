// SPDX-License-Identifier: MIT
#include "platform/symbol_lookup.hpp"

#include <dlfcn.h>
#include <link.h>

#include <cstddef>

namespace residency::platform {

const void* object_base(const void* addr) noexcept {
  Dl_info info{};
  return addr != nullptr && ::dladdr(addr, &info) != 0 ? info.dli_fbase : nullptr;
}

namespace {

bool in_object_of(const void* p, const void* self) noexcept {
  const void* base = object_base(p);
  return base != nullptr && base == object_base(self);
}

}  // namespace

void* find_in_object(const char* path, const char* name, const void* self) noexcept {
  if (path == nullptr || *path == '\0') return nullptr;
  void* handle = ::dlopen(path, RTLD_NOLOAD | RTLD_LAZY);
  if (handle == nullptr) return nullptr;
  void* f = ::dlsym(handle, name);
  if (f == nullptr || in_object_of(f, self)) {
    ::dlclose(handle);  // not here: the reference we took goes back
    return nullptr;
  }
  return f;
}

void* find_near(const char* name, const void* near, const void* self) noexcept {
  Dl_info info{};
  if (near == nullptr || ::dladdr(near, &info) == 0 || info.dli_fbase == object_base(self)) return nullptr;
  return find_in_object(info.dli_fname, name, self);
}

// dlopen cannot run inside dl_iterate_phdr's callback, which holds the loader's lock: the names are
// collected first.
void* find_anywhere(const char* name, const void* self) noexcept {
  constexpr int kMaxObjects = 512;
  struct Names {
    const char* path[kMaxObjects];
    int n = 0;
  } names;
  ::dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t, void* data) -> int {
        auto& v = *static_cast<Names*>(data);
        if (info->dlpi_name != nullptr && info->dlpi_name[0] != '\0' && v.n < kMaxObjects)
          v.path[v.n++] = info->dlpi_name;
        return 0;
      },
      &names);
  for (int i = 0; i < names.n; ++i)
    if (void* f = find_in_object(names.path[i], name, self)) return f;
  return nullptr;
}

}  // namespace residency::platform
