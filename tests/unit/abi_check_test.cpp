// SPDX-License-Identifier: MIT
// The rule that recognises the llama.cpp a preload was built against (src/preload/abi_check.hpp);
// the preload's tests run it on real and fake libraries (tests/preload/host_test.cpp).
#include "preload/abi_check.hpp"

#include <gtest/gtest.h>

namespace {

using residency::preload::abi_difference;
using residency::preload::abi_refusal;
using residency::preload::BuiltLlama;
using residency::preload::FoundLlama;
using residency::preload::StructFact;

BuiltLlama built() {
  BuiltLlama b;
  b.llama_version = "0.4.0-dev";
  b.has_llama_version = true;
  b.ggml_version = "0.23.0";
  b.commit = "80fb11a";
  return b;
}

StructFact params(std::size_t written) {
  StructFact s;
  s.name = "llama_context_params";
  s.returned_by = "llama_context_default_params";
  s.built_size = 296;
  s.built_align = 8;
  s.written = written;
  return s;
}

FoundLlama same() {
  FoundLlama f;
  f.path = "/x/libllama.so.0";
  f.llama_version = "0.4.0-dev";
  f.ggml_version = "0.23.0";
  f.commit = "5b4ebc5";  // another build of the same source (node-llama-cpp's)
  f.structs = {params(296)};
  return f;
}

TEST(AbiCheck, TheBuildsLlamaCppIsServedWhateverItsCommitAndDevSuffix) {
  EXPECT_EQ(abi_difference(built(), same()), "");
  FoundLlama release = same();
  release.llama_version = "0.4.0";  // LLAMA_BUILD_IS_DEV=OFF
  EXPECT_EQ(abi_difference(built(), release), "");
}

TEST(AbiCheck, TrailingPaddingTheLibraryLeavesIsNotADifference) {
  FoundLlama f = same();
  f.structs = {params(290), params(296), params(0)};  // the last one not measured
  EXPECT_EQ(abi_difference(built(), f), "");
  f.structs = {params(288)};  // a whole field fewer
  EXPECT_EQ(abi_difference(built(), f),
            "llama_context_default_params() writes 288 bytes of llama_context_params, 296 in the build");
  f.structs = {params(304)};
  EXPECT_EQ(abi_difference(built(), f),
            "llama_context_default_params() writes 304 bytes of llama_context_params, 296 in the build");
}

TEST(AbiCheck, AnotherVersionOrAMissingFunctionIsADifference) {
  FoundLlama f = same();
  f.ggml_version = "0.25.1";
  f.llama_version = "0.5.0-dev";
  EXPECT_EQ(abi_difference(built(), f), "ggml 0.25.1, not 0.23.0, llama.cpp 0.5.0-dev, not 0.4.0-dev");

  FoundLlama older = same();
  older.llama_version.clear();  // before llama_version()
  older.ggml_version = "0.0.1";
  EXPECT_EQ(abi_difference(built(), older),
            "ggml 0.0.1, not 0.23.0, no llama_version() (a llama.cpp older than 0.4.0-dev)");

  BuiltLlama old_build = built();
  old_build.has_llama_version = false;
  old_build.llama_version = "0.0.1";
  old_build.ggml_version = "0.0.1";
  FoundLlama newer = same();
  newer.ggml_version = "0.0.1";
  EXPECT_EQ(abi_difference(old_build, newer),
            "llama_version() 0.4.0-dev (a llama.cpp newer than the build's, which has none)");

  FoundLlama lacking = same();
  lacking.ggml_version.clear();
  lacking.missing = {"llama_synchronize", "ggml_version"};
  EXPECT_EQ(abi_difference(built(), lacking), "it lacks llama_synchronize ggml_version");
}

TEST(AbiCheck, TheRefusalIsOneLineNamingBothAndWhatToDo) {
  FoundLlama f = same();
  f.ggml_version = "0.25.1";
  const std::string line = abi_refusal(built(), f, abi_difference(built(), f));
  EXPECT_EQ(line,
            "llama.cpp 0.4.0-dev (ggml 0.25.1, commit 5b4ebc5, /x/libllama.so.0) is not the llama.cpp this preload was "
            "built against (llama.cpp 0.4.0-dev, ggml 0.23.0, commit 80fb11a): ggml 0.25.1, not 0.23.0; the program "
            "runs without residency (build the preload against this llama.cpp: -DRESIDENCY_LLAMA_DIR=its prefix)");
  EXPECT_EQ(line.find('\n'), std::string::npos);
}

}  // namespace
