// SPDX-License-Identifier: MIT
// A fresh directory on a disk-backed filesystem ($TMPDIR, else /var/tmp, else /tmp), for tests
// whose files must be paged out and read back (a tmpfs file's pages cannot leave memory without
// swap).
#pragma once

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

namespace residency::testing {

// The directory's path, named `prefix` + "-XXXXXX"; empty with `error` set when none could be made.
inline std::string make_disk_temp_dir(const std::string& prefix, std::string& error) {
  std::string base;
  if (const char* t = std::getenv("TMPDIR"); t != nullptr && *t != '\0') base = t;
  for (const char* d : {"/var/tmp", "/tmp"})
    if (base.empty() && ::access(d, W_OK) == 0) base = d;
  std::string tmpl = base + "/" + prefix + "-XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) {
    error = "mkdtemp in " + base + ": " + std::strerror(errno);
    return {};
  }
  return tmpl;
}

}  // namespace residency::testing
