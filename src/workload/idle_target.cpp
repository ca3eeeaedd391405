// SPDX-License-Identifier: MIT
// The idle targets this build has, policy names, and IdleTime (see idle_target.hpp).
#include "workload/idle_target.hpp"

#include "residency/config.hpp"
#include "residency/text.hpp"

#include <condition_variable>
#include <mutex>

#if RESIDENCY_IDLE_HAVE_SIM
#include "workload/sim/idle_sim.hpp"
#endif
#if RESIDENCY_IDLE_HAVE_CUDA
#include "workload/cuda/idle_cuda.hpp"
#endif
#if RESIDENCY_IDLE_HAVE_METAL
#include "workload/metal/idle_metal.hpp"
#endif

namespace residency::workload {

// Other targets declare their factories here, each under its RESIDENCY_IDLE_HAVE_<NAME>.

std::vector<std::string> idle_backends() {
  std::vector<std::string> names{"posix"};
#if RESIDENCY_IDLE_HAVE_CUDA
  names.emplace_back("cuda");
#endif
#if RESIDENCY_IDLE_HAVE_METAL
  names.emplace_back("metal");
#endif
#if RESIDENCY_IDLE_HAVE_SIM
  names.emplace_back("sim");
#endif
  return names;
}

Result<std::unique_ptr<IdleTarget>> make_idle_target(std::string_view backend, const IdleTargetOptions& options) {
  if (backend == "posix") return make_posix_idle_target(options);
#if RESIDENCY_IDLE_HAVE_SIM
  if (backend == "sim") return make_sim_idle_target({options.sim_profile, options.sim_decaying_requests});
#endif
#if RESIDENCY_IDLE_HAVE_CUDA
  if (backend == "cuda") return make_cuda_idle_target(options);
#endif
#if RESIDENCY_IDLE_HAVE_METAL
  if (backend == "metal") return make_metal_idle_target(options);
#endif
  std::string accepted;
  for (const auto& n : idle_backends()) accepted += (accepted.empty() ? "" : ", ") + n;
  return Status(ErrorCode::invalid_argument,
                "unknown backend '" + printable(backend) + "'; this build accepts: " + accepted);
}

void IdleTime::pass(Nanos d) {
  const Nanos until = clock_.now() + d;
  if (virtual_ == nullptr) {
    std::mutex m;
    std::condition_variable cv;
    std::unique_lock<std::mutex> lock(m);
    while (clock_.now() < until) clock_.wait_until(lock, cv, until);
    return;
  }
  // Bounded: a manager that stopped moving its deadline must not hang the benchmark.
  for (int i = 0; i < 10'000'000; ++i) {
    const std::optional<Nanos> next = manager_.run_due();
    if (!next || *next > until) break;
    virtual_->set(*next);
  }
  virtual_->set(until);
  manager_.run_due();
}

Result<std::vector<IdlePolicy>> parse_policies(std::string_view list, Nanos keep_alive) {
  if (keep_alive.count() <= 0) {
    return Status(ErrorCode::invalid_argument,
                  "the keep-alive policy needs a duration above 0 (e.g. 2s, 180s); policies 0, forever "
                  "and off are named in --policies");
  }
  std::vector<IdlePolicy> out;
  std::size_t start = 0;
  while (start <= list.size()) {
    const std::size_t comma = list.find(',', start);
    const std::string_view item = list.substr(start,
                                              comma == std::string_view::npos ? std::string_view::npos : comma - start);
    IdlePolicy p;
    if (item == "off") {
      p = {IdlePolicy::Kind::off, KeepAlive::off(), "off", "off"};
    } else if (item == "keep-alive") {
      p = {IdlePolicy::Kind::keep_alive, {}, "keep-alive", {}};
    } else if (item == "pressure-aware") {
      p = {IdlePolicy::Kind::keep_alive, {}, "pressure-aware", {}, true};
    } else if (item == "0") {
      p = {IdlePolicy::Kind::zero, KeepAlive::zero(), "0", "0"};
    } else if (item == "forever") {
      p = {IdlePolicy::Kind::forever, KeepAlive::forever(), "forever", "forever"};
    } else {
      return Status(ErrorCode::invalid_argument,
                    "unknown policy '" + printable(item) + "' in '" + printable(list) +
                        "'; accepted: a comma-separated list of off, keep-alive, pressure-aware, 0, forever");
    }
    for (const auto& q : out) {
      if (q.id == p.id) {
        return Status(ErrorCode::invalid_argument, "policy '" + p.id + "' is listed twice in '" + printable(list) + "'");
      }
    }
    out.push_back(std::move(p));
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  set_keep_alive(out, keep_alive);
  return out;
}

void set_keep_alive(std::vector<IdlePolicy>& policies, Nanos keep_alive) {
  for (IdlePolicy& p : policies) {
    if (p.kind != IdlePolicy::Kind::keep_alive) continue;
    p.keep_alive = KeepAlive::after(keep_alive);
    p.name = "keep-alive " + p.keep_alive.to_string() + (p.release_on_pressure ? " + pressure" : "");
  }
}

}  // namespace residency::workload
