// SPDX-License-Identifier: MIT
// residency: how a message writes a value the user gave, and a size.
//
// Every message of the library and the tool shares these two forms, so they live in one unit
// (src/core/text.cpp) of their own: a value is echoed so that it can neither split the message
// into several lines nor drive the terminal, and a size is written the way a user reads it. The
// log lines that keep llama.cpp's wording ("12.00 MiB", "3.10 ms") have their own two forms, next
// to these in the same unit (src/core/text.hpp), because their users compare them with
// llama.cpp's lines.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace residency {

// A value the user gave (a variable's value, an argument, a path) as messages quote it: control
// characters escaped (\n, \t, \x1B; also DEL, the C1 controls and bytes that are not UTF-8, and
// the backslash itself), so that no value can split a message into several lines or drive the
// terminal; a value longer than `max_bytes` (default 80) is shortened to its start and end, with its
// length. Every message of the library and the tool that echoes a user's value goes through this.
std::string printable(std::string_view value, std::size_t max_bytes = 80);

// "1.5 GiB", "512 MiB", "4 KiB", "100 B": the form used in messages for users (the unit that
// keeps the number below 1024, one decimal unless it is whole or above 100).
std::string format_size(std::uint64_t bytes);

}  // namespace residency
