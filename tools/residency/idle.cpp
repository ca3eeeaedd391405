// residency idle: llama.cpp's llama-idle benchmark on a GGUF model, with memory pressure and the
// residency policies measured side by side. The project's main command.
//
// With no arguments it is a self-contained demonstration: it writes a 1 GiB synthetic llama model
// to a temporary directory, compares keep-alive 2 s with `off` under `pageout` pressure, prints
// llama-idle's lines and a table, writes JSON, CSV and a PNG plot, removes the model and says
// where the results are. Every input is checked before anything is created, so bad input gives
// one line, exit status 2 and no files; every file created is removed on errors and on
// SIGINT/SIGTERM (workload/cleanup.hpp).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "command.hpp"
#include "idle_report.hpp"
#include "residency/config.hpp"
#include "workload/cleanup.hpp"
#include "workload/decode_pass.hpp"
#include "workload/gguf.hpp"
#include "workload/gguf_writer.hpp"
#include "workload/idle_benchmark.hpp"
#include "workload/idle_target.hpp"
#include "residency/backends/sim.hpp"
#include "workload/pressure.hpp"

namespace residency::tool {
namespace {

namespace fs = std::filesystem;
using namespace residency::workload;

// The no-argument demonstration: a keep-alive short enough that the default pauses (up to 4 s)
// cross it, so one run shows both sides of it.
constexpr const char* kDemoKeepAlive = "2s";
constexpr const char* kDemoPolicies = "off,keep-alive";
constexpr int kMaxIters = 1000;
constexpr unsigned kMaxThreads = 1024;

struct IdleArgs {
  std::string model;
  std::string backend = "posix";
  std::string policies = "off,keep-alive,0,forever";
  std::string keep_alive = "180s";
  std::string pressure;  // empty: pageout on posix, none elsewhere (pressure is a posix notion)
  std::string pauses;  // empty: llama-idle's
  int iters = 3;
  std::string out;
  std::string model_size;  // empty: 1 GiB, or 16 MiB for --backend sim (which models its own size)
  std::string profile;     // --backend sim only
  bool decaying_requests = false;  // --backend sim only
  std::string type = "f16";
  unsigned threads = 0;
  bool no_plot = false;
  bool verbose = false;
};

std::string minutes_seconds(double s) {
  const auto total = static_cast<long>(std::lround(std::max(0.0, s)));
  char buf[32];
  std::snprintf(buf, sizeof buf, "%ld:%02ld", total / 60, total % 60);
  return buf;
}

// Where a synthetic model goes: a disk-backed temporary directory. A model on tmpfs lives in
// memory and cannot be evicted without swap, which would hide exactly what is measured.
std::string model_parent_dir(std::string* warning) {
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

// Prints llama-idle's lines on stdout, warnings and the progress bar on stderr. Thread-safe:
// the managers log from their scheduler threads.
class Console final : public IdleObserver {
 public:
  Console(bool progress, bool verbose) : progress_(progress), verbose_(verbose) {}

  void out(const std::string& line) {
    std::lock_guard<std::mutex> g(m_);
    clear_bar();
    std::fputs((line + "\n").c_str(), stdout);
    std::fflush(stdout);
    draw_bar();
  }
  void warn(const std::string& line) { log(LogLevel::warn, line); }
  void log(LogLevel level, std::string_view message) {
    if (level > (verbose_ ? LogLevel::info : LogLevel::warn)) return;
    std::lock_guard<std::mutex> g(m_);
    clear_bar();
    std::fprintf(stderr, "residency idle: %s: %.*s\n", to_string(level), static_cast<int>(message.size()), message.data());
    draw_bar();
  }
  void start(const IdleSchedule& s, std::size_t policies) {
    std::lock_guard<std::mutex> g(m_);
    total_ = s.pauses.size() * policies * static_cast<std::size_t>(s.iters + 1);
    for (Nanos p : s.pauses) pause_left_ms_ += static_cast<double>(policies * static_cast<std::size_t>(s.iters)) * static_cast<double>(p.count()) / 1e6;
  }
  void finish() {
    std::lock_guard<std::mutex> g(m_);
    clear_bar();
    progress_ = false;
  }

  void block_start(const IdleResults& r, std::size_t policy, std::size_t pause, std::size_t, std::size_t) override {
    label_ = r.policies[policy].name + ", pause " + std::to_string(r.schedule.pauses[pause].count() / 1'000'000) + " ms";
    out("policy " + label_ + ":");
  }
  void warmup(const IdleResults&, const IdleWarmup& w) override {
    char buf[64];
    std::snprintf(buf, sizeof buf, "  warm-up decode: %8.2f ms", w.decode_ms);
    account(w.decode_ms, 0);
    out(buf);
  }
  void pausing(const IdleResults&, std::size_t, std::size_t, int) override {}
  void sample(const IdleResults& r, const IdleSample& s) override {
    account(s.decode_ms + s.pressure_ms, static_cast<double>(r.schedule.pauses[s.pause].count()) / 1e6);
    out(format_decode_line(s.decode_ms));
  }
  void block_end(const IdleResults& r, std::size_t policy, std::size_t pause) override {
    out(format_summary_line(r.cell(policy, pause), r.schedule.pauses[pause]));
  }

 private:
  void account(double busy_ms, double pause_ms) {
    std::lock_guard<std::mutex> g(m_);
    ++done_;
    busy_ms_ += busy_ms;
    pause_left_ms_ -= pause_ms;
  }
  // Both called with m_ held.
  void clear_bar() {
    if (progress_ && drawn_) std::fputs("\r\033[K", stderr);
    drawn_ = false;
  }
  void draw_bar() {
    if (!progress_ || total_ == 0) return;
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(kWidth * done_ / total_);
    const double per_decode = done_ ? busy_ms_ / static_cast<double>(done_) : 0.0;
    const double left_s = (pause_left_ms_ + per_decode * static_cast<double>(total_ - done_)) / 1000.0;
    std::fprintf(stderr, "\r[%s%s] %zu/%zu decodes  %s  ~%s left\033[K", std::string(filled, '#').c_str(),
                 std::string(kWidth - filled, '.').c_str(), done_, total_, label_.c_str(), minutes_seconds(left_s).c_str());
    std::fflush(stderr);
    drawn_ = true;
  }

  std::mutex m_;
  bool progress_, verbose_;
  bool drawn_ = false;
  std::size_t total_ = 0, done_ = 0;
  double busy_ms_ = 0, pause_left_ms_ = 0;
  std::string label_;
};

// Result files written into a directory the user named: removed again if the run fails.
class OutputFiles {
 public:
  explicit OutputFiles(std::string dir) : dir_(std::move(dir)) {}
  ~OutputFiles() {
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
  void create_dir() {
    std::error_code ec;
    if (fs::is_directory(dir_, ec)) return;
    if (!fs::create_directory(dir_, ec)) throw BadInput("--out " + dir_ + ": cannot create the directory: " + ec.message());
    created_dir_ = true;
    dir_slot_ = CleanupRegistry::add(dir_);
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

std::string join_pauses(const IdleSchedule& s) {
  std::string out;
  for (Nanos p : s.pauses) out += (out.empty() ? "" : ", ") + std::to_string(p.count() / 1'000'000);
  return out + " ms";
}

int run_idle(IdleArgs a, bool no_arguments) {
  if (no_arguments) {
    a.keep_alive = kDemoKeepAlive;
    a.policies = kDemoPolicies;
  }
  // ---- every input checked before anything is created ----
  const auto backends = idle_backends();
  if (std::find(backends.begin(), backends.end(), a.backend) == backends.end()) {
    std::string accepted;
    for (const auto& b : backends) accepted += (accepted.empty() ? "" : ", ") + b;
    throw BadInput("unknown backend '" + a.backend + "'; this build accepts: " + accepted);
  }
  auto ka = parse_keep_alive(a.keep_alive);
  if (!ka) throw BadInput("--keep-alive: " + ka.message());
  if (ka->kind != KeepAlive::Kind::duration) {
    throw BadInput("--keep-alive '" + a.keep_alive +
                   "': the keep-alive policy needs a duration above 0 (e.g. 2s, 180s); policies 0, forever and "
                   "off are named in --policies");
  }
  auto policies = parse_policies(a.policies, ka->duration);
  if (!policies) throw BadInput("--policies: " + policies.message());
  IdleSchedule schedule = llama_idle_schedule();
  if (!a.pauses.empty()) {
    auto pauses = parse_pauses(a.pauses);
    if (!pauses) throw BadInput(pauses.message());
    schedule.pauses = *pauses;
  }
  if (a.iters < 1 || a.iters > kMaxIters) throw BadInput("--iters " + std::to_string(a.iters) + ": accepted 1 to 1000");
  schedule.iters = a.iters;
  if (a.threads > kMaxThreads) throw BadInput("--threads " + std::to_string(a.threads) + ": accepted 0 (one per core) to 1024");
  if (a.backend != "sim" && (!a.profile.empty() || a.decaying_requests)) {
    throw BadInput("--profile and --decaying-requests apply to --backend sim only");
  }
  if (a.pressure.empty()) a.pressure = a.backend == "posix" ? "pageout" : "none";
  auto pressure = parse_pressure(a.pressure);
  if (!pressure) throw BadInput("--pressure: " + pressure.message());

  std::optional<GgufFile> user_model;
  std::optional<LlamaShape> shape;
  std::string model_dir_parent, tmpfs_warning;
  if (!a.model.empty()) {
    auto f = GgufFile::open(a.model);
    if (!f) throw BadInput(f.message());
    if (Status st = DecodePass::check(f->model()); !st) throw BadInput(a.model + ": " + st.message());
    if (pressure->kind != Pressure::Kind::none && on_memory_filesystem(a.model)) {
      tmpfs_warning = a.model + " is on a memory filesystem (tmpfs): its pages cannot be evicted, so pressure will not show";
    }
    user_model = std::move(f).value();
  } else {
    auto size = parse_size(!a.model_size.empty() ? a.model_size : (a.backend == "sim" ? "16MiB" : "1GiB"));
    if (!size) throw BadInput("--model-size: " + size.message());
    auto type = parse_model_type(a.type);
    if (!type) throw BadInput("--type: " + type.message());
    auto s = plan_llama_shape(*size, *type);
    if (!s) throw BadInput(s.message());
    shape = *s;
    model_dir_parent = model_parent_dir(&tmpfs_warning);
    auto layout = llama_builder(*shape, kSyntheticSeed).layout();
    if (!layout) throw std::runtime_error(layout.message());
    if (Status st = check_free_space(model_dir_parent, layout->file_size); !st) throw BadInput(st.message());
  }

  const bool progress = isatty(STDERR_FILENO) != 0;
  Console console(progress, a.verbose);
  IdleTargetOptions topts;
  topts.threads = a.threads;
  topts.log_level = a.verbose ? LogLevel::info : LogLevel::warn;
  topts.log = [&console](LogLevel level, std::string_view msg) { console.log(level, msg); };
  topts.sim_profile = a.profile;
  topts.sim_decaying_requests = a.decaying_requests;
  auto target = make_idle_target(a.backend, topts);
  if (!target) throw BadInput(target.message());
  if (Status st = (*target)->check_pressure(*pressure); !st) throw BadInput("--pressure " + a.pressure + ": " + st.message());

  // ---- from here on, files exist: RAII and the signal handlers remove them ----
  CleanupRegistry::install_signal_handlers();
  if (!tmpfs_warning.empty()) console.warn(tmpfs_warning);
  std::optional<TempDir> work;
  std::optional<OutputFiles> outputs;
  if (!a.out.empty()) {
    outputs.emplace(a.out);
    outputs->create_dir();
  }
  std::string model_path = a.model;
  std::optional<GgufFile> synthetic;
  if (shape) {
    auto dir = TempDir::create(model_dir_parent, "residency-idle-");
    if (!dir) throw std::runtime_error(dir.message());
    work.emplace(std::move(dir).value());
    model_path = work->track("model.gguf");
    console.out("writing a synthetic model to " + model_path + ": " + shape->to_string());
    const auto t0 = std::chrono::steady_clock::now();
    if (Status st = write_synthetic_model(model_path, *shape, kSyntheticSeed, a.threads); !st) {
      throw std::runtime_error(st.message());
    }
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.1f s", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    auto f = GgufFile::open(model_path);
    if (!f) throw std::runtime_error(f.message());
    synthetic = std::move(f).value();
    console.out("  " + format_size(synthetic->size()) + " written in " + buf);
  }
  const GgufFile& model = synthetic ? *synthetic : *user_model;
  if (Status st = (*target)->prepare(model); !st) throw std::runtime_error(st.message());

  IdleRunInfo info;
  info.model_path = model_path;
  info.synthetic_model = shape.has_value();
  info.model_bytes = model.size();
  if (shape) {
    info.model_summary = shape->to_string();
  } else {
    std::size_t matrices = 0;
    for (const auto& t : model.model().tensors) matrices += t.n_dims >= 2;
    info.model_summary = std::to_string(model.model().tensors.size()) + " tensors, " + std::to_string(matrices) + " weight matrices";
  }
  info.backend = (*target)->describe();
  std::string policy_names;
  for (const auto& p : *policies) policy_names += (policy_names.empty() ? "" : ", ") + p.name;
  console.out("model: " + model_path + " (" + format_size(model.size()) + ", " + info.model_summary + ")");
  console.out("backend: " + info.backend);
  // sim runs on virtual time and models its own model: say so instead of file sizes and minutes.
  const bool simulated = a.backend == "sim";
  const std::string model_text =
      simulated ? "profile " + (a.profile.empty() ? residency::sim_profile_names().front() : a.profile) + ", modelled"
                : format_size(model.size()) + " model";
  console.out("policies: " + policy_names + "; pressure: " + pressure->to_string() + "; pauses: " + join_pauses(schedule) +
              ", " + std::to_string(schedule.iters) + " iterations each (" +
              (simulated ? std::string("virtual time") :
                           "at least " + minutes_seconds(estimate_seconds(schedule, policies->size(), 0)) + " of pauses") + ")");

  console.start(schedule, policies->size());
  auto results = run_idle_benchmark(**target, schedule, *policies, *pressure, &console);
  console.finish();
  if (!results) throw std::runtime_error(results.message());

  std::printf("\ndecode time after a pause, ms (mean +/- sd of %d; pressure %s; %s)\n%s", schedule.iters,
              pressure->to_string().c_str(), model_text.c_str(), format_idle_table(*results).c_str());

  // Results go to --out, or next to the model in the temporary directory (kept, model removed).
  auto result_path = [&](const std::string& name) { return outputs ? outputs->file(name) : work->track(name); };
  const std::string json_path = result_path("idle.json");
  const std::string csv_path = result_path("idle.csv");
  write_idle_json(json_path, *results, info);
  write_idle_csv(csv_path, *results);
  std::string png_path;
  if (!a.no_plot) {
    png_path = result_path("idle.png");
    const std::string why = write_idle_plot(png_path, *results, info);
    if (!why.empty()) {
      console.warn(why);
      png_path.clear();
    }
  }
  std::printf("\nresults:\n  %s\n  %s\n", json_path.c_str(), csv_path.c_str());
  if (!png_path.empty()) std::printf("  %s\n", png_path.c_str());
  if (outputs) outputs->commit();
  if (work) {
    synthetic.reset();  // unmap before removing
    work->remove("model.gguf");
    if (outputs) {
      // nothing of ours is left in the temporary directory: it goes with the TempDir
    } else {
      work->keep();
    }
    std::printf("the synthetic model was removed\n");
  }
  std::printf("ran in %s\n", minutes_seconds(results->wall_seconds).c_str());
  return kExitOk;
}

const Command idle_command{
    "idle",
    "llama-idle on a GGUF model: decode time after pauses, residency policies side by side, under memory pressure",
    [](CLI::App& app) {
      auto a = std::make_shared<IdleArgs>();
      app.footer(
          "With no arguments: writes a 1 GiB synthetic model to a temporary directory, runs\n"
          "  residency idle --policies off,keep-alive --keep-alive 2s --pressure pageout\n"
          "on it, prints the table and the result files, and removes the model.\n"
          "Policies: off (no residency management), keep-alive (resident until --keep-alive after the last\n"
          "decode), 0 (wired only during each decode), forever. Pressure is applied at the end of each\n"
          "pause longer than 0: pageout (the kernel reclaims every unlocked page of the model), hog:SIZE\n"
          "(a second process allocates and touches SIZE; the kernel reclaims only what it needs, and the\n"
          "model's cached pages count as available memory, so SIZE must come close to MemAvailable to\n"
          "evict them), none.");
      app.add_option("MODEL", a->model, "GGUF model (F32, F16, BF16 or Q8_0 weights); default: a synthetic one");
      app.add_option("--backend", a->backend, "where to decode: " + [] {
        std::string s;
        for (const auto& b : idle_backends()) s += (s.empty() ? "" : ", ") + b;
        return s;
      }())->capture_default_str();
      app.add_option("--policies", a->policies, "comma-separated: off, keep-alive, 0, forever")->capture_default_str();
      app.add_option("--keep-alive", a->keep_alive, "duration of the keep-alive policy (500ms, 2s, 3m ...)")
          ->capture_default_str();
      app.add_option("--pressure", a->pressure,
                     "none, pageout or hog:SIZE (e.g. hog:8GiB); default pageout with --backend posix, else none");
      app.add_option("--pauses", a->pauses, "comma-separated pauses in ms (default 0,800,1600,2400,3200,4000)");
      app.add_option("--iters", a->iters, "iterations per pause and policy")->capture_default_str();
      app.add_option("--out", a->out, "directory for idle.json, idle.csv, idle.png (default: a new temporary directory)");
      app.add_option("--model-size", a->model_size, "size of the synthetic model (default 1GiB; 16MiB for --backend sim)");
      app.add_option("--profile", a->profile, "--backend sim: machine and model, one of " + [] {
        std::string names;
        for (const auto& n : residency::sim_profile_names()) names += (names.empty() ? "" : ", ") + n;
        return names;
      }() + " (default: the first)");
      app.add_flag("--decaying-requests", a->decaying_requests,
                   "--backend sim: residency requests decay ~1 s after use unless refreshed (macOS 26)");
      app.add_option("--type", a->type, "weight type of the synthetic model: f32, f16, bf16, q8_0")->capture_default_str();
      app.add_option("--threads", a->threads, "decode threads (0 = one per core)");
      app.add_flag("--no-plot", a->no_plot, "do not draw idle.png");
      app.add_flag("-v,--verbose", a->verbose, "also print the managers' info lines (each release and re-wire)");
      CLI::App* self = &app;
      return [a, self] {
        std::size_t given = 0;
        for (const CLI::Option* opt : self->get_options()) given += opt->count();
        return run_idle(*a, given == 0);
      };
    }};

}  // namespace
}  // namespace residency::tool
