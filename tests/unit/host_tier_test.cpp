// SPDX-License-Identifier: MIT
// The host tier (docs/design.md, "The host tier"): the model files a device backend keeps
// registered count against a host budget (a ledger in /dev/shm) shared by processes. Two device
// managers on fake backends that register "files" through the manager's host gate, as the cuda
// backend does: a registration that does not fit is refused without a wait, one that may wait asks
// the other holder, whose manager gives its registration back; the ledger never holds more than its
// budget, and the managers leave it as they found it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>

#include "core/state_file.hpp"
#include "residency/shared_budget.hpp"
#include "support/manager_fixture.hpp"
#include "support/state_files.hpp"

using namespace residency;
using namespace residency::testing;
using namespace std::chrono_literals;

namespace {

constexpr std::uint64_t kMiB = 1ull << 20;

class HostTierTest : public ::testing::Test {
 protected:
  ManualClock clock{Nanos(std::chrono::hours(1))};
  std::string name = "unit-host-tier-" + std::to_string(::getpid()) + "-" + std::to_string(serial()++);
  struct Device {
    std::shared_ptr<FakeBackend> fake = std::make_shared<FakeBackend>();
    LogCapture logs;
    std::unique_ptr<Manager> m;
  };
  HostTierTest() { remove_ledgers_of_dead_runs("unit-host-tier-"); }
  static std::atomic<int>& serial() {
    static std::atomic<int> n{0};
    return n;
  }
  void start(Device& d, HostBudget host, bool state_file = false) {
    d.fake->registers_files = true;
    ManagerOptions o;
    o.config.keep_alive = KeepAlive::after(10s);
    o.config.layout = Layout::per_buffer;
    o.config.host_budget = std::move(host);
    o.config.state_file = state_file;
    o.backend = d.fake;
    o.clock = &clock;
    o.log = d.logs.callback();
    o.start_scheduler = false;
    auto m = Manager::create(std::move(o));
    ASSERT_TRUE(m) << m.message();
    d.m = std::move(*m);
  }
  HostBudget budget(std::uint64_t bytes) const {
    HostBudget h;
    h.budget = SharedBudget{name, WiredLimit{false, bytes, 0}, ""};
    return h;
  }
  std::uint64_t ledger_used() const {
    for (const SharedBudgetInfo& info : list_shared_budgets())
      if (info.name == name) return info.used;
    return 0;
  }
  bool ledger_exists() const { return std::filesystem::exists("/dev/shm/residency-budget-" + name); }
  Device a, b;
};

TEST_F(HostTierTest, ARegistrationThatDoesNotFitIsRefusedAndOneThatMayWaitTakesTheOtherHoldersRoom) {
  start(a, budget(100 * kMiB));
  start(b, budget(100 * kMiB));
  ASSERT_TRUE(a.fake->has_host_gate()) << "a backend that registers files gets the manager's gate";
  EXPECT_TRUE(a.logs.contains(LogLevel::info, "host tier"));

  ASSERT_TRUE(a.fake->register_file(60 * kMiB, /*may_wait=*/false));
  EXPECT_EQ(ledger_used(), 60 * kMiB);
  EXPECT_FALSE(b.fake->register_file(60 * kMiB, /*may_wait=*/false)) << "no room, and a sleep never waits";
  EXPECT_EQ(a.fake->drops.load(), 0) << "nobody was asked";
  EXPECT_EQ(b.fake->registered_files.load(), 0u);

  ASSERT_TRUE(b.fake->register_file(60 * kMiB, /*may_wait=*/true)) << "the background thread's wait asks a";
  EXPECT_EQ(a.fake->drops.load(), 1);
  EXPECT_EQ(a.fake->registered_files.load(), 0u) << "a gave its registration back";
  EXPECT_EQ(b.fake->registered_files.load(), 60 * kMiB);
  EXPECT_EQ(ledger_used(), 60 * kMiB) << "the ledger holds b's, and never more than its budget";
  EXPECT_TRUE(a.logs.contains(LogLevel::info, "gave back the registration of 60.00 MiB of model files"));

  a.m.reset();
  EXPECT_FALSE(a.fake->has_host_gate()) << "the manager takes its gate back as it goes";
  b.m.reset();
  EXPECT_FALSE(ledger_exists()) << "the last holder removes the ledger";
}

// Servers of one model file (llama.cpp's router with one GGUF under several names, or several
// servers of one model) register the same page cache: the budget counts it once. A model of another
// file then needs room, and gets it only once every server of the shared file gave way.
TEST_F(HostTierTest, ServersOfOneFileCountItOnceAndAllOfThemGiveWayForAnother) {
  Device c;
  start(a, budget(100 * kMiB));
  start(b, budget(100 * kMiB));
  start(c, budget(100 * kMiB));
  constexpr std::uint64_t kFile = 0x1234, kOther = 0x5678;
  ASSERT_TRUE(a.fake->register_file(70 * kMiB, false, kFile));
  ASSERT_TRUE(b.fake->register_file(70 * kMiB, false, kFile)) << "the same pages: nothing more is pinned";
  EXPECT_EQ(ledger_used(), 70 * kMiB);
  EXPECT_FALSE(c.fake->register_file(70 * kMiB, false, kOther));
  ASSERT_TRUE(c.fake->register_file(70 * kMiB, true, kOther)) << "a and b are asked, and both give way";
  EXPECT_EQ(a.fake->registered_files.load() + b.fake->registered_files.load(), 0u);
  EXPECT_EQ(ledger_used(), 70 * kMiB);
  c.m.reset();
}

// `residency stat` lists the host tier's ledger with its holders' own account: the state file names
// that budget, and says the registered bytes.
TEST_F(HostTierTest, TheStateFileNamesTheHostBudgetAndTheRegisteredBytes) {
  remove_state_files_of(::getpid());
  a.fake->registered_files = 30 * kMiB;  // what the backend says it keeps registered
  start(a, budget(100 * kMiB), /*state_file=*/true);
  std::string named, registered;
  for (const auto& f : core::read_state_files(::getpid(), ::geteuid(), core::process_start_time(::getpid())))
    if (f.fields.count("host_budget") != 0) {
      named = f.fields.at("host_budget");
      registered = f.fields.count("registered_file_bytes") != 0 ? f.fields.at("registered_file_bytes") : "absent";
    }
  EXPECT_EQ(named, name);
  EXPECT_EQ(registered, std::to_string(30 * kMiB));
  a.m.reset();
  remove_state_files_of(::getpid());
}

TEST_F(HostTierTest, AHolderThatCannotGetRoomStaysUnregisteredAndSaysSo) {
  start(a, budget(100 * kMiB));
  start(b, budget(100 * kMiB));
  ASSERT_TRUE(a.fake->register_file(90 * kMiB, false));
  // b wants more than the whole budget: a gives way, and still it does not fit.
  EXPECT_FALSE(b.fake->register_file(120 * kMiB, true));
  EXPECT_EQ(b.fake->registered_files.load(), 0u);
  EXPECT_LE(ledger_used(), 100 * kMiB);
  EXPECT_TRUE(b.logs.contains(LogLevel::info, "host tier 2"));
}

TEST_F(HostTierTest, OffMeansNoGateAndNoLedger) {
  HostBudget off;
  off.off = true;
  start(a, off);
  EXPECT_FALSE(a.fake->has_host_gate());
  EXPECT_TRUE(a.fake->register_file(1ull << 40, false)) << "unbounded, as before the tier";
  EXPECT_FALSE(ledger_exists());
}

TEST_F(HostTierTest, ABackendThatRegistersNoFilesJoinsNoHostBudget) {
  ManagerOptions o;
  o.config.keep_alive = KeepAlive::after(10s);
  o.config.host_budget = budget(100 * kMiB);
  o.config.state_file = false;
  o.backend = a.fake;  // registers_files stays false
  o.clock = &clock;
  o.start_scheduler = false;
  auto m = Manager::create(std::move(o));
  ASSERT_TRUE(m) << m.message();
  EXPECT_FALSE(a.fake->has_host_gate());
  EXPECT_FALSE(ledger_exists());
}

}  // namespace
