// The cuda idle target; see idle_cuda.hpp.
#include "workload/cuda/idle_cuda.hpp"

#include <chrono>
#include <cstring>
#include <thread>

#include "backends/cuda/cuda_backend.hpp"
#include "workload/cuda/gpu_decode.hpp"

namespace residency::workload {
namespace {

class CudaIdleTarget final : public IdleTarget {
 public:
  CudaIdleTarget(std::shared_ptr<cuda::CudaBackend> b, IdleTargetOptions o) : backend_(std::move(b)), opts_(std::move(o)) {}
  ~CudaIdleTarget() override {
    deactivate();
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
           std::to_string((v % 1000) / 10) + "; weights in device memory through Manager::allocate; decode = GPU kernel" +
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
    if (r != CUDA_SUCCESS) return d().error(r, "pinning a " + format_size(section_bytes_) + " copy of the model", "cuMemHostAlloc");
    std::memcpy(staging_, model.data() + model.model().data_offset, section_bytes_);
    return {};
  }

  Status activate(const IdlePolicy& policy) override {
    deactivate();
    policy_ = policy;
    ManagerOptions mo = policy_manager_options(policy, opts_, backend_);
    auto m = Manager::create(std::move(mo));
    if (!m) return m.status();
    manager_ = std::move(m.value());
    auto a = manager_->allocate(section_bytes_, RegionClass::weights);
    if (!a) return a.status();
    alloc_ = *a;
    {
      cuda::ContextScope scope(d(), backend_->context());
      const CUresult r = d().cuMemcpyHtoD(weights(), staging_, section_bytes_);
      if (r != CUDA_SUCCESS) return d().error(r, "uploading the model", "cuMemcpyHtoD");
    }
    if (!verified_) {
      auto sum = pass_->run(weights());
      if (!sum) return sum.status();
      if (Status st = pass_->verify(static_cast<const std::uint8_t*>(staging_)); !st) return st;
      verified_ = true;
    }
    // One sleep and wake before timing anything: the first sleep of an allocation pins its
    // host backup (about 2 GB/s on the H200 host measured here, 30 times slower than the copy),
    // a one-time cost an engine pays once per model, not once per idle pause.
    if (policy.kind == IdlePolicy::Kind::zero) {
      auto scope = manager_->use();  // its end releases (policy 0); the next use wakes
    } else if (policy.kind != IdlePolicy::Kind::off) {
      manager_->release_now();
      manager_->touch();
    }
    return {};
  }

  void deactivate() override {
    if (!manager_) return;
    (void)manager_->unregister_region(alloc_.id);
    manager_.reset();
    alloc_ = {};
  }

  Result<PauseOutcome> pause(Nanos duration, const Pressure&) override {
    PauseOutcome out;
    const Nanos t0 = clock().now();
    if (duration.count() > 0) std::this_thread::sleep_for(duration);
    out.idle = clock().now() - t0;
    out.resident_before = backend_->is_resident(alloc_.ptr) ? 1.0 : 0.0;
    return out;
  }

  Result<DecodeOutcome> decode() override {
    if (!manager_) return Status(ErrorCode::invalid_argument, "decode() before activate()");
    DecodeOutcome out;
    const Nanos t0 = clock().now();
    Result<double> sum = 0.0;
    if (policy_.kind == IdlePolicy::Kind::zero) {
      auto scope = manager_->use([this] {
        cuda::ContextScope cs(d(), backend_->context());
        (void)d().cuCtxSynchronize();
      });
      if (!scope.status()) return scope.status();
      sum = pass_->run(weights());
      out.elapsed = clock().now() - t0;  // before the scope's release, as llama-idle times it
    } else {
      manager_->touch();
      sum = pass_->run(weights());
      out.elapsed = clock().now() - t0;
    }
    if (!sum) return sum.status();
    out.checksum = *sum;
    return out;
  }

 private:
  const cuda::Driver& d() const { return backend_->driver(); }
  CUdeviceptr weights() const { return static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(alloc_.ptr)); }

  std::shared_ptr<cuda::CudaBackend> backend_;
  IdleTargetOptions opts_;
  std::unique_ptr<GpuDecodePass> pass_;
  void* staging_ = nullptr;
  std::uint64_t section_bytes_ = 0;
  bool verified_ = false;
  IdlePolicy policy_;
  std::unique_ptr<Manager> manager_;
  Allocation alloc_;
};

}  // namespace

Result<std::unique_ptr<IdleTarget>> make_cuda_idle_target(const IdleTargetOptions& options) {
  auto b = cuda::CudaBackend::create({});
  if (!b) return b.status();
  return std::unique_ptr<IdleTarget>(new CudaIdleTarget(std::move(b.value()), options));
}

}  // namespace residency::workload
