// SPDX-License-Identifier: MIT
// The cuda backend: the wake and sleep of one allocation, the writes an engine reports, and the
// background pinning of backups (cuda_backend.hpp says how the parts fit).
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>

#include "backends/cuda/cuda_backend.hpp"
#include "backends/cuda/cuda_process.hpp"
#include "backends/cuda/nvml.hpp"
#include "residency/text.hpp"

namespace residency::cuda {

CudaBackend::DeviceAllocation* CudaBackend::find(const void* base) {
  auto it = allocations_.find(static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(base)));
  return it == allocations_.end() ? nullptr : &it->second;
}

const CudaBackend::DeviceAllocation* CudaBackend::find(const void* base) const {
  auto it = allocations_.find(static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(base)));
  return it == allocations_.end() ? nullptr : &it->second;
}

PinSettings CudaBackend::pin_settings() const { return {backup_threads_.load(), pipeline_.load()}; }

void CudaBackend::say(const std::string& line) const {
  if (!notice_) return;
  try {
    notice_(line);
  } catch (...) {
    // the line is lost, nothing else
  }
}

// One line of the wake's timeline: where its time went (the budget's gate, mapping and queueing the
// copies, the copies themselves) and where the bytes came from.
void CudaBackend::trace_wake(const DeviceAllocation& a, bool restored, std::chrono::nanoseconds total,
                             std::chrono::nanoseconds queued, std::chrono::nanoseconds gated, std::uint64_t staged) const {
  std::uint64_t from_file = 0;
  const std::size_t n = link_.chunks_of(a.range.size);
  if (restored)
    for (std::size_t i = 0; i < n && i < a.files.from_file.size(); ++i)
      if (a.files.from_file[i] != 0) from_file += std::min(link_.chunk, a.range.size - i * link_.chunk);
  const std::uint64_t copied = restored ? a.range.size : 0;
  const auto msec = [](std::chrono::nanoseconds d) { return std::chrono::duration<double, std::milli>(d).count(); };
  const double mib = 1024.0 * 1024.0;
  char part[320];
  std::snprintf(part, sizeof part, "wake of %.2f MiB %s at %s: %.2f ms in all; mapped and queued in %.2f ms",
                static_cast<double>(a.range.size) / mib, to_string(a.cls), hex(a.range.va).c_str(), msec(total),
                msec(queued));
  std::string line = part;
  if (gated.count() > 0) {
    std::snprintf(part, sizeof part, " (%.2f ms of it waiting for the budget's room)", msec(gated));
    line += part;
  }
  if (copied == 0) {
    line += ", nothing to copy";
  } else {
    const double secs = std::chrono::duration<double>(total).count();
    std::snprintf(part, sizeof part,
                  ", copies done %.2f ms later (%.2f MiB from the model file's registered pages, %.2f MiB read from "
                  "the file through the staging buffers, %.2f MiB from pinned host memory; %.1f GB/s over the whole "
                  "wake)",
                  msec(total - queued), static_cast<double>(from_file - std::min(from_file, staged)) / mib,
                  static_cast<double>(staged) / mib, static_cast<double>(copied - from_file) / mib,
                  secs > 0 ? static_cast<double>(copied) / secs / 1e9 : 0.0);
    line += part;
  }
  line += "; " + device_figure();
  try {
    trace_(line);
  } catch (...) {
    // the line is lost, nothing else
  }
}

// For the timeline: what NVML says this process holds on the device (what nvidia-smi and a GPU
// budget's sampler see), against what its backends map.
std::string CudaBackend::device_figure() const {
  CudaProcess& process = CudaProcess::instance();
  const double mib = 1024.0 * 1024.0;
  char buf[160];
  std::string why;
  const std::optional<std::uint64_t> used = uuid_.empty() ? std::nullopt
                                                          : nvml_process_bytes(process.nvml(), uuid_, ::getpid(), &why);
  if (used)
    std::snprintf(buf, sizeof buf, "the process holds %.2f MiB on the device (NVML), %.2f MiB of it mapped here",
                  static_cast<double>(*used) / mib, static_cast<double>(process.mapped(link_.dev)) / mib);
  else
    std::snprintf(buf, sizeof buf, "the process maps %.2f MiB on the device (NVML unknown)",
                  static_cast<double>(process.mapped(link_.dev)) / mib);
  return buf;
}

void CudaBackend::trace_sleep(const DeviceAllocation& a, std::chrono::nanoseconds saved,
                              std::chrono::nanoseconds dropped, std::uint64_t copied) const {
  const auto msec = [](std::chrono::nanoseconds d) { return std::chrono::duration<double, std::milli>(d).count(); };
  const double mib = 1024.0 * 1024.0;
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "sleep of %.2f MiB %s at %s: saved in %.2f ms (%.2f MiB copied to the host; a first sleep also "
                "registers model files and pins backups), unmapped in %.2f ms; %s",
                static_cast<double>(a.range.size) / mib, to_string(a.cls), hex(a.range.va).c_str(), msec(saved),
                static_cast<double>(copied) / mib, msec(dropped), device_figure().c_str());
  try {
    trace_(buf);
  } catch (...) {
    // the line is lost, nothing else
  }
}

void CudaBackend::note_mapped(std::uint64_t bytes, bool added) {
  mapped_bytes_ = added ? mapped_bytes_ + bytes : mapped_bytes_ - bytes;
  CudaProcess::instance().note_mapped(link_.dev, bytes, added);
}

// Maps physical memory chunk by chunk and, for weights with a backup, starts each chunk's copy as
// soon as it is mapped, so the copies of early chunks overlap the mapping of later ones. On any
// failure everything mapped so far is unmapped again and the backup is left as it was: a failed
// wake loses nothing.
Status CudaBackend::wake(DeviceAllocation& a) {
  VmmRange& r = a.range;
  if (r.mapped) return {};
  const bool restore = a.cls == RegionClass::weights && a.backup.valid;
  if (restore) files_.mark_changed([this](const std::string& line) { say(line); });
  std::uint64_t staged = 0;  // bytes read from an unregistered model file through the staging ring
  int read_errno = 0;
  // (runs inside map(), under mu_, which the analysis cannot see into a lambda)
  auto fill = [&](std::size_t i, std::size_t off, std::size_t len) RESIDENCY_NO_THREAD_SAFETY_ANALYSIS -> CUresult {
    if (!restore || off >= r.size) return CUDA_SUCCESS;
    if (i < a.files.from_file.size() && a.files.from_file[i] != 0)
      return a.files.restore_chunk(link_, r, i, link_.stream(i), staging_, staged, read_errno);
    return link_.d->cuMemcpyHtoDAsync(r.va + off, a.backup.base + off, std::min(len, r.size - off), link_.stream(i));
  };
  // A paced wake: the budget makes room for each chunk (the copies queued so far go on meanwhile).
  // With a trace, the time the gate took is summed for the wake's timeline.
  using SteadyClock = std::chrono::steady_clock;
  const SteadyClock::time_point t0 = SteadyClock::now();
  SteadyClock::duration gated{};
  VmmRange::BeforeChunk before;
  const WakeGate gate = gate_;  // a copy: the lambda below runs inside map(), still under mu_
  if (gate && trace_) {
    before = [&](std::size_t bytes) {
      const SteadyClock::time_point g = SteadyClock::now();
      gate(bytes);
      gated += SteadyClock::now() - g;
    };
  } else if (gate) {
    before = gate;
  }
  // Not paced (no other holder gives way while it maps): a wake the device cannot hold fails at
  // once, before it maps and copies what it would throw away (on a full GPU that cost a switch
  // about 100 ms); the manager asks the other holders and tries again.
  if (!gate_) {
    std::size_t free_b = 0, total_b = 0;
    if (link_.d->cuMemGetInfo(&free_b, &total_b) == CUDA_SUCCESS && free_b < r.reserved) {
      if (trace_)
        trace_("wake of " + format_size(r.reserved) + " " + to_string(a.cls) + " at " + hex(r.va) + ": not begun, " +
               format_size(free_b) + " free on the device");
      return Status(ErrorCode::out_of_memory,
                    "cuda: out of device memory waking a " + format_size(r.size) + " " + to_string(a.cls) +
                        " allocation at " + hex(r.va) + ": " + format_size(free_b) + " free on the device, " +
                        format_size(r.reserved) + " needed; nothing was mapped" +
                        (restore ? " and the host backup is kept" : "") +
                        "; free device memory (other allocations or processes) and request residency again");
    }
  }
  VmmRange::MapFailure f;
  if (!r.map(link_, before, fill, f)) {
    const bool oom = f.result == CUDA_ERROR_OUT_OF_MEMORY;
    if (read_errno != 0) {
      (void)link_.sync();
      return Status(ErrorCode::backend_error, "cuda: reading the model file to wake a " + format_size(r.size) + " " +
                                                  to_string(a.cls) + " allocation at " + hex(r.va) + " failed (" +
                                                  std::strerror(read_errno) +
                                                  "); the partial mapping was rolled back and the memory stays asleep");
    }
    const std::string what = std::string(oom ? "out of device memory" : "mapping failed") + " waking a " +
                             format_size(r.size) + " " + to_string(a.cls) + " allocation at " + hex(r.va) + " after " +
                             format_size(f.offset) + "; the partial mapping was rolled back" +
                             (restore ? " and the host backup is kept" : "");
    Status s = link_.d->error(f.result, what, f.call);
    return Status(s.code(), s.message() + (oom ? "; free device memory (other allocations or processes) and "
                                                 "request residency again"
                                               : ""));
  }
  const SteadyClock::time_point mapped_at = SteadyClock::now();
  if (restore) {
    if (Status st = link_.sync(); !st) {
      r.unmap(link_);
      return st;
    }
    copied_to_device_ += r.size;
  }
  if (trace_) trace_wake(a, restore, SteadyClock::now() - t0, mapped_at - t0, gated, staged);
  if (staged != 0) {  // the host tier below "asleep" (an operator sees why this wake was slower)
    const double secs = std::chrono::duration<double>(SteadyClock::now() - t0).count();
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "woke %s of weights from host tier 2: %s read from the model file through the staging buffers "
                  "(its registration was given back to the host budget), %.2f ms, %.1f GB/s",
                  format_size(r.size).c_str(), format_size(staged).c_str(), secs * 1e3,
                  secs > 0 ? static_cast<double>(r.size) / secs / 1e9 : 0.0);
    if (info_) {
      try {
        info_(buf);
      } catch (...) {
      }
    }
  }
  if (a.tracked && restore) {
    // Written chunks are reported as they are written: the backup stays the contents until then.
    a.dirty.assign(a.dirty.size(), 0);
  } else {
    a.backup.valid = false;  // the engine may write from now on; the next sleep copies again
  }
  note_mapped(r.reserved, true);
  return {};
}

// Copies weights out, then unmaps and releases. The caller has synchronized the context, so
// kernels that were using the memory have finished. On a failure the allocation stays resident:
// nothing is released before the backup is whole.
Status CudaBackend::sleep(DeviceAllocation& a) {
  if (Status st = save(a); !st) return st;
  drop(a);
  return {};
}

void CudaBackend::drop(DeviceAllocation& a) {
  if (!a.range.mapped) return;
  a.range.unmap(link_);
  note_mapped(a.range.reserved, false);
}

Status CudaBackend::save(DeviceAllocation& a) {
  if (!a.range.mapped || a.cls != RegionClass::weights) return {};
  const std::size_t n = link_.chunks_of(a.range.size);
  if (a.tracked && !a.files.pieces.empty()) {
    const PinSettings pin = pin_settings();
    const Say tell = [this](const std::string& line) { say(line); };
    FileSleep sleep{link_, a.range, a.files, a.backup, a.dirty, files_, pin, tell, copied_to_host_};
    return sleep.run();
  }
  // Tracked and whole since its last sleep: only the chunks written since then are copied.
  const bool only_written = a.tracked && a.backup.valid && a.dirty.size() == n;
  a.backup.valid = false;
  if (a.backup.base == nullptr) {  // the first sleep builds the backup while it copies
    if (Status st = a.backup.pin(link_, a.range.va, a.range.size, /*copy=*/true, nullptr, pin_settings()); !st)
      return st;
    copied_to_host_ += a.range.size;
  } else if (Status st = copy_out(a, only_written); !st) {
    return st;
  }
  a.backup.valid = true;
  if (a.tracked) a.dirty.assign(n, 0);
  return {};
}

// Pieces of at most kCopyPiece, one in flight per stream: a call that begins meanwhile
// (interrupt_release) stops the copying within a piece's time per stream, and the allocation
// stays resident (its backup is then not valid, so the next sleep copies again).
Status CudaBackend::copy_out(DeviceAllocation& a, bool only_written) {
  const VmmRange& r = a.range;
  std::size_t k = 0;  // pieces issued
  for (std::size_t i = 0; i < link_.chunks_of(r.size); ++i) {
    if (only_written && a.dirty[i] == 0) continue;
    const std::size_t end = std::min(r.size, (i + 1) * link_.chunk);
    for (std::size_t off = i * link_.chunk; off < end; off += kCopyPiece, ++k) {
      CUstream stream = link_.stream(k);
      if (k >= link_.streams.size()) (void)link_.d->cuStreamSynchronize(stream);  // its previous piece
      if (interrupt_wanted()) {
        (void)link_.sync();
        return Status(ErrorCode::interrupted, "cuda: a call began; the release stopped while copying");
      }
      const std::size_t bytes = std::min(kCopyPiece, end - off);
      const CUresult res = link_.d->cuMemcpyDtoHAsync(a.backup.base + off, r.va + off, bytes, stream);
      if (res != CUDA_SUCCESS) {
        (void)link_.sync();
        return link_.d->error(res,
                              "copying weights at " + hex(r.va) + " to the host backup; the allocation stays resident",
                              "cuMemcpyDtoHAsync");
      }
      copied_to_host_ += bytes;
    }
  }
  if (Status st = link_.sync(); !st) return Status(st.code(), st.message() + "; the allocation stays resident");
  return {};
}

void CudaBackend::free_allocation(DeviceAllocation& a) {
  if (a.range.mapped) note_mapped(a.range.reserved, false);
  a.range.free(link_);
  a.files.free_gaps(link_);
  a.backup.free(link_);
}

void CudaBackend::drop_unused_files() {
  files_.drop_unused(link_, [this](const BackingFile* f) RESIDENCY_NO_THREAD_SAFETY_ANALYSIS {
    return std::any_of(allocations_.begin(), allocations_.end(), [f](const auto& kv) { return kv.second.files.uses(f); });
  });
}

// --- the writes an engine reports ---------------------------------------------------------

void CudaBackend::track_writes(void* base) {
  MutexLock lock(mu_);
  DeviceAllocation* a = find(base);
  if (a == nullptr || a->tracked) return;
  a->tracked = true;
  // Writes before now were not reported: unless asleep (its backup is its contents), the backup
  // is not valid until the next sleep copies everything.
  if (a->range.mapped) a->backup.valid = false;
  a->dirty.assign(link_.chunks_of(a->range.size), a->range.mapped ? 1 : 0);
}

CudaBackend::DeviceAllocation* CudaBackend::note_write(const void* addr, std::size_t bytes, std::size_t& first,
                                                       std::size_t& last) {
  const auto p = static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(addr));
  auto it = allocations_.upper_bound(p);
  if (it == allocations_.begin() || bytes == 0) return nullptr;
  --it;
  DeviceAllocation& a = it->second;
  const VmmRange& r = a.range;
  if (!a.tracked || p >= r.va + r.size || a.dirty.empty()) return nullptr;
  first = static_cast<std::size_t>(p - r.va);
  last = std::min(r.size, first + std::min(bytes, r.size - first));  // exclusive
  for (std::size_t i = first / link_.chunk; i * link_.chunk < last && i < a.dirty.size(); ++i) a.dirty[i] = 1;
  a.files.cut(first, last);  // no longer the file's bytes
  return &a;
}

void CudaBackend::written(const void* addr, std::size_t bytes) {
  MutexLock lock(mu_);
  std::size_t first = 0, last = 0;
  (void)note_write(addr, bytes, first, last);
}

void CudaBackend::filled_from_file(const void* addr, std::size_t bytes, int fd, std::uint64_t offset) {
  MutexLock lock(mu_);
  std::size_t first = 0, last = 0;
  DeviceAllocation* a = note_write(addr, bytes, first, last);
  if (a == nullptr || a->cls != RegionClass::weights) return;
  struct stat st {};
  if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size < 0 ||
      offset > static_cast<std::uint64_t>(st.st_size) || last - first > static_cast<std::uint64_t>(st.st_size) - offset)
    return;  // a write like any other
  BackingFile* file = files_.note(fd, st);
  if (file == nullptr || file->unusable || !file->unchanged()) return;
  a->files.add({first, last - first, file, offset});
}

// --- backups made ahead of the first sleep ------------------------------------------------

void CudaBackend::start_background_thread() {
  if (!bg_thread_.joinable()) bg_thread_ = std::thread([this] { background_loop(); });
}

void CudaBackend::queue_background_pin(CUdeviceptr va, std::uint64_t serial) {
  try {
    {
      MutexLock bg(bg_mu_);
      bg_queue_.emplace_back(va, serial);
    }
    start_background_thread();
    bg_cv_.notify_all();
  } catch (...) {
    // No thread or no memory for the queue: the first sleep pins the backup, as by default.
  }
}

void CudaBackend::background_loop() {
  ContextScope scope(*link_.d, link_.ctx);
  for (;;) {
    std::pair<CUdeviceptr, std::uint64_t> job;
    {
      MutexLock bg(bg_mu_);
      bg_busy_ = false;
      bg_cv_.notify_all();  // wait_background_backups
      bg.wait(bg_cv_, [this]() RESIDENCY_NO_THREAD_SAFETY_ANALYSIS {
        return bg_stop_ || !bg_queue_.empty() || prep_wanted_ || room_wanted_;
      });
      if (bg_stop_) return;
      if (bg_queue_.empty() && room_wanted_ && !prep_wanted_) {
        room_wanted_ = false;
        if (!scope.ok()) continue;
        room_running_ = true;
        bg.unlock();
        run_host_room();
        bg.lock();
        room_running_ = false;
        continue;
      }
      if (bg_queue_.empty()) {  // the pinnings queued first: a preparation may have queued some
        prep_wanted_ = false;
        if (!scope.ok()) continue;  // no context here: registering would fail and give the files up
        prep_running_ = true;
        bg.unlock();
        run_preparation();
        bg.lock();
        prep_running_ = false;
        continue;
      }
      job = bg_queue_.front();
      bg_queue_.pop_front();
      bg_busy_ = true;
    }
    VmmRange range;  // the allocation's addresses, read under mu_
    {
      MutexLock lock(mu_);
      auto it = allocations_.find(job.first);
      // A tracked allocation's first sleep decides what needs pinning (file pieces need none).
      if (it == allocations_.end() || it->second.serial != job.second || it->second.backup.base != nullptr ||
          it->second.tracked)
        continue;
      range.va = it->second.range.va;
      range.size = it->second.range.size;
    }
    // Pinning reads only its own backup and the link's constants (no copy is issued): the
    // engine's calls and the manager's go on meanwhile.
    PinnedBackup made;
    const Status st = scope.ok() ? made.pin(link_, range.va, range.size, /*copy=*/false, nullptr, pin_settings())
                                 : Status(ErrorCode::backend_error, "cuda: no context on the background thread");
    if (!st) {
      bg_failed_.fetch_add(1);
      continue;
    }
    MutexLock lock(mu_);
    auto it = allocations_.find(job.first);
    if (it != allocations_.end() && it->second.serial == job.second && it->second.backup.base == nullptr &&
        !it->second.tracked) {
      it->second.backup = std::move(made);
      bg_done_.fetch_add(1);
    } else {
      made.free(link_);  // freed meanwhile, or its first sleep pinned one of its own
    }
  }
}

// --- the first release, prepared ------------------------------------------------------------

namespace {
using SteadyClock = std::chrono::steady_clock;
double ms_since(SteadyClock::time_point t0) {
  return std::chrono::duration<double, std::milli>(SteadyClock::now() - t0).count();
}
}  // namespace

Backend::Preparation CudaBackend::prepare_release(std::function<bool()> stop) {
  MutexLock lock(mu_);
  // Weights-class memory the engine does not report writes to (the KV cache) sleeps in a backup
  // of its own size: pinned whole, as right after allocation (Backup::after_allocation).
  bool queued = false;
  for (auto& [va, a] : allocations_) {
    if (a.cls != RegionClass::weights || a.tracked || a.backup.base != nullptr || !a.range.mapped || a.prepare_tried)
      continue;
    a.prepare_tried = true;
    queue_background_pin(va, a.serial);
    queued = true;
  }
  if (!queued && !preparation_left()) return Preparation::nothing;
  try {
    {
      MutexLock bg(bg_mu_);
      prep_stop_ = std::move(stop);
      prep_wanted_ = true;
    }
    start_background_thread();
  } catch (...) {
    return Preparation::nothing;  // no thread: the first release does it, as without
  }
  bg_cv_.notify_all();
  return Preparation::started;
}

void CudaBackend::stop_preparation() {
  MutexLock bg(bg_mu_);
  prep_stop_ = nullptr;
  prep_wanted_ = false;
  bg.wait(bg_cv_, [this]() RESIDENCY_NO_THREAD_SAFETY_ANALYSIS { return !prep_running_; });
}

bool CudaBackend::preparation_stopped() {
  MutexLock bg(bg_mu_);
  if (bg_stop_ || !prep_stop_) return true;
  try {
    return prep_stop_();
  } catch (...) {
    return true;
  }
}

// What a first release would do that is not done yet: files to register, chunks of tracked
// weights that do not sleep in files and have no pinned backup.
bool CudaBackend::preparation_left() {
  if (!files_.unregistered(/*with_held_back=*/false).empty()) return true;
  for (const auto& [va, a] : allocations_) {
    if (!a.tracked || a.files.pieces.empty() || !a.range.mapped || a.prepare_tried) continue;
    const std::vector<std::uint8_t> in_file = chunks_in_files(link_, a.range.size, a.files.pieces);
    for (std::size_t i = 0; i < in_file.size(); ++i)
      if (in_file[i] == 0 && (i >= a.backup.pinned.size() || a.backup.pinned[i] == 0)) return true;
  }
  return false;
}

bool CudaBackend::prepare_step() {
  const Say tell = [this](const std::string& line) { say(line); };
  // Files the host budget held back wait for a sleep (which asks for room off its path).
  const std::vector<BackingFile*> files = files_.unregistered(/*with_held_back=*/false);
  if (!files.empty()) {
    (void)files_.register_pieces(link_, *files.front(), tell, backup_threads_.load());
    return true;
  }
  for (auto& [va, a] : allocations_) {
    if (!a.tracked || a.files.pieces.empty() || !a.range.mapped || a.prepare_tried) continue;
    const std::vector<std::uint8_t> in_file = chunks_in_files(link_, a.range.size, a.files.pieces);
    for (std::size_t i = 0; i < in_file.size(); ++i) {
      if (in_file[i] != 0 || (i < a.backup.pinned.size() && a.backup.pinned[i] != 0)) continue;
      std::vector<std::uint8_t> need(in_file.size(), 0);
      need[i] = 1;
      // A failure (no pinned memory) leaves the chunk to the first sleep, which says why.
      if (!a.backup.pin(link_, a.range.va, a.range.size, /*copy=*/false, &need, pin_settings())) a.prepare_tried = true;
      return true;
    }
  }
  return false;
}

void CudaBackend::run_preparation() {
  prep_runs_.fetch_add(1);
  const SteadyClock::time_point t0 = SteadyClock::now();
  const std::uint64_t before = registered_file_bytes();
  std::uint64_t steps = 0;
  bool stopped = false, more = true;
  while (more) {
    if (preparation_stopped()) {
      stopped = true;
      break;
    }
    MutexLock lock(mu_);
    more = prepare_step();
    if (more) ++steps;
  }
  prep_steps_.fetch_add(steps);
  if (trace_ && steps > 0) {
    const std::uint64_t after = registered_file_bytes();
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "the first release prepared in the background: %.2f MiB of model files registered in %.2f ms "
                  "(%llu steps)%s",
                  static_cast<double>(after - std::min(after, before)) / (1024.0 * 1024.0), ms_since(t0),
                  static_cast<unsigned long long>(steps), stopped ? ", stopped by a use; the next idle goes on" : "");
    try {
      trace_(buf);
    } catch (...) {
    }
  }
}

std::uint64_t CudaBackend::unregister_files() {
  MutexLock lock(mu_);
  ContextScope scope(*link_.d, link_.ctx);
  return files_.unregister_all(link_);
}

// --- the host tier --------------------------------------------------------------------------

std::uint64_t CudaBackend::drop_file_registrations() {
  drops_.fetch_add(1);  // a registration the background thread makes stops at its next step
  {
    MutexLock bg(bg_mu_);
    room_wanted_ = false;  // asked for room: this holder does not ask for it back until its next sleep
  }
  return unregister_files();
}

void CudaBackend::queue_host_room() {
  try {
    {
      MutexLock bg(bg_mu_);
      room_wanted_ = true;
    }
    start_background_thread();
    bg_cv_.notify_all();
  } catch (...) {
    // No thread: the weights wake through the staging ring until a sleep finds room.
  }
}

// On the background thread, holding neither lock while the gate may wait: room for what the files
// lack (the host budget's holder idle longest is asked), then the pieces, one step under mu_ at a
// time, until done, a wake (which would otherwise wait for a step) or a drop.
void CudaBackend::run_host_room() {
  room_runs_.fetch_add(1);
  const std::uint64_t wakes = wakes_.load(), drops = drops_.load();
  HostGate gate;
  std::uint64_t want = 0, file = 0;
  {
    MutexLock lock(mu_);
    gate = host_gate_;
    want = files_.unregistered_bytes();
    const std::vector<BackingFile*> files = files_.unregistered();
    if (files.size() == 1) file = files.front()->key();  // several: 0, the bytes are this holder's own
  }
  if (!gate.reserve || want == 0) return;
  const SteadyClock::time_point t0 = SteadyClock::now();
  if (!gate.reserve(want, /*may_wait=*/true, file)) return;  // the tier says so; the next sleep tries again
  room_granted_.fetch_add(1);
  const double room_ms = ms_since(t0);
  const Say tell = [this](const std::string& line) { say(line); };
  std::uint64_t done = 0;
  for (;;) {
    MutexLock lock(mu_);
    if (wakes_.load() != wakes || drops_.load() != drops) break;
    const std::vector<BackingFile*> files = files_.unregistered();
    if (files.empty()) break;
    const std::uint64_t before = files_.registered_bytes();
    const BackingFiles::Step st = files_.register_pieces(link_, *files.front(), tell, backup_threads_.load());
    done += files_.registered_bytes() - std::min(before, files_.registered_bytes());
    if (st == BackingFiles::Step::held_back || st == BackingFiles::Step::failed) break;
  }
  {
    MutexLock lock(mu_);
    (void)files_.take_held_back();  // a refusal here is not a sleep's: no new run for it
  }
  if (trace_) {
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "host tier: room made for %.2f MiB of model files in %.2f ms, %.2f MiB registered in %.2f ms in "
                  "all (the next wake copies them at the link's rate)",
                  static_cast<double>(want) / (1024.0 * 1024.0), room_ms, static_cast<double>(done) / (1024.0 * 1024.0),
                  ms_since(t0));
    try {
      trace_(buf);
    } catch (...) {
    }
  }
}

bool CudaBackend::wait_host_room(int timeout_ms) {
  MutexLock bg(bg_mu_);
  return bg.wait_for(bg_cv_, std::chrono::milliseconds(timeout_ms), [this]() RESIDENCY_NO_THREAD_SAFETY_ANALYSIS {
    return bg_stop_ || (!room_wanted_ && !room_running_);
  });
}

std::uint64_t CudaBackend::staged_bytes() const {
  MutexLock lock(mu_);
  return staging_.bytes();
}

std::uint64_t CudaBackend::registered_file_bytes() const {
  MutexLock lock(mu_);
  return files_.registered_bytes();
}

bool CudaBackend::wait_preparation(int timeout_ms) {
  MutexLock bg(bg_mu_);
  return bg.wait_for(bg_cv_, std::chrono::milliseconds(timeout_ms), [this]() RESIDENCY_NO_THREAD_SAFETY_ANALYSIS {
    return bg_stop_ || (!prep_wanted_ && !prep_running_ && bg_queue_.empty() && !bg_busy_);
  });
}

bool CudaBackend::wait_background_backups(int timeout_ms) {
  MutexLock bg(bg_mu_);
  return bg.wait_for(bg_cv_, std::chrono::milliseconds(timeout_ms), [this]() RESIDENCY_NO_THREAD_SAFETY_ANALYSIS {
    return bg_stop_ || (bg_queue_.empty() && !bg_busy_);
  });
}

Status CudaBackend::prepare_backup(const void* base) {
  MutexLock lock(mu_);
  DeviceAllocation* a = find(base);
  if (a == nullptr)
    return Status(ErrorCode::not_found, "cuda: prepare_backup of " + hex(reinterpret_cast<std::uintptr_t>(base)) +
                                            ", which this cuda backend did not allocate (or freed)");
  if (a->cls != RegionClass::weights || a->backup.base != nullptr) return {};
  ContextScope scope(*link_.d, link_.ctx);
  if (!scope.ok()) return Status(ErrorCode::backend_error, "cuda: cannot make the primary context current");
  return a->backup.pin(link_, a->range.va, a->range.size, /*copy=*/false, nullptr, pin_settings());
}

}  // namespace residency::cuda
