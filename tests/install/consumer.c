/* SPDX-License-Identifier: MIT */
/* A C program built against the installed libresidency.so: it checks the ABI it was compiled
 * for, creates a manager on the machine's backend, registers memory, touches it and reads the
 * stats back. Plain C: it needs no C++ runtime of its own. */
#include <stdio.h>
#include <stdlib.h>

#include "residency/residency.h"

int main(void) {
  if (residency_abi_version() != RESIDENCY_ABI_VERSION) {
    printf("consumer: library ABI %u, header ABI %d\n", residency_abi_version(), RESIDENCY_ABI_VERSION);
    return 1;
  }
  residency_config* cfg = residency_config_default();
  if (!cfg || residency_config_set(cfg, "keep_alive", "5m") != RESIDENCY_OK ||
      residency_config_set(cfg, "log", "error") != RESIDENCY_OK) {
    printf("consumer: %s\n", residency_last_error());
    return 1;
  }
  residency_manager* m = NULL;
  residency_status st = residency_manager_create(cfg, "auto", NULL, NULL, &m);
  residency_config_free(cfg);
  if (st != RESIDENCY_OK) {
    printf("consumer: %s\n", residency_last_error());
    return 1;
  }
  const size_t n = 64 * 1024;
  void* p = aligned_alloc(4096, n);
  uint64_t id = 0;
  if (!p || residency_register(m, p, n, RESIDENCY_WEIGHTS, 0, &id) != RESIDENCY_OK) {
    printf("consumer: %s\n", residency_last_error());
    return 1;
  }
  residency_touch_region(m, id);
  residency_stats s = RESIDENCY_STATS_INIT;
  if (residency_get_stats(m, &s) != RESIDENCY_OK || s.tracked_bytes != n) {
    printf("consumer: stats %s\n", residency_last_error());
    return 1;
  }
  residency_unregister_ptr(m, p);
  residency_manager_destroy(m);
  free(p);
  printf("consumer: ok (residency %s, wired %llu of %llu bytes)\n", residency_version(),
         (unsigned long long)s.wired_bytes, (unsigned long long)s.tracked_bytes);
  return 0;
}
