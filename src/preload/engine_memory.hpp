// SPDX-License-Identifier: MIT
// The engine's own working memory, held with the model
// (docs/design.md, "The model's memory: llama.cpp's buffers": residency holds the memory a decode
// reads). Besides llama.cpp's buffers and code, a decode reads and writes memory that is no ggml
// buffer: the graph's metadata, ggml's scheduler tables, the CPU backend's work buffer, the
// decoding threads' stacks. That is anonymous memory: under pressure with swap it moves out, and
// the next token reads it back page by page (docs/measurements.md has the cost).
//
// The decision that shapes it: which pages a decode touches cannot be read from the kernel
// without privilege or soft-dirty bits, so what is held is a snapshot of what is resident after a
// decode, taken on a schedule the session owns (SessionRules::snapshot_after) and dropped before
// anything could wire a piece that is gone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "buffer_plan.hpp"
#include "piece_table.hpp"

namespace residency::preload {

// One line of /proc/self/maps.
struct MapsEntry {
  std::uintptr_t begin = 0;
  std::uintptr_t end = 0;
  bool readable = false;
  bool writable = false;
  bool executable = false;
  bool is_private = false;
  std::uint64_t inode = 0;
  std::string path;  // "", "[heap]", "[stack]", "[anon:name]", a file's path, ...
};

// The whole of /proc/self/maps; empty when it cannot be read.
std::string read_own_maps();

// The lines of a /proc/PID/maps text; a line that does not parse is skipped.
std::vector<MapsEntry> parse_maps(std::string_view text);

// Private anonymous memory a program reads and writes: private, readable and writable, no file,
// and either unnamed, the heap, a stack or a named anonymous mapping ([anon:...]).
bool is_private_anonymous(const MapsEntry& m) noexcept;

// The engine's own data: a private mapping of an engine object (is_engine_object), readable, not
// executable: its .data and, once relocated, its read-only GOT and relocated tables (RELRO), whose
// written pages are private copies that only swap can take. (Its read-only segments are held as
// code already; engine_code.hpp.)
bool is_engine_data(const MapsEntry& m) noexcept;

struct MemoryPlan {
  std::vector<Extent> ranges;  // whole pages, sorted, disjoint: the candidates to look at
  std::uint64_t bytes = 0;
  std::uint64_t left_out = 0;  // bytes of candidate mappings over max_mapping
};

// What is the engine's, besides its libraries' data: the memory it made and ran on, as the
// session saw it. Everything else (the program's own mappings: V8's, Go's or jemalloc's heaps, a
// program's buffers and reservations, malloc's large chunks and arenas) is never a candidate.
struct EngineOwned {
  std::vector<Extent> made;                  // anonymous mappings made inside the engine's calls, sorted
  std::vector<std::uintptr_t> stack_points;  // addresses on the stacks the engine's calls ran on
  bool heap = true;                          // the C library's main heap ([heap]), shared with the program
};

// Pure: the candidates of `maps` minus `held` (sorted, disjoint: what is registered already, and
// what the program locked itself), in whole pages: the engine libraries' data, the private
// anonymous mappings that hold a stack point, the main heap, and the parts of private anonymous
// mappings inside `owned.made`. A candidate mapping over max_mapping is left out (an arena or a
// reservation, not working memory), but for what is held of it.
MemoryPlan plan_engine_memory(const std::vector<MapsEntry>& maps, const std::vector<Extent>& held,
                              const EngineOwned& owned, std::size_t page_size, std::uint64_t max_mapping);

// Pure: the runs of resident pages of `range` (bit 0 of resident[i]: page i is in memory, as
// mincore says), two runs at most max_gap pages apart merged (mlock faults the gap in).
std::vector<Extent> resident_runs(const Extent& range, const std::vector<unsigned char>& resident,
                                  std::size_t page_size, std::size_t max_gap);

// Pure: what of `runs` (sorted) to hold under both caps, at most max_runs runs and max_bytes in
// all, smallest first (stacks and the allocator's small chunks before bulk data: a runtime's
// arenas or a large buffer of the program), returned sorted by address.
std::vector<Extent> runs_to_hold(std::vector<Extent> runs, std::size_t max_runs, std::uint64_t max_bytes);

// What a snapshot holds (docs/design.md, "The engine session": the engine's memory, never the
// program's): the resident pages of the engine's candidates (plan_engine_memory), not registered
// already. The main heap is the C library's, where llama.cpp's small allocations sit beside the
// program's; glibc never fails on a locked page there (its trims and madvise results are ignored),
// and the preload's madvise and mprotect hooks unlock what the program takes back before its call.
// At most kMaxRuns runs and kMaxBytes are held, the smallest first (runs_to_hold).
// RESIDENCY_ENGINE_MEMORY=off holds none.
//
// The allocator changes this memory without any call the preload sees (glibc's free() unmaps and
// trims through internal system calls), so a held piece may stop being mapped: its lock goes with
// the mapping, munlock of it fails harmlessly, and the next snapshot, taken before any wire,
// drops it.
class EngineMemory {
 public:
  static constexpr std::uint64_t kMaxMapping = 1ULL << 30;
  static constexpr std::size_t kMaxRuns = 256;
  static constexpr std::uint64_t kMaxBytes = 256ULL << 20;
  static constexpr std::size_t kMaxGapPages = 4;
  // `log` must outlive it: a snapshot that holds more than any before says so at info, others at debug.
  EngineMemory(Manager& manager, const SessionLog& log)
      : manager_(&manager), pieces_(&manager, log, "engine memory"), log_(&log) {}

  // With the session's lock held: what is registered becomes the resident pages of the engine's
  // candidates outside `held` (sorted, disjoint), now. `why` goes into the log.
  void snapshot(const std::vector<Extent>& held, const EngineOwned& owned, const char* why) noexcept;
  // With the preload's lock held: nothing of it stays registered.
  void unregister() noexcept;
  // Bytes the last snapshot registered (0: none held).
  std::uint64_t bytes() const noexcept { return bytes_; }

  PieceTable& pieces() noexcept { return pieces_; }
  const PieceTable& pieces() const noexcept { return pieces_; }

 private:
  Manager* manager_;
  PieceTable pieces_;
  const SessionLog* log_;
  std::uint64_t bytes_ = 0;
  std::uint64_t said_bytes_ = 0;  // the most an info line said: a snapshot that holds more says so at info
};

}  // namespace residency::preload
