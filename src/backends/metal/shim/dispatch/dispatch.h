// SPDX-License-Identifier: MIT
// Shim (compile checks on Linux only; see ../README.md): the libdispatch names metal-cpp passes
// through and the backend's memory-pressure watch uses, as Apple's headers declare them for C++
// outside Objective-C (OS_OBJECT_USE_OBJC 0): each object type derives from dispatch_object_s,
// so it converts to dispatch_object_t and to nothing else.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
struct dispatch_object_s {};
typedef struct dispatch_object_s* dispatch_object_t;
#define RESIDENCY_SHIM_DISPATCH_DECL(name) typedef struct name##_s : public dispatch_object_s{} * name##_t
#else
#define RESIDENCY_SHIM_DISPATCH_DECL(name) typedef struct name##_s* name##_t
#endif

RESIDENCY_SHIM_DISPATCH_DECL(dispatch_queue);
RESIDENCY_SHIM_DISPATCH_DECL(dispatch_queue_attr);
RESIDENCY_SHIM_DISPATCH_DECL(dispatch_data);
RESIDENCY_SHIM_DISPATCH_DECL(dispatch_semaphore);
RESIDENCY_SHIM_DISPATCH_DECL(dispatch_source);
#undef RESIDENCY_SHIM_DISPATCH_DECL

typedef uint64_t dispatch_time_t;
typedef void (^dispatch_block_t)(void);
typedef const struct dispatch_source_type_s* dispatch_source_type_t;
typedef unsigned long dispatch_source_memorypressure_flags_t;

#define DISPATCH_TIME_NOW (0ull)
#define DISPATCH_TIME_FOREVER (~0ull)
#define NSEC_PER_SEC 1000000000ull
#define NSEC_PER_MSEC 1000000ull
#define DISPATCH_QUEUE_SERIAL NULL

#define DISPATCH_MEMORYPRESSURE_NORMAL 0x01
#define DISPATCH_MEMORYPRESSURE_WARN 0x02
#define DISPATCH_MEMORYPRESSURE_CRITICAL 0x04

#ifdef __cplusplus
extern "C" {
#endif
extern const struct dispatch_source_type_s _dispatch_source_type_memorypressure;
extern const struct dispatch_source_type_s _dispatch_source_type_timer;
#define DISPATCH_SOURCE_TYPE_MEMORYPRESSURE (&_dispatch_source_type_memorypressure)
#define DISPATCH_SOURCE_TYPE_TIMER (&_dispatch_source_type_timer)

dispatch_queue_t dispatch_queue_create(const char* label, dispatch_queue_attr_t attr);
dispatch_source_t dispatch_source_create(dispatch_source_type_t type, uintptr_t handle, uintptr_t mask,
                                         dispatch_queue_t queue);
void dispatch_source_set_event_handler(dispatch_source_t source, dispatch_block_t handler);
void dispatch_source_set_cancel_handler(dispatch_source_t source, dispatch_block_t handler);
void dispatch_source_set_timer(dispatch_source_t source, dispatch_time_t start, uint64_t interval, uint64_t leeway);
uintptr_t dispatch_source_get_data(dispatch_source_t source);
void dispatch_source_cancel(dispatch_source_t source);
dispatch_time_t dispatch_time(dispatch_time_t when, int64_t delta);
void dispatch_resume(dispatch_object_t object);
void dispatch_activate(dispatch_object_t object);
void dispatch_retain(dispatch_object_t object);
void dispatch_release(dispatch_object_t object);
void dispatch_sync(dispatch_queue_t queue, dispatch_block_t block);
void dispatch_async(dispatch_queue_t queue, dispatch_block_t block);
#ifdef __cplusplus
}
#endif
