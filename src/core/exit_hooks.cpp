// SPDX-License-Identifier: MIT
#include "exit_hooks.hpp"

#include <cstdlib>
#include <map>
#include <mutex>

namespace residency::core {

namespace {
std::mutex& hooks_mu() {
  static auto* m = new std::mutex;
  return *m;
}
std::map<void*, void (*)(void*)>& hooks() {
  static auto* h = new std::map<void*, void (*)(void*)>;
  return *h;
}
void run_exit_hooks() {
  std::lock_guard<std::mutex> g(hooks_mu());
  for (auto& [key, fn] : hooks()) fn(key);
}
}  // namespace

void add_exit_hook(void* key, void (*fn)(void*)) {
  static std::once_flag registered;
  std::call_once(registered, [] { std::atexit(run_exit_hooks); });
  std::lock_guard<std::mutex> g(hooks_mu());
  hooks()[key] = fn;
}

void remove_exit_hook(void* key) {
  std::lock_guard<std::mutex> g(hooks_mu());
  hooks().erase(key);
}

}  // namespace residency::core
