// SPDX-License-Identifier: MIT
// metal-cpp's one implementation unit: the selector and class symbols every metal-cpp call
// refers to. A program must define them exactly once; an engine that already has such a unit
// builds with -DRESIDENCY_METAL_CPP_IMPLEMENTATION=OFF and this file is left out.
#define NS_PRIVATE_IMPLEMENTATION
#define MTL_PRIVATE_IMPLEMENTATION
#include <Foundation/Foundation.hpp>
#include <Metal/Metal.hpp>
