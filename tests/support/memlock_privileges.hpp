// SPDX-License-Identifier: MIT
// For a child before its exec (ChildSpec::before_exec): the privileges that decide what it may
// lock, as a service without them has: CAP_IPC_LOCK dropped from every set, and RLIMIT_MEMLOCK.
#pragma once

#include <linux/capability.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace residency::testing {

inline void drop_cap_ipc_lock() noexcept {
  ::prctl(PR_CAPBSET_DROP, CAP_IPC_LOCK, 0, 0, 0);
  ::prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
  __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3] = {};
  if (::syscall(SYS_capget, &hdr, data) == 0) {
    data[0].effective &= ~(1U << CAP_IPC_LOCK);
    data[0].permitted &= ~(1U << CAP_IPC_LOCK);
    data[0].inheritable &= ~(1U << CAP_IPC_LOCK);
    ::syscall(SYS_capset, &hdr, data);
  }
}

inline void set_memlock_limit(std::uint64_t bytes) noexcept {
  const rlimit rl{static_cast<rlim_t>(bytes), static_cast<rlim_t>(bytes)};
  ::setrlimit(RLIMIT_MEMLOCK, &rl);
}

}  // namespace residency::testing
