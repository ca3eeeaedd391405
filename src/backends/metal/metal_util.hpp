// SPDX-License-Identifier: MIT
// residency metal backend: two helpers every metal-cpp caller of the project needs (the backend,
// the Metal decode pass). Include after <Foundation/Foundation.hpp>.
#pragma once

#include <string>

namespace residency::metal {

// Releases what the Metal calls of one entry point autoreleased: every entry point runs inside
// one, because some are called from threads that have no pool (the manager's scheduler).
class AutoreleasePool {
 public:
  AutoreleasePool() : pool_(NS::AutoreleasePool::alloc()->init()) {}
  ~AutoreleasePool() { pool_->release(); }
  AutoreleasePool(const AutoreleasePool&) = delete;
  AutoreleasePool& operator=(const AutoreleasePool&) = delete;

 private:
  NS::AutoreleasePool* pool_;
};

// An NSError's localized description, for messages.
inline std::string describe(const NS::Error* error) {
  if (error == nullptr || error->localizedDescription() == nullptr) return "no reason given";
  return error->localizedDescription()->utf8String();
}

}  // namespace residency::metal
