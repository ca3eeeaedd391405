// SPDX-License-Identifier: MIT
#include "asymmetric_fence.hpp"

#include <mutex>

#if defined(__linux__)
#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace residency::core {

std::atomic<bool> g_heavy_fence_is_membarrier{false};

void enable_asymmetric_fences() noexcept {
  static std::once_flag once;
  std::call_once(once, [] {
#if defined(__linux__) && defined(__NR_membarrier)
    const long cmds = ::syscall(__NR_membarrier, MEMBARRIER_CMD_QUERY, 0, 0);
    if (cmds > 0 && (cmds & MEMBARRIER_CMD_PRIVATE_EXPEDITED) != 0 &&
        ::syscall(__NR_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0) {
      g_heavy_fence_is_membarrier.store(true);
    }
#endif
  });
}

void heavy_fence() noexcept {
  std::atomic_thread_fence(std::memory_order_seq_cst);
#if defined(__linux__) && defined(__NR_membarrier)
  if (g_heavy_fence_is_membarrier.load(std::memory_order_relaxed)) {
    // Cannot fail once registered (EINVAL/EPERM only before registration).
    ::syscall(__NR_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0);
  }
#endif
}

}  // namespace residency::core
