/* A toy inference engine in C: it maps its "weights", lets the residency manager keep them
 * locked while it serves, and releases them when idle. It shows the whole C API in order:
 * configuration (environment first, then the engine's own defaults), manager, registration,
 * touch per step, a use scope, stats and teardown.
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

int main(void) {
  residency_config* cfg = NULL;
  if (residency_config_from_env(&cfg) != RESIDENCY_OK) {
    fprintf(stderr, "bad residency configuration:\n%s\n", residency_last_error());
    return 2;
  }
  residency_manager* m = NULL;
  if (residency_manager_create(cfg, "auto", on_log, NULL, &m) != RESIDENCY_OK) {
    fprintf(stderr, "cannot create the residency manager: %s\n", residency_last_error());
    residency_config_free(cfg);
    return 1;
  }
  residency_config_free(cfg);

  const size_t bytes = 4u << 20; /* 4 MiB of "weights": under the default 8 MiB RLIMIT_MEMLOCK */
  float* weights = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (weights == MAP_FAILED) {
    perror("mmap");
    residency_manager_destroy(m);
    return 1;
  }
  for (size_t i = 0; i < bytes / sizeof(float); ++i) weights[i] = (float)(i % 7);

  uint64_t id = 0;
  if (residency_register(m, weights, bytes, RESIDENCY_WEIGHTS, 10, &id) != RESIDENCY_OK)
    fprintf(stderr, "weights not registered: %s (continuing unmanaged)\n", residency_last_error());

  float sum = 0.0f;
  for (int step = 0; step < 100; ++step) {
    residency_touch(m); /* once per graph compute: lock-free */
    sum += decode_step(weights, bytes / sizeof(float));
  }

  residency_scope* scope = NULL;
  if (residency_use_begin(m, synchronize, NULL, &scope) == RESIDENCY_OK) {
    sum += decode_step(weights, bytes / sizeof(float));
  }
  residency_use_end(scope);

  residency_stats st;
  if (residency_get_stats(m, &st) == RESIDENCY_OK)
    printf("tracked %llu bytes, wired %llu bytes, %u set(s), %llu commit(s), checksum %.0f\n",
           (unsigned long long)st.tracked_bytes, (unsigned long long)st.wired_bytes, st.sets,
           (unsigned long long)st.commits, (double)sum);

  residency_unregister(m, id);
  residency_manager_destroy(m);
  munmap(weights, bytes);
  return 0;
}
