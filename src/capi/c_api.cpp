// SPDX-License-Identifier: MIT
// The C API over the C++ API (include/residency/residency.h). No exception or abort crosses
// this boundary; every enum a caller passes is checked as an integer first.
//
// A manager handle may be destroyed while it is still in use: a scope of it ending on another
// thread, a call in flight there, or the destroy called from inside a scope's synchronize callback
// (residency.h, "Destroying a manager"). So every call on a manager, and every end of one of its
// scopes, is counted in the handle's gate while it runs; residency_manager_destroy() closes the
// gate (a call that comes after is refused without touching the manager), and the last call out,
// destroy's own or another, tears the manager down. The handle's memory stays until its last scope
// struct is freed as well, so that a scope can always reach it.
#include "residency/residency.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <new>
#include <set>
#include <string>
#include <utility>

#include "core/config_keys.hpp"
#include "platform/thread_annotations.hpp"
#include "residency/backends.hpp"
#include "residency/residency.hpp"
#include "residency/text.hpp"

using namespace residency;

struct residency_config {
  Config config;
};
struct residency_backend {
  std::shared_ptr<Backend> backend;
  std::string name;
};
struct residency_scope;
struct residency_manager {
  // Reset by finish() only: once the gate is closed and no call is left in flight.
  std::unique_ptr<Manager> manager;
  // Bit 0 (kClosed): residency_manager_destroy() was called. Above it, the calls in flight, kCall
  // each. Once closed the count only falls (a call that finds it closed is not counted), so it
  // reaches 0 exactly once after the close: that call's end finishes the manager.
  std::atomic<std::uint64_t> gate{0};
  // The handle itself (until finished) and each scope struct not yet freed: the memory goes with
  // the last of them.
  std::atomic<std::size_t> refs{1};
  residency::Mutex mu;
  std::set<residency_scope*> open RESIDENCY_GUARDED_BY(mu);  // scopes whose end nobody has claimed
};
// A scope is ended by whoever takes it out of its manager's `open` set: residency_use_end, or the
// destroy (which then frees it only if residency_use_end came meanwhile).
struct residency_scope {
  residency_scope(residency_manager* m, UseScope s) : manager(m), scope(std::move(s)) {}
  residency_manager* const manager;                      // outlives the scope struct (a reference in manager->refs)
  UseScope scope;                                        // ended by the one that claimed it, without the lock
  bool ended RESIDENCY_GUARDED_BY(manager->mu) = false;  // the destroy claimed and ended it
  bool use_end_called RESIDENCY_GUARDED_BY(manager->mu) = false;  // while the destroy was ending it
};

namespace {

thread_local std::string g_last_error;

residency_status code_of(ErrorCode c) {
  switch (c) {
    case ErrorCode::ok: return RESIDENCY_OK;
    case ErrorCode::invalid_argument: return RESIDENCY_INVALID_ARGUMENT;
    case ErrorCode::limit_exceeded: return RESIDENCY_LIMIT_EXCEEDED;
    case ErrorCode::permission_denied: return RESIDENCY_PERMISSION_DENIED;
    case ErrorCode::out_of_memory: return RESIDENCY_OUT_OF_MEMORY;
    case ErrorCode::unsupported: return RESIDENCY_UNSUPPORTED;
    case ErrorCode::not_found: return RESIDENCY_NOT_FOUND;
    case ErrorCode::io_error: return RESIDENCY_IO_ERROR;
    case ErrorCode::backend_error: return RESIDENCY_BACKEND_ERROR;
    case ErrorCode::interrupted: return RESIDENCY_INTERRUPTED;
  }
  return RESIDENCY_BACKEND_ERROR;
}

residency_status fail(const Status& s) {
  g_last_error = s.message();
  return code_of(s.code());
}

residency_status ok_or(const Status& s) { return s ? RESIDENCY_OK : fail(s); }

residency_status null_arg(const char* fn, const char* arg) {
  return fail(Status(ErrorCode::invalid_argument, std::string(fn) + ": " + arg + " is NULL"));
}

template <typename F>
residency_status guarded(const char* fn, F&& f) noexcept {
  try {
    return f();
  } catch (const std::bad_alloc&) {
    return fail(Status(ErrorCode::out_of_memory, std::string(fn) + ": out of host memory"));
  } catch (const std::exception& e) {
    return fail(Status(ErrorCode::backend_error, std::string(fn) + ": " + e.what()));
  } catch (...) {
    return fail(Status(ErrorCode::backend_error, std::string(fn) + ": unknown exception"));
  }
}

// Checked as an int: an out-of-range residency_class is refused before it becomes an enum.
bool class_of(const char* fn, int cls, RegionClass* out) {
  if (cls < RESIDENCY_WEIGHTS || cls > RESIDENCY_SCRATCH) {
    fail(Status(ErrorCode::invalid_argument, std::string(fn) + ": class " + std::to_string(cls) +
                                                 " is not one of RESIDENCY_WEIGHTS (0), RESIDENCY_KV_CACHE (1), "
                                                 "RESIDENCY_SCRATCH (2)"));
    return false;
  }
  *out = static_cast<RegionClass>(cls);
  return true;
}

// A struct from a caller built against another version of the header: copy what both know.
template <typename T>
bool sized_copy(const char* fn, const T* in, T* out) {
  if (in->struct_size < sizeof(std::size_t)) {
    fail(Status(ErrorCode::invalid_argument, std::string(fn) + ": struct_size is " + std::to_string(in->struct_size) +
                                                 "; set it to sizeof the struct (use the _INIT macro)"));
    return false;
  }
  std::memcpy(out, in, std::min(in->struct_size, sizeof(T)));
  return true;
}

// A Stats member as its residency_stats field (residency/stats_fields.h: TYPE per language).
std::uint64_t to_c(std::uint64_t v) { return v; }
std::uint32_t to_c(std::uint32_t v) { return v; }
int to_c(bool v) { return v ? 1 : 0; }
std::uint64_t to_c(Nanos v) { return static_cast<std::uint64_t>(v.count()); }

LogCallback c_log(residency_log_fn log, void* user) {
  if (!log) return {};
  return [log, user](LogLevel level, std::string_view msg) {
    std::string s(msg);
    log(static_cast<residency_log_level>(level), s.c_str(), user);
  };
}

// --- the handle's gate: see the top of this file and residency.h, "Destroying a manager" ------

constexpr std::uint64_t kClosed = 1;
constexpr std::uint64_t kCall = 2;

void finish(residency_manager* m) noexcept;

void drop_ref(residency_manager* m) noexcept {
  if (m->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete m;
}

// The scope struct goes, and with it its reference to the handle.
void free_scope(residency_scope* s) noexcept {
  residency_manager* m = s->manager;
  delete s;  // its UseScope was ended already, or is ended now (a call holds the manager)
  drop_ref(m);
}

// One call on a manager, counted while it runs. False when the manager is being destroyed: then
// nothing is counted, and the manager must not be touched (the handle's memory only while a scope
// struct keeps it).
class Call {
 public:
  explicit Call(residency_manager* m) noexcept : m_(m) {
    std::uint64_t g = m->gate.load(std::memory_order_relaxed);
    do {
      if (g & kClosed) {
        m_ = nullptr;
        return;
      }
    } while (!m->gate.compare_exchange_weak(g, g + kCall, std::memory_order_acquire, std::memory_order_relaxed));
  }
  // A call counted already (the destroy counts itself in the step that closes the gate).
  static Call adopt(residency_manager* m) noexcept { return Call(m, 0); }
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;
  Call(Call&& o) noexcept : m_(std::exchange(o.m_, nullptr)) {}
  ~Call() { leave(); }
  explicit operator bool() const noexcept { return m_ != nullptr; }
  // The last call out of a closed manager finishes it, on its own thread.
  void leave() noexcept {
    if (residency_manager* m = std::exchange(m_, nullptr))
      if (m->gate.fetch_sub(kCall, std::memory_order_acq_rel) == (kClosed | kCall)) finish(m);
  }

 private:
  Call(residency_manager* m, int) noexcept : m_(m) {}
  residency_manager* m_;
};

residency_status closed(const char* fn) {
  return fail(Status(ErrorCode::invalid_argument,
                     std::string(fn) +
                         ": the manager is being destroyed (residency_manager_destroy was called); no call on it "
                         "begins after that"));
}

// Ends the scopes left open (their synchronize runs here, on this thread); a scope that
// residency_use_end was called on meanwhile is freed here too. Called with a call counted, or by
// finish(): the manager is alive throughout.
void end_open_scopes(residency_manager* m, const char* fn) noexcept {
  std::set<residency_scope*> claimed;
  {
    MutexLock g(m->mu);
    claimed.swap(m->open);
  }
  if (claimed.empty()) return;
  try {
    log_to_stderr(LogLevel::warn, std::string(fn) + ": " + std::to_string(claimed.size()) +
                                      " use scope(s) still open; ending them now (residency_use_end on them only "
                                      "frees them)");
  } catch (...) {  // the warning's allocation: nothing may escape into C
  }
  for (residency_scope* s : claimed) {
    s->scope = UseScope();  // ends it: synchronize, then release
    bool free_it = false;
    {
      MutexLock g(s->manager->mu);
      s->ended = true;
      free_it = s->use_end_called;
    }
    if (free_it) free_scope(s);  // never the last reference: the handle's is held until finish() ends
  }
}

// The gate is closed and no call is left in flight: the scopes begun while the destroy ran are
// ended, then the manager goes, then the handle's own reference.
void finish(residency_manager* m) noexcept {
  end_open_scopes(m, "residency_manager_destroy");
  m->manager.reset();
  drop_ref(m);
}

residency_status create_manager(const residency_config* cfg, std::shared_ptr<Backend> backend, residency_log_fn log,
                                void* log_user, residency_manager** out) {
  ManagerOptions o;
  o.config = cfg ? cfg->config : Config{};
  o.backend = std::move(backend);
  o.log = c_log(log, log_user);
  auto m = Manager::create(std::move(o));
  if (!m) return fail(m.status());
  auto* h = new residency_manager;
  h->manager = std::move(*m);
  *out = h;
  return RESIDENCY_OK;
}

}  // namespace

extern "C" {

const char* residency_version(void) { return RESIDENCY_VERSION_STRING; }
uint32_t residency_abi_version(void) { return RESIDENCY_ABI_VERSION; }

const char* residency_last_error(void) { return g_last_error.c_str(); }

residency_config* residency_config_default(void) { return new (std::nothrow) residency_config{}; }

residency_status residency_config_from_env(residency_config** out) {
  if (!out) return null_arg("residency_config_from_env", "out");
  *out = nullptr;
  return guarded("residency_config_from_env", [&] {
    auto c = Config::from_env();
    if (!c) return fail(c.status());
    *out = new residency_config{std::move(*c)};
    return RESIDENCY_OK;
  });
}

residency_status residency_config_set(residency_config* cfg, const char* key, const char* value) {
  if (!cfg) return null_arg("residency_config_set", "cfg");
  if (!key) return null_arg("residency_config_set", "key");
  if (!value) return null_arg("residency_config_set", "value");
  return guarded("residency_config_set", [&] {
    // The key table (src/core/config_keys.cpp): the value is parsed exactly as its environment
    // variable would be, and only that key's field changes.
    const core::ConfigKey* k = core::find_config_key(key);
    if (!k)
      return fail(Status(ErrorCode::invalid_argument, "residency_config_set: unknown key '" + printable(key) +
                                                          "'; accepted: " + core::config_key_names()));
    return ok_or(k->set(cfg->config, value));
  });
}

void residency_config_free(residency_config* cfg) { delete cfg; }

residency_status residency_backend_create(const residency_backend_options* options, residency_backend** out) {
  if (!out) return null_arg("residency_backend_create", "out");
  *out = nullptr;
  residency_backend_options o = RESIDENCY_BACKEND_OPTIONS_INIT;
  if (options && !sized_copy("residency_backend_create", options, &o)) return code_of(ErrorCode::invalid_argument);
  o.struct_size = sizeof o;
  return guarded("residency_backend_create", [&] {
    const std::string kind = o.kind ? o.kind : "auto";
    // The backend-specific fields go to the registry as they are: it alone knows who takes them.
    BackendOptions bo;
    bo.cuda_device = o.cuda_device;
    bo.metal_device = o.metal_device;
    bo.metal_attach_to_queues = o.metal_attach_to_queues != 0;
    auto b = make_backend(kind, bo);
    if (!b && bo == BackendOptions{}) return fail(b.status());
    if (!b) return fail(Status(b.status().code(), "residency_backend_create: " + b.message()));
    auto* h = new residency_backend;
    h->name = (*b)->capabilities().name;
    h->backend = std::move(*b);
    *out = h;
    return RESIDENCY_OK;
  });
}

void residency_backend_release(residency_backend* backend) { delete backend; }

const char* residency_backend_name(const residency_backend* backend) { return backend ? backend->name.c_str() : ""; }

residency_status residency_backend_add_command_queue(residency_backend* backend, void* queue) {
  if (!backend) return null_arg("residency_backend_add_command_queue", "backend");
  if (!queue) return null_arg("residency_backend_add_command_queue", "queue");
  return guarded("residency_backend_add_command_queue", [&] {
    const Status st = add_command_queue(*backend->backend, queue);
    if (st || st.code() != ErrorCode::unsupported) return ok_or(st);
    return fail(Status(st.code(), "residency_backend_add_command_queue: " + st.message()));
  });
}

residency_status residency_manager_create(const residency_config* cfg, const char* backend, residency_log_fn log,
                                          void* log_user, residency_manager** out) {
  if (!out) return null_arg("residency_manager_create", "out");
  *out = nullptr;
  return guarded("residency_manager_create", [&] {
    auto b = make_backend(backend ? backend : "auto");
    if (!b) return fail(b.status());
    return create_manager(cfg, std::move(*b), log, log_user, out);
  });
}

residency_status residency_manager_create_with_backend(const residency_config* cfg, residency_backend* backend,
                                                       residency_log_fn log, void* log_user, residency_manager** out) {
  if (!out) return null_arg("residency_manager_create_with_backend", "out");
  *out = nullptr;
  if (!backend) return null_arg("residency_manager_create_with_backend", "backend");
  return guarded("residency_manager_create_with_backend",
                 [&] { return create_manager(cfg, backend->backend, log, log_user, out); });
}

void residency_manager_destroy(residency_manager* m) {
  if (!m) return;
  // Close the gate and count this call in one step: from here no call begins, and the manager goes
  // when the last one in flight (this one, or another thread's) returns.
  std::uint64_t g = m->gate.load(std::memory_order_relaxed);
  do {
    if (g & kClosed) {
      // Only reachable while the manager still exists: from a callback that runs inside a call on
      // it (a scope's synchronize), or on a thread racing the first destroy, which is deferred.
      try {
        log_to_stderr(LogLevel::warn,
                      "residency_manager_destroy: this manager is being destroyed already (destroy called again, "
                      "from a callback or another thread); ignored");
      } catch (...) {
      }
      return;
    }
  } while (!m->gate.compare_exchange_weak(g, (g + kCall) | kClosed, std::memory_order_acq_rel, std::memory_order_relaxed));
  Call self = Call::adopt(m);
  end_open_scopes(m, "residency_manager_destroy");
}

residency_status residency_register(residency_manager* m, void* base, size_t size, int cls, int priority, uint64_t* id_out) {
  return residency_register_object(m, base, size, cls, priority, nullptr, id_out);
}

residency_status residency_register_object(residency_manager* m, void* base, size_t size, int cls, int priority,
                                           void* backend_object, uint64_t* id_out) {
  if (!m) return null_arg("residency_register", "manager");
  Call call(m);
  if (!call) return closed("residency_register");
  RegionClass c;
  if (!class_of("residency_register", cls, &c)) return RESIDENCY_INVALID_ARGUMENT;
  return guarded("residency_register", [&] {
    auto id = m->manager->register_region(base, size, c, priority, backend_object);
    if (!id) return fail(id.status());
    if (id_out) *id_out = *id;
    return RESIDENCY_OK;
  });
}

residency_status residency_unregister(residency_manager* m, uint64_t id) {
  if (!m) return null_arg("residency_unregister", "manager");
  Call call(m);
  if (!call) return closed("residency_unregister");
  return guarded("residency_unregister", [&] { return ok_or(m->manager->unregister_region(id)); });
}

residency_status residency_unregister_ptr(residency_manager* m, void* base) {
  if (!m) return null_arg("residency_unregister_ptr", "manager");
  Call call(m);
  if (!call) return closed("residency_unregister_ptr");
  return guarded("residency_unregister_ptr", [&] { return ok_or(m->manager->unregister_address(base)); });
}

residency_status residency_allocate(residency_manager* m, size_t size, int cls, int priority, void** ptr_out,
                                    uint64_t* id_out) {
  if (!m) return null_arg("residency_allocate", "manager");
  Call call(m);
  if (!call) return closed("residency_allocate");
  if (!ptr_out) return null_arg("residency_allocate", "ptr_out");
  *ptr_out = nullptr;
  RegionClass c;
  if (!class_of("residency_allocate", cls, &c)) return RESIDENCY_INVALID_ARGUMENT;
  return guarded("residency_allocate", [&] {
    auto a = m->manager->allocate(size, c, priority);
    if (!a) return fail(a.status());
    *ptr_out = a->ptr;
    if (id_out) *id_out = a->id;
    return RESIDENCY_OK;
  });
}

residency_status residency_free(residency_manager* m, void* ptr) {
  if (!m) return null_arg("residency_free", "manager");
  Call call(m);
  if (!call) return closed("residency_free");
  return guarded("residency_free", [&] { return ok_or(m->manager->deallocate(ptr)); });
}

residency_status residency_set_wired_limit(residency_manager* m, uint64_t bytes) {
  if (!m) return null_arg("residency_set_wired_limit", "manager");
  Call call(m);
  if (!call) return closed("residency_set_wired_limit");
  return guarded("residency_set_wired_limit", [&] { return ok_or(m->manager->set_wired_limit(bytes)); });
}

residency_status residency_batch_begin(residency_manager* m) {
  if (!m) return null_arg("residency_batch_begin", "manager");
  Call call(m);
  if (!call) return closed("residency_batch_begin");
  return guarded("residency_batch_begin", [&] {
    m->manager->begin_batch();
    return RESIDENCY_OK;
  });
}

residency_status residency_batch_end(residency_manager* m) {
  if (!m) return null_arg("residency_batch_end", "manager");
  Call call(m);
  if (!call) return closed("residency_batch_end");
  return guarded("residency_batch_end", [&] { return ok_or(m->manager->end_batch()); });
}

void residency_touch(residency_manager* m) {
  if (!m) return;
  Call call(m);  // nothing once the manager is being destroyed
  if (call) m->manager->touch();
}

void residency_touch_region(residency_manager* m, uint64_t id) {
  if (!m) return;
  Call call(m);  // nothing once the manager is being destroyed
  if (call) m->manager->touch(id);
}

void residency_prefetch(residency_manager* m) {
  if (!m) return;
  Call call(m);  // nothing once the manager is being destroyed
  if (call) m->manager->prefetch();
}

residency_scope* residency_use_begin(residency_manager* m, void (*synchronize)(void*), void* user,
                                     residency_status* status_out) {
  residency_scope* out = nullptr;
  const residency_status st = [&]() -> residency_status {
    if (!m) return null_arg("residency_use_begin", "manager");
    Call call(m);
    if (!call) return closed("residency_use_begin");
    return guarded("residency_use_begin", [&] {
      std::function<void()> sync;
      if (synchronize) sync = [synchronize, user] { synchronize(user); };
      auto* s = new residency_scope(m, m->manager->use(std::move(sync)));  // on a throw, the scope ends
      m->refs.fetch_add(1, std::memory_order_relaxed);
      try {
        MutexLock g(m->mu);
        m->open.insert(s);
      } catch (...) {
        free_scope(s);
        throw;
      }
      out = s;
      const Status& ws = s->scope.status();
      return ws ? RESIDENCY_OK : fail(ws);  // partly wired: the scope is valid all the same
    });
  }();
  if (status_out) *status_out = st;
  return out;
}

void residency_use_end(residency_scope* s) {
  if (!s) return;
  residency_manager* m = s->manager;  // alive while s is (its reference)
  Call call(m);                       // not counted once the manager is being destroyed
  bool end_here = false, free_here = false;
  {
    MutexLock g(s->manager->mu);
    if (call && s->manager->open.erase(s) != 0) {
      end_here = true;  // ours to end: the manager stays until this call returns
    } else if (s->ended) {
      free_here = true;  // the destroy ended it: only freed here
    } else {
      // The destroy took it and is ending it now (or will, if it is about to): it frees it.
      s->use_end_called = true;
    }
  }
  if (end_here) s->scope = UseScope();  // synchronize, then (keep-alive 0) release
  call.leave();                         // may finish the manager (a destroy came meanwhile, or from the synchronize)
  if (end_here || free_here) free_scope(s);
}

void residency_notify_memory_pressure(residency_manager* m) {
  if (!m) return;
  Call call(m);  // nothing once the manager is being destroyed
  if (call) m->manager->notify_memory_pressure();
}

void residency_release_now(residency_manager* m) {
  if (!m) return;
  Call call(m);  // nothing once the manager is being destroyed
  if (call) m->manager->release_now();
}

residency_status residency_get_stats(residency_manager* m, residency_stats* out) {
  if (!m) return null_arg("residency_get_stats", "manager");
  Call call(m);
  if (!call) return closed("residency_get_stats");
  if (!out) return null_arg("residency_get_stats", "out");
  if (out->struct_size < sizeof(std::size_t))
    return fail(Status(ErrorCode::invalid_argument, "residency_get_stats: out->struct_size is " +
                                                        std::to_string(out->struct_size) +
                                                        "; set it to sizeof(residency_stats) (RESIDENCY_STATS_INIT)"));
  const Stats s = m->manager->stats();
  residency_stats full{};
  // Field by field, from the one list (residency/stats_fields.h), converted per TYPE.
#define RESIDENCY_STATS_TO_C_(TYPE, name, cpp_default) full.RESIDENCY_STATS_C_NAME_##TYPE(name) = to_c(s.name);
  RESIDENCY_STATS_FIELDS(RESIDENCY_STATS_TO_C_)
#undef RESIDENCY_STATS_TO_C_
  const std::size_t n = std::min(out->struct_size, sizeof full);
  full.struct_size = n;
  std::memcpy(out, &full, n);
  return RESIDENCY_OK;
}

}  // extern "C"
