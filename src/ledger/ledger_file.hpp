// SPDX-License-Identifier: MIT
// The ledger's file (internal to src/ledger): its layout in shared memory, the checks of its bytes
// and of the file itself, how it is opened, created and mapped, and the only two ways this process
// touches its data: pread() of the whole ledger into a copy, and one word at a time written by the
// kernel (write_word()).
//
// Why it is shaped so: anyone who may write the file may truncate it or scribble on it at any
// moment, and a load or store through a mapping whose page was cut off faults the process
// (SIGBUS). So no instruction of this process loads or stores through the mapping; the mapping only
// gives the kernel addresses (the futex words, write_word's target), which the kernel answers with
// EFAULT, never a fault, when the page is gone (docs/design.md, "The ledger protocol"). And
// anything may sit at a ledger's path in /dev/shm (a FIFO, a socket, a link): it is opened so that
// nothing there can make a command block.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include <sys/types.h>

#include "ledger.hpp"
#include "residency/status.hpp"

#if defined(__linux__) && !defined(RESIDENCY_LEDGER_UNSUPPORTED)
#define RESIDENCY_LEDGER_LINUX 1
#include <time.h>
#endif

namespace residency::ledger {

using Nanos = std::chrono::nanoseconds;

inline constexpr const char* kDir = "/dev/shm";
inline constexpr const char* kPrefix = "residency-budget-";

#if RESIDENCY_LEDGER_LINUX

// --- the layout in shared memory ------------------------------------------------------------

inline constexpr std::uint64_t kMagic = 0x5245444752444c52ULL;  // "RLDRGDER" little-endian: residency ledger
// Never given out as an ask id: builds before 2027-01 wrote it into their own ask word to stop
// their listener (the same format), and such a listener must not take an ask for it.
inline constexpr std::uint32_t kStopWord = 0xffffffffu;

// One holder. Invariant: `occupied` is 1 exactly while pid/start_time name a holder; `bytes` is what
// that holder has reserved. Each is one aligned word, written under the ledger's lock (last_use
// also without it, by the holder's touch(); its own ask word too, by its stop and when it cannot
// take the lock to answer).
//
// An ask has an identity and an end: `ask` holds its id (Shared::ask_serial, never 0 or
// kStopWord), asker_pid/asker_start name the asking process and ask_deadline is when it stops
// waiting. The asked holder gives back only for an ask that is still the one in its word, whose
// asker is alive and whose deadline has not passed (a holder stopped while asked, continued after
// the asker gave up, gives back to nobody); the asker withdraws its asks when it stops waiting.
struct alignas(64) Slot {
  std::atomic<std::uint32_t> ask;  // futex word: 0 nothing asked; else the ask's id
  std::atomic<std::uint32_t> occupied;
  std::atomic<std::int32_t> pid;
  std::atomic<std::int32_t> priority;
  std::atomic<std::uint64_t> start_time;
  std::atomic<std::uint64_t> bytes;
  std::atomic<std::int64_t> last_use;  // CLOCK_MONOTONIC ns of the last use; 0: none yet
  std::atomic<std::int32_t> asker_pid;
  std::atomic<std::uint32_t> floor_mib;  // MiB of `bytes` that no ask gets back (Ledger::set_floor)
  std::atomic<std::uint64_t> asker_start;
  std::atomic<std::int64_t> ask_deadline;  // CLOCK_MONOTONIC ns
  // A strict wait (Ledger::acquire_in_turn): its place in the queue (Shared::ticket_serial when it
  // began), 0 when not waiting. Room goes to the occupied slot of the lowest ticket first.
  std::atomic<std::uint64_t> wait_ticket;
  // What `bytes` are, where they are the same memory as another holder's (Ledger::set_shared_key):
  // holders of one nonzero key count once, as the largest of them (the host tier: one model file's
  // page cache, registered by every server of that file, is pinned once). 0: its own. Carved out
  // of the reserved bytes, which creators zero, so that the layout and format stay; a process of an
  // earlier build counts every holder (more, never less).
  std::atomic<std::uint64_t> shared_key;
  char reserved[48];
};
static_assert(sizeof(Slot) == 128, "two cache lines per holder");
static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "the ledger needs lock-free 64-bit atomics");

struct Ledger::Shared {
  // The trust model: every process that may open the file (its user, or the members of its
  // group) may deny the others budget, never corrupt their processes. So nothing here is a lock or
  // a pointer: the lock is the kernel's (an OFD lock on the file), and every field is checked
  // before it is used (check_table(), and the file's size, under the lock). A ledger that fails
  // the check is an error with a message; its holders stop using it and keep their processes.
  //
  // Fixed header: magic and version stay at these offsets in every format version, so that a
  // reader can name the version it found.
  std::uint64_t magic;
  std::uint32_t version;
  std::uint32_t layout_size;  // sizeof(Shared) of the creator: another layout is another format
  std::uint64_t budget;
  std::atomic<std::uint32_t> generation;  // futex word: bumped whenever bytes are given back
  std::atomic<std::uint32_t> retired;     // 1: unlinked by the last holder; open afresh
  char name[72];
  // The pid that took the lock last (0: unlocked): only for the message of a wait that timed out.
  std::atomic<std::int32_t> locker;
  std::atomic<std::uint32_t> ask_serial;     // the last ask id given out
  std::atomic<std::uint64_t> ticket_serial;  // the last wait ticket given out (Slot::wait_ticket)
  alignas(64) Slot slots[kMaxHolders];
};

using Shared = Ledger::Shared;

// --- reading the bytes: checks ------------------------------------------------------------------

// What is wrong with a ledger's bytes ("" when nothing is). Every field another process may have
// written is read here before it is used: the header, the retired word, each slot's `occupied`, pid
// and start time, and the sum of the reservations against the budget (which acquire() keeps).
std::string check_table(const Shared& s);
// The sum of the reservations of a table (`used` is never stored: a holder killed mid-update
// leaves nothing to undo); holders of one shared key count once, as the largest. `extra` is added
// to slot `with` first (what the sum would be after it took `extra` more).
std::uint64_t used_bytes(const Shared& s, std::uint32_t with = kMaxHolders, std::uint64_t extra = 0);
// The ledger's locker word, read with pread (a mapping may not be touched without the lock).
int locker_of(int fd);

// --- writing a word, waiting on a word ----------------------------------------------------------

std::int64_t monotonic_ns();
std::string errno_text(int e);
// Writes `size` bytes at offset `at` of a ledger: one word of it, by the kernel, never through
// the mapping (ledger_file.cpp says how, and what happens where a sandbox refuses the call).
// Returns false when nothing was written.
bool write_word(int fd, void* mapping, std::size_t at, const void* value, std::size_t size);
// Returns the number woken, or -1 with errno (EFAULT: the page is gone, the file was truncated).
long futex_wake(std::atomic<std::uint32_t>& a, int n);
// Sleeps while `a` holds `expected`, at most `timeout` (nullptr: no limit).
// Returns 0 when woken (or spuriously), else -1 with errno: EAGAIN (the word differed), ETIMEDOUT,
// EINTR, or EFAULT (the page is gone: the file was truncated). The kernel compares the word, so
// waiting needs no load of it from a mapping.
long futex_wait(std::atomic<std::uint32_t>& a, std::uint32_t expected, const timespec* timeout);

// --- the file: open, check, create, map ---------------------------------------------------------

// Opens a path in /dev/shm (world-writable: anyone may put a FIFO, a socket or a link there)
// without ever blocking: O_NONBLOCK, so that opening a FIFO returns at once (ENXIO for a socket),
// and O_NOFOLLOW. The caller checks the file's type with fstat before it reads a byte.
int open_in_shm(const std::string& path, int access);
// The message for a path in /dev/shm that is not a regular file (any user may make one there).
std::string not_a_ledger(const std::string& path, mode_t mode);
// Checks an open ledger: a regular file of this user (or of our group with mode 0660), mode
// 0600 or 0660, magic, format version, layout size. `group`: the gid configured, or -1.
Status check_file(int fd, const std::string& path, long group, const std::string& group_name = "");
// The gid of a group named in a budget, or an error naming it.
Result<gid_t> group_id(const std::string& group);
// Opens the ledger at `path`, or creates it (create_ledger()), and checks it (check_file()).
// Returns the descriptor, -1 when another process created or linked one just now (open again),
// or an error that names the path.
Result<int> open_ledger(const std::string& path, const std::string& name, std::uint64_t budget, long group,
                        const std::string& group_name);
// The mapping gives the futex words their address and write_word() its target; nothing is loaded
// from it or stored into it by this process's instructions (Lock, ledger_lock.hpp), so a truncation by
// another member can never fault this process. nullptr (errno set) when it fails.
Shared* map_ledger(int fd);
// Whether the file at `path` is the one open as `fd` (a ledger removed from outside, rm or
// systemd's RemoveIPC, may have been replaced by another process's new one: that one is not ours
// to remove).
bool path_is_ours(int fd, const std::string& path);

#endif  // RESIDENCY_LEDGER_LINUX

}  // namespace residency::ledger
