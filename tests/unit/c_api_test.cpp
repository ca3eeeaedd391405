// The C API: configuration from text, a manager on the posix backend, errors as codes plus
// residency_last_error(), NULLs refused instead of crashing.
#include <gtest/gtest.h>

#include <sys/mman.h>

#include <cstring>
#include <string>

#include "residency/backends.hpp"
#include "residency/residency.h"

namespace {
bool has_backend(const char* name) {
  for (const auto& n : residency::available_backends())
    if (n == name) return true;
  return false;
}
}  // namespace

TEST(CApi, ConfigSetParsesStrictlyAndNamesTheVariable) {
  residency_config* cfg = residency_config_default();
  ASSERT_NE(cfg, nullptr);
  EXPECT_EQ(residency_config_set(cfg, "keep_alive", "5m"), RESIDENCY_OK);
  EXPECT_EQ(residency_config_set(cfg, "keep_alive", "soon"), RESIDENCY_INVALID_ARGUMENT);
  EXPECT_NE(std::string(residency_last_error()).find("RESIDENCY_KEEP_ALIVE=\"soon\""), std::string::npos);
  EXPECT_EQ(residency_config_set(cfg, "colour", "blue"), RESIDENCY_INVALID_ARGUMENT);
  EXPECT_NE(std::string(residency_last_error()).find("unknown key 'colour'"), std::string::npos);
  EXPECT_EQ(residency_config_set(cfg, "wired_limit", "50%"), RESIDENCY_OK);
  EXPECT_EQ(residency_config_set(nullptr, "keep_alive", "1s"), RESIDENCY_INVALID_ARGUMENT);
  EXPECT_EQ(residency_config_set(cfg, nullptr, "1s"), RESIDENCY_INVALID_ARGUMENT);
  residency_config_free(cfg);
  residency_config_free(nullptr);
}

TEST(CApi, NullsAndUnknownBackendsAreErrorsNotCrashes) {
  residency_manager* m = nullptr;
  EXPECT_EQ(residency_manager_create(nullptr, "warp-drive", nullptr, nullptr, &m), RESIDENCY_INVALID_ARGUMENT);
  EXPECT_EQ(m, nullptr);
  EXPECT_NE(std::string(residency_last_error()).find("unknown backend 'warp-drive'"), std::string::npos);
  EXPECT_EQ(residency_manager_create(nullptr, "posix", nullptr, nullptr, nullptr), RESIDENCY_INVALID_ARGUMENT);
  EXPECT_EQ(residency_register(nullptr, nullptr, 1, RESIDENCY_WEIGHTS, 0, nullptr), RESIDENCY_INVALID_ARGUMENT);
  residency_touch(nullptr);
  residency_manager_destroy(nullptr);
  residency_stats st;
  EXPECT_EQ(residency_get_stats(nullptr, &st), RESIDENCY_INVALID_ARGUMENT);
}

TEST(CApi, RegisterUseAndTeardownOnARealBackend) {
  if (!has_backend("posix")) GTEST_SKIP() << "this build has no posix backend";
  residency_config* cfg = residency_config_default();
  ASSERT_EQ(residency_config_set(cfg, "keep_alive", "0"), RESIDENCY_OK);
  ASSERT_EQ(residency_config_set(cfg, "log", "error"), RESIDENCY_OK);
  residency_manager* m = nullptr;
  ASSERT_EQ(residency_manager_create(cfg, "posix", nullptr, nullptr, &m), RESIDENCY_OK) << residency_last_error();
  residency_config_free(cfg);

  const size_t size = 1 << 20;  // small: fits the default RLIMIT_MEMLOCK of 8 MiB
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  uint64_t id = 0;
  ASSERT_EQ(residency_register(m, p, size, RESIDENCY_WEIGHTS, 0, &id), RESIDENCY_OK) << residency_last_error();
  EXPECT_EQ(residency_register(m, p, size, RESIDENCY_WEIGHTS, 0, nullptr), RESIDENCY_INVALID_ARGUMENT);
  residency_class bogus;
  const int seven = 7;
  std::memcpy(&bogus, &seven, sizeof bogus);  // what a C caller can pass
  EXPECT_EQ(residency_register(m, p, size, bogus, 0, nullptr), RESIDENCY_INVALID_ARGUMENT);

  residency_stats st{};
  ASSERT_EQ(residency_get_stats(m, &st), RESIDENCY_OK);
  EXPECT_EQ(st.tracked_bytes, size);
  EXPECT_EQ(st.wired_bytes, 0u);  // keep_alive 0: wired only inside a use scope

  int synced = 0;
  residency_scope* scope = nullptr;
  ASSERT_EQ(residency_use_begin(m, [](void* u) { ++*static_cast<int*>(u); }, &synced, &scope), RESIDENCY_OK)
      << residency_last_error();
  ASSERT_EQ(residency_get_stats(m, &st), RESIDENCY_OK);
  EXPECT_EQ(st.wired_bytes, size);
  residency_use_end(scope);
  EXPECT_EQ(synced, 1);
  ASSERT_EQ(residency_get_stats(m, &st), RESIDENCY_OK);
  EXPECT_EQ(st.wired_bytes, 0u);
  EXPECT_EQ(st.releases, 1u);

  EXPECT_EQ(residency_unregister(m, 999), RESIDENCY_NOT_FOUND);
  residency_manager_destroy(m);  // the region is still registered: released, not an abort
  munmap(p, size);
}
