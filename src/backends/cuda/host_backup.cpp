// SPDX-License-Identifier: MIT
#include "backends/cuda/host_backup.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "backends/cuda/cuda_process.hpp"
#include "platform/thread_annotations.hpp"
#include "residency/text.hpp"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older headers lack the name
#endif

namespace residency::cuda {
namespace {

// Transparent huge pages are 2 MiB on x86-64 and on arm64 with 4 KiB pages: the backup is aligned
// to that, so that every chunk (a multiple of the 2 MiB device granularity) is made of whole huge
// pages, which fault in and pin several times faster than 4 KiB pages.
constexpr std::size_t kHugePage = std::size_t{2} << 20;
// The unit of faulting-in work a host thread takes: small enough that a chunk's pages are faulted
// in by many threads at once (so the first copy starts early), large enough that the hand-out
// costs nothing.
constexpr std::size_t kFaultSlice = std::size_t{16} << 20;
constexpr int kDefaultMaxBackupThreads = 16;

// `bytes` of anonymous memory aligned to kHugePage and advised for huge pages; null and errno set
// on failure.
char* map_aligned(std::size_t bytes) {
  // Reserve 2 MiB more than needed, keep the 2 MiB-aligned part of exactly `bytes`.
  void* raw = mmap(nullptr, bytes + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const auto raw_addr = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t start = round_up(raw_addr, kHugePage);
  if (start > raw_addr) (void)munmap(raw, start - raw_addr);
  const std::uintptr_t end = start + bytes;
  if (raw_addr + bytes + kHugePage > end)
    (void)munmap(reinterpret_cast<void*>(end), raw_addr + bytes + kHugePage - end);
  char* base = reinterpret_cast<char*>(start);
  (void)madvise(base, bytes, MADV_HUGEPAGE);  // a hint: without THP the backup is made of 4 KiB pages
  return base;
}

// One call of PinnedBackup::pin(): the pipeline of a first sleep. Host threads fault the memory in,
// handed out in kFaultSlice pieces in address order; with pipeline `workers` the thread that
// faults in a chunk's last piece registers the chunk; with `registrar` the calling thread
// registers each chunk as soon as all its pieces are in. The calling thread takes the chunks in
// order and issues each one's copy as soon as it is registered, so chunk k copies while chunk k+1
// is registered and later chunks are faulted in. Registration is per chunk, and so is every later
// copy (never across two registrations).
class Pinning {
 public:
  Pinning(const DeviceLink& link, PinnedBackup& backup, CUdeviceptr va, std::size_t size, bool copy,
          const std::vector<std::uint8_t>* need, const PinSettings& settings)
      : link_(link), b_(backup), va_(va), size_(size), copy_(copy), need_(need), settings_(settings) {
    what_ = "pinning a " + format_size(size) + " host backup for the weights at " + hex(va);
  }
  Status run();

 private:
  static constexpr std::uint8_t kFaulted = 1, kRegistered = 2;
  struct Slice {
    std::size_t chunk, off, len;
  };
  bool wanted(std::size_t i) const {
    return (need_ == nullptr || (i < need_->size() && (*need_)[i] != 0)) && (i >= b_.pinned.size() || b_.pinned[i] == 0);
  }
  std::size_t chunk_len(std::size_t i) const { return std::min(link_.chunk, mapped_ - i * link_.chunk); }
  Status map_fresh();
  void plan();
  void start_threads();
  void worker();
  void fail(Status s) RESIDENCY_EXCLUDES(m_);
  bool register_chunk(std::size_t i);
  void issue_in_order() RESIDENCY_EXCLUDES(m_);
  Status finish() RESIDENCY_EXCLUDES(m_);

  const DeviceLink& link_;
  PinnedBackup& b_;
  const CUdeviceptr va_;
  const std::size_t size_;
  const bool copy_;
  const std::vector<std::uint8_t>* const need_;
  const PinSettings settings_;
  std::string what_;
  const std::string kept_ =
      "; the partial backup was rolled back (unregistered and unmapped) and the allocation stays resident, nothing "
      "is lost; free host memory and release again";
  bool fresh_ = false;
  char* base_ = nullptr;
  std::size_t mapped_ = 0, n_ = 0;
  std::vector<Slice> slices_;
  std::unique_ptr<std::atomic<std::size_t>[]> left_;  // per chunk: its slices not yet faulted in
  std::atomic<std::size_t> next_{0};                  // the next slice to hand out
  std::atomic<bool> failed_{false};
  std::vector<std::thread> threads_;
  Mutex m_;
  std::condition_variable cv_;
  std::vector<std::uint8_t> state_ RESIDENCY_GUARDED_BY(m_);  // per chunk: 0, kFaulted, kRegistered
  Status failure_ RESIDENCY_GUARDED_BY(m_);                   // the first failure
};

// The mapping is made once (its pages cost nothing until a chunk is faulted in); a later call pins
// more chunks of it.
Status Pinning::map_fresh() {
  fresh_ = b_.base == nullptr;
  mapped_ = round_up(size_, host_page());
  base_ = b_.base;
  if (!fresh_) return {};
  base_ = map_aligned(mapped_);
  if (base_ != nullptr) return {};
  const int e = errno;
  return Status(e == ENOMEM ? ErrorCode::out_of_memory : ErrorCode::backend_error,
                "cuda: " + what_ + ": mmap of " + format_size(mapped_) + " failed: " + std::strerror(e) +
                    "; the allocation stays resident (nothing is lost); free host memory and release again");
}

void Pinning::plan() {
  n_ = link_.chunks_of(mapped_);
  left_.reset(new std::atomic<std::size_t>[n_]);
  for (std::size_t i = 0; i < n_; ++i) {
    left_[i].store(0);
    if (!wanted(i)) continue;
    const std::size_t coff = i * link_.chunk, clen = chunk_len(i);
    std::size_t count = 0;
    for (std::size_t o = 0; o < clen; o += kFaultSlice, ++count)
      slices_.push_back({i, coff + o, std::min(kFaultSlice, clen - o)});
    left_[i].store(count);
  }
  MutexLock lock(m_);
  state_.assign(n_, 0);
}

void Pinning::fail(Status s) {
  MutexLock lock(m_);
  if (failure_) failure_ = std::move(s);
  failed_.store(true);
  cv_.notify_all();
}

bool Pinning::register_chunk(std::size_t i) {
  const CUresult r = link_.d->cuMemHostRegister(base_ + i * link_.chunk, chunk_len(i), CU_MEMHOSTREGISTER_PORTABLE);
  if (r != CUDA_SUCCESS) {
    Status s = link_.d->error(r, what_ + " (chunk " + std::to_string(i + 1) + " of " + std::to_string(n_) + ")",
                              "cuMemHostRegister");
    fail(Status(s.code(), s.message() + kept_));
    return false;
  }
  MutexLock lock(m_);
  state_[i] = kRegistered;
  cv_.notify_all();
  return true;
}

void Pinning::worker() {
  ContextScope scope(*link_.d, link_.ctx);
  if (!scope.ok()) {
    fail(Status(ErrorCode::backend_error, "cuda: " + what_ + ": cannot make the primary context current on a host thread"));
    return;
  }
  while (!failed_.load(std::memory_order_relaxed)) {
    const std::size_t t = next_.fetch_add(1);
    if (t >= slices_.size()) return;
    const Slice& sl = slices_[t];
    if (const int e = fault_in(base_ + sl.off, sl.len); e != 0) {
      fail(Status(e == ENOMEM ? ErrorCode::out_of_memory : ErrorCode::backend_error,
                  "cuda: " + what_ + ": faulting in host memory at offset " + format_size(sl.off) +
                      " failed: " + std::strerror(e) + kept_));
      return;
    }
    if (left_[sl.chunk].fetch_sub(1) != 1) continue;
    if (settings_.pipeline == BackupPipeline::workers) {  // the chunk's last piece: registered here
      if (!register_chunk(sl.chunk)) return;
      continue;
    }
    MutexLock lock(m_);
    state_[sl.chunk] = kFaulted;  // the calling thread registers it
    cv_.notify_all();
  }
}

void Pinning::start_threads() {
  const auto count = std::min<std::size_t>(static_cast<std::size_t>(std::clamp(settings_.threads, 1, 64)), slices_.size());
  threads_.reserve(count);
  for (std::size_t i = 0; i < count; ++i) {
    try {
      threads_.emplace_back([this] { worker(); });
    } catch (const std::exception&) {
      if (threads_.empty())
        fail(Status(ErrorCode::backend_error, "cuda: " + what_ + ": cannot start a host thread" + kept_));
      break;  // fewer threads: slower, not wrong
    }
  }
}

// Registers (pipeline registrar) and copies in chunk order as chunks become ready (without `copy`,
// only registers or waits).
void Pinning::issue_in_order() {
  for (std::size_t i = 0; i < n_; ++i) {
    if (!wanted(i)) continue;
    std::uint8_t state = 0;
    {
      MutexLock lock(m_);
      lock.wait(cv_, [&]() RESIDENCY_NO_THREAD_SAFETY_ANALYSIS { return state_[i] != 0 || failed_.load(); });
      if (failed_.load() || state_[i] == 0) return;
      state = state_[i];
    }
    if (state == kFaulted && !register_chunk(i)) return;
    const std::size_t off = i * link_.chunk;
    if (!copy_ || off >= size_) continue;
    const CUresult r = link_.d->cuMemcpyDtoHAsync(base_ + off, va_ + off, std::min(link_.chunk, size_ - off),
                                                  link_.stream(i));
    if (r != CUDA_SUCCESS) {
      Status s = link_.d->error(r, "copying weights at " + hex(va_) + " to the host backup while " + what_,
                                "cuMemcpyDtoHAsync");
      fail(Status(s.code(), s.message() + kept_));
      return;
    }
  }
}

Status Pinning::finish() {
  for (auto& t : threads_) t.join();
  if (!failed_.load() && copy_) {
    if (Status st = link_.sync(); !st) fail(Status(st.code(), st.message() + kept_));
  }
  MutexLock lock(m_);
  if (failed_.load()) {
    (void)link_.sync();  // no copy may still target memory that goes away
    for (std::size_t i = 0; i < n_; ++i)
      if (state_[i] == kRegistered) (void)link_.d->cuMemHostUnregister(base_ + i * link_.chunk);
    if (fresh_) {
      (void)munmap(base_, mapped_);
    } else {
      for (std::size_t i = 0; i < n_; ++i)
        if (wanted(i)) (void)madvise(base_ + i * link_.chunk, chunk_len(i), MADV_DONTNEED);
    }
    return failure_;
  }
  b_.pinned.resize(n_, 0);
  for (std::size_t i = 0; i < n_; ++i)
    if (state_[i] == kRegistered) b_.pinned[i] = 1;
  b_.base = base_;
  b_.mapped = mapped_;
  return {};
}

Status Pinning::run() {
  if (Status st = map_fresh(); !st) return st;
  plan();
  start_threads();
  issue_in_order();
  return finish();
}

}  // namespace

std::size_t host_page() {
  const long p = sysconf(_SC_PAGESIZE);
  return p > 0 ? static_cast<std::size_t>(p) : 4096;
}

int fault_in(char* p, std::size_t len) {
  std::atomic<bool>& populate = CudaProcess::instance().populate_write;
  if (populate.load(std::memory_order_relaxed)) {
    for (;;) {
      if (madvise(p, len, MADV_POPULATE_WRITE) == 0) return 0;
      if (errno == EINTR || errno == EAGAIN) continue;
      if (errno != EINVAL) return errno;
      populate.store(false, std::memory_order_relaxed);
      break;
    }
  }
  const std::size_t page = host_page();
  for (std::size_t off = 0; off < len; off += page) static_cast<volatile char*>(p)[off] = 0;
  return 0;
}

int default_backup_threads() {
  const int hw = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(hw <= 0 ? 4 : hw / 2, 1, kDefaultMaxBackupThreads);
}

Status PinnedBackup::pin(const DeviceLink& link, CUdeviceptr va, std::size_t size, bool copy,
                         const std::vector<std::uint8_t>* need, const PinSettings& settings) {
  Pinning p(link, *this, va, size, copy, need, settings);
  return p.run();
}

void PinnedBackup::unpin_chunk(const DeviceLink& link, std::size_t i) {
  if (i >= pinned.size() || pinned[i] == 0) return;
  const std::size_t off = i * link.chunk;
  (void)link.d->cuMemHostUnregister(base + off);
  (void)madvise(base + off, std::min(link.chunk, mapped - off), MADV_DONTNEED);
  pinned[i] = 0;
}

void PinnedBackup::free(const DeviceLink& link) {
  if (base == nullptr) return;
  for (std::size_t i = 0; i < link.chunks_of(mapped) && i < pinned.size(); ++i)
    if (pinned[i] != 0) (void)link.d->cuMemHostUnregister(base + i * link.chunk);
  (void)munmap(base, mapped);
  base = nullptr;
  mapped = 0;
  valid = false;
  pinned.clear();
}

std::uint64_t PinnedBackup::pinned_bytes(const DeviceLink& link) const {
  std::uint64_t n = 0;
  for (std::size_t i = 0; i < pinned.size(); ++i)
    if (pinned[i] != 0) n += std::min(link.chunk, mapped - i * link.chunk);
  return n;
}

}  // namespace residency::cuda
