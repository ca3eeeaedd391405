// SPDX-License-Identifier: MIT
// GGUF reader: the model file format of llama.cpp, read so that the idle benchmark can run on
// a real model and not on a buffer of our own making.
//
// The one decision that shapes it: the reader trusts nothing in the file. Every count, length,
// offset and size is checked against the bytes that are really there before it is used, so a
// truncated or hostile file gives one error that names the field and the byte offset where it
// went wrong ("model.gguf: byte 1234 (tensor 3 'blk.0.attn_q.weight' type): 99 is not a ggml
// type ..."), never a crash, an over-read or a huge allocation. The parser works on a byte span
// (which is what the fuzzer feeds it); GgufFile maps a file read-only and parses the mapping,
// which is how llama.cpp loads weights (MAP_SHARED, PROT_READ), so the pages the benchmark reads
// are page-cache pages that memory pressure can evict and mlock can wire.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "residency/status.hpp"

namespace residency::workload {

// ggml tensor element types, with the numbers the file stores. Ids 4, 5, 31-33 and 36-38 were
// used by types ggml has since removed; the reader rejects them as unknown.
enum class GgmlType : std::uint32_t {
  f32 = 0,
  f16 = 1,
  q4_0 = 2,
  q4_1 = 3,
  q5_0 = 6,
  q5_1 = 7,
  q8_0 = 8,
  q8_1 = 9,
  q2_k = 10,
  q3_k = 11,
  q4_k = 12,
  q5_k = 13,
  q6_k = 14,
  q8_k = 15,
  iq2_xxs = 16,
  iq2_xs = 17,
  iq3_xxs = 18,
  iq1_s = 19,
  iq4_nl = 20,
  iq3_s = 21,
  iq2_s = 22,
  iq4_xs = 23,
  i8 = 24,
  i16 = 25,
  i32 = 26,
  i64 = 27,
  f64 = 28,
  iq1_m = 29,
  bf16 = 30,
  tq1_0 = 34,
  tq2_0 = 35,
  mxfp4 = 39,
};

// How a type is stored: `block_elems` elements take `block_bytes` bytes; a row's length must be
// a multiple of block_elems.
struct GgmlTypeInfo {
  GgmlType type;
  std::string_view name;  // "F16", "Q8_0", ... as llama.cpp prints them
  std::uint32_t block_elems;
  std::uint32_t block_bytes;
};

// nullptr for an id that is not a ggml type.
const GgmlTypeInfo* ggml_type_info(std::uint32_t id) noexcept;
std::string_view ggml_type_name(GgmlType t) noexcept;
// The types the decode-equivalent pass computes with: F32, F16, BF16, Q8_0, Q4_0.
bool decode_supported(GgmlType t) noexcept;
// "f32", "f16", "bf16", "q8_0", "q4_0" (any case): the types the synthetic model writer produces.
Result<GgmlType> parse_model_type(std::string_view text);

enum class GgufValueType : std::uint32_t {
  uint8 = 0,
  int8 = 1,
  uint16 = 2,
  int16 = 3,
  uint32 = 4,
  int32 = 5,
  float32 = 6,
  boolean = 7,
  string = 8,
  array = 9,
  uint64 = 10,
  int64 = 11,
  float64 = 12,
};
std::string_view to_string(GgufValueType t) noexcept;

// One metadata value. Scalars are held widened (u for unsigned and bool, i for signed, f for
// floats); arrays of numbers keep their bytes as stored (so a 10-million-entry array costs its
// file size, not 10 million objects) and arrays of strings or arrays hold their items.
struct GgufValue {
  GgufValueType type = GgufValueType::uint8;
  std::uint64_t u = 0;
  std::int64_t i = 0;
  double f = 0;
  std::string str;
  // Arrays only.
  GgufValueType elem_type = GgufValueType::uint8;
  std::uint64_t count = 0;
  std::vector<std::uint8_t> raw;  // numeric or bool elements, little-endian, count * elem size
  std::vector<GgufValue> items;   // string or array elements (count of them)

  // The value as an integer when it is one of the integer types (or bool), else nullopt.
  std::optional<std::uint64_t> as_uint() const;
  std::optional<std::int64_t> as_int() const;
  // Element `index` of a numeric array, widened to double; nullopt when out of range or not one.
  std::optional<double> number_at(std::uint64_t index) const;
  // A short human-readable rendering: arrays show their first `max_items` items.
  std::string to_string(std::size_t max_items = 4) const;

  // Builders, used by the writer and by tests.
  static GgufValue of_uint(GgufValueType t, std::uint64_t v);
  static GgufValue of_int(GgufValueType t, std::int64_t v);
  static GgufValue of_float(GgufValueType t, double v);
  static GgufValue of_bool(bool v);
  static GgufValue of_string(std::string v);
  // A numeric array: `values` are converted to elem_type.
  static GgufValue of_numbers(GgufValueType elem_type, const std::vector<double>& values);
  static GgufValue of_strings(std::vector<std::string> values);
  static GgufValue of_arrays(GgufValueType elem_type, std::vector<GgufValue> arrays);
};

// Size in bytes of one element of a fixed-size value type; 0 for string and array.
std::size_t gguf_scalar_size(GgufValueType t) noexcept;

struct GgufKeyValue {
  std::string key;
  GgufValue value;
  std::uint64_t file_offset = 0;  // where the key starts in the file
};

inline constexpr std::size_t kGgufMaxDims = 4;  // GGML_MAX_DIMS

struct GgufTensor {
  std::string name;
  GgmlType type = GgmlType::f32;
  std::uint32_t n_dims = 0;
  std::array<std::uint64_t, kGgufMaxDims> ne{1, 1, 1, 1};  // ne[0] is the row length
  std::uint64_t offset = 0;                                // relative to the data section, as stored
  std::uint64_t file_offset = 0;                           // absolute: data_offset + offset
  std::uint64_t n_elements = 0;
  std::uint64_t n_bytes = 0;
  std::uint64_t info_offset = 0;  // where this tensor's info starts in the file

  std::uint64_t row_length() const { return ne[0]; }
  std::uint64_t rows() const { return ne[1] * ne[2] * ne[3]; }
  std::uint64_t row_bytes() const { return n_elements == 0 ? 0 : n_bytes / rows(); }
  // "[2048, 32000]": the shape as ggml and llama.cpp print it (ne[0] first).
  std::string shape_string() const;
};

inline constexpr std::uint32_t kGgufDefaultAlignment = 32;  // GGUF_DEFAULT_ALIGNMENT

struct GgufModel {
  std::uint32_t version = 0;
  std::uint64_t alignment = kGgufDefaultAlignment;
  std::uint64_t data_offset = 0;  // start of the data section (aligned)
  std::uint64_t file_size = 0;
  std::vector<GgufKeyValue> metadata;
  std::vector<GgufTensor> tensors;

  const GgufValue* find(std::string_view key) const;
  const GgufTensor* find_tensor(std::string_view name) const;
  std::uint64_t tensor_bytes() const;  // sum of every tensor's n_bytes
};

// Spec: GGUF v2/v3, little-endian: magic "GGUF", uint32 version, uint64 tensor count, uint64
// metadata count, the metadata (key string, uint32 value type, value), the tensor infos (name,
// uint32 n_dims, uint64 dims[n_dims], uint32 ggml type, uint64 offset relative to the data
// section), padding to `general.alignment` (default 32), the tensor data.
//
// Parses and checks a whole GGUF file held in `bytes`. `source` names it in error messages
// (a path, or "<memory>"). Errors (ErrorCode::invalid_argument) read
// "<source>: byte <offset> (<field>): <what was found>; <what is accepted>".
Result<GgufModel> parse_gguf(std::span<const std::uint8_t> bytes, std::string_view source);

// A GGUF file mapped read-only (MAP_SHARED, as llama.cpp maps weights) and parsed. Move-only;
// unmaps and closes on destruction.
class GgufFile {
 public:
  // Errors: the file is missing or unreadable (not_found / io_error, with the OS reason), is not
  // a regular file, is empty, or is not a valid GGUF file (invalid_argument, see parse_gguf).
  static Result<GgufFile> open(const std::string& path);

  GgufFile(GgufFile&& o) noexcept;
  GgufFile& operator=(GgufFile&& o) noexcept;
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;
  ~GgufFile();

  const GgufModel& model() const { return model_; }
  const std::string& path() const { return path_; }
  const std::uint8_t* data() const { return data_; }
  std::size_t size() const { return size_; }
  int fd() const { return fd_; }
  // The tensor's bytes inside the mapping (checked against the file by the parser).
  std::span<const std::uint8_t> tensor_data(const GgufTensor& t) const {
    return {data_ + t.file_offset, static_cast<std::size_t>(t.n_bytes)};
  }

 private:
  GgufFile() = default;
  void reset() noexcept;
  std::string path_;
  int fd_ = -1;
  const std::uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
  GgufModel model_;
};

}  // namespace residency::workload
