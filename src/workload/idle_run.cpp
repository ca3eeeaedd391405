// SPDX-License-Identifier: MIT
// `residency idle` as a library call (see idle_run.hpp).
#include "workload/idle_run.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "core/config_keys.hpp"
#include "residency/backends/sim.hpp"
#include "residency/config.hpp"
#include "residency/text.hpp"
#include "workload/cleanup.hpp"
#include "workload/decode_pass.hpp"
#include "workload/pressure.hpp"

namespace residency::workload {
namespace {

namespace fs = std::filesystem;

// A synthetic model's size when none is given: 1 GiB reads long enough for pressure to show; the
// sim models its own model, so its placeholder file only needs to exist.
constexpr const char* kDefaultModelSize = "1GiB";
constexpr const char* kDefaultSimModelSize = "16MiB";
constexpr const char* kTempPrefix = "residency-idle-";

Status bad(std::string message) { return Status(ErrorCode::invalid_argument, std::move(message)); }

std::string minutes_seconds(double s) {
  const auto total = static_cast<long>(std::lround(std::max(0.0, s)));
  char buf[32];
  std::snprintf(buf, sizeof buf, "%ld:%02ld", total / 60, total % 60);
  return buf;
}

std::string join_pauses(const IdleSchedule& s) {
  std::string out;
  for (Nanos p : s.pauses) out += (out.empty() ? "" : ", ") + std::to_string(p.count() / 1'000'000);
  return out + " ms";
}

// Where temporary files go: a disk-backed temporary directory. A model on tmpfs lives in memory
// and cannot be evicted without swap, which would hide exactly what is measured. `warning` says
// so when only a memory filesystem is writable.
std::string temp_parent_dir(std::string* warning) {
  std::vector<std::string> candidates;
  if (const char* t = std::getenv("TMPDIR"); t && *t) candidates.emplace_back(t);
  candidates.emplace_back("/var/tmp");
  candidates.emplace_back("/tmp");
  std::string first_writable;
  for (const auto& c : candidates) {
    if (access(c.c_str(), W_OK | X_OK) != 0) continue;
    if (first_writable.empty()) first_writable = c;
    if (!on_memory_filesystem(c)) return c;
  }
  if (first_writable.empty()) return "/tmp";
  *warning = printable(first_writable) + " is a memory filesystem (tmpfs): the model cannot be evicted there, so pressure "
             "will not show; set TMPDIR to a directory on disk";
  return first_writable;
}

// Result files written into a directory the user named: removed again (and the directory, if
// this run made it) unless the run commits them.
class OutputDir {
 public:
  explicit OutputDir(std::string dir) : dir_(std::move(dir)) {}
  OutputDir(const OutputDir&) = delete;
  OutputDir& operator=(const OutputDir&) = delete;
  ~OutputDir() {
    if (committed_) return;
    for (auto& [file, slot] : files_) {
      std::remove(file.c_str());
      CleanupRegistry::forget(slot);
    }
    if (created_dir_) {
      std::error_code ec;
      fs::remove(dir_, ec);  // only if empty
    }
    CleanupRegistry::forget(dir_slot_);
  }
  Status create() {
    std::error_code ec;
    if (fs::is_directory(dir_, ec)) return {};
    if (!fs::create_directory(dir_, ec)) {
      return Status(ErrorCode::io_error, "--out " + printable(dir_) + ": cannot create the directory: " + ec.message());
    }
    created_dir_ = true;
    dir_slot_ = CleanupRegistry::add(dir_);
    return {};
  }
  std::string file(const std::string& name) {
    std::string path = dir_ + "/" + name;
    files_.emplace_back(path, CleanupRegistry::add(path));
    return path;
  }
  void commit() {
    committed_ = true;
    for (auto& f : files_) CleanupRegistry::forget(f.second);
    CleanupRegistry::forget(dir_slot_);
  }

 private:
  std::string dir_;
  std::vector<std::pair<std::string, int>> files_;
  bool created_dir_ = false;
  int dir_slot_ = -1;
  bool committed_ = false;
};

}  // namespace

IdleRequest idle_demo_request() {
  IdleRequest r;
  r.keep_alive_default = "2s";
  r.policies = "off,keep-alive";
  return r;
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
    return bad("unknown backend '" + printable(a.backend) + "'; this build accepts: " + accepted);
  }
  o.backend = a.backend;
  // The keep-alive policy's duration: --keep-alive, else the environment's, else the default.
  const bool env_keep_alive = core::config_key_set("keep_alive", a.env);  // RESIDENCY_KEEP_ALIVE or an alias
  auto policies = parse_policies(a.policies, std::chrono::seconds(1));  // names first; the duration below
  if (!policies) return bad("--policies: " + policies.message());
  const bool uses_keep_alive = std::any_of(policies->begin(), policies->end(),
                                           [](const IdlePolicy& p) { return p.kind == IdlePolicy::Kind::keep_alive; });
  KeepAlive ka;
  if (a.keep_alive) {
    auto k = parse_keep_alive(*a.keep_alive);
    if (!k) return bad("--keep-alive: " + k.message());
    if (k->kind != KeepAlive::Kind::duration) {
      return bad("--keep-alive '" + printable(*a.keep_alive) +
                 "': the keep-alive policy needs a duration above 0 (e.g. 2s, 180s); policies 0, forever and off are "
                 "named in --policies");
    }
    if (!uses_keep_alive) o.notes.push_back("--keep-alive is not used: --policies names no keep-alive or pressure-aware policy");
    ka = *k;
  } else if (env_keep_alive && uses_keep_alive) {
    if (base.keep_alive.kind != KeepAlive::Kind::duration) {
      return bad("the environment's keep-alive (RESIDENCY_KEEP_ALIVE or its alias) is " + base.keep_alive.to_string() +
                 ": the keep-alive policy needs a duration above 0; give --keep-alive (policies 0, forever and off are "
                 "named in --policies)");
    }
    ka = base.keep_alive;
  } else {
    auto k = parse_keep_alive(a.keep_alive_default);
    if (!k || k->kind != KeepAlive::Kind::duration) return bad("keep-alive default '" + printable(a.keep_alive_default) + "' is not a duration");
    ka = *k;
  }
  policies = parse_policies(a.policies, ka.duration);
  if (!policies) return bad("--policies: " + policies.message());
  o.benchmark.policies = std::move(policies).value();
  if (core::config_key_set("release_on_pressure", a.env)) {
    o.notes.push_back("RESIDENCY_RELEASE_ON_PRESSURE is not used: each column sets its own (the pressure-aware policy "
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
    return bad("--iters " + std::to_string(a.iters) + ": accepted 1 to " + std::to_string(kIdleMaxIters));
  }
  o.benchmark.schedule.iters = a.iters;
  if (a.threads > kIdleMaxThreads) {
    return bad("--threads " + std::to_string(a.threads) + ": accepted 0 (one per core) to " + std::to_string(kIdleMaxThreads));
  }
  if (a.backend != "sim" && (!a.profile.empty() || a.decaying_requests)) {
    return bad("--profile and --decaying-requests apply to --backend sim only");
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
    auto size = parse_size(a.model_size ? *a.model_size : (a.backend == "sim" ? kDefaultSimModelSize : kDefaultModelSize));
    if (!size) return bad("--model-size: " + size.message());
    auto type = parse_model_type(a.type ? *a.type : "f16");
    if (!type) return bad("--type: " + type.message());
    auto shape = plan_llama_shape(*size, *type);
    if (!shape) return bad("--model-size: " + shape.message());
    o.synthetic = *shape;
  }
  o.out_dir = a.out;
  o.plot = a.plot;
  return o;
}

IdleRun::~IdleRun() = default;

Result<std::unique_ptr<IdleRun>> IdleRun::create(IdleOptions options) {
  std::unique_ptr<IdleRun> run(new IdleRun());
  const Pressure& pressure = options.benchmark.pressure;
  if (!options.model_path.empty()) {
    auto f = GgufFile::open(options.model_path);
    if (!f) return bad(f.message());
    if (Status st = DecodePass::check(f->model()); !st) return bad(printable(options.model_path) + ": " + st.message());
    if (pressure.kind != Pressure::Kind::none && on_memory_filesystem(options.model_path)) {
      run->tmpfs_warning_ = printable(options.model_path) +
                            " is on a memory filesystem (tmpfs): its pages cannot be evicted, so pressure will not show";
    }
    run->user_model_ = std::move(f).value();
  } else {
    run->model_parent_ = temp_parent_dir(&run->tmpfs_warning_);
    auto layout = llama_builder(*options.synthetic, kSyntheticSeed).layout();
    if (!layout) return Status(ErrorCode::invalid_argument, layout.message());
    if (Status st = check_free_space(run->model_parent_, layout->file_size); !st) return bad(st.message());
  }
  if (options.out_dir.empty() && options.model_path.empty()) {
    run->results_parent_ = run->model_parent_;  // next to the synthetic model
  } else if (options.out_dir.empty()) {
    std::string ignored;  // results are small: a memory filesystem is fine for them
    run->results_parent_ = temp_parent_dir(&ignored);
  }
  if (!options.out_dir.empty()) {
    std::error_code ec;
    const std::string shown = "--out " + printable(options.out_dir);
    const fs::path out(options.out_dir);
    const fs::path parent = out.has_parent_path() ? out.parent_path() : fs::path(".");
    if (fs::exists(out, ec) && !fs::is_directory(out, ec)) return bad(shown + ": is not a directory");
    if (!fs::exists(out, ec) && !fs::is_directory(parent, ec)) {
      return bad(shown + ": cannot create the directory: " + printable(parent.string()) + " does not exist");
    }
    // Results of a long run must not be lost at its end: the directory takes them, or this says
    // why now. What they need, measured (2026-12-02, --backend sim): idle.json 1.3 KB for one
    // sample and 21 KB for 96 (about 210 bytes a sample or warm-up), idle.csv about 40 bytes a
    // sample, idle.png 29 to 46 KB. Checked: twice that, a block per file, and 64 KiB for the
    // plot (when it does not fit after all, the plot alone is left out, with a warning).
    const std::uint64_t samples = options.benchmark.schedule.pauses.size() * options.benchmark.policies.size() *
                                  static_cast<std::uint64_t>(options.benchmark.schedule.iters + 1);
    const std::uint64_t results_bytes = (8u << 10) + 512 * samples + 3 * (4u << 10) + (options.plot ? (64u << 10) : 0);
    if (Status st = check_writable(fs::is_directory(out, ec) ? out.string() : parent.string(), results_bytes, shown); !st) {
      return bad(st.message());
    }
  }
  auto target = make_idle_target(options.backend, options.target);
  if (!target) return bad(target.message());
  if (Status st = (*target)->check_pressure(pressure); !st) {
    return bad("--pressure " + printable(options.pressure_text) + ": " + st.message());
  }
  run->target_ = std::move(target).value();
  run->options_ = std::move(options);
  return run;
}

Result<IdleOutcome> IdleRun::run(IdleReporter& reporter) {
  const IdleOptions& o = options_;
  // ---- from here on, files exist: RAII and the signal handlers remove them ----
  CleanupRegistry::install_signal_handlers();
  if (!tmpfs_warning_.empty()) reporter.warning(tmpfs_warning_);
  for (const auto& note : o.notes) reporter.note(note);
  std::optional<OutputDir> named;
  if (!o.out_dir.empty()) {
    named.emplace(o.out_dir);
    if (Status st = named->create(); !st) return st;
  }
  std::optional<TempDir> work;  // the synthetic model, and the results when no directory was named
  if (o.synthetic || !named) {
    auto dir = TempDir::create(o.synthetic ? model_parent_ : results_parent_, kTempPrefix);
    if (!dir) return dir.status();
    work.emplace(std::move(dir).value());
  }
  std::string model_path = o.model_path;
  std::optional<GgufFile> synthetic;
  if (o.synthetic) {
    model_path = work->track("model.gguf");
    reporter.line("writing a synthetic model to " + printable(model_path, 400) + ": " + o.synthetic->to_string());
    const auto t0 = std::chrono::steady_clock::now();
    if (Status st = write_synthetic_model(model_path, *o.synthetic, kSyntheticSeed, o.target.threads); !st) return st;
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.1f s", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    auto f = GgufFile::open(model_path);
    if (!f) return f.status();
    synthetic = std::move(f).value();
    reporter.line("  " + format_size(synthetic->size()) + " written in " + buf);
  }
  const GgufFile& model = synthetic ? *synthetic : *user_model_;
  if (Status st = target_->prepare(model); !st) return st;

  IdleOutcome outcome;
  IdleRunInfo& info = outcome.info;
  info.model_path = model_path;
  info.synthetic_model = o.synthetic.has_value();
  info.model_bytes = model.size();
  if (o.synthetic) {
    info.model_summary = o.synthetic->to_string();
  } else {
    std::size_t matrices = 0;
    for (const auto& t : model.model().tensors) matrices += t.n_dims >= 2;
    info.model_summary =
        std::to_string(model.model().tensors.size()) + " tensors, " + std::to_string(matrices) + " weight matrices";
  }
  info.backend = target_->describe();
  const IdleSchedule& schedule = o.benchmark.schedule;
  const auto& policies = o.benchmark.policies;
  std::string policy_names;
  for (const auto& p : policies) policy_names += (policy_names.empty() ? "" : ", ") + p.name;
  reporter.line("model: " + printable(model_path, 400) + " (" + format_size(model.size()) + ", " + info.model_summary + ")");
  reporter.line("backend: " + info.backend);
  // sim runs on virtual time and models its own model: say so instead of file sizes and minutes.
  const bool simulated = target_->virtual_clock() != nullptr;
  outcome.model_text = simulated ? "profile " + (o.target.sim_profile.empty() ? sim_profile_names().front() : o.target.sim_profile) +
                                       ", modelled"
                                 : format_size(model.size()) + " model";
  reporter.line("policies: " + policy_names + "; pressure: " + o.benchmark.pressure.to_string() +
                "; pauses: " + join_pauses(schedule) + ", " + std::to_string(schedule.iters) + " iterations each (" +
                (simulated ? std::string("virtual time")
                           : "at least " + minutes_seconds(estimate_seconds(schedule, policies.size(), 0)) + " of pauses") +
                ")");

  IdleBenchmarkOptions bench = o.benchmark;
  bench.log = [&reporter](LogLevel level, std::string_view message) { reporter.log(level, message); };
  reporter.run_starts(schedule, policies.size());
  auto results = run_idle_benchmark(*target_, bench, &reporter);
  reporter.run_ends();
  if (!results) return results.status();
  outcome.results = std::move(results).value();

  auto result_path = [&](const std::string& name) { return named ? named->file(name) : work->track(name); };
  const std::string json_path = result_path("idle.json");
  if (Status st = write_idle_json(json_path, outcome.results, info); !st) return st;
  outcome.files.push_back(json_path);
  const std::string csv_path = result_path("idle.csv");
  if (Status st = write_idle_csv(csv_path, outcome.results); !st) return st;
  outcome.files.push_back(csv_path);
  if (o.plot) {
    const std::string png_path = result_path("idle.png");
    const std::string why = write_idle_plot(png_path, outcome.results, info);
    if (why.empty()) {
      outcome.files.push_back(png_path);
    } else {
      reporter.warning(why);
    }
  }
  outcome.out_dir = named ? o.out_dir : work->path();
  if (named) named->commit();
  if (o.synthetic) {
    synthetic.reset();  // unmap before removing
    work->remove("model.gguf");
    outcome.synthetic_model_removed = true;
  }
  // With a named directory nothing of ours is left in the temporary one: it goes with the TempDir.
  if (work && !named) {
    const std::string tagged = work->path();
    work->keep();  // renamed: without its owner tag, no later run takes it for a dead run's leftover
    for (auto& f : outcome.files) f = work->path() + f.substr(tagged.size());
    outcome.out_dir = work->path();
  }
  return outcome;
}

}  // namespace residency::workload
