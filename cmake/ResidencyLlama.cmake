# SPDX-License-Identifier: MIT
# llama.cpp, as scripts/llama-cpp builds and installs it (outside the checkout, in the cache):
#   ${RESIDENCY_CACHE:-$HOME/.cache/residency}/llama.cpp-<tag>
# Sets RESIDENCY_HAVE_LLAMA (the imported target `llama` exists) and RESIDENCY_LLAMA_REASON
# (why not, when not). What needs llama.cpp is built only when it is found; with
# RESIDENCY_REQUIRE_LLAMA (CI) a missing llama.cpp is a configure error instead.
#
# The versions scripts/llama-cpp builds are its table (VERSIONS: npm version, tag, commit, date),
# read here: the pinned one (PINNED) is the default prefix; any of them is known.
file(STRINGS "${PROJECT_SOURCE_DIR}/scripts/llama-cpp" _residency_llama_rows REGEX "^  \"[0-9]+\\.[0-9]+\\.[0-9]+ ")
file(STRINGS "${PROJECT_SOURCE_DIR}/scripts/llama-cpp" _residency_llama_pinned REGEX "^PINNED=")
string(REGEX REPLACE "^PINNED=([0-9.]+).*" "\\1" _residency_llama_pinned "${_residency_llama_pinned}")
set(RESIDENCY_LLAMA_KNOWN "")  # "npm tag commit7" per version
foreach(_row IN LISTS _residency_llama_rows)
  string(REGEX MATCH "^  \"([0-9.]+) +([^ ]+) +([0-9a-f]+) " _m "${_row}")
  string(SUBSTRING "${CMAKE_MATCH_3}" 0 7 _commit)
  list(APPEND RESIDENCY_LLAMA_KNOWN "${CMAKE_MATCH_1} ${CMAKE_MATCH_2} ${_commit}")
  if(CMAKE_MATCH_1 STREQUAL _residency_llama_pinned)
    set(RESIDENCY_LLAMA_TAG ${CMAKE_MATCH_2})
    set(RESIDENCY_LLAMA_COMMIT ${_commit})
  endif()
endforeach()
if(NOT RESIDENCY_LLAMA_TAG)
  message(FATAL_ERROR "residency: scripts/llama-cpp has no VERSIONS row for its PINNED version")
endif()

if(DEFINED ENV{RESIDENCY_CACHE} AND NOT "$ENV{RESIDENCY_CACHE}" STREQUAL "")
  set(_residency_llama_default "$ENV{RESIDENCY_CACHE}/llama.cpp-${RESIDENCY_LLAMA_TAG}")
else()
  set(_residency_llama_default "$ENV{HOME}/.cache/residency/llama.cpp-${RESIDENCY_LLAMA_TAG}")
endif()
set(RESIDENCY_LLAMA_DIR "${_residency_llama_default}" CACHE PATH
    "llama.cpp install prefix (scripts/llama-cpp prints it)")
option(RESIDENCY_WITH_LLAMA "Build what needs llama.cpp when it is found" ON)
option(RESIDENCY_REQUIRE_LLAMA "A llama.cpp that is not found is an error, not a skip (CI)" OFF)

set(RESIDENCY_HAVE_LLAMA OFF)
set(RESIDENCY_LLAMA_REASON "")
if(NOT RESIDENCY_WITH_LLAMA)
  set(RESIDENCY_LLAMA_REASON "llama.cpp disabled (RESIDENCY_WITH_LLAMA=OFF)")
else()
  # (A llama_DIR left by an earlier configure that no longer holds the package is ignored by
  # find_package, which then searches again.)
  find_package(llama CONFIG QUIET HINTS "${RESIDENCY_LLAMA_DIR}")
  if(llama_FOUND AND TARGET llama)
    set(RESIDENCY_HAVE_LLAMA ON)
    set(_known "")
    foreach(_row IN LISTS RESIDENCY_LLAMA_KNOWN)
      string(REPLACE " " ";" _f "${_row}")
      list(GET _f 2 _c)
      if(_c STREQUAL LLAMA_BUILD_COMMIT)
        list(GET _f 0 _npm)
        list(GET _f 1 _tag)
        set(_known "${_tag}, from node-llama-cpp ${_npm}")
      endif()
    endforeach()
    if(NOT LLAMA_BUILD_COMMIT STREQUAL RESIDENCY_LLAMA_COMMIT)
      if(_known)
        message(STATUS "residency: llama.cpp ${_known}, one of scripts/llama-cpp --version's; the tests' "
                       "default is ${RESIDENCY_LLAMA_TAG} (commit ${RESIDENCY_LLAMA_COMMIT})")
      else()
        message(WARNING "residency: llama.cpp at ${llama_DIR} is commit ${LLAMA_BUILD_COMMIT}, "
                        "not ${RESIDENCY_LLAMA_COMMIT} (${RESIDENCY_LLAMA_TAG}) that scripts/llama-cpp builds")
      endif()
    endif()
    # ggml's packages before 2026 name their version file ggml-version.cmake, which find_package
    # does not read: its PACKAGE_VERSION is what ggml_version() returns.
    if(NOT ggml_VERSION AND EXISTS "${ggml_DIR}/ggml-version.cmake")
      file(STRINGS "${ggml_DIR}/ggml-version.cmake" _m REGEX "^set\\(PACKAGE_VERSION \"[^\"]+\"\\)")
      string(REGEX REPLACE "^set\\(PACKAGE_VERSION \"([^\"]+)\"\\).*" "\\1" ggml_VERSION "${_m}")
    endif()
    message(STATUS "residency: llama.cpp ${LLAMA_VERSION} (commit ${LLAMA_BUILD_COMMIT}, ggml ${ggml_VERSION}) at ${llama_DIR}")
    # What the preload is built against, which it recognises at run time (src/preload/engine_abi.hpp),
    # and what its headers have that not every version's do.
    get_target_property(_llama_include llama INTERFACE_INCLUDE_DIRECTORIES)
    set(RESIDENCY_LLAMA_HAS_VERSION_FN 0)
    set(RESIDENCY_GGML_HAS_IGPU 0)
    set(RESIDENCY_LLAMA_HAS_LOAD_MODE 0)  # llama_model_params.load_mode (since 2026), before it use_mmap/use_mlock
    foreach(_dir IN LISTS _llama_include)
      if(EXISTS "${_dir}/llama.h")
        file(STRINGS "${_dir}/llama.h" _m REGEX "llama_version[ ]*\\(void\\)")
        if(_m)
          set(RESIDENCY_LLAMA_HAS_VERSION_FN 1)
        endif()
        file(STRINGS "${_dir}/llama.h" _m REGEX "enum llama_load_mode +load_mode")
        if(_m)
          set(RESIDENCY_LLAMA_HAS_LOAD_MODE 1)
        endif()
      endif()
      if(EXISTS "${_dir}/ggml-backend.h")
        file(STRINGS "${_dir}/ggml-backend.h" _m REGEX "GGML_BACKEND_DEVICE_TYPE_IGPU")
        if(_m)
          set(RESIDENCY_GGML_HAS_IGPU 1)
        endif()
      endif()
    endforeach()
  elseif(RESIDENCY_LLAMA_DIR STREQUAL "")
    # The README's -DRESIDENCY_LLAMA_DIR="$llama" with llama unset (scripts/llama-cpp failed, or
    # another shell) once printed "not found at ," here.
    set(RESIDENCY_LLAMA_REASON "llama.cpp not found: RESIDENCY_LLAMA_DIR is empty (was \"$llama\" unset?), run scripts/llama-cpp (then cmake again)")
  else()
    set(RESIDENCY_LLAMA_REASON "llama.cpp not found at ${RESIDENCY_LLAMA_DIR}, run scripts/llama-cpp (then cmake again)")
  endif()
endif()

if(NOT RESIDENCY_HAVE_LLAMA)
  if(RESIDENCY_REQUIRE_LLAMA)
    message(FATAL_ERROR "residency: ${RESIDENCY_LLAMA_REASON} (RESIDENCY_REQUIRE_LLAMA is ON)")
  endif()
  # A warning, not a status line: the quick start once installed without the preload, silently.
  message(WARNING "residency: ${RESIDENCY_LLAMA_REASON}: the preload (libresidency_preload.so) is NOT "
                  "built and will not be installed; the llama tests are skipped. Pass "
                  "-DRESIDENCY_LLAMA_DIR=<the prefix scripts/llama-cpp prints> to build it.")
endif()
