// SPDX-License-Identifier: MIT
// `residency idle`'s command line, read once (see idle_options.hpp).
#include "idle_options.hpp"

#include <algorithm>
#include <initializer_list>
#include <utility>

#include "core/config_keys.hpp"
#include "residency/text.hpp"
#include "workload/gguf_writer.hpp"
#include "workload/idle_benchmark.hpp"
#include "workload/idle_target.hpp"
#include "workload/pressure.hpp"

namespace residency::tool {
namespace {

using namespace residency::workload;

// A synthetic model's size when none is given: 1 GiB reads long enough for pressure to show; the
// sim models its own model, so its placeholder file only needs to exist.
constexpr std::uint64_t kDefaultModelSize = 1ull << 30;
constexpr std::uint64_t kDefaultSimModelSize = 16ull << 20;

Status bad(std::string message) { return Status(ErrorCode::invalid_argument, std::move(message)); }

}  // namespace

IdleRequest idle_demo_request(IdleRequest base) {
  base.keep_alive_default = std::chrono::seconds(2);
  base.policies = "off,keep-alive";
  return base;
}

bool idle_option_keeps_demo(const std::string& names) {
  for (const char* output : {"--out", "--no-plot", "--verbose", "--iters", "--threads", "--help"})
    if (names.find(output) != std::string::npos) return true;
  return false;
}

Result<IdleOptions> parse_idle_options(const IdleRequest& a) {
  IdleOptions o;
  // The environment first: a bad RESIDENCY_* value is bad input even where an option overrides it.
  Config base;
  if (a.env) {
    auto c = Config::from_env(a.env);
    if (!c) return bad(c.message());
    base = std::move(c).value();
  }
  const auto backends = idle_backends();
  if (std::find(backends.begin(), backends.end(), a.backend) == backends.end()) {
    std::string accepted;
    for (const auto& b : backends) accepted += (accepted.empty() ? "" : ", ") + b;
    return bad("--backend: unknown backend '" + printable(a.backend) + "'; this build accepts: " + accepted);
  }
  o.backend = a.backend;
  // The policies' names first (their errors come before the duration's), read once; the
  // keep-alive policies get their duration below.
  auto policies = parse_policies(a.policies, std::chrono::seconds(1));
  if (!policies) return bad("--policies: " + policies.message());
  const bool uses_keep_alive = std::any_of(policies->begin(), policies->end(),
                                           [](const IdlePolicy& p) { return p.kind == IdlePolicy::Kind::keep_alive; });
  // The keep-alive policy's duration: --keep-alive, else the environment's, else the default.
  const bool env_keep_alive = core::config_key_set("keep_alive", a.env);  // RESIDENCY_KEEP_ALIVE or an alias
  KeepAlive ka;
  if (a.keep_alive) {
    auto k = parse_keep_alive(*a.keep_alive);
    if (!k) return bad("--keep-alive: " + k.message());
    if (!k->expires()) {
      return bad("--keep-alive '" + printable(*a.keep_alive) +
                 "': the keep-alive policy needs a duration above 0 (e.g. 2s, 180s); policies 0, forever and off are "
                 "named in --policies");
    }
    if (!uses_keep_alive)
      o.notes.push_back("--keep-alive is not used: --policies names no keep-alive or pressure-aware policy");
    ka = *k;
  } else if (env_keep_alive && uses_keep_alive) {
    if (!base.keep_alive.expires()) {
      return bad("the environment's keep-alive (RESIDENCY_KEEP_ALIVE or its alias) is " + base.keep_alive.to_string() +
                 ": the keep-alive policy needs a duration above 0; give --keep-alive (policies 0, forever and off are "
                 "named in --policies)");
    }
    ka = base.keep_alive;
  } else {
    ka = KeepAlive::after(a.keep_alive_default);
    if (!ka.expires()) return bad("keep-alive default " + ka.to_string() + " is not a duration above 0");
  }
  set_keep_alive(*policies, ka.duration);
  o.benchmark.policies = std::move(policies).value();
  if (core::config_key_set("release_on_pressure", a.env)) {
    o.notes.push_back(
        "RESIDENCY_RELEASE_ON_PRESSURE is not used: each column sets its own (the pressure-aware policy "
        "releases under pressure, the others do not)");
  }
  o.benchmark.schedule = llama_idle_schedule();
  if (a.pauses) {
    if (a.pauses->find_first_not_of(" \t") == std::string::npos) {
      return bad("--pauses '" + printable(*a.pauses) +
                 "': empty; give pauses in milliseconds (e.g. 0,800,1600), or leave the option out for llama-idle's "
                 "schedule");
    }
    auto pauses = parse_pauses(*a.pauses);
    if (!pauses) return bad(pauses.message());
    o.benchmark.schedule.pauses = *pauses;
  }
  if (a.iters < 1 || a.iters > kIdleMaxIters) {
    return bad("--iters " + std::to_string(a.iters) + ": out of range; accepted: 1 to " + std::to_string(kIdleMaxIters));
  }
  o.benchmark.schedule.iters = a.iters;
  if (a.threads > kIdleMaxThreads) {
    return bad("--threads " + std::to_string(a.threads) + ": out of range; accepted: 0 (one per core) to " +
               std::to_string(kIdleMaxThreads));
  }
  if (a.backend != "sim" && (!a.profile.empty() || a.decaying_requests)) {
    return bad("--profile and --decaying-requests apply to --backend sim only, not to --backend " + printable(a.backend));
  }
  o.pressure_text = a.pressure ? *a.pressure : (a.backend == "posix" ? "pageout" : "none");
  auto pressure = parse_pressure(o.pressure_text);
  if (!pressure) return bad("--pressure: " + pressure.message());
  o.benchmark.pressure = *pressure;
  const bool env_log = core::config_key_set("log", a.env);  // RESIDENCY_LOG or MLX_RESIDENCY_DEBUG
  o.benchmark.log_level = a.verbose ? std::max(LogLevel::info, env_log ? base.log_level : LogLevel::info)
                                    : (env_log ? base.log_level : LogLevel::warn);
  o.benchmark.config = base;
  for (const auto& note : base.notes) o.notes.push_back(note);
  o.target.threads = a.threads;
  o.target.sim_profile = a.profile;
  o.target.sim_decaying_requests = a.decaying_requests;
  if (!a.model.empty()) {
    if (a.model_size || a.type) {
      return bad(std::string(a.model_size ? "--model-size" : "--type") +
                 " describes the synthetic model, but MODEL was given (" + printable(a.model) +
                 "); leave out one or the other");
    }
    o.model_path = a.model;
  } else {
    std::uint64_t size = a.backend == "sim" ? kDefaultSimModelSize : kDefaultModelSize;
    if (a.model_size) {
      auto given = parse_size(*a.model_size);
      if (!given) return bad("--model-size: " + given.message());
      size = *given;
    }
    GgmlType type = GgmlType::f16;
    if (a.type) {
      auto given = parse_model_type(*a.type);
      if (!given) return bad("--type: " + given.message());
      type = *given;
    }
    auto shape = plan_llama_shape(size, type);
    if (!shape) return bad("--model-size: " + shape.message());
    o.synthetic = *shape;
  }
  o.out_dir = a.out;
  o.plot = a.plot;
  return o;
}

}  // namespace residency::tool
