// SPDX-License-Identifier: MIT
// residency: the machine-wide wired budgets (RESIDENCY_SHARED_BUDGET), as a reader sees them.
//
// Processes that name the same budget share one ledger in shared memory (/dev/shm on Linux):
// every holder reserves its wired bytes there before it wires them. This header lists those
// ledgers for `residency stat` and for monitoring; it reads them without taking their lock and
// changes nothing. Linux only; elsewhere the list is empty.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace residency {

struct SharedBudgetHolder {
  int pid = 0;
  std::uint64_t bytes = 0;                       // reserved in the ledger (what it has wired, or is about to)
  std::uint64_t unmanaged = 0;                   // of bytes, what no sleep gives back (a GPU context), in whole MiB
  std::optional<std::chrono::nanoseconds> idle;  // since its last use; nullopt: never used
  int priority = 0;                              // RESIDENCY_SHARED_PRIORITY
  bool alive = true;                             // false: the process is gone (or its pid was reused); the next
                                                 // process that takes the ledger's lock reclaims its share
  bool asked = false;                            // asked to give back, not answered yet
  bool waiting = false;                          // waiting its turn for room (RESIDENCY_BUDGET_WAIT)
  std::uint64_t shared_key = 0;                  // nonzero: the same memory as the other holders of this key
                                                 // (one model file's page cache): they count once, as the largest
};

struct SharedBudgetInfo {
  std::string name;        // the NAME of RESIDENCY_SHARED_BUDGET
  std::string path;        // e.g. /dev/shm/residency-budget-NAME
  std::string error;       // non-empty: the ledger could not be read (the holders are empty)
  std::uint64_t size = 0;  // the budget, bytes
  std::uint64_t used = 0;  // reserved by every holder, dead ones included (holders of one shared key once)
  std::uint32_t mode = 0;  // permission bits of the ledger (0600, or 0660 for a group)
  std::vector<SharedBudgetHolder> holders;
};

// Every ledger of this machine that this user may read, by name. A ledger that cannot be read
// (another format version, another user's) is listed with `error` saying why.
std::vector<SharedBudgetInfo> list_shared_budgets();

// Ends every wait of this process for a shared budget's ledger at once, now and from now on: a
// manager being created fails with a message, an acquire gives up. For a process that is ending
// on a signal while it waits (`residency hold`); async-signal-safe.
void cancel_shared_budget_waits() noexcept;

}  // namespace residency
