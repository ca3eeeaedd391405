// residency_cuda_bench: how fast the cuda backend puts device memory to sleep and wakes it,
// against a plain pinned copy of the same size measured in the same run.
//
// Google Benchmark does not fit this measurement: one cycle of 64 GiB takes seconds, the
// figure that matters is a ratio between two operations on the same bytes, and the run must
// check every byte after every wake. So this is a small program of its own:
//
//   for each size: allocate `weights` through the backend, fill it with a pattern, sleep
//   once (this first sleep also pins the host backup, reported apart), then per iteration:
//     sleep (end_residency: sync, chunked device-to-host copies, unmap + release)
//     plain device-to-host copy: cuMemcpyDtoH of the same size, plain cuMemAlloc buffer to
//       the same pinned backup buffer (it writes back the bytes the buffer was filled from,
//       so the backup is unchanged)
//     plain host-to-device copy: cuMemcpyHtoD of the same size from the same backup
//     wake (request_residency: create + map + chunked host-to-device copies, overlapped)
//     check: every byte of the woken allocation against the pattern (outside the timing)
//   The plain copies reuse the backup as their pinned buffer: a 64 GiB backup and a second
//   64 GiB pinned buffer would not both fit in the 128 GiB of a typical GPU host.
//   Then, for the same size, `scratch` sleep and wake (discarded: no copy).
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

namespace {

using residency::RegionClass;
using residency::RegionDesc;
using residency::Status;
using residency::cuda::CudaBackend;
using residency::cuda::ContextScope;
using residency::cuda::Driver;
using residency::cuda::PatternKernels;
using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kGiB = std::uint64_t{1} << 30;
constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;
constexpr std::uint64_t kSeed = 0x5eed5eedull;

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "residency_cuda_bench: %s\n", what.c_str());
  std::exit(1);
}
void check(const Status& s, const char* what) {
  if (!s) die(std::string(what) + ": " + s.message());
}
void check(const Driver& d, CUresult r, const char* what) {
  if (r != CUDA_SUCCESS) die(std::string(what) + ": " + d.describe(r));
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}
double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}
double gbps(std::uint64_t bytes, double s) { return s > 0 ? static_cast<double>(bytes) / s / 1e9 : 0; }

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
  std::size_t chunk = 0;
  int streams = 0;
  double first_sleep_s = 0;  // includes pinning the backup (cuMemHostAlloc)
  std::vector<double> sleep_s, wake_s, plain_d2h_s, plain_h2d_s;
  std::vector<double> discard_sleep_s, discard_wake_s;
  double wake_gbps() const { return gbps(bytes, median(wake_s)); }
  double sleep_gbps() const { return gbps(bytes, median(sleep_s)); }
  double h2d_gbps() const { return gbps(bytes, median(plain_h2d_s)); }
  double d2h_gbps() const { return gbps(bytes, median(plain_d2h_s)); }
};

struct Options {
  std::vector<double> sizes_gib = {1, 16, 64};
  int iterations = 5;
  std::size_t chunk = 0;  // 0: backend default
  int streams = 0;        // 0: backend default
  bool sweep = false;
  bool discard = true;
  std::string json;
};

// One backend, one size: the whole protocol described at the top of the file.
SizeResult measure(std::uint64_t bytes, const Options& o, bool with_discard) {
  residency::CudaBackendOptions bo;
  if (o.chunk) bo.chunk_bytes = o.chunk;
  if (o.streams) bo.streams = o.streams;
  auto made = CudaBackend::create(bo);
  if (!made) die(made.message());
  CudaBackend& b = **made;
  const Driver& d = b.driver();
  auto kernels = PatternKernels::load(d, b.context());
  if (!kernels) die(kernels.message());

  SizeResult res;
  res.bytes = bytes;
  res.chunk = b.chunk_bytes();
  res.streams = bo.streams;

  auto p = b.allocate(bytes, RegionClass::weights);
  if (!p) die(p.message());
  const auto va = static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(*p));
  check(kernels->fill(va, bytes, kSeed), "fill");
  {
    ContextScope scope(d, b.context());
    check(d, d.cuCtxSynchronize(), "fill");
  }
  RegionDesc desc;
  desc.id = 1;
  desc.base = *p;
  desc.size = bytes;
  desc.cls = RegionClass::weights;
  desc.backend_allocated = true;
  check(b.create_set(0, bytes), "create_set");
  b.add_region(0, desc);
  check(b.commit(0).status, "commit");
  auto ok = [&](const residency::SetOutcome& out, const char* what) {
    if (!out.ok()) die(std::string(what) + ": " + out.status.message());
  };
  ok(b.request_residency(0), "request_residency");

  auto t0 = Clock::now();
  (void)b.end_residency(0);  // checked through last_release_status()
  res.first_sleep_s = seconds_since(t0);
  check(b.last_release_status(), "first sleep");
  void* backup = b.host_backup(*p);
  if (backup == nullptr || b.is_resident(*p)) die("the first sleep left no backup or kept the memory");

  CUdeviceptr plain = 0;
  {
    ContextScope scope(d, b.context());
    check(d, d.cuMemAlloc(&plain, bytes), "cuMemAlloc for the plain copy");
    // Fill the plain buffer from the backup once, so that the timed device-to-host copies
    // write back exactly what the backup holds.
    check(d, d.cuMemcpyHtoD(plain, backup, bytes), "priming the plain buffer");
  }
  for (int it = 0; it < o.iterations; ++it) {
    {
      ContextScope scope(d, b.context());
      t0 = Clock::now();
      check(d, d.cuMemcpyDtoH(backup, plain, bytes), "plain device-to-host copy");
      check(d, d.cuCtxSynchronize(), "plain device-to-host copy");
      res.plain_d2h_s.push_back(seconds_since(t0));
      t0 = Clock::now();
      check(d, d.cuMemcpyHtoD(plain, backup, bytes), "plain host-to-device copy");
      check(d, d.cuCtxSynchronize(), "plain host-to-device copy");
      res.plain_h2d_s.push_back(seconds_since(t0));
    }
    t0 = Clock::now();
    ok(b.request_residency(0), "wake");
    res.wake_s.push_back(seconds_since(t0));
    auto bad = kernels->mismatches(va, bytes, kSeed);
    if (!bad) die(bad.message());
    if (*bad != 0) die("wake restored " + std::to_string(*bad) + " wrong words of " + std::to_string(bytes) + " bytes");
    t0 = Clock::now();
    (void)b.end_residency(0);  // checked through last_release_status()
    res.sleep_s.push_back(seconds_since(t0));
    check(b.last_release_status(), "sleep");
  }
  {
    ContextScope scope(d, b.context());
    check(d, d.cuMemFree(plain), "cuMemFree");
  }
  ok(b.request_residency(0), "final wake");
  auto bad = kernels->mismatches(va, bytes, kSeed);
  if (!bad || *bad != 0) die("final wake: contents differ");

  if (with_discard) {
    auto s = b.allocate(bytes, RegionClass::scratch);
    if (!s) die(s.message());
    RegionDesc sd = desc;
    sd.id = 2;
    sd.base = *s;
    sd.cls = RegionClass::scratch;
    check(b.create_set(1, bytes), "create_set");
    b.add_region(1, sd);
    check(b.commit(1).status, "commit");
    ok(b.request_residency(1), "request scratch");
    for (int it = 0; it < o.iterations; ++it) {
      t0 = Clock::now();
      (void)b.end_residency(1);  // checked through last_release_status()
      res.discard_sleep_s.push_back(seconds_since(t0));
      t0 = Clock::now();
      ok(b.request_residency(1), "wake scratch");
      res.discard_wake_s.push_back(seconds_since(t0));
    }
    if (b.host_backup(*s) != nullptr) die("scratch got a host backup: it must be discarded");
    (void)b.destroy_set(1);  // checked through last_release_status()
    b.deallocate(*s);
  }
  (void)b.destroy_set(0);  // checked through last_release_status()
  b.deallocate(*p);
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
  char head[512];
  std::snprintf(head, sizeof head,
                "{\"bytes\": %llu, \"chunk_bytes\": %zu, \"streams\": %d, \"first_sleep_s\": %.6f, "
                "\"wake_GBps\": %.2f, \"plain_h2d_GBps\": %.2f, \"wake_ratio\": %.4f, "
                "\"sleep_GBps\": %.2f, \"plain_d2h_GBps\": %.2f, \"sleep_ratio\": %.4f, ",
                static_cast<unsigned long long>(r.bytes), r.chunk, r.streams, r.first_sleep_s, r.wake_gbps(),
                r.h2d_gbps(), r.wake_gbps() / r.h2d_gbps(), r.sleep_gbps(), r.d2h_gbps(),
                r.sleep_gbps() / r.d2h_gbps());
  return std::string(head) + "\"wake_s\": " + json_list(r.wake_s) + ", \"sleep_s\": " + json_list(r.sleep_s) +
         ", \"plain_h2d_s\": " + json_list(r.plain_h2d_s) + ", \"plain_d2h_s\": " + json_list(r.plain_d2h_s) +
         ", \"discard_sleep_s\": " + json_list(r.discard_sleep_s) +
         ", \"discard_wake_s\": " + json_list(r.discard_wake_s) + "}";
}

void usage() {
  std::puts(
      "usage: residency_cuda_bench [--sizes GiB,GiB,...] [--iterations N] [--chunk-mib N]\n"
      "                            [--streams N] [--sweep] [--no-discard] [--json FILE]\n"
      "  --sizes       sizes to measure, in GiB (default 1,16,64)\n"
      "  --iterations  timed sleep/wake cycles per size (default 5); medians are reported\n"
      "  --chunk-mib   chunk size of the backend (default: the backend's, 256)\n"
      "  --streams     copy streams of the backend (default: the backend's, 4)\n"
      "  --sweep       also measure 4 GiB over chunk sizes 32..1024 MiB and 1, 2, 4 streams\n"
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
      } else if (a == "--sweep") {
        o.sweep = true;
      } else if (a == "--no-discard") {
        o.discard = false;
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

  std::vector<SizeResult> results;
  std::printf("\n%8s %7s %7s | %9s %9s %6s | %9s %9s %6s | %9s %10s %10s\n", "size", "chunk", "streams",
              "wake", "plainH2D", "ratio", "sleep", "plainD2H", "ratio", "1st sleep", "discard_s", "dwake_s");
  std::printf("%8s %7s %7s | %9s %9s %6s | %9s %9s %6s | %9s %10s %10s\n", "GiB", "MiB", "", "GB/s", "GB/s", "",
              "GB/s", "GB/s", "", "s", "(scratch)", "(scratch)");
  auto row = [](const SizeResult& r) {
    std::printf("%8.2f %7zu %7d | %9.2f %9.2f %6.3f | %9.2f %9.2f %6.3f | %9.3f %10.4f %10.4f\n",
                static_cast<double>(r.bytes) / kGiB, r.chunk / kMiB, r.streams, r.wake_gbps(), r.h2d_gbps(),
                r.wake_gbps() / r.h2d_gbps(), r.sleep_gbps(), r.d2h_gbps(), r.sleep_gbps() / r.d2h_gbps(),
                r.first_sleep_s, median(r.discard_sleep_s), median(r.discard_wake_s));
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
        sweep.push_back(measure(4 * kGiB, so, false));
        row(sweep.back());
      }
    }
  }
  if (!o.json.empty()) {
    std::FILE* f = std::fopen(o.json.c_str(), "w");
    if (f == nullptr) die("cannot write " + o.json);
    std::fprintf(f, "{\n  \"date\": \"%s\",\n  \"gpu\": \"%s\",\n  \"driver_cuda_version\": %d,\n"
                    "  \"iterations\": %d,\n  \"host_threads\": %u,\n  \"sizes\": [\n",
                 now_utc().c_str(), gpu.c_str(), d.driver_version, o.iterations,
                 std::thread::hardware_concurrency());
    for (std::size_t i = 0; i < results.size(); ++i)
      std::fprintf(f, "    %s%s\n", size_json(results[i]).c_str(), i + 1 < results.size() ? "," : "");
    std::fprintf(f, "  ],\n  \"sweep_4GiB\": [\n");
    for (std::size_t i = 0; i < sweep.size(); ++i)
      std::fprintf(f, "    %s%s\n", size_json(sweep[i]).c_str(), i + 1 < sweep.size() ? "," : "");
    std::fprintf(f, "  ]\n}\n");
    std::fclose(f);
  }
  return 0;
}
