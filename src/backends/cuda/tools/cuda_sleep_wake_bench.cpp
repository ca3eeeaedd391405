// SPDX-License-Identifier: MIT
// residency_cuda_bench: how fast the cuda backend puts device memory to sleep and wakes it,
// against a plain pinned copy of the same size measured in the same run.
//
// Google Benchmark does not fit this measurement: one cycle of 64 GiB takes seconds, the
// figure that matters is a ratio between two operations on the same bytes, and the run must
// check every byte after every wake. So this is a small program of its own:
//
//   for each size: allocate `weights` through the backend and fill it with a pattern; then
//     plain copies: a cuMemAlloc buffer and a cuMemHostAlloc buffer of the same size (the
//       pinning is timed too: it is what a first sleep that pins with cuMemHostAlloc costs), per
//       iteration one cuMemcpyDtoH and one cuMemcpyHtoD of the whole size; the host buffer is
//       freed before the backend's first sleep (a 64 GiB backup and a second 64 GiB pinned
//       buffer would not both fit in the 128 GiB of a typical GPU host)
//     first sleep (end_residency: this one also builds the pinned backup, pipelined with the
//       copies), reported apart
//     per iteration: wake (request_residency: create + map + chunked host-to-device copies,
//       overlapped), check every byte against the pattern (outside the timing), sleep
//       (end_residency: sync, chunked device-to-host copies, unmap + release)
//   Then, for the same size: `scratch` sleep and wake (discarded: no copy); and the other
//   way to pay the pinning, prepare_backup() right after allocation (timed) followed by the
//   first sleep (timed, now a plain copy), checked after a wake.
//   --pin-threads N,N,...: the first sleep of --pin-size GiB with that many pinning threads.
//
// Output: a table on stdout and, with --json FILE, every measured time.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>
#include <thread>
#include <vector>

#include "backends/cuda/cuda_backend.hpp"
#include "backends/cuda/pattern/pattern.hpp"

#include "tool_support.hpp"

const char* const residency::cuda::tools::kToolName = "residency_cuda_bench";

namespace {

using residency::RegionClass;
using residency::RegionDesc;
using residency::Status;
using residency::cuda::ContextScope;
using residency::cuda::CudaBackend;
using residency::cuda::Driver;
using residency::cuda::PatternKernels;
using namespace residency::cuda::tools;

constexpr std::uint64_t kSeed = 0x5eed5eedull;

std::string json_list(const std::vector<double>& v) {
  std::string out = "[";
  for (std::size_t i = 0; i < v.size(); ++i) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%s%.6f", i ? ", " : "", v[i]);
    out += buf;
  }
  return out + "]";
}

struct SizeResult {
  std::uint64_t bytes = 0;
  bool background_backup = false;
  std::size_t chunk = 0;
  int streams = 0;
  int pin_threads = 0;
  bool pin_workers = false;  // BackupPipeline::workers
  double first_sleep_s = 0;  // includes building the pinned backup
  std::size_t backup_bytes = 0;
  double plain_pin_s = 0;  // cuMemHostAlloc of the plain copies' host buffer
  double prepare_s = 0;    // prepare_backup() right after allocation
  double prepared_first_sleep_s = 0;
  std::vector<double> sleep_s, wake_s, plain_d2h_s, plain_h2d_s;
  // Diagnostics: host-to-device copies into device memory allocated just before (cuMemAlloc +
  // copy from the cuMemHostAlloc buffer, timed together), and the wake's chunked copies from the
  // backup into device memory that was written before (no new physical memory).
  std::vector<double> fresh_h2d_s, backup_h2d_reused_s;
  std::vector<double> discard_sleep_s, discard_wake_s;
  double wake_gbps() const { return gbps(bytes, median(wake_s)); }
  double sleep_gbps() const { return gbps(bytes, median(sleep_s)); }
  double h2d_gbps() const { return gbps(bytes, median(plain_h2d_s)); }
  double d2h_gbps() const { return gbps(bytes, median(plain_d2h_s)); }
};

struct Options {
  std::vector<double> sizes_gib = {1, 16, 64};
  int iterations = 5;
  std::size_t chunk = 0;               // 0: backend default
  int streams = 0;                     // 0: backend default
  int pin_threads = 0;                 // 0: backend default
  int pin_workers = -1;                // -1: backend default; 0: registrar; 1: workers
  std::vector<std::string> pin_sweep;  // r<N> / w<N>
  bool pin_auto = false;
  double pin_sweep_gib = 16;
  bool prepared = true;
  bool sweep = false;
  bool discard = true;
  bool background_backup = false;  // --backup after-allocation
  int idle_ms = 0;                 // --idle-ms: pause between a sleep and the next wake
  std::string json;
};

// One backend, one size: the whole protocol described at the top of the file. With
// `first_only`, only the first sleep (and a wake to check it).
SizeResult measure(std::uint64_t bytes, const Options& o, bool with_discard, bool first_only = false) {
  residency::CudaBackendOptions bo;
  if (o.chunk) bo.chunk_bytes = o.chunk;
  if (o.streams) bo.streams = o.streams;
  if (o.background_backup) bo.backup = residency::CudaBackendOptions::Backup::after_allocation;
  auto made = CudaBackend::create(bo);
  if (!made) die(made.message());
  CudaBackend& b = **made;
  if (o.pin_threads) b.set_backup_threads(o.pin_threads);
  if (o.pin_workers >= 0)
    b.set_backup_pipeline(o.pin_workers ? CudaBackend::BackupPipeline::workers : CudaBackend::BackupPipeline::registrar);
  const Driver& d = b.driver();
  auto kernels = PatternKernels::load(d, b.context());
  if (!kernels) die(kernels.message());

  SizeResult res;
  res.bytes = bytes;
  res.chunk = b.chunk_bytes();
  res.streams = bo.streams;
  res.pin_threads = b.backup_threads();
  res.background_backup = o.background_backup;
  res.pin_workers = b.backup_pipeline() == CudaBackend::BackupPipeline::workers;

  auto ok = [&](const residency::SetOutcome& out, const char* what) {
    if (!out.ok()) die(std::string(what) + ": " + out.status.message());
  };
  auto filled = [&](RegionClass cls, std::uint64_t seed) {
    auto p = b.allocate(bytes, cls);
    if (!p) die(p.message());
    check(kernels->fill(static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(*p)), bytes, seed), "fill");
    ContextScope scope(d, b.context());
    check(d, d.cuCtxSynchronize(), "fill");
    return *p;
  };
  auto verify = [&](void* p, std::uint64_t seed, const char* what) {
    auto bad = kernels->mismatches(static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p)), bytes, seed);
    if (!bad) die(bad.message());
    if (*bad != 0)
      die(std::string(what) + ": " + std::to_string(*bad) + " wrong words of " + std::to_string(bytes) + " bytes");
  };
  auto in_set = [&](residency::SetId set, residency::RegionId id, void* p, RegionClass cls) {
    request_in_new_set(b, set, id, p, bytes, cls);
  };

  void* p = filled(RegionClass::weights, kSeed);
  in_set(0, 1, p, RegionClass::weights);

  Clock::time_point t0;
  CUdeviceptr plain = 0;
  if (!first_only) {
    ContextScope scope(d, b.context());
    void* host = nullptr;
    check(d, d.cuMemAlloc(&plain, bytes), "cuMemAlloc for the plain copy");
    t0 = Clock::now();
    check(d, d.cuMemHostAlloc(&host, bytes, CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc for the plain copy");
    res.plain_pin_s = seconds_since(t0);
    check(d, d.cuMemcpyDtoH(host, static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p)), bytes), "priming");
    for (int it = 0; it < o.iterations; ++it) {
      t0 = Clock::now();
      check(d, d.cuMemcpyHtoD(plain, host, bytes), "plain host-to-device copy");
      check(d, d.cuCtxSynchronize(), "plain host-to-device copy");
      res.plain_h2d_s.push_back(seconds_since(t0));
      t0 = Clock::now();
      check(d, d.cuMemcpyDtoH(host, plain, bytes), "plain device-to-host copy");
      check(d, d.cuCtxSynchronize(), "plain device-to-host copy");
      res.plain_d2h_s.push_back(seconds_since(t0));
    }
    // Diagnostic: the same copy into device memory allocated for it (as a wake's is).
    check(d, d.cuMemFree(plain), "cuMemFree");
    for (int it = 0; it < std::min(o.iterations, 3); ++it) {
      t0 = Clock::now();
      check(d, d.cuMemAlloc(&plain, bytes), "cuMemAlloc for the fresh copy");
      check(d, d.cuMemcpyHtoD(plain, host, bytes), "fresh host-to-device copy");
      check(d, d.cuCtxSynchronize(), "fresh host-to-device copy");
      res.fresh_h2d_s.push_back(seconds_since(t0));
      check(d, d.cuMemFree(plain), "cuMemFree");
    }
    check(d, d.cuMemFreeHost(host), "cuMemFreeHost");
    check(d, d.cuMemAlloc(&plain, bytes), "cuMemAlloc for the reused copy");
    check(d, d.cuMemsetD8(plain, 0, bytes), "cuMemsetD8");
  }

  if (o.background_backup) {
    // The backup was being pinned in the background since the allocation (during the plain
    // copies above); the first sleep is measured once it is done, as a server's would be.
    t0 = Clock::now();
    if (!b.wait_background_backups(600'000) || b.background_backup_failures() != 0)
      die("the background backup did not finish");
    std::printf("  %.0f GiB: waited %.3f s more for the background backup before the first sleep\n",
                static_cast<double>(bytes) / (1ull << 30), seconds_since(t0));
  }
  t0 = Clock::now();
  (void)b.end_residency(0);  // checked through last_release_status()
  res.first_sleep_s = seconds_since(t0);
  check(b.last_release_status(), "first sleep");
  res.backup_bytes = b.host_backup_bytes(p);
  if (b.host_backup(p) == nullptr || b.is_resident(p)) die("the first sleep left no backup or kept the memory");

  for (int it = 0; it < (first_only ? 0 : o.iterations); ++it) {
    // A server idles between a sleep and the next wake; without the pause the wake follows the
    // sleep at once (the driver may still be busy with the physical memory the sleep released).
    if (o.idle_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(o.idle_ms));
    t0 = Clock::now();
    ok(b.request_residency(0), "wake");
    res.wake_s.push_back(seconds_since(t0));
    verify(p, kSeed, "wake restored");
    t0 = Clock::now();
    (void)b.end_residency(0);  // checked through last_release_status()
    res.sleep_s.push_back(seconds_since(t0));
    check(b.last_release_status(), "sleep");
  }
  if (!first_only) {
    // Diagnostic: the wake's copies (chunked, over the backend's streams) from the backup into
    // device memory that exists already.
    ContextScope scope(d, b.context());
    std::vector<CUstream> streams(static_cast<std::size_t>(res.streams > 0 ? res.streams : 4));
    for (auto& st : streams) check(d, d.cuStreamCreate(&st, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    const char* backup = static_cast<const char*>(b.host_backup(p));
    for (int it = 0; it < std::min(o.iterations, 3); ++it) {
      t0 = Clock::now();
      for (std::size_t off = 0, i = 0; off < bytes; off += res.chunk, ++i) {
        check(d,
              d.cuMemcpyHtoDAsync(plain + off, backup + off, std::min<std::uint64_t>(res.chunk, bytes - off),
                                  streams[i % streams.size()]),
              "chunked copy from the backup");
      }
      for (auto st : streams) check(d, d.cuStreamSynchronize(st), "chunked copy from the backup");
      res.backup_h2d_reused_s.push_back(seconds_since(t0));
    }
    for (auto st : streams) check(d, d.cuStreamDestroy(st), "cuStreamDestroy");
    check(d, d.cuMemFree(plain), "cuMemFree");
  }
  ok(b.request_residency(0), "final wake");
  verify(p, kSeed, "final wake");

  if (with_discard && !first_only) {
    void* s = filled(RegionClass::scratch, 2);
    in_set(1, 2, s, RegionClass::scratch);
    for (int it = 0; it < o.iterations; ++it) {
      t0 = Clock::now();
      (void)b.end_residency(1);  // checked through last_release_status()
      res.discard_sleep_s.push_back(seconds_since(t0));
      t0 = Clock::now();
      ok(b.request_residency(1), "wake scratch");
      res.discard_wake_s.push_back(seconds_since(t0));
    }
    if (b.host_backup(s) != nullptr) die("scratch got a host backup: it must be discarded");
    (void)b.destroy_set(1);  // checked through last_release_status()
    b.deallocate(s);
  }
  (void)b.destroy_set(0);  // checked through last_release_status()
  b.deallocate(p);

  if (o.prepared && !first_only) {
    // The backup pinned right after allocation (what an engine could do at load time).
    const std::uint64_t seed = kSeed + 1;
    void* q = filled(RegionClass::weights, seed);
    in_set(2, 3, q, RegionClass::weights);
    t0 = Clock::now();
    check(b.prepare_backup(q), "prepare_backup");
    res.prepare_s = seconds_since(t0);
    t0 = Clock::now();
    (void)b.end_residency(2);
    res.prepared_first_sleep_s = seconds_since(t0);
    check(b.last_release_status(), "first sleep after prepare_backup");
    ok(b.request_residency(2), "wake after prepare_backup");
    verify(q, seed, "wake after prepare_backup");
    (void)b.destroy_set(2);
    b.deallocate(q);
  }
  return res;
}

std::string device_line(const Driver& d) {
  CUdevice dev = 0;
  char name[256] = {0};
  if (d.cuDeviceGet(&dev, 0) == CUDA_SUCCESS) (void)d.cuDeviceGetName(name, sizeof name, dev);
  return name;
}

std::string now_utc() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string size_json(const SizeResult& r) {
  char head[1024];
  std::snprintf(head, sizeof head,
                "{\"bytes\": %llu, \"chunk_bytes\": %zu, \"streams\": %d, \"pin_threads\": %d, "
                "\"pin_pipeline\": \"%s\", \"backup\": \"%s\", \"first_sleep_s\": %.6f, \"first_sleep_GBps\": %.2f, "
                "\"backup_bytes\": %zu, "
                "\"plain_pin_s\": %.6f, \"prepare_backup_s\": %.6f, \"prepared_first_sleep_s\": %.6f, "
                "\"wake_GBps\": %.2f, \"plain_h2d_GBps\": %.2f, \"wake_ratio\": %.4f, "
                "\"sleep_GBps\": %.2f, \"plain_d2h_GBps\": %.2f, \"sleep_ratio\": %.4f, ",
                static_cast<unsigned long long>(r.bytes), r.chunk, r.streams, r.pin_threads,
                r.pin_workers ? "workers" : "registrar", r.background_backup ? "after-allocation" : "at-first-sleep",
                r.first_sleep_s, gbps(r.bytes, r.first_sleep_s), r.backup_bytes, r.plain_pin_s, r.prepare_s,
                r.prepared_first_sleep_s, r.wake_gbps(), r.h2d_gbps(), r.h2d_gbps() > 0 ? r.wake_gbps() / r.h2d_gbps() : 0,
                r.sleep_gbps(), r.d2h_gbps(), r.d2h_gbps() > 0 ? r.sleep_gbps() / r.d2h_gbps() : 0);
  return std::string(head) + "\"wake_s\": " + json_list(r.wake_s) + ", \"sleep_s\": " + json_list(r.sleep_s) +
         ", \"plain_h2d_s\": " + json_list(r.plain_h2d_s) + ", \"plain_d2h_s\": " + json_list(r.plain_d2h_s) +
         ", \"fresh_h2d_s\": " + json_list(r.fresh_h2d_s) +
         ", \"backup_h2d_reused_s\": " + json_list(r.backup_h2d_reused_s) +
         ", \"discard_sleep_s\": " + json_list(r.discard_sleep_s) +
         ", \"discard_wake_s\": " + json_list(r.discard_wake_s) + "}";
}

void usage() {
  std::puts(
      "usage: residency_cuda_bench [--sizes GiB,GiB,...] [--iterations N] [--chunk-mib N]\n"
      "                            [--streams N] [--pin-threads N] [--pin-pipeline P]\n"
      "                            [--pin-sweep r8,w8,...] [--pin-auto]\n"
      "                            [--pin-size GiB] [--no-prepared] [--sweep] [--no-discard]\n"
      "                            [--idle-ms N] [--json FILE]\n"
      "  --sizes       sizes to measure, in GiB (default 1,16,64)\n"
      "  --iterations  timed sleep/wake cycles per size (default 5); medians are reported\n"
      "  --chunk-mib   chunk size of the backend (default: the backend's, 256)\n"
      "  --streams     copy streams of the backend (default: the backend's, 4)\n"
      "  --pin-threads host threads that build a backup (default: the backend's)\n"
      "  --pin-pipeline registrar|workers: who registers a backup's chunks (default: the backend's)\n"
      "  --pin-sweep   first, the first sleep of --pin-size GiB (default 16) for each of r<N>\n"
      "                (registrar pipeline, N faulting threads) and w<N> (workers pipeline)\n"
      "  --pin-auto    measure the sizes with the fastest entry of --pin-sweep (said so in the output)\n"
      "  --no-prepared skip prepare_backup() + first sleep\n"
      "  --backup M    at-first-sleep (default) or after-allocation (pinned by a background thread)\n"
      "  --sweep       also measure 4 GiB over chunk sizes 32..1024 MiB and 1, 2, 4 streams\n"
      "  --idle-ms N   pause N ms between each sleep and the next wake, as a server idles (default 0)\n"
      "  --json FILE   write every measured time to FILE");
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        usage();
        die(a + " needs a value");
      }
      return argv[++i];
    };
    try {
      if (a == "--sizes") {
        o.sizes_gib.clear();
        std::string v = next();
        for (std::size_t pos = 0; pos <= v.size();) {
          const std::size_t comma = std::min(v.find(',', pos), v.size());
          o.sizes_gib.push_back(std::stod(v.substr(pos, comma - pos)));
          pos = comma + 1;
        }
      } else if (a == "--iterations") {
        o.iterations = std::stoi(next());
      } else if (a == "--chunk-mib") {
        o.chunk = static_cast<std::size_t>(std::stoull(next())) * kMiB;
      } else if (a == "--streams") {
        o.streams = std::stoi(next());
      } else if (a == "--pin-threads") {
        o.pin_threads = std::stoi(next());
      } else if (a == "--pin-pipeline") {
        const std::string v = next();
        if (v != "registrar" && v != "workers") throw std::invalid_argument(v);
        o.pin_workers = v == "workers";
      } else if (a == "--pin-sweep") {
        std::string v = next();
        for (std::size_t pos = 0; pos <= v.size();) {
          const std::size_t comma = std::min(v.find(',', pos), v.size());
          const std::string e = v.substr(pos, comma - pos);
          if (e.size() < 2 || (e[0] != 'r' && e[0] != 'w')) throw std::invalid_argument(e);
          (void)std::stoi(e.substr(1));
          o.pin_sweep.push_back(e);
          pos = comma + 1;
        }
      } else if (a == "--pin-auto") {
        o.pin_auto = true;
      } else if (a == "--pin-size") {
        o.pin_sweep_gib = std::stod(next());
      } else if (a == "--backup") {
        const std::string v = next();
        if (v == "after-allocation") o.background_backup = true;
        else if (v != "at-first-sleep") die("--backup: '" + v + "' is not accepted (at-first-sleep, after-allocation)");
      } else if (a == "--no-prepared") {
        o.prepared = false;
      } else if (a == "--sweep") {
        o.sweep = true;
      } else if (a == "--no-discard") {
        o.discard = false;
      } else if (a == "--idle-ms") {
        o.idle_ms = std::stoi(next());
        if (o.idle_ms < 0 || o.idle_ms > 600'000) die("--idle-ms: accepted 0 to 600000 (milliseconds)");
      } else if (a == "--json") {
        o.json = next();
      } else {
        usage();
        return a == "--help" || a == "-h" ? 0 : 2;
      }
    } catch (const std::exception&) {
      usage();
      die("bad value for " + a);
    }
  }
  if (o.iterations < 1) die("--iterations must be at least 1");

  auto drv = Driver::get();
  if (!drv) {
    std::printf("SKIP: %s\n", drv.message().c_str());
    return 0;
  }
  const Driver& d = **drv;
  const std::string gpu = device_line(d);
  std::printf("device: %s, driver CUDA %d.%d\n", gpu.c_str(), d.driver_version / 1000, (d.driver_version % 1000) / 10);

  std::vector<SizeResult> pin_sweep;
  if (!o.pin_sweep.empty()) {
    std::printf("\nfirst sleep of %.2f GiB by pinning pipeline and faulting threads:\n", o.pin_sweep_gib);
    const SizeResult* best = nullptr;
    for (const std::string& e : o.pin_sweep) {
      Options so = o;
      so.pin_workers = e[0] == 'w';
      so.pin_threads = std::stoi(e.substr(1));
      pin_sweep.push_back(measure(static_cast<std::uint64_t>(o.pin_sweep_gib * static_cast<double>(kGiB)), so, false, true));
      const SizeResult& r = pin_sweep.back();
      std::printf("  %-9s %3d threads: %8.3f s  %7.2f GB/s\n", r.pin_workers ? "workers" : "registrar", r.pin_threads,
                  r.first_sleep_s, gbps(r.bytes, r.first_sleep_s));
      std::fflush(stdout);
    }
    for (const SizeResult& r : pin_sweep)
      if (best == nullptr || r.first_sleep_s < best->first_sleep_s) best = &r;
    if (o.pin_auto && best != nullptr) {
      o.pin_workers = best->pin_workers;
      o.pin_threads = best->pin_threads;
      std::printf("--pin-auto: the sizes below are measured with the %s pipeline and %d faulting threads\n",
                  best->pin_workers ? "workers" : "registrar", best->pin_threads);
    }
  }
  std::vector<SizeResult> results;
  std::printf("\n%8s %7s %7s %4s | %9s %9s %6s | %9s %9s %6s | %9s %9s %9s | %9s %9s %9s | %9s %9s\n", "size", "chunk",
              "streams", "pin", "wake", "plainH2D", "ratio", "sleep", "plainD2H", "ratio", "1st sleep", "1st sleep",
              "backup", "hostalloc", "prepare", "then 1st", "discard", "dwake");
  std::printf("%8s %7s %7s %4s | %9s %9s %6s | %9s %9s %6s | %9s %9s %9s | %9s %9s %9s | %9s %9s\n", "GiB", "MiB", "",
              "thr", "GB/s", "GB/s", "", "GB/s", "GB/s", "", "s", "GB/s", "bytes-sz", "GB/s", "GB/s", "GB/s", "s", "s");
  auto row = [](const SizeResult& r) {
    auto rate = [&](double s) { return gbps(r.bytes, s); };
    std::printf(
        "%8.2f %7zu %7d %4d | %9.2f %9.2f %6.3f | %9.2f %9.2f %6.3f | %9.3f %9.2f %9lld | %9.2f %9.2f %9.2f | %9.4f "
        "%9.4f\n",
        static_cast<double>(r.bytes) / kGiB, r.chunk / kMiB, r.streams, r.pin_threads, r.wake_gbps(), r.h2d_gbps(),
        r.h2d_gbps() > 0 ? r.wake_gbps() / r.h2d_gbps() : 0, r.sleep_gbps(), r.d2h_gbps(),
        r.d2h_gbps() > 0 ? r.sleep_gbps() / r.d2h_gbps() : 0, r.first_sleep_s, rate(r.first_sleep_s),
        static_cast<long long>(r.backup_bytes) - static_cast<long long>(r.bytes), rate(r.plain_pin_s),
        rate(r.prepare_s), rate(r.prepared_first_sleep_s), median(r.discard_sleep_s), median(r.discard_wake_s));
    std::fflush(stdout);
  };
  for (double g : o.sizes_gib) {
    const auto bytes = static_cast<std::uint64_t>(g * static_cast<double>(kGiB));
    results.push_back(measure(bytes, o, o.discard));
    row(results.back());
  }
  std::vector<SizeResult> sweep;
  if (o.sweep) {
    std::printf("\nsweep (4 GiB):\n");
    for (std::size_t chunk_mib : {32u, 128u, 256u, 1024u}) {
      for (int streams : {1, 2, 4}) {
        Options so = o;
        so.chunk = chunk_mib * kMiB;
        so.streams = streams;
        so.iterations = std::min(o.iterations, 3);
        so.prepared = false;
        sweep.push_back(measure(4 * kGiB, so, false));
        row(sweep.back());
      }
    }
  }
  if (!o.json.empty()) {
    std::FILE* f = std::fopen(o.json.c_str(), "w");
    if (f == nullptr) die("cannot write " + o.json);
    std::fprintf(f,
                 "{\n  \"date\": \"%s\",\n  \"gpu\": \"%s\",\n  \"driver_cuda_version\": %d,\n"
                 "  \"iterations\": %d,\n  \"idle_ms\": %d,\n  \"host_threads\": %u,\n  \"sizes\": [\n",
                 now_utc().c_str(), gpu.c_str(), d.driver_version, o.iterations, o.idle_ms,
                 std::thread::hardware_concurrency());
    for (std::size_t i = 0; i < results.size(); ++i)
      std::fprintf(f, "    %s%s\n", size_json(results[i]).c_str(), i + 1 < results.size() ? "," : "");
    std::fprintf(f, "  ],\n  \"sweep_4GiB\": [\n");
    for (std::size_t i = 0; i < sweep.size(); ++i)
      std::fprintf(f, "    %s%s\n", size_json(sweep[i]).c_str(), i + 1 < sweep.size() ? "," : "");
    std::fprintf(f, "  ],\n  \"pin_sweep\": [\n");
    for (std::size_t i = 0; i < pin_sweep.size(); ++i)
      std::fprintf(f, "    %s%s\n", size_json(pin_sweep[i]).c_str(), i + 1 < pin_sweep.size() ? "," : "");
    std::fprintf(f, "  ]\n}\n");
    std::fclose(f);
  }
  return 0;
}
