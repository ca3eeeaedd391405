// SPDX-License-Identifier: MIT
// A Manager over a FakeBackend and a ManualClock, with helpers to make regions at fake
// addresses (the fake never dereferences them) and to step virtual time.
#pragma once

#include <gtest/gtest.h>

#include <memory>

#include "fake_backend.hpp"
#include "residency/residency.hpp"

namespace residency::testing {

constexpr std::uint64_t MiB = 1ull << 20;
constexpr std::uint64_t GiB = 1ull << 30;

class ManagerTest : public ::testing::Test {
 protected:
  std::shared_ptr<FakeBackend> fake = std::make_shared<FakeBackend>();
  ManualClock clock{Nanos(std::chrono::hours(1))};
  LogCapture logs;
  std::uintptr_t next_addr = std::uintptr_t(1) << 40;

  std::unique_ptr<Manager> make(Config c = {}, bool start_scheduler = false) {
    ManagerOptions o;
    o.config = std::move(c);
    o.backend = fake;
    o.clock = &clock;
    o.log = logs.callback();
    o.start_scheduler = start_scheduler;
    auto m = Manager::create(std::move(o));
    EXPECT_TRUE(m.is_ok()) << m.message();
    return m ? std::move(*m) : nullptr;
  }
  // A fresh address range of `size` bytes (never overlapping earlier ones).
  void* addr(std::uint64_t size) {
    void* p = reinterpret_cast<void*>(next_addr);
    next_addr += (size + 4095) / 4096 * 4096 + 4096;
    return p;
  }
  RegionId reg(Manager& m, std::uint64_t size, int priority = 0, RegionClass cls = RegionClass::weights) {
    auto id = m.register_region(addr(size), size, cls, priority);
    EXPECT_TRUE(id.is_ok()) << id.message();
    return id ? *id : 0;
  }
  static Config with_keep_alive(const char* ka) {
    Config c;
    c.keep_alive = *parse_keep_alive(ka);
    return c;
  }
  void advance(Nanos d) { clock.advance(d); }
};

}  // namespace residency::testing
