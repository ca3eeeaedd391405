// SPDX-License-Identifier: MIT
// libFuzzer target for the GGUF reader: any input either parses into a model whose every tensor
// lies inside the input, or gives one error line naming a byte offset; never a crash, an
// over-read (ASan) or undefined behaviour (UBSan). Inputs that parse and hold small decodable
// models also run the decode pass over their (fuzzed) weights.
//
// Seed corpus: tests/fuzz/corpus/gguf_reader (files our writer makes; regenerate with
// RESIDENCY_UPDATE_FUZZ_SEEDS=1 workload_fuzz_seeds_test).
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "workload/decode_pass.hpp"
#include "workload/gguf.hpp"

namespace {
// Decoding is the slow part; big fuzzed models would only slow the fuzzer down.
constexpr std::uint64_t kMaxDecodeBytes = 1 << 20;
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace residency::workload;
  auto m = parse_gguf(std::span<const std::uint8_t>(data, size), "fuzz");
  if (!m) {
    const std::string& msg = m.message();
    if (msg.find('\n') != std::string::npos || msg.rfind("fuzz: byte ", 0) != 0) __builtin_trap();
    return 0;
  }
  volatile std::uint8_t sink = 0;
  for (const auto& t : m->tensors) {
    if (t.file_offset > size || t.n_bytes > size - t.file_offset) __builtin_trap();
    if (t.n_bytes) {
      sink = static_cast<std::uint8_t>(sink ^ data[t.file_offset] ^ data[t.file_offset + t.n_bytes - 1]);
    }
    (void)t.shape_string();
  }
  for (const auto& kv : m->metadata) (void)kv.value.to_string(8);
  if (m->tensor_bytes() <= kMaxDecodeBytes && DecodePass::check(*m).is_ok()) {
    auto pass = DecodePass::create(*m, data, {1, std::nullopt});
    if (pass) {
      (void)(*pass)->run();
      (void)(*pass)->plain_sum();
    }
  }
  return 0;
}
