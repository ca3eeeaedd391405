// The sim idle target: see idle_sim.hpp (and idle_target.hpp for the contract).
#include "workload/sim/idle_sim.hpp"

#include <optional>

#include "residency/backends/sim.hpp"
#include "residency/residency.hpp"

namespace residency::workload {
namespace {

// Where the modelled model "lives": a page-aligned address far above anything a process maps
// on x86-64 or arm64 user space layouts in practice. The sim and the manager only compare it.
void* const kModelBase = reinterpret_cast<void*>(std::uintptr_t{1} << 44);

class SimIdleTarget final : public IdleTarget {
 public:
  SimIdleTarget(SimProfile profile, SimIdleOptions sim, IdleTargetOptions options)
      : profile_(std::move(profile)), sim_options_(std::move(sim)), options_(std::move(options)) {}
  ~SimIdleTarget() override { deactivate(); }

  std::string describe() const override {
    return "sim (virtual time), profile " + profile_.name + ": " + profile_.description +
           "; decaying requests " + (sim_options_.decaying_requests ? "on" : "off") +
           "; decode times are modelled (the model file is not read)";
  }

  Clock& clock() override { return clock_; }

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

  Status activate(const IdlePolicy& policy) override {
    if (!prepared_) return Status(ErrorCode::invalid_argument, "sim idle target: activate() before prepare()");
    deactivate();
    policy_ = policy;
    SimOptions so;
    so.profile = profile_;
    so.clock = &clock_;
    so.decaying_requests = sim_options_.decaying_requests;
    auto sim = make_sim_backend(so);
    if (!sim) return sim.status();
    sim_ = std::move(sim).value();
    auto queue = sim_->add_queue();
    if (!queue) return queue.status();
    queue_ = *queue;

    ManagerOptions mo = policy_manager_options(policy, options_, sim_);
    mo.config.layout = Layout::per_buffer;  // one region, one set (llama.cpp)
    mo.clock = &clock_;
    mo.start_scheduler = false;  // virtual time: step() runs what is due
    auto manager = Manager::create(std::move(mo));
    if (!manager) return manager.status();
    manager_ = std::move(manager).value();
    auto region = manager_->register_region(kModelBase, profile_.model_bytes, RegionClass::weights);
    if (!region) {
      manager_.reset();
      return region.status();
    }
    region_ = *region;
    return {};
  }

  void deactivate() override {
    if (!manager_) return;
    (void)manager_->unregister_region(region_);
    manager_.reset();
    sim_.reset();
    region_ = 0;
  }

  Result<PauseOutcome> pause(Nanos duration, const Pressure& pressure) override {
    if (Status st = check_pressure(pressure); !st) return st;
    if (!manager_) return Status(ErrorCode::invalid_argument, "sim idle target: pause() before activate()");
    PauseOutcome out;
    const Nanos start = clock_.now();
    step(duration);
    out.idle = clock_.now() - start;
    out.resident_before = static_cast<double>(sim_->wired_bytes(kModelBase)) /
                          static_cast<double>(profile_.model_bytes);
    return out;
  }

  // One decode as an engine does it: touch() (or a use scope under policy 0), which may re-wire
  // through a residency request, then one command buffer reading every weight. Virtual time
  // moves by what each step costs, so the collector and the manager see the decode's duration.
  Result<DecodeOutcome> decode() override {
    if (!manager_) return Status(ErrorCode::invalid_argument, "sim idle target: decode() before activate()");
    DecodeOutcome out;
    const Nanos t0 = clock_.now();
    Status failed;
    auto pass = [&] {
      const Nanos wire = sim_->stats().request_wire_time - wire_seen_;
      wire_seen_ = sim_->stats().request_wire_time;
      step(wire);
      auto d = sim_->run_command_buffer(queue_, {{kModelBase, profile_.model_bytes}}, profile_.decode_compute);
      if (!d) {
        failed = d.status();
        return;
      }
      step(*d);
    };
    wire_seen_ = sim_->stats().request_wire_time;
    if (policy_.kind == IdlePolicy::Kind::zero) {
      UseScope scope = manager_->use();
      pass();
      out.elapsed = clock_.now() - t0;  // before the scope's release, as the contract says
    } else {
      manager_->touch();
      pass();
      out.elapsed = clock_.now() - t0;
    }
    if (!failed.is_ok()) return failed;
    out.checksum = static_cast<double>(profile_.model_bytes);  // nothing is read; the size stands in
    return out;
  }

 private:
  // Advances virtual time by d, stopping at every deadline the manager reports (refresh,
  // keep-alive expiry) to run what is due then.
  void step(Nanos d) {
    const Nanos until = clock_.now() + d;
    // Bounded: a manager that stopped moving its deadline must not hang the benchmark.
    for (int i = 0; i < 10'000'000; ++i) {
      const std::optional<Nanos> next = manager_->run_due();
      if (!next || *next > until) break;
      clock_.set(*next);
    }
    clock_.set(until);
    manager_->run_due();
  }

  SimProfile profile_;
  SimIdleOptions sim_options_;
  IdleTargetOptions options_;
  ManualClock clock_;
  bool prepared_ = false;
  IdlePolicy policy_;
  std::shared_ptr<SimBackend> sim_;
  SimBackend::QueueId queue_ = 0;
  std::unique_ptr<Manager> manager_;  // destroyed before sim_ and clock_ (declared after them)
  RegionId region_ = 0;
  Nanos wire_seen_{0};
};

}  // namespace

Result<std::unique_ptr<IdleTarget>> make_sim_idle_target(const IdleTargetOptions& options,
                                                         const SimIdleOptions& sim) {
  SimProfile profile = default_sim_profile();
  if (!sim.profile.empty()) {
    auto p = sim_profile(sim.profile);
    if (!p) return p.status();
    profile = std::move(p).value();
  }
  return std::unique_ptr<IdleTarget>(new SimIdleTarget(std::move(profile), sim, options));
}

}  // namespace residency::workload
