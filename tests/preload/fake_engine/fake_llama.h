/* SPDX-License-Identifier: MIT */
/* A fake libllama (fake_llama.c) and the program that links it (fake_host.c): a llama.cpp the
 * preload was not built against. It says it is the build's llama.cpp unless told otherwise
 * (FAKE_GGML_VERSION, FAKE_LLAMA_VERSION in the environment). Compiled with FAKE_NEWER, its
 * llama_model_params is larger than the build's, as a newer llama.cpp's may be (passed by value);
 * with FAKE_LACKING, it lacks llama_synchronize and ggml_version. The program passes the larger
 * struct with a known tail and its own callback; the library records whether both arrived as the
 * program made them. */
#pragma once

#include <llama.h>

#define FAKE_TAIL 64

/* llama_model_params as a newer llama.cpp might have it: the build's, then more fields. */
struct fake_model_params {
  struct llama_model_params base;
  unsigned char tail[FAKE_TAIL];
};

/* These two take or return the larger struct under llama.cpp's names (asm labels: the C names
 * differ from llama.h's declarations). */
struct fake_model_params fake_model_default_params(void) __asm__("llama_model_default_params");
struct llama_model* fake_model_load_from_file(const char* path,
                                              struct fake_model_params params) __asm__("llama_model_load_from_file");

/* What the library saw: -1 not called, 0 no, 1 yes. */
extern int fake_tail_intact;
extern int fake_callback_untouched;
extern int fake_batch_intact;
/* The callback the program passes, which must arrive as it is (not a trampoline of the preload's). */
extern llama_progress_callback fake_expected_callback;
