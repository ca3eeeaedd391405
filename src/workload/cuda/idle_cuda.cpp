// SPDX-License-Identifier: MIT
// The cuda idle target; see idle_cuda.hpp.
#include "workload/cuda/idle_cuda.hpp"

#include <cstring>

#include "backends/cuda/cuda_backend.hpp"
#include "residency/text.hpp"
#include "workload/cuda/gpu_decode.hpp"

namespace residency::workload {
namespace {

class CudaIdleTarget final : public IdleTarget {
 public:
  explicit CudaIdleTarget(std::shared_ptr<cuda::CudaBackend> b) : backend_(std::move(b)) {}
  ~CudaIdleTarget() override {
    pass_.reset();
    if (staging_ != nullptr) {
      cuda::ContextScope scope(d(), backend_->context());
      (void)d().cuMemFreeHost(staging_);
    }
  }

  std::string describe() const override {
    char name[256] = {0};
    (void)d().cuDeviceGetName(name, sizeof name, backend_->device());
    const int v = d().driver_version;
    return std::string("cuda: ") + name + ", driver CUDA " + std::to_string(v / 1000) + "." +
           std::to_string((v % 1000) / 10) +
           "; weights in device memory through Manager::allocate; decode = GPU kernel" +
           (pass_ ? " over " + std::to_string(pass_->matrix_count()) + " matrices, " + format_size(pass_->bytes()) : "");
  }
  Clock& clock() override { return SteadyClock::instance(); }

  Status check_pressure(const Pressure& p) const override {
    if (p.kind == Pressure::Kind::none) return {};
    return Status(ErrorCode::invalid_argument,
                  "the cuda backend keeps the model in device memory, which host memory pressure (" + p.to_string() +
                      ") does not reach; use --pressure none (the default) with --backend cuda");
  }

  Status prepare(const GgufFile& model) override {
    auto pass = GpuDecodePass::create(d(), backend_->context(), model.model());
    if (!pass) return pass.status();
    pass_ = std::move(pass.value());
    section_bytes_ = model.size() - model.model().data_offset;
    // A pinned copy of the weights: each policy's fresh allocation is filled from it at the
    // link's rate, so activating a policy costs milliseconds, not a read of the file.
    cuda::ContextScope scope(d(), backend_->context());
    const CUresult r = d().cuMemHostAlloc(&staging_, section_bytes_, CU_MEMHOSTALLOC_PORTABLE);
    if (r != CUDA_SUCCESS)
      return d().error(r, "pinning a " + format_size(section_bytes_) + " copy of the model", "cuMemHostAlloc");
    std::memcpy(staging_, model.data() + model.model().data_offset, section_bytes_);
    return {};
  }

  Result<std::shared_ptr<Backend>> policy_backend() override { return std::shared_ptr<Backend>(backend_); }

  // Fresh device memory from the policy's manager, filled from the pinned copy; the first time,
  // one pass is checked against the CPU.
  Result<std::vector<RegionId>> place_model(Manager& manager) override {
    if (!pass_) return Status(ErrorCode::invalid_argument, "cuda idle target: place_model() before prepare()");
    auto a = manager.allocate(section_bytes_, RegionClass::weights);
    if (!a) return a.status();
    alloc_ = *a;
    auto give_back = [&](Status st) {
      (void)manager.unregister_region(alloc_.id);
      alloc_ = {};
      return st;
    };
    {
      cuda::ContextScope scope(d(), backend_->context());
      const CUresult r = d().cuMemcpyHtoD(weights(), staging_, section_bytes_);
      if (r != CUDA_SUCCESS) return give_back(d().error(r, "uploading the model", "cuMemcpyHtoD"));
    }
    if (!verified_) {
      auto sum = pass_->run(weights());
      if (!sum) return give_back(sum.status());
      if (Status st = pass_->verify(static_cast<const std::uint8_t*>(staging_)); !st) return give_back(st);
      verified_ = true;
    }
    return std::vector<RegionId>{alloc_.id};
  }

  // The first sleep of an allocation pins its host backup (slower than the copy itself; the
  // rates are in docs/measurements.md), a one-time cost an engine pays once per model, not once
  // per idle pause.
  bool first_release_sets_up() const override { return true; }
  bool decode_needs_residency() const override { return true; }  // unmapped device memory faults
  std::function<void()> synchronize() override {
    return [this] {
      cuda::ContextScope cs(d(), backend_->context());
      (void)d().cuCtxSynchronize();
    };
  }

  Result<double> decode_pass(IdleTime&) override { return pass_->run(weights()); }
  Status apply_pressure(const Pressure& p) override { return check_pressure(p); }
  double resident_fraction() override { return backend_->is_resident(alloc_.ptr) ? 1.0 : 0.0; }

 private:
  const cuda::Driver& d() const { return backend_->driver(); }
  CUdeviceptr weights() const { return static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(alloc_.ptr)); }

  std::shared_ptr<cuda::CudaBackend> backend_;
  std::unique_ptr<GpuDecodePass> pass_;
  void* staging_ = nullptr;
  std::uint64_t section_bytes_ = 0;
  bool verified_ = false;
  Allocation alloc_;  // in the current policy's manager
};

}  // namespace

Result<std::unique_ptr<IdleTarget>> make_cuda_idle_target(const IdleTargetOptions& /*options: none apply*/) {
  auto b = cuda::CudaBackend::create({});
  if (!b) return b.status();
  return std::unique_ptr<IdleTarget>(new CudaIdleTarget(std::move(b.value())));
}

}  // namespace residency::workload
