// SPDX-License-Identifier: MIT
// Finding a library's definition of a function that a preload library also defines (the preloads'
// "next" functions): past the preload in the global scope, or in the local scope of the library
// that called (a Node addon or a Python extension dlopen'ed without RTLD_GLOBAL, whose dependencies
// RTLD_NEXT never searches), or in any loaded library. Never the preload's own definition: `self`
// is an address inside the preload asking (its definitions are the hooks).
#pragma once

#include <cstdint>

namespace residency::platform {

// The loaded object that holds an address: its segments' span and its path ("" for the main
// program).
struct ObjectSpan {
  std::uintptr_t begin = 0, end = 0;
  const char* path = nullptr;
};
// False when no loaded object holds `addr`. Lock-free where glibc has _dl_find_object (2.35);
// before it, dladdr and the object's program headers.
bool object_span(const void* addr, ObjectSpan& out) noexcept;

// The load address of the object that holds `addr` (null when none does).
const void* object_base(const void* addr) noexcept;
// dlsym in the local scope of the loaded object at `path` (the object and its dependencies),
// which is kept loaded when the symbol is found there (a cached pointer must never dangle).
void* find_in_object(const char* path, const char* name, const void* self) noexcept;
// The same for the object that holds address `near` (a caller's return address).
void* find_near(const char* name, const void* near, const void* self) noexcept;
// Every loaded object but `self`'s, in load order.
void* find_anywhere(const char* name, const void* self) noexcept;

}  // namespace residency::platform
