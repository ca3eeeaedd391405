// The posix idle target: the model is a read-only shared mapping of the GGUF file (as llama.cpp
// maps weights), residency is the posix backend's mlock driven by a real residency::Manager on
// real time, a decode is the CPU decode-equivalent pass, and pressure is MADV_PAGEOUT or a memory
// hog (see idle_target.hpp for the contract).
#include <condition_variable>
#include <mutex>

#include "residency/backends.hpp"
#include "residency/residency.hpp"
#include "workload/decode_pass.hpp"
#include "workload/idle_target.hpp"

namespace residency::workload {
namespace {

class PosixIdleTarget final : public IdleTarget {
 public:
  PosixIdleTarget(std::shared_ptr<Backend> backend, IdleTargetOptions options)
      : backend_(std::move(backend)), options_(std::move(options)) {}
  ~PosixIdleTarget() override { deactivate(); }

  std::string describe() const override {
    std::string s = "posix (mlock), decode on the CPU";
    if (pass_) {
      s += ": " + std::to_string(pass_->threads()) + " threads, " + std::string(to_string(pass_->isa())) + " kernels";
    }
    return s;
  }

  Clock& clock() override { return SteadyClock::instance(); }

  Status check_pressure(const Pressure& pressure) const override {
    switch (pressure.kind) {
      case Pressure::Kind::none: return {};
      case Pressure::Kind::pageout: return pageout_supported();
      case Pressure::Kind::hog: return check_hog_fits(pressure.hog_bytes);
    }
    return {};
  }

  Status prepare(const GgufFile& model) override {
    auto pass = DecodePass::create(model.model(), model.data(), {options_.threads, std::nullopt});
    if (!pass) return pass.status();
    pass_ = std::move(pass).value();
    model_ = &model;
    return {};
  }

  Status activate(const IdlePolicy& policy) override {
    deactivate();
    policy_ = policy;
    ManagerOptions mo = policy_manager_options(policy, options_, backend_);
    mo.config.layout = Layout::per_buffer;  // one region, one set
    mo.clock = &clock();
    auto manager = Manager::create(std::move(mo));
    if (!manager) return manager.status();
    manager_ = std::move(manager).value();
    auto region = manager_->register_region(const_cast<std::uint8_t*>(model_->data()), model_->size(),
                                            RegionClass::weights);
    if (!region) {
      manager_.reset();
      return region.status();
    }
    region_ = *region;
    // keep-alive and forever wire at registration; tell the user when the backend could not,
    // since the column then measures nothing but `off` (the backend's warning says why).
    if ((policy.kind == IdlePolicy::Kind::keep_alive || policy.kind == IdlePolicy::Kind::forever) &&
        !warned_unwired_) {
      const Stats st = manager_->stats();
      if (st.wired_bytes < model_->size() && options_.log) {
        warned_unwired_ = true;
        options_.log(LogLevel::warn, "policy " + policy.name + ": only " + format_size(st.wired_bytes) + " of the " +
                                         format_size(model_->size()) +
                                         " model could be wired (see the warning above); its column is not "
                                         "what the policy would give");
      }
    }
    return {};
  }

  void deactivate() override {
    if (!manager_) return;
    (void)manager_->unregister_region(region_);
    manager_.reset();
    region_ = 0;
  }

  Result<PauseOutcome> pause(Nanos duration, const Pressure& pressure) override {
    PauseOutcome out;
    Clock& c = clock();
    const Nanos start = c.now();
    const Nanos deadline = start + duration;
    {
      std::mutex m;
      std::condition_variable cv;
      std::unique_lock<std::mutex> lock(m);
      while (c.now() < deadline) c.wait_until(lock, cv, deadline);
    }
    if (duration.count() > 0 && pressure.kind != Pressure::Kind::none) {
      const Nanos p0 = c.now();
      if (pressure.kind == Pressure::Kind::pageout) {
        auto r = page_out(model_->data(), model_->size(), model_->fd());
        if (!r) return r.status();
      } else {
        if (Status st = run_hog(pressure.hog_bytes); !st) return st;
      }
      out.pressure_time = c.now() - p0;
    }
    out.idle = c.now() - start;
    auto resident = resident_fraction(model_->data(), model_->size());
    out.resident_before = resident ? *resident : -1.0;
    return out;
  }

  Result<DecodeOutcome> decode() override {
    DecodeOutcome out;
    Clock& c = clock();
    if (!manager_) return Status(ErrorCode::invalid_argument, "decode() before activate()");
    const Nanos t0 = c.now();
    if (policy_.kind == IdlePolicy::Kind::zero) {
      UseScope scope = manager_->use();
      out.checksum = pass_->run();
      out.elapsed = c.now() - t0;
      if (!scope.status() && !warned_scope_ && options_.log) {
        warned_scope_ = true;
        options_.log(LogLevel::warn, "policy 0: the model could not be wired for the decode: " + scope.status().message());
      }
    } else {
      manager_->touch();
      out.checksum = pass_->run();
      out.elapsed = c.now() - t0;
    }
    return out;
  }

 private:
  std::shared_ptr<Backend> backend_;
  IdleTargetOptions options_;
  const GgufFile* model_ = nullptr;
  std::unique_ptr<DecodePass> pass_;
  std::unique_ptr<Manager> manager_;
  RegionId region_ = 0;
  IdlePolicy policy_;
  bool warned_unwired_ = false;
  bool warned_scope_ = false;
};

}  // namespace

Result<std::unique_ptr<IdleTarget>> make_posix_idle_target(const IdleTargetOptions& options) {
  auto backend = make_backend("posix");
  if (!backend) return backend.status();
  return std::unique_ptr<IdleTarget>(new PosixIdleTarget(std::move(backend).value(), options));
}

}  // namespace residency::workload
