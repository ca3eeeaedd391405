/* SPDX-License-Identifier: MIT */
/* Every C library memory call the preload interposes, over the flag combinations each takes,
 * valid and invalid; a program that knows nothing about residency. The preload must forward each
 * call's arguments exactly as the C library reads them (mremap's fifth, new_address, included),
 * so the tests run this table without and with it and compare the lines.
 *
 *   memory_calls [MODEL]
 *
 * MODEL: first loads it with llama.cpp and decodes one token (under the preload, the session is
 * then running and holds the model), prints "# vm_lck_kb N" (a comment line: it differs with and
 * without the preload), then runs the table; the model is freed at the end.
 *
 * One line per case, "NAME RESULT ERRNO": RESULT never holds an address (0 / -1 for the calls
 * that return an int; for mmap and mremap MAP_FAILED, or where the mapping landed and what it
 * holds, e.g. "moved,data,old_zero"), ERRNO is errno's name after the call (errno is set to 0
 * before each: a call that succeeds must leave it so). Locks are 64 KiB at most, each undone at
 * once; mlockall runs last, each case followed by munlockall. The scratch file is unlinked as
 * soon as it is open. Exit status 0 when the table ran, 1 when its own setup failed. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <ggml-backend.h>
#include <llama.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include "vm_lck.h"

#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4
#endif
#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif
#ifndef MAP_SYNC
#define MAP_SYNC 0x80000
#endif
#ifndef MLOCK_ONFAULT
#define MLOCK_ONFAULT 1
#endif
#ifndef MCL_ONFAULT
#define MCL_ONFAULT 4
#endif

static size_t P; /* the page size */
static int g_cases = 0;
static int g_rw_fd = -1, g_ro_fd = -1; /* the scratch file: 4 pages of 'f' */

static const char* errno_name(int e) {
  if (e == 0) return "0";
#if defined(__GLIBC__) && (__GLIBC__ > 2 || __GLIBC_MINOR__ >= 32)
  const char* n = strerrorname_np(e);
  if (n != NULL) return n;
#endif
  static char buf[16];
  snprintf(buf, sizeof buf, "E%d", e);
  return buf;
}

static void line(const char* name, const char* result, int err) {
  printf("%s %s %s\n", name, result, errno_name(err));
  fflush(stdout);
  ++g_cases;
}

static void die(const char* what) {
  fprintf(stderr, "memory_calls: setup failed: %s: %s\n", what, strerror(errno));
  exit(1);
}

/* Setup and cleanup go through the same (interposed) calls; only their failure is checked. */
static char* anon(size_t n, int flags) {
  char* p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_ANONYMOUS | flags, -1, 0);
  if (p == MAP_FAILED) die("mmap");
  memset(p, 'a', n);
  return p;
}
static char* reserve(size_t n) {
  char* p = mmap(NULL, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) die("mmap (reservation)");
  return p;
}
static void drop(void* p, size_t n) {
  if (p != NULL && p != MAP_FAILED) munmap(p, n);
}

/* Whether every page of [p, p + n) is mapped (mincore fails with ENOMEM on a hole). */
static int mapped(const void* p, size_t n) {
  unsigned char vec[64];
  if (n / P > sizeof vec) return 0;
  const int saved = errno;
  const int ok = mincore((void*)p, n, vec) == 0;
  errno = saved;
  return ok;
}
static int all(const char* p, size_t n, char c) {
  for (size_t i = 0; i < n; i += P)
    if (p[i] != c) return 0;
  return 1;
}

/* ---- int-returning calls ---------------------------------------------------------------- */

#define INT_CASE(name, call)               \
  do {                                     \
    errno = 0;                             \
    const int r_ = (call);                 \
    const int e_ = errno;                  \
    char res_[16];                         \
    snprintf(res_, sizeof res_, "%d", r_); \
    line(name, res_, e_);                  \
  } while (0)

/* ---- mremap --------------------------------------------------------------------------- */

/* Where mremap's result landed (same / at_target / moved), whether it holds old's first bytes
 * (`c`), and what is left at old when it moved: unmapped, zero (MREMAP_DONTUNMAP on private
 * memory) or data (on shared memory). */
static void remap_line(const char* name, char* r, int err, char* old, size_t old_n, size_t new_n, const char* target,
                       char c) {
  char res[64];
  if (r == MAP_FAILED) {
    line(name, "MAP_FAILED", err);
    return;
  }
  const char* where = r == old ? "same" : (target != NULL && r == target) ? "at_target" : "moved";
  const char* data = all(r, old_n < new_n ? old_n : new_n, c) ? "data" : "nodata";
  const char* left = "";
  if (r != old && !mapped(old, old_n)) left = ",old_unmapped";
  else if (r != old) left = all(old, old_n, 0) ? ",old_zero" : all(old, old_n, c) ? ",old_data" : ",old_other";
  snprintf(res, sizeof res, "%s,%s%s", where, data, left);
  line(name, res, err);
}

static void mremap_cases(void) {
  char *a, *r, *res;

  a = anon(4 * P, MAP_PRIVATE);
  errno = 0;
  r = mremap(a, 4 * P, 4 * P, 0);
  remap_line("mremap_0_same_size", r, errno, a, 4 * P, 4 * P, NULL, 'a');
  drop(a, 4 * P);

  a = anon(4 * P, MAP_PRIVATE);
  errno = 0;
  r = mremap(a, 4 * P, 2 * P, 0);
  remap_line("mremap_0_shrink", r, errno, a, 2 * P, 2 * P, NULL, 'a');
  drop(a, 4 * P);

  a = anon(4 * P, MAP_PRIVATE);
  drop(a + P, 3 * P); /* the hole it grows into */
  errno = 0;
  r = mremap(a, P, 4 * P, 0);
  remap_line("mremap_0_grow_in_place", r, errno, a, P, 4 * P, NULL, 'a');
  drop(r != MAP_FAILED ? r : a, r != MAP_FAILED ? 4 * P : P);

  a = anon(2 * P, MAP_PRIVATE); /* its own second page is in the way */
  errno = 0;
  r = mremap(a, P, 2 * P, 0);
  remap_line("mremap_0_grow_blocked", r, errno, a, P, 2 * P, NULL, 'a');
  drop(a, 2 * P);

  a = anon(2 * P, MAP_PRIVATE);
  errno = 0;
  r = mremap(a, P, 4 * P, MREMAP_MAYMOVE);
  remap_line("mremap_maymove_grow", r, errno, a, P, 4 * P, NULL, 'a');
  drop(r, 4 * P);
  drop(a, 2 * P);

  a = anon(2 * P, MAP_PRIVATE); /* locked: the new range is locked and populated too */
  INT_CASE("mremap_mlock_first", mlock(a, P));
  errno = 0;
  r = mremap(a, P, 4 * P, MREMAP_MAYMOVE);
  remap_line("mremap_maymove_grow_locked", r, errno, a, P, 4 * P, NULL, 'a');
  if (r != MAP_FAILED) munlock(r, 4 * P);
  drop(r, 4 * P);
  munlock(a, 2 * P);
  drop(a, 2 * P);

  a = anon(4 * P, MAP_PRIVATE);
  errno = 0;
  r = mremap(a, 4 * P, 2 * P, MREMAP_MAYMOVE);
  remap_line("mremap_maymove_shrink", r, errno, a, 2 * P, 2 * P, NULL, 'a');
  drop(a, 4 * P);

  a = anon(4 * P, MAP_PRIVATE);
  res = reserve(8 * P);
  errno = 0;
  r = mremap(a, 4 * P, 4 * P, MREMAP_MAYMOVE | MREMAP_FIXED, res + 2 * P);
  remap_line("mremap_maymove_fixed", r, errno, a, 4 * P, 4 * P, res + 2 * P, 'a');
  drop(a, 4 * P);
  drop(res, 8 * P);

  a = anon(4 * P, MAP_PRIVATE);
  res = reserve(8 * P);
  errno = 0;
  r = mremap(a, 4 * P, 6 * P, MREMAP_MAYMOVE | MREMAP_FIXED, res + 2 * P);
  remap_line("mremap_maymove_fixed_grow", r, errno, a, 4 * P, 6 * P, res + 2 * P, 'a');
  drop(a, 4 * P);
  drop(res, 8 * P);

  a = anon(4 * P, MAP_PRIVATE);
  errno = 0;
  r = mremap(a, 4 * P, 4 * P, MREMAP_MAYMOVE | MREMAP_DONTUNMAP, NULL);
  remap_line("mremap_maymove_dontunmap", r, errno, a, 4 * P, 4 * P, NULL, 'a');
  drop(r, 4 * P);
  drop(a, 4 * P);

  a = anon(4 * P, MAP_PRIVATE);
  res = reserve(8 * P);
  errno = 0;
  r = mremap(a, 4 * P, 4 * P, MREMAP_MAYMOVE | MREMAP_DONTUNMAP | MREMAP_FIXED, res + 4 * P);
  remap_line("mremap_maymove_dontunmap_fixed", r, errno, a, 4 * P, 4 * P, res + 4 * P, 'a');
  drop(a, 4 * P);
  drop(res, 8 * P);

  a = anon(4 * P, MAP_SHARED);
  errno = 0;
  r = mremap(a, 4 * P, 4 * P, MREMAP_MAYMOVE | MREMAP_DONTUNMAP, NULL);
  remap_line("mremap_maymove_dontunmap_shared", r, errno, a, 4 * P, 4 * P, NULL, 'a');
  drop(r, 4 * P);
  drop(a, 4 * P);

  a = anon(4 * P, MAP_PRIVATE);
  errno = 0;
  r = mremap(a, 4 * P, 8 * P, MREMAP_MAYMOVE | MREMAP_DONTUNMAP, NULL); /* sizes must match */
  remap_line("mremap_maymove_dontunmap_grow", r, errno, a, 4 * P, 8 * P, NULL, 'a');
  drop(r, 8 * P);
  drop(a, 4 * P);

  a = anon(4 * P, MAP_PRIVATE);
  res = reserve(8 * P);
  errno = 0;
  r = mremap(a, 4 * P, 4 * P, MREMAP_FIXED, res); /* FIXED needs MAYMOVE */
  remap_line("mremap_fixed_without_maymove", r, errno, a, 4 * P, 4 * P, res, 'a');
  drop(res, 8 * P);
  drop(a, 4 * P);

  a = anon(4 * P, MAP_PRIVATE);
  errno = 0;
  r = mremap(a, 4 * P, 4 * P, MREMAP_DONTUNMAP, NULL); /* DONTUNMAP needs MAYMOVE */
  remap_line("mremap_dontunmap_without_maymove", r, errno, a, 4 * P, 4 * P, NULL, 'a');
  drop(a, 4 * P);

  a = anon(4 * P, MAP_PRIVATE);
  errno = 0;
  r = mremap(a, 4 * P, 4 * P, MREMAP_MAYMOVE | MREMAP_FIXED, a + 2 * P); /* target overlaps */
  remap_line("mremap_fixed_overlapping", r, errno, a, 4 * P, 4 * P, a + 2 * P, 'a');
  drop(a, 4 * P);

  a = anon(4 * P, MAP_PRIVATE);
  res = reserve(8 * P);
  errno = 0;
  r = mremap(a, 4 * P, 4 * P, MREMAP_MAYMOVE | MREMAP_FIXED, res + 1); /* unaligned target */
  remap_line("mremap_fixed_unaligned_target", r, errno, a, 4 * P, 4 * P, res + 1, 'a');
  drop(res, 8 * P);
  drop(a, 4 * P);

  a = anon(4 * P, MAP_PRIVATE);
  errno = 0;
  r = mremap(a + 1, 2 * P, 2 * P, MREMAP_MAYMOVE);
  remap_line("mremap_unaligned_old", r, errno, a, 2 * P, 2 * P, NULL, 'a');
  errno = 0;
  r = mremap(a, 4 * P, 0, MREMAP_MAYMOVE);
  remap_line("mremap_new_size_0", r, errno, a, 4 * P, 4 * P, NULL, 'a');
  errno = 0;
  r = mremap(a, 4 * P, 4 * P, 8); /* no such flag */
  remap_line("mremap_unknown_flag", r, errno, a, 4 * P, 4 * P, NULL, 'a');
  drop(a, 4 * P);

  res = reserve(8 * P);
  drop(res, 8 * P); /* a hole */
  errno = 0;
  r = mremap(res, 4 * P, 8 * P, MREMAP_MAYMOVE);
  remap_line("mremap_unmapped_old", r, errno, res, 4 * P, 8 * P, NULL, 'a');
  drop(r, 8 * P);
}

/* ---- mmap, mmap64, munmap ------------------------------------------------------------- */

/* What a mapping is: MAP_FAILED, or where it landed (at_target / ok) and, for the file, whether
 * it shows the file's bytes at `off`. */
static void map_line(const char* name, char* r, int err, const char* target, int file) {
  if (r == MAP_FAILED) {
    line(name, "MAP_FAILED", err);
    return;
  }
  char res[32];
  snprintf(res, sizeof res, "%s%s", target != NULL && r == target ? "at_target" : "ok",
           file ? (all(r, P, 'f') ? ",data" : ",nodata") : "");
  line(name, res, err);
}

/* mmap, or mmap64 when `g_map64` (the same cases run through both symbols); the line is
 * "mmap" or "mmap64" + `suffix`. */
static int g_map64 = 0;
static char* map_case(const char* suffix, void* addr, size_t len, int prot, int flags, int fd, off64_t off,
                      const char* target, int file) {
  char name[64];
  snprintf(name, sizeof name, "%s%s", g_map64 ? "mmap64" : "mmap", suffix);
  char* r;
  errno = 0;
#if defined(__GLIBC__)
  if (g_map64) r = mmap64(addr, len, prot, flags, fd, off);
  else
#endif
    r = mmap(addr, len, prot, flags, fd, (off_t)off);
  map_line(name, r, errno, target, file);
  return r;
}

static void map_cases(void) {
  char *r, *res;
  const int A = MAP_PRIVATE | MAP_ANONYMOUS;
  r = map_case("_anon_private", NULL, 4 * P, PROT_READ | PROT_WRITE, A, -1, 0, NULL, 0);
  drop(r, 4 * P);
  r = map_case("_anon_shared", NULL, 4 * P, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0, NULL, 0);
  drop(r, 4 * P);
  r = map_case("_anon_populate_noreserve", NULL, 4 * P, PROT_READ | PROT_WRITE, A | MAP_POPULATE | MAP_NORESERVE, -1, 0,
               NULL, 0);
  drop(r, 4 * P);
  r = map_case("_anon_locked", NULL, 16 * P, PROT_READ | PROT_WRITE, A | MAP_LOCKED, -1, 0, NULL, 0);
  drop(r, 16 * P);
  r = map_case("_anon_prot_none", NULL, 4 * P, PROT_NONE, A | MAP_NORESERVE, -1, 0, NULL, 0);
  drop(r, 4 * P);
  r = map_case("_file_private", NULL, 4 * P, PROT_READ, MAP_PRIVATE, g_ro_fd, 0, NULL, 1);
  drop(r, 4 * P);
  r = map_case("_file_shared", NULL, 4 * P, PROT_READ, MAP_SHARED, g_ro_fd, 0, NULL, 1);
  drop(r, 4 * P);
  r = map_case("_file_shared_rw_offset", NULL, 2 * P, PROT_READ | PROT_WRITE, MAP_SHARED, g_rw_fd, 2 * (off_t)P, NULL, 1);
  drop(r, 2 * P);
  r = map_case("_file_shared_rw_on_read_only_fd", NULL, 4 * P, PROT_READ | PROT_WRITE, MAP_SHARED, g_ro_fd, 0, NULL, 0);
  drop(r, 4 * P);
  r = map_case("_file_shared_validate_sync", NULL, 4 * P, PROT_READ, MAP_SHARED_VALIDATE | MAP_SYNC, g_ro_fd, 0, NULL, 0);
  drop(r, 4 * P);
  r = map_case("_file_unaligned_offset", NULL, 4 * P, PROT_READ, MAP_PRIVATE, g_ro_fd, 1, NULL, 0);
  drop(r, 4 * P);
  r = map_case("_bad_fd", NULL, 4 * P, PROT_READ, MAP_PRIVATE, -1, 0, NULL, 0);
  drop(r, 4 * P);
  map_case("_len_0", NULL, 0, PROT_READ, A, -1, 0, NULL, 0);
  r = map_case("_neither_private_nor_shared", NULL, 4 * P, PROT_READ, MAP_ANONYMOUS, -1, 0, NULL, 0);
  drop(r, 4 * P);
  map_case("_too_large", NULL, (size_t)1 << 62, PROT_READ, A | MAP_NORESERVE, -1, 0, NULL, 0);
  res = reserve(8 * P);
  map_case("_fixed", res + 2 * P, 4 * P, PROT_READ | PROT_WRITE, A | MAP_FIXED, -1, 0, res + 2 * P, 0);
  map_case("_fixed_file_over_anon", res + 2 * P, 2 * P, PROT_READ, MAP_PRIVATE | MAP_FIXED, g_ro_fd, 0, res + 2 * P, 1);
  map_case("_fixed_unaligned", res + 1, 4 * P, PROT_READ, A | MAP_FIXED, -1, 0, res + 1, 0);
  r = map_case("_fixed_noreplace_taken", res + 2 * P, 4 * P, PROT_READ, A | MAP_FIXED_NOREPLACE, -1, 0, res + 2 * P, 0);
  drop(r, 4 * P);
  drop(res + 6 * P, 2 * P); /* a hole just made */
  map_case("_fixed_noreplace_free", res + 6 * P, 2 * P, PROT_READ, A | MAP_FIXED_NOREPLACE, -1, 0, res + 6 * P, 0);
  drop(res, 8 * P);
}

static void munmap_cases(void) {
  char* a = anon(8 * P, MAP_PRIVATE);
  INT_CASE("munmap_part", munmap(a + 4 * P, 2 * P));
  INT_CASE("munmap_unaligned", munmap(a + 1, P));
  INT_CASE("munmap_len_0", munmap(a, 0));
  INT_CASE("munmap_hole", munmap(a + 4 * P, 2 * P));
  INT_CASE("munmap_across_hole", munmap(a, 8 * P));
  INT_CASE("munmap_too_large", munmap(a, (size_t)-P));
  char* s = anon(4 * P, MAP_SHARED);
  INT_CASE("munmap_shared", munmap(s, 4 * P));
  char* f = mmap(NULL, 4 * P, PROT_READ, MAP_SHARED, g_ro_fd, 0);
  if (f == MAP_FAILED) die("mmap (file)");
  INT_CASE("munmap_file", munmap(f, 4 * P));
}

/* ---- madvise, mprotect ---------------------------------------------------------------- */

/* ZEROED: the advice's effect is looked at (DONTNEED and REMOVE leave zeros behind; FREE's
 * pages are taken only under memory pressure, so its effect is not looked at). */
enum { KEPT, ZEROED };
static void madvise_case(const char* name, int advice, int flags, int look) {
  char* a = anon(16 * P, flags);
  errno = 0;
  const int r = madvise(a, 16 * P, advice);
  const int e = errno;
  char res[32];
  snprintf(res, sizeof res, "%d%s", r, look != ZEROED ? "" : all(a, 16 * P, 0) ? ",zeroed" : ",data");
  line(name, res, e);
  drop(a, 16 * P);
}

static void madvise_cases(void) {
  const int priv = MAP_PRIVATE, shared = MAP_SHARED;
  madvise_case("madvise_normal", MADV_NORMAL, priv, KEPT);
  madvise_case("madvise_random", MADV_RANDOM, priv, KEPT);
  madvise_case("madvise_sequential", MADV_SEQUENTIAL, priv, KEPT);
  madvise_case("madvise_willneed", MADV_WILLNEED, priv, KEPT);
  madvise_case("madvise_dontneed", MADV_DONTNEED, priv, ZEROED);
  madvise_case("madvise_dontneed_shared", MADV_DONTNEED, shared, ZEROED);
#ifdef MADV_FREE
  madvise_case("madvise_free", MADV_FREE, priv, KEPT);
  madvise_case("madvise_free_shared", MADV_FREE, shared, KEPT);
#endif
#ifdef MADV_COLD
  madvise_case("madvise_cold", MADV_COLD, priv, KEPT);
#endif
#ifdef MADV_PAGEOUT
  madvise_case("madvise_pageout", MADV_PAGEOUT, priv, KEPT);
#endif
  madvise_case("madvise_remove_private", MADV_REMOVE, priv, ZEROED);
  madvise_case("madvise_remove_shared", MADV_REMOVE, shared, ZEROED);
  madvise_case("madvise_dontfork", MADV_DONTFORK, priv, KEPT);
  madvise_case("madvise_dofork", MADV_DOFORK, priv, KEPT);
  madvise_case("madvise_dontdump", MADV_DONTDUMP, priv, KEPT);
  madvise_case("madvise_dodump", MADV_DODUMP, priv, KEPT);
#ifdef MADV_WIPEONFORK
  madvise_case("madvise_wipeonfork", MADV_WIPEONFORK, priv, KEPT);
  madvise_case("madvise_keeponfork", MADV_KEEPONFORK, priv, KEPT);
#endif
  madvise_case("madvise_hugepage", MADV_HUGEPAGE, priv, KEPT);
  madvise_case("madvise_nohugepage", MADV_NOHUGEPAGE, priv, KEPT);
#ifdef MADV_POPULATE_READ
  madvise_case("madvise_populate_read", MADV_POPULATE_READ, priv, KEPT);
  madvise_case("madvise_populate_write", MADV_POPULATE_WRITE, priv, KEPT);
#endif
  madvise_case("madvise_invalid_advice", 12345, priv, KEPT);

  char* a = anon(16 * P, MAP_PRIVATE);
  INT_CASE("madvise_unaligned", madvise(a + 1, P, MADV_DONTNEED));
  INT_CASE("madvise_len_0", madvise(a, 0, MADV_DONTNEED));
  INT_CASE("madvise_mlock_first", mlock(a, 16 * P));
  INT_CASE("madvise_dontneed_locked", madvise(a, 16 * P, MADV_DONTNEED));
#ifdef MADV_FREE
  INT_CASE("madvise_free_locked", madvise(a, 16 * P, MADV_FREE));
#endif
#ifdef MADV_PAGEOUT
  INT_CASE("madvise_pageout_locked", madvise(a, 16 * P, MADV_PAGEOUT));
#endif
  munlock(a, 16 * P);
  drop(a + 8 * P, 8 * P);
  INT_CASE("madvise_dontneed_over_hole", madvise(a, 16 * P, MADV_DONTNEED));
  INT_CASE("madvise_willneed_over_hole", madvise(a, 16 * P, MADV_WILLNEED));
  drop(a, 8 * P);
}

static void mprotect_cases(void) {
  char* a = anon(4 * P, MAP_PRIVATE);
  INT_CASE("mprotect_none", mprotect(a, 4 * P, PROT_NONE));
  INT_CASE("mprotect_read", mprotect(a, 4 * P, PROT_READ));
  INT_CASE("mprotect_read_write", mprotect(a, 4 * P, PROT_READ | PROT_WRITE));
  INT_CASE("mprotect_part_none", mprotect(a + P, P, PROT_NONE));
  INT_CASE("mprotect_all_again", mprotect(a, 4 * P, PROT_READ | PROT_WRITE));
  INT_CASE("mprotect_unaligned", mprotect(a + 1, P, PROT_READ));
  INT_CASE("mprotect_len_0", mprotect(a, 0, PROT_READ));
  INT_CASE("mprotect_unknown_bit", mprotect(a, 4 * P, PROT_READ | 0x100));
  INT_CASE("mprotect_growsdown_not_stack", mprotect(a, 4 * P, PROT_READ | PROT_GROWSDOWN));
  INT_CASE("mprotect_rw_kept", mprotect(a, 4 * P, PROT_READ | PROT_WRITE) == 0 && all(a, 4 * P, 'a') ? 0 : -1);
  drop(a + 2 * P, 2 * P);
  INT_CASE("mprotect_over_hole", mprotect(a, 4 * P, PROT_READ));
  drop(a, 2 * P);
  char* f = mmap(NULL, 4 * P, PROT_READ, MAP_SHARED, g_ro_fd, 0);
  if (f == MAP_FAILED) die("mmap (file)");
  INT_CASE("mprotect_write_on_read_only_file", mprotect(f, 4 * P, PROT_READ | PROT_WRITE));
  INT_CASE("mprotect_file_none", mprotect(f, 4 * P, PROT_NONE));
  drop(f, 4 * P);
}

/* ---- mlock, mlock2, munlock, mlockall ------------------------------------------------- */

static void mlock_cases(void) {
  char* a = anon(16 * P, MAP_PRIVATE); /* 64 KiB with 4 KiB pages: far below a default RLIMIT_MEMLOCK */
  INT_CASE("mlock", mlock(a, 16 * P));
  INT_CASE("mlock_again", mlock(a, 16 * P));
  INT_CASE("munlock", munlock(a, 16 * P));
  INT_CASE("munlock_again", munlock(a, 16 * P));
  INT_CASE("mlock_unaligned", mlock(a + 1, P));
  INT_CASE("munlock_unaligned", munlock(a + 1, P));
  INT_CASE("mlock_len_0", mlock(a, 0));
  INT_CASE("munlock_len_0", munlock(a, 0));
  INT_CASE("mlock2_0", mlock2(a, 16 * P, 0));
  INT_CASE("munlock_after_mlock2_0", munlock(a, 16 * P));
  INT_CASE("mlock2_onfault", mlock2(a, 16 * P, MLOCK_ONFAULT));
  INT_CASE("munlock_after_mlock2_onfault", munlock(a, 16 * P));
  INT_CASE("mlock2_unknown_flag", mlock2(a, 16 * P, 2));
  INT_CASE("mlock2_unaligned_onfault", mlock2(a + 1, P, MLOCK_ONFAULT));
  INT_CASE("munlock_after_unaligned", munlock(a, 2 * P));
  mprotect(a + 8 * P, 8 * P, PROT_NONE);
  INT_CASE("mlock_prot_none", mlock(a + 8 * P, 8 * P));
  INT_CASE("munlock_prot_none", munlock(a + 8 * P, 8 * P));
  drop(a + 8 * P, 8 * P);
  INT_CASE("mlock_over_hole", mlock(a, 16 * P));
  INT_CASE("munlock_over_hole", munlock(a, 16 * P));
  INT_CASE("mlock2_over_hole", mlock2(a, 16 * P, MLOCK_ONFAULT));
  munlock(a, 8 * P);
  drop(a, 8 * P);
}

static void mlockall_cases(void) {
  /* MCL_CURRENT succeeds only when all the process maps fits RLIMIT_MEMLOCK (or with
   * CAP_IPC_LOCK). The preload maps memory of its own, so under a finite limit a reservation
   * larger than the limit makes the outcome the limit's alone: ENOMEM both ways. */
  struct rlimit lim;
  char* over = NULL;
  size_t over_n = 0;
  if (getrlimit(RLIMIT_MEMLOCK, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY) {
    over_n = ((size_t)lim.rlim_cur + ((size_t)64 << 20)) & ~(P - 1);
    over = reserve(over_n);
  }
  static const struct {
    const char* name;
    int flags;
  } cases[] = {
      {"mlockall_current", MCL_CURRENT},
      {"mlockall_future", MCL_FUTURE},
      {"mlockall_current_future", MCL_CURRENT | MCL_FUTURE},
      {"mlockall_current_onfault", MCL_CURRENT | MCL_ONFAULT},
      {"mlockall_future_onfault", MCL_FUTURE | MCL_ONFAULT},
      {"mlockall_current_future_onfault", MCL_CURRENT | MCL_FUTURE | MCL_ONFAULT},
      {"mlockall_onfault_alone", MCL_ONFAULT},
      {"mlockall_0", 0},
      {"mlockall_unknown_flag", MCL_CURRENT | 8},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
    INT_CASE(cases[i].name, mlockall(cases[i].flags));
    char name[64];
    snprintf(name, sizeof name, "munlockall_after_%s", cases[i].name);
    INT_CASE(name, munlockall());
  }
  drop(over, over_n);
}

/* ---- the scratch file, the model ------------------------------------------------------ */

static void open_scratch(void) {
  const char* dir = getenv("TMPDIR");
  char path[4096];
  snprintf(path, sizeof path, "%s/memory_calls-XXXXXX", dir != NULL && *dir != '\0' ? dir : "/tmp");
  g_rw_fd = mkstemp(path);
  if (g_rw_fd < 0) die(path);
  g_ro_fd = open(path, O_RDONLY | O_CLOEXEC);
  unlink(path);
  if (g_ro_fd < 0) die("open");
  char page[65536];
  memset(page, 'f', sizeof page);
  for (int i = 0; i < 4; ++i)
    if (write(g_rw_fd, page, P) != (ssize_t)P) die("write");
}

static void quiet_log(enum ggml_log_level level, const char* text, void* user) {
  (void)user;
  if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

int main(int argc, char** argv) {
  if (argc > 2) {
    fprintf(stderr, "usage: %s [MODEL]\n", argv[0]);
    return 2;
  }
  P = (size_t)sysconf(_SC_PAGESIZE);
  if (P > 65536) die("page size over 64 KiB");

  struct llama_model* model = NULL;
  struct llama_context* ctx = NULL;
  if (argc == 2) {
    llama_log_set(quiet_log, NULL);
    llama_backend_init();
    model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (model == NULL) die("llama_model_load_from_file");
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 64;
    cp.n_threads = cp.n_threads_batch = 1;
    ctx = llama_init_from_model(model, cp);
    if (ctx == NULL) die("llama_init_from_model");
    const struct llama_vocab* vocab = llama_model_get_vocab(model);
    llama_token tok = llama_vocab_bos(vocab) >= 0 ? llama_vocab_bos(vocab) : 1;
    if (llama_decode(ctx, llama_batch_get_one(&tok, 1)) != 0) die("llama_decode");
    printf("# vm_lck_kb %ld\n", vm_lck_kb());
  }

  open_scratch();
  mremap_cases();
  map_cases();
#if defined(__GLIBC__)
  g_map64 = 1;
  map_cases();
#endif
  munmap_cases();
  madvise_cases();
  mprotect_cases();
  mlock_cases();
  mlockall_cases();
  printf("# cases %d\n", g_cases);

  close(g_rw_fd);
  close(g_ro_fd);
  if (ctx != NULL) llama_free(ctx);
  if (model != NULL) llama_model_free(model);
  if (argc == 2) llama_backend_free();
  return 0;
}
