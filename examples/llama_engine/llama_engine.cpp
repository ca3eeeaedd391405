// A small engine on llama.cpp's public API with residency embedded: the few lines an engine
// needs, each marked "residency:". It loads a GGUF model (llama.cpp maps it), registers the
// mapping llama.cpp made of the model file with a residency manager (found by the file's device
// and inode in /proc/self/maps: llama.cpp does not publish it), then serves "requests": prefetch()
// when a request arrives, touch() before every decode, greedy decoding.
//
//   llama_engine MODEL.gguf [REQUESTS] [TOKENS] [PAUSES_MS]
//   RESIDENCY_KEEP_ALIVE=2s llama_engine model.gguf 3 8 500
// PAUSES_MS is the pause before each request, a number or a comma-separated list (cycled).
//
// Prints the tokens of each request with its time to first token, and what the kernel says is
// locked (VmLck). Exit status 2 for bad input (arguments, RESIDENCY_* values, a model llama.cpp
// refuses), 1 for a failure while running.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
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

// The range of this process's mapping of the file (dev, inode), as /proc/self/maps lists it;
// {nullptr, 0} when there is none (llama.cpp read the file instead: --no-mmap, or Windows).
std::pair<void*, std::size_t> mapping_of(dev_t dev, ino_t ino) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  std::uintptr_t lo = 0, hi = 0;
  while (std::getline(maps, line)) {
    unsigned long long b = 0, e = 0, off = 0, inode = 0;
    unsigned dmaj = 0, dmin = 0;
    char perms[8] = {};
    if (std::sscanf(line.c_str(), "%llx-%llx %7s %llx %x:%x %llu", &b, &e, perms, &off, &dmaj, &dmin, &inode) != 7) continue;
    if (inode != ino || makedev(dmaj, dmin) != dev) continue;
    if (lo == 0 || b < lo) lo = b;
    if (e > hi) hi = e;
  }
  return {reinterpret_cast<void*>(lo), hi - lo};
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
    std::fprintf(stderr, "usage: llama_engine MODEL.gguf [REQUESTS 1-1000] [TOKENS 1-4096] [PAUSES_MS 0-3600000[,...]]\n");
    return 2;
  }
  const char* path = argv[1];

  // residency: configuration from RESIDENCY_* (strict), the machine's backend, one manager.
  auto config = residency::Config::from_env();
  if (!config) {
    std::fprintf(stderr, "llama_engine: %s\n", config.message().c_str());
    return 2;
  }
  auto backend = residency::make_backend("auto");
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

  llama_log_set([](ggml_log_level level, const char* text, void*) {
    if (level >= GGML_LOG_LEVEL_WARN) std::fputs(text, stderr);
  }, nullptr);
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  llama_model* model = llama_model_load_from_file(path, mp);
  if (!model) {
    std::fprintf(stderr, "llama_engine: llama.cpp could not load '%s' (its log above says why)\n", path);
    return 2;
  }

  // residency: register the model: the mapping llama.cpp made of the file.
  struct stat st {};
  residency::RegionId id = 0;
  if (::stat(path, &st) == 0) {
    const auto [base, size] = mapping_of(st.st_dev, st.st_ino);
    if (size > 0) {
      auto r = (*manager)->register_region(base, size, residency::RegionClass::weights);
      if (r) id = *r;
      else std::fprintf(stderr, "llama_engine: not managed: %s\n", r.message().c_str());
    } else {
      std::fprintf(stderr, "llama_engine: llama.cpp did not map %s; nothing to keep resident\n", path);
    }
  }

  llama_context_params cp = llama_context_default_params();
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
      (*manager)->touch(id);  // residency: once per decode, before the compute (lock-free)
      llama_batch batch = llama_batch_get_one(&tok, 1);
      if (llama_decode(ctx, batch) != 0) {
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

  if (id != 0) (void)(*manager)->unregister_region(id);  // residency: before llama.cpp unmaps it
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return status;
}
