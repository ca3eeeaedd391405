// SPDX-License-Identifier: MIT
// residency llama-idle [MODEL.gguf]: llama.cpp's own llama-idle, unmodified, side by side in
// several configurations (llama.cpp's mmap default, --mlock, residency through the preload with a
// keep-alive and with 0, --no-mmap, and the linked example engine), under pressure from outside.
// The runner is src/workload/llama_idle.*; this file parses, finds the binaries, prints, writes.
#include <limits.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "command.hpp"
#include "core/config_keys.hpp"
#include "json_text.hpp"
#include "residency/config.hpp"
#include "residency/text.hpp"
#include "workload/cleanup.hpp"
#include "workload/gguf_writer.hpp"
#include "workload/idle_report.hpp"
#include "workload/llama_idle.hpp"

namespace residency::tool {
namespace {

namespace fs = std::filesystem;
using namespace residency::workload;

constexpr const char* kLlamaTag = "v0.4.0";  // what scripts/llama-cpp builds

struct Args {
  std::string model, llama_dir, preload, engine, configs, pressure = "pageout", out;
  std::optional<std::string> keep_alive, model_size;
  int rounds = 1;
  bool plot = true;
  bool no_repack = false;
};

std::string exe_dir() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return ".";
  buf[n] = '\0';
  return fs::path(buf).parent_path().string();
}

std::string first_existing(const std::vector<std::string>& candidates) {
  for (const auto& c : candidates)
    if (!c.empty() && ::access(c.c_str(), R_OK) == 0) return c;
  return candidates.empty() ? "" : candidates.front();
}

std::string default_llama_dir() {
  if (const char* d = std::getenv("RESIDENCY_LLAMA_DIR"); d && *d) return d;
  std::string cache;
  if (const char* c = std::getenv("RESIDENCY_CACHE"); c && *c) cache = c;
  else cache = std::string(std::getenv("HOME") ? std::getenv("HOME") : "/root") + "/.cache/residency";
  return cache + "/llama.cpp-" + kLlamaTag;
}

class Printer : public LlamaIdleObserver {
 public:
  void child_starts(const LlamaIdleConfig& c, int round) override {
    std::printf("== %s (round %d)\n", c.name.c_str(), round + 1);
    std::fflush(stdout);
  }
  void child_line(const LlamaIdleConfig&, const std::string& line) override {
    if (line.rfind("  - decode time:", 0) == 0 || line.rfind("iters:", 0) == 0 || line.rfind("request ", 0) == 0) {
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    }
  }
};

int run(const Args& a) {
  LlamaIdleOptions o;
  const std::string dir = a.llama_dir.empty() ? default_llama_dir() : a.llama_dir;
  o.llama_idle = dir + "/bin/llama-idle";
  const std::string here = exe_dir();
  o.preload = !a.preload.empty() ? a.preload
                                 : first_existing({here + "/../lib/libresidency_preload.so",
                                                   here + "/../../src/preload/libresidency_preload.so",
                                                   here + "/libresidency_preload.so"});
  o.engine = !a.engine.empty()
                 ? a.engine
                 : first_existing({here + "/llama_engine", here + "/../../examples/llama_engine/llama_engine"});
  // The environment as `idle` reads it: checked strictly; the preload children get the user's
  // RESIDENCY_* (except what each configuration sets); --keep-alive defaults to its keep-alive.
  auto env = Config::from_env();
  if (!env) throw BadInput(env.message());
  const bool env_keep_alive = core::config_key_set("keep_alive", [](const char* n) { return std::getenv(n); });
  if (a.keep_alive) {
    auto ka = parse_keep_alive(*a.keep_alive);
    if (!ka) throw BadInput("--keep-alive: " + ka.message());
    if (!ka->expires()) {
      throw BadInput("--keep-alive '" + printable(*a.keep_alive) +
                     "': the keep-alive configurations need a duration above 0 and at most 3.5 s (e.g. 2s); "
                     "configuration 0 is named in --configs");
    }
    o.keep_alive = ka->duration;
  } else if (env_keep_alive) {
    if (!env->keep_alive.expires()) {
      throw BadInput("the environment's keep-alive (RESIDENCY_KEEP_ALIVE or its alias) is " + env->keep_alive.to_string() +
                     ": the keep-alive configurations need a duration above 0; give --keep-alive (e.g. 2s)");
    }
    o.keep_alive = env->keep_alive.duration;
  }
  o.pass_environment = true;
  auto pressure = parse_pressure(a.pressure);
  if (!pressure) throw BadInput("--pressure: " + pressure.message());
  o.pressure = *pressure;
  o.rounds = a.rounds;
  o.no_repack = a.no_repack;
  std::string configs = a.configs;
  if (configs.empty()) {  // every configuration whose binary is here
    configs = "mmap,mlock";
    if (::access(o.preload.c_str(), R_OK) == 0)
      configs += o.pressure.kind == Pressure::Kind::hog ? ",keep-alive,pressure-aware,0" : ",keep-alive,0";
    else
      std::printf(
          "residency llama-idle: note: no libresidency_preload.so at %s: the preload configurations are left out\n",
          printable(o.preload, 400).c_str());
    configs += ",no-mmap";
    if (::access(o.engine.c_str(), X_OK) == 0) {
      configs += ",engine";
    } else if (!a.engine.empty()) {
      std::printf(
          "residency llama-idle: note: --engine %s is not an executable: the engine configuration is left out\n",
          printable(o.engine, 400).c_str());
    } else {  // an installed tool: the example is built in the build tree, not installed
      std::printf(
          "residency llama-idle: note: no llama_engine example at %s (it is built in the build tree, "
          "examples/llama_engine, and not installed): the engine configuration is left out; give --engine PATH to "
          "include it\n",
          printable(o.engine, 400).c_str());
    }
  }
  std::stringstream ss(configs);
  for (std::string id; std::getline(ss, id, ',');) o.configs.push_back(id);
  if (o.configs.empty())
    throw BadInput(
        "--configs: empty; accepted: comma-separated mmap, mlock, keep-alive, pressure-aware, 0, no-mmap, engine");

  // The model: given, or a synthetic one (removed afterwards).
  std::optional<TempDir> work;
  if (!a.model.empty() && a.model_size)
    throw BadInput("--model-size describes the synthetic model, but MODEL was given (" + printable(a.model) +
                   "); leave out one or the other");
  if (!a.out.empty()) {  // the results must not be lost at the end of a long run
    std::error_code ec;
    const fs::path out(a.out);
    fs::path existing = out;
    while (!existing.empty() && !fs::exists(existing, ec)) existing = existing.parent_path();
    if (existing.empty()) existing = ".";
    if (!fs::is_directory(existing, ec))
      throw BadInput("--out '" + printable(a.out) + "': '" + printable(existing.string()) +
                     "' is not a directory; give a directory, or a new path in one");
    if (Status st = check_writable(existing.string(), 512u << 10, "--out " + printable(a.out)); !st)
      throw BadInput(st.message());
  }
  if (a.model.empty()) {
    auto size = parse_size(a.model_size ? *a.model_size : "1GiB");
    if (!size) throw BadInput("--model-size: " + size.message());
    auto shape = plan_llama_shape(*size, GgmlType::f16);
    if (!shape) throw BadInput("--model-size: " + shape.message());
    CleanupRegistry::install_signal_handlers();
    auto d = TempDir::create(::access("/var/tmp", W_OK) == 0 ? "/var/tmp" : "/tmp", "residency-llama-idle-model-");
    if (!d) throw std::runtime_error(d.message());
    work.emplace(std::move(d).value());
    o.model = work->track("model.gguf");
    // Everything but the model is checked before a model is written.
    if (Status st = check_llama_idle_options(o, /*check_model=*/false); !st) throw BadInput(st.message());
    std::printf("writing a synthetic model to %s: %s\n", printable(o.model, 400).c_str(), shape->to_string().c_str());
    std::fflush(stdout);
    if (Status st = write_synthetic_model(o.model, *shape); !st) throw std::runtime_error(st.message());
  } else {
    o.model = a.model;
  }
  if (Status st = check_llama_idle_options(o); !st) throw BadInput(st.message());

  std::printf(
      "llama-idle: %s (llama.cpp %s; its context uses llama_context_default_params(): 4 threads, whatever -t says)\n",
      printable(o.llama_idle, 400).c_str(), kLlamaTag);
  std::printf("model: %s; configurations: %s; pressure: %s; %d round(s) of about 45 s each per configuration\n",
              printable(o.model, 400).c_str(), printable(configs).c_str(), o.pressure.to_string().c_str(), o.rounds);
  std::fflush(stdout);
  Printer printer;
  auto outcome = run_llama_idle(o, &printer);
  if (!outcome) throw std::runtime_error(outcome.message());

  std::printf("\n%s\n", format_idle_table(outcome->results).c_str());
  if (const std::string hog = format_hog_waits(outcome->results); !hog.empty()) std::printf("%s\n", hog.c_str());
  std::printf("What each configuration still holds 3.7 s after a decode (the end of the last 4 s pause):\n\n%s\n",
              format_llama_idle_held(*outcome).c_str());

  // Results: --out, else a new temporary directory.
  std::string out = a.out;
  if (out.empty()) {
    auto d = TempDir::create(::access("/var/tmp", W_OK) == 0 ? "/var/tmp" : "/tmp", "residency-llama-idle-");
    if (!d) throw std::runtime_error(d.message());
    d->keep();  // renamed without its owner tag: results, not a leftover
    out = d->path();
  } else {
    std::error_code ec;
    fs::create_directories(out, ec);
    if (ec) throw std::runtime_error("--out '" + printable(out) + "': cannot create it: " + ec.message());
  }
  std::vector<std::string> files;
  const std::string csv = out + "/llama-idle.csv";
  if (Status st = write_idle_csv(csv, outcome->results); !st) throw std::runtime_error(st.message());
  files.push_back(csv);
  nlohmann::json j;
  j["llama_idle"] = o.llama_idle;
  j["model"] = o.model;
  j["pressure"] = o.pressure.to_string();
  j["extra_buffer_types"] = !o.no_repack;  // llama.cpp's AMX / CPU_REPACK (off: --no-repack)
  j["llama_idle_threads"] = 4;
  j["engine_threads"] = o.engine_threads;
  for (std::size_t i = 0; i < outcome->results.policies.size(); ++i) {
    nlohmann::json c = {{"id", outcome->results.policies[i].id},
                        {"name", outcome->results.policies[i].name},
                        {"held_vm_lck_bytes", outcome->held[i].vm_lck},
                        {"held_rss_anon_bytes", outcome->held[i].rss_anon},
                        {"held_swap_bytes", outcome->held[i].vm_swap},
                        {"held_resident_fraction", outcome->held[i].resident_fraction}};
    for (std::size_t p = 0; p < outcome->results.schedule.pauses.size(); ++p) {
      const IdleCell cell = outcome->results.cell(i, p);
      c["pauses"].push_back(
          {{"pause_ms", std::chrono::duration_cast<std::chrono::milliseconds>(outcome->results.schedule.pauses[p]).count()},
           {"n", cell.n},
           {"mean_ms", cell.mean_ms},
           {"sd_ms", cell.sd_ms}});
    }
    j["configurations"].push_back(c);
  }
  const std::string json = out + "/llama-idle.json";
  {
    std::ofstream f(json);
    f << json_text(j) << "\n";
    f.close();
    if (!f) throw std::runtime_error(printable(json) + ": cannot write the results file: " + std::strerror(errno));
  }
  files.push_back(json);
  if (a.plot) {
    IdleRunInfo info;
    info.model_path = o.model;
    info.synthetic_model = a.model.empty();
    info.backend = "llama.cpp " + std::string(kLlamaTag) + " llama-idle, unmodified, one process per configuration";
    info.tool = "residency llama-idle";
    std::error_code ec;
    const auto bytes = fs::file_size(o.model, ec);
    info.model_bytes = ec ? 0 : bytes;
    const std::string png = out + "/llama-idle.png";
    const std::string why = write_idle_plot(png, outcome->results, info);
    if (why.empty()) files.push_back(png);
    else std::fprintf(stderr, "residency llama-idle: no plot: %s\n", why.c_str());
  }
  for (const auto& f : files) std::printf("wrote %s\n", printable(f, 400).c_str());
  return kExitOk;
}

const Command cmd{
    "llama-idle",
    "run llama.cpp's own llama-idle side by side: mmap, --load-mode mlock, residency (preload), --load-mode none, the "
    "linked engine",
    [](CLI::App& app) {
      auto a = std::make_shared<Args>();
      app.add_option("MODEL", a->model, "GGUF model; default: a synthetic llama-shaped F16 model of --model-size");
      app.add_option(
          "--llama-dir", a->llama_dir,
          "llama.cpp install prefix (bin/llama-idle); default RESIDENCY_LLAMA_DIR, else the scripts/llama-cpp cache");
      app.add_option("--preload", a->preload, "libresidency_preload.so; default: next to this tool");
      app.add_option("--engine", a->engine, "the llama_engine example; default: next to this tool");
      app.add_option("--configs", a->configs,
                     "comma-separated: mmap, mlock, keep-alive, pressure-aware, 0, no-mmap, engine; default: all that "
                     "are here (pressure-aware with hog:SIZE)");
      add_text_option(
          app, "--keep-alive", a->keep_alive,
          "the keep-alive of the residency configurations (at most 3.5 s; default RESIDENCY_KEEP_ALIVE, else 2s)");
      app.add_option("--pressure", a->pressure,
                     "none, pageout (default: process_madvise MADV_PAGEOUT over the model's file and the anonymous "
                     "mappings, + FADV_DONTNEED, at the end of each pause) or hog:SIZE");
      add_whole_number(app, "--rounds", a->rounds, 1, 20,
                       "runs of every configuration, interleaved (1 to 20; default 1)");
      app.add_option("--out", a->out, "directory for llama-idle.{csv,json,png}; default: a new temporary directory");
      add_text_option(app, "--model-size", a->model_size, "size of the synthetic model (default 1GiB); not with MODEL");
      app.footer(
          "Environment: RESIDENCY_* are checked as by `idle` (a bad value: one line, exit 2) and passed to the\n"
          "preload configurations, except RESIDENCY_KEEP_ALIVE and RESIDENCY_RELEASE_ON_PRESSURE, which each\n"
          "configuration sets (--keep-alive defaults to RESIDENCY_KEEP_ALIVE).");
      app.add_flag_function(
          "--no-plot", [a](std::int64_t n) { a->plot = n == 0; }, "do not draw llama-idle.png");
      app.add_flag("--no-repack", a->no_repack,
                   "llama.cpp's extra buffer types off in every configuration (llama-idle -nr, llama_engine "
                   "--no-repack): the weights stay in the file mapping instead of AMX or CPU_REPACK copies");
      return [a] { return run(*a); };
    }};

}  // namespace
}  // namespace residency::tool
