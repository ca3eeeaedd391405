// SPDX-License-Identifier: MIT
// GGUF writer, and the synthetic llama-shaped model that `residency make-model` and the idle
// benchmark run on.
//
// Why synthetic: the benchmark has to run anywhere (CI included) without downloading weights, and
// what it measures, re-reading or re-wiring a model after a pause, depends on the model's bytes
// and layout, not on what the numbers mean. So the writer produces a file a real loader would
// accept: a llama architecture whose tensor shapes all follow one configuration (embedding
// width, heads, grouped KV heads, feed-forward width, layers, vocabulary) chosen to fill the
// requested size, with the metadata llama.cpp reads, filled with deterministic pseudo-random
// values (the same seed gives the same bytes on every machine and with any thread count).
//
// GgufBuilder is the general part (any metadata, any tensors); it is also how the tests build
// malformed files, by editing the bytes it lays out.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "residency/status.hpp"
#include "workload/gguf.hpp"

namespace residency::workload {

struct GgufTensorSpec {
  std::string name;
  GgmlType type = GgmlType::f32;
  std::vector<std::uint64_t> ne;  // ne[0] is the row length; 1 to 4 dims
};

// The bytes before the data section and where every tensor's data goes.
struct GgufLayout {
  std::vector<std::uint8_t> header;  // magic .. padding; header.size() == data_offset
  std::uint64_t alignment = kGgufDefaultAlignment;
  std::uint64_t data_offset = 0;
  std::uint64_t file_size = 0;
  std::vector<GgufTensorSpec> tensors;
  std::vector<std::uint64_t> offsets;  // relative to data_offset, aligned
  std::vector<std::uint64_t> n_bytes;
  std::vector<std::uint64_t> row_bytes;  // bytes of one row (ne[0] elements)
  std::vector<std::uint64_t> rows;       // ne[1] * ne[2] * ne[3]
};

class GgufBuilder {
 public:
  // Sets a metadata value; a key set twice keeps its first position and its last value.
  void set(const std::string& key, GgufValue value);
  void add_tensor(GgufTensorSpec tensor);
  // Lays the file out (GGUF v3). `general.alignment`, when set, must be a power of two.
  // Errors: bad alignment, a tensor with 0 or more than 4 dims, or a row length that is not a
  // multiple of its type's block.
  Result<GgufLayout> layout() const;

 private:
  std::vector<GgufKeyValue> metadata_;
  std::vector<GgufTensorSpec> tensors_;
};

// Appends one metadata value in GGUF encoding (used by the builder and by tests).
void encode_gguf_value(const GgufValue& value, std::vector<std::uint8_t>& out);

// Fills `out` with rows [first_row, first_row + rows) of tensor `tensor` (row_bytes each).
using TensorFill =
    std::function<void(std::size_t tensor, std::uint64_t first_row, std::uint64_t rows, std::span<std::uint8_t> out)>;

// Writes the file: header, then every tensor (filled in parallel by `threads` threads, 0 = one
// per core), zero padding between tensors, then fdatasync so that the page cache holds clean
// pages that memory pressure can drop. With `overwrite` false an existing file is an error; with
// it true, only a regular file is replaced (check_replaceable), before anything is written.
// The file is written as `.<name>.partial-<owner tag>-N` beside `path` and renamed to `path` only
// when complete: an interrupted write never leaves a complete-looking file. On any failure, and
// on the signals of CleanupRegistry (when its handlers are installed), the partial file is
// removed; one a killed writer left is removed by the next write to the same path.
Status write_gguf_file(const std::string& path, const GgufLayout& layout, const TensorFill& fill, unsigned threads = 0,
                       bool overwrite = false);

// What `overwrite` may replace: nothing (ok), or a regular file. Anything else that exists under
// `path` (a directory, a device such as /dev/null, a FIFO, a socket, a symbolic link, which the
// rename would replace rather than the file it names) is invalid_argument naming the path, what it
// is and what is accepted.
Status check_replaceable(const std::string& path);

// Whether the filesystem holding `dir` has `bytes` free for an unprivileged writer; the error
// names the directory, what is needed and what is free.
Status check_free_space(const std::string& dir, std::uint64_t bytes);

// A llama configuration: every tensor shape follows from these numbers.
struct LlamaShape {
  GgmlType type = GgmlType::f16;  // of every 2-D weight; norms are F32 as in llama.cpp's files
  std::uint64_t n_vocab = 0;
  std::uint64_t n_embd = 0;
  std::uint64_t n_layer = 0;
  std::uint64_t n_head = 0;
  std::uint64_t n_head_kv = 0;  // grouped-query attention: n_head / 4 where it divides
  std::uint64_t n_ff = 0;
  std::uint64_t n_ctx = 4096;
  std::uint64_t head_dim() const { return n_embd / n_head; }
  std::uint64_t n_embd_kv() const { return head_dim() * n_head_kv; }
  std::string to_string() const;  // "n_embd 1600, n_layer 14, ..."
};

// The vocabulary never exceeds llama 2's; smaller models get a smaller one so that the embedding
// and output matrices stay about a quarter of the file, as in real small models.
inline constexpr std::uint64_t kMaxSyntheticVocab = 32000;
// And never has fewer tokens than the specials, the 256 byte tokens, printable ASCII and some
// words (see synthetic_vocab), so that any text tokenizes.
inline constexpr std::uint64_t kMinSyntheticVocab = 384;
// At most this many blocks (Llama 3.1 405B has 126): beyond that the feed-forward layers widen
// instead, so that planning any size, up to 2^63 bytes, takes a few thousand tensors and well
// under a second (2000 TiB once planned millions of blocks: 28 s and 5.7 GB before refusing).
inline constexpr std::uint64_t kMaxSyntheticLayers = 256;
// The seed `make-model` uses unless told otherwise; the bytes are a function of (shape, seed).
inline constexpr std::uint64_t kSyntheticSeed = 0x5265736964656e63ull;  // "Residenc"

// Chooses the widest llama shape whose file fits in `target_bytes` with at least n_embd / 128
// layers (the depth-to-width ratio of the llama family), then widens the feed-forward layers to
// fill the remainder. The file is within a few percent below the target. Error (with the
// smallest size that works) when the target is too small for even one layer.
Result<LlamaShape> plan_llama_shape(std::uint64_t target_bytes, GgmlType type);

// The vocabulary, in llama.cpp's SPM ("llama") form as llama 2's: token 0 "<unk>", 1 "<s>" (BOS),
// 2 "</s>" (EOS), then the 256 byte tokens "<0x00>".."<0xFF>" that any text not otherwise covered
// falls back to (llama.cpp finds its newline token, "<0x0A>", among them), then normal tokens:
// U+2581 (the tokenizer's space), printable ASCII, U+2581 before each letter, then lower-case
// words of growing length with and without U+2581 until n_vocab. So that text tokenizes and
// detokenizes in llama.cpp (what the model generates is still noise). A shape with fewer than
// 259 tokens (only tests make them) gets the first n_vocab, and text does not tokenize.
enum class SpmTokenType : int { normal = 1, unknown = 2, control = 3, byte = 6 };  // llama.cpp's token types
inline constexpr const char* kSpmSpace = "\xe2\x96\x81";  // U+2581, what SPM writes for a space
struct SyntheticVocab {
  std::vector<std::string> tokens;
  std::vector<double> scores;  // float32 in the file
  std::vector<double> types;   // SpmTokenType, int32 in the file
};
SyntheticVocab synthetic_vocab(std::uint64_t n_vocab);

// The metadata and tensor list of a model of this shape.
GgufBuilder llama_builder(const LlamaShape& shape, std::uint64_t seed);

// The deterministic content of the synthetic model (exposed for tests and the fuzz corpus).
TensorFill synthetic_fill(const GgufLayout& layout, std::uint64_t seed);

// plan + build + write. `overwrite` as in write_gguf_file.
Status write_synthetic_model(const std::string& path, const LlamaShape& shape, std::uint64_t seed = kSyntheticSeed,
                             unsigned threads = 0, bool overwrite = false);

}  // namespace residency::workload
