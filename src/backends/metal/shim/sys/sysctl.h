// SPDX-License-Identifier: MIT
// Shim (compile checks on Linux only; see ../README.md): sysctlbyname, as Apple's <sys/sysctl.h>
// declares it (glibc has no <sys/sysctl.h> since 2.32).
#pragma once

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif
int sysctlbyname(const char* name, void* oldp, size_t* oldlenp, void* newp, size_t newlen);
#ifdef __cplusplus
}
#endif
