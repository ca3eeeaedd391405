// SPDX-License-Identifier: MIT
// A program that loads each libfakeext*.so named (each with RTLD_LOCAL, each with a runtime of its
// own) and prints what their run_program() reports, one line each, in turn: what tests/cudapreload
// runs with and without the CUDA preload.
#include <dlfcn.h>

#include <cstdio>
#include <cstring>

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: fake_cuda_host LIBFAKEEXT...\n");
    return 2;
  }
  // --close: each library is closed after it ran (the next may load where it was).
  const bool close_each = std::strcmp(argv[1], "--close") == 0;
  int rc = 0;
  for (int i = close_each ? 2 : 1; i < argc; ++i) {
    void* h = ::dlopen(argv[i], RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      std::fprintf(stderr, "fake_cuda_host: %s\n", ::dlerror());
      return 1;
    }
    auto run = reinterpret_cast<int (*)(char*, std::size_t)>(::dlsym(h, "run_program"));
    if (run == nullptr) return 1;
    char out[512];
    rc |= run(out, sizeof out);
    std::printf("%s\n", out);
    if (close_each && ::dlclose(h) != 0) return 1;
  }
  return rc;
}
