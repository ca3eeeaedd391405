// SPDX-License-Identifier: MIT
#include "backends/cuda/file_backing.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>

#include "backends/cuda/driver.hpp"
#include "residency/text.hpp"

namespace residency::cuda {
namespace {

std::int64_t stat_mtime_ns(const struct stat& st) {
  return static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

// The first piece that ends after `off`.
template <typename Pieces>
auto first_piece_after(Pieces& pieces, std::size_t off) {
  return std::lower_bound(pieces.begin(), pieces.end(), off,
                          [](const FileBacked::Piece& x, std::size_t o) { return x.off + x.len <= o; });
}

}  // namespace

// --- the files ----------------------------------------------------------------------------

bool BackingFile::unchanged() const {
  struct stat st {};
  if (fstat(fd, &st) != 0) return false;
  return st.st_dev == dev && st.st_ino == ino && st.st_size == size && stat_mtime_ns(st) == mtime_ns;
}

BackingFiles::~BackingFiles() {
  for (auto& [key, f] : files_)
    if (f->fd >= 0) (void)close(f->fd);
}

BackingFile* BackingFiles::note(int fd, const struct stat& st) {
  auto key = std::make_pair(st.st_dev, st.st_ino);
  if (auto f = files_.find(key); f != files_.end()) return f->second.get();
  auto file = std::make_unique<BackingFile>();
  file->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (file->fd < 0) return nullptr;
  char link[64];
  std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  char path[4096];
  const ssize_t len = readlink(link, path, sizeof path - 1);
  file->name = len > 0 ? std::string(path, static_cast<std::size_t>(len))
                       : "the model file (fd " + std::to_string(fd) + ")";
  file->dev = st.st_dev;
  file->ino = st.st_ino;
  file->size = st.st_size;
  file->mtime_ns = stat_mtime_ns(st);
  return files_.emplace(key, std::move(file)).first->second.get();
}

std::uint64_t BackingFile::key() const {
  std::uint64_t x = static_cast<std::uint64_t>(dev) * 0x9e3779b97f4a7c15ull ^ static_cast<std::uint64_t>(ino);
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x == 0 || x == ~std::uint64_t{0} ? 1 : x;
}

bool BackingFile::whole() const {
  return map != nullptr && std::all_of(registered.begin(), registered.end(), [](std::uint8_t r) { return r != 0; });
}

namespace {
// The bytes piece k of a mapping of `map_len` bytes registers.
std::size_t piece_len(std::size_t map_len, std::size_t k) {
  return std::min(kRegisterPiece, map_len - k * kRegisterPiece);
}
}  // namespace

// Only for a file that is not whole: no weights sleep in it, so its mapping can go.
void BackingFiles::give_up(const DeviceLink& link, BackingFile& f, const std::string& why, const Say& say) {
  (void)unregister(link, f);
  f.unusable = true;
  say(why + "; the weights filled from it are backed up in pinned host memory instead");
}

BackingFiles::Step BackingFiles::register_pieces(const DeviceLink& link, BackingFile& f, const Say& say, int parallel) {
  if (f.unusable) return Step::failed;
  if (f.map == nullptr) {
    if (!f.unchanged()) {
      give_up(link, f, f.name + " changed since the weights were loaded from it (size or modification time)", say);
      return Step::failed;
    }
    const std::size_t len = round_up(static_cast<std::size_t>(f.size), host_page());
    void* m = mmap(nullptr, len, PROT_READ, MAP_SHARED, f.fd, 0);
    if (m == MAP_FAILED) {
      give_up(link, f, "cannot map " + f.name + " (" + std::strerror(errno) + ")", say);
      return Step::failed;
    }
    f.map = static_cast<char*>(m);
    f.map_len = len;
    f.registered.assign((len + kRegisterPiece - 1) / kRegisterPiece, 0);
  }
  std::vector<std::size_t> todo;
  std::uint64_t todo_bytes = 0;
  for (std::size_t k = 0; k < f.registered.size() && todo.size() < static_cast<std::size_t>(std::max(1, parallel)); ++k)
    if (f.registered[k] == 0) todo.push_back(k), todo_bytes += piece_len(f.map_len, k);
  if (todo.empty()) return Step::done;
  // The host tier: room in the host budget first (never a wait here: a sleep's locks are held).
  if (gate_ != nullptr && gate_->reserve && !gate_->reserve(todo_bytes, /*may_wait=*/false, f.key())) {
    f.held_back = true;
    held_back_ = true;
    return Step::held_back;
  }
  f.held_back = false;
  // One host thread per piece (the driver pins each piece's pages on the calling thread); the
  // first piece on this one.
  std::vector<CUresult> res(todo.size(), CUDA_SUCCESS);
  auto reg = [&](std::size_t j) {
    const std::size_t k = todo[j];
    res[j] = link.d->cuMemHostRegister(f.map + k * kRegisterPiece, piece_len(f.map_len, k),
                                       CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_READ_ONLY);
  };
  std::vector<std::thread> threads;
  for (std::size_t j = 1; j < todo.size(); ++j) {
    try {
      threads.emplace_back([&, j] {
        ContextScope scope(*link.d, link.ctx);
        if (scope.ok()) reg(j);
        else res[j] = CUDA_ERROR_INVALID_CONTEXT;
      });
    } catch (...) {
      reg(j);  // no thread: here
    }
  }
  reg(0);
  for (std::thread& t : threads) t.join();
  CUresult failed = CUDA_SUCCESS;
  std::uint64_t not_registered = 0;
  for (std::size_t j = 0; j < todo.size(); ++j) {
    if (res[j] == CUDA_SUCCESS) f.registered[todo[j]] = 1;
    else failed = res[j], not_registered += piece_len(f.map_len, todo[j]);
  }
  if (not_registered != 0 && gate_ != nullptr && gate_->give_back) gate_->give_back(not_registered);
  if (failed != CUDA_SUCCESS) {
    give_up(link, f,
            "cannot register " + f.name + " read-only with the GPU (" +
                link.d->error(failed, "", "cuMemHostRegister").message() + ")",
            say);
    return Step::failed;
  }
  return f.whole() ? Step::done : Step::more;
}

bool BackingFiles::ready(const DeviceLink& link, BackingFile& f, const Say& say, int parallel) {
  if (f.unusable) return false;
  if (f.held_back && f.unchanged()) return true;  // asked once this sleep (begin_sleep() clears it)
  if (!f.unchanged()) {
    const std::string why = f.name + " changed since the weights were loaded from it (size or modification time)";
    if (!f.whole()) {
      give_up(link, f, why, say);  // nothing sleeps in a file not yet whole
    } else {
      f.unusable = true;  // weights asleep in it keep its mapping until they wake (mark_changed)
      say(why + "; the weights filled from it are backed up in pinned host memory instead");
    }
    return false;
  }
  for (;;) {
    switch (register_pieces(link, f, say, parallel)) {
      case Step::more: continue;
      case Step::done: return true;
      case Step::held_back: return true;  // the rest is read through the staging ring at a wake
      case Step::failed: return false;
    }
  }
}

std::uint64_t BackingFiles::registered_bytes() const {
  std::uint64_t n = 0;
  for (const auto& [key, f] : files_)
    for (std::size_t k = 0; k < f->registered.size(); ++k)
      if (f->registered[k] != 0) n += piece_len(f->map_len, k);
  return n;
}

std::uint64_t BackingFiles::unregister(const DeviceLink& link, BackingFile& f) {
  if (f.map == nullptr) return 0;
  std::uint64_t n = 0;
  for (std::size_t k = 0; k < f.registered.size(); ++k)
    if (f.registered[k] != 0) {
      (void)link.d->cuMemHostUnregister(f.map + k * kRegisterPiece);
      n += piece_len(f.map_len, k);
    }
  (void)munmap(f.map, f.map_len);
  f.map = nullptr;
  f.map_len = 0;
  f.registered.clear();
  if (n != 0 && gate_ != nullptr && gate_->give_back) gate_->give_back(n);
  return n;
}

std::uint64_t BackingFiles::unregister_all(const DeviceLink& link) {
  std::uint64_t n = 0;
  for (auto& [key, f] : files_) n += unregister(link, *f);
  return n;
}

std::vector<BackingFile*> BackingFiles::unregistered(bool with_held_back) {
  std::vector<BackingFile*> out;
  for (auto& [key, f] : files_)
    if (!f->unusable && !f->whole() && (with_held_back || !f->held_back)) out.push_back(f.get());
  return out;
}

void BackingFiles::begin_sleep() {
  for (auto& [key, f] : files_) f->held_back = false;
}

std::uint64_t BackingFiles::unregistered_bytes() {
  std::uint64_t n = 0;
  for (BackingFile* f : unregistered()) {
    if (f->map == nullptr) {
      n += round_up(static_cast<std::size_t>(f->size), host_page());
      continue;
    }
    for (std::size_t k = 0; k < f->registered.size(); ++k)
      if (f->registered[k] == 0) n += piece_len(f->map_len, k);
  }
  return n;
}

void BackingFiles::mark_changed(const Say& say) {
  for (auto& [key, f] : files_) {
    if (f->unusable || f->unchanged()) continue;  // (mapped or not: an unregistered file is read at a wake)
    f->unusable = true;
    say(f->name +
        " changed while the weights filled from it slept (size or modification time); they are restored from it as "
        "it is now, which may differ from what was loaded; replace a model file by renaming a new one over it, never "
        "by writing into it, while a server uses it");
  }
}

void BackingFiles::drop_unused(const DeviceLink& link, const std::function<bool(const BackingFile*)>& used) {
  for (auto it = files_.begin(); it != files_.end();) {
    if (used(it->second.get())) {
      ++it;
      continue;
    }
    BackingFile& f = *it->second;
    (void)unregister(link, f);
    if (f.fd >= 0) (void)close(f.fd);
    it = files_.erase(it);
  }
}

// --- one allocation's pieces --------------------------------------------------------------

void Gaps::free(const DeviceLink& link) {
  if (buf != nullptr) {
    (void)link.d->cuMemHostUnregister(buf);
    (void)munmap(buf, mapped);
  }
  *this = Gaps{};
}

void FileBacked::add(const Piece& p) {
  auto at = std::lower_bound(pieces.begin(), pieces.end(), p.off,
                             [](const Piece& x, std::size_t off) { return x.off < off; });
  pieces.insert(at, p);
}

void FileBacked::cut(std::size_t begin, std::size_t end) {
  if (pieces.empty() || begin >= end) return;
  std::vector<Piece> kept;
  kept.reserve(pieces.size() + 1);
  for (const Piece& x : pieces) {
    const std::size_t xe = x.off + x.len;
    if (xe <= begin || x.off >= end) {
      kept.push_back(x);
      continue;
    }
    if (x.off < begin) kept.push_back(Piece{x.off, begin - x.off, x.file, x.file_off});
    if (xe > end) kept.push_back(Piece{end, xe - end, x.file, x.file_off + (end - x.off)});
  }
  pieces = std::move(kept);
}

bool FileBacked::uses(const BackingFile* f) const {
  return std::any_of(pieces.begin(), pieces.end(), [f](const Piece& p) { return p.file == f; });
}

std::uint64_t FileBacked::bytes_in_files(std::size_t chunk) const {
  std::uint64_t n = 0;
  for (const Piece& p : pieces) {
    for (std::size_t i = p.off / chunk; i * chunk < p.off + p.len && i < from_file.size(); ++i) {
      if (from_file[i] == 0) continue;
      n += std::min(p.off + p.len, (i + 1) * chunk) - std::max(p.off, i * chunk);
    }
  }
  return n;
}

// The chunk's file pieces, clipped to it, then its gaps.
CUresult FileBacked::restore_chunk(const DeviceLink& link, const VmmRange& range, std::size_t i, CUstream stream,
                                   StagingRing& ring, std::uint64_t& staged, int& read_errno) const {
  const std::size_t cb = i * link.chunk;
  const std::size_t ce = std::min(cb + link.chunk, range.size);
  for (auto it = first_piece_after(pieces, cb); it != pieces.end() && it->off < ce; ++it) {
    // Split where the file's registration is (a copy from host memory is pinned-fast only within
    // one registered range).
    for (std::size_t b = std::max(it->off, cb), e = std::min(it->off + it->len, ce); b < e;) {
      const std::uint64_t fo = it->file_off + (b - it->off);
      const std::size_t n = std::min<std::size_t>(e - b, kRegisterPiece - fo % kRegisterPiece);
      const BackingFile& f = *it->file;
      const std::size_t k = static_cast<std::size_t>(fo / kRegisterPiece);
      const bool registered = f.map != nullptr && k < f.registered.size() && f.registered[k] != 0;
      const CUresult r = registered ? link.d->cuMemcpyHtoDAsync(range.va + b, f.map + fo, n, stream)
                                    : ring.copy(link, f, fo, range.va + b, n, read_errno);
      if (r != CUDA_SUCCESS) return r;
      if (!registered) staged += n;
      b += n;
    }
  }
  const Gaps& g = gaps[i];
  std::size_t at = 0;
  for (const auto& [off, len] : g.ranges) {
    const CUresult r = link.d->cuMemcpyHtoDAsync(range.va + off, g.buf + at, len, stream);
    if (r != CUDA_SUCCESS) return r;
    at += len;
  }
  return CUDA_SUCCESS;
}

// --- the staging ring ---------------------------------------------------------------------

CUresult StagingRing::make(const DeviceLink& link) {
  const std::size_t bytes = kBuffers * kBufferBytes;
  void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  if (fault_in(static_cast<char*>(m), bytes) != 0) {
    (void)munmap(m, bytes);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  const CUresult r = link.d->cuMemHostRegister(m, bytes, CU_MEMHOSTREGISTER_PORTABLE);
  if (r != CUDA_SUCCESS) {
    (void)munmap(m, bytes);
    return r;
  }
  base_ = static_cast<char*>(m);
  mapped_ = bytes;
  for (std::size_t j = 0; j < kBuffers; ++j) {
    bufs_[j].p = base_ + j * kBufferBytes;
    if (const CUresult e = link.d->cuEventCreate(&bufs_[j].done, CU_EVENT_DISABLE_TIMING); e != CUDA_SUCCESS) {
      free(link);
      return e;
    }
  }
  return CUDA_SUCCESS;
}

namespace {
// Reads [off, off + n) of `fd` into `p` whole: 0, or the errno (EIO: the file is shorter).
int read_span(int fd, char* p, std::size_t n, std::uint64_t off) {
  for (std::size_t got = 0; got < n;) {
    const ssize_t k = ::pread(fd, p + got, n - got, static_cast<off_t>(off + got));
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return k < 0 ? errno : EIO;
    got += static_cast<std::size_t>(k);
  }
  return 0;
}
}  // namespace

// One buffer's read, in kReaders slices on as many threads (this one included): a read from the
// page cache is a copy by the CPU, about 4.6 GB/s on one thread of the H100's host (2026-12-05),
// against 53 GB/s for the link.
int StagingRing::read_into(int fd, char* p, std::size_t n, std::uint64_t off) {
  const std::size_t slice = (n + kReaders - 1) / kReaders;
  int errs[kReaders] = {};
  std::thread threads[kReaders - 1];
  for (std::size_t i = 1; i < kReaders && i * slice < n; ++i) {
    const std::size_t b = i * slice, len = std::min(slice, n - b);
    try {
      threads[i - 1] = std::thread([&errs, i, fd, p, b, len, off] { errs[i] = read_span(fd, p + b, len, off + b); });
    } catch (...) {
      errs[i] = read_span(fd, p + b, len, off + b);  // no thread: here
    }
  }
  errs[0] = read_span(fd, p, std::min(slice, n), off);
  for (std::thread& t : threads)
    if (t.joinable()) t.join();
  for (int e : errs)
    if (e != 0) return e;
  return 0;
}

CUresult StagingRing::copy(const DeviceLink& link, const BackingFile& f, std::uint64_t file_off, CUdeviceptr dst,
                           std::size_t len, int& read_errno) {
  if (base_ == nullptr)
    if (const CUresult r = make(link); r != CUDA_SUCCESS) return r;
  while (len > 0) {
    Buffer& b = bufs_[next_];
    const CUstream stream = link.stream(next_);
    next_ = (next_ + 1) % kBuffers;
    if (b.used)  // its previous copy must be done before it is read into again
      if (const CUresult r = link.d->cuEventSynchronize(b.done); r != CUDA_SUCCESS) return r;
    const std::size_t n = std::min(len, kBufferBytes);
    if (const int e = read_into(f.fd, b.p, n, file_off); e != 0) {
      read_errno = e;
      return CUDA_ERROR_OPERATING_SYSTEM;
    }
    if (const CUresult r = link.d->cuMemcpyHtoDAsync(dst, b.p, n, stream); r != CUDA_SUCCESS) return r;
    if (const CUresult r = link.d->cuEventRecord(b.done, stream); r != CUDA_SUCCESS) return r;
    b.used = true;
    bytes_ += n;
    dst += n;
    file_off += n;
    len -= n;
  }
  return CUDA_SUCCESS;
}

void StagingRing::drain(const DeviceLink& link) {
  for (Buffer& b : bufs_)
    if (b.used) {
      (void)link.d->cuEventSynchronize(b.done);
      b.used = false;
    }
}

void StagingRing::free(const DeviceLink& link) {
  drain(link);
  for (Buffer& b : bufs_) {
    if (b.done != nullptr) (void)link.d->cuEventDestroy(b.done);
    b = Buffer{};
  }
  if (base_ != nullptr) {
    (void)link.d->cuMemHostUnregister(base_);
    (void)munmap(base_, mapped_);
  }
  base_ = nullptr;
  mapped_ = 0;
  next_ = 0;
}

void FileBacked::free_gaps(const DeviceLink& link) {
  for (Gaps& g : gaps) g.free(link);
}

// --- the sleep ------------------------------------------------------------------------------

namespace {
const char* const kStays = "; the allocation stays resident (nothing is lost)";
}

// Files that cannot back anything any more: their pieces go, and their chunks are saved anew.
void FileSleep::drop_unusable_files() {
  const std::size_t n = link.chunks_of(range.size);
  for (std::size_t k = 0; k < files.pieces.size();) {
    BackingFile& f = *files.pieces[k].file;
    if (backing.ready(link, f, say, pin.threads)) {
      ++k;
      continue;
    }
    for (const FileBacked::Piece& p : files.pieces)
      if (p.file == &f)
        for (std::size_t i = p.off / link.chunk; i * link.chunk < p.off + p.len && i < n; ++i) dirty[i] = 1;
    auto& ps = files.pieces;
    ps.erase(std::remove_if(ps.begin(), ps.end(), [&f](const FileBacked::Piece& p) { return p.file == &f; }), ps.end());
  }
}

std::vector<std::uint8_t> chunks_in_files(const DeviceLink& link, std::size_t size,
                                          const std::vector<FileBacked::Piece>& pieces) {
  const std::size_t n = link.chunks_of(size), chunk = link.chunk;
  std::vector<std::size_t> covered(n, 0);
  for (const FileBacked::Piece& p : pieces) {
    for (std::size_t i = p.off / chunk; i * chunk < p.off + p.len && i < n; ++i) {
      const std::size_t b = std::max(p.off, i * chunk);
      const std::size_t e = std::min(p.off + p.len, std::min((i + 1) * chunk, size));
      covered[i] += e - b;
    }
  }
  std::vector<std::uint8_t> in_file(n, 0);
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t len = std::min(chunk, size - i * chunk);
    in_file[i] = covered[i] > 0 && len - covered[i] <= kMaxGapBytes ? 1 : 0;
  }
  return in_file;
}

// Chunk i sleeps in its file: what its pieces leave of it is copied into a new pinned buffer.
Status FileSleep::save_gaps(std::size_t i, CUstream stream) {
  const std::size_t cb = i * link.chunk;
  const std::size_t ce = std::min(cb + link.chunk, range.size);
  Gaps g;
  std::size_t at = cb, bytes = 0;
  for (auto it = first_piece_after(files.pieces, cb); it != files.pieces.end() && it->off < ce; ++it) {
    if (it->off > at) g.ranges.emplace_back(at, it->off - at), bytes += it->off - at;
    at = std::max(at, it->off + it->len);
  }
  if (at < ce) g.ranges.emplace_back(at, ce - at), bytes += ce - at;
  if (bytes > 0) {
    g.mapped = round_up(bytes, host_page());
    void* m = mmap(nullptr, g.mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
      return Status(ErrorCode::out_of_memory, "cuda: no host memory for the " + format_size(bytes) +
                                                  " of a weights chunk that are not its file's" + kStays);
    const int e = fault_in(static_cast<char*>(m), g.mapped);
    const CUresult r = e == 0 ? link.d->cuMemHostRegister(m, g.mapped, CU_MEMHOSTREGISTER_PORTABLE)
                              : CUDA_ERROR_OUT_OF_MEMORY;
    if (r != CUDA_SUCCESS) {
      (void)munmap(m, g.mapped);
      return link.d->error(r,
                           "pinning " + format_size(bytes) +
                               " for the bytes of a weights chunk that are not its file's" + kStays,
                           "cuMemHostRegister");
    }
    g.buf = static_cast<char*>(m);
    std::size_t put = 0;
    for (const auto& [off, len] : g.ranges) {
      const CUresult c = link.d->cuMemcpyDtoHAsync(g.buf + put, range.va + off, len, stream);
      if (c != CUDA_SUCCESS) {
        (void)link.sync();
        g.free(link);
        return link.d->error(c, std::string("copying the bytes of a weights chunk that are not its file's") + kStays,
                             "cuMemcpyDtoHAsync");
      }
      put += len;
    }
    copied += bytes;
  }
  files.gaps[i].free(link);  // (no copy can target the old buffer: it is only read by wakes)
  files.gaps[i] = std::move(g);
  return {};
}

// Once every copy is done: chunks that sleep in their file give their pinned backup chunk back,
// the others their gaps.
void FileSleep::settle(std::vector<std::uint8_t>& in_file) {
  for (std::size_t i = 0; i < in_file.size(); ++i) {
    if (in_file[i] == 0) files.gaps[i].free(link);
    else backup.unpin_chunk(link, i);
  }
  files.from_file = std::move(in_file);
  dirty.assign(files.from_file.size(), 0);
  backup.valid = true;
}

Status FileSleep::run() {
  const std::size_t n = link.chunks_of(range.size);
  drop_unusable_files();  // the caller ran backing.begin_sleep() once for the whole sleep
  std::vector<std::uint8_t> in_file = chunks_in_files(link, range.size, files.pieces);
  files.from_file.resize(n, 0);
  files.gaps.resize(n);
  std::vector<std::uint8_t> need_pin(n, 0);
  bool any_pin = false;
  for (std::size_t i = 0; i < n; ++i) {
    if (!backup.valid || in_file[i] != files.from_file[i]) dirty[i] = 1;
    const bool pinned = i < backup.pinned.size() && backup.pinned[i] != 0;
    if (in_file[i] == 0 && dirty[i] != 0 && !pinned) need_pin[i] = 1, any_pin = true;
  }
  backup.valid = false;
  if (any_pin) {
    if (Status st = backup.pin(link, range.va, range.size, /*copy=*/true, &need_pin, pin); !st) return st;
    for (std::size_t i = 0; i < n; ++i)
      if (need_pin[i] != 0) copied += std::min(link.chunk, range.size - i * link.chunk);
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (dirty[i] == 0 || need_pin[i] != 0) continue;
    Status st;
    if (in_file[i] != 0) {
      st = save_gaps(i, link.stream(i));
    } else {
      const std::size_t cb = i * link.chunk, len = std::min(link.chunk, range.size - cb);
      const CUresult r = link.d->cuMemcpyDtoHAsync(backup.base + cb, range.va + cb, len, link.stream(i));
      if (r == CUDA_SUCCESS) copied += len;
      else
        st = link.d->error(r, "copying weights at " + hex(range.va) + " to the host backup" + kStays,
                           "cuMemcpyDtoHAsync");
    }
    if (!st) {
      (void)link.sync();
      return st;
    }
  }
  if (Status st = link.sync(); !st) return Status(st.code(), st.message() + kStays);
  settle(in_file);
  return {};
}

}  // namespace residency::cuda
