// SPDX-License-Identifier: MIT
// Lock rules the compiler checks: thin macros over clang's thread-safety attributes (as abseil's
// absl/base/thread_annotations.h does), and a mutex that carries them.
//
// A member a mutex guards says so (RESIDENCY_GUARDED_BY(mu_)), a method that needs the lock held
// says so (RESIDENCY_REQUIRES(mu_)), and clang's -Wthread-safety turns a broken rule into a
// compile error (.ci/run builds with it). std::mutex is not annotated in libstdc++, so the guarded
// code locks a residency::Mutex through a MutexLock. Elsewhere (GCC) the macros are empty and
// Mutex is std::mutex's cost exactly. This is the floor below the ledger and the core.
#pragma once

#include <condition_variable>
#include <mutex>

#if defined(__clang__)
#define RESIDENCY_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define RESIDENCY_THREAD_ANNOTATION(x)
#endif

#define RESIDENCY_CAPABILITY(x) RESIDENCY_THREAD_ANNOTATION(capability(x))
#define RESIDENCY_SCOPED_CAPABILITY RESIDENCY_THREAD_ANNOTATION(scoped_lockable)
#define RESIDENCY_GUARDED_BY(x) RESIDENCY_THREAD_ANNOTATION(guarded_by(x))
#define RESIDENCY_PT_GUARDED_BY(x) RESIDENCY_THREAD_ANNOTATION(pt_guarded_by(x))
#define RESIDENCY_ACQUIRED_BEFORE(...) RESIDENCY_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
#define RESIDENCY_ACQUIRED_AFTER(...) RESIDENCY_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
#define RESIDENCY_REQUIRES(...) RESIDENCY_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define RESIDENCY_EXCLUDES(...) RESIDENCY_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define RESIDENCY_ACQUIRE(...) RESIDENCY_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RESIDENCY_RELEASE(...) RESIDENCY_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define RESIDENCY_TRY_ACQUIRE(...) RESIDENCY_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define RESIDENCY_ASSERT_HELD(x) RESIDENCY_THREAD_ANNOTATION(assert_capability(x))
#define RESIDENCY_RETURN_CAPABILITY(x) RESIDENCY_THREAD_ANNOTATION(lock_returned(x))
// For the few functions whose locking the analysis cannot follow; each use says why.
#define RESIDENCY_NO_THREAD_SAFETY_ANALYSIS RESIDENCY_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace residency {

// std::mutex with the capability attribute. constexpr-constructible (constinit globals).
class RESIDENCY_CAPABILITY("mutex") Mutex {
 public:
  constexpr Mutex() noexcept = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void lock() RESIDENCY_ACQUIRE() { mu_.lock(); }
  void unlock() RESIDENCY_RELEASE() { mu_.unlock(); }
  bool try_lock() RESIDENCY_TRY_ACQUIRE(true) { return mu_.try_lock(); }
  // Tells the analysis the caller holds it (a callback documented to run under the lock).
  void assert_held() const RESIDENCY_ASSERT_HELD(this) {}
  // For std::condition_variable: wait through MutexLock::wait, which keeps the annotations true.
  std::mutex& native() noexcept { return mu_; }

 private:
  std::mutex mu_;
};

// std::lock_guard / std::unique_lock for Mutex: held from construction to destruction, unless
// unlock() was called (then lock() again before it is read).
class RESIDENCY_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) RESIDENCY_ACQUIRE(mu) : lock_(mu.native()) {}
  // Takes over `mu`, which the caller holds already (a try_lock() that succeeded).
  MutexLock(Mutex& mu, std::adopt_lock_t) RESIDENCY_REQUIRES(mu) : lock_(mu.native(), std::adopt_lock) {}
  ~MutexLock() RESIDENCY_RELEASE() {}
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  void lock() RESIDENCY_ACQUIRE() { lock_.lock(); }
  void unlock() RESIDENCY_RELEASE() { lock_.unlock(); }
  // Condition variables: the lock is released while waiting and held again on return, so to the
  // analysis it is held throughout.
  void wait(std::condition_variable& cv) { cv.wait(lock_); }
  template <class Pred>
  void wait(std::condition_variable& cv, Pred pred) {
    cv.wait(lock_, pred);
  }
  template <class Deadline, class Pred>
  bool wait_until(std::condition_variable& cv, const Deadline& deadline, Pred pred) {
    return cv.wait_until(lock_, deadline, pred);
  }
  template <class Duration, class Pred>
  bool wait_for(std::condition_variable& cv, const Duration& d, Pred pred) {
    return cv.wait_for(lock_, d, pred);
  }
  std::unique_lock<std::mutex>& native() noexcept { return lock_; }

 private:
  std::unique_lock<std::mutex> lock_;
};

}  // namespace residency
