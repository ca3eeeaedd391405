// The C API over the C++ manager. No exception or abort crosses this boundary.
#include "residency/residency.h"

#include <new>
#include <string>

#include "residency/backends.hpp"
#include "residency/residency.hpp"

using namespace residency;

struct residency_config {
  Config config;
};
struct residency_manager {
  std::unique_ptr<Manager> manager;
};
struct residency_scope {
  UseScope scope;
};

namespace {

thread_local std::string g_last_error;

residency_status fail(const Status& s) {
  g_last_error = s.message();
  switch (s.code()) {
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
  }
}

}  // namespace

extern "C" {

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
    const std::string k = key;
    static const char* names[][2] = {{"keep_alive", "RESIDENCY_KEEP_ALIVE"},
                                     {"wired_limit", "RESIDENCY_WIRED_LIMIT"},
                                     {"set_max_pct", "RESIDENCY_SET_MAX_PCT"},
                                     {"layout", "RESIDENCY_LAYOUT"},
                                     {"release_on_pressure", "RESIDENCY_RELEASE_ON_PRESSURE"},
                                     {"log", "RESIDENCY_LOG"}};
    const char* var = nullptr;
    for (auto& n : names)
      if (k == n[0]) var = n[1];
    if (!var)
      return fail(Status(ErrorCode::invalid_argument,
                         "residency_config_set: unknown key '" + k +
                             "'; accepted: keep_alive, wired_limit, set_max_pct, layout, release_on_pressure, log"));
    // Parse exactly as the environment variable would be, then merge that one field.
    auto c = Config::from_env([&](const char* name) { return std::string(name) == var ? value : nullptr; });
    if (!c) return fail(c.status());
    if (k == "keep_alive") cfg->config.keep_alive = c->keep_alive;
    else if (k == "wired_limit") cfg->config.wired_limit = c->wired_limit;
    else if (k == "set_max_pct") cfg->config.set_max_pct = c->set_max_pct;
    else if (k == "layout") cfg->config.layout = c->layout;
    else if (k == "release_on_pressure") cfg->config.release_on_pressure = c->release_on_pressure;
    else cfg->config.log_level = c->log_level;
    return RESIDENCY_OK;
  });
}

void residency_config_free(residency_config* cfg) { delete cfg; }

residency_status residency_manager_create(const residency_config* cfg, const char* backend,
                                          residency_log_fn log, void* log_user,
                                          residency_manager** out) {
  if (!out) return null_arg("residency_manager_create", "out");
  *out = nullptr;
  return guarded("residency_manager_create", [&] {
    auto b = make_backend(backend ? backend : "auto");
    if (!b) return fail(b.status());
    ManagerOptions o;
    o.config = cfg ? cfg->config : Config{};
    o.backend = std::move(*b);
    if (log) {
      o.log = [log, log_user](LogLevel level, std::string_view msg) {
        std::string s(msg);
        log(static_cast<residency_log_level>(level), s.c_str(), log_user);
      };
    }
    auto m = Manager::create(std::move(o));
    if (!m) return fail(m.status());
    *out = new residency_manager{std::move(*m)};
    return RESIDENCY_OK;
  });
}

void residency_manager_destroy(residency_manager* m) { delete m; }

residency_status residency_register(residency_manager* m, void* base, size_t size,
                                    residency_class cls, int priority, uint64_t* id_out) {
  if (!m) return null_arg("residency_register", "manager");
  if (cls < RESIDENCY_WEIGHTS || cls > RESIDENCY_SCRATCH)
    return fail(Status(ErrorCode::invalid_argument, "residency_register: unknown class; accepted: RESIDENCY_WEIGHTS, RESIDENCY_KV_CACHE, RESIDENCY_SCRATCH"));
  return guarded("residency_register", [&] {
    auto id = m->manager->register_region(base, size, static_cast<RegionClass>(cls), priority);
    if (!id) return fail(id.status());
    if (id_out) *id_out = *id;
    return RESIDENCY_OK;
  });
}

residency_status residency_allocate(residency_manager* m, size_t size, residency_class cls,
                                    int priority, void** ptr_out, uint64_t* id_out) {
  if (!m) return null_arg("residency_allocate", "manager");
  if (!ptr_out) return null_arg("residency_allocate", "ptr_out");
  if (cls < RESIDENCY_WEIGHTS || cls > RESIDENCY_SCRATCH)
    return fail(Status(ErrorCode::invalid_argument, "residency_allocate: unknown class"));
  return guarded("residency_allocate", [&] {
    auto a = m->manager->allocate(size, static_cast<RegionClass>(cls), priority);
    if (!a) return fail(a.status());
    *ptr_out = a->ptr;
    if (id_out) *id_out = a->id;
    return RESIDENCY_OK;
  });
}

residency_status residency_unregister(residency_manager* m, uint64_t id) {
  if (!m) return null_arg("residency_unregister", "manager");
  return guarded("residency_unregister", [&] {
    Status s = m->manager->unregister_region(id);
    return s ? RESIDENCY_OK : fail(s);
  });
}

residency_status residency_set_wired_limit(residency_manager* m, uint64_t bytes) {
  if (!m) return null_arg("residency_set_wired_limit", "manager");
  return guarded("residency_set_wired_limit", [&] {
    Status s = m->manager->set_wired_limit(bytes);
    return s ? RESIDENCY_OK : fail(s);
  });
}

void residency_touch(residency_manager* m) {
  if (m) m->manager->touch();
}

residency_status residency_use_begin(residency_manager* m, void (*synchronize)(void*), void* user,
                                     residency_scope** out) {
  if (!m) return null_arg("residency_use_begin", "manager");
  if (!out) return null_arg("residency_use_begin", "out");
  *out = nullptr;
  return guarded("residency_use_begin", [&] {
    std::function<void()> sync;
    if (synchronize) sync = [synchronize, user] { synchronize(user); };
    *out = new residency_scope{m->manager->use(std::move(sync))};
    const Status& st = (*out)->scope.status();
    return st ? RESIDENCY_OK : fail(st);
  });
}

void residency_use_end(residency_scope* scope) { delete scope; }

void residency_notify_memory_pressure(residency_manager* m) {
  if (m) m->manager->notify_memory_pressure();
}

void residency_release_now(residency_manager* m) {
  if (m) m->manager->release_now();
}

residency_status residency_get_stats(residency_manager* m, residency_stats* out) {
  if (!m) return null_arg("residency_get_stats", "manager");
  if (!out) return null_arg("residency_get_stats", "out");
  const Stats s = m->manager->stats();
  *out = residency_stats{s.tracked_bytes, s.admitted_bytes, s.wired_bytes, s.pending_bytes, s.wired_limit,
                         s.regions, s.sets, s.resident ? 1 : 0, s.commits, s.residency_requests,
                         s.releases, s.rewires, static_cast<uint64_t>(s.rewire_time.count()),
                         s.scheduler_wakeups, s.wire_failures};
  return RESIDENCY_OK;
}

}  // extern "C"
