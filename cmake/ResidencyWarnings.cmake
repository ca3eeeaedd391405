# residency_warnings(target): the project's warning set; errors in CI (RESIDENCY_WERROR).
function(residency_warnings target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX,C>:-Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion>
      $<$<AND:$<COMPILE_LANGUAGE:CXX,C>,$<BOOL:${RESIDENCY_WERROR}>>:-Werror>)
  endif()
endfunction()
