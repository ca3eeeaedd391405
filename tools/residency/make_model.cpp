// SPDX-License-Identifier: MIT
// residency make-model: writes a synthetic llama-shaped GGUF model.
//
// The idle benchmark needs a real model file and CI has no weights to download, so this writes
// one: a llama architecture (token embedding, per-block attention with grouped KV heads and a
// gated feed-forward, norms, output) whose shapes follow one configuration chosen to fill the
// size asked for, with deterministic pseudo-random weights of one type (F32, F16, BF16, Q8_0 or Q4_0).
// llama.cpp's tools, @huggingface/gguf and our reader all parse it.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>

#include "command.hpp"
#include "residency/config.hpp"
#include "residency/text.hpp"
#include "workload/cleanup.hpp"
#include "workload/gguf_writer.hpp"

namespace residency::tool {
namespace {

struct MakeModelArgs {
  std::string out;
  std::string size = "1GiB";
  std::string type = "f16";
  std::uint64_t seed = workload::kSyntheticSeed;
  bool force = false;
  unsigned threads = 0;
};

constexpr unsigned kMaxThreads = 1024;

int run_make_model(const MakeModelArgs& a) {
  auto size = parse_size(a.size);
  if (!size) throw BadInput("--size: " + size.message());
  auto type = workload::parse_model_type(a.type);
  if (!type) throw BadInput("--type: " + type.message());
  std::filesystem::path out(a.out);
  const std::string shown = printable(a.out);
  if (a.out.empty() || out.filename().empty() || out.filename() == "." || out.filename() == "..") {
    throw BadInput("OUT '" + shown + "': not a file name");
  }
  const std::string dir = out.has_parent_path() ? out.parent_path().string() : ".";
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec))
    throw BadInput("OUT '" + shown + "': no such directory '" + printable(dir) +
                   "'; create it first, or give a path in an existing directory");
  if (std::filesystem::exists(std::filesystem::symlink_status(out, ec)) && !a.force) {
    throw BadInput("OUT '" + shown + "': already exists; choose another name or pass --force to overwrite it");
  }
  // --force replaces a regular file only (not a directory, nor /dev/null): refused before writing.
  if (Status st = workload::check_replaceable(a.out); !st) throw BadInput(st.message());
  // Bounded planning: any size is answered in well under a second (kMaxSyntheticLayers).
  auto shape = workload::plan_llama_shape(*size, *type);
  if (!shape) throw BadInput("--size: " + shape.message());
  auto layout = workload::llama_builder(*shape, a.seed).layout();
  if (!layout) throw std::runtime_error(layout.message());
  if (Status st = workload::check_free_space(dir, layout->file_size); !st) throw BadInput(st.message());
  // Read-only, no permission: found before minutes of writing.
  if (Status st = workload::check_writable(dir, 0, "OUT " + shown); !st) throw BadInput(st.message());

  // The model is written under a temporary name and renamed when complete; a signal removes it.
  workload::CleanupRegistry::install_signal_handlers();
  const auto t0 = std::chrono::steady_clock::now();
  Status st = workload::write_gguf_file(a.out, *layout, workload::synthetic_fill(*layout, a.seed), a.threads, a.force);
  if (!st) {
    if (st.code() == ErrorCode::invalid_argument || st.code() == ErrorCode::not_found) throw BadInput(st.message());
    throw std::runtime_error(st.message());
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("wrote %s: %s (%llu bytes), %s, %zu tensors, in %.1f s\n", printable(a.out, 400).c_str(),
              format_size(layout->file_size).c_str(), static_cast<unsigned long long>(layout->file_size),
              shape->to_string().c_str(), layout->tensors.size(), secs);
  return kExitOk;
}

const Command make_model_command{
    "make-model", "write a synthetic llama-shaped GGUF model (for `residency idle`)", [](CLI::App& app) {
      auto a = std::make_shared<MakeModelArgs>();
      app.add_option("OUT", a->out,
                     "the .gguf file to write (written as .OUT.partial-* beside it, renamed when complete)")
          ->required();
      app.add_option("--size", a->size, "file size to fill, at most (e.g. 512MiB, 1GiB, 8GB)")->capture_default_str();
      app.add_option("--type", a->type, "weight type: f32, f16, bf16, q8_0, q4_0")->capture_default_str();
      add_whole_number(app, "--seed", a->seed, 0, UINT64_MAX,
                       "seed of the pseudo-random weights (same seed, same bytes)");
      add_whole_number(app, "--threads", a->threads, 0, kMaxThreads, "writer threads (0 = one per core, at most 1024)",
                       "0 (one per core) to 1024");
      app.add_flag("--force", a->force, "overwrite OUT if it is a regular file (anything else there is refused)");
      return [a] { return run_make_model(*a); };
    }};

}  // namespace
}  // namespace residency::tool
