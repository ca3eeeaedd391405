// SPDX-License-Identifier: MIT
// A program that loads libfakeext.so (path: argv[1]) with RTLD_LOCAL and prints what its
// run_program() reports: what tests/cudapreload runs with and without the CUDA preload.
#include <dlfcn.h>

#include <cstdio>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fake_cuda_host LIBFAKEEXT\n");
    return 2;
  }
  void* h = ::dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    std::fprintf(stderr, "fake_cuda_host: %s\n", ::dlerror());
    return 1;
  }
  auto run = reinterpret_cast<int (*)(char*, std::size_t)>(::dlsym(h, "run_program"));
  if (run == nullptr) return 1;
  char out[512];
  const int rc = run(out, sizeof out);
  std::printf("%s\n", out);
  return rc;
}
