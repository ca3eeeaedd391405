// SPDX-License-Identifier: MIT
// residency tool: how every --json output is written, in one place.
//
// A JSON string must be UTF-8, and the tool's JSON carries bytes that other users chose: file
// names (a model, a ledger in /dev/shm), fields of state files. nlohmann-json throws on a byte that
// is not UTF-8 ("invalid UTF-8 byte"), which made `ps --json` fail for everyone on one Latin-1
// file name. Here such a byte is replaced with U+FFFD (docs/tool.md says so); control characters
// are escaped by JSON itself (\u001b), so none reaches a terminal raw.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace residency::tool {

// `j` as the tool prints it: indented by 2, bytes that are not UTF-8 replaced with U+FFFD.
inline std::string json_text(const nlohmann::json& j) {
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace residency::tool
