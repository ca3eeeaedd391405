// SPDX-License-Identifier: MIT
// UseScope and Batch: RAII handles over the manager's public calls (residency.hpp).
#include "residency/residency.hpp"

namespace residency {

Batch::~Batch() {
  if (manager_) (void)manager_->end_batch();
}

// --- UseScope: one engine call, with a status and a synchronize function ---

UseScope::UseScope(Manager* m, std::function<void()> sync, Status st)
    : manager_(m), synchronize_(std::move(sync)), status_(std::move(st)) {}

UseScope::UseScope(UseScope&& o) noexcept
    : manager_(o.manager_), synchronize_(std::move(o.synchronize_)), status_(std::move(o.status_)) {
  o.manager_ = nullptr;
}

UseScope& UseScope::operator=(UseScope&& o) noexcept {
  if (this != &o) {
    end();
    manager_ = o.manager_;
    synchronize_ = std::move(o.synchronize_);
    status_ = std::move(o.status_);
    o.manager_ = nullptr;
  }
  return *this;
}

UseScope::~UseScope() { end(); }

void UseScope::end() {
  if (!manager_) return;
  Manager* mgr = manager_;
  manager_ = nullptr;
  // The GPU may still be reading: wait for it before anything can be released (mlx-lm
  // synchronizes before restoring the wired limit for the same reason).
  if (synchronize_) synchronize_();
  mgr->end_counted_call(nullptr, nullptr);  // the scope is its own token: any thread may end it
}

}  // namespace residency
