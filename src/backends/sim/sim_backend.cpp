// SPDX-License-Identifier: MIT
// The sim backend: the rules of include/residency/backends/sim.hpp over an injected clock. The
// modelled machine's state (SimBackend::State) lives here, not in the public header.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <utility>

#include "platform/thread_annotations.hpp"
#include "residency/backends/sim.hpp"
#include "residency/config.hpp"
#include "residency/text.hpp"

namespace residency {
namespace {

constexpr Nanos kForever = Nanos::max();

// Bytes moved at `rate` bytes per second over `d`; rate x ns first, so that round rates over
// whole milliseconds are exact and a replay does not depend on how it was cut into steps.
double bytes_over(double rate, Nanos d) { return rate * static_cast<double>(d.count()) / 1e9; }

Nanos add_saturating(Nanos a, Nanos b) {
  if (b.count() > 0 && a > kForever - b) return kForever;
  return a + b;
}

std::string set_name(SetId set) { return "residency set " + std::to_string(set); }

}  // namespace

// The modelled machine behind a SimBackend: what the OS knows of each buffer and set, the queues,
// how far the collector has been replayed, and the counters. The backend's methods forward here;
// each public one takes mu_, and every other is called with it held.
struct SimBackend::State {
  // A buffer the sim knows. Invariant: wired <= size.
  struct Buffer {
    std::uint64_t size = 0;
    std::uint64_t wired = 0;
    bool used = false;           // a GPU operation has used it
    Nanos last_use{0};           // end of the last GPU use, when used
    bool leaked = false;         // in an ended set while no GPU operation has run
    std::uint32_t set_refs = 0;  // committed memberships (a buffer in no set may still be wired)
  };
  struct Set {
    std::map<RegionId, const void*> members;  // committed: region -> buffer base
    std::map<RegionId, RegionDesc> staged_add;
    std::set<RegionId> staged_remove;
    bool requested = false;  // request_residency called and end_residency not since
    Nanos last_request{0};   // last request or refresh
    Nanos last_use{0};       // end of the last GPU use of any member (decay counts from
                             // here too); 0 when never used, as the request is later anyway
  };

  explicit State(const SimOptions& options)
      : options_(options), clock_(options_.clock != nullptr ? options_.clock : &SteadyClock::instance()) {
    modelled_until_ = clock_->now();
  }

  // What SimBackend's methods of the same names do (see sim.hpp).
  Capabilities capabilities() const;
  MemoryInfo memory_info();
  Status create_set(SetId set, std::uint64_t capacity_bytes);
  Status destroy_set(SetId set);
  void add_region(SetId set, const RegionDesc& region);
  void remove_region(SetId set, RegionId region);
  SetOutcome commit(SetId set);
  SetOutcome request_residency(SetId set);
  Status end_residency(SetId set);
  SetOutcome refresh(SetId set);
  void after_release();
  Result<QueueId> add_queue();
  Status attach_set(QueueId queue, SetId set);
  Status detach_set(QueueId queue, SetId set);
  std::vector<SetId> queue_sets(QueueId queue) const;
  Result<CommandBuffer> commit_command_buffer(QueueId queue, std::vector<GpuBuffer> uses, Nanos compute);
  Result<Nanos> execute(const CommandBuffer& cb);
  void gpu_operation();
  std::uint64_t wired_bytes();
  std::uint64_t wired_bytes(const void* base);
  std::uint64_t allocated_bytes() const;
  std::uint32_t live_sets() const;
  bool residency_requested(SetId set);
  Stats stats() const;
  std::string last_error() const;

  Nanos now() const RESIDENCY_REQUIRES(mu_) { return clock_->now(); }
  void advance_locked(Nanos to) RESIDENCY_REQUIRES(mu_);
  bool request_live(const Set& s, Nanos t) const RESIDENCY_REQUIRES(mu_);
  Nanos request_end(const Set& s) const RESIDENCY_REQUIRES(mu_);  // when a live request decays (max for no decay)
  SetOutcome request_locked(SetId set, bool is_refresh) RESIDENCY_REQUIRES(mu_);
  std::uint64_t wire_locked(Buffer& b) RESIDENCY_REQUIRES(mu_);  // wires it all; returns the bytes newly wired
  Nanos cost_of(std::uint64_t bytes) const RESIDENCY_REQUIRES(mu_);
  void misuse(std::string message) RESIDENCY_REQUIRES(mu_);
  Status attach_locked(QueueId queue, SetId set) RESIDENCY_REQUIRES(mu_);

  const SimOptions& options_;  // the backend's
  Clock* const clock_;
  mutable Mutex mu_;
  Nanos modelled_until_ RESIDENCY_GUARDED_BY(mu_) = Nanos(0);  // the collector has been replayed up to this time
  double collector_credit_ RESIDENCY_GUARDED_BY(mu_) = 0;      // fractional bytes carried between replay steps
  std::map<const void*, Buffer> buffers_ RESIDENCY_GUARDED_BY(mu_);
  std::map<SetId, Set> sets_ RESIDENCY_GUARDED_BY(mu_);
  std::vector<std::vector<SetId>> queues_ RESIDENCY_GUARDED_BY(mu_);  // queue id -> attached sets
  std::uint64_t next_command_buffer_ RESIDENCY_GUARDED_BY(mu_) = 1;
  Stats stats_ RESIDENCY_GUARDED_BY(mu_);
  std::string last_error_ RESIDENCY_GUARDED_BY(mu_);
};

SimBackend::SimBackend(SimOptions options) : options_(std::move(options)), state_(std::make_unique<State>(options_)) {}

SimBackend::~SimBackend() = default;

// ---- the Backend interface and the GPU side: each forwards to the model --------------------

Capabilities SimBackend::capabilities() const { return state_->capabilities(); }
MemoryInfo SimBackend::memory_info() { return state_->memory_info(); }
Status SimBackend::create_set(SetId set, std::uint64_t capacity_bytes) {
  return state_->create_set(set, capacity_bytes);
}
Status SimBackend::destroy_set(SetId set) { return state_->destroy_set(set); }
void SimBackend::add_region(SetId set, const RegionDesc& region) { state_->add_region(set, region); }
void SimBackend::remove_region(SetId set, RegionId region) { state_->remove_region(set, region); }
SetOutcome SimBackend::commit(SetId set) { return state_->commit(set); }
SetOutcome SimBackend::request_residency(SetId set) { return state_->request_residency(set); }
Status SimBackend::end_residency(SetId set) { return state_->end_residency(set); }
SetOutcome SimBackend::refresh(SetId set) { return state_->refresh(set); }
void SimBackend::after_release() { state_->after_release(); }
Result<SimBackend::QueueId> SimBackend::add_queue() { return state_->add_queue(); }
Status SimBackend::attach_set(QueueId queue, SetId set) { return state_->attach_set(queue, set); }
Status SimBackend::detach_set(QueueId queue, SetId set) { return state_->detach_set(queue, set); }
std::vector<SetId> SimBackend::queue_sets(QueueId queue) const { return state_->queue_sets(queue); }
Result<SimBackend::CommandBuffer> SimBackend::commit_command_buffer(QueueId queue, std::vector<GpuBuffer> uses,
                                                                    Nanos compute) {
  return state_->commit_command_buffer(queue, std::move(uses), compute);
}
Result<Nanos> SimBackend::execute(const CommandBuffer& cb) { return state_->execute(cb); }
void SimBackend::gpu_operation() { state_->gpu_operation(); }
std::uint64_t SimBackend::wired_bytes() { return state_->wired_bytes(); }
std::uint64_t SimBackend::wired_bytes(const void* base) { return state_->wired_bytes(base); }
std::uint64_t SimBackend::allocated_bytes() const { return state_->allocated_bytes(); }
std::uint32_t SimBackend::live_sets() const { return state_->live_sets(); }
bool SimBackend::residency_requested(SetId set) { return state_->residency_requested(set); }
SimBackend::Stats SimBackend::stats() const { return state_->stats(); }
std::string SimBackend::last_error() const { return state_->last_error(); }

Capabilities SimBackend::State::capabilities() const {
  Capabilities c;
  c.name = "sim";
  c.needs_refresh = options_.decaying_requests;
  c.refresh_period = options_.decaying_requests ? options_.refresh_period : Nanos(0);
  c.max_sets = options_.attach_new_sets ? options_.queue_set_limit : 0;
  return c;
}

MemoryInfo SimBackend::State::memory_info() {
  MutexLock lock(mu_);
  advance_locked(now());
  MemoryInfo m;
  m.physical = options_.profile.physical;
  m.recommended_working_set = options_.profile.recommended_working_set;
  return m;
}

// ---- the collector --------------------------------------------------------------------

Nanos SimBackend::State::request_end(const Set& s) const {
  if (!options_.decaying_requests) return kForever;
  return add_saturating(std::max(s.last_request, s.last_use), options_.request_decay);
}

bool SimBackend::State::request_live(const Set& s, Nanos t) const { return s.requested && t < request_end(s); }

// Replays the collector from modelled_until_ to `to`. Between two calls nothing changes but
// time, so a buffer's protection can only end at a time known now (its last use plus the
// collector delay, or a decaying request's end). The replay goes from one such time to the
// next; within each step the collector unwires collector_rate bytes per second from the
// unprotected wired buffers, least recently used first.
void SimBackend::State::advance_locked(Nanos to) {
  Nanos t = modelled_until_;
  while (t < to) {
    // When each buffer covered by a live request stops being covered.
    std::map<const void*, Nanos> requested_until;
    for (const auto& [id, s] : sets_) {
      if (!request_live(s, t)) continue;
      const Nanos end = request_end(s);
      for (const auto& [rid, base] : s.members) {
        auto [it, inserted] = requested_until.try_emplace(base, end);
        if (!inserted) it->second = std::max(it->second, end);
      }
    }
    Nanos next = to;
    std::vector<std::pair<Nanos, const void*>> exposed;  // (last use, base): LRU order
    for (const auto& [base, b] : buffers_) {
      if (b.wired == 0) continue;
      bool is_protected = b.leaked;
      Nanos until = b.leaked ? kForever : t;
      if (b.used) {
        const Nanos recent_until = add_saturating(b.last_use, options_.profile.collector_delay);
        if (t < recent_until) {
          is_protected = true;
          until = std::max(until, recent_until);
        }
      }
      if (auto it = requested_until.find(base); it != requested_until.end()) {
        is_protected = true;
        until = std::max(until, it->second);
      }
      if (is_protected) {
        next = std::min(next, until);
      } else {
        exposed.emplace_back(b.used ? b.last_use : Nanos::min(), base);
      }
    }
    if (exposed.empty()) {
      collector_credit_ = 0;
    } else {
      std::sort(exposed.begin(), exposed.end());
      double budget = collector_credit_ + bytes_over(options_.profile.collector_rate, next - t);
      bool all_taken = true;
      for (const auto& [last_use, base] : exposed) {
        Buffer& b = buffers_.at(base);
        const double whole = std::floor(budget);
        const std::uint64_t take = whole >= static_cast<double>(b.wired) ? b.wired : static_cast<std::uint64_t>(whole);
        b.wired -= take;
        budget -= static_cast<double>(take);
        stats_.collected_bytes += take;
        if (b.wired > 0) {
          all_taken = false;
          break;
        }
      }
      // Credit carries over only while there is work left: an idle collector saves nothing.
      collector_credit_ = all_taken ? 0 : budget;
    }
    t = next;
  }
  if (to > modelled_until_) modelled_until_ = to;
  // Forget memory that is in no set, no longer wired and not leaked: it is the engine's
  // business again (its next GPU use brings it back, unwired).
  for (auto it = buffers_.begin(); it != buffers_.end();) {
    if (it->second.set_refs == 0 && it->second.wired == 0 && !it->second.leaked) {
      it = buffers_.erase(it);
    } else {
      ++it;
    }
  }
}

std::uint64_t SimBackend::State::wire_locked(Buffer& b) {
  const std::uint64_t newly = b.size - b.wired;
  b.wired = b.size;
  stats_.rewired_bytes += newly;
  return newly;
}

Nanos SimBackend::State::cost_of(std::uint64_t bytes) const {
  return Nanos(std::llround(static_cast<double>(bytes) / options_.profile.rewire_rate * 1e9));
}

void SimBackend::State::misuse(std::string message) {
  ++stats_.misuse;
  last_error_ = std::move(message);
}

// ---- sets -------------------------------------------------------------------------------

Status SimBackend::State::create_set(SetId set, std::uint64_t /*capacity_bytes: a hint*/) {
  MutexLock lock(mu_);
  advance_locked(now());
  if (sets_.count(set) != 0) {
    return Status(ErrorCode::invalid_argument,
                  "sim: " + set_name(set) + " already exists; destroy it before creating it again");
  }
  if (options_.attach_new_sets) {
    for (QueueId q = 0; q < queues_.size(); ++q) {
      if (queues_[q].size() >= options_.queue_set_limit) {
        return Status(ErrorCode::limit_exceeded, "sim: command queue " + std::to_string(q) + " already holds " +
                                                     std::to_string(queues_[q].size()) +
                                                     " residency sets, the most one queue accepts (queue_set_limit); "
                                                     "use fewer, larger sets (layout sharded, a larger set_max_pct)");
      }
    }
  }
  sets_.emplace(set, Set{});
  if (options_.attach_new_sets) {
    for (auto& attached : queues_) attached.push_back(set);
  }
  return Status::ok();
}

Status SimBackend::State::destroy_set(SetId set) {
  MutexLock lock(mu_);
  advance_locked(now());
  auto it = sets_.find(set);
  if (it == sets_.end()) {
    misuse("sim: destroy_set: no " + set_name(set));
    return Status(ErrorCode::not_found, "sim: destroy_set: no " + set_name(set));
  }
  Set& s = it->second;
  const bool leak = s.requested && options_.ended_set_leak && stats_.gpu_operations == 0;
  for (const auto& [rid, base] : s.members) {
    Buffer& b = buffers_.at(base);
    if (leak) b.leaked = true;
    --b.set_refs;
  }
  for (auto& attached : queues_) {
    attached.erase(std::remove(attached.begin(), attached.end(), set), attached.end());
  }
  sets_.erase(it);
  return Status::ok();
}

void SimBackend::State::add_region(SetId set, const RegionDesc& region) {
  MutexLock lock(mu_);
  auto it = sets_.find(set);
  if (it == sets_.end()) {
    misuse("sim: add_region: no " + set_name(set) + " (region " + std::to_string(region.id) + ")");
    return;
  }
  it->second.staged_remove.erase(region.id);
  it->second.staged_add[region.id] = region;
}

void SimBackend::State::remove_region(SetId set, RegionId region) {
  MutexLock lock(mu_);
  auto it = sets_.find(set);
  if (it == sets_.end()) {
    misuse("sim: remove_region: no " + set_name(set) + " (region " + std::to_string(region) + ")");
    return;
  }
  it->second.staged_add.erase(region);
  it->second.staged_remove.insert(region);
}

SetOutcome SimBackend::State::commit(SetId set) {
  MutexLock lock(mu_);
  const Nanos t = now();
  advance_locked(t);
  ++stats_.commits;
  SetOutcome out;
  auto it = sets_.find(set);
  if (it == sets_.end()) {
    out.status = Status(ErrorCode::not_found, "sim: commit: no " + set_name(set));
    return out;
  }
  Set& s = it->second;
  for (RegionId rid : s.staged_remove) {
    auto m = s.members.find(rid);
    if (m == s.members.end()) continue;
    --buffers_.at(m->second).set_refs;
    s.members.erase(m);
  }
  s.staged_remove.clear();
  const bool live = request_live(s, t);
  std::uint64_t newly = 0;
  for (const auto& [rid, desc] : s.staged_add) {
    std::string problem;
    if (desc.base == nullptr || desc.size == 0) {
      problem = "region " + std::to_string(rid) + " has no memory (base null or size 0)";
    } else if (auto b = buffers_.find(desc.base); b != buffers_.end() && b->second.size != desc.size) {
      problem = "region " + std::to_string(rid) + " of " + format_size(desc.size) +
                " starts where the sim already knows a buffer of " + format_size(b->second.size) +
                "; register each buffer once with one size";
    }
    if (!problem.empty()) {
      out.failed.push_back(rid);
      if (out.status.is_ok()) out.status = Status(ErrorCode::invalid_argument, "sim: " + problem);
      continue;
    }
    auto m = s.members.find(rid);
    if (m != s.members.end()) {
      if (m->second == desc.base) continue;  // already a member
      --buffers_.at(m->second).set_refs;
      s.members.erase(m);
    }
    Buffer& b = buffers_[desc.base];
    b.size = desc.size;
    ++b.set_refs;
    s.members.emplace(rid, desc.base);
    if (live) newly += wire_locked(b);
  }
  s.staged_add.clear();
  stats_.request_wire_time += cost_of(newly);
  return out;
}

SetOutcome SimBackend::State::request_locked(SetId set, bool is_refresh) {
  const Nanos t = now();
  advance_locked(t);
  ++(is_refresh ? stats_.refreshes : stats_.requests);
  SetOutcome out;
  auto it = sets_.find(set);
  if (it == sets_.end()) {
    out.status = Status(ErrorCode::not_found,
                        std::string("sim: ") + (is_refresh ? "refresh" : "request_residency") + ": no " + set_name(set));
    return out;
  }
  Set& s = it->second;
  s.requested = true;
  s.last_request = t;
  std::uint64_t newly = 0;
  for (const auto& [rid, base] : s.members) newly += wire_locked(buffers_.at(base));
  stats_.request_wire_time += cost_of(newly);
  return out;
}

SetOutcome SimBackend::State::request_residency(SetId set) {
  MutexLock lock(mu_);
  return request_locked(set, false);
}

// A refresh is a repeated request: it renews a decaying request and re-wires whatever the
// collector took after a lapse.
SetOutcome SimBackend::State::refresh(SetId set) {
  MutexLock lock(mu_);
  return request_locked(set, true);
}

Status SimBackend::State::end_residency(SetId set) {
  MutexLock lock(mu_);
  advance_locked(now());
  auto it = sets_.find(set);
  if (it == sets_.end()) {
    misuse("sim: end_residency: no " + set_name(set));
    return Status(ErrorCode::not_found, "sim: end_residency: no " + set_name(set));
  }
  Set& s = it->second;
  if (!s.requested) return Status::ok();
  s.requested = false;
  if (options_.ended_set_leak && stats_.gpu_operations == 0) {
    for (const auto& [rid, base] : s.members) buffers_.at(base).leaked = true;
  }
  return Status::ok();
}

void SimBackend::State::after_release() {
  if (options_.after_release_gpu_op) gpu_operation();
}

// ---- queues and GPU work ----------------------------------------------------------------

Status SimBackend::State::attach_locked(QueueId queue, SetId set) {
  if (queue >= queues_.size()) {
    return Status(ErrorCode::not_found, "sim: no command queue " + std::to_string(queue) + "; add one with add_queue()");
  }
  if (sets_.count(set) == 0) return Status(ErrorCode::not_found, "sim: no " + set_name(set));
  auto& attached = queues_[queue];
  if (std::find(attached.begin(), attached.end(), set) != attached.end()) return Status::ok();
  if (attached.size() >= options_.queue_set_limit) {
    return Status(ErrorCode::limit_exceeded, "sim: command queue " + std::to_string(queue) + " already holds " +
                                                 std::to_string(attached.size()) +
                                                 " residency sets, the most one queue accepts; detach one first");
  }
  attached.push_back(set);
  return Status::ok();
}

Result<SimBackend::QueueId> SimBackend::State::add_queue() {
  MutexLock lock(mu_);
  if (options_.attach_new_sets && sets_.size() > options_.queue_set_limit) {
    return Status(ErrorCode::limit_exceeded,
                  "sim: " + std::to_string(sets_.size()) +
                      " residency sets exist and each would be attached to the new queue, which "
                      "accepts " +
                      std::to_string(options_.queue_set_limit));
  }
  const auto id = static_cast<QueueId>(queues_.size());
  queues_.emplace_back();
  if (options_.attach_new_sets) {
    for (const auto& [set, s] : sets_) queues_.back().push_back(set);
  }
  return id;
}

Status SimBackend::State::attach_set(QueueId queue, SetId set) {
  MutexLock lock(mu_);
  return attach_locked(queue, set);
}

Status SimBackend::State::detach_set(QueueId queue, SetId set) {
  MutexLock lock(mu_);
  if (queue >= queues_.size()) {
    return Status(ErrorCode::not_found, "sim: no command queue " + std::to_string(queue));
  }
  auto& attached = queues_[queue];
  auto it = std::find(attached.begin(), attached.end(), set);
  if (it == attached.end()) {
    return Status(ErrorCode::not_found, "sim: " + set_name(set) + " is not attached to queue " + std::to_string(queue));
  }
  attached.erase(it);
  return Status::ok();
}

std::vector<SetId> SimBackend::State::queue_sets(QueueId queue) const {
  MutexLock lock(mu_);
  if (queue >= queues_.size()) return {};
  return queues_[queue];
}

Result<SimBackend::CommandBuffer> SimBackend::State::commit_command_buffer(QueueId queue, std::vector<GpuBuffer> uses,
                                                                           Nanos compute) {
  MutexLock lock(mu_);
  const Nanos t = now();
  advance_locked(t);
  if (queue >= queues_.size()) {
    return Status(ErrorCode::not_found, "sim: no command queue " + std::to_string(queue) + "; add one with add_queue()");
  }
  if (compute.count() < 0) {
    return Status(ErrorCode::invalid_argument, "sim: a command buffer's compute time must be >= 0");
  }
  for (const auto& u : uses) {
    if (u.base == nullptr || u.size == 0) {
      return Status(ErrorCode::invalid_argument, "sim: a command buffer uses memory with a null base or size 0");
    }
    auto b = buffers_.find(u.base);
    if (b != buffers_.end() && b->second.size != u.size) {
      return Status(ErrorCode::invalid_argument, "sim: a command buffer uses " + format_size(u.size) +
                                                     " where the sim knows a buffer of " + format_size(b->second.size));
    }
  }
  CommandBuffer cb;
  cb.id = next_command_buffer_++;
  cb.queue = queue;
  cb.committed_at = t;
  cb.compute = compute;
  cb.uses = std::move(uses);
  cb.resident_sets = queues_[queue];
  std::set<const void*> seen;
  for (SetId set : cb.resident_sets) {
    for (const auto& [rid, base] : sets_.at(set).members) {
      if (seen.insert(base).second) cb.resident_buffers.push_back({base, buffers_.at(base).size});
    }
  }
  return cb;
}

Result<Nanos> SimBackend::State::execute(const CommandBuffer& cb) {
  MutexLock lock(mu_);
  const Nanos t = now();
  advance_locked(t);
  std::vector<const GpuBuffer*> all;
  for (const auto& u : cb.uses) all.push_back(&u);
  for (const auto& r : cb.resident_buffers) all.push_back(&r);
  for (const GpuBuffer* g : all) {
    auto b = buffers_.find(g->base);
    if (b != buffers_.end() && b->second.size != g->size) {
      return Status(ErrorCode::invalid_argument, "sim: command buffer " + std::to_string(cb.id) + " uses " +
                                                     format_size(g->size) + " where the sim now knows a buffer of " +
                                                     format_size(b->second.size));
    }
  }
  std::uint64_t newly = 0;
  std::set<const void*> used;
  for (const GpuBuffer* g : all) {
    if (!used.insert(g->base).second) continue;
    Buffer& b = buffers_[g->base];
    b.size = g->size;
    newly += wire_locked(b);
  }
  const Nanos wire = cost_of(newly);
  const Nanos duration = cb.compute + wire;
  const Nanos end = t + duration;
  for (const void* base : used) {
    Buffer& b = buffers_.at(base);
    b.used = true;
    b.last_use = end;
  }
  for (auto& [id, s] : sets_) {
    for (const auto& [rid, base] : s.members) {
      if (used.count(base) != 0) {
        s.last_use = std::max(s.last_use, end);
        break;
      }
    }
  }
  stats_.gpu_wire_time += wire;
  ++stats_.gpu_operations;
  for (auto& [base, b] : buffers_) b.leaked = false;  // any GPU operation ends the leak
  return duration;
}

Result<Nanos> SimBackend::run_command_buffer(QueueId queue, std::vector<GpuBuffer> uses, Nanos compute) {
  auto cb = commit_command_buffer(queue, std::move(uses), compute);
  if (!cb) return cb.status();
  return execute(*cb);
}

void SimBackend::State::gpu_operation() {
  MutexLock lock(mu_);
  advance_locked(now());
  ++stats_.gpu_operations;
  for (auto& [base, b] : buffers_) b.leaked = false;
}

// ---- observations -----------------------------------------------------------------------

std::uint64_t SimBackend::State::wired_bytes() {
  MutexLock lock(mu_);
  advance_locked(now());
  std::uint64_t total = 0;
  for (const auto& [base, b] : buffers_) total += b.wired;
  return total;
}

std::uint64_t SimBackend::State::wired_bytes(const void* base) {
  MutexLock lock(mu_);
  advance_locked(now());
  auto it = buffers_.find(base);
  return it == buffers_.end() ? 0 : it->second.wired;
}

std::uint64_t SimBackend::State::allocated_bytes() const {
  MutexLock lock(mu_);
  std::uint64_t total = 0;
  for (const auto& [base, b] : buffers_) total += b.size;
  return total;
}

std::uint32_t SimBackend::State::live_sets() const {
  MutexLock lock(mu_);
  return static_cast<std::uint32_t>(sets_.size());
}

bool SimBackend::State::residency_requested(SetId set) {
  MutexLock lock(mu_);
  const Nanos t = now();
  advance_locked(t);
  auto it = sets_.find(set);
  return it != sets_.end() && request_live(it->second, t);
}

SimBackend::Stats SimBackend::State::stats() const {
  MutexLock lock(mu_);
  return stats_;
}

std::string SimBackend::State::last_error() const {
  MutexLock lock(mu_);
  return last_error_;
}

// ---- construction -------------------------------------------------------------------------

Result<std::shared_ptr<SimBackend>> make_sim_backend(SimOptions options) {
  const SimProfile& p = options.profile;
  std::string bad;
  auto check = [&bad](bool ok, const std::string& what) {
    if (!ok) bad += (bad.empty() ? "" : "; ") + what;
  };
  check(std::isfinite(p.collector_rate) && p.collector_rate > 0,
        "collector_rate must be a positive number of bytes per second");
  check(std::isfinite(p.rewire_rate) && p.rewire_rate > 0, "rewire_rate must be a positive number of bytes per second");
  check(p.collector_delay.count() >= 0, "collector_delay must be >= 0");
  check(options.queue_set_limit > 0, "queue_set_limit must be at least 1");
  if (options.decaying_requests) {
    check(options.request_decay.count() > 0, "request_decay must be > 0 with decaying_requests");
    check(options.refresh_period.count() > 0, "refresh_period must be > 0 with decaying_requests");
  }
  if (!bad.empty()) {
    return Status(ErrorCode::invalid_argument, "sim profile '" + p.name + "': " + bad);
  }
  return std::shared_ptr<SimBackend>(new SimBackend(std::move(options)));
}

Result<std::shared_ptr<Backend>> make_sim_backend() {
  auto sim = make_sim_backend(SimOptions{});
  if (!sim) return sim.status();
  return std::shared_ptr<Backend>(std::move(sim.value()));
}

}  // namespace residency
