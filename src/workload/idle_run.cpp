// `residency idle` as a library call (see idle_run.hpp).
#include "workload/idle_run.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "residency/backends/sim.hpp"
#include "residency/config.hpp"
#include "workload/cleanup.hpp"
#include "workload/decode_pass.hpp"
#include "workload/pressure.hpp"

namespace residency::workload {
namespace {

namespace fs = std::filesystem;

constexpr int kMaxIters = 1000;
constexpr unsigned kMaxThreads = 1024;
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
  *warning = first_writable + " is a memory filesystem (tmpfs): the model cannot be evicted there, so pressure "
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
      return Status(ErrorCode::io_error, "--out " + dir_ + ": cannot create the directory: " + ec.message());
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
  r.keep_alive = "2s";
  r.policies = "off,keep-alive";
  return r;
}

Result<IdleOptions> parse_idle_options(const IdleRequest& a) {
  IdleOptions o;
  const auto backends = idle_backends();
  if (std::find(backends.begin(), backends.end(), a.backend) == backends.end()) {
    std::string accepted;
    for (const auto& b : backends) accepted += (accepted.empty() ? "" : ", ") + b;
    return bad("unknown backend '" + a.backend + "'; this build accepts: " + accepted);
  }
  o.backend = a.backend;
  auto ka = parse_keep_alive(a.keep_alive);
  if (!ka) return bad("--keep-alive: " + ka.message());
  if (ka->kind != KeepAlive::Kind::duration) {
    return bad("--keep-alive '" + a.keep_alive +
               "': the keep-alive policy needs a duration above 0 (e.g. 2s, 180s); policies 0, forever and off are "
               "named in --policies");
  }
  auto policies = parse_policies(a.policies, ka->duration);
  if (!policies) return bad("--policies: " + policies.message());
  o.benchmark.policies = std::move(policies).value();
  o.benchmark.schedule = llama_idle_schedule();
  if (!a.pauses.empty()) {
    auto pauses = parse_pauses(a.pauses);
    if (!pauses) return bad(pauses.message());
    o.benchmark.schedule.pauses = *pauses;
  }
  if (a.iters < 1 || a.iters > kMaxIters) return bad("--iters " + std::to_string(a.iters) + ": accepted 1 to 1000");
  o.benchmark.schedule.iters = a.iters;
  if (a.threads > kMaxThreads) return bad("--threads " + std::to_string(a.threads) + ": accepted 0 (one per core) to 1024");
  if (a.backend != "sim" && (!a.profile.empty() || a.decaying_requests)) {
    return bad("--profile and --decaying-requests apply to --backend sim only");
  }
  o.pressure_text = !a.pressure.empty() ? a.pressure : (a.backend == "posix" ? "pageout" : "none");
  auto pressure = parse_pressure(o.pressure_text);
  if (!pressure) return bad("--pressure: " + pressure.message());
  o.benchmark.pressure = *pressure;
  o.benchmark.log_level = a.verbose ? LogLevel::info : LogLevel::warn;
  o.target.threads = a.threads;
  o.target.sim_profile = a.profile;
  o.target.sim_decaying_requests = a.decaying_requests;
  if (!a.model.empty()) {
    o.model_path = a.model;
  } else {
    auto size = parse_size(!a.model_size.empty() ? a.model_size : (a.backend == "sim" ? kDefaultSimModelSize : kDefaultModelSize));
    if (!size) return bad("--model-size: " + size.message());
    auto type = parse_model_type(a.type);
    if (!type) return bad("--type: " + type.message());
    auto shape = plan_llama_shape(*size, *type);
    if (!shape) return bad(shape.message());
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
    if (Status st = DecodePass::check(f->model()); !st) return bad(options.model_path + ": " + st.message());
    if (pressure.kind != Pressure::Kind::none && on_memory_filesystem(options.model_path)) {
      run->tmpfs_warning_ = options.model_path +
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
    const fs::path out(options.out_dir);
    const fs::path parent = out.has_parent_path() ? out.parent_path() : fs::path(".");
    if (fs::exists(out, ec) && !fs::is_directory(out, ec)) return bad("--out " + options.out_dir + ": is not a directory");
    if (!fs::exists(out, ec) && !fs::is_directory(parent, ec)) {
      return bad("--out " + options.out_dir + ": cannot create the directory: " + parent.string() + " does not exist");
    }
  }
  auto target = make_idle_target(options.backend, options.target);
  if (!target) return bad(target.message());
  if (Status st = (*target)->check_pressure(pressure); !st) return bad("--pressure " + options.pressure_text + ": " + st.message());
  run->target_ = std::move(target).value();
  run->options_ = std::move(options);
  return run;
}

Result<IdleOutcome> IdleRun::run(IdleReporter& reporter) {
  const IdleOptions& o = options_;
  // ---- from here on, files exist: RAII and the signal handlers remove them ----
  CleanupRegistry::install_signal_handlers();
  if (!tmpfs_warning_.empty()) reporter.warning(tmpfs_warning_);
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
    reporter.line("writing a synthetic model to " + model_path + ": " + o.synthetic->to_string());
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
  reporter.line("model: " + model_path + " (" + format_size(model.size()) + ", " + info.model_summary + ")");
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
  if (work && !named) work->keep();
  return outcome;
}

}  // namespace residency::workload
