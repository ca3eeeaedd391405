// SPDX-License-Identifier: MIT
#include "program_session.hpp"

#include <algorithm>
#include <utility>

#include "preload/manager_start.hpp"
#include "residency/text.hpp"

namespace residency::cudapreload {

namespace {

constexpr const char* kWithoutDevice = "; its device memory stays the CUDA runtime's (no sleep)";

std::string device_name(int device) { return "CUDA device " + std::to_string(device); }

// The backend's class for a tag: weights and unknown memory keep their bytes (the cuda backend
// copies a weights-class allocation to the host at each sleep, all of it unless its writes are
// tracked), scratch is dropped.
RegionClass class_of(Tag t) noexcept {
  switch (t) {
    case Tag::scratch: return RegionClass::scratch;
    case Tag::weights:
    case Tag::kv:
    case Tag::unknown: break;
  }
  return RegionClass::weights;
}

}  // namespace

std::optional<Tag> parse_tag(std::string_view name) noexcept {
  if (name == "weights") return Tag::weights;
  if (name == "kv") return Tag::kv;
  if (name == "scratch") return Tag::scratch;
  if (name.empty() || name == "unknown") return Tag::unknown;
  return std::nullopt;
}

const char* to_string(Tag t) noexcept {
  switch (t) {
    case Tag::weights: return "weights";
    case Tag::kv: return "kv";
    case Tag::scratch: return "scratch";
    case Tag::unknown: break;
  }
  return "unknown";
}

ProgramSession::ProgramSession(Options options)
    : options_(std::move(options)), log_(options_.config.log_level, options_.config.log_time, options_.log) {
  // The host tier bounds registered model files (docs/design.md, "The host tier"); a program's
  // memory sleeps in pinned backups only, so there is nothing for it to bound.
  options_.config.host_budget.off = true;
}

ProgramSession::~ProgramSession() {
  std::vector<std::unique_ptr<Manager>> owners;
  {
    MutexLock lock(mu_);
    held_.clear();
    captures_.clear();
    mapped_.clear();
    for (auto& m : managers_) m.store(nullptr, std::memory_order_release);
    active_.store(0, std::memory_order_release);
    owners.swap(owners_);
    routed_.clear();
  }
  owners.clear();  // outside the lock: a manager's teardown wakes nothing, but may wait for its threads
}

std::unique_ptr<Manager> ProgramSession::start_manager(int slot) {
  const bool mappings = slot >= ProgramRules::kMaxDevices;
  const int device = mappings ? slot - ProgramRules::kMaxDevices : slot;
  if (mappings && !options_.mapping_backends) return nullptr;
  return preload::start_session_manager(device, options_.config, mappings ? options_.mapping_backends : options_.backends,
                                        options_.clock, options_.start_schedulers, log_, kWithoutDevice);
}

Manager* ProgramSession::slot_locked(int slot) {
  const auto i = static_cast<std::size_t>(slot);
  if (Manager* m = managers_[i].load(std::memory_order_relaxed)) return m;
  if (failed_[i]) return nullptr;
  std::unique_ptr<Manager> m = start_manager(slot);
  if (!m) {
    failed_[i] = true;
    return nullptr;
  }
  try {
    owners_.push_back(std::move(m));
  } catch (...) {
    failed_[i] = true;
    return nullptr;
  }
  Manager* raw = owners_.back().get();
  managers_[i].store(raw, std::memory_order_release);
  started_[static_cast<std::size_t>(active_.load(std::memory_order_relaxed))] = slot;
  active_.fetch_add(1, std::memory_order_release);
  return raw;
}

Manager* ProgramSession::device_locked(int device) { return slot_locked(device); }

Manager* ProgramSession::manager(int device) const noexcept {
  if (device < 0 || device >= ProgramRules::kMaxDevices) return nullptr;
  return managers_[static_cast<std::size_t>(device)].load(std::memory_order_acquire);
}

Manager* ProgramSession::mapping_manager(int device) const noexcept {
  if (device < 0 || device >= ProgramRules::kMaxDevices) return nullptr;
  return managers_[static_cast<std::size_t>(device + ProgramRules::kMaxDevices)].load(std::memory_order_acquire);
}

// Every started manager, with its slot.
template <typename F>
void ProgramSession::for_each_device(F&& f) noexcept {
  const int n = active_.load(std::memory_order_acquire);
  for (int k = 0; k < n; ++k) {
    const int slot = started_[static_cast<std::size_t>(k)];
    if (Manager* m = managers_[static_cast<std::size_t>(slot)].load(std::memory_order_acquire)) f(slot, *m);
  }
}

ProgramSession::Allocation ProgramSession::allocate(int device, std::size_t size, Tag tag) noexcept {
  using Outcome = Allocation::Outcome;
  if (forked_.load(std::memory_order_relaxed) || aside_.load(std::memory_order_acquire) ||
      size < ProgramRules::kMinRoutedBytes || device < 0 || device >= ProgramRules::kMaxDevices ||
      !options_.config.keep_alive.manages())
    return {};
  MutexLock lock(mu_);
  if (aside_.load(std::memory_order_relaxed)) return {};
  Manager* m = device_locked(device);
  if (m == nullptr) return {};
  auto a = m->allocate(size, class_of(tag));
  if (!a) {
    if (a.status().code() == ErrorCode::out_of_memory) return {Outcome::out_of_memory, nullptr};
    if (!warned_refusal_) {
      warned_refusal_ = true;
      log_.warn(device_name(device) + ": " + a.message() + kWithoutDevice);
    }
    return {};
  }
  try {
    routed_.emplace(reinterpret_cast<std::uintptr_t>(a->ptr), Routed{size, device, tag});
  } catch (...) {
    (void)m->deallocate(a->ptr);
    return {};
  }
  if (tag == Tag::weights) {
    m->track_writes(a->ptr);  // read-only from here on: a later sleep copies only what was reported
    tagged_weights_.fetch_add(1, std::memory_order_acq_rel);
  }
  return {Outcome::routed, a->ptr};
}

bool ProgramSession::free(void* ptr) noexcept {
  if (ptr == nullptr || active_.load(std::memory_order_acquire) == 0) return false;
  Manager* m = nullptr;
  {
    MutexLock lock(mu_);
    const auto it = routed_.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (it == routed_.end()) return false;
    m = managers_[static_cast<std::size_t>(it->second.device)].load(std::memory_order_relaxed);
    if (it->second.tag == Tag::weights) tagged_weights_.fetch_sub(1, std::memory_order_acq_rel);
    routed_.erase(it);
    // Like cudaFree, waits for the device to finish with the memory first (the backend
    // synchronizes before it unmaps). Under the lock: a new allocation may reuse the address.
    if (m != nullptr) (void)m->deallocate(ptr);
  }
  return true;
}

bool ProgramSession::routed(const void* ptr, std::size_t bytes) const noexcept {
  if (active_.load(std::memory_order_acquire) == 0 || bytes == 0) return false;
  const auto b = reinterpret_cast<std::uintptr_t>(ptr);
  MutexLock lock(mu_);
  auto it = routed_.upper_bound(b);  // the first starting after b; the one before may hold b
  if (it != routed_.begin()) {
    const auto prev = std::prev(it);
    if (b < prev->first + prev->second.size) return true;
  }
  return it != routed_.end() && it->first < b + bytes;
}

bool ProgramSession::mapping_made(int device, void* va, std::size_t size) noexcept {
  if (forked_.load(std::memory_order_relaxed) || aside_.load(std::memory_order_acquire) || va == nullptr || size == 0 ||
      device < 0 || device >= ProgramRules::kMaxDevices || !options_.config.keep_alive.manages())
    return false;
  MutexLock lock(mu_);
  Manager* m = slot_locked(device + ProgramRules::kMaxDevices);
  if (m == nullptr) return false;
  // Memory the program filled: kept across a sleep, all of it each time (its writes are unknown).
  if (auto r = m->register_region(va, size, RegionClass::weights); !r) {
    log_.warn(device_name(device) + ": a mapping of the program's own (" + format_size(size) +
              ") is not managed: " + r.message());
    return false;
  }
  try {
    mapped_[reinterpret_cast<std::uintptr_t>(va)] = Mapped{size, device};
  } catch (...) {
    (void)m->unregister_address(va);
    return false;
  }
  return true;
}

void ProgramSession::mapping_gone(void* va) noexcept {
  MutexLock lock(mu_);
  const auto it = mapped_.find(reinterpret_cast<std::uintptr_t>(va));
  if (it == mapped_.end()) return;
  Manager* m = managers_[static_cast<std::size_t>(it->second.device + ProgramRules::kMaxDevices)].load(
      std::memory_order_relaxed);
  mapped_.erase(it);
  if (m != nullptr) (void)m->unregister_address(va);
}

std::uint64_t ProgramSession::mapping_bytes() const noexcept {
  MutexLock lock(mu_);
  std::uint64_t n = 0;
  for (const auto& [base, r] : mapped_) n += r.size;
  return n;
}

std::uint64_t ProgramSession::routed_bytes() const noexcept {
  MutexLock lock(mu_);
  std::uint64_t n = 0;
  for (const auto& [base, r] : routed_) n += r.size;
  return n;
}

ProgramSession::Use ProgramSession::use() noexcept {
  Use u;
  if (forked_.load(std::memory_order_relaxed) || active_.load(std::memory_order_acquire) == 0) return u;
  u.s_ = this;
  for_each_device([&](int slot, Manager& m) {
    const bool asleep = !m.wants_resident();
    m.begin_call();  // lock-free while resident; wakes first when asleep
    u.begun_[static_cast<std::size_t>(slot / 64)] |= std::uint64_t{1} << (slot % 64);
    if (!asleep || !u.status_) return;
    if (Status st = m.unwired_status(); !st) u.status_ = st;
  });
  if (!u.status_ && !warned_wake_.exchange(true, std::memory_order_relaxed))
    log_.warn("device memory could not be woken for a launch or copy (" + u.status_.message() +
              "); such a call fails with out of memory instead of running on memory that is not there");
  return u;
}

ProgramSession::Use::~Use() {
  if (s_ != nullptr) s_->end_use(begun_);
}

void ProgramSession::end_use(const std::array<std::uint64_t, 2>& begun) noexcept {
  for_each_device([&](int slot, Manager& m) {
    if ((begun[static_cast<std::size_t>(slot / 64)] >> (slot % 64)) & 1U) m.end_call();
  });
}

void ProgramSession::capture_began(const void* stream) noexcept {
  if (forked_.load(std::memory_order_relaxed) || active_.load(std::memory_order_acquire) == 0) return;
  try {
    std::vector<Manager*> managers;
    for_each_device([&](int, Manager& m) { managers.push_back(&m); });
    // Woken outside the lock (a wake takes a copy's time; allocations and frees go on meanwhile).
    std::vector<UseScope> scopes;
    scopes.reserve(managers.size());
    for (Manager* m : managers) scopes.push_back(m->use());
    MutexLock lock(mu_);
    captures_.emplace_back(stream, std::move(scopes));
  } catch (...) {
    // out of memory: the capture goes ahead unheld
  }
}

void ProgramSession::capture_ended(const void* stream) noexcept {
  std::vector<UseScope> ended;
  {
    MutexLock lock(mu_);
    for (auto it = captures_.begin(); it != captures_.end(); ++it) {
      if (it->first != stream) continue;
      ended = std::move(it->second);
      captures_.erase(it);
      break;
    }
  }
  ended.clear();  // outside the lock: under keep-alive 0 an end releases
}

void ProgramSession::written(const void* dst, std::size_t bytes) noexcept {
  if (tagged_weights_.load(std::memory_order_acquire) == 0 || bytes == 0) return;
  const auto b = reinterpret_cast<std::uintptr_t>(dst);
  const std::uintptr_t e = b + bytes;
  MutexLock lock(mu_);
  auto it = routed_.upper_bound(b);
  if (it != routed_.begin()) --it;
  for (; it != routed_.end() && it->first < e; ++it) {
    const std::uintptr_t rb = it->first, re = rb + it->second.size;
    if (it->second.tag != Tag::weights || re <= b) continue;
    Manager* m = managers_[static_cast<std::size_t>(it->second.device)].load(std::memory_order_relaxed);
    if (m == nullptr) continue;
    const std::uintptr_t from = std::max(b, rb);
    m->written(reinterpret_cast<const void*>(from), std::min(e, re) - from);
  }
}

std::uint64_t ProgramSession::tag(const void* ptr, std::size_t bytes, Tag t) noexcept {
  const auto b = reinterpret_cast<std::uintptr_t>(ptr);
  if (bytes == 0 || b + bytes < b) return 0;
  const std::uintptr_t e = b + bytes;
  MutexLock lock(mu_);
  std::uint64_t tagged = 0;
  for (auto it = routed_.lower_bound(b); it != routed_.end() && it->first < e; ++it) {
    Routed& r = it->second;
    if (it->first + r.size > e) break;  // only partly inside: left as it is
    // Only weights can be given after the allocation was made (the backend's class is fixed then);
    // scratch stays scratch.
    if (t == Tag::weights && r.tag != Tag::weights && r.tag != Tag::scratch) {
      Manager* m = managers_[static_cast<std::size_t>(r.device)].load(std::memory_order_relaxed);
      if (m == nullptr) continue;
      m->track_writes(reinterpret_cast<void*>(it->first));
      r.tag = Tag::weights;
      tagged_weights_.fetch_add(1, std::memory_order_acq_rel);
    }
    if (r.tag == t || (t == Tag::kv && r.tag == Tag::unknown)) tagged += r.size;
  }
  return tagged;
}

void ProgramSession::sleep_now() noexcept {
  if (forked_.load(std::memory_order_relaxed)) return;
  for_each_device([](int, Manager& m) { m.release_now(); });
}

Status ProgramSession::wake_now() noexcept {
  if (forked_.load(std::memory_order_relaxed)) return {};
  Status out;
  for_each_device([&](int, Manager& m) {
    m.access();
    if (Status st = m.unwired_status(); !st && out) out = st;
  });
  return out;
}

void ProgramSession::stand_aside(const std::string& why) noexcept {
  if (aside_.exchange(true, std::memory_order_acq_rel)) return;
  try {
    log_.warn(why + "; from now on its memory stays on the GPU (no sleep) and new allocations are the CUDA runtime's");
    MutexLock lock(mu_);
    for (const auto& owner : owners_) held_.push_back(owner->use());  // awake, and held for good
  } catch (...) {
  }
}

}  // namespace residency::cudapreload
