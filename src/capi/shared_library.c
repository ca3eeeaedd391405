/* SPDX-License-Identifier: MIT */
/* libresidency.so is the static library's objects, linked whole; this file only gives the shared
 * target a source of its own. It checks, at build time, that the header's ABI number is the one
 * the SONAME carries (CMake passes it). */
#include "residency/residency.h"

#if defined(RESIDENCY_SONAME_ABI) && RESIDENCY_SONAME_ABI != RESIDENCY_ABI_VERSION
#error "RESIDENCY_ABI_VERSION in residency.h differs from the SONAME's version in src/CMakeLists.txt"
#endif
