/* SPDX-License-Identifier: MIT */
/* VmLck of this process (/proc/self/status), and what is locked of a range (/proc/self/smaps), in kB;
 * -1 when it cannot be read. Shared by the C host programs of the preload tests. */
#ifndef RESIDENCY_TESTS_PRELOAD_VM_LCK_H
#define RESIDENCY_TESTS_PRELOAD_VM_LCK_H
#include <stdint.h>
#include <stdio.h>
#include <string.h>

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

/* Locked kB of the VMAs of /proc/self/smaps that overlap [b, e), each counted whole. */
static inline long locked_kb(const void* begin, size_t len) {
  const uintptr_t b = (uintptr_t)begin, e = b + len;
  FILE* f = fopen("/proc/self/smaps", "r");
  if (f == NULL) return -1;
  char line[512];
  long total = 0;
  int in = 0;
  while (fgets(line, sizeof line, f) != NULL) {
    unsigned long lo = 0, hi = 0;
    long kb = 0;
    if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') != NULL && line[0] != ' ') {
      in = lo < e && b < hi;
    } else if (in && sscanf(line, "Locked: %ld kB", &kb) == 1) {
      total += kb;
    }
  }
  fclose(f);
  return total;
}

#endif
