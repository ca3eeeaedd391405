// SPDX-License-Identifier: MIT
// `residency idle` as a library call (see idle_run.hpp).
//
// One request, followed from the tool's run_idle down to the backend, goes back to reading the
// user's text twice, both name look-ups the tool cannot do without knowing every target: here,
// make_idle_target(options.backend) picks the target by the name the tool checked against
// idle_backends(); in the sim target, make_sim_idle_target looks up --profile (sim_profile()).
// Everything else (environment, policies, keep-alive, pauses, pressure, model size and type)
// arrives as values from tools/residency/idle_options.cpp, each read once.
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
#include "residency/text.hpp"
#include "workload/cleanup.hpp"
#include "workload/decode_pass.hpp"
#include "workload/pressure.hpp"

namespace residency::workload {
namespace {

namespace fs = std::filesystem;

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
  *warning = printable(first_writable) +
             " is a memory filesystem (tmpfs): the model cannot be evicted there, so pressure "
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

IdleRun::~IdleRun() = default;

Result<std::unique_ptr<IdleRun>> IdleRun::create(IdleOptions options) {
  std::unique_ptr<IdleRun> run(new IdleRun());
  const Pressure& pressure = options.benchmark.pressure;
  if (!options.model_path.empty()) {
    auto f = GgufFile::open(options.model_path);
    if (!f) return bad(f.message());
    if (Status st = DecodePass::check(f->model()); !st) return bad(printable(options.model_path) + ": " + st.message());
    if (pressure.kind != Pressure::Kind::none && on_memory_filesystem(options.model_path)) {
      run->tmpfs_warning_ =
          printable(options.model_path) +
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
    // why now. What they need (sizes of a sim run's files in docs/measurements.md): about 250
    // bytes a sample or warm-up in idle.json and idle.csv together, under 64 KiB for idle.png.
    // Checked: twice that, a block per file, and 64 KiB for the plot (when it does not fit after
    // all, the plot alone is left out, with a warning).
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
    info.model_summary = std::to_string(model.model().tensors.size()) + " tensors, " + std::to_string(matrices) +
                         " weight matrices";
  }
  info.backend = target_->describe();
  const IdleSchedule& schedule = o.benchmark.schedule;
  const auto& policies = o.benchmark.policies;
  std::string policy_names;
  for (const auto& p : policies) policy_names += (policy_names.empty() ? "" : ", ") + p.name;
  reporter.line("model: " + printable(model_path, 400) + " (" + format_size(model.size()) + ", " + info.model_summary +
                ")");
  reporter.line("backend: " + info.backend);
  // sim runs on virtual time and models its own model: say so instead of file sizes and minutes.
  const bool simulated = target_->virtual_clock() != nullptr;
  outcome.model_text = simulated
                           ? "profile " +
                                 (o.target.sim_profile.empty() ? sim_profile_names().front() : o.target.sim_profile) +
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
