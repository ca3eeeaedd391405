// SPDX-License-Identifier: MIT
#include "host_tier.hpp"

#include <unistd.h>

#include <algorithm>
#include <utility>

#include "ledger/ledger.hpp"
#include "text.hpp"

namespace residency::core {

namespace {
std::uint64_t physical_memory() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page) : 0;
}
}  // namespace

std::shared_ptr<HostTier> HostTier::join(const Config& config, Clock& clock, const LogSink& log) {
  if (config.host_budget.off || !config.host_budget.budget) return nullptr;
  const SharedBudget& b = *config.host_budget.budget;
  const std::uint64_t ram = physical_memory();
  if (b.size.is_percent && ram == 0) {
    log(LogLevel::warn, "the host tier is off: RESIDENCY_HOST_BUDGET " + b.to_string() +
                            " is a percent of RAM, and RAM could not be read; give bytes");
    return nullptr;
  }
  ledger::AttachOptions ao;
  ao.name = b.name;
  ao.budget = b.size.resolve(ram);
  ao.group = b.group;
  ao.priority = config.shared_priority;
  auto l = ledger::Ledger::attach(ao);
  if (!l) {
    log(LogLevel::warn, "the host tier is off (model files registered for fast wakes are not bounded): " + l.message() +
                            "; set RESIDENCY_HOST_BUDGET to a ledger of your own, or `off`");
    return nullptr;
  }
  return std::shared_ptr<HostTier>(new HostTier(std::move(*l), clock, log));
}

HostTier::HostTier(std::unique_ptr<ledger::Ledger> ledger, Clock& clock, LogSink log)
    : ledger_(std::move(ledger)), clock_(clock), log_(std::move(log)) {}

HostTier::~HostTier() { stop_listening(); }

Backend::HostGate HostTier::gate() {
  Backend::HostGate g;
  std::shared_ptr<HostTier> self = shared_from_this();
  g.reserve = [self](std::uint64_t bytes, bool may_wait, std::uint64_t file) {
    return self->reserve(bytes, may_wait, file);
  };
  g.give_back = [self](std::uint64_t bytes) { self->give_back(bytes); };
  return g;
}

bool HostTier::reserve(std::uint64_t bytes, bool may_wait, std::uint64_t file) {
  if (bytes == 0) return true;
  std::unique_lock<std::mutex> lock(mu_, std::defer_lock);
  if (may_wait) lock.lock();
  else if (!lock.try_lock()) return false;  // another thread is making room: not now, never wait here
  // The holder's bytes are one file's page cache, shared with the other servers of that file
  // (counted once), until it holds a second file: then they are its own.
  if (file != key_) {
    const std::uint64_t key = ledger_->held() == 0 || key_ == kNoKeyYet ? file : 0;
    if (key != key_) ledger_->set_shared_key(key);
    key_ = key;
  }
  const std::uint64_t held = ledger_->held(), reg = registered_.load();
  const std::uint64_t spare = held > reg ? held - reg : 0;
  if (spare < bytes) {
    const std::uint64_t need = bytes - spare;
    const std::uint64_t got = ledger_->acquire(need, clock_.now().count(), may_wait ? ledger::kAskWait : Nanos(0),
                                               /*partial=*/false, ledger::kNoMinimumIdle);
    if (got < need) {
      refusals_.fetch_add(1);
      if (may_wait)
        log_(LogLevel::info, "host budget " + ledger_->name() + " (" + mib(ledger_->budget()) + ") is full: " + mib(bytes) +
                                 " of model files stay unregistered (host tier 2); the next wake reads them "
                                 "through the staging buffers");
      return false;
    }
  }
  // Room made ahead (may_wait) stays spare until the registrations take it without waiting.
  if (!may_wait) registered_.fetch_add(bytes);
  return true;
}

// Lock-free (the backend calls it under its lock, while a reserve() may wait): the ledger first,
// then the books, so that a reserve() in between finds no spare that is not there.
void HostTier::give_back(std::uint64_t bytes) {
  std::uint64_t reg = registered_.load();
  bytes = std::min(bytes, reg);
  ledger_->release(bytes);
  registered_.fetch_sub(bytes);
}

void HostTier::give_back_spare() {
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (!lock.owns_lock()) return;  // a wait is making room on another thread: it keeps what it gets
  const std::uint64_t held = ledger_->held(), reg = registered_.load();
  if (held > reg) ledger_->release(held - reg);
}

void HostTier::listen(std::function<void(int asker)> on_asked) { ledger_->listen(std::move(on_asked)); }
void HostTier::stop_listening() { ledger_->stop_listening(); }

void HostTier::detach_at_exit() {
  ledger_->release(ledger_->held());  // the process's pages are unpinned as it ends
  ledger_->detach_at_exit();
}

LastUsePublisher HostTier::publisher() { return {&ledger::Ledger::publish_last_use, ledger_.get()}; }

const std::string& HostTier::name() const { return ledger_->name(); }
std::uint64_t HostTier::budget() const { return ledger_->budget(); }
std::uint64_t HostTier::held() const { return ledger_->held(); }
std::uint64_t HostTier::registered() const { return registered_.load(); }
std::uint64_t HostTier::refusals() const { return refusals_.load(); }

}  // namespace residency::core
