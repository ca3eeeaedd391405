// SPDX-License-Identifier: MIT
// A deliberately wrong use of metal-cpp, which scripts/metal-check must refuse: a command
// queue accepts residency sets, not buffers (a buffer is an MTL::Allocation, and the types
// must keep them apart).
// expect-error: cannot initialize a parameter of type 'const MTL::ResidencySet *'
#include <Foundation/Foundation.hpp>
#include <Metal/Metal.hpp>

void attach(MTL::CommandQueue* queue, MTL::Buffer* buffer) { queue->addResidencySet(buffer); }
