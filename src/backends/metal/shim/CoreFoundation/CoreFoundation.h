// SPDX-License-Identifier: MIT
// Shim (compile checks on Linux only; see ../README.md): the CoreFoundation names metal-cpp
// uses.
#pragma once

// Apple's CoreFoundation.h brings in these C headers, and metal-cpp relies on it (INFINITY).
#include <assert.h>
#include <ctype.h>
#include <errno.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef double CFTimeInterval;
typedef unsigned long CFTypeID;
typedef signed long CFIndex;
typedef const void* CFTypeRef;
typedef const struct __CFString* CFStringRef;
typedef const struct __CFAllocator* CFAllocatorRef;
