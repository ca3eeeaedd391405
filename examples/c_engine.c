/* SPDX-License-Identifier: MIT */
/* A toy inference engine in C: it maps its "weights" and a "KV cache", lets the residency
 * manager keep them locked while it serves, and releases them when idle. It shows the C API in
 * the order an engine meets it: configuration (environment first), the process's backend, a
 * manager, registration in one batch, prefetch when a request arrives, touch per decode step,
 * a use scope, stats, and teardown by pointer.
 *
 *   RESIDENCY_KEEP_ALIVE=2s ./c_engine
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "residency/residency.h"

static void on_log(residency_log_level level, const char* message, void* user) {
  (void)user;
  static const char* names[] = {"error", "warn", "info", "debug"};
  fprintf(stderr, "[engine] residency %s: %s\n", names[level], message);
}

static void synchronize(void* user) {
  /* A GPU engine waits for its queue here; the CPU engine has nothing in flight. */
  (void)user;
}

static float decode_step(const float* w, size_t n) {
  float acc = 0.0f;
  for (size_t i = 0; i < n; i += 1024) acc += w[i];
  return acc;
}

/* What the kernel says this process has locked (VmLck), in bytes; -1 if unknown. */
static long long vm_lck(void) {
  FILE* f = fopen("/proc/self/status", "r");
  if (!f) return -1;
  char line[256];
  long long kib = -1;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "VmLck: %lld kB", &kib) == 1) break;
  fclose(f);
  return kib < 0 ? -1 : kib * 1024;
}

int main(void) {
  printf("residency %s (C ABI %u)\n", residency_version(), residency_abi_version());
  residency_config* cfg = NULL;
  if (residency_config_from_env(&cfg) != RESIDENCY_OK) {
    fprintf(stderr, "bad residency configuration:\n%s\n", residency_last_error());
    return 2;
  }
  residency_backend* backend = NULL;
  residency_backend_options bo = RESIDENCY_BACKEND_OPTIONS_INIT; /* "auto": cuda, metal, else posix */
  if (residency_backend_create(&bo, &backend) != RESIDENCY_OK) {
    fprintf(stderr, "no residency backend: %s\n", residency_last_error());
    residency_config_free(cfg);
    return 1;
  }
  residency_manager* m = NULL;
  residency_status st = residency_manager_create_with_backend(cfg, backend, on_log, NULL, &m);
  residency_config_free(cfg);
  residency_backend_release(backend); /* the manager keeps it alive */
  if (st != RESIDENCY_OK) {
    fprintf(stderr, "cannot create the residency manager: %s\n", residency_last_error());
    return 1;
  }

  /* 3 + 1 MiB: under the default 8 MiB RLIMIT_MEMLOCK of an unprivileged process. */
  const size_t wbytes = 3u << 20, kvbytes = 1u << 20;
  float* weights = mmap(NULL, wbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  float* kv = mmap(NULL, kvbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (weights == MAP_FAILED || kv == MAP_FAILED) {
    perror("mmap");
    residency_manager_destroy(m);
    return 1;
  }
  for (size_t i = 0; i < wbytes / sizeof(float); ++i) weights[i] = (float)(i % 7);
  memset(kv, 0, kvbytes);

  /* Load the model: both regions committed together, once per touched set. */
  uint64_t wid = 0, kvid = 0;
  residency_batch_begin(m);
  if (residency_register(m, weights, wbytes, RESIDENCY_WEIGHTS, 10, &wid) != RESIDENCY_OK)
    fprintf(stderr, "weights not registered: %s (continuing unmanaged)\n", residency_last_error());
  if (residency_register(m, kv, kvbytes, RESIDENCY_KV_CACHE, 0, &kvid) != RESIDENCY_OK)
    fprintf(stderr, "KV cache not registered: %s (continuing unmanaged)\n", residency_last_error());
  residency_batch_end(m);

  float sum = 0.0f;
  for (int request = 0; request < 3; ++request) {
    residency_prefetch(m); /* a request arrived: re-wire in the background while we tokenize */
    for (int step = 0; step < 32; ++step) {
      residency_touch_region(m, wid); /* once per graph compute: lock-free */
      residency_touch_region(m, kvid);
      sum += decode_step(weights, wbytes / sizeof(float));
    }
  }

  /* A one-shot generation: resident for the scope; NULL means nothing to end. */
  residency_status scope_status = RESIDENCY_OK;
  residency_scope* scope = residency_use_begin(m, synchronize, NULL, &scope_status);
  if (scope != NULL) {
    if (scope_status != RESIDENCY_OK) fprintf(stderr, "partly wired: %s\n", residency_last_error());
    sum += decode_step(weights, wbytes / sizeof(float));
    residency_use_end(scope);
  }

  residency_stats stats = RESIDENCY_STATS_INIT;
  if (residency_get_stats(m, &stats) == RESIDENCY_OK)
    printf(
        "tracked %llu bytes, wired %llu bytes (the kernel's VmLck: %lld), %u set(s), %llu commit(s), checksum %.0f\n",
        (unsigned long long)stats.tracked_bytes, (unsigned long long)stats.wired_bytes, vm_lck(), stats.sets,
        (unsigned long long)stats.commits, (double)sum);

  residency_unregister_ptr(m, kv);
  residency_unregister(m, wid);
  residency_manager_destroy(m);
  munmap(weights, wbytes);
  munmap(kv, kvbytes);
  printf("after teardown: VmLck %lld\n", vm_lck());
  return 0;
}
