// SPDX-License-Identifier: MIT
// residency stat on macOS (stat_apple.cpp): the figures that decide whether a Metal model stays
// wired, in place of Linux's /proc and PSI lines.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace residency::tool {

// Prints the macOS rows (or JSON with raw byte values), then `backends_line` as the backends
// row; `backends` (the keys "backends" and "backends_not_here") is merged into the JSON.
int run_stat_apple(bool json, const std::string& backends_line, const nlohmann::json& backends);

}  // namespace residency::tool
