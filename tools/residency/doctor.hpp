// SPDX-License-Identifier: MIT
// residency doctor (doctor.cpp, doctor_engine.cpp, doctor_environment.cpp): is residency working
// for this process, or for this command about to run, and if not, what is the first thing to fix.
//
// Why a command of its own: the answers are spread over the process's memory map, its
// environment, its limits, the preload's state files, the ledgers in /dev/shm and the GPU driver,
// and each failure (a preload that did not load, a typo in a variable, an 8 MiB memlock limit)
// looks the same from outside: the model is not held. Each check reads one source, says ok, warn
// or FAIL in one line with the fix, and never changes anything or waits on what another user left
// in /dev/shm (the ledgers are listed without their lock; every file is opened O_NONBLOCK).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/state_file.hpp"
#include "elf_file.hpp"
#include "residency/config.hpp"

namespace residency::tool::doctor {

// What is examined.
struct Subject {
  enum class Kind { here, process, command };
  Kind kind = Kind::here;  // here: what a process started from this shell gets (no PID, no command)

  // A process (`residency doctor PID`).
  int pid = 0;
  std::string name;  // /proc/PID/status Name
  unsigned uid = 0;
  std::optional<std::uint64_t> start_time;
  std::string maps_error;                   // /proc/PID/maps unreadable (another user's process): why
  std::vector<core::StateFileRead> states;  // its managers' state files

  // A command (`residency doctor -- COMMAND [ARGS...]`): not run; its program is read and the
  // dynamic loader lists what it would load (doctor.cpp says when it may run the loader).
  std::vector<std::string> argv;
  std::string program;                     // the file COMMAND names, found as the shell would (PATH)
  ElfInfo elf;                             // the program's ELF headers (elf.error: a script, or no ELF file)
  std::vector<std::string> not_found;      // libraries the loader did not find
  std::vector<std::string> loader_errors;  // the loader's own lines ("... cannot be preloaded ...")
  std::string loader_note;                 // why the loader was not asked (empty: it was)

  // Both: the environment (the process's as it started, /proc/PID/environ; else this one's), and
  // the files it maps (a process) or the loader would map (a command), in order, each once.
  std::map<std::string, std::string> env;
  std::string env_error;  // unreadable: why
  std::vector<std::string> files;

  const char* getenv(const char* variable) const {
    const auto it = env.find(variable);
    return it == env.end() ? nullptr : it->second.c_str();
  }
  Config::EnvLookup lookup() const {  // for Config::from_env: the subject's environment
    return [this](const char* variable) { return getenv(variable); };
  }
};

enum class Verdict { ok, warn, fail };

struct Check {
  std::string name;  // "preload", "llama.cpp", "memlock", ...
  Verdict verdict = Verdict::ok;
  std::string text;  // what was found, one line (values from other users through printable())
  std::string fix;   // what to do about it; empty when nothing
  nlohmann::json details = nlohmann::json::object();  // --json only: the raw values
};

// The checks, in the order they are printed; the first FAIL among them is the first thing to fix
// (a process that cannot be read, then the preload, then what it serves and needs).
Check check_subject(const Subject& s);
Check check_preload(const Subject& s);
Check check_llama(const Subject& s);
Check check_configuration(const Subject& s);
Check check_memlock(const Subject& s);
Check check_budgets(const Subject& s);
Check check_gpus(const Subject& s);
Check check_state_directory(const Subject& s);

// What the checks share (doctor.cpp).
std::string base_name(const std::string& path);
// A file name's part that names the library: "libllama.so.0.4.0" -> "libllama".
std::string library_stem(const std::string& path);
// The first of `files` whose library_stem is `stem`; "" when none.
std::string first_of(const std::vector<std::string>& files, const std::string& stem);
// The subject's state files that were read and are its own (not stale): its running managers.
std::vector<const core::StateFileRead*> live_managers(const Subject& s);
// A state file's field, "" when it has none.
std::string state_field(const core::StateFileRead& s, const char* key);

}  // namespace residency::tool::doctor
