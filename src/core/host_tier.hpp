// SPDX-License-Identifier: MIT
// HostTier: the host tier below "asleep" (docs/design.md, "The host tier"). A device backend keeps
// the model files its weights sleep in registered with the device (pinned page cache, which the
// kernel cannot evict), so that a wake copies from them at the link's rate. Those bytes count
// against a budget of RAM shared by the processes that name it (a ledger: RESIDENCY_HOST_BUDGET,
// else RESIDENCY_SHARED_BUDGET's, else `host:50%`). This unit is the backend's host gate
// (Backend::HostGate): a registration reserves its bytes first; one that does not fit is not made
// (the model sleeps in the tier below: its file, read through a staging buffer at the next wake),
// and the backend's background thread makes room later by asking the holder idle longest, which
// gives its registration back (Backend::drop_file_registrations).
//
// Threads: reserve() without waiting runs under the manager's and the backend's locks (a sleep);
// reserve() that may wait only on the backend's background thread, which holds neither; the
// ledger's listener thread answers asks through the manager (on_asked). A mutex of its own
// serializes the reservations; the one that waits for other processes holds it, and the others
// never wait for it (try_lock: refused, and the waiting one makes the room); giving back is
// lock-free.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "keep_alive.hpp"
#include "log.hpp"
#include "residency/backend.hpp"
#include "residency/clock.hpp"
#include "residency/config.hpp"

namespace residency::ledger {
class Ledger;
}

namespace residency::core {

class HostTier : public std::enable_shared_from_this<HostTier> {
 public:
  // Joins the ledger config.host_budget names (Config::for_device_memory resolved it), for a
  // backend whose Capabilities::registers_files. Null when the tier is off. A ledger that cannot be
  // joined (another user's, a full table) is said in the log and the tier stays off: the files are
  // then registered unbounded, as before the tier existed.
  static std::shared_ptr<HostTier> join(const Config& config, Clock& clock, const LogSink& log);
  ~HostTier();
  HostTier(const HostTier&) = delete;
  HostTier& operator=(const HostTier&) = delete;

  // The gate for Backend::set_host_gate: it keeps this object alive while the backend holds it.
  Backend::HostGate gate();
  // Room for `bytes` more registered: from what an earlier wait reserved, else what the ledger has
  // free now; with `may_wait`, the other holders are asked (the one idle longest first, however
  // short its idle: giving a registration back costs nothing until its next wake) and waited for,
  // boundedly (ledger::kAskWait). False: the bytes are not to be registered now.
  // `file`: which model file (Backend::HostGate), so that the servers of one file count it once.
  bool reserve(std::uint64_t bytes, bool may_wait, std::uint64_t file = 0);
  // `bytes` of registration were given back.
  void give_back(std::uint64_t bytes);
  // What is reserved but registered by nobody goes back to the ledger (asked for room).
  void give_back_spare();

  // The ledger's listener: `on_asked(asker)` runs on its thread when another holder needs room.
  void listen(std::function<void(int asker)> on_asked);
  void stop_listening();
  // At process exit (a preload's manager is never destroyed): gives everything back and leaves.
  void detach_at_exit();
  // The time of last use, published into the ledger's slot like the device budget's (so that the
  // one asked is the least recently used).
  LastUsePublisher publisher();

  const std::string& name() const;
  std::uint64_t budget() const;
  std::uint64_t held() const;        // reserved in the ledger
  std::uint64_t registered() const;  // of it, registered by the backend
  std::uint64_t refusals() const;    // registrations refused for want of room

 private:
  HostTier(std::unique_ptr<ledger::Ledger> ledger, Clock& clock, LogSink log);
  std::unique_ptr<ledger::Ledger> ledger_;
  Clock& clock_;
  const LogSink log_;
  std::mutex mu_;  // serializes reserve() (and give_back_spare()): the books' one writer that adds
  std::atomic<std::uint64_t> registered_{0};  // the ledger's held() minus this is spare
  std::atomic<std::uint64_t> refusals_{0};
  // The ledger slot's shared key (Ledger::set_shared_key), under mu_: the file its bytes are, or 0.
  static constexpr std::uint64_t kNoKeyYet = ~std::uint64_t{0};
  std::uint64_t key_ = kNoKeyYet;
};

}  // namespace residency::core
