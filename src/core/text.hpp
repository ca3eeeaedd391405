// SPDX-License-Identifier: MIT
// The text forms of the library in one unit: printable() and format_size() for messages
// (declared in the public residency/text.hpp), and the two forms of the log lines that follow
// llama.cpp's and MLX's wording (docs/design.md, "Logs"), which stay in fixed units on purpose so
// that they read like llama.cpp's own lines.
#pragma once

#include <cstdint>
#include <string>

#include "residency/clock.hpp"
#include "residency/text.hpp"

namespace residency::core {

std::string mib(std::uint64_t bytes);  // "12.00 MiB": log lines in llama.cpp's form (format_size: for users)
std::string ms(Nanos d);               // "3.10 ms"

}  // namespace residency::core
