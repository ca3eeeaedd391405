/* SPDX-License-Identifier: MIT */
/* A program that reads a file through mmap, like `cat` would, and knows nothing of llama.cpp:
 * maps FILE read-only (MAP_SHARED, as llama.cpp maps its models), prints the byte count and a
 * checksum, unmaps it. With a GGUF file under the preload, llama_decode is not reachable: the
 * preload must say so once and leave the program alone. */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s FILE\n", argv[0]);
    return 2;
  }
  const int fd = open(argv[1], O_RDONLY);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0 || st.st_size <= 0) {
    perror(argv[1]);
    return 1;
  }
  const size_t size = (size_t)st.st_size;
  const unsigned char* p = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    perror("mmap");
    return 1;
  }
  uint64_t sum = 0;
  for (size_t i = 0; i < size; ++i) sum = sum * 31 + p[i];
  if (munmap((void*)p, size) != 0) {
    perror("munmap");
    return 1;
  }
  close(fd);
  printf("%zu bytes, checksum %llu\n", size, (unsigned long long)sum);
  return 0;
}
