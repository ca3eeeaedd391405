// SPDX-License-Identifier: MIT
// BudgetShare: this manager's share of a machine-wide budget (RESIDENCY_SHARED_BUDGET, and the
// ledger of each GPU under RESIDENCY_GPU_BUDGET). The one core unit that talks to the ledger:
// joining it, reserving before anything is wired or allocated, asking the other holders for room,
// waking device memory over the budget and repaying that debt, pacing a wake, the floor of device
// memory no ask can get back, and giving back what is no longer needed (docs/design.md, "The shared
// budget" and "The GPU budget").
//
// It keeps no books of regions: what this manager admitted and wired is Admission's, handed in as a
// Demand at each call, so that the share decides only how much the ledger must hold and what to do
// when it cannot.
//
// Two faces, and the compiler checks which is used where (clang -Wthread-safety):
//   - BudgetShare itself runs under the manager's lock and never waits on another process (the one
//     exception, pace(), is named there). Admission owns it, and Admission is guarded by the
//     manager's lock, so no call can reach it without that lock.
//   - BudgetShare::Room asks the other holders and waits for their answers. The manager holds it
//     beside Admission, unguarded, and every call that may wait names the manager's lock as one
//     it must not hold (RESIDENCY_EXCLUDES), so calling it with the lock held does not compile.
// Both faces share the ledger; the ledger's own methods are thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "keep_alive.hpp"
#include "log.hpp"
#include "platform/thread_annotations.hpp"
#include "residency/backend.hpp"
#include "residency/clock.hpp"
#include "residency/config.hpp"

namespace residency::ledger {
class Ledger;
}

namespace residency::core {

// What Admission's books say the ledger must cover, read at each call.
struct Demand {
  std::uint64_t admitted = 0;   // charged bytes of the admitted regions (wired, or at the next commit)
  std::uint64_t requested = 0;  // bytes the backend holds wired now
  bool wants_resident = false;  // the policy wants the memory resident (KeepAliveState)
  bool in_call = false;         // an engine call or use scope is open (KeepAliveState::calls())
};

class BudgetShare {
 public:
  // The ledger Config::shared_budget names, joined (null when it names none): both faces of the
  // share are made from it (the constructor, room()), and the time of last use is published into
  // it (publisher()).
  using Joined = std::shared_ptr<ledger::Ledger>;
  static Result<Joined> join(const Config& config, const MemoryInfo& mem, const std::string& backend);
  // `paced_wake`: Capabilities::paced_wake of the backend. `clock`: the manager's, whose times the
  // ledger is given (a test's manual one included). `log` outlives the share. `wait`:
  // Config::budget_wait: nullopt, device memory the others could not make room for wakes over the
  // budget; else it waits its turn that long at most, then is refused (strict()).
  BudgetShare(Joined ledger, int priority, bool paced_wake, Clock& clock, const LogSink& log,
              std::optional<Nanos> wait = std::nullopt);
  ~BudgetShare();
  BudgetShare(const BudgetShare&) = delete;
  BudgetShare& operator=(const BudgetShare&) = delete;

  // --- under the manager's lock: never waits -----------------------------------------------
  // What the ledger must hold now: while the policy wants the memory resident, everything admitted
  // plus what reserve_ahead() holds for an allocation; otherwise what the backend still has wired;
  // plus the unmanaged floor.
  std::uint64_t needed(const Demand& d) const;
  // Reserves room for `more` bytes on top of needed(d), before they can be wired. False: they must
  // wait; on a first attempt at a full budget, take_room_wanted() says how much to ask for. Device
  // memory (`device`) that finds the budget full after the others were asked wakes over it.
  bool reserve(const Demand& d, std::uint64_t more, bool device);
  // Device memory about to be allocated: reserved before the allocation (a full GPU cannot
  // allocate and then ask). `unmanaged`: Backend::unmanaged_device_bytes() now.
  bool reserve_ahead(const Demand& d, std::uint64_t bytes, std::uint64_t unmanaged);
  // A region of device memory takes over up to `bytes` of what reserve_ahead() holds (returned:
  // how much), or gives them back to it when it could not be admitted (untake_ahead()).
  std::uint64_t take_ahead(std::uint64_t bytes);
  void untake_ahead(std::uint64_t bytes) { ahead_ += bytes; }
  // The allocation is over (tracked, or failed): what it reserved ahead and nobody took goes back.
  void end_ahead(const Demand& d, std::uint64_t bytes);
  // Gives back to the ledger what is no longer needed.
  void settle(const Demand& d);
  // Every byte given back (the sets are gone: nothing is wired).
  void release_all();
  // Device memory outside its allocations (a GPU context), awake whatever the policy says.
  void count_unmanaged(std::uint64_t bytes);

  // Before the sets are requested. What the ledger cannot give now:
  //   go:       wire (the ledger holds enough, device memory woke over the budget, or a paced
  //             wake begins in the room there is: pacing());
  //   wait:     device memory, first attempt: do not request; the others are asked first;
  //   evict_to: host memory: keep admitted only what fits in `keep` bytes, then call short_by().
  struct WirePlan {
    enum class Step { go, wait, evict_to } step = Step::go;
    std::uint64_t keep = 0, missing = 0;
  };
  WirePlan plan_wire(const Demand& d, bool device_memory, std::uint64_t unmanaged);
  // The reservation came back `need` bytes short and `bytes` stay unwired: on a first attempt at a
  // full budget, remembered as room to ask for; else said once in the log (why, and what to do).
  void short_by(std::uint64_t need, std::uint64_t bytes);
  // True on a first attempt at a full budget: the others are asked before anything else.
  bool asking() const;
  // Device memory that could not wake because the device itself is full (the budget had room).
  void note_device_full(std::uint64_t bytes) { device_full_ += bytes; }
  // The strict budget (RESIDENCY_BUDGET_WAIT is a duration): device memory never goes over it.
  bool strict() const { return wait_.has_value(); }
  // Whether what `d` needs is held (always in the `over` mode): an allocation that reserved ahead
  // and still is not covered after its wait is refused (refusal() says why).
  bool covers(const Demand& d) const { return !strict() || held() >= needed(d); }
  // Why `bytes` of device memory were refused: the budget, the wait, and who holds it.
  std::string refusal(std::uint64_t bytes) const;

  // A paced wake (Capabilities::paced_wake) begun by plan_wire(): the backend calls pace() before
  // each piece it maps. THE ONE WAIT UNDER THE MANAGER'S LOCK: a piece the room held does not cover
  // asks the other holders and waits for them (the wake the engine waits for is this call), while
  // the copies of the pieces already mapped go on.
  bool pacing() const { return pacing_; }
  void pace(std::uint64_t bytes);
  // The paced wake is over (also when it threw): the backend calls pace() no more.
  void stop_pacing() { pacing_ = false; }
  // After it returned: what its pieces did not take is reserved (or woken over) now.
  void end_paced_wake(const Demand& d);
  // Bytes the last paced wake began with before room was made (0: none), taken once.
  std::uint64_t take_paced_head() { return std::exchange(paced_head_, 0); }

  // What this call's first attempt wants asked of the others (Room::make), taken once.
  struct RoomWanted {
    std::uint64_t bytes = 0;        // room in the budget
    bool device = false;            // for device memory: any holder not inside a call is asked
    std::uint64_t device_full = 0;  // device memory the device lacked (Ledger::ask_to_free)
    // Strict: the room is waited for in turn (Ledger::acquire_in_turn), at most `wait` (0 for a
    // holder inside a call with memory awake: it never waits for the budget, so that two such
    // holders cannot wait for each other).
    bool in_turn = false;
    Nanos wait{0};
    bool any() const { return bytes != 0 || device_full != 0; }
  };
  RoomWanted take_room_wanted();
  // After Room::make: the next attempt says what still does not fit, unless `keep_asking` (the
  // device was full and the holders asked gave memory back, which another waker may take first).
  void begin_retry(bool keep_asking);
  // The call is over: the next one starts with a first attempt.
  void end_call();
  // A flush committed what changed: the next reservation may try the ledger again.
  void end_flush() { full_ = false; }
  // The process is exiting: nothing more is reserved (and so nothing more wired).
  void begin_exit() { exiting_ = true; }
  // At process exit, once nothing is held: leave the ledger (Ledger::detach_at_exit).
  void detach_at_exit();
  // Whether this holder repays the budget's debt now (Ledger::repay_turn).
  bool repay_turn();

  // How long a holder must have been idle before an ask gets its memory: device memory any time it
  // is not inside a call, host memory after a second (ledger::kIdleBeforeAsked).
  static Nanos idle_before_giving_back(bool device_holder);
  // The words of a release another process asked for (`idle`: how long this one was idle), and of
  // a release that repays the budget's debt (`over`: by how much the holders' sum exceeds it).
  std::string why_asked(int asker, Nanos idle) const;
  std::string why_repaying(std::uint64_t over) const;

  // --- what it says (the report, the log) -------------------------------------------------
  const std::string& name() const;
  const std::string& path() const;
  std::uint64_t budget() const;
  std::uint64_t held() const;
  std::uint64_t requested_budget() const;
  std::uint64_t asks_sent() const;
  int priority() const { return priority_; }
  std::uint64_t short_count() const { return short_count_; }  // reservations that stayed short
  std::uint64_t over_count() const { return over_count_; }    // wakes over the budget
  // What KeepAliveState publishes each time of last use through (the ledger's slot; none without).
  static LastUsePublisher publisher(const Joined& ledger);

  // --- without the manager's lock: may wait ---------------------------------------------------
  class Room {
   public:
    // Asks the other holders for what take_room_wanted() said, and waits for them (boundedly):
    // room in the budget is then held for the retry; for device memory the device lacked, returns
    // the bytes the holders asked gave back.
    std::uint64_t make(const RoomWanted& want, const Mutex& manager_lock) const RESIDENCY_EXCLUDES(manager_lock);
    // Asks the other holders to give back `bytes` of device memory the device itself lacks, again
    // and again for up to ledger::kAskWait (a holder inside a call declines, and gives way once its
    // call ends). Stops at once when nobody holds anything to ask for. Returns the bytes given back.
    std::uint64_t free_device_memory(std::uint64_t bytes, const Mutex& manager_lock) const
        RESIDENCY_EXCLUDES(manager_lock);
    // How far the holders' sum exceeds the budget now (a pread: no lock, no wait; 0 within it).
    std::uint64_t over_budget() const;
    // Starts the ledger's thread that answers asks; `on_asked` runs there and takes the manager's
    // lock itself (boundedly).
    void listen(std::function<void(int asker)> on_asked) const;
    // Stops that thread, waiting for an answer in progress (which may wait for the manager's lock).
    void stop_listening(const Mutex& manager_lock) const RESIDENCY_EXCLUDES(manager_lock);

   private:
    friend class BudgetShare;
    Room(std::shared_ptr<ledger::Ledger> l, Clock& c) : ledger_(std::move(l)), clock_(&c) {}
    std::uint64_t ask_to_free(std::uint64_t bytes) const;
    std::shared_ptr<ledger::Ledger> ledger_;
    Clock* clock_;
  };
  // The waiting face of the share made from `ledger` (none without one).
  static std::optional<Room> room(const Joined& ledger, Clock& clock);

 private:
  bool over_budget(std::uint64_t bytes);  // wakes `bytes` over the budget; false: not even that
  bool refuse(std::uint64_t bytes);       // strict: `bytes` of device memory stay asleep; says why once
  void note(const Demand& d) { awake_in_call_ = d.in_call && d.requested > 0; }

  const std::shared_ptr<ledger::Ledger> ledger_;
  const int priority_;
  const bool paced_wake_;
  Clock& clock_;  // the manager's: the ledger is given its time
  const LogSink& log_;
  const std::optional<Nanos> wait_;
  bool awake_in_call_ = false;   // the last demand: inside a call with memory awake (never waits)
  std::uint64_t unmanaged_ = 0;  // Backend::unmanaged_device_bytes() when last read (the floor)
  std::uint64_t ahead_ = 0;      // reserve_ahead()'s bytes, not yet a region's
  bool full_ = false;            // a reservation came back short: no further try until a flush
  bool exiting_ = false;
  bool first_attempt_ = true;  // no holder has been asked in this call yet
  std::uint64_t room_wanted_ = 0;
  bool room_for_device_ = false;
  std::uint64_t device_full_ = 0;
  // A paced wake: credit is reserved bytes its pieces may still take; owed what the ledger lacks.
  bool pacing_ = false;
  std::uint64_t pace_credit_ = 0, pace_owed_ = 0, paced_head_ = 0;
  std::uint64_t short_count_ = 0, over_count_ = 0;
  bool warned_full_ = false, warned_problem_ = false, warned_over_ = false, warned_refused_ = false;
};

}  // namespace residency::core
