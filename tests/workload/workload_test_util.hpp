// SPDX-License-Identifier: MIT
// Helpers shared by the workload tests: a temporary directory per test and small GGUF files
// built in memory with every kind of metadata value.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "workload/gguf_writer.hpp"

namespace residency::workload::testing {

// A fresh directory under $TMPDIR (or /tmp), removed with everything in it at the end.
class ScratchDir {
 public:
  ScratchDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/residency-test-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (mkdtemp(buf.data()) == nullptr) ADD_FAILURE() << "mkdtemp failed for " << tmpl;
    path_ = buf.data();
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline void write_bytes(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

inline std::vector<std::uint8_t> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// A builder with one metadata value of every GGUF type (arrays of each element type, nested
// arrays, an empty array) and a few small tensors of the decode pass's types.
inline GgufBuilder every_value_builder() {
  using VT = GgufValueType;
  GgufBuilder b;
  b.set("general.architecture", GgufValue::of_string("llama"));
  b.set("test.u8", GgufValue::of_uint(VT::uint8, 200));
  b.set("test.i8", GgufValue::of_int(VT::int8, -100));
  b.set("test.u16", GgufValue::of_uint(VT::uint16, 60000));
  b.set("test.i16", GgufValue::of_int(VT::int16, -30000));
  b.set("test.u32", GgufValue::of_uint(VT::uint32, 4000000000u));
  b.set("test.i32", GgufValue::of_int(VT::int32, -2000000000));
  b.set("test.f32", GgufValue::of_float(VT::float32, 0.5));
  b.set("test.bool", GgufValue::of_bool(true));
  b.set("test.string", GgufValue::of_string("h\xc3\xa9llo"));
  b.set("test.u64", GgufValue::of_uint(VT::uint64, 1ull << 60));
  b.set("test.i64", GgufValue::of_int(VT::int64, -(1ll << 60)));
  b.set("test.f64", GgufValue::of_float(VT::float64, 3.25));
  for (VT t : {VT::uint8, VT::int8, VT::uint16, VT::int16, VT::uint32, VT::int32, VT::float32, VT::boolean, VT::uint64,
               VT::int64, VT::float64}) {
    b.set("test.array." + std::string(to_string(t)), GgufValue::of_numbers(t, {0, 1, 1, 0}));
  }
  b.set("test.array.string", GgufValue::of_strings({"a", "", "ccc"}));
  b.set("test.array.empty", GgufValue::of_numbers(VT::int32, {}));
  b.set("test.array.nested",
        GgufValue::of_arrays(VT::array, {GgufValue::of_numbers(VT::uint16, {1, 2}), GgufValue::of_strings({"x"})}));
  b.set("general.alignment", GgufValue::of_uint(VT::uint32, 64));
  b.add_tensor({"w.f32", GgmlType::f32, {64, 3}});
  b.add_tensor({"w.f16", GgmlType::f16, {64, 5}});
  b.add_tensor({"norm", GgmlType::f32, {64}});
  b.add_tensor({"w.bf16", GgmlType::bf16, {96, 2}});
  b.add_tensor({"w.q8_0", GgmlType::q8_0, {96, 4}});
  b.add_tensor({"w.3d", GgmlType::f16, {32, 2, 3}});
  return b;
}

// The whole file of a builder, tensor data from the synthetic fill.
inline std::vector<std::uint8_t> file_bytes(const GgufBuilder& b, std::uint64_t seed = 1) {
  auto layout = b.layout();
  EXPECT_TRUE(layout.is_ok()) << layout.message();
  std::vector<std::uint8_t> bytes(layout->header);
  bytes.resize(layout->file_size, 0);
  auto fill = synthetic_fill(*layout, seed);
  for (std::size_t t = 0; t < layout->tensors.size(); ++t) {
    const std::uint64_t n = layout->n_bytes[t];
    if (n == 0) continue;
    fill(t, 0, layout->rows[t], {bytes.data() + layout->data_offset + layout->offsets[t], static_cast<std::size_t>(n)});
  }
  return bytes;
}

}  // namespace residency::workload::testing
