/* residency: the C API.
 *
 * For engines written in C, or wanting a stable ABI: the same manager as residency.hpp behind
 * opaque handles. Every function that can fail returns a residency_status; the message of the
 * last failure on this thread is residency_last_error(). Nothing here aborts on bad input.
 *
 *   residency_config* cfg = NULL;
 *   if (residency_config_from_env(&cfg) != RESIDENCY_OK) { fprintf(stderr, "%s\n", residency_last_error()); ... }
 *   residency_manager* m = NULL;
 *   residency_manager_create(cfg, "auto", NULL, NULL, &m);
 *   residency_config_free(cfg);
 *   uint64_t id; residency_register(m, weights, n_bytes, RESIDENCY_WEIGHTS, 0, &id);
 *   for (;;) { residency_touch(m); decode(); }
 *   residency_manager_destroy(m);
 */
#ifndef RESIDENCY_RESIDENCY_H
#define RESIDENCY_RESIDENCY_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum residency_status {
  RESIDENCY_OK = 0,
  RESIDENCY_INVALID_ARGUMENT = 1,
  RESIDENCY_LIMIT_EXCEEDED = 2,
  RESIDENCY_PERMISSION_DENIED = 3,
  RESIDENCY_OUT_OF_MEMORY = 4,
  RESIDENCY_UNSUPPORTED = 5,
  RESIDENCY_NOT_FOUND = 6,
  RESIDENCY_IO_ERROR = 7,
  RESIDENCY_BACKEND_ERROR = 8
} residency_status;

typedef enum residency_class {
  RESIDENCY_WEIGHTS = 0,
  RESIDENCY_KV_CACHE = 1,
  RESIDENCY_SCRATCH = 2,
  RESIDENCY_CLASS_FORCE_INT = 0x7fffffff /* the enum is an int: any value a caller passes is checked */
} residency_class;

typedef enum residency_log_level {
  RESIDENCY_LOG_ERROR = 0,
  RESIDENCY_LOG_WARN = 1,
  RESIDENCY_LOG_INFO = 2,
  RESIDENCY_LOG_DEBUG = 3
} residency_log_level;

typedef struct residency_config residency_config;
typedef struct residency_manager residency_manager;
typedef struct residency_scope residency_scope;

/* Called for each log line; must not call back into the manager. NULL: lines go to stderr. */
typedef void (*residency_log_fn)(residency_log_level level, const char* message, void* user);

typedef struct residency_stats {
  uint64_t tracked_bytes, admitted_bytes, wired_bytes, pending_bytes, wired_limit;
  uint32_t regions, sets;
  int resident;
  uint64_t commits, residency_requests, releases, rewires, rewire_time_ns, scheduler_wakeups,
      wire_failures;
} residency_stats;

/* The message of the last failed call on this thread ("" if none). Valid until the next call. */
const char* residency_last_error(void);

/* A configuration with the defaults (keep_alive 180 s, sharded, ...). */
residency_config* residency_config_default(void);
/* Reads the RESIDENCY_* variables and their peer aliases (see README). On error *out is NULL. */
residency_status residency_config_from_env(residency_config** out);
/* Sets one key from text, parsed as the environment variable of the same name would be:
 * "keep_alive", "wired_limit", "set_max_pct", "layout", "release_on_pressure", "log". */
residency_status residency_config_set(residency_config* cfg, const char* key, const char* value);
void residency_config_free(residency_config* cfg);

/* backend: "auto", "posix", "cuda", "metal", "sim". */
residency_status residency_manager_create(const residency_config* cfg, const char* backend,
                                          residency_log_fn log, void* log_user,
                                          residency_manager** out);
/* Releases everything; regions still registered are reported as a warning. NULL is a no-op. */
void residency_manager_destroy(residency_manager* m);

residency_status residency_register(residency_manager* m, void* base, size_t size,
                                    residency_class cls, int priority, uint64_t* id_out);
residency_status residency_allocate(residency_manager* m, size_t size, residency_class cls,
                                    int priority, void** ptr_out, uint64_t* id_out);
residency_status residency_unregister(residency_manager* m, uint64_t id);
residency_status residency_set_wired_limit(residency_manager* m, uint64_t bytes);

/* The hot path: once per graph compute. */
void residency_touch(residency_manager* m);
/* A use scope: resident from begin to end. At end, synchronize(user) runs first (may be NULL);
 * under keep_alive 0 the memory is then released. */
residency_status residency_use_begin(residency_manager* m, void (*synchronize)(void* user),
                                     void* user, residency_scope** out);
void residency_use_end(residency_scope* scope);

void residency_notify_memory_pressure(residency_manager* m);
void residency_release_now(residency_manager* m);
residency_status residency_get_stats(residency_manager* m, residency_stats* out);

#ifdef __cplusplus
}
#endif

#endif /* RESIDENCY_RESIDENCY_H */
