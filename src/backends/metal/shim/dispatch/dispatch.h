// Shim (compile checks on Linux only; see ../README.md): the libdispatch object types metal-cpp
// passes through (opaque pointers, as in C++ outside Objective-C).
#pragma once

typedef struct dispatch_queue_s* dispatch_queue_t;
typedef struct dispatch_data_s* dispatch_data_t;
typedef struct dispatch_semaphore_s* dispatch_semaphore_t;
