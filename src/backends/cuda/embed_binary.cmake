# SPDX-License-Identifier: MIT
# Turns a binary file (a CUDA fatbin) into a C++ source holding it as a byte array, so kernels
# travel inside the executable and are loaded with cuModuleLoadData at run time: no file to
# find next to the binary, no libcudart.
# Usage: cmake -DINPUT=x.fatbin -DOUTPUT=x.cpp -DSYMBOL=name -P embed_binary.cmake
# The .cpp defines, in namespace residency::cuda::embedded:
#   extern const unsigned char NAME[];  extern const std::size_t NAME_size;
file(READ "${INPUT}" hex HEX)
string(LENGTH "${hex}" hex_len)
math(EXPR size "${hex_len} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
# 32 bytes per line keeps the generated file readable in a diff viewer.
string(REGEX REPLACE "((0x..,){32})" "\\1\n" bytes "${bytes}")
file(WRITE "${OUTPUT}.tmp"
"// Generated from ${INPUT} by embed_binary.cmake; do not edit.
#include <cstddef>
namespace residency::cuda::embedded {
extern const unsigned char ${SYMBOL}[];
extern const std::size_t ${SYMBOL}_size;
alignas(64) const unsigned char ${SYMBOL}[] = {
${bytes}
};
const std::size_t ${SYMBOL}_size = ${size};
}  // namespace residency::cuda::embedded
")
file(COPY_FILE "${OUTPUT}.tmp" "${OUTPUT}" ONLY_IF_DIFFERENT)
file(REMOVE "${OUTPUT}.tmp")
