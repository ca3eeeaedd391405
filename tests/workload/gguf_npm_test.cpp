// SPDX-License-Identifier: MIT
// Files we write, parsed by @huggingface/gguf (npm): every tensor's name, type, shape and offset,
// the data offset and every metadata value must be what our reader says. The package is installed
// by `npm ci` in tests/workload; without node or the package the test is skipped (with the reason).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "workload/gguf.hpp"
#include "workload/gguf_writer.hpp"
#include "workload_test_util.hpp"

namespace residency::workload {
namespace {

const std::string kTestDir = RESIDENCY_WORKLOAD_TEST_DIR;

bool on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  std::string p = path ? path : "";
  std::size_t start = 0;
  while (start <= p.size()) {
    const std::size_t end = p.find(':', start);
    const std::string dir = p.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (!dir.empty() && access((dir + "/" + program).c_str(), X_OK) == 0) return true;
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return false;
}

// Our reader's view of a file, in the form gguf_compare.mjs reads.
nlohmann::json describe(const GgufModel& m) {
  nlohmann::json j;
  j["version"] = m.version;
  j["data_offset"] = std::to_string(m.data_offset);
  j["tensors"] = nlohmann::json::array();
  for (const auto& t : m.tensors) {
    nlohmann::json shape = nlohmann::json::array();
    for (std::uint32_t d = 0; d < t.n_dims; ++d) shape.push_back(std::to_string(t.ne[d]));
    j["tensors"].push_back({{"name", t.name},
                            {"type", static_cast<std::uint32_t>(t.type)},
                            {"shape", shape},
                            {"offset", std::to_string(t.offset)}});
  }
  nlohmann::json meta = nlohmann::json::object();
  for (const auto& kv : m.metadata) {
    const GgufValue& v = kv.value;
    switch (v.type) {
      case GgufValueType::array: {
        nlohmann::json a{{"count", v.count}};
        if (v.count > 0 && v.elem_type == GgufValueType::string) a["first"] = v.items[0].str;
        if (v.count > 0 && gguf_scalar_size(v.elem_type) && v.elem_type != GgufValueType::boolean) {
          a["first"] = *v.number_at(0);  // a JSON number with every digit: JS reads the same double
        }
        meta[kv.key] = a;
        break;
      }
      case GgufValueType::string: meta[kv.key] = {{"value", v.str}}; break;
      case GgufValueType::float32:
      case GgufValueType::float64: meta[kv.key] = {{"value", v.f}}; break;
      default: meta[kv.key] = {{"value", v.as_int() ? std::to_string(*v.as_int()) : std::to_string(*v.as_uint())}};
    }
  }
  j["metadata"] = meta;
  return j;
}

int run(const std::string& cmd) {
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

void compare_with_npm(const std::string& path) {
  auto f = GgufFile::open(path);
  ASSERT_TRUE(f.is_ok()) << f.message();
  const std::string expected = path + ".json";
  std::ofstream(expected) << describe(f->model()).dump(1);
  const int rc = run("node '" + kTestDir + "/gguf_compare.mjs' '" + path + "' '" + expected + "'");
  EXPECT_EQ(rc, 0) << "@huggingface/gguf disagrees with our reader on " << path << " (differences above)";
}

class GgufNpm : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!on_path("node")) GTEST_SKIP() << "node is not installed (apt-get install nodejs npm)";
    if (!std::filesystem::exists(kTestDir + "/node_modules/@huggingface/gguf/package.json")) {
      GTEST_SKIP() << "@huggingface/gguf is not installed: run `npm ci` in " << kTestDir;
    }
  }
  testing::ScratchDir dir_;
};

TEST_F(GgufNpm, AgreesOnSyntheticModelsOfEveryType) {
  for (GgmlType type : {GgmlType::f32, GgmlType::f16, GgmlType::bf16, GgmlType::q8_0, GgmlType::q4_0}) {
    auto s = plan_llama_shape(3ull << 20, type);
    ASSERT_TRUE(s.is_ok());
    const std::string path = dir_.file(std::string(ggml_type_name(type)) + ".gguf");
    ASSERT_TRUE(write_synthetic_model(path, *s).is_ok());
    compare_with_npm(path);
  }
}

TEST_F(GgufNpm, AgreesOnEveryMetadataValueType) {
  const std::string path = dir_.file("values.gguf");
  testing::write_bytes(path, testing::file_bytes(testing::every_value_builder()));
  compare_with_npm(path);
}

TEST_F(GgufNpm, NoticesADifference) {
  // The comparison itself must be able to fail: describe a file, then change one offset.
  const std::string path = dir_.file("values.gguf");
  testing::write_bytes(path, testing::file_bytes(testing::every_value_builder()));
  auto f = GgufFile::open(path);
  ASSERT_TRUE(f.is_ok());
  auto j = describe(f->model());
  j["tensors"][1]["offset"] = "12345";
  std::ofstream(path + ".json") << j.dump();
  EXPECT_EQ(run("node '" + kTestDir + "/gguf_compare.mjs' '" + path + "' '" + path + ".json' > /dev/null"), 1);
}

}  // namespace
}  // namespace residency::workload
