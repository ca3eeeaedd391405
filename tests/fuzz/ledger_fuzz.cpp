// SPDX-License-Identifier: MIT
// libFuzzer target: a live shared-budget ledger whose file another process scribbles on (issue 18,
// item 4). Two holders use it, each with its own open file and its listener thread; one of them
// acquires and releases in a loop on a thread of its own, the other follows the input, and the
// input also writes bytes into the file, truncates or extends it, holds the ledger's lock for a
// while (a holder stopped inside it), reads it as `residency stat` does and joins a third holder.
// What may never happen: a crash, a sanitizer report, a holder operation that waits unboundedly
// (more than a second), or a message that is not one printable line of bounded length.
//
// Input: a sequence of operations, one byte of kind and its parameters (see run_one). Writes of
// bytes run while the looping holder runs; a truncation or an extension waits for the looping
// holder to be between two operations (a file cut under an access in flight faults the access
// whatever the code checked before: the checks under the lock are what this target tests). Linux
// only; elsewhere the target accepts every input and does nothing.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#if defined(__linux__)
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>

#include "ledger/ledger.hpp"
#include "residency/shared_budget.hpp"

namespace {

using namespace residency;
using SteadyClock = std::chrono::steady_clock;
constexpr std::uint64_t kBudget = 1 << 20;
constexpr auto kBound = std::chrono::seconds(1);  // far above every wait the ledger allows itself
// The time a manager on the real clock gives Ledger::acquire (CLOCK_MONOTONIC nanoseconds).
std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(SteadyClock::now().time_since_epoch()).count();
}

void check_line(const std::string& m) {
  for (char c : m)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) __builtin_trap();  // several lines, or raw bytes
  if (m.size() > 2000) __builtin_trap();
}

// One holder, and the lock its owner would hold around it (a manager's mutex).
struct Holder {
  std::unique_ptr<ledger::Ledger> ledger;
  std::mutex mu;
  void listen() {
    ledger->listen([this](int) {
      std::lock_guard<std::mutex> g(mu);
      ledger->release(ledger->held());
    });
  }
  std::uint64_t acquire(std::uint64_t bytes, std::chrono::nanoseconds wait, bool partial) {
    std::lock_guard<std::mutex> g(mu);
    const auto t0 = SteadyClock::now();
    const std::uint64_t got = ledger->acquire(bytes, now_ns(), wait, partial);
    if (SteadyClock::now() - t0 > kBound + wait) __builtin_trap();  // an unbounded wait
    if (got > bytes) __builtin_trap();
    check_line(ledger->problem());
    return got;
  }
  void release(std::uint64_t bytes) {
    std::lock_guard<std::mutex> g(mu);
    const auto t0 = SteadyClock::now();
    ledger->release(bytes);
    if (SteadyClock::now() - t0 > kBound) __builtin_trap();
  }
};

std::unique_ptr<Holder> join(const std::string& name) {
  auto l = ledger::Ledger::attach({name, kBudget, "", 0});
  if (!l) {
    check_line(l.message());
    return nullptr;
  }
  auto h = std::make_unique<Holder>();
  h->ledger = std::move(*l);
  h->listen();
  return h;
}

// Takes the ledger's lock through another open of the file, as a stopped holder would hold it.
class HeldLock {
 public:
  explicit HeldLock(const std::string& path) : fd_(::open(path.c_str(), O_RDWR | O_CLOEXEC)) {
    struct flock fl {};
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    if (fd_ >= 0) ::fcntl(fd_, F_OFD_SETLK, &fl);
  }
  ~HeldLock() {
    if (fd_ >= 0) ::close(fd_);  // the lock goes with the open file
  }
  HeldLock(const HeldLock&) = delete;
  HeldLock& operator=(const HeldLock&) = delete;

 private:
  int fd_;
};

struct Input {
  const std::uint8_t* p;
  std::size_t n;
  bool empty() const { return n == 0; }
  std::uint8_t byte() {
    if (n == 0) return 0;
    --n;
    return *p++;
  }
  std::uint32_t u16() { return static_cast<std::uint32_t>(byte()) | static_cast<std::uint32_t>(byte()) << 8; }
};

void run_one(Input in) {
  static int serial = 0;
  const std::string name = "fuzz-" + std::to_string(::getpid()) + "-" + std::to_string(serial++);
  const std::string path = ledger::ledger_path(name);
  std::unique_ptr<Holder> a = join(name), b = join(name);
  if (!a || !b) __builtin_trap();  // a fresh ledger must be joinable
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) __builtin_trap();
  struct stat st {};
  ::fstat(fd, &st);
  const auto full_size = static_cast<std::uint32_t>(st.st_size);

  // b acquires and releases in a loop; `pause` holds it between two operations.
  std::atomic<bool> stop{false}, pause{false}, paused{false};
  std::thread loop([&] {
    while (!stop.load()) {
      if (pause.load()) {
        paused = true;
        while (pause.load() && !stop.load()) std::this_thread::yield();
        paused = false;
        continue;
      }
      const std::uint64_t got = b->acquire(4096, std::chrono::milliseconds(1), true);
      b->release(got);
    }
  });
  auto quiet = [&] {  // b between two operations, and an answer to one of its asks finished
    pause = true;
    while (!paused.load()) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
  };

  for (int ops = 0; !in.empty() && ops < 64; ++ops) {
    switch (in.byte() % 8) {
      case 0: {  // bytes written into the file, anywhere inside it
        const std::uint32_t off = in.u16() % full_size;
        std::uint8_t buf[16];
        const std::size_t len = 1 + in.byte() % sizeof buf;
        for (std::size_t i = 0; i < len; ++i) buf[i] = in.byte();
        if (::pwrite(fd, buf, std::min<std::size_t>(len, full_size - off), off) < 0) __builtin_trap();
        break;
      }
      case 1:
        a->acquire(static_cast<std::uint64_t>(in.byte()) * 4096, std::chrono::milliseconds(in.byte() % 4), in.byte() & 1);
        break;
      case 2: a->release(static_cast<std::uint64_t>(in.byte()) * 4096); break;
      case 3: {  // truncated or extended (between two operations of b), or given its size back
        const std::uint32_t size = in.u16() % (full_size + 4096);
        quiet();
        if (::ftruncate(fd, size) != 0) __builtin_trap();
        pause = false;
        break;
      }
      case 4: {  // a holder stopped inside the lock for a while
        HeldLock held(path);
        const auto t0 = SteadyClock::now();
        a->acquire(4096, std::chrono::milliseconds(1), true);
        if (SteadyClock::now() - t0 > kBound) __builtin_trap();
        std::this_thread::sleep_for(std::chrono::milliseconds(in.byte() % 20));
        break;
      }
      case 5:  // read as `residency stat` does
        for (const SharedBudgetInfo& info : list_shared_budgets())
          if (info.name == name) check_line(info.error);
        break;
      case 6: {  // a third process joins and leaves
        const auto t0 = SteadyClock::now();
        auto c = join(name);
        if (SteadyClock::now() - t0 > ledger::kJoinWait + kBound) __builtin_trap();
        break;
      }
      case 7:  // a's last use set long ago, so that b may ask it (as a touch() publishes it)
        ledger::Ledger::publish_last_use(a->ledger.get(), 1);
        break;
    }
  }
  stop = true;
  loop.join();
  const auto t0 = SteadyClock::now();
  a.reset();
  b.reset();
  if (SteadyClock::now() - t0 > 2 * kBound) __builtin_trap();
  ::close(fd);
  ::unlink(path.c_str());  // a ledger found corrupt is left by its holders
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  run_one({data, size});
  return 0;
}

#else
extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t*, std::size_t) { return 0; }
#endif
