# Installs the library with a CMake package config (find_package(residency)) and a pkg-config
# file (pkg-config --cflags --libs residency).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS residency EXPORT residencyTargets
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
# Relocatable: the prefix is found from the .pc file's own location.
file(RELATIVE_PATH RESIDENCY_PC_TO_PREFIX "/prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/prefix")
configure_file(cmake/residency.pc.in ${CMAKE_CURRENT_BINARY_DIR}/residency.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/residency.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
