# SPDX-License-Identifier: MIT
# Installs the library with a CMake package config (find_package(residency): targets
# residency::residency, the static library with the C and C++ API, and residency::shared,
# libresidency.so with the C API) and pkg-config files (residency: the shared library and the C
# API; residency-static: the static library, for C++).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS residency residency_shared EXPORT residencyTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/residency DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT residencyTargets NAMESPACE residency::
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/residency)
configure_package_config_file(cmake/residencyConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/residencyConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/residency)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/residencyConfigVersion.cmake
  COMPATIBILITY SameMajorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/residencyConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/residencyConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/residency)

get_target_property(_residency_extra_libs residency RESIDENCY_PKGCONFIG_LIBS)
if(NOT _residency_extra_libs)
  set(_residency_extra_libs "")
endif()
# The static library's C++ runtime and libm (src/CMakeLists.txt): in Libs, not Libs.private,
# so that `cc main.c $(pkg-config --cflags residency) $(pkg-config --libs residency-static)` links
# from C (residency-static's Cflags carry -std=c++20, for C++ consumers).
list(TRANSFORM RESIDENCY_C_LINK_RUNTIME PREPEND "-l" OUTPUT_VARIABLE _residency_runtime_flags)
list(JOIN _residency_runtime_flags " " RESIDENCY_PC_RUNTIME)
# Relocatable: the prefix is found from the .pc file's own location.
file(RELATIVE_PATH RESIDENCY_PC_TO_PREFIX "/prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/prefix")
configure_file(cmake/residency.pc.in ${CMAKE_CURRENT_BINARY_DIR}/residency.pc @ONLY)
configure_file(cmake/residency-static.pc.in ${CMAKE_CURRENT_BINARY_DIR}/residency-static.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/residency.pc ${CMAKE_CURRENT_BINARY_DIR}/residency-static.pc
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
install(FILES LICENSE DESTINATION ${CMAKE_INSTALL_DATADIR}/doc/residency)
