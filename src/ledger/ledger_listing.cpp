// SPDX-License-Identifier: MIT
// The listing of the shared budgets on this machine, for `residency stat` and `residency ps`
// (residency/shared_budget.hpp): every ledger in /dev/shm, read as a copy and checked, never
// opened in a way that blocks, never mapped.
#include "residency/shared_budget.hpp"

#include "ledger_file.hpp"

#if RESIDENCY_LEDGER_LINUX

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace residency {

std::vector<SharedBudgetInfo> list_shared_budgets() {
  using namespace ledger;
  std::vector<SharedBudgetInfo> out;
  DIR* d = ::opendir(kDir);
  if (!d) return out;
  const std::string prefix = kPrefix;
  while (dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n.rfind(prefix, 0) != 0 || n.find(".tmp-") != std::string::npos) continue;
    SharedBudgetInfo info;
    info.name = n.substr(prefix.size());
    info.path = std::string(kDir) + "/" + n;
    // Anyone may make a FIFO, a socket or a link under this name: it is listed as what it is, and
    // never opened in a way that blocks (open_in_shm; an open of a FIFO without O_NONBLOCK waits
    // for a writer, forever).
    struct stat lst {};
    if (::lstat(info.path.c_str(), &lst) != 0) continue;  // gone meanwhile
    if (!S_ISREG(lst.st_mode)) {
      info.mode = lst.st_mode & 07777;
      info.error = not_a_ledger(info.path, lst.st_mode);
      out.push_back(std::move(info));
      continue;
    }
    const int fd = open_in_shm(info.path, O_RDONLY);
    if (fd < 0) continue;  // not readable by this user: not listed
    struct stat st {};
    if (::fstat(fd, &st) == 0) info.mode = st.st_mode & 07777;
    // A reader may look at a group's ledger it is not the owner of: check as a member would.
    const long group = st.st_uid != ::geteuid() ? static_cast<long>(st.st_gid) : -1;
    if (Status s = check_file(fd, info.path, group); !s) {
      info.error = s.message();
      ::close(fd);
      out.push_back(std::move(info));
      continue;
    }
    // A copy read with pread, not a mapping: another process may truncate the file meanwhile
    // (a mapping would fault), and every field is checked before it is shown.
    auto copy = std::make_unique<Shared>();
    const ssize_t got = ::pread(fd, static_cast<void*>(copy.get()), sizeof(Shared), 0);
    const int read_errno = errno;
    ::close(fd);
    const Shared* s = copy.get();
    std::string bad = got < 0 ? std::string("cannot read it: ") + std::strerror(read_errno)
                      : got != static_cast<ssize_t>(sizeof(Shared))
                          ? "it is " + std::to_string(got) + " bytes long, a ledger is " + std::to_string(sizeof(Shared))
                          : check_table(*s);
    if (!bad.empty()) {
      info.error = "the ledger " + info.path + " is corrupt: " + bad;
      out.push_back(std::move(info));
      continue;
    }
    info.size = s->budget;
    const std::int64_t now = monotonic_ns();
    for (const Slot& sl : s->slots) {
      if (!sl.occupied.load(std::memory_order_acquire)) continue;
      SharedBudgetHolder h;
      h.pid = sl.pid.load(std::memory_order_relaxed);
      h.bytes = sl.bytes.load(std::memory_order_relaxed);
      h.unmanaged = std::min<std::uint64_t>(h.bytes, std::uint64_t{sl.floor_mib.load(std::memory_order_relaxed)} << 20);
      h.priority = sl.priority.load(std::memory_order_relaxed);
      const std::int64_t lu = sl.last_use.load(std::memory_order_relaxed);
      if (lu > 0) h.idle = Nanos(std::max<std::int64_t>(0, now - lu));
      h.alive = holder_alive(h.pid, sl.start_time.load(std::memory_order_relaxed));
      const std::uint32_t ask = sl.ask.load(std::memory_order_relaxed);
      h.asked = ask != 0 && ask != kStopWord;
      h.waiting = sl.wait_ticket.load(std::memory_order_relaxed) != 0;
      h.shared_key = sl.shared_key.load(std::memory_order_relaxed);
      info.holders.push_back(h);
    }
    info.used = used_bytes(*s);  // holders of one shared key (one model file's page cache) count once
    out.push_back(std::move(info));
  }
  ::closedir(d);
  std::sort(out.begin(), out.end(), [](const SharedBudgetInfo& a, const SharedBudgetInfo& b) { return a.name < b.name; });
  return out;
}

}  // namespace residency

#endif  // RESIDENCY_LEDGER_LINUX
