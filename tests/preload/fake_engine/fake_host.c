/* SPDX-License-Identifier: MIT */
/* Links the fake libllama of fake_llama.h; passes a larger llama_model_params (a known tail, its
 * own progress callback) and a batch, and prints what the library saw, key=value per line. */
#include <stdio.h>
#include <string.h>

#include "fake_llama.h"

static int progress_calls = 0;
static bool on_progress(float progress, void* data) {
  (void)progress;
  progress_calls += data == (void*)&progress_calls;
  return true;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: fake_host MODEL.gguf\n");
    return 2;
  }
  struct fake_model_params p = fake_model_default_params();
  for (int i = 0; i < FAKE_TAIL; ++i) p.tail[i] = (unsigned char)(0xc0 + i);
  p.base.progress_callback = on_progress;
  p.base.progress_callback_user_data = &progress_calls;
  fake_expected_callback = on_progress;
  if (fake_model_load_from_file(argv[1], p) == NULL) return 1;
  llama_token tokens[3] = {1, 2, 42};
  if (llama_decode(NULL, llama_batch_get_one(tokens, 3)) != 0) return 1;
  printf("tail_intact=%d\ncallback_untouched=%d\nprogress_calls=%d\nbatch_intact=%d\n", fake_tail_intact,
         fake_callback_untouched, progress_calls, fake_batch_intact);
  return 0;
}
