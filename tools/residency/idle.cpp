// SPDX-License-Identifier: MIT
// residency idle: llama.cpp's llama-idle benchmark on a GGUF model, with memory pressure and the
// residency policies measured side by side. The project's main command.
//
// With no arguments it is a self-contained demonstration: it writes a 1 GiB synthetic llama model
// to a temporary directory, compares keep-alive 2 s with `off` under `pageout` pressure, prints
// llama-idle's lines and a table, writes JSON, CSV and a PNG plot, removes the model and says
// where the results are. This file is the command line only: it fills an IdleRequest, reads it
// once into the library's typed request (idle_options.hpp), and the library (workload/idle_run.hpp)
// checks what the machine must allow, runs and writes the files; here they are printed.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

#include "command.hpp"
#include "idle_options.hpp"
#include "residency/backends/sim.hpp"
#include "residency/config.hpp"
#include "residency/text.hpp"
#include "workload/idle_benchmark.hpp"
#include "workload/idle_run.hpp"

namespace residency::tool {
namespace {

using namespace residency::workload;

std::string minutes_seconds(double s) {
  const auto total = static_cast<long>(std::lround(std::max(0.0, s)));
  char buf[32];
  std::snprintf(buf, sizeof buf, "%ld:%02ld", total / 60, total % 60);
  return buf;
}

// Prints llama-idle's lines on stdout, warnings and the progress bar on stderr. Thread-safe:
// the managers log from their scheduler threads.
class Console final : public IdleReporter {
 public:
  Console(bool progress, bool verbose) : progress_(progress), verbose_(verbose) {}

  void line(const std::string& text) override { out(text); }
  void warning(const std::string& text) override { log(LogLevel::warn, text); }
  void note(const std::string& text) override {
    std::lock_guard<std::mutex> g(m_);
    clear_bar();
    std::fprintf(stderr, "residency idle: note: %s\n", text.c_str());
    draw_bar();
  }
  void run_starts(const IdleSchedule& s, std::size_t policies) override { start(s, policies); }
  void run_ends() override { finish(); }

  void out(const std::string& line) {
    std::lock_guard<std::mutex> g(m_);
    clear_bar();
    errno = 0;
    if ((std::fputs((line + "\n").c_str(), stdout) < 0 || std::fflush(stdout) != 0) && output_error_.empty()) {
      // A closed pipe (`| head` that has exited), a full disk: the rest of the run would print
      // to nobody. The benchmark stops at its next step (stop_reason) and main says it once.
      output_error_ = output_error_text(errno);
    }
    draw_bar();
  }
  std::string stop_reason() const override {
    std::lock_guard<std::mutex> g(m_);
    return output_error_;
  }
  void log(LogLevel level, std::string_view message) override {
    if (level > (verbose_ ? LogLevel::info : LogLevel::warn)) return;
    std::lock_guard<std::mutex> g(m_);
    clear_bar();
    std::fprintf(stderr, "residency idle: %s: %.*s\n", to_string(level), static_cast<int>(message.size()), message.data());
    draw_bar();
  }
  void start(const IdleSchedule& s, std::size_t policies) {
    std::lock_guard<std::mutex> g(m_);
    total_ = s.pauses.size() * policies * static_cast<std::size_t>(s.iters + 1);
    for (Nanos p : s.pauses)
      pause_left_ms_ += static_cast<double>(policies * static_cast<std::size_t>(s.iters)) *
                        static_cast<double>(p.count()) / 1e6;
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
                 std::string(kWidth - filled, '.').c_str(), done_, total_, label_.c_str(),
                 minutes_seconds(left_s).c_str());
    std::fflush(stderr);
    drawn_ = true;
  }

  mutable std::mutex m_;
  std::string output_error_;  // the first failed write to stdout; empty while writes succeed
  bool progress_, verbose_;
  bool drawn_ = false;
  std::size_t total_ = 0, done_ = 0;
  double busy_ms_ = 0, pause_left_ms_ = 0;
  std::string label_;
};

// parse (once, here) -> typed options -> run (model, target, benchmark, files) -> print.
int run_idle(const IdleRequest& request) {
  auto options = parse_idle_options(request);
  if (!options) throw BadInput(options.message());
  auto run = IdleRun::create(std::move(options).value());
  if (!run) throw BadInput(run.message());
  Console console(isatty(STDERR_FILENO) != 0, request.verbose);
  auto outcome = (*run)->run(console);
  if (!outcome) throw std::runtime_error(outcome.message());
  const IdleResults& r = outcome->results;
  std::printf("\ndecode time after a pause, ms (mean +/- sd of %d; pressure %s; %s)\n%s", r.schedule.iters,
              r.pressure.to_string().c_str(), outcome->model_text.c_str(), format_idle_table(r).c_str());
  if (const std::string hog = format_hog_waits(r); !hog.empty()) std::printf("\n%s", hog.c_str());
  if (const std::string verdict = format_idle_verdict(r); !verdict.empty()) std::printf("\n%s\n", verdict.c_str());
  std::printf("\nresults:\n");
  for (const auto& f : outcome->files) std::printf("  %s\n", printable(f, 400).c_str());
  if (outcome->synthetic_model_removed) std::printf("the synthetic model was removed\n");
  std::printf("ran in %s\n", minutes_seconds(r.wall_seconds).c_str());
  return kExitOk;
}

const Command idle_command{
    "idle",
    "llama-idle on a GGUF model: decode time after pauses, residency policies side by side, under memory pressure",
    [](CLI::App& app) {
      auto a = std::make_shared<IdleRequest>();
      app.footer(
          "With no arguments (or only --out, --no-plot, -v, --iters, --threads): writes a 1 GiB synthetic\n"
          "model to a temporary directory, runs\n"
          "  residency idle --policies off,keep-alive --keep-alive 2s --pressure pageout\n"
          "on it, prints the table and the result files, and removes the model.\n"
          "Policies: off (no residency management), keep-alive (resident until --keep-alive after the last\n"
          "decode), 0 (wired only during each decode), forever. Pressure is applied at the end of each\n"
          "pause longer than 0: pageout (the kernel reclaims every unlocked page of the model), hog:SIZE\n"
          "(a second process allocates and touches SIZE; the kernel reclaims only what it needs, and the\n"
          "model's cached pages count as available memory, so SIZE must come close to MemAvailable to\n"
          "evict them), none.\n"
          "Environment: the RESIDENCY_* variables (README, \"Configuration\") configure every policy's manager\n"
          "for what the options do not set: the wired limit, layout, set cap, pressure floor and quiet, the log\n"
          "level, and the keep-alive policy's duration (--keep-alive wins). Each policy sets its own keep-alive\n"
          "kind and release on pressure. A bad value is one line per variable and exit status 2.");
      app.add_option("MODEL", a->model, "GGUF model (F32, F16, BF16, Q8_0 or Q4_0 weights); default: a synthetic one");
      app.add_option(
             "--backend", a->backend,
             "where to decode: " +
                 [] {
                   std::string s;
                   for (const auto& b : idle_backends()) s += (s.empty() ? "" : ", ") + b;
                   return s;
                 }())
          ->capture_default_str();
      app.add_option("--policies", a->policies,
                     "comma-separated: off, keep-alive, pressure-aware (keep-alive + graded release under memory "
                     "pressure), 0, forever")
          ->capture_default_str();
      add_text_option(app, "--keep-alive", a->keep_alive,
                      "duration of the keep-alive policy (500ms, 2s, 3m ...); default RESIDENCY_KEEP_ALIVE, else 180s "
                      "(2s with no arguments)");
      add_text_option(app, "--pressure", a->pressure,
                      "none, pageout or hog:SIZE (e.g. hog:8GiB); default pageout with --backend posix, else none");
      add_text_option(app, "--pauses", a->pauses,
                      "comma-separated pauses in ms, each at most 3600000 (1 h); default 0,800,1600,2400,3200,4000");
      add_whole_number(app, "--iters", a->iters, 1, kIdleMaxIters,
                       "iterations per pause and policy (1 to 1000; default 3)");
      app.add_option("--out", a->out,
                     "directory for idle.json, idle.csv, idle.png (default: a new temporary directory, "
                     "residency-idle-XXXXXX under $TMPDIR, /var/tmp or /tmp; its files are printed at the end)");
      add_text_option(app, "--model-size", a->model_size,
                      "size of the synthetic model (default 1GiB; 16MiB for --backend sim); not with MODEL");
      app.add_option(
          "--profile", a->profile, "--backend sim: machine and model, one of " + [] {
            std::string names;
            for (const auto& n : residency::sim_profile_names()) names += (names.empty() ? "" : ", ") + n;
            return names;
          }() + " (default: the first)");
      app.add_flag("--decaying-requests", a->decaying_requests,
                   "--backend sim: residency requests decay ~1 s after use unless refreshed (macOS 26)");
      add_text_option(app, "--type", a->type,
                      "weight type of the synthetic model: f32, f16 (default), bf16, q8_0, q4_0; not with MODEL");
      add_whole_number(app, "--threads", a->threads, 0, kIdleMaxThreads,
                       "decode threads (0 = one per core, the default; at most 1024)", "0 (one per core) to 1024");
      app.add_flag_function(
          "--no-plot", [a](std::int64_t n) { a->plot = n == 0; }, "do not draw idle.png");
      app.add_flag("-v,--verbose", a->verbose, "also print the managers' info lines (each release and re-wire)");
      CLI::App* self = &app;
      return [a, self] {
        // The demonstration unless the run chose what it measures: options about the output
        // (--out, --no-plot, -v, --iters, --threads) keep it.
        bool chose = false;
        for (const CLI::Option* opt : self->get_options())
          if (opt->count() != 0 && !idle_option_keeps_demo(opt->get_name(false, true))) chose = true;
        IdleRequest request = chose ? *a : idle_demo_request(*a);
        request.env = [](const char* name) -> const char* { return std::getenv(name); };
        return run_idle(request);
      };
    }};

}  // namespace
}  // namespace residency::tool
