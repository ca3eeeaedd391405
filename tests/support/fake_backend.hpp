// SPDX-License-Identifier: MIT
// FakeBackend: a Backend that keeps books instead of wiring memory, for the core's tests.
//
// It records what the manager asked for (sets, members, commits, requests, releases) and
// models the one thing a test must observe: which bytes are resident. A region is resident
// when it is a committed member of a set whose residency is requested. It can be told to
// refuse regions (as mlock refuses past RLIMIT_MEMLOCK), to refuse releases (as a CUDA sleep
// without pinned memory does), to limit reservations (the process's hard limit, shared by its
// managers) and to ask for periodic refreshes. Like every backend it locks for itself: several
// managers and their scheduler threads may call it at once, and tests read it meanwhile.
#pragma once

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "residency/backend.hpp"
#include "residency/config.hpp"

namespace residency::testing {

class FakeBackend : public Backend {
 public:
  struct SetRec {
    bool exists = false;
    bool requested = false;
    std::map<RegionId, RegionDesc> members;  // committed
    std::map<RegionId, RegionDesc> staged_add;
    std::set<RegionId> staged_remove;
    int commits = 0;
    int requests = 0;
    int refreshes = 0;
    int ends = 0;
  };

  // Knobs (set before creating the manager).
  std::uint64_t recommended = 1ull << 30;  // 1 GiB
  std::uint64_t physical = 4ull << 30;
  std::uint64_t hard_limit = 0;
  std::uint32_t max_sets = 0;
  bool needs_refresh = false;
  Nanos refresh_period{std::chrono::milliseconds(500)};
  std::uint64_t refuse_above_bytes = UINT64_MAX;  // resident bytes the "OS" allows
  std::uint64_t reserve_limit = UINT64_MAX;       // bytes reserve_wired() grants in all
  bool fail_end_residency = false;                // end_residency refuses (nothing given back)
  std::optional<std::uint64_t> available;         // memory_available(); nullopt: unknown
  std::function<bool()> device_full;  // allocate() and waking allocated memory fail with out_of_memory while it says so
  // A paced wake (Capabilities::paced_wake), as the cuda backend's: waking allocated memory asks
  // the wake gate before each piece of this many bytes, and calls on_paced(bytes mapped so far)
  // after it (without the lock). 0: no pacing.
  std::uint64_t pace_piece = 0;
  std::function<void(std::uint64_t)> on_paced;
  std::function<bool()> prepare_stop;       // prepare_release()'s, under mu
  std::atomic<std::uint64_t> unmanaged{0};  // unmanaged_device_bytes(): a GPU context's, say
  std::uint64_t unmanaged_device_bytes() override { return unmanaged.load(); }
  std::atomic<std::uint64_t> registered_files{0};  // registered_file_bytes(): model files pinned for wakes
  std::uint64_t registered_file_bytes() const override { return registered_files.load(); }
  int available_reads = 0;

  Capabilities capabilities() const override {
    Capabilities c;
    c.name = "fake";
    c.needs_refresh = needs_refresh;
    c.refresh_period = needs_refresh ? refresh_period : Nanos(0);
    c.max_sets = max_sets;
    c.paced_wake = pace_piece != 0;
    c.prepares_release = prepares_release;
    c.registers_files = registers_files;
    return c;
  }
  // The host tier (Capabilities::registers_files), as the cuda backend keeps model files
  // registered: register_file() asks the host gate first, drop_file_registrations() gives back.
  bool registers_files = false;  // set before creating the manager
  void set_host_gate(HostGate g) override {
    std::lock_guard<std::recursive_mutex> l(mu);
    host_gate = std::move(g);
  }
  bool has_host_gate() const {
    std::lock_guard<std::recursive_mutex> l(mu);
    return static_cast<bool>(host_gate.reserve);
  }
  bool register_file(std::uint64_t bytes, bool may_wait, std::uint64_t file = 0) {
    HostGate g;
    {
      std::lock_guard<std::recursive_mutex> l(mu);
      g = host_gate;
    }
    if (g.reserve && !g.reserve(bytes, may_wait, file)) return false;
    if (may_wait && g.reserve && !g.reserve(bytes, false, file)) return false;  // the room made ahead, taken
    registered_files.fetch_add(bytes);
    return true;
  }
  std::uint64_t drop_file_registrations() override {
    std::lock_guard<std::recursive_mutex> l(mu);
    const std::uint64_t n = registered_files.exchange(0);
    if (n != 0 && host_gate.give_back) host_gate.give_back(n);
    ++drops;
    return n;
  }
  HostGate host_gate;
  std::atomic<int> drops{0};
  void set_wake_gate(WakeGate g) override {
    std::lock_guard<std::recursive_mutex> l(mu);
    gate = std::move(g);
  }
  // The first release, prepared: what prepare_release() answers, how often it was asked, and the
  // `stop` it was given (until stop_preparation()).
  bool prepares_release = false;  // Capabilities::prepares_release (set before creating the manager)
  Preparation prepare_answer = Preparation::nothing;
  std::atomic<int> prepare_calls{0};
  std::atomic<int> preparation_stops{0};
  Preparation prepare_release(std::function<bool()> stop) override {
    std::lock_guard<std::recursive_mutex> l(mu);
    ++prepare_calls;
    prepare_stop = std::move(stop);
    return prepare_answer;
  }
  void stop_preparation() override {
    std::lock_guard<std::recursive_mutex> l(mu);
    ++preparation_stops;
    prepare_stop = nullptr;
  }
  // What the preparation's `stop` says now (nullopt: none was given, or it was taken back).
  std::optional<bool> preparation_should_stop() {
    std::lock_guard<std::recursive_mutex> l(mu);
    if (!prepare_stop) return std::nullopt;
    return prepare_stop();
  }
  std::optional<std::uint64_t> memory_available() override {
    std::lock_guard<std::recursive_mutex> g(mu);
    ++available_reads;
    return available;
  }
  MemoryInfo memory_info() override {
    std::lock_guard<std::recursive_mutex> g(mu);
    MemoryInfo m;
    m.physical = physical;
    m.recommended_working_set = recommended;
    m.hard_limit = hard_limit;
    m.hard_limit_name = "FAKE_LIMIT";
    m.hard_limit_fix = "raise the fake limit";
    return m;
  }
  Status reserve_wired(std::uint64_t bytes) override {
    std::lock_guard<std::recursive_mutex> g(mu);
    if (bytes > reserve_limit || reserved > reserve_limit - bytes)
      return Status(ErrorCode::limit_exceeded,
                    "FAKE_LIMIT: " + std::to_string(reserved) + " of " + std::to_string(reserve_limit) + " reserved");
    reserved += bytes;
    max_reserved = std::max(max_reserved, reserved);
    return {};
  }
  void unreserve_wired(std::uint64_t bytes) override {
    std::lock_guard<std::recursive_mutex> g(mu);
    reserved -= std::min(reserved, bytes);
  }
  Result<void*> allocate(std::size_t size, RegionClass) override {
    if (device_full && device_full()) return Status(ErrorCode::out_of_memory, "fake: out of device memory");
    std::lock_guard<std::recursive_mutex> g(mu);
    auto* p = new char[size];
    allocated.insert(p);
    return static_cast<void*>(p);
  }
  void deallocate(void* base) override {
    std::lock_guard<std::recursive_mutex> g(mu);
    auto* p = static_cast<char*>(base);
    if (allocated.erase(p)) delete[] p;
  }
  ~FakeBackend() override {
    for (char* p : allocated) delete[] p;
  }

  Status create_set(SetId set, std::uint64_t) override {
    std::lock_guard<std::recursive_mutex> g(mu);
    auto& s = sets[set];
    if (s.exists) return Status(ErrorCode::invalid_argument, "set exists");
    s = SetRec{};
    s.exists = true;
    ++sets_created;
    created_order.push_back(set);
    return {};
  }
  Status destroy_set(SetId set) override {
    std::lock_guard<std::recursive_mutex> g(mu);
    auto& s = sets[set];
    if (s.requested) ++s.ends;
    s = SetRec{};
    ++sets_destroyed;
    max_resident = std::max(max_resident, resident_bytes());
    return {};
  }
  void add_region(SetId set, const RegionDesc& r) override {
    std::lock_guard<std::recursive_mutex> g(mu);
    auto& s = sets[set];
    s.staged_remove.erase(r.id);
    s.staged_add[r.id] = r;
  }
  void remove_region(SetId set, RegionId id) override {
    std::lock_guard<std::recursive_mutex> g(mu);
    auto& s = sets[set];
    if (s.staged_add.erase(id) == 0) s.staged_remove.insert(id);
  }
  SetOutcome commit(SetId set) override {
    std::lock_guard<std::recursive_mutex> g(mu);
    auto& s = sets[set];
    ++s.commits;
    ++total_commits;
    for (RegionId id : s.staged_remove) s.members.erase(id);
    s.staged_remove.clear();
    SetOutcome out;
    for (auto& [id, r] : s.staged_add) {
      if (s.requested &&
          (resident_bytes() + r.size > refuse_above_bytes || (r.backend_allocated && device_full && device_full()))) {
        out.failed.push_back(id);
        out.status = Status(ErrorCode::out_of_memory, "FAKE_LIMIT reached");
        continue;
      }
      s.members[id] = r;
    }
    s.staged_add.clear();
    max_resident = std::max(max_resident, resident_bytes());
    return out;
  }
  SetOutcome request_residency(SetId set) override {
    pace_wake(set);
    std::lock_guard<std::recursive_mutex> g(mu);
    auto& s = sets[set];
    ++s.requests;
    ++total_requests;
    SetOutcome out;
    if (!s.requested) {
      // Refuse members that do not fit, as mlock does past its limit.
      std::uint64_t have = resident_bytes();
      for (auto it = s.members.begin(); it != s.members.end();) {
        if (have + it->second.size > refuse_above_bytes || (it->second.backend_allocated && device_full && device_full())) {
          out.failed.push_back(it->first);
          out.status = Status(ErrorCode::out_of_memory, "FAKE_LIMIT reached");
          ++it;
        } else {
          have += it->second.size;
          ++it;
        }
      }
      for (RegionId id : out.failed) s.members.erase(id);
      rewired_bytes += members_bytes(s);
    }
    s.requested = true;
    max_resident = std::max(max_resident, resident_bytes());
    return out;
  }
  Status end_residency(SetId set) override {
    std::function<void()> meanwhile;
    {
      std::lock_guard<std::recursive_mutex> g(mu);
      meanwhile = during_end_residency;
    }
    {
      std::lock_guard<std::recursive_mutex> g(mu);
      releasing_now = true;
    }
    if (meanwhile) meanwhile();  // what the test makes happen while this release runs
    std::lock_guard<std::recursive_mutex> g(mu);
    releasing_now = false;
    if (interrupt_pending) {  // as a backend may (Backend::interrupt_release): nothing given back
      interrupt_pending = false;
      ++interrupted_ends;
      return Status(ErrorCode::interrupted, "FAKE: a call began; the release stopped");
    }
    if (fail_end_residency) {
      ++failed_ends;
      return Status(ErrorCode::out_of_memory, "FAKE: no host memory for the backup");
    }
    auto& s = sets[set];
    s.requested = false;
    ++s.ends;
    ++total_ends;
    return {};
  }
  SetOutcome refresh(SetId set) override {
    std::lock_guard<std::recursive_mutex> g(mu);
    ++sets[set].refreshes;
    ++total_refreshes;
    return {};
  }
  void interrupt_release() override {
    interrupts.fetch_add(1);
    std::lock_guard<std::recursive_mutex> g(mu);
    if (releasing_now) interrupt_pending = true;
  }
  void after_release() override {
    std::lock_guard<std::recursive_mutex> g(mu);
    ++after_release_calls;
  }

  // Observations.
  static std::uint64_t members_bytes(const SetRec& s) {
    std::uint64_t b = 0;
    for (auto& [id, r] : s.members) b += r.size;
    return b;
  }
  std::uint64_t resident_bytes() const {
    std::lock_guard<std::recursive_mutex> g(mu);
    std::uint64_t b = 0;
    for (auto& [id, s] : sets)
      if (s.exists && s.requested) b += members_bytes(s);
    return b;
  }
  bool is_resident(RegionId id) const {
    std::lock_guard<std::recursive_mutex> g(mu);
    for (auto& [sid, s] : sets)
      if (s.exists && s.requested && s.members.count(id)) return true;
    return false;
  }
  // Write tracking: what the engine said (track_writes, written), as it said it.
  void track_writes(void* base) override {
    std::lock_guard<std::recursive_mutex> g(mu);
    tracked.insert(static_cast<char*>(base));
  }
  void written(const void* addr, std::size_t bytes) override {
    std::lock_guard<std::recursive_mutex> g(mu);
    writes.emplace_back(reinterpret_cast<std::uintptr_t>(addr), bytes);
  }
  // A fill from a file: where, how much, the file (device and inode, read from the descriptor
  // during the call, as a backend must) and the offset in it.
  struct FileFill {
    std::uintptr_t addr;
    std::size_t bytes;
    dev_t dev;
    ino_t ino;
    std::uint64_t offset;
    bool operator==(const FileFill&) const = default;
  };
  void filled_from_file(const void* addr, std::size_t bytes, int fd, std::uint64_t offset) override {
    struct stat st {};
    const bool ok = ::fstat(fd, &st) == 0;
    std::lock_guard<std::recursive_mutex> g(mu);
    fills.push_back(FileFill{reinterpret_cast<std::uintptr_t>(addr), bytes, ok ? st.st_dev : 0, ok ? st.st_ino : 0, offset});
  }
  // The n-th set created (set ids are process-wide, so tests count in creation order).
  const SetRec& nth_set(std::size_t n) const {
    std::lock_guard<std::recursive_mutex> g(mu);
    static const SetRec none;
    return n < created_order.size() ? sets.at(created_order[n]) : none;
  }
  int live_sets() const {
    std::lock_guard<std::recursive_mutex> g(mu);
    int n = 0;
    for (auto& [id, s] : sets) n += s.exists;
    return n;
  }
  std::map<SetId, SetRec> sets;
  std::vector<SetId> created_order;
  std::set<char*> allocated;
  std::set<char*> tracked;
  std::vector<std::pair<std::uintptr_t, std::size_t>> writes;  // (address, bytes)
  std::vector<FileFill> fills;
  // Release interruption: run (without the lock) inside each end_residency; interrupt_release()
  // calls, and the releases they stopped.
  std::function<void()> during_end_residency;
  WakeGate gate;  // set_wake_gate()
  // Before a set's wake: its allocated memory, piece by piece through the gate (pace_piece).
  void pace_wake(SetId set) {
    WakeGate g;
    std::function<void(std::uint64_t)> seen;
    std::uint64_t bytes = 0;
    {
      std::lock_guard<std::recursive_mutex> l(mu);
      auto it = sets.find(set);
      if (pace_piece == 0 || !gate || it == sets.end() || it->second.requested) return;
      for (const auto& [id, r] : it->second.members)
        if (r.backend_allocated) bytes += r.size;
      g = gate;
      seen = on_paced;
    }
    for (std::uint64_t mapped = 0; mapped < bytes;) {
      const std::uint64_t piece = std::min(pace_piece, bytes - mapped);
      g(piece);
      mapped += piece;
      if (seen) seen(mapped);
    }
  }
  std::atomic<int> interrupts{0};
  bool releasing_now = false;
  bool interrupt_pending = false;
  int interrupted_ends = 0;
  int sets_created = 0, sets_destroyed = 0, total_commits = 0, total_requests = 0, total_ends = 0, total_refreshes = 0,
      after_release_calls = 0;
  std::uint64_t rewired_bytes = 0;
  std::uint64_t reserved = 0, max_reserved = 0;
  std::uint64_t max_resident = 0;  // the most bytes ever resident at once (after each call)
  int failed_ends = 0;
  mutable std::recursive_mutex mu;  // guards everything: backends lock for themselves
};

// Collects log lines for assertions.
struct LogCapture {
  std::mutex m;
  std::vector<std::pair<LogLevel, std::string>> lines;
  auto callback() {
    return [this](LogLevel l, std::string_view s) {
      std::lock_guard<std::mutex> g(m);
      lines.emplace_back(l, std::string(s));
    };
  }
  bool contains(LogLevel l, const std::string& needle) {
    std::lock_guard<std::mutex> g(m);
    for (auto& [lv, s] : lines)
      if (lv == l && s.find(needle) != std::string::npos) return true;
    return false;
  }
  bool contains(const std::string& needle) {
    std::lock_guard<std::mutex> g(m);
    for (auto& [lv, s] : lines)
      if (s.find(needle) != std::string::npos) return true;
    return false;
  }
};

}  // namespace residency::testing
