// SPDX-License-Identifier: MIT
// GGUF reader: every read is bounds-checked against the bytes that exist (see gguf.hpp).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <unordered_set>
#include <utility>

#include "residency/config.hpp"
#include "residency/text.hpp"
#include "workload/gguf.hpp"

namespace residency::workload {
namespace {

// Block sizes as ggml defines them (ggml-common.h); Q8_1 is 2 halves + 32 int8 = 36 bytes.
constexpr GgmlTypeInfo kTypes[] = {
    {GgmlType::f32, "F32", 1, 4},
    {GgmlType::f16, "F16", 1, 2},
    {GgmlType::q4_0, "Q4_0", 32, 18},
    {GgmlType::q4_1, "Q4_1", 32, 20},
    {GgmlType::q5_0, "Q5_0", 32, 22},
    {GgmlType::q5_1, "Q5_1", 32, 24},
    {GgmlType::q8_0, "Q8_0", 32, 34},
    {GgmlType::q8_1, "Q8_1", 32, 36},
    {GgmlType::q2_k, "Q2_K", 256, 84},
    {GgmlType::q3_k, "Q3_K", 256, 110},
    {GgmlType::q4_k, "Q4_K", 256, 144},
    {GgmlType::q5_k, "Q5_K", 256, 176},
    {GgmlType::q6_k, "Q6_K", 256, 210},
    {GgmlType::q8_k, "Q8_K", 256, 292},
    {GgmlType::iq2_xxs, "IQ2_XXS", 256, 66},
    {GgmlType::iq2_xs, "IQ2_XS", 256, 74},
    {GgmlType::iq3_xxs, "IQ3_XXS", 256, 98},
    {GgmlType::iq1_s, "IQ1_S", 256, 50},
    {GgmlType::iq4_nl, "IQ4_NL", 32, 18},
    {GgmlType::iq3_s, "IQ3_S", 256, 110},
    {GgmlType::iq2_s, "IQ2_S", 256, 82},
    {GgmlType::iq4_xs, "IQ4_XS", 256, 136},
    {GgmlType::i8, "I8", 1, 1},
    {GgmlType::i16, "I16", 1, 2},
    {GgmlType::i32, "I32", 1, 4},
    {GgmlType::i64, "I64", 1, 8},
    {GgmlType::f64, "F64", 1, 8},
    {GgmlType::iq1_m, "IQ1_M", 256, 56},
    {GgmlType::bf16, "BF16", 1, 2},
    {GgmlType::tq1_0, "TQ1_0", 256, 54},
    {GgmlType::tq2_0, "TQ2_0", 256, 66},
    {GgmlType::mxfp4, "MXFP4", 32, 17},
};

// Nested arrays are legal GGUF; nothing real nests more than 2 deep. The limit keeps a hostile
// file from recursing the parser off its stack.
constexpr int kMaxArrayDepth = 8;
// Smallest possible encodings, used to reject counts that cannot fit in the bytes left before
// allocating anything for them.
constexpr std::uint64_t kMinKeyValueBytes = 8 + 4 + 1;            // empty key, type, 1-byte value
constexpr std::uint64_t kMinTensorInfoBytes = 8 + 4 + 8 + 4 + 8;  // empty name, 1 dim, type, offset
constexpr std::uint64_t kMaxAlignment = std::uint64_t{1} << 30;   // 1 GiB: far above any real use

struct ParseError {
  std::uint64_t offset;
  std::string field;
  std::string what;
};

std::string hex_bytes(const std::uint8_t* p, std::size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (std::size_t k = 0; k < n; ++k) {
    if (k) s += ' ';
    s += digits[p[k] >> 4];
    s += digits[p[k] & 15];
  }
  return s;
}

class Cursor {
 public:
  explicit Cursor(std::span<const std::uint8_t> bytes) : bytes_(bytes) {}

  std::uint64_t pos() const { return pos_; }
  std::uint64_t size() const { return bytes_.size(); }
  std::uint64_t left() const { return bytes_.size() - pos_; }

  [[noreturn]] void fail(std::uint64_t at, std::string field, std::string what) const {
    throw ParseError{at, std::move(field), std::move(what)};
  }

  void need(std::uint64_t n, const std::string& field) const {
    if (n > left()) {
      fail(pos_, field,
           "needs " + std::to_string(n) + " bytes but the file ends " + std::to_string(left()) +
               " bytes later (file size " + std::to_string(size()) + "): the file is truncated");
    }
  }

  template <typename T>
  T read(const std::string& field) {
    need(sizeof(T), field);
    T v;
    std::memcpy(&v, bytes_.data() + pos_, sizeof(T));  // the format is little-endian, as is every host we build for
    pos_ += sizeof(T);
    return v;
  }

  std::string read_string(const std::string& field) {
    const std::uint64_t at = pos_;
    const auto len = read<std::uint64_t>(field + " length");
    if (len > left()) {
      fail(at, field + " length",
           "string length " + std::to_string(len) + " is more than the " + std::to_string(left()) +
               " bytes left in the file: the file is truncated or corrupt");
    }
    std::string s(reinterpret_cast<const char*>(bytes_.data() + pos_), static_cast<std::size_t>(len));
    pos_ += len;
    return s;
  }

  const std::uint8_t* here() const { return bytes_.data() + pos_; }
  void skip(std::uint64_t n) { pos_ += n; }  // callers have called need(n)

 private:
  std::span<const std::uint8_t> bytes_;
  std::uint64_t pos_ = 0;
};

bool is_known_value_type(std::uint32_t t) { return t <= 12; }

std::string quoted_name(const std::string& s) {
  std::string out = "'";
  for (char c : s.substr(0, 64)) {
    const auto u = static_cast<unsigned char>(c);
    out += (u >= 0x20 && u < 0x7f) ? c : '?';
  }
  if (s.size() > 64) out += "...";
  return out + "'";
}

GgufValue read_value(Cursor& c, GgufValueType type, const std::string& field, int depth);

GgufValue read_array(Cursor& c, const std::string& field, int depth) {
  GgufValue v;
  v.type = GgufValueType::array;
  const std::uint64_t type_at = c.pos();
  const auto elem = c.read<std::uint32_t>(field + " array element type");
  if (!is_known_value_type(elem)) {
    c.fail(type_at, field + " array element type", std::to_string(elem) + " is not a GGUF value type (accepted: 0..12)");
  }
  v.elem_type = static_cast<GgufValueType>(elem);
  const std::uint64_t count_at = c.pos();
  v.count = c.read<std::uint64_t>(field + " array count");
  const std::size_t scalar = gguf_scalar_size(v.elem_type);
  // Strings take at least their 8-byte length, arrays at least type + count.
  const std::uint64_t min_elem = scalar ? scalar : (v.elem_type == GgufValueType::string ? 8 : 12);
  if (v.count > c.left() / min_elem) {
    c.fail(count_at, field + " array count",
           "an array of " + std::to_string(v.count) + " " + std::string(to_string(v.elem_type)) +
               " values needs at least " + std::to_string(min_elem) + " bytes each, more than the " +
               std::to_string(c.left()) + " bytes left in the file: the file is truncated or the count is corrupt");
  }
  if (scalar) {
    const std::uint64_t n = v.count * scalar;
    c.need(n, field);
    if (v.elem_type == GgufValueType::boolean) {
      for (std::uint64_t k = 0; k < v.count; ++k) {
        if (c.here()[k] > 1) {
          c.fail(c.pos() + k, field + "[" + std::to_string(k) + "]",
                 "bool value " + std::to_string(c.here()[k]) + " (accepted: 0 or 1)");
        }
      }
    }
    v.raw.assign(c.here(), c.here() + n);
    c.skip(n);
    return v;
  }
  if (depth >= kMaxArrayDepth) {
    c.fail(type_at, field + " array element type",
           "arrays nested more than " + std::to_string(kMaxArrayDepth) + " deep are not accepted");
  }
  v.items.reserve(static_cast<std::size_t>(v.count));
  for (std::uint64_t k = 0; k < v.count; ++k) {
    v.items.push_back(read_value(c, v.elem_type, field + "[" + std::to_string(k) + "]", depth + 1));
  }
  return v;
}

GgufValue read_value(Cursor& c, GgufValueType type, const std::string& field, int depth) {
  GgufValue v;
  v.type = type;
  switch (type) {
    case GgufValueType::uint8: v.u = c.read<std::uint8_t>(field); break;
    case GgufValueType::int8: v.i = c.read<std::int8_t>(field); break;
    case GgufValueType::uint16: v.u = c.read<std::uint16_t>(field); break;
    case GgufValueType::int16: v.i = c.read<std::int16_t>(field); break;
    case GgufValueType::uint32: v.u = c.read<std::uint32_t>(field); break;
    case GgufValueType::int32: v.i = c.read<std::int32_t>(field); break;
    case GgufValueType::uint64: v.u = c.read<std::uint64_t>(field); break;
    case GgufValueType::int64: v.i = c.read<std::int64_t>(field); break;
    case GgufValueType::float32: v.f = static_cast<double>(c.read<float>(field)); break;
    case GgufValueType::float64: v.f = c.read<double>(field); break;
    case GgufValueType::boolean: {
      const std::uint64_t at = c.pos();
      v.u = c.read<std::uint8_t>(field);
      if (v.u > 1) c.fail(at, field, "bool value " + std::to_string(v.u) + " (accepted: 0 or 1)");
      break;
    }
    case GgufValueType::string: v.str = c.read_string(field); break;
    case GgufValueType::array: return read_array(c, field, depth);
  }
  return v;
}

std::uint64_t checked_alignment(const GgufKeyValue& kv, Cursor& c) {
  const auto a = kv.value.as_uint();
  if (!a) {
    c.fail(kv.file_offset, "general.alignment",
           "value of type " + std::string(to_string(kv.value.type)) +
               " (accepted: an unsigned integer, uint32 in the spec)");
  }
  if (*a == 0 || (*a & (*a - 1)) != 0 || *a > kMaxAlignment) {
    c.fail(kv.file_offset, "general.alignment",
           "value " + std::to_string(*a) + " (accepted: a power of two from 1 to 2^30)");
  }
  return *a;
}

GgufModel parse(Cursor& c) {
  GgufModel m;
  m.file_size = c.size();
  if (c.size() < 4) {
    c.fail(0, "magic",
           "the file is " + std::to_string(c.size()) +
               " bytes long, shorter than the 4-byte GGUF magic: not a GGUF file");
  }
  if (std::memcmp(c.here(), "GGUF", 4) != 0) {
    c.fail(0, "magic", "expected 'GGUF' (47 47 55 46), found " + hex_bytes(c.here(), 4) + ": not a GGUF file");
  }
  c.skip(4);
  m.version = c.read<std::uint32_t>("version");
  if (m.version != 2 && m.version != 3) {
    std::string hint;
    if (m.version == 1) hint = " (version 1 used 32-bit counts and is obsolete; re-convert the model)";
    if (m.version == 0x03000000u || m.version == 0x02000000u) hint = " (this is a big-endian GGUF file)";
    c.fail(4, "version", "version " + std::to_string(m.version) + " (accepted: 2, 3)" + hint);
  }
  const std::uint64_t tc_at = c.pos();
  const auto tensor_count = c.read<std::uint64_t>("tensor_count");
  const std::uint64_t kc_at = c.pos();
  const auto kv_count = c.read<std::uint64_t>("metadata_kv_count");
  if (kv_count > c.left() / kMinKeyValueBytes) {
    c.fail(kc_at, "metadata_kv_count",
           std::to_string(kv_count) + " key-value pairs cannot fit in the " + std::to_string(c.left()) +
               " bytes left in the file: the file is truncated or the count is corrupt");
  }
  if (tensor_count > c.left() / kMinTensorInfoBytes) {
    c.fail(tc_at, "tensor_count",
           std::to_string(tensor_count) + " tensor infos cannot fit in the " + std::to_string(c.left()) +
               " bytes left in the file: the file is truncated or the count is corrupt");
  }

  std::unordered_set<std::string> keys;
  m.metadata.reserve(static_cast<std::size_t>(kv_count));
  for (std::uint64_t k = 0; k < kv_count; ++k) {
    GgufKeyValue kv;
    kv.file_offset = c.pos();
    const std::string field = "metadata[" + std::to_string(k) + "]";
    kv.key = c.read_string(field + " key");
    const std::string named = field + " " + quoted_name(kv.key);
    if (!keys.insert(kv.key).second) c.fail(kv.file_offset, named, "duplicate key");
    const std::uint64_t type_at = c.pos();
    const auto type = c.read<std::uint32_t>(named + " value type");
    if (!is_known_value_type(type)) {
      c.fail(type_at, named + " value type", std::to_string(type) + " is not a GGUF value type (accepted: 0..12)");
    }
    kv.value = read_value(c, static_cast<GgufValueType>(type), named, 0);
    if (kv.key == "general.alignment") m.alignment = checked_alignment(kv, c);
    m.metadata.push_back(std::move(kv));
  }

  std::unordered_set<std::string> names;
  m.tensors.reserve(static_cast<std::size_t>(tensor_count));
  for (std::uint64_t k = 0; k < tensor_count; ++k) {
    GgufTensor t;
    t.info_offset = c.pos();
    std::string field = "tensor[" + std::to_string(k) + "]";
    t.name = c.read_string(field + " name");
    field += " " + quoted_name(t.name);
    if (!names.insert(t.name).second) c.fail(t.info_offset, field + " name", "duplicate tensor name");
    const std::uint64_t nd_at = c.pos();
    t.n_dims = c.read<std::uint32_t>(field + " n_dims");
    if (t.n_dims == 0 || t.n_dims > kGgufMaxDims) {
      c.fail(nd_at, field + " n_dims", std::to_string(t.n_dims) + " dimensions (accepted: 1 to 4)");
    }
    std::uint64_t elements = 1;
    for (std::uint32_t d = 0; d < t.n_dims; ++d) {
      const std::uint64_t at = c.pos();
      const std::string dim_field = field + " dims[" + std::to_string(d) + "]";
      t.ne[d] = c.read<std::uint64_t>(dim_field);
      if (t.ne[d] > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) ||
          (t.ne[d] != 0 && elements > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) / t.ne[d])) {
        c.fail(at, dim_field,
               "dimension " + std::to_string(t.ne[d]) + " makes the element count overflow a 64-bit integer");
      }
      elements *= t.ne[d];
    }
    t.n_elements = elements;
    const std::uint64_t type_at = c.pos();
    const auto type_id = c.read<std::uint32_t>(field + " type");
    const GgmlTypeInfo* info = ggml_type_info(type_id);
    if (!info) {
      c.fail(type_at, field + " type",
             std::to_string(type_id) + " is not a ggml type this reader knows (known: 0-3, 6-30, 34, 35, 39)");
    }
    t.type = info->type;
    if (t.ne[0] % info->block_elems != 0) {
      c.fail(type_at, field + " type",
             std::string(info->name) + " stores blocks of " + std::to_string(info->block_elems) +
                 " elements but the row length dims[0] is " + std::to_string(t.ne[0]));
    }
    const std::uint64_t blocks = elements / info->block_elems;
    if (blocks > std::numeric_limits<std::uint64_t>::max() / info->block_bytes) {
      c.fail(type_at, field + " type", "the tensor's size in bytes overflows a 64-bit integer");
    }
    t.n_bytes = blocks * info->block_bytes;
    const std::uint64_t off_at = c.pos();
    t.offset = c.read<std::uint64_t>(field + " offset");
    t.file_offset = off_at;  // remembered for the checks below, replaced once data_offset is known
    m.tensors.push_back(std::move(t));
  }

  // The data section starts at the next multiple of the alignment.
  const std::uint64_t end_of_infos = c.pos();
  const std::uint64_t pad = (m.alignment - end_of_infos % m.alignment) % m.alignment;
  m.data_offset = end_of_infos + pad;
  if (!m.tensors.empty() && m.data_offset > c.size()) {
    c.fail(end_of_infos, "data section",
           "the data section would start at byte " + std::to_string(m.data_offset) +
               " (after padding to general.alignment " + std::to_string(m.alignment) + ") but the file ends at byte " +
               std::to_string(c.size()) + ": the file is truncated");
  }
  for (std::size_t k = 0; k < m.tensors.size(); ++k) {
    GgufTensor& t = m.tensors[k];
    const std::uint64_t off_at = t.file_offset;
    const std::string field = "tensor[" + std::to_string(k) + "] " + quoted_name(t.name) + " offset";
    if (t.offset % m.alignment != 0) {
      c.fail(off_at, field,
             std::to_string(t.offset) + " is not a multiple of general.alignment (" + std::to_string(m.alignment) +
                 "): the tensor data is misaligned");
    }
    const std::uint64_t room = c.size() - m.data_offset;
    if (t.offset > room || t.n_bytes > room - t.offset) {
      c.fail(off_at, field,
             "the tensor's " + std::to_string(t.n_bytes) + " bytes at data offset " + std::to_string(t.offset) +
                 " (file byte " + std::to_string(m.data_offset) + " + " + std::to_string(t.offset) +
                 ") end past the end of the file (" + std::to_string(c.size()) +
                 " bytes): the file is truncated or corrupt");
    }
    t.file_offset = m.data_offset + t.offset;
  }
  return m;
}

}  // namespace

const GgmlTypeInfo* ggml_type_info(std::uint32_t id) noexcept {
  for (const auto& t : kTypes) {
    if (static_cast<std::uint32_t>(t.type) == id) return &t;
  }
  return nullptr;
}

std::string_view ggml_type_name(GgmlType t) noexcept {
  const GgmlTypeInfo* info = ggml_type_info(static_cast<std::uint32_t>(t));
  return info ? info->name : std::string_view("?");
}

bool decode_supported(GgmlType t) noexcept {
  return t == GgmlType::f32 || t == GgmlType::f16 || t == GgmlType::bf16 || t == GgmlType::q8_0 || t == GgmlType::q4_0;
}

Result<GgmlType> parse_model_type(std::string_view text) {
  std::string lower;
  for (char ch : text) lower += static_cast<char>(ch >= 'A' && ch <= 'Z' ? ch - 'A' + 'a' : ch);
  if (lower == "f32") return GgmlType::f32;
  if (lower == "f16") return GgmlType::f16;
  if (lower == "bf16") return GgmlType::bf16;
  if (lower == "q8_0") return GgmlType::q8_0;
  if (lower == "q4_0") return GgmlType::q4_0;
  return Status(ErrorCode::invalid_argument,
                "unknown model type '" + printable(text) + "'; accepted: f32, f16, bf16, q8_0, q4_0");
}

std::string_view to_string(GgufValueType t) noexcept {
  switch (t) {
    case GgufValueType::uint8: return "uint8";
    case GgufValueType::int8: return "int8";
    case GgufValueType::uint16: return "uint16";
    case GgufValueType::int16: return "int16";
    case GgufValueType::uint32: return "uint32";
    case GgufValueType::int32: return "int32";
    case GgufValueType::float32: return "float32";
    case GgufValueType::boolean: return "bool";
    case GgufValueType::string: return "string";
    case GgufValueType::array: return "array";
    case GgufValueType::uint64: return "uint64";
    case GgufValueType::int64: return "int64";
    case GgufValueType::float64: return "float64";
  }
  return "?";
}

std::size_t gguf_scalar_size(GgufValueType t) noexcept {
  switch (t) {
    case GgufValueType::uint8:
    case GgufValueType::int8:
    case GgufValueType::boolean: return 1;
    case GgufValueType::uint16:
    case GgufValueType::int16: return 2;
    case GgufValueType::uint32:
    case GgufValueType::int32:
    case GgufValueType::float32: return 4;
    case GgufValueType::uint64:
    case GgufValueType::int64:
    case GgufValueType::float64: return 8;
    case GgufValueType::string:
    case GgufValueType::array: return 0;
  }
  return 0;
}

std::optional<std::uint64_t> GgufValue::as_uint() const {
  switch (type) {
    case GgufValueType::uint8:
    case GgufValueType::uint16:
    case GgufValueType::uint32:
    case GgufValueType::uint64:
    case GgufValueType::boolean: return u;
    case GgufValueType::int8:
    case GgufValueType::int16:
    case GgufValueType::int32:
    case GgufValueType::int64:
      if (i < 0) return std::nullopt;
      return static_cast<std::uint64_t>(i);
    default: return std::nullopt;
  }
}

std::optional<std::int64_t> GgufValue::as_int() const {
  switch (type) {
    case GgufValueType::int8:
    case GgufValueType::int16:
    case GgufValueType::int32:
    case GgufValueType::int64: return i;
    case GgufValueType::uint8:
    case GgufValueType::uint16:
    case GgufValueType::uint32:
    case GgufValueType::uint64:
    case GgufValueType::boolean:
      if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) return std::nullopt;
      return static_cast<std::int64_t>(u);
    default: return std::nullopt;
  }
}

std::optional<double> GgufValue::number_at(std::uint64_t index) const {
  const std::size_t size = gguf_scalar_size(elem_type);
  if (type != GgufValueType::array || size == 0 || index >= count) return std::nullopt;
  const std::uint8_t* p = raw.data() + index * size;
  auto load = [p](auto v) {
    std::memcpy(&v, p, sizeof(v));
    return static_cast<double>(v);
  };
  switch (elem_type) {
    case GgufValueType::uint8:
    case GgufValueType::boolean: return load(std::uint8_t{});
    case GgufValueType::int8: return load(std::int8_t{});
    case GgufValueType::uint16: return load(std::uint16_t{});
    case GgufValueType::int16: return load(std::int16_t{});
    case GgufValueType::uint32: return load(std::uint32_t{});
    case GgufValueType::int32: return load(std::int32_t{});
    case GgufValueType::float32: return load(float{});
    case GgufValueType::uint64: return load(std::uint64_t{});
    case GgufValueType::int64: return load(std::int64_t{});
    case GgufValueType::float64: return load(double{});
    default: return std::nullopt;
  }
}

std::string GgufValue::to_string(std::size_t max_items) const {
  std::ostringstream o;
  switch (type) {
    case GgufValueType::uint8:
    case GgufValueType::uint16:
    case GgufValueType::uint32:
    case GgufValueType::uint64: o << u; break;
    case GgufValueType::int8:
    case GgufValueType::int16:
    case GgufValueType::int32:
    case GgufValueType::int64: o << i; break;
    case GgufValueType::float32:
    case GgufValueType::float64: o << f; break;
    case GgufValueType::boolean: o << (u ? "true" : "false"); break;
    case GgufValueType::string: o << quoted_name(str); break;
    case GgufValueType::array: {
      o << "[";
      const std::uint64_t shown = std::min<std::uint64_t>(count, max_items);
      for (std::uint64_t k = 0; k < shown; ++k) {
        if (k) o << ", ";
        if (gguf_scalar_size(elem_type)) {
          o << *number_at(k);
        } else {
          o << items[static_cast<std::size_t>(k)].to_string(max_items);
        }
      }
      if (count > shown) o << ", ... (" << count << " " << workload::to_string(elem_type) << ")";
      o << "]";
      break;
    }
  }
  return o.str();
}

GgufValue GgufValue::of_uint(GgufValueType t, std::uint64_t v) {
  GgufValue r;
  r.type = t;
  r.u = v;
  return r;
}
GgufValue GgufValue::of_int(GgufValueType t, std::int64_t v) {
  GgufValue r;
  r.type = t;
  r.i = v;
  return r;
}
GgufValue GgufValue::of_float(GgufValueType t, double v) {
  GgufValue r;
  r.type = t;
  r.f = v;
  return r;
}
GgufValue GgufValue::of_bool(bool v) { return of_uint(GgufValueType::boolean, v ? 1 : 0); }
GgufValue GgufValue::of_string(std::string v) {
  GgufValue r;
  r.type = GgufValueType::string;
  r.str = std::move(v);
  return r;
}

GgufValue GgufValue::of_numbers(GgufValueType elem_type, const std::vector<double>& values) {
  GgufValue r;
  r.type = GgufValueType::array;
  r.elem_type = elem_type;
  r.count = values.size();
  const std::size_t size = gguf_scalar_size(elem_type);
  r.raw.resize(values.size() * size);
  for (std::size_t k = 0; k < values.size(); ++k) {
    std::uint8_t* p = r.raw.data() + k * size;
    const double x = values[k];
    auto store = [p](auto v) { std::memcpy(p, &v, sizeof(v)); };
    switch (elem_type) {
      case GgufValueType::uint8:
      case GgufValueType::boolean: store(static_cast<std::uint8_t>(x)); break;
      case GgufValueType::int8: store(static_cast<std::int8_t>(x)); break;
      case GgufValueType::uint16: store(static_cast<std::uint16_t>(x)); break;
      case GgufValueType::int16: store(static_cast<std::int16_t>(x)); break;
      case GgufValueType::uint32: store(static_cast<std::uint32_t>(x)); break;
      case GgufValueType::int32: store(static_cast<std::int32_t>(x)); break;
      case GgufValueType::float32: store(static_cast<float>(x)); break;
      case GgufValueType::uint64: store(static_cast<std::uint64_t>(x)); break;
      case GgufValueType::int64: store(static_cast<std::int64_t>(x)); break;
      case GgufValueType::float64: store(x); break;
      default: break;
    }
  }
  return r;
}

GgufValue GgufValue::of_strings(std::vector<std::string> values) {
  GgufValue r;
  r.type = GgufValueType::array;
  r.elem_type = GgufValueType::string;
  r.count = values.size();
  r.items.reserve(values.size());
  for (auto& s : values) r.items.push_back(of_string(std::move(s)));
  return r;
}

GgufValue GgufValue::of_arrays(GgufValueType elem_type, std::vector<GgufValue> arrays) {
  GgufValue r;
  r.type = GgufValueType::array;
  r.elem_type = elem_type;
  r.count = arrays.size();
  r.items = std::move(arrays);
  return r;
}

std::string GgufTensor::shape_string() const {
  std::string s = "[";
  for (std::uint32_t d = 0; d < n_dims; ++d) {
    if (d) s += ", ";
    s += std::to_string(ne[d]);
  }
  return s + "]";
}

const GgufValue* GgufModel::find(std::string_view key) const {
  for (const auto& kv : metadata) {
    if (kv.key == key) return &kv.value;
  }
  return nullptr;
}

const GgufTensor* GgufModel::find_tensor(std::string_view name) const {
  for (const auto& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

std::uint64_t GgufModel::tensor_bytes() const {
  std::uint64_t n = 0;
  for (const auto& t : tensors) n += t.n_bytes;
  return n;
}

Result<GgufModel> parse_gguf(std::span<const std::uint8_t> bytes, std::string_view source) {
  Cursor c(bytes);
  try {
    return parse(c);
  } catch (const ParseError& e) {
    return Status(ErrorCode::invalid_argument,
                  printable(source) + ": byte " + std::to_string(e.offset) + " (" + e.field + "): " + e.what);
  } catch (const std::bad_alloc&) {
    return Status(ErrorCode::out_of_memory, printable(source) + ": not enough memory to hold the file's metadata");
  }
}

GgufFile::GgufFile(GgufFile&& o) noexcept
    : path_(std::move(o.path_)), fd_(o.fd_), data_(o.data_), size_(o.size_), model_(std::move(o.model_)) {
  o.fd_ = -1;
  o.data_ = nullptr;
  o.size_ = 0;
}

GgufFile& GgufFile::operator=(GgufFile&& o) noexcept {
  if (this != &o) {
    reset();
    path_ = std::move(o.path_);
    fd_ = std::exchange(o.fd_, -1);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    model_ = std::move(o.model_);
  }
  return *this;
}

GgufFile::~GgufFile() { reset(); }

void GgufFile::reset() noexcept {
  if (data_) munmap(const_cast<std::uint8_t*>(data_), size_);
  if (fd_ >= 0) close(fd_);
  data_ = nullptr;
  fd_ = -1;
  size_ = 0;
}

Result<GgufFile> GgufFile::open(const std::string& path) {
  GgufFile f;
  f.path_ = path;
  f.fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd_ < 0) {
    const int err = errno;
    return Status(err == ENOENT ? ErrorCode::not_found : ErrorCode::io_error,
                  printable(path) + ": cannot open: " + std::strerror(err));
  }
  struct stat st {};
  if (fstat(f.fd_, &st) != 0) {
    return Status(ErrorCode::io_error, printable(path) + ": cannot stat: " + std::strerror(errno));
  }
  if (!S_ISREG(st.st_mode)) {
    return Status(ErrorCode::invalid_argument, printable(path) + ": not a regular file (expected a .gguf model file)");
  }
  if (st.st_size == 0) {
    return Status(ErrorCode::invalid_argument, printable(path) + ": the file is empty, not a GGUF model");
  }
  f.size_ = static_cast<std::size_t>(st.st_size);
  void* p = mmap(nullptr, f.size_, PROT_READ, MAP_SHARED, f.fd_, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    f.size_ = 0;
    return Status(ErrorCode::io_error,
                  printable(path) + ": cannot map " + std::to_string(st.st_size) + " bytes: " + std::strerror(err));
  }
  f.data_ = static_cast<const std::uint8_t*>(p);
  auto model = parse_gguf({f.data_, f.size_}, path);
  if (!model) return model.status();
  f.model_ = std::move(model).value();
  return f;
}

}  // namespace residency::workload
