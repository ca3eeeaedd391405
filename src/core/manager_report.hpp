// SPDX-License-Identifier: MIT
// ManagerReport: what a manager says about itself, in the two forms it is read: Stats (the API,
// the C API, the tool) and the state file (`residency stat --pid`, state_file.hpp).
//
// Why a unit: both forms are views of the same books (Admission's regions, budget and sets,
// ResidencyCycle's counters, the shared budget), and neither changes them. The state file is
// written on changes only, never from touch()'s fast path: at once after a release or a re-wire,
// and for other changes (a registration, a budget change) at most once per kStateCoalesce, by the
// scheduler (an engine that registers 10,000 regions writes a few snapshots, not 10,000: each one
// visits every region and renames a file).
//
// Invariants (guarded by the manager's mutex): dirty_ while the file is older than the books;
// with a scheduler, due_ is when it is written.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "admission.hpp"
#include "keep_alive.hpp"
#include "keep_alive_scheduler.hpp"
#include "log.hpp"
#include "residency/residency.hpp"
#include "residency_cycle.hpp"
#include "state_file.hpp"

namespace residency::core {

class ManagerReport {
 public:
  static constexpr Nanos kStateCoalesce = std::chrono::milliseconds(50);

  ManagerReport(const Config& config, const Capabilities& caps, const Backend& backend, Clock& clock,
                const LogSink& log, const KeepAliveState& ka, const Admission& adm, const ResidencyCycle& cycle)
      : config_(config), caps_(caps), backend_(backend), clock_(clock), log_(log), ka_(ka), adm_(adm), cycle_(cycle) {}

  // The start-up lines: the notes, the collection's settings, the shared budget.
  void log_start(bool managing) const;
  // Starts the state file (Config::state_file) and writes its first snapshot.
  void start_state_file(std::string pressure_source);
  void stop_state_file() { state_.reset(); }  // removes the file
  // The books changed: written within kStateCoalesce (by the scheduler, or at a later change).
  // True when the scheduler must be woken (a snapshot became due).
  bool changed();
  // Written now (a release or a re-wire).
  void publish();
  // For the scheduler: writes a snapshot that is due; returns when the next one is.
  std::optional<Nanos> due();

  Stats stats() const;
  void set_scheduler(const KeepAliveScheduler* s) { scheduler_ = s; }
  // The host tier's ledger this manager's registered model files count against (docs/design.md,
  // "The host tier"): `residency stat` finds the holder's own account under that budget too.
  void set_host_budget(std::string name) { host_budget_ = std::move(name); }

 private:
  const Config& config_;
  const Capabilities& caps_;
  const Backend& backend_;
  Clock& clock_;
  const LogSink& log_;
  const KeepAliveState& ka_;
  const Admission& adm_;
  const ResidencyCycle& cycle_;
  const KeepAliveScheduler* scheduler_ = nullptr;
  std::string host_budget_;
  std::string pressure_src_;
  std::unique_ptr<StateFile> state_;
  bool dirty_ = false;
  Nanos due_{0};
  std::optional<Nanos> written_;
};

}  // namespace residency::core
