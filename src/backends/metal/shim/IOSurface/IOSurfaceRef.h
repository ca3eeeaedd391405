// SPDX-License-Identifier: MIT
// Shim (compile checks on Linux only; see ../README.md).
#pragma once

typedef struct __IOSurface* IOSurfaceRef;
