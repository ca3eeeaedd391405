// SPDX-License-Identifier: MIT
// residency doctor's checks of what runs (doctor.hpp): the process or the command's program, the
// preload, and the llama.cpp it serves. Each reads the Subject and the files it names; nothing
// here changes a file or waits on one.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "doctor.hpp"
#include "residency/config.hpp"
#include "residency/text.hpp"
#include "stat_pid.hpp"

#if defined(__linux__)
#include <elf.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

#ifndef RESIDENCY_TESTED_LLAMA_TAG  // tools/residency/CMakeLists.txt, from cmake/ResidencyLlama.cmake
#define RESIDENCY_TESTED_LLAMA_TAG "v0.4.0"
#define RESIDENCY_TESTED_LLAMA_COMMIT "80fb11a"
#endif
#ifndef RESIDENCY_PRELOAD_FROM_BIN  // where the preload is installed, relative to the tool's directory
#define RESIDENCY_PRELOAD_FROM_BIN "../lib/libresidency_preload.so"
#endif

namespace residency::tool::doctor {

#if defined(__linux__)

namespace {

// "0.4.0" from libllama.so.0.4.0, the file the path resolves to (libllama.so.0 is a link to it).
std::string file_version(const std::string& path) {
  char* real = ::realpath(path.c_str(), nullptr);
  const std::string name = base_name(real != nullptr ? real : path);
  std::free(real);
  const auto so = name.find(".so.");
  return so == std::string::npos ? std::string() : name.substr(so + 4);
}

bool same_file(const std::string& a, const std::string& b) {
  struct stat sa {};
  struct stat sb {};
  return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

// "host: posix, keep-alive 30 s, resident; cuda:0: cuda, keep-alive 30 s, asleep".
std::string managers_text(const std::vector<const core::StateFileRead*>& ms) {
  std::string out;
  for (const auto* m : ms) {
    const std::string backend = state_field(*m, "backend");
    out += (out.empty() ? "" : "; ") + std::string(backend == "cuda" ? "GPU manager " : "manager ") +
           printable(state_field(*m, "manager")) + ": " + printable(backend) + ", keep-alive " +
           printable(state_field(*m, "keep_alive")) + ", " + state_word(backend, state_field(*m, "resident") == "1") +
           ", " + format_size(std::strtoull(state_field(*m, "wired_bytes").c_str(), nullptr, 10)) + " wired";
  }
  return out;
}

// Where this tool's preload is, to name in a fix: beside an installed tool (bin/ -> lib/), or in
// the build tree it was built in (tools/residency/ -> src/preload/); else the install's form.
std::string suggested_preload() {
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0) {
    self[n] = '\0';
    const std::string dir = std::string(self).substr(0, std::string(self).rfind('/'));
    for (const char* rel : {RESIDENCY_PRELOAD_FROM_BIN, "../../src/preload/libresidency_preload.so"}) {
      const std::string cand = dir + "/" + rel;
      if (char* real = ::realpath(cand.c_str(), nullptr)) {
        std::string out = real;
        std::free(real);
        return out;
      }
    }
  }
  return "PREFIX/lib/libresidency_preload.so";
}

// The LD_PRELOAD entries that name residency's preload (separated by ':' or spaces, as the loader reads them).
std::vector<std::string> preload_entries(const std::string& value) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : value + ":") {
    if (c == ':' || c == ' ' || c == '\t') {
      if (library_stem(cur) == "libresidency_preload") out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  return out;
}

// The words the lines share for a process that cannot be read.
std::string unreadable(const Subject& s) { return "unknown: " + printable(s.maps_error, 300); }

}  // namespace

// --- the process, or the command's program -------------------------------------------------------

Check check_subject(const Subject& s) {
  Check c;
  if (s.kind == Subject::Kind::here) {
    c.name = "environment";
    c.text = "no PID or command given: what a program started from this shell gets (uid " +
             std::to_string(::geteuid()) + ")";
    return c;
  }
  if (s.kind == Subject::Kind::process) {
    c.name = "process";
    c.text = "pid " + std::to_string(s.pid) + " (" + printable(s.name) + "), uid " + std::to_string(s.uid);
    c.details = {{"pid", s.pid}, {"name", printable(s.name)}, {"uid", s.uid}};
    const std::string& err = !s.maps_error.empty() ? s.maps_error : s.env_error;
    if (!err.empty()) {
      c.verdict = Verdict::fail;
      if (::geteuid() != 0 && ::geteuid() != s.uid) {
        c.text += "; this user (uid " + std::to_string(::geteuid()) + ") may not read it: " + printable(err, 300);
        c.fix = "run `residency doctor " + std::to_string(s.pid) + "` as uid " + std::to_string(s.uid) + " or as root";
      } else {  // the kernel's ptrace check: another user namespace (a container), or yama's ptrace_scope
        c.text += "; the kernel does not let this process read it: " + printable(err, 300);
        c.fix = "run `residency doctor " + std::to_string(s.pid) + "` where the process runs (in its container)";
      }
    }
    return c;
  }
  c.name = "program";
  c.details = {{"path", printable(s.program, 400)}, {"argv", nlohmann::json::array()}};
  for (const auto& a : s.argv) c.details["argv"].push_back(printable(a, 400));
  c.text = printable(s.program, 400) + ": ";
  if (!s.elf.error.empty()) {
    c.verdict = Verdict::warn;
    c.text += printable(s.elf.error, 300) + ": the llama.cpp it loads is known once it runs";
    c.fix = "run it, then `residency doctor PID`";
    return c;
  }
  c.text += s.elf.kind() + (s.elf.dynamic ? ", dynamically linked" : ", statically linked");
  c.details["elf"] = s.elf.kind();
  if (!s.elf.dynamic) {
    c.verdict = Verdict::fail;
    c.text += ": the dynamic loader never runs for it, so LD_PRELOAD has no effect";
    c.fix = "use a dynamically linked build of the program (llama.cpp: BUILD_SHARED_LIBS=ON, its default)";
    return c;
  }
  if (s.elf.set_id) {
    c.verdict = Verdict::fail;
    c.text += ", set-user-ID or set-group-ID: the loader ignores LD_PRELOAD paths for it";
    c.fix = "run a copy of the program without the set-ID bits";
    return c;
  }
  if (!s.not_found.empty()) {
    std::string names;
    for (const auto& n : s.not_found) names += (names.empty() ? "" : ", ") + printable(n);
    c.verdict = Verdict::fail;
    c.text += "; the loader does not find " + names + ": it would not start";
    c.fix = "install them, or name their directory in LD_LIBRARY_PATH";
    return c;
  }
  if (!s.loader_note.empty()) {
    c.text += " (what it loads was not asked of the loader: " + printable(s.loader_note, 300) + ")";
  } else {
    c.text += "; the loader finds every library it links";
  }
  return c;
}

// --- the preload ------------------------------------------------------------------------------

namespace {

Check preload_in_process(const Subject& s) {
  Check c;
  c.name = "preload";
  if (!s.maps_error.empty()) {
    c.verdict = Verdict::warn;
    c.text = unreadable(s);
    return c;
  }
  const std::string mapped = first_of(s.files, "libresidency_preload");
  const auto managers = live_managers(s);
  c.details = {{"loaded", !mapped.empty()},
               {"path", mapped.empty() ? nlohmann::json(nullptr) : nlohmann::json(printable(mapped, 400))},
               {"managers", managers.size()}};
  const std::string where = " (" + printable(mapped, 400) + ")";
  const std::string restart = "start it again as `LD_PRELOAD=" + suggested_preload() +
                              " PROGRAM ...` (a service: Environment=LD_PRELOAD=... in its unit); a running "
                              "process cannot load it";
  if (!mapped.empty()) {
    if (!managers.empty()) {
      c.text = "loaded" + where + " and active: " + managers_text(managers);
      return c;
    }
    c.verdict = Verdict::fail;
    const auto config = s.env_error.empty() ? Config::from_env(s.lookup()) : Result<Config>(Config{});
    std::string state_error;
    for (const auto& st : s.states)
      if (!st.error.empty()) state_error = printable(st.path, 200) + ": " + printable(st.error, 200);
    if (!config) {
      std::string names;  // each line of the message starts "NAME=..."
      std::size_t at = 0;
      for (const std::string& m = config.message(); at < m.size();) {
        const std::size_t eol = std::min(m.find('\n', at), m.size());
        const std::string line = m.substr(at, eol - at);
        if (const auto eq = line.find('='); eq != std::string::npos)
          names += (names.empty() ? "" : ", ") + printable(line.substr(0, eq));
        at = eol + 1;
      }
      c.text = "loaded" + where + " but not active: " + names +
               " has a bad value, so it runs the program without residency (the configuration line says why)";
      c.fix = "give " + names + " an accepted value, then restart the program";
    } else if (!config->state_file) {
      c.verdict = Verdict::warn;
      c.text = "loaded" + where +
               "; RESIDENCY_STATE_FILE=0: its managers publish no state, so whether they are active "
               "cannot be seen from here";
      c.fix = "its log says (the `residency[" + std::to_string(s.pid) + "]` lines on its stderr)";
    } else if (!state_error.empty()) {
      c.verdict = Verdict::warn;
      c.text = "loaded" + where + "; its state file is not read: " + state_error;
    } else if (first_of(s.files, "libllama").empty()) {
      c.text = "loaded" + where +
               " but not active: no libllama is loaded in the process (residency starts when one "
               "is; llama.cpp linked statically into the program runs without it)";
      c.fix = "use llama.cpp as shared libraries (libllama.so, libggml*.so: BUILD_SHARED_LIBS=ON)";
    } else if (std::none_of(s.files.begin(), s.files.end(),
                            [](const std::string& f) { return library_stem(f).rfind("libggml", 0) == 0; })) {
      c.text = "loaded" + where +
               " but not active: ggml is not a shared library in this program, so llama.cpp's "
               "buffers cannot be followed";
      c.fix = "build llama.cpp with ggml as shared libraries (BUILD_SHARED_LIBS=ON)";
    } else {
      c.text = "loaded" + where +
               " but not active: it has made no residency manager (no model loaded yet, or it gave "
               "up: one `residency[" +
               std::to_string(s.pid) + "]: warn:` line on the program's stderr says why)";
      c.fix = "read the program's `residency[" + std::to_string(s.pid) + "]` lines";
    }
    return c;
  }
  if (!managers.empty()) {
    c.text = "not loaded, and not needed: the program runs residency's library itself: " + managers_text(managers);
    return c;
  }
  c.verdict = Verdict::fail;
  c.fix = restart;
  if (!s.env_error.empty()) {
    c.text = "not loaded (its environment cannot be read: " + printable(s.env_error, 300) + ")";
    return c;
  }
  const char* value = s.getenv("LD_PRELOAD");
  const auto entries = preload_entries(value != nullptr ? value : "");
  if (value == nullptr) {
    c.text = "not loaded: its environment has no LD_PRELOAD";
    return c;
  }
  if (entries.empty()) {
    c.text = "not loaded: its LD_PRELOAD ('" + printable(value, 200) + "') does not name libresidency_preload.so";
    return c;
  }
  const std::string& path = entries.front();
  struct stat st {};
  if (path.find('/') == std::string::npos) {
    c.text = "not loaded: LD_PRELOAD names '" + printable(path, 200) +
             "' without a directory, and the loader found none";
    c.fix = "give its full path: " + restart;
  } else if (::stat(path.c_str(), &st) != 0) {
    c.text = "not loaded: LD_PRELOAD names " + printable(path, 400) + ", which does not exist (" +
             std::strerror(errno) + "): the loader ignored it (\"cannot be preloaded\" on the program's stderr)";
    c.fix = "point LD_PRELOAD at the installed library: " + restart;
  } else {
    c.text = "not loaded: LD_PRELOAD names " + printable(path, 400) +
             ", but the loader refused it (\"cannot be preloaded\" on the program's stderr: another architecture, "
             "or a set-user-ID program)";
    c.fix = "ask `residency doctor -- PROGRAM` with the same LD_PRELOAD why";
  }
  return c;
}

Check preload_for_command(const Subject& s) {
  Check c;
  c.name = "preload";
  const bool here = s.kind == Subject::Kind::here;
  const char* value = s.getenv("LD_PRELOAD");
  const auto entries = preload_entries(value != nullptr ? value : "");
  c.details = {{"ld_preload", value != nullptr ? nlohmann::json(printable(value, 400)) : nlohmann::json(nullptr)}};
  if (entries.empty()) {
    c.verdict = here ? Verdict::warn : Verdict::fail;
    c.text = std::string(value == nullptr
                             ? "LD_PRELOAD is not set"
                             : "LD_PRELOAD ('" + printable(value, 200) + "') does not name libresidency_preload.so") +
             (here ? ": a program started here runs without residency unless its command sets it"
                   : ": the command would run without residency");
    c.fix = "run it as `LD_PRELOAD=" + suggested_preload() + " COMMAND ...`";
    return c;
  }
  const std::string& path = entries.front();
  c.details["path"] = printable(path, 400);
  auto fail = [&](const std::string& text, const std::string& fix) {
    c.verdict = Verdict::fail;
    c.text = "LD_PRELOAD names " + printable(path, 400) + text;
    c.fix = fix;
    return c;
  };
  const std::string fix_path = "point LD_PRELOAD at the installed library (" + suggested_preload() + ")";
  for (const auto& e : s.loader_errors)
    if (e.find("cannot be preloaded") != std::string::npos && e.find(path) != std::string::npos)
      return fail(": the loader refuses it: " + printable(e, 300), fix_path);
  if (path.find('/') == std::string::npos) {
    if (!s.loader_note.empty() || here)
      return fail(" without a directory: the loader searches the library path for it", "give its full path");
  } else {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0)
      return fail(std::string(", which does not exist (") + std::strerror(errno) + ")", fix_path);
    if (::access(path.c_str(), R_OK) != 0)
      return fail(std::string(", which this user cannot read (") + std::strerror(errno) + ")",
                  "make it readable (mode 0644)");
    const ElfInfo lib = read_elf(path);
    if (!lib.error.empty())
      return fail(", which is not a shared library (" + printable(lib.error, 200) + ")", fix_path);
    if (lib.type != ET_DYN) return fail(", which is an ELF program, not a shared library", fix_path);
    if (!here && s.elf.error.empty() && (lib.is64 != s.elf.is64 || lib.machine != s.elf.machine))
      return fail(" (" + lib.kind() + "), but the program is " + s.elf.kind() + ": the loader refuses it",
                  "use a preload built for the program's machine");
    if (elf_defines(path, "residency_preload_instance") == std::optional<bool>(false)) {
      c.verdict = Verdict::warn;
      c.text = "LD_PRELOAD names " + printable(path, 400) +
               ", which is not residency's preload (it defines no "
               "residency_preload_instance)";
      c.fix = fix_path;
      return c;
    }
    c.details["elf"] = lib.kind();
  }
  if (!here && s.elf.error.empty() && !s.elf.dynamic)
    return fail(", but the program is statically linked: the loader never preloads anything into it",
                "use a dynamically linked build of the program");
  if (!here && s.loader_note.empty() && std::none_of(s.files.begin(), s.files.end(), [](const std::string& f) {
        return library_stem(f) == "libresidency_preload";
      }))
    return fail(", but the loader does not load it", fix_path);
  c.text = "LD_PRELOAD names " + printable(path, 400) +
           (here ? ": a program started here with this environment loads it" : ": the loader preloads it");
  return c;
}

}  // namespace

Check check_preload(const Subject& s) {
  return s.kind == Subject::Kind::process ? preload_in_process(s) : preload_for_command(s);
}

// --- llama.cpp -------------------------------------------------------------------------------

Check check_llama(const Subject& s) {
  Check c;
  c.name = "llama.cpp";
  const std::string libllama = first_of(s.files, "libllama");
  const std::string base = first_of(s.files, "libggml-base");
  const auto managers = live_managers(s);
  std::string engine;
  for (const auto* m : managers)
    if (engine.empty()) engine = state_field(*m, "engine");
  c.details = {{"libllama", libllama.empty() ? nlohmann::json(nullptr) : nlohmann::json(printable(libllama, 400))},
               {"engine", engine.empty() ? nlohmann::json(nullptr) : nlohmann::json(printable(engine, 400))},
               {"tested", RESIDENCY_TESTED_LLAMA_TAG " (commit " RESIDENCY_TESTED_LLAMA_COMMIT ")"}};
  if (s.kind == Subject::Kind::process && !s.maps_error.empty()) {
    c.verdict = Verdict::warn;
    c.text = unreadable(s);
    return c;
  }
  if (libllama.empty()) {
    const std::string program = s.kind == Subject::Kind::process ? "/proc/" + std::to_string(s.pid) + "/exe" : s.program;
    if (elf_defines(program, "llama_decode") == std::optional<bool>(true)) {
      c.verdict = Verdict::fail;
      c.text = "linked statically into the program: the preload cannot reach its llama_decode";
      c.fix = "use llama.cpp as shared libraries (BUILD_SHARED_LIBS=ON, its default)";
      return c;
    }
    if (s.kind == Subject::Kind::command) {
      const auto links = std::find_if(s.elf.needed.begin(), s.elf.needed.end(),
                                      [](const std::string& n) { return library_stem(n) == "libllama"; });
      c.verdict = Verdict::warn;
      if (links != s.elf.needed.end() && std::find(s.not_found.begin(), s.not_found.end(), *links) != s.not_found.end()) {
        c.verdict = Verdict::fail;
        c.text = "the program links " + printable(*links) + ", which the loader does not find";
        c.fix = "name the directory of llama.cpp's libraries in LD_LIBRARY_PATH, or install them";
      } else if (links != s.elf.needed.end()) {
        c.text = "the program links " + printable(*links) + "; where the loader finds it was not asked (" +
                 printable(s.loader_note, 200) + ")";
      } else {
        c.text =
            "the program does not link libllama: a host that loads it at run time (node-llama-cpp, Python) is "
            "served from then on";
        c.fix = "run it, then `residency doctor PID` says which llama.cpp it loaded";
      }
      return c;
    }
    if (!managers.empty()) {
      c.text = "none: not a llama.cpp program (its residency manager is the library's own)";
      return c;
    }
    c.verdict = Verdict::warn;
    c.text = "no libllama in the process: not a llama.cpp program, or one that has not loaded llama.cpp yet";
    return c;
  }
  const auto version = base.empty() ? std::nullopt : elf_returned_string(base, "ggml_version");
  const auto commit = base.empty() ? std::nullopt : elf_returned_string(base, "ggml_commit");
  const std::string lib_version = file_version(libllama);
  c.details["libllama_version"] = lib_version.empty() ? nlohmann::json(nullptr) : nlohmann::json(lib_version);
  c.details["ggml_version"] = version ? nlohmann::json(printable(*version)) : nlohmann::json(nullptr);
  c.details["ggml_commit"] = commit ? nlohmann::json(printable(*commit)) : nlohmann::json(nullptr);
  c.text = printable(libllama, 400) + (lib_version.empty() ? "" : " (" + printable(lib_version) + ")");
  if (version || commit)
    c.text += ", ggml " + printable(version.value_or("?")) + (commit ? " commit " + printable(*commit) : "");
  else c.text += ", its version unknown";
  // The commit strings are abbreviated to 7 or more characters: one is a prefix of the other.
  const std::string tested = RESIDENCY_TESTED_LLAMA_COMMIT;
  const bool same_commit = commit && commit->size() >= 7 &&
                           (commit->rfind(tested, 0) == 0 || tested.rfind(*commit, 0) == 0);
  if (commit && !same_commit) {
    c.verdict = Verdict::warn;
    c.text += "; not the llama.cpp residency is tested with (" RESIDENCY_TESTED_LLAMA_TAG ", commit " + tested +
              "): other versions are untested";
    c.fix = "if the model is not held, try llama.cpp " RESIDENCY_TESTED_LLAMA_TAG " (scripts/llama-cpp builds it)";
  } else if (same_commit) {
    c.text += ", the version residency is tested with";
  }
  if (s.kind == Subject::Kind::process) {
    bool served = false;
    for (const auto& f : s.files)
      if (library_stem(f) == "libllama" && !engine.empty() && same_file(f, engine)) served = true;
    c.details["served"] = served;
    if (served) c.text += "; the preload serves it";
    else if (!engine.empty()) {
      c.verdict = Verdict::warn;
      c.text += "; the preload serves another libllama, " + printable(engine, 400);
    } else if (!managers.empty() && !first_of(s.files, "libresidency_preload").empty()) {
      c.text += "; the preload does not say which libllama it serves (a preload older than this tool)";
    } else {
      c.verdict = Verdict::warn;
      c.text += "; not served (the preload line says why)";
    }
  }
  return c;
}

#endif  // __linux__ (elsewhere doctor is refused: doctor.cpp)

}  // namespace residency::tool::doctor
