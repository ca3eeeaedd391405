// SPDX-License-Identifier: MIT
#include "abi_check.hpp"

namespace residency::preload {

namespace {

// "0.4.0" of "0.4.0-dev" or "0.4.0+build": a build from git says -dev also at a release tag.
std::string base_of(const std::string& version) { return version.substr(0, version.find_first_of("-+")); }

void add(std::string& out, const std::string& what) {
  if (!out.empty()) out += ", ";
  out += what;
}

std::string llama_name(const std::string& llama_version) {
  return llama_version.empty() ? std::string("without llama_version()") : llama_version;
}

}  // namespace

std::string abi_difference(const BuiltLlama& built, const FoundLlama& found) {
  std::string d;
  if (!found.missing.empty()) {
    std::string names;
    for (const std::string& m : found.missing) names += (names.empty() ? "" : " ") + m;
    add(d, "it lacks " + names);
  }
  if (!found.ggml_version.empty() && base_of(found.ggml_version) != base_of(built.ggml_version))
    add(d, "ggml " + found.ggml_version + ", not " + built.ggml_version);
  if (built.has_llama_version && found.llama_version.empty())
    add(d, "no llama_version() (a llama.cpp older than " + built.llama_version + ")");
  else if (!built.has_llama_version && !found.llama_version.empty())
    add(d, "llama_version() " + found.llama_version + " (a llama.cpp newer than the build's, which has none)");
  else if (built.has_llama_version && base_of(found.llama_version) != base_of(built.llama_version))
    add(d, "llama.cpp " + found.llama_version + ", not " + built.llama_version);
  for (const StructFact& s : found.structs) {
    // A function that returns the struct writes every field; the bytes after the last field
    // (padding, less than the alignment) it may leave alone.
    if (s.written == 0) continue;
    if (s.written <= s.built_size && s.written + s.built_align > s.built_size) continue;
    add(d, std::string(s.returned_by) + "() writes " + std::to_string(s.written) + " bytes of " + s.name + ", " +
               std::to_string(s.built_size) + " in the build");
  }
  return d;
}

std::string abi_refusal(const BuiltLlama& built, const FoundLlama& found, const std::string& difference) {
  std::string what = "llama.cpp " + llama_name(found.llama_version);
  what += " (ggml " + (found.ggml_version.empty() ? std::string("without ggml_version()") : found.ggml_version);
  if (!found.commit.empty()) what += ", commit " + found.commit;
  what += ", " + found.path + ")";
  return what + " is not the llama.cpp this preload was built against (llama.cpp " + llama_name(built.llama_version) +
         ", ggml " + built.ggml_version + ", commit " + built.commit + "): " + difference +
         "; the program runs without residency (build the preload against this llama.cpp: "
         "-DRESIDENCY_LLAMA_DIR=its prefix)";
}

}  // namespace residency::preload
