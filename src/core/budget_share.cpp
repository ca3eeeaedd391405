// SPDX-License-Identifier: MIT
#include "budget_share.hpp"

#include <algorithm>
#include <thread>

#include "ledger/ledger.hpp"

namespace residency::core {

Result<BudgetShare::Joined> BudgetShare::join(const Config& config, const MemoryInfo& mem, const std::string& backend) {
  if (!config.shared_budget) return Joined();
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
  auto l = ledger::Ledger::attach(ao);
  if (!l) return l.status();
  return Joined(std::move(*l));
}

BudgetShare::BudgetShare(Joined ledger, int priority, bool paced_wake, Clock& clock, const LogSink& log,
                         std::optional<Nanos> wait)
    : ledger_(std::move(ledger)), priority_(priority), paced_wake_(paced_wake), clock_(clock), log_(log), wait_(wait) {}

BudgetShare::~BudgetShare() = default;

// --- reserving ----------------------------------------------------------------------------

std::uint64_t BudgetShare::needed(const Demand& d) const {
  return (d.wants_resident ? std::max(d.admitted + ahead_, d.requested) : d.requested) + unmanaged_;
}

bool BudgetShare::reserve(const Demand& d, std::uint64_t more, bool device) {
  if (!d.wants_resident) return true;
  if (exiting_) return false;
  note(d);
  const std::uint64_t target = needed(d) + more;
  if (ledger_->held() >= target) return true;
  const std::uint64_t need = target - ledger_->held();
  if (!full_ && ledger_->acquire(need, clock_.now().count(), Nanos(0), /*partial=*/false) == need) return true;
  full_ = true;
  if (device && !asking()) return strict() ? refuse(need) : over_budget(need);
  room_for_device_ = room_for_device_ || device;
  short_by(need, more);
  return false;
}

// A device holder's memory outside its allocations (the GPU context, libraries' workspaces) is
// awake whatever the policy says: the ledger holds it too, and askers pass a holder that holds only
// that (Ledger::set_floor). Read before a wake or an allocation, when it may have grown.
void BudgetShare::count_unmanaged(std::uint64_t bytes) {
  if (bytes == unmanaged_) return;
  unmanaged_ = bytes;
  ledger_->set_floor(bytes);
}

bool BudgetShare::reserve_ahead(const Demand& d, std::uint64_t bytes, std::uint64_t unmanaged) {
  if (!d.wants_resident) return true;
  count_unmanaged(unmanaged);
  ahead_ += bytes;
  return reserve(d, 0, /*device=*/true);
}

std::uint64_t BudgetShare::take_ahead(std::uint64_t bytes) {
  const std::uint64_t taken = std::min(ahead_, bytes);
  ahead_ -= taken;
  return taken;
}

void BudgetShare::end_ahead(const Demand& d, std::uint64_t bytes) {
  ahead_ -= std::min(ahead_, bytes);
  settle(d);
}

void BudgetShare::settle(const Demand& d) {
  const std::uint64_t need = needed(d);
  if (ledger_->held() > need) ledger_->release(ledger_->held() - need);
}

void BudgetShare::release_all() { ledger_->release(ledger_->held()); }

bool BudgetShare::asking() const { return first_attempt_ && !exiting_ && ledger_->problem().empty(); }

// Device memory the ledger could not make room for after the others were asked: awake over the
// budget (it is awake whether or not it is in a set: the backend wakes what it allocates), in the
// ledger's books so that the others find it full. False: not even that could be reserved.
bool BudgetShare::over_budget(std::uint64_t bytes) {
  if (ledger_->take_over_budget(bytes) != bytes) {
    short_by(bytes, bytes);
    return false;
  }
  ++over_count_;
  log_(warned_over_ ? LogLevel::debug : LogLevel::warn,
       "shared budget " + name() + " (" + mib(budget()) + ") is full: " + mib(bytes) +
           " of device memory is awake over it (this process holds " + mib(held()) +
           "; no idle holder of priority <= " + std::to_string(priority_) +
           " could sleep, and device memory a decode reads cannot wait). `residency stat` lists the holders");
  warned_over_ = true;
  return true;
}

// Strict: device memory that did not get its turn within the wait stays asleep (or unallocated),
// and the call that needs it fails with this reason.
bool BudgetShare::refuse(std::uint64_t bytes) {
  ++short_count_;
  log_(warned_refused_ ? LogLevel::debug : LogLevel::warn, refusal(bytes));
  warned_refused_ = true;
  return false;
}

std::string BudgetShare::refusal(std::uint64_t bytes) const {
  const std::string holders = ledger_->others_holding();
  return "shared budget " + name() + " (" + mib(budget()) + ") had no room for " + mib(bytes) +
         " of device memory within RESIDENCY_BUDGET_WAIT (" + KeepAlive::after(*wait_).to_string() +
         "; this process holds " + mib(held()) + "; " +
         (holders.empty() ? std::string("nobody else holds any") : holders) +
         "): it is refused, and the call that needs it fails; `residency stat` lists the holders";
}

void BudgetShare::short_by(std::uint64_t need, std::uint64_t bytes) {
  if (asking()) {  // full: ask the others first (Room::make, then begin_retry())
    room_wanted_ += need;
    return;
  }
  ++short_count_;
  const std::uint64_t ours = held();
  if (const std::string problem = ledger_->problem(); !problem.empty()) {  // not full: the ledger could not be used
    log_(warned_problem_ ? LogLevel::debug : LogLevel::warn,
         "shared budget " + name() + ": " + problem + "; " + mib(bytes) +
             " stays tracked but unwired (this process holds " + mib(ours) + " of the budget)" +
             (ledger_->usable() ? "; it is wired at a later use once the ledger answers" : ""));
    warned_problem_ = true;
    return;
  }
  log_(warned_full_ ? LogLevel::debug : LogLevel::warn,
       "shared budget " + name() + " (" + mib(budget()) + ") is full: " + mib(bytes) +
           " stays tracked but unwired (this process holds " + mib(ours) +
           " of it; no idle holder of priority <= " + std::to_string(priority_) +
           " could give back). It is wired when this process wires again (a registration, or its first use after "
           "a release), and asks again then; `residency stat` lists the holders");
  warned_full_ = true;
}

// --- wiring -------------------------------------------------------------------------------

BudgetShare::WirePlan BudgetShare::plan_wire(const Demand& d, bool device_memory, std::uint64_t unmanaged) {
  if (device_memory) count_unmanaged(unmanaged);
  note(d);
  const std::uint64_t need = d.admitted + unmanaged_;
  if (ledger_->held() >= need) return {};
  if (!exiting_ && !full_) ledger_->acquire(need - ledger_->held(), clock_.now().count(), Nanos(0), /*partial=*/true);
  if (ledger_->held() >= need) return {};
  full_ = true;
  const std::uint64_t missing = need - ledger_->held();
  if (!device_memory) return {WirePlan::Step::evict_to, ledger_->held(), missing};
  // Device memory sleeps until there is room: the others are asked first, then it wakes, over the
  // budget if nobody could give way. A backend that paces its wakes begins in the room the ledger
  // holds and the rest is asked for while it runs (pace()): the other's release and this wake
  // overlap where the budget allows (docs/design.md, "The GPU budget").
  // (A strict budget does not pace: a piece that found no room could not be refused halfway.)
  const std::uint64_t wired = d.requested + unmanaged_;
  if (asking() && paced_wake_ && !strict() && ledger_->held() > wired) {
    pacing_ = true;
    pace_credit_ = ledger_->held() - wired;
    pace_owed_ = missing;
    paced_head_ = pace_credit_;
    return {};
  }
  if (asking()) {
    room_wanted_ += missing;
    room_for_device_ = true;
    return {WirePlan::Step::wait, 0, missing};
  }
  if (strict()) {  // its turn came and went: it sleeps on, and the call that needs it is refused
    (void)refuse(d.admitted - std::min(d.admitted, d.requested));
    return {WirePlan::Step::wait, 0, missing};
  }
  if (!exiting_) (void)over_budget(missing);  // not reserved even so: short_by() said why
  return {};
}

// Before each piece a paced wake maps: the piece fits in what the ledger held when the wake began,
// or the rest is made now: the others are asked (the least recently used holder not inside a call
// first) and waited for. When nobody can give way, the rest wakes over the budget, as an unpaced
// wake would after its ask (over_budget()).
void BudgetShare::pace(std::uint64_t bytes) {
  if (bytes <= pace_credit_) {
    pace_credit_ -= bytes;
    return;
  }
  const std::uint64_t want = std::min(pace_owed_, bytes - pace_credit_);
  pace_credit_ = 0;
  if (want == 0 || exiting_) return;
  pace_owed_ -= want;
  const Nanos asked_at = clock_.now();
  const std::uint64_t got = ledger_->acquire(want, asked_at.count(), ledger::kAskWait, /*partial=*/false,
                                             ledger::kNoMinimumIdle);
  if (log_.enabled(LogLevel::debug))
    log_(LogLevel::debug, "timeline: a paced wake asked the holders for " + mib(want) + " of " + name() + ": " +
                              (got == want ? "given" : "not given") + " in " + ms(clock_.now() - asked_at));
  if (got == want) {
    // The holder asked gave back at once what it had: the rest that is free now, in one take.
    const std::uint64_t more = pace_owed_ != 0 ? ledger_->acquire(pace_owed_, clock_.now().count(), Nanos(0), true) : 0;
    pace_owed_ -= more;
    pace_credit_ += more;
    return;
  }
  const std::uint64_t rest = want + pace_owed_;
  pace_owed_ = 0;
  if (over_budget(rest)) pace_credit_ = rest - want;
}

void BudgetShare::end_paced_wake(const Demand& d) {
  // What the pieces did not take (the backend mapped less than was charged): the ledger holds what
  // is admitted before anything else is decided.
  const std::uint64_t need = needed(d);
  if (ledger_->held() < need && !exiting_) {
    const std::uint64_t rest = need - ledger_->held();
    if (ledger_->acquire(rest, clock_.now().count(), Nanos(0), /*partial=*/false) != rest) (void)over_budget(rest);
  }
}

// --- asking -------------------------------------------------------------------------------

BudgetShare::RoomWanted BudgetShare::take_room_wanted() {
  RoomWanted r{room_wanted_, room_for_device_, device_full_};
  if (strict() && room_for_device_) {
    r.in_turn = true;
    r.wait = awake_in_call_ ? Nanos(0) : *wait_;
  }
  room_wanted_ = 0;
  room_for_device_ = false;
  device_full_ = 0;
  return r;
}

void BudgetShare::begin_retry(bool keep_asking) {
  device_full_ = 0;
  first_attempt_ = keep_asking;
  full_ = false;
  room_wanted_ = 0;
}

void BudgetShare::end_call() {
  room_wanted_ = 0;
  first_attempt_ = true;
}

void BudgetShare::detach_at_exit() { ledger_->detach_at_exit(); }
bool BudgetShare::repay_turn() { return ledger_->repay_turn(); }

Nanos BudgetShare::idle_before_giving_back(bool device_holder) {
  return device_holder ? ledger::kNoMinimumIdle : ledger::kIdleBeforeAsked;
}

std::string BudgetShare::why_asked(int asker, Nanos idle) const {
  return "asked by process " + std::to_string(asker) + ": shared budget " + name() + " is full; idle for " + ms(idle) +
         "; the next use wires it again";
}

std::string BudgetShare::why_repaying(std::uint64_t over) const {
  return "shared budget " + name() + " is " + mib(over) +
         " over (a wake went over it while every other holder was inside a call): "
         "this holder, the least recently used, sleeps; the next use wakes it";
}

// --- what it says ---------------------------------------------------------------------------

const std::string& BudgetShare::name() const { return ledger_->name(); }
const std::string& BudgetShare::path() const { return ledger_->path(); }
std::uint64_t BudgetShare::budget() const { return ledger_->budget(); }
std::uint64_t BudgetShare::held() const { return ledger_->held(); }
std::uint64_t BudgetShare::requested_budget() const { return ledger_->requested_budget(); }
std::uint64_t BudgetShare::asks_sent() const { return ledger_->asks_sent(); }
LastUsePublisher BudgetShare::publisher(const Joined& ledger) {
  if (!ledger) return {};
  return {&ledger::Ledger::publish_last_use, ledger.get()};
}

std::optional<BudgetShare::Room> BudgetShare::room(const Joined& ledger, Clock& clock) {
  if (!ledger) return std::nullopt;
  return Room(ledger, clock);
}

// --- the Room: without the manager's lock -----------------------------------------------------

std::uint64_t BudgetShare::Room::make(const RoomWanted& want, const Mutex&) const {
  std::uint64_t freed = 0;
  if (want.bytes != 0 && want.in_turn) {
    // Strict: in order of arrival, as long as the wait allows; never long for this process itself
    // (its own holders inside a call could be waiting for this very thread).
    const Nanos wait = ledger_->only_this_process_holds() ? std::min(want.wait, Nanos(ledger::kAskWait)) : want.wait;
    ledger_->acquire_in_turn(want.bytes, clock_->now().count(), wait, ledger::kNoMinimumIdle);
  } else if (want.bytes != 0) {  // held for the retry, which keeps it
    ledger_->acquire(want.bytes, clock_->now().count(), ledger::kAskWait, /*partial=*/false,
                     want.device ? ledger::kNoMinimumIdle : ledger::kIdleBeforeAsked);
  }
  if (want.device_full != 0) freed = ask_to_free(want.device_full);
  return freed;
}

std::uint64_t BudgetShare::Room::free_device_memory(std::uint64_t bytes, const Mutex&) const {
  return ask_to_free(bytes);
}

std::uint64_t BudgetShare::Room::ask_to_free(std::uint64_t bytes) const {
  const auto deadline = std::chrono::steady_clock::now() + ledger::kAskWait;
  std::uint64_t freed = 0;
  for (;;) {
    bool asked = false;
    freed += ledger_->ask_to_free(bytes - freed, clock_->now().count(), ledger::kAskWait, ledger::kNoMinimumIdle, &asked);
    if (freed >= bytes || !asked || std::chrono::steady_clock::now() >= deadline) return freed;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

std::uint64_t BudgetShare::Room::over_budget() const { return ledger_->over_budget(); }

void BudgetShare::Room::listen(std::function<void(int asker)> on_asked) const { ledger_->listen(std::move(on_asked)); }

void BudgetShare::Room::stop_listening(const Mutex&) const { ledger_->stop_listening(); }

}  // namespace residency::core
