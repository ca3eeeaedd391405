// SPDX-License-Identifier: MIT
// expect-error: no known conversion from 'dispatch_queue_t'
// A queue where a source is expected: the dispatch shim keeps Apple's distinct object types
// for C++, so the pressure source's calls are checked, not just accepted.
#include <dispatch/dispatch.h>

void cancel_the_queue(dispatch_queue_t queue) { dispatch_source_cancel(queue); }
