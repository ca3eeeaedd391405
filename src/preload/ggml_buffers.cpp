// SPDX-License-Identifier: MIT
#include "ggml_buffers.hpp"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "residency/text.hpp"

namespace residency::preload {

void GgmlBuffers::created(BufferId b, bool from_ptr) noexcept {
  if (b == 0) return;
  try {
    const BufferFacts now = reader_->facts(b, from_ptr);
    auto it = buffers_.find(b);
    if (it != buffers_.end()) {
      // ggml made it inside another hooked call (CPU_REPACK allocates a CPU buffer and takes it
      // over; the CPU device's from_host_ptr calls ggml_backend_cpu_buffer_from_ptr).
      BufferFacts& f = it->second.facts;
      if (from_ptr && !f.from_ptr) {
        f.from_ptr = true;
        remember_from_ptr(b);
      }
      // A buffer type's allocation made through the CPU buffer code and then given its own type
      // (ggml-cuda's CUDA_Host: cudaMallocHost, ggml_backend_cpu_buffer_from_ptr, then its buft):
      // its facts are the outer type's. Pinned host memory of a GPU is not a mapping to follow.
      if (!from_ptr && !is_cpu_memory(now.device)) {
        f.device = now.device;
        f.is_host = now.is_host;
        f.from_ptr = false;
        f.tensors.clear();
        forget_from_ptr(b);
      }
      return;
    }
    Tracked t;
    t.facts = now;
    t.facts.from_ptr = from_ptr;
    if (t.facts.size == 0) return;  // ggml's dummy buffer for empty allocations
    // Only host memory has a base worth reading (device buffers' bases are device addresses).
    if (!is_cpu_memory(t.facts.device)) t.facts.base = 0;
    buffers_.emplace(b, std::move(t));
    if (from_ptr) remember_from_ptr(b);
    pending_.store(true, std::memory_order_release);
  } catch (...) {
    // Out of memory: this buffer stays unmanaged.
  }
}

bool GgmlBuffers::is_from_ptr(BufferId b) const noexcept {
  if (b == 0) return false;
  // Only the slots ever used (one or two per model file): this runs for every tensor ggml's graph
  // allocator places, every graph.
  const std::size_t used = from_ptr_used_.load(std::memory_order_acquire);
  for (std::size_t i = 0; i < used; ++i) {
    if (from_ptr_[i].load(std::memory_order_acquire) == b) return true;
  }
  return false;
}

void GgmlBuffers::remember_from_ptr(BufferId b) noexcept {
  for (std::size_t i = 0; i < kMaxFromPtr; ++i) {
    BufferId expected = 0;
    if (from_ptr_[i].compare_exchange_strong(expected, b, std::memory_order_acq_rel)) {
      if (from_ptr_used_.load(std::memory_order_relaxed) < i + 1)
        from_ptr_used_.store(i + 1, std::memory_order_release);
      return;
    }
  }
  // More than kMaxFromPtr at once: this one's tensors are not followed, so it registers nothing.
}

void GgmlBuffers::forget_from_ptr(BufferId b) noexcept {
  for (auto& slot : from_ptr_) {
    BufferId expected = b;
    slot.compare_exchange_strong(expected, 0, std::memory_order_acq_rel);
  }
}

void GgmlBuffers::tensor_placed(BufferId b, std::uintptr_t begin, std::uintptr_t end) noexcept {
  if (begin == 0 || end < begin) return;
  auto it = buffers_.find(b);
  if (it == buffers_.end() || !it->second.facts.from_ptr) return;
  try {
    it->second.facts.tensors.push_back(Extent{begin, end});
    it->second.dirty = true;
    pending_.store(true, std::memory_order_release);
  } catch (...) {
  }
}

void GgmlBuffers::usage_set(BufferId b, BufferUsage u) noexcept {
  auto it = buffers_.find(b);
  if (it == buffers_.end()) return;
  if (it->second.facts.usage == u) return;
  it->second.facts.usage = u;
  it->second.dirty = true;
  pending_.store(true, std::memory_order_release);
}

void GgmlBuffers::freeing(BufferId b) noexcept {
  auto it = buffers_.find(b);
  if (it == buffers_.end()) return;
  pieces_.remove_owner(static_cast<std::uint64_t>(b));
  forget_from_ptr(b);
  buffers_.erase(it);
}

bool GgmlBuffers::holds_weights() const noexcept {
  return std::any_of(buffers_.begin(), buffers_.end(),
                     [](const auto& kv) { return kv.second.facts.usage == BufferUsage::weights; });
}

GgmlBuffers::Registered GgmlBuffers::register_buffer(BufferId b, Tracked& t) {
  const auto owner = static_cast<std::uint64_t>(b);
  pieces_.remove_owner(owner);  // what changed is registered anew
  t.dirty = false;
  // Its type read now: CPU_REPACK takes over a CPU buffer after creating it.
  const std::string type_name = reader_->type_name(b);
  const BufferPlan plan = plan_buffer(t.facts, system_page_size());
  const std::string what = type_name + " buffer of " + format_size(t.facts.size);
  if (plan.ranges.empty()) {
    if (plan.worth_a_line) log_->info(what + ": not managed: " + plan.not_managed);
    return {};
  }
  std::size_t placed = 0, programs = 0;
  for (const Extent& r : plan.ranges) {
    const std::size_t theirs = pieces_.excluded_bytes(r.begin, r.end);  // what add() leaves out
    programs += theirs;
    if (pieces_.add(r.begin, r.end, plan.cls, owner)) placed += r.end - r.begin - theirs;
  }
  std::string line = "registered " + what + " as " + to_string(plan.cls);
  if (t.facts.from_ptr) {
    line += ": its " + std::to_string(t.facts.tensors.size()) + " tensor(s), " + format_size(placed) + " in " +
            std::to_string(plan.ranges.size()) + " range(s)";
    if (placed + system_page_size() < t.facts.size)
      line += "; the rest of its range is other buffers' tensors' file pages, not wired";
  }
  if (placed + programs < plan.registered_bytes)
    line += " (" + format_size(plan.registered_bytes - placed - programs) + " left unmanaged)";
  if (programs > 0) line += " (" + format_size(programs) + " locked by the program itself, left to it)";
  log_->debug(line);
  if (pressure_without_swap_ && !warned_anonymous_weights_ && !t.facts.from_ptr && plan.cls == RegionClass::weights &&
      placed >= (std::size_t{64} << 20)) {
    warned_anonymous_weights_ = true;
    log_->warn(
        "llama.cpp copied " + format_size(placed) + " of the model's weights into a " + type_name +
        " buffer (anonymous memory) and this machine has no swap: releasing them under memory pressure frees nothing "
        "(anonymous pages can only be reclaimed to swap). To let pressure take the model back, keep the weights in "
        "the page cache: llama.cpp's --no-repack (-nr; use_extra_bufts = false), or add swap");
  }
  return Registered{plan.cls, type_name, placed, programs};
}

namespace {

// "weights 111.7 MiB (CPU_REPACK 103.2 MiB, CPU_Mapped 8.5 MiB), kv_cache 16 MiB (CPU)": by class
// in RegionClass order, each with its buffer types, largest first.
std::string by_class_and_type(const std::vector<std::pair<RegionClass, std::pair<std::string, std::size_t>>>& parts) {
  std::string out;
  for (RegionClass cls : {RegionClass::weights, RegionClass::kv_cache, RegionClass::scratch}) {
    std::vector<std::pair<std::string, std::size_t>> types;
    std::size_t total = 0;
    for (const auto& part : parts) {
      const std::size_t bytes = part.second.second;
      if (part.first != cls || bytes == 0) continue;
      total += bytes;
      auto it = std::find_if(types.begin(), types.end(), [&part](const auto& t) { return t.first == part.second.first; });
      if (it == types.end()) types.push_back(part.second);
      else it->second += bytes;
    }
    if (total == 0) continue;
    std::sort(types.begin(), types.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
    out += (out.empty() ? "" : ", ") + std::string(to_string(cls)) + " " + format_size(total) + " (";
    for (std::size_t i = 0; i < types.size(); ++i)
      out += (i ? ", " : "") + types[i].first + (types.size() > 1 ? " " + format_size(types[i].second) : "");
    out += ")";
  }
  return out;
}

}  // namespace

void GgmlBuffers::flush() noexcept {
  pending_.store(false, std::memory_order_release);
  try {
    std::vector<std::pair<RegionClass, std::pair<std::string, std::size_t>>> parts, programs;
    std::size_t count = 0;
    for (auto& [b, t] : buffers_) {
      if (!t.dirty) continue;
      Registered r = register_buffer(b, t);
      // (Less than a page: a buffer beside a lock of the program's that shares its last page.)
      if (r.programs >= system_page_size()) programs.emplace_back(r.cls, std::make_pair(r.type, r.programs));
      if (r.bytes == 0) continue;
      ++count;
      parts.emplace_back(r.cls, std::make_pair(std::move(r.type), r.bytes));
    }
    if (count > 0)
      log_->info("registered " + std::to_string(count) + (count == 1 ? " buffer: " : " buffers: ") +
                 by_class_and_type(parts));
    // llama.cpp's load modes mlock and mmap+mlock lock the weights themselves: the session never
    // registers what the program locked (it would unlock it), and says so, once per load.
    if (!programs.empty())
      log_->info("left to the program, which locks it itself (llama.cpp's load mode mlock or mmap+mlock): " +
                 by_class_and_type(programs) +
                 "; it stays locked for as long as the program keeps it so, residency neither holds nor releases "
                 "it, and it counts in none of residency's limits or budgets");
  } catch (...) {
    // Out of memory while logging: what was registered stays registered.
  }
}

std::vector<Extent> GgmlBuffers::from_ptr_runs() const {
  std::vector<Extent> out;
  for (const PieceTable::Piece& p : pieces_.pieces()) {
    auto it = buffers_.find(static_cast<BufferId>(p.owner));
    if (it != buffers_.end() && it->second.facts.from_ptr) out.push_back(Extent{p.begin, p.end});
  }
  return out;
}

}  // namespace residency::preload
