// SPDX-License-Identifier: MIT
// Where the ledger cannot work (not Linux: no futexes, OFD locks or /proc; or a build with
// RESIDENCY_LEDGER_UNSUPPORTED): attach() refuses with a message, everything else does nothing.
#include "ledger.hpp"

#include "ledger_file.hpp"

#if !RESIDENCY_LEDGER_LINUX

#include "residency/shared_budget.hpp"

namespace residency::ledger {

struct Ledger::Shared {};

std::uint64_t process_start_time(int) { return 0; }
int lock_owner(const std::string&) { return 0; }
bool holder_alive(int, std::uint64_t) { return false; }

Result<std::unique_ptr<Ledger>> Ledger::attach(const AttachOptions&) {
  return Status(ErrorCode::unsupported,
                "RESIDENCY_SHARED_BUDGET: shared budgets between processes need Linux (a futex per holder, "
                "/proc for process identity); this build's platform has neither: unset it");
}
Ledger::~Ledger() = default;
void Ledger::listen(OnAsked) {}
bool Ledger::mine() const { return true; }
void Ledger::stop_listening() {}
void Ledger::detach_at_exit() {}
std::uint64_t Ledger::budget() const { return 0; }
void Ledger::publish_last_use(void*, std::int64_t) noexcept {}
std::uint64_t Ledger::acquire(std::uint64_t, std::int64_t, Nanos, bool, Nanos) { return 0; }
std::uint64_t Ledger::acquire_in_turn(std::uint64_t, std::int64_t, Nanos, Nanos) { return 0; }
std::string Ledger::others_holding() const { return {}; }
bool Ledger::only_this_process_holds() const { return false; }
std::uint64_t Ledger::ask_to_free(std::uint64_t, std::int64_t, Nanos, Nanos, bool*) { return 0; }
std::uint64_t Ledger::over_budget() const { return 0; }
bool Ledger::repay_turn() { return false; }
void Ledger::set_floor(std::uint64_t) {}
void Ledger::set_shared_key(std::uint64_t) {}
std::uint64_t Ledger::take_over_budget(std::uint64_t) { return 0; }
std::string Ledger::problem() const { return {}; }
bool Ledger::usable() const { return false; }
void Ledger::release(std::uint64_t) {}
void Ledger::listen_loop(ListenerState&) {}

}  // namespace residency::ledger

namespace residency {
void cancel_shared_budget_waits() noexcept {}
std::vector<SharedBudgetInfo> list_shared_budgets() { return {}; }
}  // namespace residency

#endif  // !RESIDENCY_LEDGER_LINUX
