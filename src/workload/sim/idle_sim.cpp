// SPDX-License-Identifier: MIT
// The sim idle target: see idle_sim.hpp (and idle_target.hpp for the contract).
#include "workload/sim/idle_sim.hpp"

#include "residency/backends/sim.hpp"
#include "residency/residency.hpp"

namespace residency::workload {
namespace {

// Where the modelled model "lives": a page-aligned address far above anything a process maps
// on x86-64 or arm64 user space layouts in practice. The sim and the manager only compare it.
void* const kModelBase = reinterpret_cast<void*>(std::uintptr_t{1} << 44);

class SimIdleTarget final : public IdleTarget {
 public:
  SimIdleTarget(SimProfile profile, SimIdleOptions sim) : profile_(std::move(profile)), sim_options_(std::move(sim)) {}

  std::string describe() const override {
    return "sim (virtual time), profile " + profile_.name + ": " + profile_.description + "; decaying requests " +
           (sim_options_.decaying_requests ? "on" : "off") + "; decode times are modelled (the model file is not read)";
  }

  Clock& clock() override { return clock_; }
  ManualClock* virtual_clock() override { return &clock_; }

  Status check_pressure(const Pressure& pressure) const override {
    if (pressure.kind == Pressure::Kind::none) return {};
    return Status(ErrorCode::invalid_argument,
                  "the sim backend models the OS's wired-memory collector, not memory pressure; "
                  "--pressure needs --backend posix");
  }

  Status prepare(const GgufFile& /*model: not read, see idle_sim.hpp*/) override {
    prepared_ = true;
    return {};
  }

  // A fresh process per policy: a new SimBackend with one command queue.
  Result<std::shared_ptr<Backend>> policy_backend() override {
    if (!prepared_) return Status(ErrorCode::invalid_argument, "sim idle target: policy_backend() before prepare()");
    SimOptions so;
    so.profile = profile_;
    so.clock = &clock_;
    so.decaying_requests = sim_options_.decaying_requests;
    auto sim = make_sim_backend(so);
    if (!sim) return sim.status();
    auto queue = (*sim)->add_queue();
    if (!queue) return queue.status();
    sim_ = std::move(sim).value();
    queue_ = *queue;
    return std::shared_ptr<Backend>(sim_);
  }
  std::optional<Layout> layout() const override { return Layout::per_buffer; }  // one region, one set (llama.cpp)

  Result<std::vector<RegionId>> place_model(Manager& manager) override {
    auto region = manager.register_region(kModelBase, profile_.model_bytes, RegionClass::weights);
    if (!region) return region.status();
    return std::vector<RegionId>{*region};
  }

  void decode_starts() override { wire_seen_ = sim_->stats().request_wire_time; }

  // One command buffer reading every weight, after the re-wire that the benchmark's touch() (or
  // use scope) paid through a residency request. Virtual time moves by what each step costs, so
  // the collector and the manager see the decode's duration.
  Result<double> decode_pass(IdleTime& time) override {
    time.pass(sim_->stats().request_wire_time - wire_seen_);
    auto d = sim_->run_command_buffer(queue_, {{kModelBase, profile_.model_bytes}}, profile_.decode_compute);
    if (!d) return d.status();
    time.pass(*d);
    return static_cast<double>(profile_.model_bytes);  // nothing is read; the size stands in
  }

  Status apply_pressure(const Pressure& pressure) override { return check_pressure(pressure); }

  double resident_fraction() override {
    return static_cast<double>(sim_->wired_bytes(kModelBase)) / static_cast<double>(profile_.model_bytes);
  }

 private:
  SimProfile profile_;
  SimIdleOptions sim_options_;
  ManualClock clock_;  // outlives every manager the benchmark runs on it
  bool prepared_ = false;
  std::shared_ptr<SimBackend> sim_;  // the current policy's
  SimBackend::QueueId queue_ = 0;
  Nanos wire_seen_{0};
};

}  // namespace

Result<std::unique_ptr<IdleTarget>> make_sim_idle_target(const SimIdleOptions& sim) {
  SimProfile profile = default_sim_profile();
  if (!sim.profile.empty()) {
    auto p = sim_profile(sim.profile);
    if (!p) return p.status();
    profile = std::move(p).value();
  }
  return std::unique_ptr<IdleTarget>(new SimIdleTarget(std::move(profile), sim));
}

}  // namespace residency::workload
