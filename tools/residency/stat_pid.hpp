// SPDX-License-Identifier: MIT
// residency stat --pid PID (stat_pid.cpp): what another process holds, as the kernel, its
// residency managers and its GPU driver see it.
#pragma once

namespace residency::tool {

// Prints the process's report (or JSON with raw byte values). Exit status: 0; 1 when the
// process belongs to another user and this one may not read its mappings; a pid that names no
// process throws BadInput (exit 2).
int run_stat_pid(int pid, bool json);

}  // namespace residency::tool
