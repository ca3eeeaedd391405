// SPDX-License-Identifier: MIT
// A fixed set of threads that run one task together and wait for the next.
//
// The decode pass runs once per benchmark iteration and must not pay for creating threads each
// time (a real engine keeps its threads too), so the threads live as long as the pool and sleep on
// a condition variable between tasks: an idle pool costs no CPU, which matters in a benchmark
// whose subject is what idle costs.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace residency::workload {

class WorkerPool {
 public:
  // `threads` in total, the caller of run() included; 0 = std::thread::hardware_concurrency().
  explicit WorkerPool(unsigned threads = 0);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  unsigned size() const { return size_; }
  // Runs task(i) for i in [0, size()) on the pool's threads (i = 0 on the caller's thread) and
  // returns when every one has returned. One run() at a time (callers serialise).
  void run(const std::function<void(unsigned)>& task);

 private:
  void loop(unsigned index);

  unsigned size_ = 1;
  std::mutex m_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  // Guarded by m_: the task of the current generation, how many workers are still in it.
  const std::function<void(unsigned)>* task_ = nullptr;
  std::uint64_t generation_ = 0;
  unsigned pending_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace residency::workload
