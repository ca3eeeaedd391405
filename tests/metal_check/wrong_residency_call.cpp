// SPDX-License-Identifier: MIT
// A deliberately wrong use of metal-cpp, which scripts/metal-check must refuse: if this file
// compiles, the shim headers are too permissive for the check to mean anything.
// newResidencySet takes a descriptor AND an NS::Error** (Metal reports failures through it);
// forgetting the error argument is the mistake.
// expect-error: too few arguments to function call, expected 2, have 1
#include <Foundation/Foundation.hpp>
#include <Metal/Metal.hpp>

MTL::ResidencySet* make_set(MTL::Device* device, MTL::ResidencySetDescriptor* desc) {
  return device->newResidencySet(desc);
}
