// SPDX-License-Identifier: MIT
// The table of configuration keys (config_keys.hpp) and Config::from_env, which reads it.
#include "core/config_keys.hpp"

#include <cmath>
#include <cstdlib>

#include "residency/text.hpp"

namespace residency::core {

void EnvReader::fail(const char* name, const Status& st) {
  errors_ += (errors_.empty() ? "" : "\n") + std::string(name) + "=" + st.message();
}

namespace {

template <auto Field>
void copy_field(Config& to, const Config& from) {
  to.*Field = from.*Field;
}

// A key whose value is one parser's result, stored in its field as it is.
template <auto Field, auto Parse>
void read_parsed(const ConfigKey& key, EnvReader& env, Config& c) {
  if (const char* v = env.get(key.variable)) {
    auto r = Parse(v);
    if (r) c.*Field = *r;
    else env.fail(key.variable, r.status());
  }
}

// A key that is a flag; `Forms` is its "accepted:" text.
template <auto Field, const char* Forms>
void read_flag(const ConfigKey& key, EnvReader& env, Config& c) {
  if (const char* v = env.get(key.variable)) {
    auto f = parse_flag(v, Forms);
    if (f) c.*Field = *f;
    else env.fail(key.variable, f.status());
  }
}

constexpr char kReleaseOnPressureForms[] = "0 or 1";
constexpr char kStateFileForms[] = "1 (publish this process's state for `residency stat --pid`, the default) or 0";
constexpr char kLogTimeForms[] = "0 or 1 (1: each log line carries the local time)";
constexpr char kEngineMemoryForms[] = "1 (hold the engine's working memory with the model, the default) or 0";

// Keep-alive: ours wins over the aliases; each alias is parsed strictly.
void read_keep_alive(const ConfigKey& key, EnvReader& env, Config& c) {
  const char* ka = env.get(key.variable);
  const char* ggml_ka = env.get("GGML_METAL_RESIDENCY_KEEP_ALIVE_S");
  const char* ggml_off = env.get("GGML_METAL_NO_RESIDENCY");
  if (ka) {
    auto v = parse_keep_alive(ka);
    if (v) c.keep_alive = *v;
    else env.fail(key.variable, v.status());
    if (ggml_ka) c.notes.push_back("GGML_METAL_RESIDENCY_KEEP_ALIVE_S is ignored: RESIDENCY_KEEP_ALIVE is set");
    if (ggml_off) c.notes.push_back("GGML_METAL_NO_RESIDENCY is ignored: RESIDENCY_KEEP_ALIVE is set");
    return;
  }
  bool off = false;
  if (ggml_off) {
    auto v = parse_flag(*ggml_off ? ggml_off : "1",
                        "set (empty, 1, true, yes, on) to turn residency off; 0, false, no, off to keep it");
    if (!v) {
      env.fail("GGML_METAL_NO_RESIDENCY", v.status());
    } else if (*v) {
      off = true;
      c.keep_alive = KeepAlive::off();
      c.notes.push_back("GGML_METAL_NO_RESIDENCY is set: keep_alive = off (alias of RESIDENCY_KEEP_ALIVE=off)");
    }
  }
  if (ggml_ka && !off) {
    // llama.cpp reads whole seconds with atoi; we accept a number of seconds, strictly.
    constexpr const char* forms = "a number of seconds (0 = release after each use, negative = forever)";
    if (!parse_number(ggml_ka)) {
      env.fail("GGML_METAL_RESIDENCY_KEEP_ALIVE_S", bad_value(ggml_ka, "not a number of seconds", forms));
    } else if (auto v = parse_keep_alive_as(ggml_ka, forms)) {
      c.keep_alive = *v;
      c.notes.push_back("GGML_METAL_RESIDENCY_KEEP_ALIVE_S=" + printable(ggml_ka) + " read as RESIDENCY_KEEP_ALIVE=" +
                        v->to_string() + " (unlike llama.cpp, 0 means 0 and text is an error)");
    } else {
      env.fail("GGML_METAL_RESIDENCY_KEEP_ALIVE_S", v.status());
    }
  } else if (ggml_ka) {
    c.notes.push_back("GGML_METAL_RESIDENCY_KEEP_ALIVE_S is ignored: GGML_METAL_NO_RESIDENCY is set");
  }
}

void read_set_max_pct(const ConfigKey& key, EnvReader& env, Config& c) {
  const char* pct = env.get(key.variable);
  const char* mlx_pct = env.get("MLX_RESIDENCY_SET_MAX_PCT");
  if (!pct && !mlx_pct) return;
  auto n = parse_number(pct ? pct : mlx_pct);
  if (n) c.set_max_pct = *n;
  else env.fail(pct ? key.variable : "MLX_RESIDENCY_SET_MAX_PCT", n.status());
  if (pct && mlx_pct) c.notes.push_back("MLX_RESIDENCY_SET_MAX_PCT is ignored: RESIDENCY_SET_MAX_PCT is set");
  else if (!pct && n) c.notes.push_back("MLX_RESIDENCY_SET_MAX_PCT read as RESIDENCY_SET_MAX_PCT");
}

void read_pressure_quiet(const ConfigKey& key, EnvReader& env, Config& c) {
  const char* v = env.get(key.variable);
  if (!v) return;
  constexpr const char* forms = "a duration above 0 with unit (10s, 2m), or a bare number of seconds";
  auto k = parse_keep_alive_as(v, forms);
  if (k && k->expires()) c.pressure_quiet = k->duration;
  else env.fail(key.variable, k ? bad_value(v, "not a duration above 0", forms) : k.status());
}

void read_shared_priority(const ConfigKey& key, EnvReader& env, Config& c) {
  const char* v = env.get(key.variable);
  if (!v) return;
  auto n = parse_number(v);
  if (n && *n == std::floor(*n) && *n >= -1000 && *n <= 1000) {
    c.shared_priority = static_cast<int>(*n);
  } else {
    env.fail(key.variable, bad_value(v, "not an integer from -1000 to 1000",
                                     "an integer from -1000 to 1000; default 0, higher keeps its share longer"));
  }
}

void read_budget_wait(const ConfigKey& key, EnvReader& env, Config& c) {
  const char* v = env.get(key.variable);
  if (!v) return;
  constexpr const char* forms = "a duration above 0 with unit (30s, the default; 2m), or `over`";
  if (std::string_view(v) == "over") {
    c.budget_wait.reset();
    return;
  }
  auto k = parse_keep_alive_as(v, forms);
  if (k && k->expires()) c.budget_wait = k->duration;
  else env.fail(key.variable, k ? bad_value(v, "neither `over` nor a duration above 0", forms) : k.status());
}

// As RESIDENCY_SHARED_BUDGET, with a name short enough for NAME.GPU-UUID to fit the ledger's name.
void read_gpu_budget(const ConfigKey& key, EnvReader& env, Config& c) {
  const char* v = env.get(key.variable);
  if (!v) return;
  auto b = parse_budget(v, kGpuBudgetNameMax, "each GPU's memory");
  if (b) c.gpu_budget = *b;
  else env.fail(key.variable, b.status());
}

void read_log(const ConfigKey& key, EnvReader& env, Config& c) {
  const char* log = env.get(key.variable);
  const char* mlx_debug = env.get("MLX_RESIDENCY_DEBUG");
  if (log) {
    auto l = parse_log_level(log);
    if (l) c.log_level = *l;
    else env.fail(key.variable, l.status());
    if (mlx_debug) c.notes.push_back("MLX_RESIDENCY_DEBUG is ignored: RESIDENCY_LOG is set");
  } else if (mlx_debug) {
    auto f = parse_flag(mlx_debug, "1 (debug log) or 0");
    if (!f) {
      env.fail("MLX_RESIDENCY_DEBUG", f.status());
    } else if (*f) {
      c.log_level = LogLevel::debug;
      c.notes.push_back("MLX_RESIDENCY_DEBUG=1 read as RESIDENCY_LOG=debug");
    }
  }
}

// The keys, in the order they are read (and their errors and notes listed). The aliases named
// here are the ones each reader reads; meaning and values are the README's table, as it shows them.
constexpr ConfigKey kKeys[] = {
    {"keep_alive",
     "RESIDENCY_KEEP_ALIVE",
     {"GGML_METAL_RESIDENCY_KEEP_ALIVE_S", "GGML_METAL_NO_RESIDENCY"},
     "policy",
     "a number with a unit `ns` `us` `ms` `s` `m` `h`, a space allowed before it (`500ms`, `180s` (default), `5 s`, "
     "`3m`); units combined largest first, each once (`1h30m`); bare number = seconds; `0` (only inside use scopes); "
     "`forever` or negative; `off`",
     read_keep_alive,
     copy_field<&Config::keep_alive>},
    {"wired_limit",
     "RESIDENCY_WIRED_LIMIT",
     {},
     "budget",
     "bytes with unit (`8GiB`, `512MB`) or `75%` of the recommended working set; `0` or `0%`: nothing is wired",
     read_parsed<&Config::wired_limit, parse_wired_limit>,
     copy_field<&Config::wired_limit>},
    {"set_max_pct",
     "RESIDENCY_SET_MAX_PCT",
     {"MLX_RESIDENCY_SET_MAX_PCT"},
     "sharded set cap",
     "number, default 5; `<=0` or `>=100` = one set",
     read_set_max_pct,
     copy_field<&Config::set_max_pct>},
    {"layout",
     "RESIDENCY_LAYOUT",
     {},
     "set layout",
     "`sharded` (default, MLX) or `per_buffer` (llama.cpp)",
     read_parsed<&Config::layout, parse_layout>,
     copy_field<&Config::layout>},
    {"release_on_pressure",
     "RESIDENCY_RELEASE_ON_PRESSURE",
     {},
     "give memory back gradually under memory pressure (Linux: PSI, or `memory.pressure_level` in a cgroup v1 memory "
     "cgroup)",
     "`0`/`1`",
     read_flag<&Config::release_on_pressure, kReleaseOnPressureForms>,
     copy_field<&Config::release_on_pressure>},
    {"pressure_floor",
     "RESIDENCY_PRESSURE_FLOOR",
     {},
     "what pressure never takes",
     "bytes or a percent of the wired limit; default 0",
     read_parsed<&Config::pressure_floor, parse_wired_limit>,
     copy_field<&Config::pressure_floor>},
    {"pressure_quiet",
     "RESIDENCY_PRESSURE_QUIET",
     {},
     "how long pressure must be quiet before the budget comes back",
     "duration, default `30s`",
     read_pressure_quiet,
     copy_field<&Config::pressure_quiet>},
    {"shared_budget",
     "RESIDENCY_SHARED_BUDGET",
     {},
     "a wired budget shared with every process naming it (Linux)",
     "`NAME:SIZE` or `NAME:SIZE:GROUP`: NAME of letters, digits, `.` `_` `-` (up to 64), SIZE bytes with unit or a "
     "percent of RAM (`llm:48GiB`, `llm:60%`), GROUP: the ledger is mode 0660 for that group instead of 0600 for its "
     "user",
     read_parsed<&Config::shared_budget, parse_shared_budget>,
     copy_field<&Config::shared_budget>},
    {"shared_priority",
     "RESIDENCY_SHARED_PRIORITY",
     {},
     "who gives back first when the shared budget is full",
     "integer -1000..1000, default 0; a holder is only asked by one of equal or higher priority",
     read_shared_priority,
     copy_field<&Config::shared_priority>},
    {"budget_wait",
     "RESIDENCY_BUDGET_WAIT",
     {},
     "device memory (a GPU budget) that does not fit once the idle holders were asked: a duration waits for room, "
     "in order of arrival across the processes, that long at most, then refuses it (the decode fails with the "
     "reason); `over` wakes it over the budget, a debt repaid as the calls end",
     "a duration above 0 (default `30s`) or `over`",
     read_budget_wait,
     copy_field<&Config::budget_wait>},
    {"state_file",
     "RESIDENCY_STATE_FILE",
     {},
     "publish this process's state for `residency stat --pid` (a 0600 file in `/dev/shm`, Linux)",
     "`1` (default) or `0`",
     read_flag<&Config::state_file, kStateFileForms>,
     copy_field<&Config::state_file>},
    {"log",
     "RESIDENCY_LOG",
     {"MLX_RESIDENCY_DEBUG"},
     "log level",
     "`error`, `warn`, `info` (default), `debug`",
     read_log,
     copy_field<&Config::log_level>},
    {"log_time",
     "RESIDENCY_LOG_TIME",
     {},
     "each log line carries the local time after the pid",
     "`0` (default) or `1`",
     read_flag<&Config::log_time, kLogTimeForms>,
     copy_field<&Config::log_time>},
    // No C API key: a device manager of the C API names its budget as shared_budget.
    {nullptr,
     "RESIDENCY_GPU_BUDGET",
     {},
     "the preloads only (CUDA builds): one budget per GPU shared by the processes naming it (llama.cpp and other "
     "CUDA programs); a wake that "
     "does not fit first asks the idlest holder to sleep",
     "`NAME:SIZE` or `NAME:SIZE:GROUP` as `RESIDENCY_SHARED_BUDGET`, NAME up to 31 characters, SIZE bytes or a "
     "percent of each GPU's memory; the ledger of a GPU is `NAME.GPU-UUID`",
     read_gpu_budget,
     copy_field<&Config::gpu_budget>},
    {"host_budget",
     "RESIDENCY_HOST_BUDGET",
     {},
     "the host tier (CUDA): the model files GPUs keep registered for fast wakes (pinned page cache the kernel "
     "cannot evict) count against this RAM budget, shared by the processes naming it; beyond it the least "
     "recently used model gives its registration back and wakes from the file through a staging buffer",
     "`off`, SIZE or a percent of RAM (ledger `host`), or `NAME:SIZE[:GROUP]` as `RESIDENCY_SHARED_BUDGET`; "
     "default: `RESIDENCY_SHARED_BUDGET`'s ledger if set, else `host:50%`",
     read_parsed<&Config::host_budget, parse_host_budget>,
     copy_field<&Config::host_budget>},
    // No C API key: only the preload has an engine whose memory it can tell.
    {nullptr,
     "RESIDENCY_ENGINE_MEMORY",
     {},
     "the preload only: hold the engine's working memory with the model (its libraries' data, the stacks of live "
     "threads its calls ran on, what it mapped or grew of the heap inside its calls; never the program's own memory)",
     "`1` (default) or `0`",
     read_flag<&Config::engine_memory, kEngineMemoryForms>,
     copy_field<&Config::engine_memory>},
    // No C API key: the C API's backends are made by residency_backend_create, with their own options.
    {nullptr,
     "RESIDENCY_CUDA_BACKUP",
     {},
     "the preload only (CUDA builds): when the pinned host backup of GPU weights is made",
     "`after-allocation` (the default unless the keep-alive is `forever`) or `at-first-sleep`",
     read_parsed<&Config::cuda_backup, parse_cuda_backup>,
     copy_field<&Config::cuda_backup>},
};

}  // namespace

bool ConfigKey::set_in(const Config::EnvLookup& env) const {
  const EnvReader r(env);
  if (r.get(variable)) return true;
  for (const char* alias : aliases)
    if (alias && r.get(alias)) return true;
  return false;
}

Status ConfigKey::set(Config& config, const char* value) const {
  const std::string var = variable;
  const Config::EnvLookup only_this = [&](const char* n) { return var == n ? value : nullptr; };
  EnvReader env(only_this);
  Config parsed;
  read(*this, env, parsed);
  if (!env.errors().empty()) return Status(ErrorCode::invalid_argument, env.errors());
  merge(config, parsed);
  return Status();
}

std::span<const ConfigKey> config_keys() { return kKeys; }

const ConfigKey* find_config_key(std::string_view name) {
  for (const ConfigKey& k : kKeys)
    if (k.name && name == k.name) return &k;
  return nullptr;
}

std::string config_key_names() {
  std::string out;
  for (const ConfigKey& k : kKeys)
    if (k.name) out += (out.empty() ? "" : ", ") + std::string(k.name);
  return out;
}

bool config_key_set(std::string_view name, const Config::EnvLookup& env) {
  const ConfigKey* k = find_config_key(name);
  return k && k->set_in(env);
}

}  // namespace residency::core

namespace residency {

Result<Config> Config::from_env() {
  return from_env([](const char* name) { return std::getenv(name); });
}

Result<Config> Config::from_env(const EnvLookup& getenv) {
  Config c;
  core::EnvReader env(getenv);
  for (const core::ConfigKey& key : core::config_keys()) key.read(key, env, c);
  if (!env.errors().empty()) return Status(ErrorCode::invalid_argument, env.errors());
  return c;
}

}  // namespace residency
