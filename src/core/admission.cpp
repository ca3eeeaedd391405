// SPDX-License-Identifier: MIT
#include "admission.hpp"

#include <algorithm>
#include <cstdio>

#include "ledger/ledger.hpp"

namespace residency::core {

Admission::Admission(Backend& backend, const LogSink& log, const KeepAliveState& ka, Clock& clock, Limits limits,
                     SetLayout layout, std::unique_ptr<ledger::Ledger> shared, int shared_priority)
    : backend_(backend),
      log_(log),
      ka_(ka),
      clock_(clock),
      limits_(std::move(limits)),
      sets_(backend, std::move(layout), log),
      shared_(std::move(shared)),
      shared_priority_(shared_priority) {
  const Capabilities caps = backend.capabilities();
  const std::uint64_t g = caps.wire_granularity;
  granularity_ = g > 1 && (g & (g - 1)) == 0 ? g : 1;
  paced_wake_ = caps.paced_wake;
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

Result<std::unique_ptr<ledger::Ledger>> Admission::join_shared_budget(const Config& config, const MemoryInfo& mem,
                                                                      const std::string& backend) {
  if (!config.shared_budget) return std::unique_ptr<ledger::Ledger>();
  const SharedBudget& sb = *config.shared_budget;
  if (sb.size.is_percent && mem.physical == 0)
    return Status(ErrorCode::invalid_argument, "RESIDENCY_SHARED_BUDGET=" + sb.to_string() +
                                                   ": a percent of RAM, but the " + backend +
                                                   " backend does not know the physical memory; give bytes");
  ledger::AttachOptions ao;
  ao.name = sb.name;
  ao.budget = sb.size.resolve(mem.physical);
  ao.group = sb.group;
  ao.priority = config.shared_priority;
  return ledger::Ledger::attach(ao);
}

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
  const std::uint64_t from_ahead = r.desc.backend_allocated ? std::min(ahead_, bytes) : 0;
  ahead_ -= from_ahead;
  if (!reserve_shared(bytes, r.desc.backend_allocated)) {
    ahead_ += from_ahead;
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
  if (shared_ && asking() && out.status.code() == ErrorCode::out_of_memory) {
    bool all_device = !out.failed.empty();
    for (RegionId id : out.failed)
      if (Region* r = regions_.find(id); r && !r->desc.backend_allocated) all_device = false;
    if (all_device) {
      for (RegionId id : out.failed)
        if (Region* r = regions_.find(id)) {
          device_short_ += r->desc.size;
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
  if (!pacing_) return sets_.request_all(failure_handler());
  // A paced wake (reserve_for_wire()): the backend asks pace() before each piece it maps.
  backend_.set_wake_gate([this](std::uint64_t bytes) { pace(bytes); });
  const auto r = [&] {
    // No gate outlives its wake, even one left by an exception (std::bad_alloc) from the sets.
    struct Ungate {
      Admission& a;
      ~Ungate() {
        a.backend_.set_wake_gate(nullptr);
        a.pacing_ = false;
      }
    } ungate{*this};
    return sets_.request_all(failure_handler());
  }();
  // What the pieces did not take (the backend mapped less than was charged): the ledger holds what
  // is admitted before anything else is decided.
  const std::uint64_t needed = shared_needed();
  if (shared_->held() < needed && !exiting_) {
    const std::uint64_t rest = needed - shared_->held();
    if (shared_->acquire(rest, clock_.now().count(), Nanos(0), /*partial=*/false) != rest) (void)over_budget(rest);
  }
  return r;
}

// Before each piece a paced wake maps: the piece fits in what the ledger held when the wake began,
// or the rest is made now: the others are asked (the least recently used holder not inside a call
// first) and waited for, while the copies of the pieces already mapped go on. When nobody can give
// way, the rest wakes over the budget, as an unpaced wake would after its ask (over_budget()).
void Admission::pace(std::uint64_t bytes) {
  if (bytes <= pace_credit_) {
    pace_credit_ -= bytes;
    return;
  }
  const std::uint64_t want = std::min(pace_owed_, bytes - pace_credit_);
  pace_credit_ = 0;
  if (want == 0 || exiting_) return;
  pace_owed_ -= want;
  if (shared_->acquire(want, clock_.now().count(), ledger::kAskWait, /*partial=*/false, ledger::kNoMinimumIdle) == want) {
    // The holder asked gave back at once what it had: the rest that is free now, in one take.
    const std::uint64_t more = pace_owed_ != 0 ? shared_->acquire(pace_owed_, clock_.now().count(), Nanos(0), true) : 0;
    pace_owed_ -= more;
    pace_credit_ += more;
    return;
  }
  const std::uint64_t rest = want + pace_owed_;
  pace_owed_ = 0;
  if (over_budget(rest)) pace_credit_ = rest - want;
}
ResidencySets::Released Admission::end_all() { return sets_.end_all(); }
void Admission::refresh_all() { sets_.refresh_all(failure_handler()); }

void Admission::flush() {
  if (batch_depth_ > 0) return;
  sets_.flush(ka_.wants_resident(), failure_handler());
  settle();
  shared_full_ = false;
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
  if (shared_) shared_->release(shared_->held());  // after the sets are gone: nothing is wired
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

// What the ledger must hold for this manager now: while the policy wants the memory resident,
// everything admitted (wired, or wired at the next commit); otherwise what the backend still has.
std::uint64_t Admission::shared_needed() const {
  const std::uint64_t requested = sets_.requested_bytes();
  return (ka_.wants_resident() ? std::max(budget_.admitted() + ahead_, requested) : requested) + unmanaged_;
}

// A device holder's memory outside its allocations (the GPU context, libraries' workspaces) is
// awake whatever the policy says: the ledger holds it too, and askers pass a holder that holds only
// that (Ledger::set_floor). Read before a wake or an allocation, when it may have grown.
void Admission::count_unmanaged() {
  if (!shared_) return;
  const std::uint64_t u = backend_.unmanaged_device_bytes();
  if (u == unmanaged_) return;
  unmanaged_ = u;
  shared_->set_floor(u);
}

bool Admission::reserve_ahead(std::uint64_t bytes) {
  if (!shared_ || !ka_.wants_resident()) return true;
  count_unmanaged();
  ahead_ += bytes;
  return reserve_shared(0, /*device=*/true);
}

void Admission::end_ahead(std::uint64_t bytes) {
  ahead_ -= std::min(ahead_, bytes);
  settle();
}

// Reserves room for `more` bytes on top of what is needed, before they can be wired. False: the
// region must wait (and room_wanted() says what to ask the other holders for).
bool Admission::reserve_shared(std::uint64_t more, bool device) {
  if (!shared_ || !ka_.wants_resident()) return true;
  if (exiting_) return false;
  const std::uint64_t target = shared_needed() + more;
  if (shared_->held() >= target) return true;
  const std::uint64_t need = target - shared_->held();
  if (!shared_full_ && shared_->acquire(need, clock_.now().count(), Nanos(0), /*partial=*/false) == need) return true;
  shared_full_ = true;
  if (device && !asking()) return over_budget(need);
  room_for_device_ = room_for_device_ || device;
  short_by(need, more);
  return false;
}

bool Admission::asking() const { return first_attempt_ && !exiting_ && shared_->problem().empty(); }

// Device memory the ledger could not make room for after the others were asked: awake over the
// budget (it is awake whether or not it is in a set: the backend wakes what it allocates), in the
// ledger's books so that the others find it full. False: not even that could be reserved.
bool Admission::over_budget(std::uint64_t bytes) {
  if (shared_->take_over_budget(bytes) != bytes) {
    short_by(bytes, bytes);
    return false;
  }
  ++shared_over_;
  log_(warned_over_ ? LogLevel::debug : LogLevel::warn,
       "shared budget " + shared_->name() + " (" + mib(shared_->budget()) + ") is full: " + mib(bytes) +
           " of device memory is awake over it (this process holds " + mib(shared_->held()) +
           "; no idle holder of priority <= " + std::to_string(shared_priority_) +
           " could sleep, and device memory a decode reads cannot wait). `residency stat` lists the holders");
  warned_over_ = true;
  return true;
}

void Admission::settle() {
  if (!shared_) return;
  const std::uint64_t need = shared_needed();
  if (shared_->held() > need) shared_->release(shared_->held() - need);
}

void Admission::short_by(std::uint64_t need, std::uint64_t bytes) {
  if (asking()) {  // full: ask the others first (retry())
    room_wanted_ += need;
    return;
  }
  ++shared_short_;
  const std::uint64_t ours = shared_->held();
  if (const std::string problem = shared_->problem(); !problem.empty()) {  // not full: the ledger could not be used
    log_(warned_shared_problem_ ? LogLevel::debug : LogLevel::warn,
         "shared budget " + shared_->name() + ": " + problem + "; " + mib(bytes) +
             " stays tracked but unwired (this process holds " + mib(ours) + " of the budget)" +
             (shared_->usable() ? "; it is wired at a later use once the ledger answers" : ""));
    warned_shared_problem_ = true;
    return;
  }
  log_(warned_shared_ ? LogLevel::debug : LogLevel::warn,
       "shared budget " + shared_->name() + " (" + mib(shared_->budget()) + ") is full: " + mib(bytes) +
           " stays tracked but unwired (this process holds " + mib(ours) +
           " of it; no idle holder of priority <= " + std::to_string(shared_priority_) +
           " could give back). It is wired when this process wires again (a registration, or its first use after "
           "a release), and asks again then; `residency stat` lists the holders");
  warned_shared_ = true;
}

bool Admission::reserve_for_wire() {
  if (!shared_) return true;
  if (holds_backend_memory()) count_unmanaged();
  const std::uint64_t need = budget_.admitted() + unmanaged_;
  if (shared_->held() >= need) return true;
  if (!exiting_ && !shared_full_)
    shared_->acquire(need - shared_->held(), clock_.now().count(), Nanos(0), /*partial=*/true);
  if (shared_->held() >= need) return true;
  shared_full_ = true;
  const std::uint64_t missing = need - shared_->held();
  if (holds_backend_memory()) {
    // Device memory sleeps until there is room: the others are asked first, then it wakes, over
    // the budget if nobody could give way. A backend that paces its wakes begins in the room the
    // ledger holds and the rest is asked for while it runs (pace()): the other's release and this
    // wake overlap where the budget allows (docs/design.md, "The GPU budget").
    const std::uint64_t wired = sets_.requested_bytes() + unmanaged_;
    if (asking() && paced_wake_ && shared_->held() > wired) {
      pacing_ = true;
      pace_credit_ = shared_->held() - wired;
      pace_owed_ = missing;
      paced_head_ = pace_credit_;
      return true;
    }
    if (asking()) {
      room_wanted_ += missing;
      room_for_device_ = true;
      return false;
    }
    if (!exiting_) (void)over_budget(missing);  // not reserved even so: short_by() said why
    return true;
  }
  const std::uint64_t before = budget_.admitted();
  const auto entries = entries_of(true);
  for (RegionId id : choose_evictions(entries, budget_.admitted(), shared_->held()))
    if (Region* r = regions_.find(id)) evict(*r);
  // Commit the removals now, before request_all(): a backend requests what a set holds as
  // committed, and would lock the regions just evicted until the next commit.
  sets_.flush(/*request=*/false, failure_handler());
  short_by(missing, before - budget_.admitted());
  return true;
}

void Admission::begin_retry(bool keep_asking) {
  device_short_ = 0;
  first_attempt_ = keep_asking;
  shared_full_ = false;
  room_wanted_ = 0;
}

}  // namespace residency::core
