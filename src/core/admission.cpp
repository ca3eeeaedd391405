// SPDX-License-Identifier: MIT
#include "admission.hpp"

#include <algorithm>
#include <cstdio>

namespace residency::core {

Admission::Admission(Backend& backend, const LogSink& log, const KeepAliveState& ka, Limits limits, SetLayout layout,
                     std::unique_ptr<BudgetShare> share)
    : backend_(backend),
      log_(log),
      ka_(ka),
      limits_(std::move(limits)),
      sets_(backend, std::move(layout), log),
      share_(std::move(share)) {
  const std::uint64_t g = backend.capabilities().wire_granularity;
  granularity_ = g > 1 && (g & (g - 1)) == 0 ? g : 1;
  budget_.set_limit(limits_.initial_wired_limit());
}

std::uint64_t Admission::charge(const RegionDesc& d) const {
  if (granularity_ == 1) return d.size;
  const auto b = reinterpret_cast<std::uintptr_t>(d.base);
  const std::uint64_t lo = b & ~(granularity_ - 1);
  const std::uint64_t end = std::uint64_t{b} + d.size;  // no wrap: register_region refuses one
  const std::uint64_t hi = end > UINT64_MAX - (granularity_ - 1) ? UINT64_MAX
                                                                 : (end + granularity_ - 1) & ~(granularity_ - 1);
  return hi - lo;
}

Admission::~Admission() = default;

Result<Region*> Admission::track(const RegionDesc& d, int priority, std::int64_t now) {
  if (Status s = limits_.check_track(regions_.tracked_bytes(), d.size); !s) return s;
  auto inserted = regions_.insert(d, priority, now);
  if (!inserted) return inserted.status();
  Region& r = **inserted;
  if (log_.enabled(LogLevel::debug)) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "allocated buffer, size = %8.2f MiB, (%8.2f / %8.2f)",
                  static_cast<double>(d.size) / (1024.0 * 1024.0),
                  static_cast<double>(regions_.tracked_bytes()) / (1024.0 * 1024.0),
                  static_cast<double>(limits_.recommended()) / (1024.0 * 1024.0));
    log_(LogLevel::debug, buf);
  }
  limits_.warn_if_over_recommended(regions_.tracked_bytes(), log_);
  if (ka_.managing() && !admit(r)) {
    budget_.add_pending(r.desc.id);
    if (log_.enabled(LogLevel::debug))
      log_(LogLevel::debug, "region " + std::to_string(r.desc.id) + " (" + mib(d.size) + ") is over the wired limit " +
                                mib(budget_.limit()) + " (" + mib(budget_.admitted()) +
                                " admitted): tracked but not wired");
  }
  return &r;
}

void Admission::untrack(Region& r) {
  open_batch();
  if (r.desc.backend_allocated) backend_.deallocate(r.desc.base);
  evict(r);
  budget_.forget(r.desc.id);
  regions_.erase(r.desc.id);
  promote();  // unlike MLX, freeing wired memory makes room for what waits
  close_batch();
}

Status Admission::untrack_id(RegionId id) {
  Region* r = regions_.find(id);
  if (!r)
    return Status(ErrorCode::not_found, "unregister_region: no region with id " + std::to_string(id) + " is tracked");
  untrack(*r);
  return {};
}

Status Admission::untrack_address(const void* base) {
  Region* r = regions_.find_address(base);
  if (!r) return Status(ErrorCode::not_found, "unregister_address: no tracked region starts at this address");
  untrack(*r);
  return {};
}

Status Admission::untrack_allocation(const void* ptr) {
  Region* r = regions_.find_address(ptr);
  if (!r || !r->desc.backend_allocated)
    return Status(ErrorCode::not_found, std::string("deallocate: this pointer was not returned by allocate()") +
                                            (r ? "; it is a registered region: use unregister_address()" : ""));
  untrack(*r);
  return {};
}

void Admission::set_limit(std::uint64_t bytes) {
  open_batch();
  budget_.set_limit(bytes);
  regions_.for_each([](Region& r) { r.eligible = true; });  // a new limit: try again what failed
  shrink_to_limit();
  promote();
  close_batch();
}

bool Admission::admit(Region& r) {
  const std::uint64_t bytes = charge(r.desc);
  if (r.admitted || !budget_.fits(bytes)) return false;
  // Device memory reserved ahead of its allocation (reserve_ahead()) takes that reservation over.
  const std::uint64_t from_ahead = r.desc.backend_allocated && share_ ? share_->take_ahead(bytes) : 0;
  if (!reserve_shared(bytes, r.desc.backend_allocated)) {
    if (from_ahead != 0) share_->untake_ahead(from_ahead);
    return false;
  }
  if (Status s = backend_.reserve_wired(bytes); !s) {
    log_(warned_reserve_ ? LogLevel::debug : LogLevel::warn,
         "region " + std::to_string(r.desc.id) + " (" + mib(r.desc.size) + ") stays tracked but unwired: " + s.message());
    warned_reserve_ = true;
    return false;
  }
  auto slot = sets_.add(r.desc, bytes);
  if (!slot) {
    backend_.unreserve_wired(bytes);
    log_(LogLevel::warn, slot.message() + "; the region stays tracked but unwired");
    r.eligible = false;
    return false;
  }
  r.admitted = true;
  r.layout_slot = *slot;
  budget_.admitted_region(r.desc.id, bytes);
  admitted_size_ += r.desc.size;
  return true;
}

void Admission::evict(Region& r) {
  if (!r.admitted) return;
  const std::uint64_t bytes = charge(r.desc);
  sets_.remove(r.layout_slot, r.desc, bytes);
  backend_.unreserve_wired(bytes);
  budget_.evicted_region(r.desc.id, bytes);
  admitted_size_ -= r.desc.size;
  r.admitted = false;
}

std::vector<BudgetEntry> Admission::entries_of(bool admitted) {
  std::vector<BudgetEntry> v;
  auto add = [&](Region& r) {
    v.push_back({r.desc.id, charge(r.desc), r.priority, regions_.last_use(r), r.admitted, r.eligible, r.desc.cls});
  };
  if (admitted) {
    regions_.for_each([&](Region& r) {
      if (r.admitted) add(r);
    });
  } else {
    for (RegionId id : budget_.pending())
      if (Region* r = regions_.find(id)) add(*r);
  }
  return v;
}

void Admission::promote() {
  if (!ka_.managing() || budget_.pending().empty()) return;
  const auto entries = entries_of(false);
  for (RegionId id : choose_promotions(entries, budget_.admitted(), budget_.effective_limit()))
    if (Region* r = regions_.find(id)) admit(*r);
}

std::uint64_t Admission::shrink_to_limit(bool by_class, std::uint64_t floor) {
  if (budget_.admitted() <= budget_.effective_limit()) return 0;
  const std::uint64_t before = budget_.admitted();
  const auto entries = entries_of(true);
  for (RegionId id : choose_evictions(entries, budget_.admitted(), budget_.effective_limit(), by_class, floor))
    if (Region* r = regions_.find(id)) evict(*r);
  return before - budget_.admitted();
}

// Regions the backend could not wire leave their set and wait, out of the budget's way.
void Admission::on_failure(const SetOutcome& out, const char* what) {
  // Device memory that could not wake for want of device memory, on a first attempt under a shared
  // budget: the other holders are asked to sleep (the manager, without its lock) and it is tried
  // again (retry()). Unmapped device memory is not memory a decode can go on without.
  if (share_ && share_->asking() && out.status.code() == ErrorCode::out_of_memory) {
    bool all_device = !out.failed.empty();
    for (RegionId id : out.failed)
      if (Region* r = regions_.find(id); r && !r->desc.backend_allocated) all_device = false;
    if (all_device) {
      for (RegionId id : out.failed)
        if (Region* r = regions_.find(id)) {
          share_->note_device_full(r->desc.size);
          evict(*r);  // eligible still: promote() admits it again at the retry
        }
      return;
    }
  }
  std::uint64_t bytes = 0;
  for (RegionId id : out.failed) {
    Region* r = regions_.find(id);
    if (!r) continue;
    bytes += r->desc.size;
    evict(*r);
    // Device memory short of device memory is tried again at the next wake (a GPU frees memory
    // as other processes sleep or exit); anything else waits for a new limit.
    r->eligible = r->desc.backend_allocated && out.status.code() == ErrorCode::out_of_memory;
  }
  wire_failures_ += out.failed.size();
  std::string msg = std::string(what) + " failed";
  if (!out.failed.empty())
    msg += " for " + std::to_string(out.failed.size()) + " region(s), " + mib(bytes) +
           "; they stay tracked but unwired and the process goes on";
  if (!out.status.is_ok()) msg += ": " + out.status.message();
  log_(LogLevel::warn, msg);
}

std::pair<std::uint64_t, std::uint32_t> Admission::request_all() {
  if (!share_ || !share_->pacing()) return sets_.request_all(failure_handler());
  // A paced wake (BudgetShare::plan_wire()): the backend asks the share before each piece it maps.
  backend_.set_wake_gate([this](std::uint64_t bytes) { share_->pace(bytes); });
  const auto r = [&] {
    // No gate outlives its wake, even one left by an exception (std::bad_alloc) from the sets.
    struct Ungate {
      Admission& a;
      ~Ungate() {
        a.backend_.set_wake_gate(nullptr);
        a.share_->stop_pacing();
      }
    } ungate{*this};
    return sets_.request_all(failure_handler());
  }();
  share_->end_paced_wake(demand());
  return r;
}

ResidencySets::Released Admission::end_all() { return sets_.end_all(); }
void Admission::refresh_all() { sets_.refresh_all(failure_handler()); }

void Admission::flush() {
  if (batch_depth_ > 0) return;
  sets_.flush(ka_.wants_resident(), failure_handler());
  settle();
  if (share_) share_->end_flush();
  if (on_change_) on_change_();
}

void Admission::teardown() {
  if (regions_.size() != 0) {
    log_(LogLevel::warn, std::to_string(regions_.size()) + " region(s), " + mib(regions_.tracked_bytes()) +
                             ", still registered at teardown; releasing them (not an error)");
  }
  regions_.for_each([&](const Region& r) {
    if (r.desc.backend_allocated) backend_.deallocate(r.desc.base);
  });
  const bool any_requested = sets_.requested_bytes() > 0;
  if (Status s = sets_.destroy_all(); !s) log_(LogLevel::warn, "at teardown: " + s.message());
  if (any_requested) backend_.after_release();
  if (budget_.admitted() > 0) backend_.unreserve_wired(budget_.admitted());
  if (share_) share_->release_all();  // after the sets are gone: nothing is wired
}

bool Admission::holds_backend_memory() const {
  bool device = false;
  regions_.for_each([&](const Region& r) { device = device || r.desc.backend_allocated; });
  return device;
}

Status Admission::unwired_status() const {
  const std::uint64_t tracked = regions_.tracked_bytes(), wired = sets_.requested_bytes();
  if (wired >= tracked) return {};
  return Status(ErrorCode::limit_exceeded, format_size(tracked - wired) + " of " + format_size(tracked) +
                                               " tracked is not wired (over the wired limit of " +
                                               format_size(budget_.limit()) + " or refused by the backend)");
}

// --- the shared budget --------------------------------------------------------------------

Demand Admission::demand() const {
  return {budget_.admitted(), sets_.requested_bytes(), ka_.wants_resident(), ka_.calls() > 0};
}

bool Admission::reserve_ahead(std::uint64_t bytes) {
  return !share_ || share_->reserve_ahead(demand(), bytes, backend_.unmanaged_device_bytes());
}

void Admission::end_ahead(std::uint64_t bytes) {
  if (share_) share_->end_ahead(demand(), bytes);
}

// Reserves room for `more` bytes on top of what is needed, before they can be wired. False: the
// region must wait.
bool Admission::reserve_shared(std::uint64_t more, bool device) {
  return !share_ || share_->reserve(demand(), more, device);
}

void Admission::settle() {
  if (share_) share_->settle(demand());
}

bool Admission::reserve_for_wire() {
  if (!share_) return true;
  const bool device = holds_backend_memory();
  const BudgetShare::WirePlan plan = share_->plan_wire(demand(), device, device ? backend_.unmanaged_device_bytes() : 0);
  if (plan.step == BudgetShare::WirePlan::Step::go) return true;
  if (plan.step == BudgetShare::WirePlan::Step::wait) {
    // Refused by a strict budget (not a first attempt, which asks next): what it took of the room
    // goes back, since the memory stays asleep.
    if (!share_->asking()) share_->settle({budget_.admitted(), sets_.requested_bytes(), false, ka_.calls() > 0});
    return false;
  }
  // Host memory: what the ledger holds is what may be wired; the least valuable leave.
  const std::uint64_t before = budget_.admitted();
  const auto entries = entries_of(true);
  for (RegionId id : choose_evictions(entries, budget_.admitted(), plan.keep))
    if (Region* r = regions_.find(id)) evict(*r);
  // Commit the removals now, before request_all(): a backend requests what a set holds as
  // committed, and would lock the regions just evicted until the next commit.
  sets_.flush(/*request=*/false, failure_handler());
  share_->short_by(plan.missing, before - budget_.admitted());
  return true;
}

}  // namespace residency::core
