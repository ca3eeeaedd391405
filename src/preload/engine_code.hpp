// SPDX-License-Identifier: MIT
// The engine's own code, held with the model
// (docs/design.md, "The model's memory: llama.cpp's buffers": residency holds the memory a decode
// reads). A decode executes libllama's and ggml's code and reads their constant tables; after a
// pageout from outside (process_madvise, or reclaim under pressure) every decode faults those pages
// back in from the library files (docs/measurements.md has how much). So while a model is loaded
// the read-only segments of the engine's libraries are registered as weights: they never change,
// and releasing them is only munlock.
//
// The pieces are registered at the end of the model's load and unregistered when the last weights
// buffer is freed: a library is not unloaded while a model it decodes is loaded (an unload
// unmaps through the dynamic loader's own munmap, which no hook sees).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "buffer_plan.hpp"
#include "piece_table.hpp"

namespace residency::preload {

// One loaded program segment, as the dynamic loader describes it.
struct LoadedSegment {
  std::string object;  // the object's path (dlpi_name; empty for the main program)
  std::uintptr_t begin = 0;
  std::uintptr_t end = 0;  // begin + p_memsz
  bool writable = false;   // PF_W
};

// The engine's objects: libllama* (llama-server's libllama-common and libllama-server-impl match
// too; what of them a request runs was not measured), libggml* (base, CPU variants, GPU backends),
// libgomp (ggml's OpenMP thread pool), the C and C++ runtimes a decode calls and the preload
// itself, as the dynamic loader lists them (dl_iterate_phdr). The runtimes' pages are shared with
// other processes; locking them in one only keeps them in memory. Writable segments are never
// registered (locking a private writable mapping would copy its pages), and a segment over
// kMaxSegment is left out: that is a GPU backend's device code (libggml-cuda's fatbin, hundreds of
// MiB), which the CPU never reads at decode.
// Whether an object of this path belongs to the engine: its file name starts with libllama,
// libggml, libgomp or libresidency_preload, or is libc, libm or libstdc++ (libc.so.6, libc-2.36.so).
bool is_engine_object(std::string_view path) noexcept;

struct CodePlan {
  std::vector<Extent> ranges;        // whole pages, sorted, merged
  std::vector<std::string> objects;  // file names of the objects they belong to, in load order
  std::uint64_t bytes = 0;
  std::uint64_t left_out = 0;  // bytes of read-only engine segments over max_segment
};

// Pure: what to register of these segments.
CodePlan plan_engine_code(const std::vector<LoadedSegment>& segments, std::size_t page_size, std::uint64_t max_segment);

// Every PT_LOAD segment of every loaded object (dl_iterate_phdr).
std::vector<LoadedSegment> loaded_segments();

class EngineCode {
 public:
  static constexpr std::uint64_t kMaxSegment = 64ULL << 20;
  // `log` must outlive it.
  EngineCode(Manager& manager, const SessionLog& log) : pieces_(&manager, log, "engine code"), log_(&log) {}

  // With the preload's lock held: registers the engine's read-only segments, once (one info line).
  void register_once() noexcept;
  // With the preload's lock held: unregisters them (the model is freed).
  void unregister() noexcept;
  bool registered() const noexcept { return registered_; }

  PieceTable& pieces() noexcept { return pieces_; }
  const PieceTable& pieces() const noexcept { return pieces_; }

 private:
  PieceTable pieces_;
  const SessionLog* log_;
  bool registered_ = false;
};

}  // namespace residency::preload
