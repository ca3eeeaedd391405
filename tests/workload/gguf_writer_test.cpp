// SPDX-License-Identifier: MIT
// The writer and the synthetic llama model: shapes follow one configuration and fill the size
// asked for; files round-trip through our reader; the content is deterministic.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <set>

#include "workload/gguf.hpp"
#include "workload/gguf_writer.hpp"
#include "workload/half.hpp"
#include "workload_test_util.hpp"

namespace residency::workload {
namespace {

constexpr std::uint64_t kMiB = 1ull << 20;

TEST(LlamaShape, FollowsOneConfigurationAndFillsTheSize) {
  for (std::uint64_t size : {1 * kMiB, 4 * kMiB, 64 * kMiB, 1024 * kMiB, 7 * 1024 * kMiB, 70 * 1024 * kMiB}) {
    for (GgmlType type : {GgmlType::f32, GgmlType::f16, GgmlType::bf16, GgmlType::q8_0, GgmlType::q4_0}) {
      SCOPED_TRACE(std::to_string(size) + " " + std::string(ggml_type_name(type)));
      auto s = plan_llama_shape(size, type);
      ASSERT_TRUE(s.is_ok()) << s.message();
      EXPECT_EQ(s->n_embd % s->n_head, 0u);
      EXPECT_EQ(s->n_head % s->n_head_kv, 0u);
      EXPECT_GE(s->n_layer, std::max<std::uint64_t>(1, s->n_embd / 128));
      EXPECT_EQ(s->n_ff % 64, 0u);
      EXPECT_GE(s->n_ff, s->n_embd * 8 / 3 - 64);
      EXPECT_LE(s->n_vocab, kMaxSyntheticVocab);
      auto layout = llama_builder(*s, 1).layout();
      ASSERT_TRUE(layout.is_ok());
      EXPECT_LE(layout->file_size, size);
      EXPECT_GE(static_cast<double>(layout->file_size), (size >= 64 * kMiB ? 0.97 : 0.85) * static_cast<double>(size));
    }
  }
}

TEST(LlamaShape, TensorShapesDeriveFromTheConfiguration) {
  auto s = plan_llama_shape(16 * kMiB, GgmlType::f16);
  ASSERT_TRUE(s.is_ok());
  auto layout = llama_builder(*s, 1).layout();
  ASSERT_TRUE(layout.is_ok());
  const std::uint64_t e = s->n_embd, kv = s->n_embd_kv();
  ASSERT_EQ(layout->tensors.size(), 9 * s->n_layer + 3);
  auto shape_of = [&](const std::string& name) {
    for (const auto& t : layout->tensors) {
      if (t.name == name) return t.ne;
    }
    ADD_FAILURE() << name;
    return std::vector<std::uint64_t>{};
  };
  EXPECT_EQ(shape_of("token_embd.weight"), (std::vector<std::uint64_t>{e, s->n_vocab}));
  EXPECT_EQ(shape_of("output.weight"), (std::vector<std::uint64_t>{e, s->n_vocab}));
  EXPECT_EQ(shape_of("output_norm.weight"), (std::vector<std::uint64_t>{e}));
  for (std::uint64_t l = 0; l < s->n_layer; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    EXPECT_EQ(shape_of(p + "attn_q.weight"), (std::vector<std::uint64_t>{e, e}));
    EXPECT_EQ(shape_of(p + "attn_k.weight"), (std::vector<std::uint64_t>{e, kv}));
    EXPECT_EQ(shape_of(p + "attn_v.weight"), (std::vector<std::uint64_t>{e, kv}));
    EXPECT_EQ(shape_of(p + "attn_output.weight"), (std::vector<std::uint64_t>{e, e}));
    EXPECT_EQ(shape_of(p + "ffn_gate.weight"), (std::vector<std::uint64_t>{e, s->n_ff}));
    EXPECT_EQ(shape_of(p + "ffn_up.weight"), (std::vector<std::uint64_t>{e, s->n_ff}));
    EXPECT_EQ(shape_of(p + "ffn_down.weight"), (std::vector<std::uint64_t>{s->n_ff, e}));
    EXPECT_EQ(shape_of(p + "attn_norm.weight"), (std::vector<std::uint64_t>{e}));
  }
}

TEST(LlamaShape, TooSmallSaysWhatTheSmallestIs) {
  auto s = plan_llama_shape(10000, GgmlType::f16);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("10000 bytes is too small for a llama-shaped F16 model; the smallest is "), std::string::npos)
      << s.message();
  EXPECT_FALSE(plan_llama_shape(kMiB, GgmlType::q4_k).is_ok());
}

// What llama.cpp's SPM tokenizer needs (its llama-vocab.cpp): the specials at 0, 1, 2, every
// byte as "<0xXX>" of type BYTE (the newline "<0x0A>" among them), unique token texts, scores and
// types for every token, and every multi-character normal token a merge of two earlier tokens
// (the tokenizer only reaches a token by merging two it already has).
TEST(SyntheticVocab, HasWhatLlamaCppsTokenizerNeeds) {
  for (std::uint64_t n : {kMinSyntheticVocab, std::uint64_t{1000}, kMaxSyntheticVocab}) {
    SCOPED_TRACE(n);
    const SyntheticVocab v = synthetic_vocab(n);
    ASSERT_EQ(v.tokens.size(), n);
    ASSERT_EQ(v.scores.size(), n);
    ASSERT_EQ(v.types.size(), n);
    EXPECT_EQ(v.tokens[0], "<unk>");
    EXPECT_EQ(v.types[0], static_cast<double>(SpmTokenType::unknown));
    EXPECT_EQ(v.tokens[1], "<s>");
    EXPECT_EQ(v.tokens[2], "</s>");
    EXPECT_EQ(v.types[1], static_cast<double>(SpmTokenType::control));
    EXPECT_EQ(v.types[2], static_cast<double>(SpmTokenType::control));
    EXPECT_EQ(v.tokens[3 + 0x0A], "<0x0A>");
    EXPECT_EQ(v.tokens[3 + 0xFF], "<0xFF>");
    std::set<std::string> seen;
    for (std::size_t k = 0; k < n; ++k) {
      EXPECT_TRUE(seen.insert(v.tokens[k]).second) << "duplicate " << v.tokens[k];
      EXPECT_EQ(v.types[k] == static_cast<double>(SpmTokenType::byte), k >= 3 && k < 259) << k;
    }
    EXPECT_TRUE(seen.count(kSpmSpace) && seen.count("a") && seen.count("~") && seen.count(std::string(kSpmSpace) + "H"));
    for (std::size_t k = 259; k < n; ++k) {
      const std::string& t = v.tokens[k];
      EXPECT_EQ(v.types[k], static_cast<double>(SpmTokenType::normal));
      EXPECT_LT(v.scores[k], v.scores[k - 1] + (k == 259 ? 1 : 0)) << "shorter tokens merge first";
      const std::size_t last = t.size() - 1;
      if (t.size() > 1 && !(t.size() == 3 && t == kSpmSpace)) {
        // A word start or word of length L is a shorter one plus its last letter.
        EXPECT_TRUE(seen.count(t.substr(0, last)) && seen.count(t.substr(last))) << t;
      }
    }
  }
  // Tests' tiny shapes get the first tokens.
  EXPECT_EQ(synthetic_vocab(8).tokens.back(), "<0x04>");
}

TEST(LlamaShape, VocabularyNeverBelowTheOneThatTokenizesText) {
  for (std::uint64_t size : {1 * kMiB, 2 * kMiB, 16 * kMiB}) {
    auto s = plan_llama_shape(size, GgmlType::q4_0);
    ASSERT_TRUE(s.is_ok()) << s.message();
    EXPECT_GE(s->n_vocab, kMinSyntheticVocab) << size;
  }
}

TEST(SyntheticModel, RoundTripsThroughOurReader) {
  testing::ScratchDir dir;
  for (GgmlType type : {GgmlType::f32, GgmlType::f16, GgmlType::bf16, GgmlType::q8_0, GgmlType::q4_0}) {
    SCOPED_TRACE(std::string(ggml_type_name(type)));
    auto s = plan_llama_shape(2 * kMiB, type);
    ASSERT_TRUE(s.is_ok());
    const std::string path = dir.file(std::string(ggml_type_name(type)) + ".gguf");
    ASSERT_TRUE(write_synthetic_model(path, *s, 7).is_ok());
    auto f = GgufFile::open(path);
    ASSERT_TRUE(f.is_ok()) << f.message();
    const GgufModel& m = f->model();
    auto layout = llama_builder(*s, 7).layout();
    ASSERT_EQ(m.tensors.size(), layout->tensors.size());
    EXPECT_EQ(m.data_offset, layout->data_offset);
    EXPECT_EQ(m.file_size, layout->file_size);
    for (std::size_t k = 0; k < m.tensors.size(); ++k) {
      const GgufTensor& t = m.tensors[k];
      EXPECT_EQ(t.name, layout->tensors[k].name);
      EXPECT_EQ(t.type, layout->tensors[k].type);
      EXPECT_EQ(std::vector<std::uint64_t>(t.ne.begin(), t.ne.begin() + t.n_dims), layout->tensors[k].ne);
      EXPECT_EQ(t.offset, layout->offsets[k]);
      EXPECT_EQ(t.type, t.n_dims == 1 ? GgmlType::f32 : type) << t.name;
    }
    EXPECT_EQ(m.find("general.architecture")->str, "llama");
    EXPECT_EQ(m.find("llama.block_count")->u, s->n_layer);
    EXPECT_EQ(m.find("llama.embedding_length")->u, s->n_embd);
    EXPECT_EQ(m.find("llama.feed_forward_length")->u, s->n_ff);
    EXPECT_EQ(m.find("llama.attention.head_count_kv")->u, s->n_head_kv);
    EXPECT_EQ(m.find("tokenizer.ggml.tokens")->count, s->n_vocab);
    EXPECT_EQ(m.find("tokenizer.ggml.tokens")->items[1].str, "<s>");
    EXPECT_EQ(m.find("general.alignment")->u, 32u);
    if (type == GgmlType::q4_0) {
      EXPECT_EQ(m.find("general.file_type")->u, 2u);  // LLAMA_FTYPE_MOSTLY_Q4_0
      EXPECT_EQ(m.find("general.quantization_version")->u, 2u);
    }
  }
}

// Q4_0 as ggml's reference quantiser makes it: the scale is d = m / -8, m the block's element of
// largest magnitude with its sign, so m is kept (as q = 0, value -8 d); every other element is
// within half a step of d * (q - 8), or within a step where x / d reaches 7.5 (q = 16 is clamped
// to 15). The originals are the same model written as F32: the values do not depend on the type.
TEST(SyntheticModel, Q4_0ValuesAreWithinItsErrorOfTheOriginals) {
  auto s = plan_llama_shape(2 * kMiB, GgmlType::q4_0);
  ASSERT_TRUE(s.is_ok());
  LlamaShape f32_shape = *s;
  f32_shape.type = GgmlType::f32;
  const auto q_bytes = testing::file_bytes(llama_builder(*s, 5), 5);
  const auto f_bytes = testing::file_bytes(llama_builder(f32_shape, 5), 5);
  auto qm = parse_gguf(q_bytes, "q4_0");
  auto fm = parse_gguf(f_bytes, "f32");
  ASSERT_TRUE(qm.is_ok() && fm.is_ok());
  std::size_t matrices = 0, clamped = 0;
  double err_sum = 0, step_sum = 0;
  for (const GgufTensor& qt : qm->tensors) {
    if (qt.n_dims < 2) continue;
    SCOPED_TRACE(qt.name);
    ASSERT_EQ(qt.type, GgmlType::q4_0);
    ASSERT_EQ(qt.n_bytes, qt.n_elements / 32 * 18);
    const GgufTensor& ft = *fm->find_tensor(qt.name);
    ++matrices;
    for (std::uint64_t b = 0; b < qt.n_elements / 32; ++b) {
      const std::uint8_t* blk = q_bytes.data() + qt.file_offset + 18 * b;
      float x[32];
      std::memcpy(x, f_bytes.data() + ft.file_offset + 4 * 32 * b, sizeof x);
      float m = 0;
      for (float v : x) m = std::fabs(v) > std::fabs(m) ? v : m;
      std::uint16_t dh;
      std::memcpy(&dh, blk, 2);
      ASSERT_EQ(dh, f32_to_f16(m / -8.0f)) << "block " << b;
      const float d = f16_to_f32(dh);
      for (int k = 0; k < 32; ++k) {
        const unsigned nibble = k < 16 ? blk[2 + k] & 0x0fu : blk[2 + k - 16] >> 4;
        const float value = d * (static_cast<float>(nibble) - 8.0f);
        const float err = std::fabs(value - x[k]);
        // 1% over the step: the scale is stored as fp16 (8 * 2^-11 of d at most).
        const bool at_clamp = x[k] / (m / -8.0f) >= 7.5f;
        if (at_clamp) ++clamped;
        ASSERT_LE(err, (at_clamp ? 1.01f : 0.51f) * std::fabs(d)) << "block " << b << " element " << k;
        if (x[k] == m) {
          EXPECT_LE(err, std::fabs(m) * 1e-3f) << "block " << b << ": its largest element is kept";
        }
        err_sum += err;
        step_sum += std::fabs(d);
      }
    }
  }
  EXPECT_EQ(matrices, 7 * s->n_layer + 2);  // 7 a layer, token_embd and output
  EXPECT_GT(clamped, 0u) << "no element reached the clamp: the test does not cover it";
  // Uniform weights: the rounding error averages about a quarter of a step.
  EXPECT_LT(err_sum / step_sum, 0.3);
  EXPECT_GT(err_sum / step_sum, 0.2);
}

TEST(SyntheticModel, ValuesAreDeterministicAndInRange) {
  testing::ScratchDir dir;
  auto s = plan_llama_shape(3 * kMiB, GgmlType::q8_0);
  ASSERT_TRUE(s.is_ok());
  ASSERT_TRUE(write_synthetic_model(dir.file("a.gguf"), *s, 11, 1).is_ok());
  ASSERT_TRUE(write_synthetic_model(dir.file("b.gguf"), *s, 11, 3).is_ok());
  ASSERT_TRUE(write_synthetic_model(dir.file("c.gguf"), *s, 12, 2).is_ok());
  const auto a = testing::read_bytes(dir.file("a.gguf"));
  EXPECT_EQ(a, testing::read_bytes(dir.file("b.gguf"))) << "the thread count changed the bytes";
  EXPECT_NE(a, testing::read_bytes(dir.file("c.gguf"))) << "the seed did not change the bytes";

  auto f = GgufFile::open(dir.file("a.gguf"));
  ASSERT_TRUE(f.is_ok());
  const GgufTensor& q = *f->model().find_tensor("blk.0.attn_q.weight");
  const auto data = f->tensor_data(q);
  const float bound = 1.0f / std::sqrt(static_cast<float>(q.ne[0]));
  float amax = 0;
  for (std::size_t b = 0; b < data.size() / 34; ++b) {
    std::uint16_t dh;
    std::memcpy(&dh, data.data() + 34 * b, 2);
    const float d = f16_to_f32(dh);
    for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(d * static_cast<std::int8_t>(data[34 * b + 2 + k])));
  }
  EXPECT_LE(amax, bound * 1.01f);
  EXPECT_GE(amax, bound * 0.9f);
  const GgufTensor& norm = *f->model().find_tensor("output_norm.weight");
  float first;
  std::memcpy(&first, f->tensor_data(norm).data(), 4);
  EXPECT_NEAR(first, 1.0f, 0.1f);
}

TEST(SyntheticModel, RefusesToOverwriteAndLeavesNothingOnFailure) {
  testing::ScratchDir dir;
  auto s = plan_llama_shape(kMiB, GgmlType::f16);
  ASSERT_TRUE(s.is_ok());
  ASSERT_TRUE(write_synthetic_model(dir.file("m.gguf"), *s).is_ok());
  const auto again = write_synthetic_model(dir.file("m.gguf"), *s);
  EXPECT_EQ(again.message(),
            dir.file("m.gguf") + ": already exists; choose another name or allow overwriting (--force)");
  EXPECT_TRUE(write_synthetic_model(dir.file("m.gguf"), *s, 5, 0, true).is_ok());
  const auto nodir = write_synthetic_model(dir.file("no/such/dir.gguf"), *s);
  EXPECT_EQ(nodir.code(), ErrorCode::not_found);
  EXPECT_FALSE(std::filesystem::exists(dir.file("no")));
}

// Overwriting replaces a regular file only: onto a directory or a FIFO the writer refuses before it
// writes (no partial file is left) and what was there stays.
TEST(SyntheticModel, OverwriteRefusesWhatIsNotARegularFile) {
  testing::ScratchDir dir;
  auto s = plan_llama_shape(kMiB, GgmlType::f16);
  ASSERT_TRUE(s.is_ok());
  std::filesystem::create_directory(dir.file("d.gguf"));
  ASSERT_EQ(::mkfifo(dir.file("f.gguf").c_str(), 0600), 0);
  for (const char* name : {"d.gguf", "f.gguf"}) {
    const auto st = write_synthetic_model(dir.file(name), *s, 5, 0, true);
    EXPECT_EQ(st.code(), ErrorCode::invalid_argument) << st.message();
    EXPECT_NE(st.message().find("replaces only a regular file"), std::string::npos) << st.message();
    EXPECT_FALSE(std::filesystem::is_regular_file(dir.file(name)));
  }
  for (const auto& e : std::filesystem::directory_iterator(dir.path()))
    EXPECT_EQ(e.path().filename().string().find(".partial-"), std::string::npos) << e.path();
}

TEST(Half, F16RoundTripsEveryValue) {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const float f = f16_to_f32(static_cast<std::uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE((h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0) << h;
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f))));
      continue;
    }
    EXPECT_EQ(f32_to_f16(f), h) << std::hex << h;
  }
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_f32(0x7bff), 65504.0f);
  EXPECT_TRUE(std::isinf(f16_to_f32(0xfc00)) && f16_to_f32(0xfc00) < 0);
}

TEST(Half, F16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);      // tie, to even
  EXPECT_EQ(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie, to even (up)
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);
  EXPECT_EQ(f32_to_f16(1e10f), 0x7c00);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000);  // tie between 0 and the smallest subnormal
  EXPECT_EQ(f32_to_f16(3 * std::ldexp(1.0f, -26)), 0x0001);
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
}

TEST(Half, Bf16RoundTripsAndRounds) {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const float f = bf16_to_f32(static_cast<std::uint16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(f32_to_bf16(f), h);
  }
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);  // tie, to even
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::nanf("")))));
}

}  // namespace
}  // namespace residency::workload
