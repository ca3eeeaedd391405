// SPDX-License-Identifier: MIT
// The C API over the C++ API (include/residency/residency.h). No exception or abort crosses
// this boundary; every enum a caller passes is checked as an integer first.
#include "residency/residency.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <new>
#include <set>
#include <string>

#include "core/config_keys.hpp"
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
  std::unique_ptr<Manager> manager;
  std::mutex scopes_mu;  // guards scopes and every scope's `manager` field
  std::set<residency_scope*> scopes;
};
struct residency_scope {
  UseScope scope;
  residency_manager* manager = nullptr;  // nullptr once detached (its manager was destroyed)
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
  return guarded("residency_manager_create_with_backend", [&] {
    return create_manager(cfg, backend->backend, log, log_user, out);
  });
}

void residency_manager_destroy(residency_manager* m) {
  if (!m) return;
  try {
    std::set<residency_scope*> open;
    {
      std::lock_guard<std::mutex> g(m->scopes_mu);
      open.swap(m->scopes);
      for (residency_scope* s : open) s->manager = nullptr;
    }
    if (!open.empty()) {
      log_to_stderr(LogLevel::warn, "residency_manager_destroy: " + std::to_string(open.size()) +
                                        " use scope(s) still open; ending them now (residency_use_end on them only frees them)");
      for (residency_scope* s : open) s->scope = UseScope();  // ends it: synchronize, then release
    }
    delete m;
  } catch (...) {
    // Nothing may escape into C; what could throw here is only a log callback's allocation.
  }
}

residency_status residency_register(residency_manager* m, void* base, size_t size, int cls, int priority,
                                    uint64_t* id_out) {
  return residency_register_object(m, base, size, cls, priority, nullptr, id_out);
}

residency_status residency_register_object(residency_manager* m, void* base, size_t size, int cls, int priority,
                                           void* backend_object, uint64_t* id_out) {
  if (!m) return null_arg("residency_register", "manager");
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
  return guarded("residency_unregister", [&] { return ok_or(m->manager->unregister_region(id)); });
}

residency_status residency_unregister_ptr(residency_manager* m, void* base) {
  if (!m) return null_arg("residency_unregister_ptr", "manager");
  return guarded("residency_unregister_ptr", [&] { return ok_or(m->manager->unregister_address(base)); });
}

residency_status residency_allocate(residency_manager* m, size_t size, int cls, int priority, void** ptr_out,
                                    uint64_t* id_out) {
  if (!m) return null_arg("residency_allocate", "manager");
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
  return guarded("residency_free", [&] { return ok_or(m->manager->deallocate(ptr)); });
}

residency_status residency_set_wired_limit(residency_manager* m, uint64_t bytes) {
  if (!m) return null_arg("residency_set_wired_limit", "manager");
  return guarded("residency_set_wired_limit", [&] { return ok_or(m->manager->set_wired_limit(bytes)); });
}

residency_status residency_batch_begin(residency_manager* m) {
  if (!m) return null_arg("residency_batch_begin", "manager");
  return guarded("residency_batch_begin", [&] {
    m->manager->begin_batch();
    return RESIDENCY_OK;
  });
}

residency_status residency_batch_end(residency_manager* m) {
  if (!m) return null_arg("residency_batch_end", "manager");
  return guarded("residency_batch_end", [&] { return ok_or(m->manager->end_batch()); });
}

void residency_touch(residency_manager* m) {
  if (m) m->manager->touch();
}

void residency_touch_region(residency_manager* m, uint64_t id) {
  if (m) m->manager->touch(id);
}

void residency_prefetch(residency_manager* m) {
  if (m) m->manager->prefetch();
}

residency_scope* residency_use_begin(residency_manager* m, void (*synchronize)(void*), void* user,
                                     residency_status* status_out) {
  residency_scope* out = nullptr;
  const residency_status st = [&]() -> residency_status {
    if (!m) return null_arg("residency_use_begin", "manager");
    return guarded("residency_use_begin", [&] {
      std::function<void()> sync;
      if (synchronize) sync = [synchronize, user] { synchronize(user); };
      auto* s = new residency_scope{m->manager->use(std::move(sync)), m};
      {
        std::lock_guard<std::mutex> g(m->scopes_mu);
        m->scopes.insert(s);
      }
      out = s;
      const Status& ws = s->scope.status();
      return ws ? RESIDENCY_OK : fail(ws);  // partly wired: the scope is valid all the same
    });
  }();
  if (status_out) *status_out = st;
  return out;
}

void residency_use_end(residency_scope* scope) {
  if (!scope) return;
  try {
    if (residency_manager* m = scope->manager) {
      {
        std::lock_guard<std::mutex> g(m->scopes_mu);
        m->scopes.erase(scope);
      }
      scope->scope = UseScope();  // synchronize, then (keep-alive 0) release
    }
  } catch (...) {
  }
  delete scope;
}

void residency_notify_memory_pressure(residency_manager* m) {
  if (m) m->manager->notify_memory_pressure();
}

void residency_release_now(residency_manager* m) {
  if (m) m->manager->release_now();
}

residency_status residency_get_stats(residency_manager* m, residency_stats* out) {
  if (!m) return null_arg("residency_get_stats", "manager");
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
