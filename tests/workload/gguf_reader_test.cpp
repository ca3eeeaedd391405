// SPDX-License-Identifier: MIT
// The GGUF reader on good files and on every kind of malformation: each bad file gives one error
// line that names the field and the byte offset, never a crash or an over-read (ASan checks the
// latter in CI).
#include <gtest/gtest.h>

#include <cstring>
#include <regex>

#include "workload/gguf.hpp"
#include "workload_test_util.hpp"

namespace residency::workload {
namespace {

using testing::every_value_builder;
using testing::file_bytes;

GgufModel parse_ok(const std::vector<std::uint8_t>& bytes) {
  auto m = parse_gguf(bytes, "t.gguf");
  EXPECT_TRUE(m.is_ok()) << m.message();
  return m.is_ok() ? *m : GgufModel{};
}

// Parses `bytes`, expects an error and returns its message after checking the common shape:
// "t.gguf: byte N (field): ...", one line.
std::string parse_error(const std::vector<std::uint8_t>& bytes) {
  auto m = parse_gguf(bytes, "t.gguf");
  EXPECT_FALSE(m.is_ok()) << "a malformed file was accepted";
  if (m.is_ok()) return {};
  const std::string& msg = m.message();
  EXPECT_TRUE(std::regex_search(msg, std::regex("^t\\.gguf: byte [0-9]+ \\([^)]+\\): .+"))) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  return msg;
}

template <typename T>
void poke(std::vector<std::uint8_t>& bytes, std::uint64_t at, T v) {
  ASSERT_LE(at + sizeof(T), bytes.size());
  std::memcpy(bytes.data() + at, &v, sizeof(T));
}

const GgufKeyValue& kv_of(const GgufModel& m, const std::string& key) {
  for (const auto& kv : m.metadata) {
    if (kv.key == key) return kv;
  }
  ADD_FAILURE() << "no key " << key;
  return m.metadata.front();
}
std::uint64_t value_type_at(const GgufKeyValue& kv) { return kv.file_offset + 8 + kv.key.size(); }
std::uint64_t value_at(const GgufKeyValue& kv) { return value_type_at(kv) + 4; }
// Field positions inside a tensor info.
std::uint64_t dims_at(const GgufTensor& t) { return t.info_offset + 8 + t.name.size() + 4; }
std::uint64_t type_at(const GgufTensor& t) { return dims_at(t) + 8 * t.n_dims; }
std::uint64_t offset_at(const GgufTensor& t) { return type_at(t) + 4; }

TEST(GgufReader, ReadsEveryValueTypeAndTensor) {
  const auto bytes = file_bytes(every_value_builder());
  const GgufModel m = parse_ok(bytes);
  EXPECT_EQ(m.version, 3u);
  EXPECT_EQ(m.alignment, 64u);
  EXPECT_EQ(m.data_offset % 64, 0u);
  EXPECT_EQ(m.file_size, bytes.size());
  EXPECT_EQ(m.find("test.u8")->u, 200u);
  EXPECT_EQ(m.find("test.i8")->i, -100);
  EXPECT_EQ(m.find("test.u16")->u, 60000u);
  EXPECT_EQ(m.find("test.i16")->i, -30000);
  EXPECT_EQ(m.find("test.u32")->u, 4000000000u);
  EXPECT_EQ(m.find("test.i32")->i, -2000000000);
  EXPECT_EQ(m.find("test.f32")->f, 0.5);
  EXPECT_EQ(m.find("test.bool")->u, 1u);
  EXPECT_EQ(m.find("test.string")->str, "h\xc3\xa9llo");
  EXPECT_EQ(m.find("test.u64")->u, 1ull << 60);
  EXPECT_EQ(m.find("test.i64")->i, -(1ll << 60));
  EXPECT_EQ(m.find("test.f64")->f, 3.25);
  for (const char* t :
       {"uint8", "int8", "uint16", "int16", "uint32", "int32", "float32", "bool", "uint64", "int64", "float64"}) {
    const GgufValue* a = m.find(std::string("test.array.") + t);
    ASSERT_NE(a, nullptr) << t;
    EXPECT_EQ(a->type, GgufValueType::array);
    ASSERT_EQ(a->count, 4u) << t;
    EXPECT_EQ(*a->number_at(0), 0.0) << t;
    EXPECT_EQ(*a->number_at(1), 1.0) << t;
    EXPECT_EQ(*a->number_at(3), 0.0) << t;
    EXPECT_FALSE(a->number_at(4).has_value()) << t;
  }
  const GgufValue* s = m.find("test.array.string");
  ASSERT_EQ(s->items.size(), 3u);
  EXPECT_EQ(s->items[2].str, "ccc");
  EXPECT_EQ(s->items[1].str, "");
  EXPECT_EQ(m.find("test.array.empty")->count, 0u);
  const GgufValue* nested = m.find("test.array.nested");
  ASSERT_EQ(nested->items.size(), 2u);
  EXPECT_EQ(*nested->items[0].number_at(1), 2.0);
  EXPECT_EQ(nested->items[1].items[0].str, "x");
  EXPECT_EQ(nested->to_string(), "[[1, 2], ['x']]");

  ASSERT_EQ(m.tensors.size(), 6u);
  const GgufTensor* q8 = m.find_tensor("w.q8_0");
  ASSERT_NE(q8, nullptr);
  EXPECT_EQ(q8->type, GgmlType::q8_0);
  EXPECT_EQ(q8->shape_string(), "[96, 4]");
  EXPECT_EQ(q8->n_bytes, 4u * 3 * 34);
  EXPECT_EQ(q8->row_bytes(), 3u * 34);
  const GgufTensor* t3 = m.find_tensor("w.3d");
  EXPECT_EQ(t3->n_dims, 3u);
  EXPECT_EQ(t3->rows(), 6u);
  for (const auto& t : m.tensors) {
    EXPECT_EQ(t.offset % 64, 0u) << t.name;
    EXPECT_EQ(t.file_offset, m.data_offset + t.offset) << t.name;
    EXPECT_LE(t.file_offset + t.n_bytes, bytes.size()) << t.name;
  }
}

TEST(GgufReader, Q4_0TensorsHaveTheirBlockSizes) {
  GgufBuilder b;
  b.add_tensor({"w.q4_0", GgmlType::q4_0, {96, 4}});
  b.add_tensor({"w.q4_0.3d", GgmlType::q4_0, {32, 2, 3}});
  const auto bytes = file_bytes(b);
  const GgufModel m = parse_ok(bytes);
  const GgufTensor* q4 = m.find_tensor("w.q4_0");
  ASSERT_NE(q4, nullptr);
  EXPECT_EQ(q4->type, GgmlType::q4_0);
  EXPECT_EQ(q4->shape_string(), "[96, 4]");
  EXPECT_EQ(q4->n_bytes, 4u * 3 * 18);
  EXPECT_EQ(q4->row_bytes(), 3u * 18);
  EXPECT_EQ(m.find_tensor("w.q4_0.3d")->n_bytes, 6u * 18);
  auto b2 = bytes;
  poke<std::uint64_t>(b2, dims_at(*q4), 48);
  const std::string msg = parse_error(b2);
  EXPECT_NE(msg.find("Q4_0 stores blocks of 32 elements but the row length dims[0] is 48"), std::string::npos) << msg;
}

TEST(GgufReader, FileWithoutTensorsIsValid) {
  GgufBuilder b;
  b.set("general.name", GgufValue::of_string("empty"));
  const GgufModel m = parse_ok(file_bytes(b));
  EXPECT_TRUE(m.tensors.empty());
  EXPECT_EQ(m.find("general.name")->str, "empty");
}

TEST(GgufReader, TruncationAtEveryByteIsOneNamedError) {
  const auto good = file_bytes(every_value_builder());
  const GgufModel m = parse_ok(good);
  for (std::size_t cut = 0; cut < good.size(); ++cut) {
    std::vector<std::uint8_t> bytes(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(cut));
    auto r = parse_gguf(bytes, "t.gguf");
    ASSERT_FALSE(r.is_ok()) << "cut at " << cut << " was accepted";
    const std::string& msg = r.message();
    ASSERT_TRUE(std::regex_search(msg, std::regex("^t\\.gguf: byte [0-9]+ \\([^)]+\\): .+"))) << msg;
    const auto at = std::stoull(msg.substr(std::strlen("t.gguf: byte ")));
    EXPECT_LE(at, cut) << msg;  // the error points at or before the end of what exists
    if (cut >= m.data_offset) {
      EXPECT_NE(msg.find("offset): the tensor's"), std::string::npos) << msg;
      EXPECT_NE(msg.find("end past the end of the file"), std::string::npos) << msg;
    } else if (cut >= 4) {
      EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
    }
  }
}

TEST(GgufReader, BadMagic) {
  auto bytes = file_bytes(every_value_builder());
  bytes[0] = 'P';
  bytes[1] = 'K';
  const std::string msg = parse_error(bytes);
  EXPECT_NE(msg.find("byte 0 (magic)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("not a GGUF file"), std::string::npos) << msg;
  EXPECT_NE(parse_error({'G', 'G'}).find("shorter than the 4-byte GGUF magic"), std::string::npos);
}

TEST(GgufReader, BadVersion) {
  auto bytes = file_bytes(every_value_builder());
  poke<std::uint32_t>(bytes, 4, 1);
  std::string msg = parse_error(bytes);
  EXPECT_NE(msg.find("byte 4 (version): version 1 (accepted: 2, 3)"), std::string::npos) << msg;
  poke<std::uint32_t>(bytes, 4, 0x03000000u);
  msg = parse_error(bytes);
  EXPECT_NE(msg.find("big-endian"), std::string::npos) << msg;
  poke<std::uint32_t>(bytes, 4, 2);  // v2 has the same layout and is accepted
  EXPECT_EQ(parse_ok(bytes).version, 2u);
}

TEST(GgufReader, HugeCountsAreRejectedBeforeAllocating) {
  auto bytes = file_bytes(every_value_builder());
  auto b1 = bytes;
  poke<std::uint64_t>(b1, 8, 1ull << 62);
  EXPECT_NE(parse_error(b1).find("byte 8 (tensor_count)"), std::string::npos);
  auto b2 = bytes;
  poke<std::uint64_t>(b2, 16, ~0ull);
  EXPECT_NE(parse_error(b2).find("byte 16 (metadata_kv_count)"), std::string::npos);
  auto b3 = bytes;
  poke<std::uint64_t>(b3, 24, 1ull << 40);  // the first key's length
  const std::string msg = parse_error(b3);
  EXPECT_NE(msg.find("byte 24 (metadata[0] key length): string length 1099511627776"), std::string::npos) << msg;

  const GgufModel m = parse_ok(bytes);
  auto b4 = bytes;
  const auto& arr = kv_of(m, "test.array.int32");
  poke<std::uint64_t>(b4, value_at(arr) + 4, 1ull << 61);
  const std::string msg4 = parse_error(b4);
  EXPECT_NE(msg4.find("byte " + std::to_string(value_at(arr) + 4) + " (metadata["), std::string::npos) << msg4;
  EXPECT_NE(msg4.find("'test.array.int32' array count)"), std::string::npos) << msg4;
  auto b5 = bytes;
  const auto& strs = kv_of(m, "test.array.string");
  poke<std::uint64_t>(b5, value_at(strs) + 4, 1ull << 59);
  EXPECT_NE(parse_error(b5).find("array count"), std::string::npos);
}

TEST(GgufReader, TensorOffsetPastEndOrMisaligned) {
  const auto bytes = file_bytes(every_value_builder());
  const GgufModel m = parse_ok(bytes);
  const GgufTensor& t = *m.find_tensor("w.f16");
  auto b1 = bytes;
  poke<std::uint64_t>(b1, offset_at(t), 1ull << 40);
  std::string msg = parse_error(b1);
  EXPECT_NE(msg.find("byte " + std::to_string(offset_at(t)) + " (tensor[1] 'w.f16' offset)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("end past the end of the file"), std::string::npos) << msg;
  auto b2 = bytes;
  poke<std::uint64_t>(b2, offset_at(t), ~0ull - 63);  // aligned, and offset + size overflows
  EXPECT_NE(parse_error(b2).find("end past the end of the file"), std::string::npos);
  auto b3 = bytes;
  poke<std::uint64_t>(b3, offset_at(t), t.offset + 2);
  msg = parse_error(b3);
  EXPECT_NE(msg.find("is not a multiple of general.alignment (64): the tensor data is misaligned"), std::string::npos)
      << msg;
}

TEST(GgufReader, UnknownTypes) {
  const auto bytes = file_bytes(every_value_builder());
  const GgufModel m = parse_ok(bytes);
  const GgufTensor& t = *m.find_tensor("w.bf16");
  for (std::uint32_t bad : {4u, 31u, 99u, 0xffffffffu}) {
    auto b = bytes;
    poke<std::uint32_t>(b, type_at(t), bad);
    const std::string msg = parse_error(b);
    EXPECT_NE(msg.find("byte " + std::to_string(type_at(t)) + " (tensor[3] 'w.bf16' type): " + std::to_string(bad) +
                       " is not a ggml type"),
              std::string::npos)
        << msg;
  }
  auto b = bytes;
  const auto& kv = kv_of(m, "test.f64");
  poke<std::uint32_t>(b, value_type_at(kv), 13);
  std::string msg = parse_error(b);
  EXPECT_NE(msg.find("'test.f64' value type): 13 is not a GGUF value type (accepted: 0..12)"), std::string::npos) << msg;
  auto b2 = bytes;
  poke<std::uint32_t>(b2, value_at(kv_of(m, "test.array.uint8")), 77);
  msg = parse_error(b2);
  EXPECT_NE(msg.find("array element type): 77 is not a GGUF value type"), std::string::npos) << msg;
}

TEST(GgufReader, BadAlignment) {
  for (std::uint64_t bad : {0ull, 48ull, 1ull << 31}) {
    GgufBuilder b;
    b.set("general.alignment", GgufValue::of_uint(GgufValueType::uint64, 32));
    b.add_tensor({"w", GgmlType::f32, {8, 2}});
    auto bytes = file_bytes(b);
    poke<std::uint64_t>(bytes, 24 + 8 + std::strlen("general.alignment") + 4, bad);
    const std::string msg = parse_error(bytes);
    EXPECT_NE(msg.find("byte 24 (general.alignment): value " + std::to_string(bad) + " (accepted: a power of two"),
              std::string::npos)
        << msg;
  }
  GgufBuilder b;
  b.set("general.alignment", GgufValue::of_string("32"));
  const std::string msg = parse_error(file_bytes(b));
  EXPECT_NE(msg.find("(general.alignment): value of type string"), std::string::npos) << msg;
}

TEST(GgufReader, BadDimensions) {
  const auto bytes = file_bytes(every_value_builder());
  const GgufModel m = parse_ok(bytes);
  const GgufTensor& t = *m.find_tensor("w.f32");
  for (std::uint32_t nd : {0u, 5u}) {
    auto b = bytes;
    poke<std::uint32_t>(b, dims_at(t) - 4, nd);
    const std::string msg = parse_error(b);
    EXPECT_NE(msg.find("(tensor[0] 'w.f32' n_dims): " + std::to_string(nd) + " dimensions (accepted: 1 to 4)"), std::string::npos)
        << msg;
  }
  auto b = bytes;
  poke<std::uint64_t>(b, dims_at(t), 1ull << 40);
  poke<std::uint64_t>(b, dims_at(t) + 8, 1ull << 40);
  std::string msg = parse_error(b);
  EXPECT_NE(msg.find("(tensor[0] 'w.f32' dims[1]): dimension 1099511627776 makes the element count overflow"), std::string::npos)
      << msg;
  const GgufTensor& q = *m.find_tensor("w.q8_0");
  auto b2 = bytes;
  poke<std::uint64_t>(b2, dims_at(q), 33);
  msg = parse_error(b2);
  EXPECT_NE(msg.find("Q8_0 stores blocks of 32 elements but the row length dims[0] is 33"), std::string::npos) << msg;
}

TEST(GgufReader, DuplicatesAndBadValues) {
  const auto bytes = file_bytes(every_value_builder());
  const GgufModel m = parse_ok(bytes);
  auto b1 = bytes;
  const auto& kv = kv_of(m, "test.i8");
  b1[kv.file_offset + 8 + 5] = 'u';  // "test.i8" -> "test.u8"
  EXPECT_NE(parse_error(b1).find("'test.u8'): duplicate key"), std::string::npos);
  auto b2 = bytes;
  const GgufTensor& t = *m.find_tensor("w.f16");
  std::memcpy(b2.data() + t.info_offset + 8, "w.f32", 5);
  EXPECT_NE(parse_error(b2).find("(tensor[1] 'w.f32' name): duplicate tensor name"), std::string::npos);
  auto b3 = bytes;
  b3[value_at(kv_of(m, "test.bool"))] = 2;
  EXPECT_NE(parse_error(b3).find("'test.bool'): bool value 2 (accepted: 0 or 1)"), std::string::npos);
}

TEST(GgufReader, DeepNestingIsRefused) {
  GgufValue v = GgufValue::of_numbers(GgufValueType::uint8, {1});
  for (int k = 0; k < 12; ++k) v = GgufValue::of_arrays(GgufValueType::array, {v});
  GgufBuilder b;
  b.set("deep", v);
  EXPECT_NE(parse_error(file_bytes(b)).find("nested more than 8 deep"), std::string::npos);
}

TEST(GgufFileOpen, MapsAValidFile) {
  testing::ScratchDir dir;
  const auto bytes = file_bytes(every_value_builder());
  testing::write_bytes(dir.file("m.gguf"), bytes);
  auto f = GgufFile::open(dir.file("m.gguf"));
  ASSERT_TRUE(f.is_ok()) << f.message();
  EXPECT_EQ(f->size(), bytes.size());
  const GgufTensor& t = *f->model().find_tensor("w.q8_0");
  const auto data = f->tensor_data(t);
  EXPECT_EQ(data.size(), t.n_bytes);
  EXPECT_EQ(0, std::memcmp(data.data(), bytes.data() + t.file_offset, data.size()));
  GgufFile moved = std::move(f).value();
  EXPECT_EQ(moved.model().tensors.size(), 6u);
}

TEST(GgufFileOpen, ClearErrorsForFilesThatAreNotModels) {
  testing::ScratchDir dir;
  auto missing = GgufFile::open(dir.file("nope.gguf"));
  ASSERT_FALSE(missing.is_ok());
  EXPECT_EQ(missing.status().code(), ErrorCode::not_found);
  EXPECT_EQ(missing.message(), dir.file("nope.gguf") + ": cannot open: No such file or directory");
  auto d = GgufFile::open(dir.path());
  EXPECT_NE(d.message().find("not a regular file"), std::string::npos) << d.message();
  testing::write_bytes(dir.file("empty.gguf"), {});
  EXPECT_NE(GgufFile::open(dir.file("empty.gguf")).message().find("the file is empty"), std::string::npos);
  testing::write_bytes(dir.file("text.gguf"), {'h', 'e', 'l', 'l', 'o', '\n'});
  const auto text = GgufFile::open(dir.file("text.gguf"));
  EXPECT_EQ(text.message(), dir.file("text.gguf") +
                                ": byte 0 (magic): expected 'GGUF' (47 47 55 46), found 68 65 6c 6c: not a GGUF file");
}

TEST(GgmlTypes, SizesAndNames) {
  EXPECT_EQ(ggml_type_info(8)->block_bytes, 34u);
  EXPECT_EQ(ggml_type_info(30)->name, "BF16");
  EXPECT_EQ(ggml_type_info(9)->block_bytes, 36u);
  EXPECT_EQ(ggml_type_info(14)->block_bytes, 210u);
  EXPECT_EQ(ggml_type_info(4), nullptr);
  EXPECT_EQ(ggml_type_info(2)->name, "Q4_0");
  EXPECT_EQ(ggml_type_info(2)->block_bytes, 18u);
  EXPECT_TRUE(decode_supported(GgmlType::q8_0));
  EXPECT_TRUE(decode_supported(GgmlType::q4_0));
  EXPECT_FALSE(decode_supported(GgmlType::q4_k));
  EXPECT_FALSE(decode_supported(GgmlType::q4_1));
  EXPECT_EQ(*parse_model_type("Q8_0"), GgmlType::q8_0);
  EXPECT_EQ(*parse_model_type("q4_0"), GgmlType::q4_0);
  EXPECT_EQ(*parse_model_type("Q4_0"), GgmlType::q4_0);
  EXPECT_EQ(parse_model_type("q4_k").message(), "unknown model type 'q4_k'; accepted: f32, f16, bf16, q8_0, q4_0");
}

}  // namespace
}  // namespace residency::workload
