// SPDX-License-Identifier: MIT
// The GPU decode-equivalent pass (workload/cuda/gpu_decode.hpp) computes what the CPU computes,
// for every weight type the pass accepts, on a small synthetic llama model; and the cuda idle
// target refuses host memory pressure with a message that names the fix.
#include <unistd.h>

#include <cmath>
#include <filesystem>

#include "cuda_test_support.hpp"
#include "workload/cuda/gpu_decode.hpp"
#include "workload/cuda/idle_cuda.hpp"
#include "workload/gguf_writer.hpp"

namespace residency::cuda::testing {
namespace {

using workload::GgmlType;

class GpuDecodeTest : public CudaTest, public ::testing::WithParamInterface<GgmlType> {};

TEST_P(GpuDecodeTest, MatchesTheCpuReferenceAndRepeats) {
  auto shape = workload::plan_llama_shape(48 * kMiB, GetParam());
  ASSERT_TRUE(shape) << shape.message();
  std::string dir = (std::filesystem::temp_directory_path() / "residency-gpu-decode-XXXXXX").string();
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  const std::string path = dir + "/model.gguf";
  ASSERT_TRUE(workload::write_synthetic_model(path, *shape));
  {
    auto file = workload::GgufFile::open(path);
    ASSERT_TRUE(file) << file.message();
    auto pass = workload::GpuDecodePass::create(d(), backend_->context(), file->model());
    ASSERT_TRUE(pass) << pass.message();
    const std::uint64_t bytes = file->size() - file->model().data_offset;
    const std::uint8_t* section = file->data() + file->model().data_offset;
    void* dev = allocate_filled(*backend_, bytes, RegionClass::weights, 1);
    ASSERT_NE(dev, nullptr);
    {
      ContextScope scope(d(), backend_->context());
      ASSERT_EQ(d().cuMemcpyHtoD(dptr(dev), section, bytes), CUDA_SUCCESS);
    }
    auto first = (*pass)->run(dptr(dev));
    ASSERT_TRUE(first) << first.message();
    EXPECT_TRUE((*pass)->verify(section)) << (*pass)->verify(section).message();
    auto second = (*pass)->run(dptr(dev));
    ASSERT_TRUE(second);
    EXPECT_NEAR(*first, *second, 1e-6 * std::fabs(*first) + 1e-9) << "same weights, same inputs";
    EXPECT_GE((*pass)->bytes(), bytes * 9 / 10) << "the pass should read (nearly) every weight byte";
    backend_->deallocate(dev);
  }
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Types, GpuDecodeTest,
                         ::testing::Values(GgmlType::f32, GgmlType::f16, GgmlType::bf16, GgmlType::q8_0, GgmlType::q4_0),
                         [](const auto& type) { return std::string(workload::ggml_type_name(type.param)); });

TEST_F(CudaTest, IdleTargetRefusesHostMemoryPressure) {
  auto t = workload::make_cuda_idle_target({});
  ASSERT_TRUE(t) << t.message();
  workload::Pressure p;
  p.kind = workload::Pressure::Kind::pageout;
  Status st = (*t)->check_pressure(p);
  EXPECT_FALSE(st);
  EXPECT_NE(st.message().find("--pressure none"), std::string::npos) << st.message();
  EXPECT_TRUE((*t)->check_pressure(workload::Pressure{}));
}

}  // namespace
}  // namespace residency::cuda::testing
