// SPDX-License-Identifier: MIT
// The posix idle target: the model is a read-only shared mapping of the GGUF file (as llama.cpp
// maps weights), registered with each policy's manager over the posix backend (mlock) on real
// time; a decode is the CPU decode-equivalent pass, and pressure is MADV_PAGEOUT or a memory hog
// (see idle_target.hpp for the contract).
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

  Result<std::shared_ptr<Backend>> policy_backend() override { return backend_; }
  std::optional<Layout> layout() const override { return Layout::per_buffer; }  // one region, one set

  Result<std::vector<RegionId>> place_model(Manager& manager) override {
    if (!model_) return Status(ErrorCode::invalid_argument, "posix idle target: place_model() before prepare()");
    auto region = manager.register_region(const_cast<std::uint8_t*>(model_->data()), model_->size(), RegionClass::weights);
    if (!region) return region.status();
    return std::vector<RegionId>{*region};
  }

  Result<double> decode_pass(IdleTime&) override { return pass_->run(); }

  Status apply_pressure(const Pressure& pressure) override {
    if (pressure.kind == Pressure::Kind::pageout) {
      auto r = page_out(model_->data(), model_->size(), model_->fd());
      return r ? Status{} : r.status();
    }
    if (pressure.kind == Pressure::Kind::hog) {
      auto run = run_hog(pressure.hog_bytes);
      if (!run) return run.status();
      last_hog_ = *run;
    }
    return {};
  }
  std::optional<HogRun> last_hog() const override { return last_hog_; }

  double resident_fraction() override {
    auto resident = workload::resident_fraction(model_->data(), model_->size());
    return resident ? *resident : -1.0;
  }

 private:
  std::shared_ptr<Backend> backend_;
  IdleTargetOptions options_;
  const GgufFile* model_ = nullptr;
  std::unique_ptr<DecodePass> pass_;
  std::optional<HogRun> last_hog_;
};

}  // namespace

Result<std::unique_ptr<IdleTarget>> make_posix_idle_target(const IdleTargetOptions& options) {
  auto backend = make_backend("posix");
  if (!backend) return backend.status();
  return std::unique_ptr<IdleTarget>(new PosixIdleTarget(std::move(backend).value(), options));
}

}  // namespace residency::workload
