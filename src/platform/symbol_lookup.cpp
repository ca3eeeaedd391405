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

bool object_span(const void* addr, ObjectSpan& out) noexcept {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 35))
  dl_find_object found{};
  if (::_dl_find_object(const_cast<void*>(addr), &found) != 0 || found.dlfo_link_map == nullptr) return false;
  out.begin = reinterpret_cast<std::uintptr_t>(found.dlfo_map_start);
  out.end = reinterpret_cast<std::uintptr_t>(found.dlfo_map_end);
  out.path = found.dlfo_link_map->l_name;
  return out.begin < out.end;
#else
  Dl_info info{};
  if (::dladdr(addr, &info) == 0) return false;
  struct Ctx {
    const void* base;
    ObjectSpan* span;
  } ctx{info.dli_fbase, &out};
  out = ObjectSpan{0, 0, info.dli_fname};
  ::dl_iterate_phdr(
      [](dl_phdr_info* pi, std::size_t, void* data) -> int {
        auto& c = *static_cast<Ctx*>(data);
        bool mine = false;
        for (ElfW(Half) i = 0; i < pi->dlpi_phnum; ++i) {
          const ElfW(Phdr)& ph = pi->dlpi_phdr[i];
          if (ph.p_type != PT_LOAD) continue;
          const std::uintptr_t b = pi->dlpi_addr + ph.p_vaddr, e = b + ph.p_memsz;
          if (reinterpret_cast<std::uintptr_t>(c.base) >= b && reinterpret_cast<std::uintptr_t>(c.base) < e)
            mine = true;
          if (c.span->begin == 0 || b < c.span->begin) c.span->begin = b;
          if (e > c.span->end) c.span->end = e;
        }
        if (mine) return 1;
        c.span->begin = c.span->end = 0;
        return 0;
      },
      &ctx);
  return out.begin < out.end;
#endif
}

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
