/* SPDX-License-Identifier: MIT */
/* residency: the manager's statistics, as one list of fields.
 *
 * The C++ struct residency::Stats (residency.hpp), the C struct residency_stats and its
 * RESIDENCY_STATS_INIT (residency.h), and the C API's conversion between them are all made from
 * this one list, so that a field cannot be added to one and forgotten in another. The order is
 * the C ABI: a later release adds fields only at the end (residency_stats starts with its size,
 * and a caller built against fewer fields gets only those).
 *
 * X(TYPE, name, cpp_default) per field. TYPE is written per language:
 *   U64   uint64_t in C,  std::uint64_t in C++
 *   U32   uint32_t in C,  std::uint32_t in C++
 *   FLAG  int in C (0 or 1), bool in C++
 *   NS    uint64_t nanoseconds named name_ns in C, residency::Nanos named name in C++
 * cpp_default is the C++ member's initial value; RESIDENCY_STATS_INIT sets every field to 0
 * (residency_get_stats fills them all).
 */
#ifndef RESIDENCY_STATS_FIELDS_H
#define RESIDENCY_STATS_FIELDS_H

#define RESIDENCY_STATS_FIELDS(X)                                                                            \
  X(U64, tracked_bytes, 0)         /* every registered region */                                             \
  X(U64, admitted_bytes, 0)        /* regions inside a set (within the wired budget); charged as whole  */   \
                                   /* pages on posix (what mlock locks), so >= their bytes               */  \
  X(U64, wired_bytes, 0)           /* admitted bytes whose residency is requested now (charged alike)     */ \
  X(U64, pending_bytes, 0)         /* tracked but left out of every set (over the budget) */                 \
  X(U64, wired_limit, 0)           /* the budget in bytes */                                                 \
  X(U32, regions, 0)               /* regions registered */                                                  \
  X(U32, sets, 0)                  /* residency sets */                                                      \
  X(FLAG, resident, false)         /* residency currently requested */                                       \
  X(U64, commits, 0)               /* Backend::commit calls */                                               \
  X(U64, residency_requests, 0)    /* Backend::request_residency + refresh calls */                          \
  X(U64, releases, 0)              /* times residency was given back (keep-alive, pressure, scope) */        \
  X(U64, rewires, 0)               /* times released memory was made resident again */                       \
  X(NS, rewire_time, 0)            /* total time spent in those re-wires */                                  \
  X(U64, scheduler_wakeups, 0)     /* times the scheduler thread returned from a wait */                     \
  X(U64, wire_failures, 0)         /* regions the backend could not make resident */                         \
  X(U64, release_failures, 0)      /* releases in which the backend could not give a set back */             \
  X(U64, pressure_releases, 0)     /* pressure events that gave memory back (one graded step each) */        \
  X(U64, pressure_restores, 0)     /* times the budget came back after pressure was quiet */                 \
  X(U64, pressure_cap, UINT64_MAX) /* the reduced budget in force; UINT64_MAX: none */                       \
  /* Shared budget (key shared_budget, Config::shared_budget); all 0 without one. */                         \
  X(U64, shared_budget, 0)    /* the machine-wide budget, bytes */                                           \
  X(U64, shared_held, 0)      /* this manager's share of it now */                                           \
  X(U64, shared_asks, 0)      /* times this manager asked another holder to give back */                     \
  X(U64, shared_gave_back, 0) /* times it gave its memory back when asked */                                 \
  X(U64, shared_short, 0)     /* times the budget was full and memory stayed unwired */

/* The C spelling of each TYPE (residency.h), and of a field's name. */
#define RESIDENCY_STATS_C_TYPE_U64 uint64_t
#define RESIDENCY_STATS_C_TYPE_U32 uint32_t
#define RESIDENCY_STATS_C_TYPE_FLAG int
#define RESIDENCY_STATS_C_TYPE_NS uint64_t
#define RESIDENCY_STATS_C_NAME_U64(name) name
#define RESIDENCY_STATS_C_NAME_U32(name) name
#define RESIDENCY_STATS_C_NAME_FLAG(name) name
#define RESIDENCY_STATS_C_NAME_NS(name) name##_ns

#endif /* RESIDENCY_STATS_FIELDS_H */
