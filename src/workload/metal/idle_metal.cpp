// SPDX-License-Identifier: MIT
// The metal idle target; see idle_metal.hpp.
#include "workload/metal/idle_metal.hpp"

#include <optional>
#include <vector>

#include "residency/backends/metal.hpp"
#include "residency/text.hpp"
#include "workload/metal/metal_decode.hpp"
#include "workload/pressure.hpp"

namespace residency::workload {
namespace {

class MetalIdleTarget final : public IdleTarget {
 public:
  explicit MetalIdleTarget(std::shared_ptr<MetalBackend> b) : backend_(std::move(b)) {}
  ~MetalIdleTarget() override {
    pass_.reset();  // before the views it reads
    views_.reset();
  }

  std::string describe() const override {
    const MetalDeviceInfo dev = read_metal_device_info(backend_->device());
    std::string s = "metal: " + dev.name + "; weights = the mapped file";
    if (views_) s += " in " + std::to_string(views_->views().size()) + " no-copy view(s), one region";
    s += "; decode = Metal compute kernel (compiled at run time)";
    if (pass_) s += " over " + std::to_string(pass_->matrix_count()) + " matrices, " + format_size(pass_->bytes());
    return s;
  }
  Clock& clock() override { return SteadyClock::instance(); }

  Status check_pressure(const Pressure& p) const override {
    if (p.kind == Pressure::Kind::none) return {};
    return Status(
        ErrorCode::invalid_argument,
        "--backend metal measures what macOS does on its own after an idle pause; " + p.to_string() +
            " is not available on macOS (pageout is Linux's MADV_PAGEOUT); use --pressure none (the default)");
  }

  Status prepare(const GgufFile& model) override {
    std::vector<Extent> tensors;
    for (const auto& t : model.model().tensors) {
      if (t.n_bytes != 0) tensors.push_back({t.file_offset, t.n_bytes});
    }
    auto views = MetalHostViews::make(backend_->device(), const_cast<std::uint8_t*>(model.data()), model.size(), tensors);
    if (!views) return views.status();
    views_.emplace(std::move(views.value()));
    auto pass = MetalDecodePass::create(backend_->device(), model.model(), *views_);
    if (!pass) return pass.status();
    pass_ = std::move(pass.value());
    // One pass checked against the CPU before anything is timed.
    auto sum = pass_->run();
    if (!sum) return sum.status();
    if (Status st = pass_->verify(model.data()); !st) return st;
    model_ = &model;
    return {};
  }

  Result<std::shared_ptr<Backend>> policy_backend() override { return std::shared_ptr<Backend>(backend_); }
  std::optional<Layout> layout() const override { return Layout::per_buffer; }  // one region, one set

  Result<std::vector<RegionId>> place_model(Manager& manager) override {
    if (!model_) return Status(ErrorCode::invalid_argument, "metal idle target: place_model() before prepare()");
    auto region = manager.register_region(const_cast<std::uint8_t*>(model_->data()), model_->size(),
                                          RegionClass::weights, 0, views_->array());
    if (!region) return region.status();
    return std::vector<RegionId>{*region};
  }

  Result<double> decode_pass(IdleTime&) override { return pass_->run(); }  // waits for the GPU
  Status apply_pressure(const Pressure& p) override { return check_pressure(p); }
  // What macOS unwires is not visible per buffer: unknown.
  double resident_fraction() override { return -1.0; }

 private:
  std::shared_ptr<MetalBackend> backend_;
  const GgufFile* model_ = nullptr;
  std::optional<MetalHostViews> views_;
  std::unique_ptr<MetalDecodePass> pass_;
};

}  // namespace

Result<std::unique_ptr<IdleTarget>> make_metal_idle_target(const IdleTargetOptions& /*options: none apply*/) {
  auto b = make_metal_backend(MetalOptions{});
  if (!b) return b.status();
  return std::unique_ptr<IdleTarget>(new MetalIdleTarget(std::move(b.value())));
}

}  // namespace residency::workload
