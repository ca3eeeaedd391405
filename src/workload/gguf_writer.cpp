// SPDX-License-Identifier: MIT
// GGUF writer and the synthetic llama model (see gguf_writer.hpp).
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <thread>

#include "workload/gguf_writer.hpp"

#include "residency/config.hpp"
#include "residency/text.hpp"
#include "workload/cleanup.hpp"
#include "workload/half.hpp"

namespace residency::workload {
namespace {

// Tensor data is written in pieces of about this size, one piece per task, so that several
// threads generate values at once and no piece needs much memory.
constexpr std::uint64_t kWriteChunkBytes = 4ull << 20;

void put_u32(std::vector<std::uint8_t>& out, std::uint32_t v) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(&v);
  out.insert(out.end(), p, p + 4);
}
void put_u64(std::vector<std::uint8_t>& out, std::uint64_t v) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(&v);
  out.insert(out.end(), p, p + 8);
}
void put_string(std::vector<std::uint8_t>& out, const std::string& s) {
  put_u64(out, s.size());
  out.insert(out.end(), s.begin(), s.end());
}

// splitmix64's finaliser: a bijective 64-bit mix, enough for test data.
std::uint64_t mix(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

std::uint64_t hash_name(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Uniform values in [-scale, scale) for element indices [first, first + n): element i takes 16
// bits of mix(salt + i / 4), so any range can be produced independently of the others.
void fill_uniform(float* out, std::uint64_t first, std::size_t n, std::uint64_t salt, float scale) {
  const float unit = scale / 32768.0f;
  std::uint64_t h = mix(salt + (first >> 2));
  for (std::size_t k = 0; k < n; ++k) {
    const std::uint64_t idx = first + k;
    const unsigned lane = static_cast<unsigned>(idx & 3);
    if (lane == 0 && k != 0) h = mix(salt + (idx >> 2));
    const auto bits = static_cast<std::int32_t>((h >> (16 * lane)) & 0xffff);
    out[k] = static_cast<float>(bits - 32768) * unit;
  }
}

void write_q8_0(const float* x, std::size_t n, std::uint8_t* out) {
  for (std::size_t b = 0; b < n / 32; ++b) {
    const float* v = x + b * 32;
    float amax = 0;
    for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(v[k]));
    const float d = amax / 127.0f;
    const float id = d > 0 ? 1.0f / d : 0.0f;
    const std::uint16_t dh = f32_to_f16(d);
    std::memcpy(out, &dh, 2);
    for (int k = 0; k < 32; ++k) {
      const float q = std::clamp(std::nearbyint(v[k] * id), -127.0f, 127.0f);
      out[2 + k] = static_cast<std::uint8_t>(static_cast<std::int8_t>(q));
    }
    out += 34;
  }
}

// Q4_0 blocks as ggml's reference quantiser makes them: the scale is d = m / -8, m being the
// block's element of largest magnitude with its sign, so that m is kept (as q = 0, but for the
// fp16 rounding of d); q = min(15, trunc(x / d + 8.5)) stands for d * (q - 8). 18 bytes a block: the fp16 scale, then
// 16 bytes of which byte j holds element j in its low nibble and element j + 16 in its high one.
void write_q4_0(const float* x, std::size_t n, std::uint8_t* out) {
  for (std::size_t b = 0; b < n / 32; ++b) {
    const float* v = x + b * 32;
    float amax = 0, m = 0;
    for (int k = 0; k < 32; ++k) {
      if (std::fabs(v[k]) > amax) {
        amax = std::fabs(v[k]);
        m = v[k];
      }
    }
    const float d = m / -8.0f;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    const std::uint16_t dh = f32_to_f16(d);
    std::memcpy(out, &dh, 2);
    // x / d lies in [-8, 8], so x / d + 8.5 in [0.5, 16.5]: truncation gives 0 to 16.
    auto quant = [id](float e) { return static_cast<unsigned>(std::min(15, static_cast<int>(e * id + 8.5f))); };
    for (int j = 0; j < 16; ++j) out[2 + j] = static_cast<std::uint8_t>(quant(v[j]) | (quant(v[j + 16]) << 4));
    out += 18;
  }
}

Status pwrite_all(int fd, const std::uint8_t* p, std::uint64_t n, std::uint64_t off, const std::string& path) {
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, static_cast<std::size_t>(std::min<std::uint64_t>(n, 1u << 30)),
                               static_cast<off_t>(off));
    if (w < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      return Status(err == ENOSPC ? ErrorCode::out_of_memory : ErrorCode::io_error,
                    printable(path) + ": write at byte " + std::to_string(off) + " failed: " + std::strerror(err) +
                        (err == ENOSPC ? " (the disk is full; free space or choose another directory)" : ""));
    }
    p += w;
    n -= static_cast<std::uint64_t>(w);
    off += static_cast<std::uint64_t>(w);
  }
  return {};
}

std::uint64_t tensor_bytes(GgmlType type, std::uint64_t elements) {
  const GgmlTypeInfo* info = ggml_type_info(static_cast<std::uint32_t>(type));
  return elements / info->block_elems * info->block_bytes;
}

}  // namespace

void encode_gguf_value(const GgufValue& v, std::vector<std::uint8_t>& out) {
  auto put = [&out](auto x) {
    const auto* p = reinterpret_cast<const std::uint8_t*>(&x);
    out.insert(out.end(), p, p + sizeof(x));
  };
  switch (v.type) {
    case GgufValueType::uint8: put(static_cast<std::uint8_t>(v.u)); break;
    case GgufValueType::int8: put(static_cast<std::int8_t>(v.i)); break;
    case GgufValueType::uint16: put(static_cast<std::uint16_t>(v.u)); break;
    case GgufValueType::int16: put(static_cast<std::int16_t>(v.i)); break;
    case GgufValueType::uint32: put(static_cast<std::uint32_t>(v.u)); break;
    case GgufValueType::int32: put(static_cast<std::int32_t>(v.i)); break;
    case GgufValueType::uint64: put(v.u); break;
    case GgufValueType::int64: put(v.i); break;
    case GgufValueType::float32: put(static_cast<float>(v.f)); break;
    case GgufValueType::float64: put(v.f); break;
    case GgufValueType::boolean: put(static_cast<std::uint8_t>(v.u ? 1 : 0)); break;
    case GgufValueType::string: put_string(out, v.str); break;
    case GgufValueType::array:
      put_u32(out, static_cast<std::uint32_t>(v.elem_type));
      put_u64(out, v.count);
      if (gguf_scalar_size(v.elem_type)) {
        out.insert(out.end(), v.raw.begin(), v.raw.end());
      } else {
        for (const auto& item : v.items) encode_gguf_value(item, out);
      }
      break;
  }
}

void GgufBuilder::set(const std::string& key, GgufValue value) {
  for (auto& kv : metadata_) {
    if (kv.key == key) {
      kv.value = std::move(value);
      return;
    }
  }
  metadata_.push_back({key, std::move(value), 0});
}

void GgufBuilder::add_tensor(GgufTensorSpec tensor) { tensors_.push_back(std::move(tensor)); }

Result<GgufLayout> GgufBuilder::layout() const {
  GgufLayout l;
  for (const auto& kv : metadata_) {
    if (kv.key != "general.alignment") continue;
    // A value that is not an integer is written as given (tests write such files on purpose)
    // and the default alignment is used for the layout.
    const auto a = kv.value.as_uint();
    if (!a) continue;
    if (*a == 0 || (*a & (*a - 1)) != 0) {
      return Status(ErrorCode::invalid_argument, "general.alignment must be a power of two");
    }
    l.alignment = *a;
  }
  auto& h = l.header;
  h.insert(h.end(), {'G', 'G', 'U', 'F'});
  put_u32(h, 3);
  put_u64(h, tensors_.size());
  put_u64(h, metadata_.size());
  for (const auto& kv : metadata_) {
    put_string(h, kv.key);
    put_u32(h, static_cast<std::uint32_t>(kv.value.type));
    encode_gguf_value(kv.value, h);
  }
  std::uint64_t offset = 0;
  for (const auto& t : tensors_) {
    if (t.ne.empty() || t.ne.size() > kGgufMaxDims) {
      return Status(ErrorCode::invalid_argument,
                    "tensor '" + t.name + "' has " + std::to_string(t.ne.size()) + " dims (1 to 4)");
    }
    const GgmlTypeInfo* info = ggml_type_info(static_cast<std::uint32_t>(t.type));
    if (t.ne[0] % info->block_elems != 0) {
      return Status(ErrorCode::invalid_argument, "tensor '" + t.name + "': row length " + std::to_string(t.ne[0]) +
                                                     " is not a multiple of " + std::string(info->name) +
                                                     "'s block of " + std::to_string(info->block_elems));
    }
    std::uint64_t elements = 1;
    for (auto d : t.ne) elements *= d;
    const std::uint64_t rows = t.ne[0] == 0 ? 0 : elements / t.ne[0];
    put_string(h, t.name);
    put_u32(h, static_cast<std::uint32_t>(t.ne.size()));
    for (auto d : t.ne) put_u64(h, d);
    put_u32(h, static_cast<std::uint32_t>(t.type));
    offset = (offset + l.alignment - 1) / l.alignment * l.alignment;
    put_u64(h, offset);
    l.tensors.push_back(t);
    l.offsets.push_back(offset);
    l.n_bytes.push_back(tensor_bytes(t.type, elements));
    l.rows.push_back(rows);
    l.row_bytes.push_back(tensor_bytes(t.type, t.ne[0]));
    offset += l.n_bytes.back();
  }
  h.resize((h.size() + l.alignment - 1) / l.alignment * l.alignment, 0);
  l.data_offset = h.size();
  l.file_size = l.data_offset + offset;
  return l;
}

Status write_gguf_file(const std::string& final_path, const GgufLayout& layout, const TensorFill& fill,
                       unsigned threads, bool overwrite) {
  // Written under a temporary name beside the target and renamed when complete, so that no
  // interrupted write (a signal, SIGKILL, a full disk) leaves a file under the name that looks
  // like a model. The temporary name carries its owner; what a killed writer left is removed here.
  const std::filesystem::path target(final_path);
  const std::string dir = target.has_parent_path() ? target.parent_path().string() : ".";
  const std::string partial_prefix = "." + target.filename().string() + ".partial-";
  remove_dead_leftovers(dir, partial_prefix);
  struct stat existing {};
  if (!overwrite && ::lstat(final_path.c_str(), &existing) == 0) {
    return Status(ErrorCode::invalid_argument,
                  printable(final_path) + ": already exists; choose another name or allow overwriting (--force)");
  }
  if (overwrite) {
    if (Status st = check_replaceable(final_path); !st) return st;
  }
  static std::atomic<unsigned> serial{0};
  const std::string path = dir + "/" + partial_prefix + owner_tag() + "-" + std::to_string(serial.fetch_add(1));
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    return Status(err == ENOENT ? ErrorCode::not_found : ErrorCode::io_error,
                  printable(final_path) + ": cannot create: " + std::strerror(err));
  }
  const int slot = CleanupRegistry::add(path);
  auto fail = [&](Status st) {
    ::close(fd);
    ::unlink(path.c_str());
    CleanupRegistry::forget(slot);
    return st;
  };
  // Reserve the space first, so that a full disk is reported before minutes of writing.
#if defined(__APPLE__)
  const int fa = EOPNOTSUPP;  // macOS has no posix_fallocate: sized by ftruncate below
#else
  const int fa = ::posix_fallocate(fd, 0, static_cast<off_t>(layout.file_size));
#endif
  if (fa == ENOSPC) {
    return fail(Status(ErrorCode::out_of_memory, printable(final_path) + ": not enough disk space for " +
                                                     std::to_string(layout.file_size) +
                                                     " bytes; free space or choose another directory"));
  }
  if (fa != 0 && ::ftruncate(fd, static_cast<off_t>(layout.file_size)) != 0) {
    return fail(Status(ErrorCode::io_error, printable(final_path) + ": cannot size the file: " + std::strerror(errno)));
  }
  if (Status st = pwrite_all(fd, layout.header.data(), layout.header.size(), 0, final_path); !st) return fail(st);

  struct Task {
    std::size_t tensor;
    std::uint64_t first_row, rows;
  };
  std::vector<Task> tasks;
  for (std::size_t t = 0; t < layout.tensors.size(); ++t) {
    if (layout.n_bytes[t] == 0) continue;
    const std::uint64_t per = std::max<std::uint64_t>(1, kWriteChunkBytes /
                                                             std::max<std::uint64_t>(1, layout.row_bytes[t]));
    for (std::uint64_t r = 0; r < layout.rows[t]; r += per) tasks.push_back({t, r, std::min(per, layout.rows[t] - r)});
  }
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  threads = static_cast<unsigned>(std::min<std::size_t>(threads, std::max<std::size_t>(1, tasks.size())));
  std::atomic<std::size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex err_mutex;
  Status first_error;
  auto worker = [&] {
    std::vector<std::uint8_t> buf;
    for (;;) {
      const std::size_t k = next.fetch_add(1);
      if (k >= tasks.size() || failed.load()) return;
      const Task& task = tasks[k];
      const std::uint64_t n = task.rows * layout.row_bytes[task.tensor];
      buf.resize(static_cast<std::size_t>(n));
      fill(task.tensor, task.first_row, task.rows, buf);
      const std::uint64_t off = layout.data_offset + layout.offsets[task.tensor] +
                                task.first_row * layout.row_bytes[task.tensor];
      if (Status st = pwrite_all(fd, buf.data(), n, off, final_path); !st) {
        std::lock_guard<std::mutex> g(err_mutex);
        if (!failed.exchange(true)) first_error = st;
        return;
      }
    }
  };
  std::vector<std::thread> pool;
  for (unsigned k = 1; k < threads; ++k) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
  if (failed.load()) return fail(first_error);
  if (::fdatasync(fd) != 0) {
    return fail(Status(ErrorCode::io_error, printable(final_path) + ": fdatasync failed: " + std::strerror(errno)));
  }
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(path.c_str());
    CleanupRegistry::forget(slot);
    return Status(ErrorCode::io_error, printable(final_path) + ": close failed: " + std::strerror(err));
  }
  const int rc = overwrite ? std::rename(path.c_str(), final_path.c_str())
                           : rename_no_replace(path.c_str(), final_path.c_str());
  const int err = errno;
  if (rc != 0) ::unlink(path.c_str());
  CleanupRegistry::forget(slot);
  if (rc != 0) {
    if (err == EEXIST) {
      return Status(ErrorCode::invalid_argument,
                    printable(final_path) + ": already exists; choose another name or allow overwriting (--force)");
    }
    return Status(ErrorCode::io_error,
                  printable(final_path) + ": cannot rename the written file into place: " + std::strerror(err));
  }
  return {};
}

Status check_replaceable(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT) return {};
    return Status(ErrorCode::io_error, printable(path) + ": cannot look at it: " + std::strerror(err));
  }
  if (S_ISREG(st.st_mode)) return {};
  const char* what = S_ISDIR(st.st_mode)    ? "a directory"
                     : S_ISCHR(st.st_mode)  ? "a character device"
                     : S_ISBLK(st.st_mode)  ? "a block device"
                     : S_ISFIFO(st.st_mode) ? "a FIFO"
                     : S_ISSOCK(st.st_mode) ? "a socket"
                     : S_ISLNK(st.st_mode)  ? "a symbolic link"
                                            : "not a regular file";
  return Status(ErrorCode::invalid_argument, printable(path) + " is " + what +
                                                 "; overwriting (--force) replaces only a regular file: remove it or "
                                                 "choose another name");
}

Status check_free_space(const std::string& dir, std::uint64_t bytes) {
  struct statvfs s {};
  if (statvfs(dir.c_str(), &s) != 0) {
    const int err = errno;
    return Status(err == ENOENT ? ErrorCode::not_found : ErrorCode::io_error, printable(dir) + ": " + std::strerror(err));
  }
  const std::uint64_t free_bytes = static_cast<std::uint64_t>(s.f_bavail) * s.f_frsize;
  if (free_bytes < bytes) {
    return Status(ErrorCode::limit_exceeded, printable(dir) + " has " + std::to_string(free_bytes >> 20) +
                                                 " MiB free; the model needs " +
                                                 std::to_string((bytes + (1u << 20) - 1) >> 20) +
                                                 " MiB (choose a smaller size or another directory)");
  }
  return {};
}

std::string LlamaShape::to_string() const {
  return "llama, " + std::string(ggml_type_name(type)) + ", n_vocab " + std::to_string(n_vocab) + ", n_embd " +
         std::to_string(n_embd) + ", n_layer " + std::to_string(n_layer) + ", n_head " + std::to_string(n_head) +
         ", n_head_kv " + std::to_string(n_head_kv) + ", n_ff " + std::to_string(n_ff);
}

SyntheticVocab synthetic_vocab(std::uint64_t n_vocab) {
  SyntheticVocab v;
  const auto n = static_cast<std::size_t>(n_vocab);
  v.tokens.reserve(n);
  v.scores.reserve(n);
  v.types.reserve(n);
  auto add = [&v, n](std::string text, SpmTokenType type) {
    if (v.tokens.size() >= n) return false;
    // Normal tokens score by position, so that the tokenizer merges the shorter ones first;
    // the others are never merged and score 0 as in llama 2's vocabulary.
    v.scores.push_back(type == SpmTokenType::normal ? -static_cast<double>(v.tokens.size()) : 0.0);
    v.types.push_back(static_cast<double>(type));
    v.tokens.push_back(std::move(text));
    return true;
  };
  add("<unk>", SpmTokenType::unknown);
  add("<s>", SpmTokenType::control);
  add("</s>", SpmTokenType::control);
  static constexpr char kHex[] = "0123456789ABCDEF";
  for (unsigned b = 0; b < 256; ++b) add(std::string("<0x") + kHex[b >> 4] + kHex[b & 15] + ">", SpmTokenType::byte);
  const std::string space = kSpmSpace;
  add(space, SpmTokenType::normal);
  for (char c = '!'; c <= '~'; ++c) add(std::string(1, c), SpmTokenType::normal);
  for (char c = 'A'; c <= 'Z'; ++c) add(space + c, SpmTokenType::normal);
  // Then lower-case words of growing length, each also as a word start: every one is a merge of
  // two tokens already listed (a shorter word and a letter), as the tokenizer needs.
  std::vector<std::string> words;
  for (char c = 'a'; c <= 'z'; ++c) words.emplace_back(1, c);
  for (const std::string& w : words) {
    if (!add(space + w, SpmTokenType::normal)) return v;
  }
  while (v.tokens.size() < n) {
    std::vector<std::string> longer;
    for (const std::string& w : words) {
      for (char c = 'a'; c <= 'z'; ++c) {
        longer.push_back(w + c);
        if (!add(longer.back(), SpmTokenType::normal) || !add(space + longer.back(), SpmTokenType::normal)) return v;
      }
    }
    words = std::move(longer);
  }
  return v;
}

GgufBuilder llama_builder(const LlamaShape& s, std::uint64_t seed) {
  GgufBuilder b;
  using VT = GgufValueType;
  auto u32 = [](std::uint64_t v) { return GgufValue::of_uint(VT::uint32, v); };
  std::uint32_t file_type = 1;  // llama.cpp's LLAMA_FTYPE_MOSTLY_F16
  if (s.type == GgmlType::f32) file_type = 0;
  if (s.type == GgmlType::q8_0) file_type = 7;
  if (s.type == GgmlType::q4_0) file_type = 2;
  if (s.type == GgmlType::bf16) file_type = 32;
  b.set("general.architecture", GgufValue::of_string("llama"));
  b.set("general.name", GgufValue::of_string("residency synthetic llama " + std::string(ggml_type_name(s.type))));
  b.set("general.file_type", u32(file_type));
  b.set("general.alignment", u32(kGgufDefaultAlignment));
  b.set("general.source.residency_seed", GgufValue::of_uint(VT::uint64, seed));
  b.set("llama.vocab_size", u32(s.n_vocab));
  b.set("llama.context_length", u32(s.n_ctx));
  b.set("llama.embedding_length", u32(s.n_embd));
  b.set("llama.block_count", u32(s.n_layer));
  b.set("llama.feed_forward_length", u32(s.n_ff));
  b.set("llama.rope.dimension_count", u32(s.head_dim()));
  b.set("llama.attention.head_count", u32(s.n_head));
  b.set("llama.attention.head_count_kv", u32(s.n_head_kv));
  b.set("llama.attention.layer_norm_rms_epsilon", GgufValue::of_float(VT::float32, 1e-5));
  b.set("llama.rope.freq_base", GgufValue::of_float(VT::float32, 10000.0));
  if (s.type == GgmlType::q8_0 || s.type == GgmlType::q4_0) b.set("general.quantization_version", u32(2));
  SyntheticVocab vocab = synthetic_vocab(s.n_vocab);
  b.set("tokenizer.ggml.model", GgufValue::of_string("llama"));
  b.set("tokenizer.ggml.tokens", GgufValue::of_strings(std::move(vocab.tokens)));
  b.set("tokenizer.ggml.scores", GgufValue::of_numbers(VT::float32, vocab.scores));
  b.set("tokenizer.ggml.token_type", GgufValue::of_numbers(VT::int32, vocab.types));
  b.set("tokenizer.ggml.unknown_token_id", u32(0));
  b.set("tokenizer.ggml.bos_token_id", u32(1));
  b.set("tokenizer.ggml.eos_token_id", u32(2));

  const std::uint64_t e = s.n_embd, kv = s.n_embd_kv();
  b.add_tensor({"token_embd.weight", s.type, {e, s.n_vocab}});
  for (std::uint64_t l = 0; l < s.n_layer; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    b.add_tensor({p + "attn_norm.weight", GgmlType::f32, {e}});
    b.add_tensor({p + "attn_q.weight", s.type, {e, e}});
    b.add_tensor({p + "attn_k.weight", s.type, {e, kv}});
    b.add_tensor({p + "attn_v.weight", s.type, {e, kv}});
    b.add_tensor({p + "attn_output.weight", s.type, {e, e}});
    b.add_tensor({p + "ffn_norm.weight", GgmlType::f32, {e}});
    b.add_tensor({p + "ffn_gate.weight", s.type, {e, s.n_ff}});
    b.add_tensor({p + "ffn_down.weight", s.type, {s.n_ff, e}});
    b.add_tensor({p + "ffn_up.weight", s.type, {e, s.n_ff}});
  }
  b.add_tensor({"output_norm.weight", GgmlType::f32, {e}});
  b.add_tensor({"output.weight", s.type, {e, s.n_vocab}});
  return b;
}

Result<LlamaShape> plan_llama_shape(std::uint64_t target, GgmlType type) {
  if (!decode_supported(type)) {
    return Status(ErrorCode::invalid_argument, "model type " + std::string(ggml_type_name(type)) +
                                                   " cannot be written; accepted: f32, f16, bf16, q8_0, q4_0");
  }
  auto tb = [type](std::uint64_t n) { return tensor_bytes(type, n); };
  // Metadata estimate: the vocabulary strings, scores and types (~24 bytes a token) plus the
  // tensor infos; checked exactly against the real layout below.
  auto header_estimate = [](std::uint64_t vocab, std::uint64_t layers) {
    return 24 * vocab + 80 * (9 * layers + 3) + 4096;
  };
  // Widths: multiples of 128 from 8192 down to 1024, then multiples of 64.
  std::vector<std::uint64_t> widths;
  for (std::uint64_t e = 8192; e >= 1024; e -= 128) widths.push_back(e);
  for (std::uint64_t e = 960; e >= 64; e -= 64) widths.push_back(e);
  for (std::uint64_t e : widths) {
    LlamaShape s;
    s.type = type;
    s.n_embd = e;
    const std::uint64_t head_dim = (e % 128 == 0 && e >= 2048) ? 128 : 64;
    s.n_head = e / head_dim;
    s.n_head_kv = (s.n_head % 4 == 0 && s.n_head >= 8) ? s.n_head / 4 : s.n_head;
    // Embedding + output about a quarter of the file at most, but never below the vocabulary
    // that tokenizes any text.
    s.n_vocab = std::clamp<std::uint64_t>(target / 8 / std::max<std::uint64_t>(1, tb(e)) / 64 * 64, kMinSyntheticVocab,
                                          kMaxSyntheticVocab);
    const std::uint64_t ff0 = (8 * e / 3 + 63) / 64 * 64;
    const std::uint64_t attn = 2 * tb(e * e) + 2 * tb(e * s.n_embd_kv()) + 2 * 4 * e;
    const std::uint64_t fixed = 2 * tb(s.n_vocab * e) + 4 * e + header_estimate(s.n_vocab, e / 32);
    if (target <= fixed) continue;
    const std::uint64_t layers = std::min(kMaxSyntheticLayers, (target - fixed) / (attn + 3 * tb(e * ff0)));
    if (layers < std::max<std::uint64_t>(1, e / 128)) continue;
    s.n_layer = layers;
    // Widen the feed-forward layers into what the whole layers left over.
    const std::uint64_t per_layer = (target - fixed) / layers;
    s.n_ff = std::max<std::uint64_t>(ff0, (per_layer - attn) / (3 * tb(e)) / 64 * 64);
    // Exact check: narrow the feed-forward width until the real file fits.
    for (;;) {
      auto layout = llama_builder(s, 0).layout();
      if (layout && layout->file_size <= target) return s;
      if (s.n_ff <= 64) break;
      s.n_ff -= 64;
    }
  }
  // The smallest shape: one layer at width 64, the smallest vocabulary.
  LlamaShape smallest{type, kMinSyntheticVocab, 64, 1, 1, 1, 192, 4096};
  const auto min_layout = llama_builder(smallest, 0).layout();
  return Status(ErrorCode::invalid_argument, std::to_string(target) + " bytes is too small for a llama-shaped " +
                                                 std::string(ggml_type_name(type)) + " model; the smallest is " +
                                                 std::to_string(min_layout ? min_layout->file_size : 0) + " bytes");
}

TensorFill synthetic_fill(const GgufLayout& layout, std::uint64_t seed) {
  std::vector<std::uint64_t> salts;
  for (const auto& t : layout.tensors) salts.push_back(mix(seed ^ hash_name(t.name)));
  return [&layout, salts](std::size_t tensor, std::uint64_t first_row, std::uint64_t rows, std::span<std::uint8_t> out) {
    const GgufTensorSpec& t = layout.tensors[tensor];
    const std::uint64_t n = t.ne[0];
    const std::uint64_t row_bytes = layout.row_bytes[tensor];
    const bool is_norm = t.ne.size() == 1;
    // Weights ~ U(-1/sqrt(n), 1/sqrt(n)) as a linear layer's initialisation; norms ~ 1 +/- 0.1.
    const float scale = is_norm ? 0.1f : 1.0f / std::sqrt(static_cast<float>(std::max<std::uint64_t>(1, n)));
    std::vector<float> v(static_cast<std::size_t>(n));
    for (std::uint64_t r = 0; r < rows; ++r) {
      std::uint8_t* dst = out.data() + r * row_bytes;
      fill_uniform(v.data(), (first_row + r) * n, v.size(), salts[tensor], scale);
      if (is_norm) {
        for (auto& x : v) x += 1.0f;
      }
      switch (t.type) {
        case GgmlType::f32: std::memcpy(dst, v.data(), v.size() * 4); break;
        case GgmlType::f16:
          for (std::size_t k = 0; k < v.size(); ++k) {
            const std::uint16_t h = f32_to_f16(v[k]);
            std::memcpy(dst + 2 * k, &h, 2);
          }
          break;
        case GgmlType::bf16:
          for (std::size_t k = 0; k < v.size(); ++k) {
            const std::uint16_t h = f32_to_bf16(v[k]);
            std::memcpy(dst + 2 * k, &h, 2);
          }
          break;
        case GgmlType::q8_0: write_q8_0(v.data(), v.size(), dst); break;
        case GgmlType::q4_0: write_q4_0(v.data(), v.size(), dst); break;
        default:  // other types: pseudo-random bytes (only tests write them)
          for (std::uint64_t k = 0; k < row_bytes; ++k) {
            dst[k] = static_cast<std::uint8_t>(mix(salts[tensor] + (first_row + r) * row_bytes + k));
          }
          break;
      }
    }
  };
}

Status write_synthetic_model(const std::string& path, const LlamaShape& shape, std::uint64_t seed, unsigned threads,
                             bool overwrite) {
  auto layout = llama_builder(shape, seed).layout();
  if (!layout) return layout.status();
  return write_gguf_file(path, *layout, synthetic_fill(*layout, seed), threads, overwrite);
}

}  // namespace residency::workload
