// SPDX-License-Identifier: MIT
// A small engine on llama.cpp's public API with residency embedded: the few lines an engine
// needs, each marked "residency:". It loads a GGUF model, finds the memory llama.cpp decodes
// from by watching one warm-up decode through llama.cpp's eval callback (every tensor of the
// graph names its ggml buffer: the weights in whatever buffer type holds them, CPU_Mapped file
// ranges, AMX or CPU_REPACK copies, plain CPU; the KV cache; the compute buffers), registers
// that memory with a residency manager, then serves "requests": prefetch() when a request
// arrives, begin_call()/end_call() around every decode, greedy decoding.
//
// Why not the GGUF mapping: on x86 CPUs with AMX, and for Q4_0 on ARM and AVX2 x86, llama.cpp
// copies most weights into anonymous buffers at load and decodes from those; the mapping then has
// dead ranges and holes it unmapped. llama.h does not publish its buffers, so the engine observes
// them: weights as the pages of the tensors the graph read, other buffers whole.
//
//   llama_engine [--no-repack] MODEL.gguf [REQUESTS] [TOKENS] [PAUSES_MS]
//   RESIDENCY_KEEP_ALIVE=2s llama_engine model.gguf 3 8 500
// --no-repack: llama.cpp's extra buffer types off (every weight read from the file mapping).
// PAUSES_MS is the pause before each request, a number or a comma-separated list (cycled).
//
// Prints the tokens of each request with its time to first token, and what the kernel says is
// locked (VmLck). Exit status 2 for bad input (arguments, RESIDENCY_* values, a model llama.cpp
// refuses), 1 for a failure while running.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "llama.h"
#include "residency/backends.hpp"
#include "residency/residency.hpp"

namespace {

long long vm_lck_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmLck:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return -1;
}

// What one decode reads from host memory, per ggml buffer: the byte ranges of the weight tensors
// it read, and the other buffers (KV cache, compute) it touched.
struct Observed {
  bool on = false;
  std::map<ggml_backend_buffer_t, std::vector<std::pair<std::uintptr_t, std::uintptr_t>>> weights;
  std::map<ggml_backend_buffer_t, ggml_backend_buffer_usage> others;
};

bool host_buffer(ggml_backend_buffer_t b) {
  ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(b));
  if (dev == nullptr) return true;
  const auto type = ggml_backend_dev_type(dev);
  return type == GGML_BACKEND_DEVICE_TYPE_CPU || type == GGML_BACKEND_DEVICE_TYPE_ACCEL;
}

void note(Observed& o, const ggml_tensor* t) {
  if (t == nullptr || t->buffer == nullptr || t->data == nullptr || !host_buffer(t->buffer)) return;
  const ggml_backend_buffer_usage u = ggml_backend_buffer_get_usage(t->buffer);
  if (u == GGML_BACKEND_BUFFER_USAGE_WEIGHTS) {
    const auto b = reinterpret_cast<std::uintptr_t>(t->data);
    o.weights[t->buffer].emplace_back(b, b + ggml_nbytes(t));
  } else {
    o.others.emplace(t->buffer, u);
  }
}

// llama.cpp's eval callback: asked about every node of the graph; never stops the graph.
bool observe(ggml_tensor* t, bool ask, void* user) {
  auto* o = static_cast<Observed*>(user);
  if (!ask || !o->on) return false;
  note(*o, t);
  for (const ggml_tensor* src : t->src) note(*o, src);
  return false;
}

// The ranges, rounded out to pages, sorted and merged.
std::vector<std::pair<std::uintptr_t, std::uintptr_t>> page_runs(std::vector<std::pair<std::uintptr_t, std::uintptr_t>> r) {
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  for (auto& [b, e] : r) {
    b &= ~(page - 1);
    e = (e + page - 1) & ~(page - 1);
  }
  std::sort(r.begin(), r.end());
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> out;
  for (auto& x : r) {
    if (!out.empty() && x.first <= out.back().second) out.back().second = std::max(out.back().second, x.second);
    else out.push_back(x);
  }
  return out;
}

bool parse_count(const char* text, long lo, long hi, long* out) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || v < lo || v > hi) return false;
  *out = v;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  bool no_repack = false;
  if (argc > 1 && std::strcmp(argv[1], "--no-repack") == 0) {
    no_repack = true;
    --argc;
    ++argv;
  }
  long requests = 3, tokens = 8;
  std::vector<long> pauses{0};
  bool ok = argc >= 2 && argc <= 5 && (argc <= 2 || parse_count(argv[2], 1, 1000, &requests)) &&
            (argc <= 3 || parse_count(argv[3], 1, 4096, &tokens));
  if (ok && argc > 4) {
    pauses.clear();
    std::string list = argv[4];
    for (std::size_t at = 0; ok && at <= list.size();) {
      const std::size_t comma = std::min(list.find(',', at), list.size());
      long p = 0;
      ok = parse_count(list.substr(at, comma - at).c_str(), 0, 3600000, &p);
      pauses.push_back(p);
      at = comma + 1;
    }
  }
  if (!ok) {
    std::fprintf(
        stderr,
        "usage: llama_engine [--no-repack] MODEL.gguf [REQUESTS 1-1000] [TOKENS 1-4096] [PAUSES_MS 0-3600000[,...]]\n");
    return 2;
  }
  const char* path = argv[1];

  // residency: configuration from RESIDENCY_* (strict), the machine's backend, one manager.
  auto config = residency::Config::from_env();
  if (!config) {
    std::fprintf(stderr, "llama_engine: %s\n", config.message().c_str());
    return 2;
  }
  // llama.cpp's host buffers are host memory: on Linux the posix backend locks them, also on a
  // machine with a GPU, where "auto" is the cuda backend (device memory; it pins host memory
  // instead of locking it, and pinned pages are no VmLck).
#if defined(__APPLE__)
  auto backend = residency::make_backend("auto");
#else
  auto backend = residency::make_backend("posix");
#endif
  if (!backend) {
    std::fprintf(stderr, "llama_engine: %s\n", backend.message().c_str());
    return 1;
  }
  residency::ManagerOptions mo;
  mo.config = *config;
  mo.backend = *backend;
  auto manager = residency::Manager::create(mo);
  if (!manager) {
    std::fprintf(stderr, "llama_engine: %s\n", manager.message().c_str());
    return 2;
  }

  llama_log_set(
      [](ggml_log_level level, const char* text, void*) {
        if (level >= GGML_LOG_LEVEL_WARN) std::fputs(text, stderr);
      },
      nullptr);
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  if (no_repack) mp.use_extra_bufts = false;
  llama_model* model = llama_model_load_from_file(path, mp);
  if (!model) {
    std::fprintf(stderr, "llama_engine: llama.cpp could not load '%s' (its log above says why)\n", path);
    return 2;
  }

  llama_context_params cp = llama_context_default_params();
  Observed observed;
  cp.cb_eval = observe;  // residency: to see which buffers decode reads (the warm-up below)
  cp.cb_eval_user_data = &observed;
  cp.n_ctx = 512;
  cp.n_batch = 512;
  cp.n_threads = cp.n_threads_batch = static_cast<int32_t>(std::max(1u, std::thread::hardware_concurrency()));
  llama_context* ctx = llama_init_from_model(model, cp);
  if (!ctx) {
    std::fprintf(stderr, "llama_engine: could not create a llama.cpp context\n");
    llama_model_free(model);
    return 1;
  }
  const llama_vocab* vocab = llama_model_get_vocab(model);
  const int32_t n_vocab = llama_vocab_n_tokens(vocab);
  const llama_token bos = llama_vocab_bos(vocab);

  // residency: one warm-up decode, watched; then register what it read: the weight tensors'
  // pages per buffer, and the KV cache and compute buffers whole.
  {
    llama_token tok = bos < 0 ? 1 : bos;
    observed.on = true;
    const int32_t rc = llama_decode(ctx, llama_batch_get_one(&tok, 1));
    observed.on = false;
    llama_memory_clear(llama_get_memory(ctx), true);
    if (rc != 0) {
      std::fprintf(stderr, "llama_engine: the warm-up decode failed\n");
      llama_free(ctx);
      llama_model_free(model);
      return 1;
    }
  }
  std::vector<residency::RegionId> ids;
  std::uint64_t by_class[3] = {0, 0, 0};
  auto add = [&](std::uintptr_t b, std::uintptr_t e, residency::RegionClass cls) {
    auto r = (*manager)->register_region(reinterpret_cast<void*>(b), e - b, cls);
    if (r) {
      ids.push_back(*r);
      by_class[static_cast<int>(cls)] += e - b;
    } else {
      std::fprintf(stderr, "llama_engine: not managed: %s\n", r.message().c_str());
    }
  };
  for (auto& [buf, ranges] : observed.weights)
    for (auto& [b, e] : page_runs(ranges)) add(b, e, residency::RegionClass::weights);
  for (auto& [buf, usage] : observed.others) {
    const auto b = reinterpret_cast<std::uintptr_t>(ggml_backend_buffer_get_base(buf));
    add(b, b + ggml_backend_buffer_get_size(buf),
        usage == GGML_BACKEND_BUFFER_USAGE_COMPUTE ? residency::RegionClass::scratch : residency::RegionClass::kv_cache);
  }
  std::string buffers;
  for (auto& [buf, ranges] : observed.weights)
    buffers += std::string(buffers.empty() ? "" : ", ") + ggml_backend_buffer_name(buf);
  std::printf("llama_engine: registered %zu region(s): weights %llu bytes (in %s), kv_cache %llu, scratch %llu\n",
              ids.size(), static_cast<unsigned long long>(by_class[0]), buffers.c_str(),
              static_cast<unsigned long long>(by_class[1]), static_cast<unsigned long long>(by_class[2]));
  std::printf("llama_engine: %s, %d threads, keep-alive %s, VmLck %lld\n", path, cp.n_threads,
              config->keep_alive.to_string().c_str(), vm_lck_bytes());

  int status = 0;
  for (long r = 0; r < requests && status == 0; ++r) {
    const long pause_ms = pauses[static_cast<std::size_t>(r) % pauses.size()];
    if (pause_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
    const auto t0 = std::chrono::steady_clock::now();
    (*manager)->prefetch();  // residency: a request arrived; re-wire in the background
    llama_memory_clear(llama_get_memory(ctx), true);
    llama_token tok = bos < 0 ? 1 : bos;  // a synthetic vocabulary may have no BOS: use token 1
    std::string out;
    double first_ms = 0;
    for (long i = 0; i < tokens; ++i) {
      llama_batch batch = llama_batch_get_one(&tok, 1);
      (*manager)->begin_call();  // residency: around each decode (lock-free while resident)
      const int32_t rc = llama_decode(ctx, batch);
      (*manager)->end_call();
      if (rc != 0) {
        std::fprintf(stderr, "llama_engine: llama_decode failed at token %ld of request %ld\n", i, r);
        status = 1;
        break;
      }
      const float* logits = llama_get_logits_ith(ctx, -1);
      llama_token best = 0;
      for (int32_t v = 1; v < n_vocab; ++v)
        if (logits[v] > logits[best]) best = v;
      if (i == 0) first_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      out += (out.empty() ? "" : " ") + std::to_string(best);
      tok = best;
    }
    std::printf("request %ld: first token %.2f ms, tokens %s, VmLck %lld\n", r, first_ms, out.c_str(), vm_lck_bytes());
    std::fflush(stdout);
  }
  const residency::Stats s = (*manager)->stats();
  std::printf("llama_engine: wired %llu of %llu bytes, %llu release(s), %llu re-wire(s)\n",
              static_cast<unsigned long long>(s.wired_bytes), static_cast<unsigned long long>(s.tracked_bytes),
              static_cast<unsigned long long>(s.releases), static_cast<unsigned long long>(s.rewires));

  for (residency::RegionId id : ids) (void)(*manager)->unregister_region(id);  // residency: before llama.cpp frees it
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return status;
}
