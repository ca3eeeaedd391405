// SPDX-License-Identifier: MIT
// Shim (compile checks on Linux only; see ../README.md): the Objective-C runtime names
// metal-cpp uses, with the types of Apple's objc4 headers.
#pragma once

typedef struct objc_class* Class;
struct objc_object {
  Class isa;
};
typedef struct objc_object* id;
typedef struct objc_selector* SEL;
typedef void (*IMP)(void);  // OBJC_OLD_DISPATCH_PROTOTYPES=0, the default
#if defined(__arm64__) || defined(__aarch64__)
typedef bool BOOL;
#else
typedef signed char BOOL;
#endif
typedef struct objc_object Protocol;  // what objc/runtime.h declares outside Objective-C

#ifdef __cplusplus
extern "C" {
#endif
SEL sel_registerName(const char* str);
const char* sel_getName(SEL sel);
Class objc_lookUpClass(const char* name);
Protocol* objc_getProtocol(const char* name);
Class object_getClass(id obj);
IMP class_getMethodImplementation(Class cls, SEL name);
BOOL class_respondsToSelector(Class cls, SEL sel);
#ifdef __cplusplus
}
#endif
