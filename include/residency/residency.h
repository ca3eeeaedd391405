/* SPDX-License-Identifier: MIT */
/* residency: the C API.
 *
 * For engines written in C, or wanting a stable ABI: the same manager as residency.hpp behind
 * opaque handles, shipped as libresidency.so (SONAME libresidency.so.1; only residency_* symbols
 * are exported) as well as in the static library. Every function that can fail returns a
 * residency_status; the message of the last failure on this thread is residency_last_error().
 * Nothing here aborts on bad input.
 *
 *   residency_config* cfg = NULL;
 *   if (residency_config_from_env(&cfg) != RESIDENCY_OK) { fprintf(stderr, "%s\n", residency_last_error()); ... }
 *   residency_manager* m = NULL;
 *   residency_manager_create(cfg, "auto", NULL, NULL, &m);
 *   residency_config_free(cfg);
 *   uint64_t id; residency_register(m, weights, n_bytes, RESIDENCY_WEIGHTS, 0, &id);
 *   for (;;) { residency_prefetch(m); tokenize(); residency_touch(m); decode(); }
 *   residency_manager_destroy(m);
 *
 * Growing the ABI: public structs begin with their size (set it with the _INIT macro, or to
 * sizeof); a later release adds fields only at the end and reads only what the caller's size
 * covers. residency_abi_version() says which ABI the loaded library implements.
 *
 * Ownership of handles:
 *   - config: from residency_config_default / _from_env; free with residency_config_free. A
 *     manager copies what it needs, so the config may be freed right after create.
 *   - backend: from residency_backend_create; release with residency_backend_release. Managers
 *     keep the backend they use alive, so it may be released right after creating them.
 *   - manager: free with residency_manager_destroy. Regions still registered are released and
 *     reported as a warning. Scopes still open are ended (their synchronize runs) and detached,
 *     with a warning: residency_use_end on them afterwards only frees them.
 *   - scope: from residency_use_begin; end and free with residency_use_end, exactly once.
 *   Every destroy/free/release/end accepts NULL. Using a handle after it was freed, or freeing it
 *   twice, is undefined (as with free()).
 *
 * Destroying a manager while it is in use. Each call on a manager, and each residency_use_end of
 * one of its scopes, counts as in flight while it runs. residency_manager_destroy never waits
 * and never frees what a call in flight still uses:
 *   - From the moment it is called, the manager refuses new calls: those that return a status
 *     return RESIDENCY_INVALID_ARGUMENT ("the manager is being destroyed"), residency_use_begin
 *     returns NULL, and the void ones (touch, prefetch, ...) do nothing. A second destroy is
 *     ignored with a warning.
 *   - The manager is torn down (its scopes ended, its regions released) when the last call in
 *     flight returns: at once when none is, otherwise at the end of that call, on its thread.
 *   - So residency_use_end may race residency_manager_destroy on another thread: the scope is
 *     ended exactly once (its synchronize runs once), by whichever gets to it first, and freed by
 *     residency_use_end. And a synchronize callback may destroy its own manager: the destroy is
 *     deferred until that residency_use_end (or the destroy that ended the scope) returns.
 *   - A call that begins before destroy has returned (on a racing thread, or from a callback
 *     inside a call in flight) finds the handle and is refused as above. A call that begins
 *     after destroy has returned is a use after free, as with free(): the handle may be gone.
 * A log callback still must not call back into its manager (see residency_log_fn).
 */
#ifndef RESIDENCY_RESIDENCY_H
#define RESIDENCY_RESIDENCY_H

#include <stddef.h>
#include <stdint.h>

#include "residency/stats_fields.h"

#if defined(_WIN32)
#define RESIDENCY_API
#else
#define RESIDENCY_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* The ABI this header describes; residency_abi_version() is the library's. */
#define RESIDENCY_ABI_VERSION 1

typedef enum residency_status {
  RESIDENCY_OK = 0,
  RESIDENCY_INVALID_ARGUMENT = 1,
  RESIDENCY_LIMIT_EXCEEDED = 2,
  RESIDENCY_PERMISSION_DENIED = 3,
  RESIDENCY_OUT_OF_MEMORY = 4,
  RESIDENCY_UNSUPPORTED = 5,
  RESIDENCY_NOT_FOUND = 6,
  RESIDENCY_IO_ERROR = 7,
  RESIDENCY_BACKEND_ERROR = 8,
  RESIDENCY_INTERRUPTED = 9 /* a release stopped because a call began; nothing was lost */
} residency_status;

/* Region classes. Functions take them as int, so that any value a caller passes is checked
 * (an out-of-range enum value is not even loadable in C++). */
typedef enum residency_class {
  RESIDENCY_WEIGHTS = 0,  /* preserved across a release */
  RESIDENCY_KV_CACHE = 1, /* may be discarded on release where the backend can (cuda) */
  RESIDENCY_SCRATCH = 2   /* may be discarded on release where the backend can (cuda) */
} residency_class;

typedef enum residency_log_level {
  RESIDENCY_LOG_ERROR = 0,
  RESIDENCY_LOG_WARN = 1,
  RESIDENCY_LOG_INFO = 2,
  RESIDENCY_LOG_DEBUG = 3
} residency_log_level;

typedef struct residency_config residency_config;
typedef struct residency_backend residency_backend;
typedef struct residency_manager residency_manager;
typedef struct residency_scope residency_scope;

/* Called for each log line, from the thread that caused it (the scheduler's thread for keep-alive
 * releases); must not call back into the manager. NULL: lines go to stderr. */
typedef void (*residency_log_fn)(residency_log_level level, const char* message, void* user);

/* The manager's statistics. The fields and what each means: residency/stats_fields.h (one list,
 * from which residency::Stats is made too). Set struct_size before residency_get_stats, with
 * RESIDENCY_STATS_INIT or to sizeof(residency_stats). */
typedef struct residency_stats {
  size_t struct_size; /* set to sizeof(residency_stats) before the call */
#define RESIDENCY_STATS_C_FIELD_(TYPE, name, cpp_default) \
  RESIDENCY_STATS_C_TYPE_##TYPE RESIDENCY_STATS_C_NAME_##TYPE(name);
  RESIDENCY_STATS_FIELDS(RESIDENCY_STATS_C_FIELD_)
#undef RESIDENCY_STATS_C_FIELD_
} residency_stats;
#define RESIDENCY_STATS_INIT_ZERO_(TYPE, name, cpp_default) 0,
#define RESIDENCY_STATS_INIT \
  { sizeof(residency_stats), RESIDENCY_STATS_FIELDS(RESIDENCY_STATS_INIT_ZERO_) }

/* The fields after `kind` are each for one backend; the library hands them as they are to its
 * backend registry (residency/backends.hpp, BackendOptions), the one place that knows which
 * backend takes what. Left at their defaults, every backend kind accepts them. */
typedef struct residency_backend_options {
  size_t struct_size;         /* sizeof(residency_backend_options) */
  const char* kind;           /* "auto" (NULL), "posix", "cuda", "metal", "sim" */
  int cuda_device;            /* cuda: device ordinal (default 0) */
  void* metal_device;         /* metal: an MTL::Device* / id<MTLDevice>; NULL = the system default */
  int metal_attach_to_queues; /* metal: attach every set to each queue given to
                                 residency_backend_add_command_queue (MLX); at most 32 sets */
} residency_backend_options;
#define RESIDENCY_BACKEND_OPTIONS_INIT \
  { sizeof(residency_backend_options), "auto", 0, NULL, 0 }

/* Version: "0.1.0", and the ABI number (RESIDENCY_ABI_VERSION of the library's build). */
RESIDENCY_API const char* residency_version(void);
RESIDENCY_API uint32_t residency_abi_version(void);

/* The message of the last failed call on this thread ("" if none). Valid until the next call. */
RESIDENCY_API const char* residency_last_error(void);

/* --- configuration ------------------------------------------------------------------------- */

/* A configuration with the defaults (keep_alive 180 s, sharded, ...). NULL when out of memory. */
RESIDENCY_API residency_config* residency_config_default(void);
/* Reads the RESIDENCY_* variables and their peer aliases (see README). On error *out is NULL. */
RESIDENCY_API residency_status residency_config_from_env(residency_config** out);
/* Sets one key from text, parsed as the environment variable of the same name would be:
 * "keep_alive", "wired_limit", "set_max_pct", "layout", "release_on_pressure", "pressure_floor",
 * "pressure_quiet", "shared_budget" (NAME:SIZE[:GROUP], a wired budget shared with the other
 * processes naming it; Linux), "shared_priority", "budget_wait" (a duration, 30s by default: how long
 * device memory waits its turn for room in a full shared budget; or over), "state_file" (0: publish no state for
 * `residency stat --pid`), "log", "log_time" (0 or 1: the default log lines carry the local time),
 * "host_budget" (off, SIZE, or NAME:SIZE[:GROUP]: the RAM budget of the model files a GPU keeps
 * registered for fast wakes; CUDA). */
RESIDENCY_API residency_status residency_config_set(residency_config* cfg, const char* key, const char* value);
RESIDENCY_API void residency_config_free(residency_config* cfg);

/* --- backends ------------------------------------------------------------------------------ */

/* One backend per kind per process: with default options, every call for a kind returns the
 * instance already alive. options NULL = RESIDENCY_BACKEND_OPTIONS_INIT. */
RESIDENCY_API residency_status residency_backend_create(const residency_backend_options* options, residency_backend** out);
RESIDENCY_API void residency_backend_release(residency_backend* backend);
/* "posix", "cuda", ...; valid while the handle is. */
RESIDENCY_API const char* residency_backend_name(const residency_backend* backend);
/* metal: a command queue (MTL::CommandQueue*) to attach every set to (with
 * metal_attach_to_queues). Other backends: RESIDENCY_UNSUPPORTED. */
RESIDENCY_API residency_status residency_backend_add_command_queue(residency_backend* backend, void* queue);

/* --- managers ------------------------------------------------------------------------------ */

/* backend: "auto" (NULL), "posix", "cuda", "metal", "sim". cfg NULL = the defaults. */
RESIDENCY_API residency_status residency_manager_create(const residency_config* cfg, const char* backend,
                                                        residency_log_fn log, void* log_user, residency_manager** out);
/* The same over a backend made with residency_backend_create (kept alive by the manager). */
RESIDENCY_API residency_status residency_manager_create_with_backend(const residency_config* cfg,
                                                                     residency_backend* backend, residency_log_fn log,
                                                                     void* log_user, residency_manager** out);
/* Safe while calls on m or residency_use_end of its scopes run on other threads, and from inside
 * a scope's synchronize callback: see "Destroying a manager while it is in use" above. */
RESIDENCY_API void residency_manager_destroy(residency_manager* m);

/* Tracks [base, base+size). cls: a residency_class. id_out may be NULL. */
RESIDENCY_API residency_status residency_register(residency_manager* m, void* base, size_t size, int cls, int priority,
                                                  uint64_t* id_out);
/* The same with the backend's own object for the memory (metal: the MTL::Buffer* it lives in). */
RESIDENCY_API residency_status residency_register_object(residency_manager* m, void* base, size_t size, int cls,
                                                         int priority, void* backend_object, uint64_t* id_out);
RESIDENCY_API residency_status residency_unregister(residency_manager* m, uint64_t id);
/* Unregisters the region that starts at base. */
RESIDENCY_API residency_status residency_unregister_ptr(residency_manager* m, void* base);
/* Backend memory (cuda: device memory at an address that never moves across sleep and wake). */
RESIDENCY_API residency_status residency_allocate(residency_manager* m, size_t size, int cls, int priority,
                                                  void** ptr_out, uint64_t* id_out);
/* Frees what residency_allocate returned. */
RESIDENCY_API residency_status residency_free(residency_manager* m, void* ptr);
RESIDENCY_API residency_status residency_set_wired_limit(residency_manager* m, uint64_t bytes);

/* Registrations between begin and end are committed once per touched set at the end (nests). */
RESIDENCY_API residency_status residency_batch_begin(residency_manager* m);
RESIDENCY_API residency_status residency_batch_end(residency_manager* m);

/* The hot path: once per graph compute (lock-free, a few ns while resident: a clock read and the
 * handle's in-flight count, two atomic operations). */
RESIDENCY_API void residency_touch(residency_manager* m);
/* residency_touch, and marks one region as just used (the budget's least-recently-used order). */
RESIDENCY_API void residency_touch_region(residency_manager* m, uint64_t id);
/* A request arrived: re-wire in the background now, so the first touch finds it done. */
RESIDENCY_API void residency_prefetch(residency_manager* m);

/* A use scope: resident from begin to end. At end, synchronize(user) runs first (may be NULL);
 * under keep_alive 0 the memory is then released. Returns NULL on error (status_out says why;
 * nothing to end). A scope whose memory is only partly wired is returned, with
 * RESIDENCY_LIMIT_EXCEEDED in *status_out and the reason in residency_last_error().
 * status_out may be NULL. residency_use_end may run on any thread, also while the manager is being
 * destroyed; if the destroy ended the scope first, it only frees it. */
RESIDENCY_API residency_scope* residency_use_begin(residency_manager* m, void (*synchronize)(void* user), void* user,
                                                   residency_status* status_out);
RESIDENCY_API void residency_use_end(residency_scope* scope);

RESIDENCY_API void residency_notify_memory_pressure(residency_manager* m);
RESIDENCY_API void residency_release_now(residency_manager* m);
/* out->struct_size must be set (RESIDENCY_STATS_INIT); fills as much as it covers. */
RESIDENCY_API residency_status residency_get_stats(residency_manager* m, residency_stats* out);

#ifdef __cplusplus
}
#endif

#endif /* RESIDENCY_RESIDENCY_H */
