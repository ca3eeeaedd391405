// SPDX-License-Identifier: MIT
// residency_cuda_release_probe: how fast a wake runs in the moments after other device memory
// was released, as in a switch under a GPU budget (one server releases its model, the next
// wakes its own at once).
//
// A wake right after a sleep ran measurably slower than a plain pinned copy, and at the copy's
// rate after a pause of a few seconds (docs/measurements.md, "cuda backend"); a switch is exactly
// that case. This program measures the window: for each delay d,
//   - the "victim": --free-gib of scratch device memory through a cuda backend (cuMemCreate
//     chunks of 256 MiB, mapped, then written with cuMemsetD8), left quiet for --quiet-ms, then
//     released (end_residency: a scratch set is discarded, so the release is unmap + release
//     only), timed;
//   - d ms later, one of
//       wake: the backend's own wake of --copy-gib of weights from a pinned backup (create, map,
//             chunked copies over its streams), timed as a whole;
//       copy: the same bytes from the same backup into device memory that exists already
//             (cuMemAlloc'd at the start), in 256 MiB pieces on one stream, each piece's end
//             timed by an event, so the rate over time shows when a slowdown ends.
//   The baseline of each kind ("none"): the same after --quiet-ms without a release before.
// Output: a table of medians on stdout and, with --json FILE, every run (each piece's end time
// of the copies included).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "backends/cuda/cuda_backend.hpp"

#include "tool_support.hpp"

const char* const residency::cuda::tools::kToolName = "residency_cuda_release_probe";

namespace {

using residency::RegionClass;
using residency::cuda::ContextScope;
using residency::cuda::CudaBackend;
using residency::cuda::Driver;
using namespace residency::cuda::tools;

constexpr std::uint64_t kPiece = 256 * kMiB;

[[noreturn]] void usage(const std::string& what, int status = 2) {
  std::fprintf(status == 0 ? stdout : stderr,
               "%s%s"
               "usage: residency_cuda_release_probe [--free-gib G] [--copy-gib G] [--delays MS,MS,...]\n"
               "                                    [--quiet-ms MS] [--repeats N] [--json FILE]\n"
               "  --free-gib   device memory released before each measured copy (default 12)\n"
               "  --copy-gib   bytes woken or copied after it (default 8)\n"
               "  --delays     pauses between the release and the copy, in ms (default 0,20,50,100,200,500)\n"
               "  --quiet-ms   pause before each release and before each baseline (default 1500)\n"
               "  --repeats    runs of each delay and kind (default 3)\n"
               "  --json FILE  write every run to FILE\n",
               what.empty() ? "" : "residency_cuda_release_probe: ", what.empty() ? "" : (what + "\n").c_str());
  std::exit(status);
}
double positive(const std::string& flag, const std::string& v, double max, bool zero = false) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (end == v.c_str() || *end != '\0' || !(x > 0 || (zero && x == 0)) || x > max)
    usage(flag + ": '" + v + "' is not accepted (a number " + (zero ? "from 0" : "above 0") + ", at most " +
          std::to_string(static_cast<long>(max)) + ")");
  return x;
}

struct Run {
  std::string kind;   // "wake" or "copy"
  int delay_ms = -1;  // -1: the baseline, no release before
  double release_s = 0;
  double seconds = 0;
  std::vector<double> piece_end_ms;  // copy: each piece's end after the first piece began
};

struct Options {
  double free_gib = 12;
  double copy_gib = 8;
  std::vector<int> delays = {0, 20, 50, 100, 200, 500};
  int quiet_ms = 1500;
  int repeats = 3;
  std::string json;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(a + " needs a value");
      return argv[++i];
    };
    if (a == "--free-gib") {
      o.free_gib = positive(a, value(), 1024);
    } else if (a == "--copy-gib") {
      o.copy_gib = positive(a, value(), 1024);
    } else if (a == "--delays") {
      o.delays.clear();
      std::string v = value();
      for (std::size_t p = 0; p <= v.size();) {
        const std::size_t q = std::min(v.find(',', p), v.size());
        const std::string item = v.substr(p, q - p);
        o.delays.push_back(static_cast<int>(positive(a, item, 60'000, /*zero=*/true)));
        p = q + 1;
      }
    } else if (a == "--quiet-ms") {
      o.quiet_ms = static_cast<int>(positive(a, value(), 60'000));
    } else if (a == "--repeats") {
      o.repeats = static_cast<int>(positive(a, value(), 100));
    } else if (a == "--json") {
      o.json = value();
    } else if (a == "--help" || a == "-h") {
      usage("", 0);
    } else {
      usage("unknown argument '" + a + "'");
    }
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const auto free_bytes = static_cast<std::uint64_t>(o.free_gib * kGiB) / kPiece * kPiece;
  const auto copy_bytes = static_cast<std::uint64_t>(o.copy_gib * kGiB) / kPiece * kPiece;
  if (free_bytes == 0 || copy_bytes == 0) usage("--free-gib and --copy-gib must be at least 0.25");

  auto made = CudaBackend::create({});
  if (!made) die(made.message());
  CudaBackend& b = **made;
  const Driver& d = b.driver();

  auto ptr = [](void* p) { return static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p)); };

  // The waker: weights with a pinned backup, asleep. The victim: scratch, awake.
  auto w = b.allocate(copy_bytes, RegionClass::weights);
  if (!w) die(w.message());
  request_in_new_set(b, 0, 1, *w, copy_bytes, RegionClass::weights);
  {
    ContextScope scope(d, b.context());
    check(d, d.cuMemsetD8(ptr(*w), 0x5a, copy_bytes), "cuMemsetD8 (weights)");
    check(d, d.cuCtxSynchronize(), "cuCtxSynchronize");
  }
  check(b.prepare_backup(*w), "prepare_backup");
  (void)b.end_residency(0);
  check(b.last_release_status(), "first sleep");
  const char* backup = static_cast<const char*>(b.host_backup(*w));
  if (backup == nullptr) die("the weights have no backup after their first sleep");

  auto v = b.allocate(free_bytes, RegionClass::scratch);
  if (!v) die(v.message());
  request_in_new_set(b, 1, 2, *v, free_bytes, RegionClass::scratch);
  (void)b.end_residency(1);

  CUdeviceptr dst = 0;
  CUstream stream = nullptr;
  std::vector<CUevent> events(copy_bytes / kPiece + 1);
  {
    ContextScope scope(d, b.context());
    check(d, d.cuMemAlloc(&dst, copy_bytes), "cuMemAlloc (the copy's destination)");
    check(d, d.cuMemsetD8(dst, 0, copy_bytes), "cuMemsetD8 (the copy's destination)");
    check(d, d.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    for (auto& e : events) check(d, d.cuEventCreate(&e, CU_EVENT_DEFAULT), "cuEventCreate");
    check(d, d.cuCtxSynchronize(), "cuCtxSynchronize");
  }

  std::vector<Run> runs;
  for (int rep = 0; rep < o.repeats; ++rep) {
    for (int di = -1; di < static_cast<int>(o.delays.size()); ++di) {
      for (const char* kind : {"wake", "copy"}) {
        Run r;
        r.kind = kind;
        r.delay_ms = di < 0 ? -1 : o.delays[static_cast<std::size_t>(di)];
        if (r.delay_ms >= 0) {
          if (!b.request_residency(1).ok()) die("waking the victim");
          {
            ContextScope scope(d, b.context());
            check(d, d.cuMemsetD8(ptr(*v), 0x33, free_bytes), "cuMemsetD8 (victim)");
            check(d, d.cuCtxSynchronize(), "cuCtxSynchronize");
          }
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(o.quiet_ms));
        if (r.delay_ms >= 0) {
          const auto t0 = Clock::now();
          (void)b.end_residency(1);
          r.release_s = seconds_since(t0);
          check(b.last_release_status(), "releasing the victim");
          if (r.delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(r.delay_ms));
        }
        if (r.kind == "wake") {
          const auto t0 = Clock::now();
          if (!b.request_residency(0).ok()) die("waking the weights");
          r.seconds = seconds_since(t0);
          (void)b.end_residency(0);  // untracked weights: copied back (outside the timing)
          check(b.last_release_status(), "sleeping the weights");
        } else {
          ContextScope scope(d, b.context());
          const auto t0 = Clock::now();
          check(d, d.cuEventRecord(events[0], stream), "cuEventRecord");
          for (std::uint64_t off = 0, i = 1; off < copy_bytes; off += kPiece, ++i) {
            check(d, d.cuMemcpyHtoDAsync(dst + off, backup + off, kPiece, stream), "cuMemcpyHtoDAsync");
            check(d, d.cuEventRecord(events[i], stream), "cuEventRecord");
          }
          check(d, d.cuStreamSynchronize(stream), "cuStreamSynchronize");
          r.seconds = seconds_since(t0);
          for (std::size_t i = 1; i < events.size(); ++i) {
            float ms = 0;
            check(d, d.cuEventElapsedTime(&ms, events[0], events[i]), "cuEventElapsedTime");
            r.piece_end_ms.push_back(ms);
          }
        }
        runs.push_back(std::move(r));
      }
    }
  }

  char name[256] = {0};
  CUdevice dev = 0;
  if (d.cuDeviceGet(&dev, 0) == CUDA_SUCCESS) (void)d.cuDeviceGetName(name, sizeof name, dev);
  std::printf("%s: %.2f GiB released, then %.2f GiB woken or copied; medians of %d\n", name,
              static_cast<double>(free_bytes) / kGiB, static_cast<double>(copy_bytes) / kGiB, o.repeats);
  std::printf("%10s | %10s %9s | %10s %9s | %s\n", "delay ms", "wake s", "GB/s", "copy s", "GB/s",
              "copy: GB/s of each quarter");
  for (int di = -1; di < static_cast<int>(o.delays.size()); ++di) {
    const int delay = di < 0 ? -1 : o.delays[static_cast<std::size_t>(di)];
    std::vector<double> wake, copy;
    std::vector<std::vector<double>> quarters(4);
    for (const Run& r : runs) {
      if (r.delay_ms != delay) continue;
      (r.kind == "wake" ? wake : copy).push_back(r.seconds);
      if (r.kind != "copy") continue;
      const std::size_t n = r.piece_end_ms.size();
      for (std::size_t q = 0; q < 4; ++q) {
        const std::size_t a = q * n / 4, z = (q + 1) * n / 4;
        const double t_a = a == 0 ? 0 : r.piece_end_ms[a - 1];
        if (z > a) quarters[q].push_back(gbps((z - a) * kPiece, (r.piece_end_ms[z - 1] - t_a) / 1e3));
      }
    }
    char q[128];
    std::snprintf(q, sizeof q, "%.1f %.1f %.1f %.1f", median(quarters[0]), median(quarters[1]), median(quarters[2]),
                  median(quarters[3]));
    std::printf("%10s | %10.4f %9.2f | %10.4f %9.2f | %s\n", delay < 0 ? "none" : std::to_string(delay).c_str(),
                median(wake), gbps(copy_bytes, median(wake)), median(copy), gbps(copy_bytes, median(copy)), q);
  }

  if (!o.json.empty()) {
    FILE* f = std::fopen(o.json.c_str(), "w");
    if (f == nullptr) die("cannot write " + o.json);
    std::fprintf(f,
                 "{\"device\": \"%s\", \"free_bytes\": %llu, \"copy_bytes\": %llu, \"piece_bytes\": %llu, "
                 "\"quiet_ms\": %d, \"runs\": [",
                 name, static_cast<unsigned long long>(free_bytes), static_cast<unsigned long long>(copy_bytes),
                 static_cast<unsigned long long>(kPiece), o.quiet_ms);
    for (std::size_t i = 0; i < runs.size(); ++i) {
      const Run& r = runs[i];
      std::fprintf(
          f, "%s\n  {\"kind\": \"%s\", \"delay_ms\": %d, \"release_s\": %.6f, \"seconds\": %.6f, \"piece_end_ms\": [",
          i ? "," : "", r.kind.c_str(), r.delay_ms, r.release_s, r.seconds);
      for (std::size_t k = 0; k < r.piece_end_ms.size(); ++k)
        std::fprintf(f, "%s%.3f", k ? ", " : "", r.piece_end_ms[k]);
      std::fprintf(f, "]}");
    }
    std::fprintf(f, "\n]}\n");
    std::fclose(f);
  }

  {
    ContextScope scope(d, b.context());
    for (auto e : events) (void)d.cuEventDestroy(e);
    (void)d.cuStreamDestroy(stream);
    (void)d.cuMemFree(dst);
  }
  (void)b.destroy_set(1);
  b.deallocate(*v);
  (void)b.destroy_set(0);
  b.deallocate(*w);
  return 0;
}
