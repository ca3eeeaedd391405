# SPDX-License-Identifier: MIT
# residency_warnings(target): the project's warning set; errors in CI (RESIDENCY_WERROR).
function(residency_warnings target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX,C>:-Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion>
      $<$<AND:$<COMPILE_LANGUAGE:CXX,C>,$<BOOL:${RESIDENCY_WERROR}>>:-Werror>)
  endif()
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    # GCC 12 reports impossible overlaps in std::string's inlined memcpy at -O2/-O3
    # (GCC bug 105329, a false positive in libstdc++ itself).
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wno-restrict>)
  endif()
endfunction()
