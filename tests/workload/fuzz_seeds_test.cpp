// SPDX-License-Identifier: MIT
// The fuzz target's seed corpus (tests/fuzz/corpus/gguf_reader) is what our writer produces: tiny
// llama models of each type and a file with every metadata type. This test fails when the writer
// changes and the corpus was not regenerated; RESIDENCY_UPDATE_FUZZ_SEEDS=1 rewrites it.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <map>

#include "workload/gguf.hpp"
#include "workload/gguf_writer.hpp"
#include "workload_test_util.hpp"

namespace residency::workload {
namespace {

const std::string kSeedDir = RESIDENCY_FUZZ_SEED_DIR;

// Smaller than any size plan_llama_shape picks, so that each seed is a few KiB.
LlamaShape tiny_llama(GgmlType type) {
  LlamaShape s;
  s.type = type;
  s.n_vocab = 8;
  // A Q8_0 or Q4_0 row holds at least one 32-element block.
  s.n_embd = type == GgmlType::q8_0 || type == GgmlType::q4_0 ? 32 : 16;
  s.n_layer = 1;
  s.n_head = 1;
  s.n_head_kv = 1;
  s.n_ff = s.n_embd;
  s.n_ctx = 64;
  return s;
}

std::map<std::string, std::vector<std::uint8_t>> seeds() {
  std::map<std::string, std::vector<std::uint8_t>> out;
  for (GgmlType t : {GgmlType::f32, GgmlType::f16, GgmlType::bf16, GgmlType::q8_0, GgmlType::q4_0}) {
    out["llama-" + std::string(ggml_type_name(t))] = testing::file_bytes(llama_builder(tiny_llama(t), 1), 1);
  }
  out["every-value"] = testing::file_bytes(testing::every_value_builder(), 1);
  return out;
}

TEST(FuzzSeeds, CorpusIsWhatTheWriterMakes) {
  const auto expected = seeds();
  if (const char* update = std::getenv("RESIDENCY_UPDATE_FUZZ_SEEDS"); update && std::string(update) == "1") {
    std::filesystem::create_directories(kSeedDir);
    for (const auto& [name, bytes] : expected) testing::write_bytes(kSeedDir + "/" + name, bytes);
  }
  for (const auto& [name, bytes] : expected) {
    SCOPED_TRACE(name);
    EXPECT_LT(bytes.size(), 12u * 1024) << "a seed should stay small";
    ASSERT_TRUE(parse_gguf(bytes, name).is_ok());
    EXPECT_EQ(testing::read_bytes(kSeedDir + "/" + name), bytes)
        << "the committed seed differs from the writer's output: run RESIDENCY_UPDATE_FUZZ_SEEDS=1 "
           "workload_fuzz_seeds_test and commit tests/fuzz/corpus/gguf_reader";
  }
}

}  // namespace
}  // namespace residency::workload
