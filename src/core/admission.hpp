// SPDX-License-Identifier: MIT
// Admission: which tracked regions are inside a set, under every budget that applies.
//
// A region may be wired only while it fits four limits at once: the manager's wired budget (its
// limit, lowered for a while by memory pressure), the backend's hard limit (RLIMIT_MEMLOCK, shared
// by the managers of a process), the layout's sets, and, with a shared budget, this manager's
// reservation in the machine-wide ledger. This unit is the one place a region enters or leaves a
// set, so those four books can only change together: admit() and evict() are the only writers of
// Region::admitted, the budget's admitted bytes and pending ids, the backend's reservation and the
// sets' membership. It decides *which* regions are in; ResidencyCycle decides *when* what is in is
// wired.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "budget_share.hpp"
#include "keep_alive.hpp"
#include "limits.hpp"
#include "log.hpp"
#include "region_table.hpp"
#include "residency/backend.hpp"
#include "residency_sets.hpp"
#include "set_layout.hpp"
#include "wired_budget.hpp"

namespace residency::core {

// Invariants (every field is guarded by the manager's mutex):
//   - A region is admitted exactly when it is in a set (at Region::layout_slot), its bytes are counted
//     in budget().admitted() and reserved with the backend; otherwise its id is in
//     budget().pending(). Regions never overlap; tracked bytes stay within the memory limit.
//   - After each public call of the manager: budget().admitted() <= budget().effective_limit().
//   - Shared budget: the ledger holds at least what the backend has wired (sets().requested_bytes())
//     and, while the policy wants the memory resident, at least what is admitted: bytes are
//     reserved there before a commit or a request can wire them (admit(), reserve_for_wire()) and
//     given back after the backend unwired them (settle(), after every flush and release).
//   - Nothing here waits on another process but a paced wake (BudgetShare::pace()): the share is
//     asked with a wait of 0 under the mutex. When it comes back short, share()->take_room_wanted()
//     says how much; the manager asks the other holders through BudgetShare::Room with its mutex
//     released, then calls retry (manager.cpp, make_room()).
class Admission {
 public:
  Admission(Backend& backend, const LogSink& log, const KeepAliveState& ka, Limits limits, SetLayout layout,
            std::unique_ptr<BudgetShare> share);
  ~Admission();
  Admission(const Admission&) = delete;
  Admission& operator=(const Admission&) = delete;

  // Called after every flush (the state file is out of date).
  void on_change(std::function<void()> f) { on_change_ = std::move(f); }

  // --- regions ----------------------------------------------------------------------------
  // Tracks a region (the memory limit checked first) and, when residency is managed, admits it if
  // it fits, else leaves it pending. The pointer is valid until untrack().
  Result<Region*> track(const RegionDesc& desc, int priority, std::int64_t now);
  // Frees backend memory first (leaving the set first would make a backend copy device weights
  // out just before they are thrown away), then evicts, forgets and promotes what waits.
  void untrack(Region& r);
  // The same, for a region found by id, by its start address, or by a pointer allocate() returned;
  // not_found with a message naming what was wrong.
  Status untrack_id(RegionId id);
  Status untrack_address(const void* base);
  Status untrack_allocation(const void* ptr);
  // A new limit: what failed is tried again, the least valuable leave, what now fits comes in.
  void set_limit(std::uint64_t bytes);
  // Admits pending regions that fit, most valuable first (no-op when residency is not managed).
  void promote();
  // Evicts until admitted bytes fit the effective limit; returns the bytes evicted. Under pressure
  // (by_class) scratch goes first, then kv_cache, then weights, and nothing that would take the
  // admitted bytes below `floor`.
  std::uint64_t shrink_to_limit(bool by_class = false, std::uint64_t floor = 0);

  // --- wiring (for ResidencyCycle) --------------------------------------------------------
  // Before the sets are requested: reserves what is admitted in the shared budget; what it cannot
  // give leaves the sets, least valuable first, and waits as over a local limit. Device memory
  // never leaves them: on a first attempt the wire waits (false: do not request; the others are
  // asked, then the wire is tried again), after it the device memory wakes over the budget.
  bool reserve_for_wire();
  // Requests every admitted set; returns bytes and sets requested. A wake that reserve_for_wire()
  // began in the room the ledger had is paced: the backend maps piece by piece and the rest of the
  // room is asked for, and waited for, as it goes (pace(); the one wait on other processes made
  // with the manager's lock held: this call is inside the wake the engine waits for).
  std::pair<std::uint64_t, std::uint32_t> request_all();
  // Bytes the last request began to wake before the room for the rest was made (0: none), taken once.
  std::uint64_t take_paced_head() { return share_ ? share_->take_paced_head() : 0; }
  ResidencySets::Released end_all();
  void refresh_all();
  // Commits what changed, unless a batch is open, and gives back the shared budget no longer needed.
  void flush();
  // Gives back to the shared budget what is no longer needed.
  void settle();
  // Batches: membership changes are committed once, when the outermost one ends.
  void open_batch() { ++batch_depth_; }
  void close_batch() {
    if (--batch_depth_ == 0) flush();
  }
  int batch_depth() const { return batch_depth_; }

  // --- the shared budget ------------------------------------------------------------------
  // This manager's share of a machine-wide budget (null: none). Guarded by the manager's lock with
  // the rest of these books.
  BudgetShare* share() { return share_.get(); }
  const BudgetShare* share() const { return share_.get(); }
  // What the books say the share must cover now.
  Demand demand() const;
  // Device memory about to be allocated (Manager::allocate): reserved in the shared budget before
  // the allocation, so that room is made first (a full GPU cannot allocate and then ask). False:
  // the budget is full on a first attempt; the others are asked for room at the end of the call,
  // and the reservation stays wanted until end_ahead(). No-op without a shared budget.
  bool reserve_ahead(std::uint64_t bytes);
  // The allocation was tracked (its region took the reservation over) or failed: forgets it.
  void end_ahead(std::uint64_t bytes);
  // Whether what reserve_ahead() wanted is held (a strict budget refuses the allocation if not).
  bool ahead_covered() const { return !share_ || share_->covers(demand()); }
  // After the others were asked: the next attempt says what still does not fit.
  void begin_retry(bool keep_asking = false) {
    if (share_) share_->begin_retry(keep_asking);
  }
  // The call is over: the next one starts with a first attempt.
  void end_call() {
    if (share_) share_->end_call();
  }
  // The process is exiting: nothing more is reserved (and so nothing more wired).
  void begin_exit() {
    if (share_) share_->begin_exit();
  }

  // At the manager's destruction: backend memory freed first (no pointless copy-out of device
  // weights), then every set destroyed and every reservation given back. Warns about regions
  // still registered.
  void teardown();
  bool holds_backend_memory() const;
  // ok when everything tracked is wired; else what is not, and why it may be.
  Status unwired_status() const;

  // --- what the books say -----------------------------------------------------------------
  RegionTable& regions() { return regions_; }
  const RegionTable& regions() const { return regions_; }
  const WiredBudget& budget() const { return budget_; }
  // The admitted regions' own bytes (budget().admitted() is what they are charged).
  std::uint64_t admitted_size() const { return admitted_size_; }
  WiredBudget& budget() { return budget_; }
  const ResidencySets& sets() const { return sets_; }
  ResidencySets& sets() { return sets_; }
  Limits& limits() { return limits_; }
  std::uint64_t wire_failures() const { return wire_failures_; }

 private:
  // What a region costs the wired limit and a shared budget: its bytes rounded out to the
  // backend's wire granularity (whole pages for mlock).
  std::uint64_t charge(const RegionDesc& d) const;
  bool admit(Region& r);
  void evict(Region& r);
  std::vector<BudgetEntry> entries_of(bool admitted);
  void on_failure(const SetOutcome& out, const char* what);
  auto failure_handler() {
    return [this](const SetOutcome& o, const char* w) { on_failure(o, w); };
  }
  bool reserve_shared(std::uint64_t more, bool device);

  Backend& backend_;
  std::uint64_t granularity_ = 1;  // Capabilities::wire_granularity
  std::uint64_t admitted_size_ = 0;
  const LogSink& log_;
  const KeepAliveState& ka_;
  Limits limits_;  // its warn-once flags change here
  RegionTable regions_;
  WiredBudget budget_;
  ResidencySets sets_;
  const std::unique_ptr<BudgetShare> share_;
  std::function<void()> on_change_;
  int batch_depth_ = 0;
  bool warned_reserve_ = false;
  std::uint64_t wire_failures_ = 0;
};

}  // namespace residency::core
