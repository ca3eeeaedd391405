// SPDX-License-Identifier: MIT
// WorkerPool (see worker_pool.hpp).
#include "workload/worker_pool.hpp"

#include <algorithm>

namespace residency::workload {

WorkerPool::WorkerPool(unsigned threads) {
  size_ = threads ? threads : std::max(1u, std::thread::hardware_concurrency());
  threads_.reserve(size_ - 1);
  for (unsigned i = 1; i < size_; ++i) threads_.emplace_back([this, i] { loop(i); });
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> g(m_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void WorkerPool::run(const std::function<void(unsigned)>& task) {
  {
    std::lock_guard<std::mutex> g(m_);
    task_ = &task;
    pending_ = size_ - 1;
    ++generation_;
  }
  start_cv_.notify_all();
  task(0);
  std::unique_lock<std::mutex> lock(m_);
  done_cv_.wait(lock, [this] { return pending_ == 0; });
  task_ = nullptr;
}

void WorkerPool::loop(unsigned index) {
  std::uint64_t seen = 0;
  for (;;) {
    const std::function<void(unsigned)>* task = nullptr;
    {
      std::unique_lock<std::mutex> lock(m_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      task = task_;
    }
    (*task)(index);
    std::lock_guard<std::mutex> g(m_);
    if (--pending_ == 0) done_cv_.notify_one();
  }
}

}  // namespace residency::workload
