// SPDX-License-Identifier: MIT
#include "limits.hpp"

#include <algorithm>
#include <atomic>

#include "residency/text.hpp"

namespace residency::core {

namespace {

// The hard-limit warning is about the process, not one manager: print it once.
std::atomic<bool> g_warned_hard_limit{false};

std::uint64_t clamp_to_hard(std::uint64_t bytes, const MemoryInfo& mem, const std::string& asked, const LogSink& log) {
  if (mem.hard_limit == 0 || bytes <= mem.hard_limit) return bytes;
  if (!g_warned_hard_limit.exchange(true)) {
    log(LogLevel::warn, "wired limit clamped to " + mem.hard_limit_name + " = " + format_size(mem.hard_limit) + asked +
                            "; to wire more: " + mem.hard_limit_fix + " (said once per process)");
  }
  return mem.hard_limit;
}

}  // namespace

Result<Limits> Limits::resolve(const Config& config, const MemoryInfo& mem, const std::string& backend, bool managing,
                               const LogSink& log) {
  Limits l;
  l.backend_ = backend;
  l.recommended_ = mem.recommended_working_set;
  std::uint64_t limit = UINT64_MAX;
  if (config.wired_limit) {
    if (config.wired_limit->is_percent && l.recommended_ == 0)
      return Status(ErrorCode::invalid_argument, "wired limit " + config.wired_limit->to_string() +
                                                     " is a percent, but the " + backend +
                                                     " backend reports no recommended working set; give bytes instead");
    limit = config.wired_limit->resolve(l.recommended_);
    if (l.recommended_ != 0 && limit > l.recommended_)
      return Status(ErrorCode::limit_exceeded, "wired limit " + format_size(limit) +
                                                   " is above the recommended working set of " +
                                                   format_size(l.recommended_) + " (" + backend +
                                                   " backend); choose at most that, e.g. RESIDENCY_WIRED_LIMIT=100%");
  } else if (l.recommended_ != 0) {
    limit = l.recommended_;
  }
  if (managing)
    limit = clamp_to_hard(limit, mem, config.wired_limit ? " (asked for " + format_size(limit) + ")" : std::string(), log);
  l.initial_wired_limit_ = limit;

  if (config.memory_limit) {
    l.memory_limit_ = *config.memory_limit;
  } else if (l.recommended_ != 0 || mem.physical != 0) {
    const double a = l.recommended_ ? kMemoryLimitOfRecommended * static_cast<double>(l.recommended_) : 1e300;
    const double b = mem.physical ? kMemoryLimitOfPhysical * static_cast<double>(mem.physical) : 1e300;
    l.memory_limit_ = static_cast<std::uint64_t>(std::min(a, b));
  }
  return l;
}

Result<std::uint64_t> Limits::check_wired_limit(std::uint64_t bytes, const MemoryInfo& mem, const LogSink& log) const {
  if (recommended_ != 0 && bytes > recommended_)
    return Status(ErrorCode::limit_exceeded,
                  "set_wired_limit: " + format_size(bytes) + " is above the recommended working set of " +
                      format_size(recommended_) + " (" + backend_ + " backend); choose at most that");
  return clamp_to_hard(bytes, mem, " (asked for " + format_size(bytes) + ")", log);
}

Status Limits::check_track(std::uint64_t tracked, std::uint64_t more) const {
  if (memory_limit_ == 0 || (more <= memory_limit_ && tracked <= memory_limit_ - more)) return Status::ok();
  return Status(ErrorCode::limit_exceeded,
                "register_region: tracking " + format_size(more) + " more would make " + format_size(tracked + more) +
                    ", above the memory limit of " + format_size(memory_limit_) +
                    " (min(1.5 x recommended working set, 0.95 x physical memory), unless Config::memory_limit sets "
                    "it)");
}

void Limits::warn_if_over_recommended(std::uint64_t tracked, const LogSink& log) {
  if (recommended_ == 0 || tracked <= recommended_ || warned_over_recommended_) return;
  warned_over_recommended_ = true;
  log(LogLevel::warn, "current allocated size " + mib(tracked) +
                          " is greater than the recommended max working set size " + mib(recommended_));
}

void Limits::warn_if_scope_large(std::uint64_t admitted, const LogSink& log) {
  if (recommended_ == 0 || warned_scope_size_ ||
      static_cast<double>(admitted) <= kScopeWarnFraction * static_cast<double>(recommended_))
    return;
  warned_scope_size_ = true;
  log(LogLevel::warn, "generating with a model that requires " + mib(admitted) +
                          ", close to the maximum recommended size of " + mib(recommended_) +
                          "; this can be slow (other applications compete for the memory)");
}

}  // namespace residency::core
