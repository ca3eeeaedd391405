// SPDX-License-Identifier: MIT
// Limits: what the backend's memory allows, decided once at create and checked in one place.
//
// The peers' limits, kept (docs/design.md, "Concepts"): a wired limit above the recommended working
// set is an error (MLX); a warning when tracked bytes exceed the recommended working set
// (llama.cpp) and when a use scope wires a model above 0.9 x recommended (mlx-lm); a memory limit
// on tracked bytes, default min(1.5 x recommended, 0.95 x physical) (MLX). The backend's hard limit
// (RLIMIT_MEMLOCK) clamps the budget, with one warning per process naming the fix: a server
// with many models would otherwise print the same line for each of them.
#pragma once

#include <cstdint>
#include <string>

#include "log.hpp"
#include "residency/backend.hpp"
#include "residency/config.hpp"
#include "residency/status.hpp"

namespace residency::core {

// mlx-lm warns when a generation wires a model above 0.9 x the recommended working set.
inline constexpr double kScopeWarnFraction = 0.9;
// Default memory limit on tracked bytes (MLX): min(1.5 x recommended, 0.95 x physical).
inline constexpr double kMemoryLimitOfRecommended = 1.5;
inline constexpr double kMemoryLimitOfPhysical = 0.95;

class Limits {
 public:
  // Resolves the budget (explicit, else the recommended working set, else unlimited), clamps it
  // to the hard limit (warning once per process) and the memory limit. Errors: a percent without
  // a recommended working set, a limit above the recommended working set.
  static Result<Limits> resolve(const Config& config, const MemoryInfo& memory, const std::string& backend,
                                bool managing, const LogSink& log);

  std::uint64_t initial_wired_limit() const { return initial_wired_limit_; }
  std::uint64_t recommended() const { return recommended_; }
  std::uint64_t memory_limit() const { return memory_limit_; }  // 0 = none

  // set_wired_limit(): above the recommended working set is an error; above the hard limit is
  // clamped with a warning. `memory` is read now (the hard limit may have changed).
  Result<std::uint64_t> check_wired_limit(std::uint64_t bytes, const MemoryInfo& memory, const LogSink& log) const;
  // register_region(): tracking `more` bytes on top of `tracked` must stay within the memory limit.
  Status check_track(std::uint64_t tracked, std::uint64_t more) const;
  // Warnings, each once per manager.
  void warn_if_over_recommended(std::uint64_t tracked, const LogSink& log);
  void warn_if_scope_large(std::uint64_t admitted, const LogSink& log);

 private:
  std::string backend_;
  std::uint64_t recommended_ = 0;
  std::uint64_t memory_limit_ = 0;
  std::uint64_t initial_wired_limit_ = UINT64_MAX;
  bool warned_over_recommended_ = false;
  bool warned_scope_size_ = false;
};

}  // namespace residency::core
