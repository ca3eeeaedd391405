// SPDX-License-Identifier: MIT
// residency_cuda_idle: the idle benchmark on the GPU, on its own.
//
// Runs workload/idle_benchmark.hpp's schedule with the cuda idle target (idle_cuda.hpp), the
// same code `residency idle --backend cuda` runs, without the tool's dependencies (CLI11, JSON
// library), so that scripts/gpu-check can run it on a GPU host that has neither. With no
// model given it writes a synthetic llama-shaped F16 model of --model-size to a temporary
// directory and removes it afterwards.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "residency/text.hpp"
#include "workload/cuda/idle_cuda.hpp"
#include "workload/gguf_writer.hpp"
#include "workload/idle_benchmark.hpp"

namespace {

using namespace residency;
using namespace residency::workload;

[[noreturn]] void die(const std::string& what, int code = 1) {
  std::fprintf(stderr, "residency_cuda_idle: %s\n", what.c_str());
  std::exit(code);
}

class Printer final : public IdleObserver {
 public:
  void block_start(const IdleResults& r, std::size_t policy, std::size_t pause, std::size_t block,
                   std::size_t blocks) override {
    std::printf("[%zu/%zu] policy %s, pause %lld ms\n", block + 1, blocks, r.policies[policy].name.c_str(),
                static_cast<long long>(
                    std::chrono::duration_cast<std::chrono::milliseconds>(r.schedule.pauses[pause]).count()));
  }
  void sample(const IdleResults&, const IdleSample& s) override {
    std::printf("%s   (resident before: %s)\n", format_decode_line(s.decode_ms).c_str(),
                s.resident_before < 0     ? "?"
                : s.resident_before > 0.5 ? "yes"
                                          : "no");
  }
  void block_end(const IdleResults& r, std::size_t policy, std::size_t pause) override {
    std::printf("%s\n", format_summary_line(r.cell(policy, pause), r.schedule.pauses[pause]).c_str());
    std::fflush(stdout);
  }
};

void usage() {
  std::puts(
      "usage: residency_cuda_idle [--model FILE.gguf] [--model-size SIZE] [--type f16|bf16|q8_0|q4_0|f32]\n"
      "                           [--pauses LIST] [--iters N] [--keep-alive DURATION]\n"
      "                           [--policies LIST] [--json FILE]\n"
      "  defaults: a synthetic 4 GiB f16 model, pauses 0,1000,3000 ms, 3 iterations,\n"
      "            keep-alive 2s, policies keep-alive,0,forever,off");
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_path, json, pauses = "0,1000,3000", policies = "keep-alive,0,forever,off";
  std::string size_text = "4GiB", type_text = "f16", keep_alive_text = "2s";
  int iters = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) die(a + " needs a value", 2);
      return argv[++i];
    };
    if (a == "--model") model_path = next();
    else if (a == "--model-size") size_text = next();
    else if (a == "--type") type_text = next();
    else if (a == "--pauses") pauses = next();
    else if (a == "--iters") iters = std::atoi(next().c_str());
    else if (a == "--keep-alive") keep_alive_text = next();
    else if (a == "--policies") policies = next();
    else if (a == "--json") json = next();
    else {
      usage();
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  if (iters < 1) die("--iters must be at least 1", 2);
  auto ka = parse_keep_alive(keep_alive_text);
  if (!ka || !ka->expires()) die("--keep-alive: give a duration above 0, e.g. 2s", 2);
  auto pol = parse_policies(policies, ka->duration);
  if (!pol) die(pol.message(), 2);
  auto ps = parse_pauses(pauses);
  if (!ps) die(ps.message(), 2);

  auto target = make_cuda_idle_target({});
  if (!target) {
    std::printf("SKIP: %s\n", target.message().c_str());
    return 0;
  }

  std::string tmpdir;
  if (model_path.empty()) {
    auto bytes = parse_size(size_text);
    if (!bytes) die("--model-size: " + bytes.message(), 2);
    auto type = parse_model_type(type_text);
    if (!type) die("--type: " + type.message(), 2);
    auto shape = plan_llama_shape(*bytes, *type);
    if (!shape) die(shape.message(), 2);
    const char* base = std::getenv("TMPDIR");
    std::string templ = std::string(base ? base : "/tmp") + "/residency-cuda-idle-XXXXXX";
    if (mkdtemp(templ.data()) == nullptr) die("cannot create a temporary directory under " + templ);
    tmpdir = templ;
    model_path = tmpdir + "/model.gguf";
    std::printf("writing a synthetic model: %s\n", shape->to_string().c_str());
    if (Status st = write_synthetic_model(model_path, *shape); !st) die(st.message());
  }
  int rc = 0;
  {
    auto file = GgufFile::open(model_path);
    if (!file) die(file.message(), 2);
    if (Status st = (*target)->prepare(*file); !st) die(st.message());
    std::printf("%s\nmodel: %s (%s)\n", (*target)->describe().c_str(), model_path.c_str(),
                format_size(file->size()).c_str());
    IdleBenchmarkOptions bench;
    bench.schedule.pauses = *ps;
    bench.schedule.iters = iters;
    bench.policies = *pol;
    bench.log_level = LogLevel::warn;
    bench.log = [](LogLevel level, std::string_view msg) { log_to_stderr(level, msg); };
    Printer printer;
    auto res = run_idle_benchmark(**target, bench, &printer);
    if (!res) {
      std::fprintf(stderr, "residency_cuda_idle: %s\n", res.message().c_str());
      rc = 1;
    } else {
      std::printf("\n%s\n", format_idle_table(*res).c_str());
      if (!json.empty()) {
        std::FILE* f = std::fopen(json.c_str(), "w");
        if (f == nullptr) die("cannot write " + json);
        std::fprintf(f, "{\n  \"backend\": \"%s\",\n  \"model_bytes\": %zu,\n  \"cells\": [\n",
                     (*target)->describe().c_str(), file->size());
        bool first = true;
        for (std::size_t p = 0; p < res->policies.size(); ++p) {
          for (std::size_t q = 0; q < res->schedule.pauses.size(); ++q) {
            const IdleCell c = res->cell(p, q);
            std::fprintf(f,
                         "%s    {\"policy\": \"%s\", \"pause_ms\": %lld, \"n\": %d, \"mean_ms\": %.4f, \"sd_ms\": "
                         "%.4f, \"resident_before\": %.3f}",
                         first ? "" : ",\n", res->policies[p].name.c_str(),
                         static_cast<long long>(
                             std::chrono::duration_cast<std::chrono::milliseconds>(res->schedule.pauses[q]).count()),
                         c.n, c.mean_ms, c.sd_ms, c.resident_before);
            first = false;
          }
        }
        std::fprintf(f, "\n  ],\n  \"csv\": \"");
        for (char ch : format_idle_csv(*res)) {
          if (ch == '\n') std::fputs("\\n", f);
          else if (ch == '"') std::fputs("\\\"", f);
          else std::fputc(ch, f);
        }
        std::fprintf(f, "\"\n}\n");
        std::fclose(f);
      }
    }
  }
  if (!tmpdir.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(tmpdir, ec);
  }
  return rc;
}
