/* SPDX-License-Identifier: MIT */
/* VmLck of this process (/proc/self/status), in kB; -1 when it cannot be read. Shared by the C
 * host programs of the preload tests. */
#ifndef RESIDENCY_TESTS_PRELOAD_VM_LCK_H
#define RESIDENCY_TESTS_PRELOAD_VM_LCK_H
#include <stdio.h>

static inline long vm_lck_kb(void) {
  FILE* f = fopen("/proc/self/status", "r");
  if (f == NULL) return -1;
  char line[256];
  long kb = -1;
  while (fgets(line, sizeof line, f) != NULL)
    if (sscanf(line, "VmLck: %ld kB", &kb) == 1) break;
  fclose(f);
  return kb;
}

#endif
