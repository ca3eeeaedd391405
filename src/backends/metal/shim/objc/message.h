// SPDX-License-Identifier: MIT
// Shim (compile checks on Linux only; see ../README.md): the message senders. Declared
// without prototypes, as Apple's header does by default: callers cast them to the exact
// function type of each message.
#pragma once

#include <objc/runtime.h>

#ifdef __cplusplus
extern "C" {
#endif
void objc_msgSend(void);
void objc_msgSendSuper(void);
#if defined(__i386__) || defined(__x86_64__) || defined(__arm__)
void objc_msgSend_stret(void);
#endif
#if defined(__i386__) || defined(__x86_64__)
void objc_msgSend_fpret(void);
#endif
#ifdef __cplusplus
}
#endif
