// SPDX-License-Identifier: MIT
// Weights backed by their file (docs/design.md, "Weights backed by their file"). A tracked
// allocation's ranges filled from a file (Backend::filled_from_file) sleep in the file itself while
// it is unchanged (device, inode, size, modification time): the first sleep that needs it maps
// the whole file read-only and registers it (cuMemHostRegister READ_ONLY), so a wake copies from
// it at the link's rate; the rest of such a copy chunk (alignment gaps, up to kMaxGapBytes) sleeps
// in a small pinned buffer. A chunk with more gaps, or whose file changed or cannot be registered,
// sleeps in the pinned backup instead, and the fallback is said once per file.
#pragma once

#include <cuda.h>
#include <sys/stat.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backends/cuda/device_link.hpp"
#include "backends/cuda/host_backup.hpp"
#include "backends/cuda/vmm_range.hpp"
#include "residency/backend.hpp"
#include "residency/status.hpp"

namespace residency::cuda {

using Say = std::function<void(const std::string&)>;

// A file that backs device ranges: our own descriptor of it (dup'ed), what it was when first seen,
// and, from the first sleep that needs it, the whole file mapped read-only and registered.
struct BackingFile {
  int fd = -1;
  std::string name;  // the path /proc/self/fd gave, for the log
  dev_t dev = 0;
  ino_t ino = 0;
  off_t size = 0;
  std::int64_t mtime_ns = 0;
  char* map = nullptr;  // the whole file, mapped read-only while non-null
  std::size_t map_len = 0;
  // Per kRegisterPiece of the mapping: registered read-only with the GPU. Registered piece by piece
  // so that the work can run in the background and stop between pieces (the first release,
  // prepared); a copy never spans two pieces (FileBacked::restore_chunk).
  std::vector<std::uint8_t> registered;
  bool unusable = false;  // changed, or cannot be mapped or registered: backs nothing from now on
  // The host gate refused the room to register it (the host tier below "asleep"): it backs its
  // ranges unregistered, read through a StagingRing; a sleep or a later room-making tries again.
  bool held_back = false;

  // Whether the file, as its descriptor sees it now, is still what was first seen.
  bool unchanged() const;
  // Whether every piece of the mapping is registered.
  bool whole() const;
  // The host tier's key of this file (device and inode, never 0): the servers of one file share
  // its page cache, and the host budget counts it once.
  std::uint64_t key() const;
};

// The file mapping is registered in pieces of this many bytes: about 10 ms of pinning each.
inline constexpr std::size_t kRegisterPiece = std::size_t{256} << 20;

// The files of one backend, by device and inode.
class BackingFiles {
 public:
  ~BackingFiles();
  // The host tier's gate (Backend::HostGate, the backend's): asked before pieces are registered,
  // told when they are given back. Null or empty: registrations are not bounded.
  void set_gate(const Backend::HostGate* gate) { gate_ = gate; }
  // The file `fd` names (`st`: its fstat), added the first time; null if it cannot be dup'ed.
  BackingFile* note(int fd, const struct stat& st);
  // Whether `f` can back ranges now: unchanged since first seen, mapped and registered (done here
  // the first time), or held back by the host gate (registered in part or not at all: what is
  // not registered is read through a StagingRing). When not, it is marked unusable and `say`
  // tells why, once.
  // `parallel`: host threads that register pieces at once.
  bool ready(const DeviceLink& link, BackingFile& f, const Say& say, int parallel = 1);
  // One step of ready() that can run ahead of the first sleep: maps `f` (the first time) and
  // registers its next `parallel` pieces, one host thread each. `more`: pieces are left; `done`:
  // `f` is whole (or was); `failed`: it cannot back ranges (marked unusable, said once, nothing of
  // it kept registered); `held_back`: the host gate has no room for the pieces now (f.held_back).
  enum class Step { more, done, failed, held_back };
  Step register_pieces(const DeviceLink& link, BackingFile& f, const Say& say, int parallel);
  // The files that are usable but not whole yet (`with_held_back`: those the host gate held back too).
  std::vector<BackingFile*> unregistered(bool with_held_back = true);
  // A sleep begins: the host gate is asked again, once per file (ready() asks no more once refused).
  void begin_sleep();
  // Bytes of those files' mappings not registered (a file not mapped yet: its size).
  std::uint64_t unregistered_bytes();
  // Whether a registration was held back by the host gate since the last call (cleared).
  bool take_held_back() { return std::exchange(held_back_, false); }
  // Bytes registered with the GPU, over all files.
  std::uint64_t registered_bytes() const;
  // Gives the registration of `f` back and unmaps it (its pages may be evicted from now on); it
  // stays the backup of what was filled from it, woken through a StagingRing. Returns the bytes
  // unregistered. Its next ready() registers it again.
  std::uint64_t unregister(const DeviceLink& link, BackingFile& f);
  // The same for every file; the bytes unregistered.
  std::uint64_t unregister_all(const DeviceLink& link);
  // Before a restore: files that changed while the weights slept in them are marked unusable, and
  // said (nothing else holds those bytes).
  void mark_changed(const Say& say);
  // Unregisters, unmaps and closes the files `used` says no allocation refers to any more.
  void drop_unused(const DeviceLink& link, const std::function<bool(const BackingFile*)>& used);

 private:
  // Unregisters what `f` registered and unmaps it, marks it unusable and says why.
  void give_up(const DeviceLink& link, BackingFile& f, const std::string& why, const Say& say);
  std::map<std::pair<dev_t, ino_t>, std::unique_ptr<BackingFile>> files_;
  const Backend::HostGate* gate_ = nullptr;
  bool held_back_ = false;
};

// The host tier below "asleep" (docs/design.md, "Weights backed by their file"): a file whose
// registration was given back (BackingFiles::unregister) is still the backup of the weights
// filled from it, but its pages may be evicted; a wake copies its bytes through this ring of
// pinned buffers, reading the next buffer from the file (pread: the page cache, or the disk) while
// the link copies the previous one.
class StagingRing {
 public:
  static constexpr std::size_t kBuffers = 2;
  static constexpr std::size_t kBufferBytes = std::size_t{64} << 20;
  // Host threads that read one buffer from the file, each a slice.
  static constexpr std::size_t kReaders = 4;
  // Copies `len` bytes at `file_off` of `f` to device address `dst`, buffer by buffer. Returns
  // CUDA_SUCCESS, or the failing call's result (a read that fails or comes back short:
  // CUDA_ERROR_OPERATING_SYSTEM, its errno in `read_errno`). The last copies may still run: the
  // caller synchronizes the link's streams, and drain() before the ring is freed.
  CUresult copy(const DeviceLink& link, const struct BackingFile& f, std::uint64_t file_off, CUdeviceptr dst,
                std::size_t len, int& read_errno);
  // Waits for the copies out of the buffers.
  void drain(const DeviceLink& link);
  // Bytes the ring has copied over its life.
  std::uint64_t bytes() const { return bytes_; }
  void free(const DeviceLink& link);

 private:
  CUresult make(const DeviceLink& link);
  static int read_into(int fd, char* p, std::size_t n, std::uint64_t off);
  struct Buffer {
    char* p = nullptr;
    CUevent done = nullptr;  // recorded after the buffer's last copy
    bool used = false;
  };
  Buffer bufs_[kBuffers];
  std::size_t next_ = 0;
  std::size_t mapped_ = 0;  // bytes of the one mapping that holds every buffer
  char* base_ = nullptr;
  std::uint64_t bytes_ = 0;
};

// The bytes of a copy chunk that sleeps in its file but are not the file's: [off, off + len)
// ranges of the allocation, kept one after the other in a small pinned buffer.
struct Gaps {
  char* buf = nullptr;
  std::size_t mapped = 0;
  std::vector<std::pair<std::size_t, std::size_t>> ranges;
  void free(const DeviceLink& link);
};

// A tracked weights allocation's bytes that are its files': the pieces, and per copy chunk whether
// its last sleep kept it in its file and its gaps.
struct FileBacked {
  // Device bytes [off, off + len) of the allocation equal the file's bytes at file_off.
  struct Piece {
    std::size_t off = 0;
    std::size_t len = 0;
    BackingFile* file = nullptr;
    std::uint64_t file_off = 0;
  };
  std::vector<Piece> pieces;            // sorted by off, disjoint
  std::vector<std::uint8_t> from_file;  // per copy chunk: its last sleep kept it in its file
  std::vector<Gaps> gaps;               // per copy chunk

  void add(const Piece& p);
  // Removes [begin, end) from the pieces (splitting those it cuts through): written, no longer the file's.
  void cut(std::size_t begin, std::size_t end);
  bool uses(const BackingFile* f) const;
  // Bytes of the allocation that sleep in files now.
  std::uint64_t bytes_in_files(std::size_t chunk) const;
  // Issues the copies that refill chunk `i` from its file pieces and gaps on `stream`: from the
  // file's registered pieces directly, through `ring` where the file is not registered.
  // `staged`: bytes that went through the ring, added to.
  CUresult restore_chunk(const DeviceLink& link, const VmmRange& range, std::size_t i, CUstream stream,
                         StagingRing& ring, std::uint64_t& staged, int& read_errno) const;
  void free_gaps(const DeviceLink& link);
};

// The most bytes of a copy chunk that may be gaps (not from a file) for the chunk to sleep in its
// file: 1/16 of a 256 MiB chunk.
inline constexpr std::size_t kMaxGapBytes = std::size_t{16} << 20;

// Per copy chunk of an allocation of `size` bytes: whether it sleeps in its files (covered by
// `pieces` but for at most kMaxGapBytes).
std::vector<std::uint8_t> chunks_in_files(const DeviceLink& link, std::size_t size,
                                          const std::vector<FileBacked::Piece>& pieces);

// The sleep of a tracked weights allocation with file pieces, while its memory is still mapped:
// chunk by chunk, what changed since the last sleep (or everything, the first time) is saved; a
// chunk made of its file's bytes but for at most kMaxGapBytes keeps those in the file (nothing to
// copy) and its gaps in a small pinned buffer; any other chunk goes to the pinned backup, pinned
// chunk by chunk as needed. Chunks that now sleep in their file give their pinned backup back. On
// a failure the allocation stays resident and nothing is lost. `dirty`: one flag per chunk,
// written since the last sleep (cleared on success). `copied`: bytes copied to the host, added to.
struct FileSleep {
  const DeviceLink& link;
  const VmmRange& range;
  FileBacked& files;
  PinnedBackup& backup;
  std::vector<std::uint8_t>& dirty;
  BackingFiles& backing;
  const PinSettings& pin;
  const Say& say;
  std::uint64_t& copied;

  Status run();

 private:
  void drop_unusable_files();
  Status save_gaps(std::size_t i, CUstream stream);
  void settle(std::vector<std::uint8_t>& in_file);
};

}  // namespace residency::cuda
