// SPDX-License-Identifier: MIT
// What the cuda backend's measuring programs share: failing with one line that names the program,
// timing, medians and rates, and a region of the backend's own memory in a set, requested.
// Each program defines kToolName.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "backends/cuda/cuda_backend.hpp"

namespace residency::cuda::tools {

extern const char* const kToolName;

using Clock = std::chrono::steady_clock;
constexpr std::uint64_t kGiB = std::uint64_t{1} << 30;
constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;

[[noreturn]] inline void die(const std::string& what) {
  std::fprintf(stderr, "%s: %s\n", kToolName, what.c_str());
  std::exit(1);
}
inline void check(const Status& s, const char* what) {
  if (!s) die(std::string(what) + ": " + s.message());
}
inline void check(const Driver& d, CUresult r, const char* what) {
  if (r != CUDA_SUCCESS) die(std::string(what) + ": " + d.describe(r));
}

inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}
inline double gbps(std::uint64_t bytes, double s) { return s > 0 ? static_cast<double>(bytes) / s / 1e9 : 0; }

// `p` (`bytes` from b.allocate()) as the one region of a new set `set`, committed and requested.
inline void request_in_new_set(CudaBackend& b, SetId set, RegionId id, void* p, std::uint64_t bytes, RegionClass cls) {
  RegionDesc desc;
  desc.id = id;
  desc.base = p;
  desc.size = bytes;
  desc.cls = cls;
  desc.backend_allocated = true;
  check(b.create_set(set, bytes), "create_set");
  b.add_region(set, desc);
  check(b.commit(set).status, "commit");
  const SetOutcome out = b.request_residency(set);
  if (!out.ok()) die("request_residency: " + out.status.message());
}

}  // namespace residency::cuda::tools
