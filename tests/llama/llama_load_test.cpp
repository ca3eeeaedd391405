// SPDX-License-Identifier: MIT
// llama.cpp itself loads and decodes what our GGUF writer produces: for every type the writer
// makes (F32, F16, BF16, Q8_0, Q4_0) a small synthetic model (`residency make-model`'s writer) is
// loaded through libllama's public C API, decodes one token on 2 threads, and must give finite
// logits; llama.cpp's own account of the model (parameters, bytes, shape, file type) must match
// what we wrote, so that a truncated or misread file cannot pass as a loaded one.
#include <gtest/gtest.h>
#include <llama.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "workload/gguf_writer.hpp"

namespace residency::workload {
namespace {

constexpr std::uint64_t kMiB = 1024 * 1024;

// llama.cpp's log goes here, and is printed only when a test fails.
std::string& llama_log() {
  static std::string log;
  return log;
}

class LlamaEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    llama_log_set([](ggml_log_level, const char* text, void*) { llama_log() += text; }, nullptr);
    llama_backend_init();
  }
  void TearDown() override { llama_backend_free(); }
};
[[maybe_unused]] const auto* const kEnvironment = ::testing::AddGlobalTestEnvironment(new LlamaEnvironment);

class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/residency-llama-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (mkdtemp(buf.data()) == nullptr) ADD_FAILURE() << "mkdtemp failed for " << tmpl;
    path_ = buf.data();
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// llama.cpp's LLAMA_FTYPE_* for the general.file_type our writer sets.
llama_ftype expected_ftype(GgmlType type) {
  switch (type) {
    case GgmlType::f32: return LLAMA_FTYPE_ALL_F32;
    case GgmlType::bf16: return LLAMA_FTYPE_MOSTLY_BF16;
    case GgmlType::q8_0: return LLAMA_FTYPE_MOSTLY_Q8_0;
    case GgmlType::q4_0: return LLAMA_FTYPE_MOSTLY_Q4_0;
    default: return LLAMA_FTYPE_MOSTLY_F16;
  }
}

struct ModelDeleter {
  void operator()(llama_model* m) const { llama_model_free(m); }
};
struct ContextDeleter {
  void operator()(llama_context* c) const { llama_free(c); }
};

class LlamaLoadTest : public ::testing::TestWithParam<GgmlType> {
 protected:
  void SetUp() override { llama_log().clear(); }
  void TearDown() override {
    if (HasFailure()) std::cerr << "llama.cpp's log:\n" << llama_log();
  }
};

TEST_P(LlamaLoadTest, LoadsAndDecodesOneToken) {
  const GgmlType type = GetParam();
  auto shape = plan_llama_shape(16 * kMiB, type);
  ASSERT_TRUE(shape.is_ok()) << shape.message();
  auto layout = llama_builder(*shape, kSyntheticSeed).layout();
  ASSERT_TRUE(layout.is_ok()) << layout.message();
  std::uint64_t n_params = 0, n_bytes = 0;
  for (std::size_t t = 0; t < layout->tensors.size(); ++t) {
    std::uint64_t n = 1;
    for (std::uint64_t d : layout->tensors[t].ne) n *= d;
    n_params += n;
    n_bytes += layout->n_bytes[t];
  }

  TempDir dir;
  const std::string path = dir.file(std::string(ggml_type_name(type)) + ".gguf");
  const Status written = write_synthetic_model(path, *shape, kSyntheticSeed, 2);
  ASSERT_TRUE(written.is_ok()) << written.message();
  ASSERT_EQ(std::filesystem::file_size(path), layout->file_size);

  // With llama.cpp's extra buffer types on (AMX on CPUs with it, CPU_REPACK for Q4_0 on AVX2 x86 and ARM:
  // the matrices copied and repacked at load) and off (read from the file mapping): both decode,
  // to the same logits within the repacked kernels' rounding.
  std::vector<float> logits_by_layout[2];
  for (int no_repack = 0; no_repack < 2; ++no_repack) {
    SCOPED_TRACE(no_repack ? "extra buffer types off" : "extra buffer types on");
    llama_model_params mparams = llama_model_default_params();
    mparams.use_extra_bufts = no_repack == 0;
    mparams.n_gpu_layers = 0;  // the CPU backend, also in a CUDA build of llama.cpp
    std::unique_ptr<llama_model, ModelDeleter> model(llama_model_load_from_file(path.c_str(), mparams));
    ASSERT_NE(model, nullptr) << "llama.cpp did not load " << shape->to_string();

    // llama.cpp's account of the file equals what we wrote.
    EXPECT_EQ(llama_model_n_params(model.get()), n_params);
    EXPECT_EQ(llama_model_size(model.get()), n_bytes);
    EXPECT_EQ(llama_model_ftype(model.get()), expected_ftype(type));
    EXPECT_EQ(static_cast<std::uint64_t>(llama_model_n_embd(model.get())), shape->n_embd);
    EXPECT_EQ(static_cast<std::uint64_t>(llama_model_n_layer(model.get())), shape->n_layer);
    EXPECT_EQ(static_cast<std::uint64_t>(llama_model_n_head(model.get())), shape->n_head);
    EXPECT_EQ(static_cast<std::uint64_t>(llama_model_n_head_kv(model.get())), shape->n_head_kv);
    EXPECT_EQ(static_cast<std::uint64_t>(llama_model_n_ctx_train(model.get())), shape->n_ctx);
    const llama_vocab* vocab = llama_model_get_vocab(model.get());
    ASSERT_NE(vocab, nullptr);
    const std::int32_t n_vocab = llama_vocab_n_tokens(vocab);
    EXPECT_EQ(static_cast<std::uint64_t>(n_vocab), shape->n_vocab);

    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = 64;
    cparams.n_batch = 64;
    cparams.n_ubatch = 64;
    cparams.n_seq_max = 1;
    cparams.n_threads = 2;
    cparams.n_threads_batch = 2;
    cparams.no_perf = true;
    std::unique_ptr<llama_context, ContextDeleter> ctx(llama_init_from_model(model.get(), cparams));
    ASSERT_NE(ctx, nullptr);

    // Our writer's vocabulary ("llama" tokenizer, token 1 "<s>", tokenizer.ggml.bos_token_id 1)
    // gives a BOS; were it absent (LLAMA_TOKEN_NULL, as with tokenizer.ggml.model "none"), token 1
    // is fed directly: any id below n_vocab is a valid input to the graph.
    llama_token token = llama_vocab_bos(vocab);
    EXPECT_EQ(token, 1);
    if (token == LLAMA_TOKEN_NULL) token = 1;
    llama_batch batch = llama_batch_get_one(&token, 1);
    ASSERT_EQ(llama_decode(ctx.get(), batch), 0);

    const float* logits = llama_get_logits_ith(ctx.get(), -1);
    ASSERT_NE(logits, nullptr);
    std::int32_t non_finite = 0;
    for (std::int32_t k = 0; k < n_vocab; ++k) non_finite += std::isfinite(logits[k]) ? 0 : 1;
    EXPECT_EQ(non_finite, 0) << "of " << n_vocab << " logits";
    // Random weights give distinct logits; all equal would mean the weights read as zeros.
    const auto [lo, hi] = std::minmax_element(logits, logits + n_vocab);
    EXPECT_LT(*lo, *hi);
    logits_by_layout[no_repack].assign(logits, logits + n_vocab);
  }
  ASSERT_EQ(logits_by_layout[0].size(), logits_by_layout[1].size());
  float scale = 0, worst = 0;
  for (std::size_t k = 0; k < logits_by_layout[0].size(); ++k) {
    scale = std::max(scale, std::fabs(logits_by_layout[1][k]));
    worst = std::max(worst, std::fabs(logits_by_layout[0][k] - logits_by_layout[1][k]));
  }
  EXPECT_LE(worst, 0.02F * scale + 1e-3F) << "the two layouts decode differently";
}

// Text goes in and comes out as a user types it: llama.cpp's SPM tokenizer turns any text
// (ASCII, a newline, a tab, UTF-8 beyond ASCII) into our vocabulary's tokens, words through its
// merges and the rest through the byte tokens, and detokenizes them back to the same text.
// Before the vocabulary had byte tokens, llama.cpp found no newline token and tokenizing threw
// (llama-server answered "unordered_map::at").
TEST(LlamaVocab, TextTokenizesAndDetokenizesToItself) {
  auto shape = plan_llama_shape(8 * kMiB, GgmlType::q4_0);
  ASSERT_TRUE(shape.is_ok()) << shape.message();
  TempDir dir;
  const std::string path = dir.file("vocab.gguf");
  ASSERT_TRUE(write_synthetic_model(path, *shape, kSyntheticSeed, 2).is_ok());
  llama_model_params mparams = llama_model_default_params();
  mparams.vocab_only = true;
  llama_log().clear();
  std::unique_ptr<llama_model, ModelDeleter> model(llama_model_load_from_file(path.c_str(), mparams));
  ASSERT_NE(model, nullptr) << llama_log();
  EXPECT_EQ(llama_log().find("newline token not found"), std::string::npos) << llama_log();
  const llama_vocab* vocab = llama_model_get_vocab(model.get());
  EXPECT_EQ(llama_vocab_nl(vocab), 3 + '\n') << "the newline is byte token <0x0A>";
  EXPECT_EQ(llama_vocab_bos(vocab), 1);
  EXPECT_EQ(llama_vocab_eos(vocab), 2);

  for (const std::string text : {"Hello", "Hello, world!\nA second line\twith a tab.",
                                 "caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac 42 {\"json\": [1, 2]}"}) {
    SCOPED_TRACE(text);
    std::vector<llama_token> tokens(text.size() + 8);
    const std::int32_t n = llama_tokenize(vocab, text.c_str(), static_cast<std::int32_t>(text.size()), tokens.data(),
                                          static_cast<std::int32_t>(tokens.size()), false, false);
    ASSERT_GT(n, 0);
    tokens.resize(static_cast<std::size_t>(n));
    // Words merge: fewer tokens than bytes.
    EXPECT_LT(tokens.size(), text.size() + 1);
    for (llama_token t : tokens) EXPECT_TRUE(t > 2 && t < llama_vocab_n_tokens(vocab)) << t;
    std::string back(text.size() * 2 + 16, '\0');
    const std::int32_t m = llama_detokenize(vocab, tokens.data(), n, back.data(),
                                            static_cast<std::int32_t>(back.size()), false, false);
    ASSERT_GE(m, 0);
    back.resize(static_cast<std::size_t>(m));
    EXPECT_EQ(back, text);
  }
}

// Named "llama/LlamaLoadTest...", so that `ctest -R llama` finds them.
INSTANTIATE_TEST_SUITE_P(llama, LlamaLoadTest,
                         ::testing::Values(GgmlType::f32, GgmlType::f16, GgmlType::bf16, GgmlType::q8_0, GgmlType::q4_0),
                         [](const ::testing::TestParamInfo<GgmlType>& param) {
                           return std::string(ggml_type_name(param.param));
                         });

}  // namespace
}  // namespace residency::workload
