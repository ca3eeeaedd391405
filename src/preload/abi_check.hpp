// SPDX-License-Identifier: MIT
// Whether the llama.cpp found in a process is the one the preload was built against: the facts of
// each side and the one rule that compares them. No llama.cpp header here (engine_abi.cpp gathers
// the facts), so the rule is unit-tested without llama.cpp (tests/unit/abi_check_test.cpp).
//
// The preload is compiled against one llama.cpp's headers, and what it takes from them is machine
// code: the layout of the structs it passes by value and writes into (llama_model_params,
// llama_context_params, llama_batch), ggml's enums and ggml_tensor, each hooked function's
// parameter list. Releases change them, and nothing at run time describes a layout. So the build
// is recognised by what the library says of itself (llama_version(), ggml_version()) and by what
// can be measured (how many bytes the default-params functions write), and anything else is refused.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace residency::preload {

// One struct the preload passes by value: its size and alignment in the build's headers, and how
// many leading bytes the library's own function that returns one writes (0: not measured).
struct StructFact {
  const char* name = "";
  const char* returned_by = "";  // the library's function that returns one
  std::size_t built_size = 0;
  std::size_t built_align = 1;
  std::size_t written = 0;
};

struct BuiltLlama {
  std::string llama_version;       // LLAMA_VERSION of the build's CMake package ("0.4.0-dev")
  bool has_llama_version = false;  // the build's llama.h declares llama_version()
  std::string ggml_version;        // the ggml package's version ("0.23.0")
  std::string commit;              // LLAMA_BUILD_COMMIT, for the message only
};

struct FoundLlama {
  std::string path;                  // the libllama, for the message
  std::string llama_version;         // llama_version(); empty: the library has none
  std::string ggml_version;          // ggml_version(); empty: none
  std::string commit;                // ggml_commit(), for the message only; empty: none
  std::vector<std::string> missing;  // functions the preload needs that the library lacks
  std::vector<StructFact> structs;
};

// Empty when `found` is the llama.cpp `built` describes; else what differs, comma-separated
// ("ggml 0.25.1, not 0.23.0", "llama_context_default_params() writes 312 bytes of
// llama_context_params, 296 in the build"). Versions compare by their base ("0.4.0" of "0.4.0-dev").
std::string abi_difference(const BuiltLlama& built, const FoundLlama& found);

// The one warning line for a refused llama.cpp: what it is, what the preload was built against,
// `difference`, and what to do.
std::string abi_refusal(const BuiltLlama& built, const FoundLlama& found, const std::string& difference);

}  // namespace residency::preload
