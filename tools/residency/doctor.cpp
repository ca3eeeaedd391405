// SPDX-License-Identifier: MIT
// residency doctor [PID | -- COMMAND [ARGS...]] [--json]: is residency working for that process,
// or would it for that command, and if not, the first thing to fix (doctor.hpp has the why).
//
// One line per check (doctor_engine.cpp, doctor_environment.cpp), `ok`, `warn` or `FAIL` with the
// fix, then the first thing to fix (or that there is none) last. Exit status: 0 when no check
// FAILs, 1 when one does, 2 for bad input: a PID that is not one or names no process, a command
// that names no program.
//
// A command is not run. Its program's ELF headers are read (elf_file.hpp); what the dynamic loader
// would load, LD_PRELOAD included, is listed by the system's loader in its trace mode
// (LD_TRACE_LOADED_OBJECTS=1, what ldd does), which maps the libraries and exits before any code
// of theirs runs. The loader is the one the program names (PT_INTERP) and is run only when it is
// a root-owned file no other user may write: a program naming its own interpreter would otherwise
// choose what doctor runs.
#include "doctor.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "command.hpp"
#include "json_text.hpp"
#include "platform/proc_stat.hpp"
#include "residency/text.hpp"
#include "stat_pid.hpp"

#if defined(__linux__)
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;
#endif

namespace residency::tool {
namespace doctor {

std::string base_name(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

std::string library_stem(const std::string& path) {
  const std::string name = base_name(path);
  const auto so = name.find(".so");
  return so == std::string::npos ? name : name.substr(0, so);
}

std::string first_of(const std::vector<std::string>& files, const std::string& stem) {
  for (const auto& f : files)
    if (library_stem(f) == stem) return f;
  return {};
}

std::vector<const core::StateFileRead*> live_managers(const Subject& s) {
  std::vector<const core::StateFileRead*> out;
  for (const auto& st : s.states)
    if (st.error.empty() && !st.stale) out.push_back(&st);
  return out;
}

std::string state_field(const core::StateFileRead& s, const char* key) {
  const auto it = s.fields.find(key);
  return it == s.fields.end() ? std::string() : it->second;
}

}  // namespace doctor

namespace {

using doctor::Check;
using doctor::Subject;
using doctor::Verdict;

#if defined(__linux__)

constexpr const char* kAccepted =
    "accepted: a process id (1 to 4194304), -- COMMAND [ARGS...] (the command is not run), or nothing";
constexpr unsigned long kPidMax = 4194304;  // PID_MAX_LIMIT on 64-bit Linux, as `stat --pid` takes

// How long the loader may take to list a program's libraries, and how much of its output is read.
constexpr int kLoaderTimeoutMs = 10'000;
constexpr std::size_t kMaxLoaderOutput = 1 << 20;
// The most of /proc/PID/environ and /proc/PID/maps that is read.
constexpr std::size_t kMaxProcFile = 16 << 20;

// The whole of a /proc file, or the errno of the open or read that failed.
int read_proc_file(const std::string& path, std::string& out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno;
  char buf[65536];
  int err = 0;
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) err = errno;
    if (n <= 0 || out.size() > kMaxProcFile) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return err;
}

void add_file(Subject& s, const std::string& path) {
  if (std::find(s.files.begin(), s.files.end(), path) == s.files.end()) s.files.push_back(path);
}

int parse_pid(const std::string& word) {
  const std::string what = "PID '" + printable(word) + "': ";
  if (word.empty() || word.find_first_not_of("0123456789") != std::string::npos)
    throw BadInput("'" + printable(word) + "' is not a process id; " + kAccepted + " (a command goes after --)");
  const auto first = word.find_first_not_of('0');  // leading zeros count for nothing
  const std::string digits = first == std::string::npos ? std::string("0") : word.substr(first);
  if (digits.size() > 7 || std::stoul(digits) > kPidMax) throw BadInput(what + "too large; " + kAccepted);
  if (digits == "0") throw BadInput(what + "too small; " + kAccepted);
  return static_cast<int>(std::stoul(digits));
}

Subject process_subject(int pid) {
  Subject s;
  s.kind = Subject::Kind::process;
  s.pid = pid;
  const auto brief = proc_brief(pid);
  const auto stat = platform::read_proc_stat(pid);
  if (!brief || !stat)
    throw BadInput("PID " + std::to_string(pid) + ": no such process (/proc/" + std::to_string(pid) +
                   " does not exist); give the pid of a running process, or -- COMMAND [ARGS...]");
  if (stat->gone())
    throw BadInput("PID " + std::to_string(pid) + ": the process has ended (a zombie its parent has not reaped); " +
                   "give the pid of a running process, or -- COMMAND [ARGS...]");
  s.start_time = stat->start_time;
  s.name = brief->name;
  s.uid = brief->uid;
  const std::string proc = "/proc/" + std::to_string(pid);
  std::string text;
  if (const int err = read_proc_file(proc + "/environ", text); err != 0) {
    s.env_error = proc + "/environ: " + std::strerror(err);
  } else {
    std::istringstream in(text);
    for (std::string entry; std::getline(in, entry, '\0');)
      if (const auto eq = entry.find('='); eq != std::string::npos && eq > 0)
        s.env.emplace(entry.substr(0, eq), entry.substr(eq + 1));  // the first of a name, as getenv finds it
  }
  text.clear();
  if (const int err = read_proc_file(proc + "/maps", text); err != 0) {
    s.maps_error = proc + "/maps: " + std::strerror(err);
  } else {
    // "start-end perms offset dev inode   /path" (" (deleted)" after a replaced file).
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) {
      const auto slash = line.find('/');
      if (slash == std::string::npos) continue;
      std::string path = line.substr(slash);
      constexpr const char* kDeleted = " (deleted)";
      if (path.size() > std::strlen(kDeleted) &&
          path.compare(path.size() - std::strlen(kDeleted), std::string::npos, kDeleted) == 0)
        path.resize(path.size() - std::strlen(kDeleted));
      add_file(s, path);
    }
  }
  s.states = core::read_state_files(pid, s.uid, s.start_time);
  return s;
}

// The file COMMAND names, as execvp finds it: a name with a slash as it is, else the first
// executable regular file of that name in PATH (/bin:/usr/bin when PATH is unset).
std::string find_program(const std::string& command) {
  const std::string what = "-- '" + printable(command, 200) + "': ";
  auto usable = [](const std::string& p, std::string& why) {
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0) why = std::strerror(errno);
    else if (!S_ISREG(st.st_mode)) why = S_ISDIR(st.st_mode) ? "a directory" : "not a regular file";
    else if (::access(p.c_str(), X_OK) != 0) why = std::string("not executable: ") + std::strerror(errno);
    else return true;
    return false;
  };
  std::string why;
  if (command.empty()) throw BadInput(std::string("-- '': an empty command; ") + kAccepted);
  if (command.find('/') != std::string::npos) {
    if (!usable(command, why)) throw BadInput(what + why + "; " + kAccepted);
    return command;
  }
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path != nullptr ? path : "/bin:/usr/bin");
  for (std::string d; std::getline(dirs, d, ':');) {
    const std::string cand = (d.empty() ? std::string(".") : d) + "/" + command;
    if (usable(cand, why)) return cand;
  }
  throw BadInput(what + "no such program in PATH; give its path, or a name PATH finds; " + kAccepted);
}

// The command's stdout and stderr together, or nullopt if it could not start; killed after
// kLoaderTimeoutMs. `status`: its wait status.
std::optional<std::string> run_captured(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                                        int& status) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return std::nullopt;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 2);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  std::vector<char*> a, e;
  for (const auto& x : argv) a.push_back(const_cast<char*>(x.c_str()));
  a.push_back(nullptr);
  for (const auto& x : env) e.push_back(const_cast<char*>(x.c_str()));
  e.push_back(nullptr);
  pid_t child = 0;
  const int rc = posix_spawn(&child, a[0], &fa, nullptr, a.data(), e.data());
  posix_spawn_file_actions_destroy(&fa);
  ::close(fds[1]);
  if (rc != 0) {
    ::close(fds[0]);
    return std::nullopt;
  }
  bool timed_out = false;
  const std::string out = read_child_output(fds[0], std::chrono::milliseconds(kLoaderTimeoutMs), kMaxLoaderOutput,
                                            timed_out);
  ::close(fds[0]);
  if (timed_out) ::kill(child, SIGKILL);
  while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  if (timed_out) return std::nullopt;
  return out;
}

// ".../bin/../lib/libllama.so.0" (a RUNPATH of $ORIGIN/../lib) as ".../lib/libllama.so.0".
std::string normal(const std::string& path) { return std::filesystem::path(path).lexically_normal().string(); }

// What the dynamic loader would load for the command, in its trace mode, with this environment.
void trace_loader(Subject& s) {
  if (!s.elf.error.empty()) {
    s.loader_note = "the program is " + s.elf.error;
    return;
  }
  if (!s.elf.dynamic || s.elf.interp.empty()) {
    s.loader_note = "the program names no dynamic loader";
    return;
  }
  struct stat st {};
  if (::stat(s.elf.interp.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != 0 || (st.st_mode & 022) != 0) {
    s.loader_note = "its loader " + s.elf.interp +
                    " is not a root-owned file that only root may change, so it is not run";
    return;
  }
  std::vector<std::string> env = {"LD_TRACE_LOADED_OBJECTS=1"};
  for (char** e = environ; *e != nullptr; ++e)
    if (std::strncmp(*e, "LD_TRACE_LOADED_OBJECTS=", 24) != 0) env.emplace_back(*e);
  int status = 0;
  const auto out = run_captured({s.elf.interp, s.program}, env, status);
  if (!out) {
    s.loader_note = "the loader " + s.elf.interp + " did not answer within 10 s";
    return;
  }
  // "\tlibllama.so.0 => /path/libllama.so.0 (0x...)", "\t/path/lib.so (0x...)", "\tlibx.so => not found",
  // "ERROR: ld.so: object 'X' from LD_PRELOAD cannot be preloaded (...): ignored."
  std::istringstream in(*out);
  bool listed = false;
  for (std::string line; std::getline(in, line);) {
    const auto start = line.find_first_not_of(" \t");
    if (start == std::string::npos) continue;
    line = line.substr(start);
    if (const auto arrow = line.find(" => "); arrow != std::string::npos) {
      listed = true;
      const std::string rest = line.substr(arrow + 4);
      if (rest.rfind("not found", 0) == 0) s.not_found.push_back(line.substr(0, arrow));
      else if (rest[0] == '/') add_file(s, normal(rest.substr(0, rest.rfind(" ("))));
    } else if (line[0] == '/' && line.find(" (0x") != std::string::npos) {
      listed = true;
      add_file(s, normal(line.substr(0, line.rfind(" ("))));
    } else if (line.find("(0x") == std::string::npos) {
      s.loader_errors.push_back(line);  // the loader's own words: an object it cannot preload, an error
    }
  }
  if (!listed) {
    s.loader_note = "the loader listed nothing" +
                    (s.loader_errors.empty() ? std::string() : " (" + s.loader_errors.front() + ")");
    if (WIFEXITED(status) && WEXITSTATUS(status) != 0)
      s.loader_note += ", exit status " + std::to_string(WEXITSTATUS(status));
  }
}

Subject command_subject(const std::vector<std::string>& argv) {
  Subject s;
  s.kind = Subject::Kind::command;
  s.argv = argv;
  s.program = find_program(argv.front());
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    if (const auto eq = entry.find('='); eq != std::string::npos && eq > 0)
      s.env.emplace(entry.substr(0, eq), entry.substr(eq + 1));
  }
  s.elf = read_elf(s.program);
  trace_loader(s);
  return s;
}

Subject here_subject() {
  Subject s;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    if (const auto eq = entry.find('='); eq != std::string::npos && eq > 0)
      s.env.emplace(entry.substr(0, eq), entry.substr(eq + 1));
  }
  return s;
}

const char* verdict_word(Verdict v) { return v == Verdict::ok ? "ok" : v == Verdict::warn ? "warn" : "FAIL"; }
const char* verdict_json(Verdict v) { return v == Verdict::ok ? "ok" : v == Verdict::warn ? "warn" : "fail"; }

int run_doctor(const std::vector<std::string>& words, bool after_dashes, bool json) {
  Subject s;
  if (after_dashes) {
    if (words.empty()) throw BadInput(std::string("-- needs a COMMAND after it; ") + kAccepted);
    s = command_subject(words);
  } else if (words.size() > 1) {
    throw BadInput("one PID at most ('" + printable(words[0]) + "' and '" + printable(words[1]) + "' given); " +
                   kAccepted + " (a command goes after --)");
  } else if (words.size() == 1) {
    s = process_subject(parse_pid(words[0]));
  } else {
    s = here_subject();
  }
  std::vector<Check> checks;
  checks.push_back(doctor::check_subject(s));
  checks.push_back(doctor::check_preload(s));
  if (s.kind != Subject::Kind::here) checks.push_back(doctor::check_llama(s));
  checks.push_back(doctor::check_configuration(s));
  checks.push_back(doctor::check_memlock(s));
  checks.push_back(doctor::check_budgets(s));
  checks.push_back(doctor::check_gpus(s));
  checks.push_back(doctor::check_state_directory(s));
  // What was read of a process that ended (or whose pid was reused) meanwhile is not about it.
  if (const auto now = s.kind == Subject::Kind::process ? platform::read_proc_stat(s.pid) : std::nullopt;
      s.kind == Subject::Kind::process && (!now || now->gone() || now->start_time != s.start_time))
    throw BadInput("PID " + std::to_string(s.pid) +
                   ": the process ended while doctor looked at it; run doctor again while it runs");

  const auto first_fail = std::find_if(checks.begin(), checks.end(),
                                       [](const Check& c) { return c.verdict == Verdict::fail; });
  const auto warnings = std::count_if(checks.begin(), checks.end(),
                                      [](const Check& c) { return c.verdict == Verdict::warn; });
  const int code = first_fail != checks.end() ? kExitFailure : kExitOk;
  const std::string last = first_fail != checks.end() ? "first to fix: " + first_fail->name + ": " +
                                                            (first_fail->fix.empty() ? first_fail->text : first_fail->fix)
                           : warnings > 0 ? "nothing to fix (" + std::to_string(warnings) + " warning(s) above)"
                                          : "all is well";
  if (json) {
    nlohmann::json j;
    nlohmann::json subject = {{"kind", s.kind == Subject::Kind::process   ? "process"
                                       : s.kind == Subject::Kind::command ? "command"
                                                                          : "here"}};
    if (s.kind == Subject::Kind::process) subject["pid"] = s.pid;
    if (s.kind == Subject::Kind::command) subject["program"] = printable(s.program, 400);
    j["subject"] = subject;
    nlohmann::json a = nlohmann::json::array();
    for (const auto& c : checks)
      a.push_back({{"check", c.name},
                   {"verdict", verdict_json(c.verdict)},
                   {"text", c.text},
                   {"fix", c.fix.empty() ? nlohmann::json(nullptr) : nlohmann::json(c.fix)},
                   {"details", c.details}});
    j["checks"] = a;
    j["verdict"] = first_fail != checks.end() ? "fail" : warnings > 0 ? "warn" : "ok";
    j["first_to_fix"] = first_fail == checks.end()
                            ? nlohmann::json(nullptr)
                            : nlohmann::json({{"check", first_fail->name},
                                              {"fix", first_fail->fix.empty() ? first_fail->text : first_fail->fix}});
    j["summary"] = last;
    std::printf("%s\n", json_text(j).c_str());
    return code;
  }
  std::size_t width = 0;
  for (const auto& c : checks) width = std::max(width, c.name.size());
  for (const auto& c : checks)
    std::printf("%-4s  %-*s  %s%s\n", verdict_word(c.verdict), static_cast<int>(width), c.name.c_str(), c.text.c_str(),
                c.fix.empty() || c.verdict == Verdict::ok ? "" : ("; fix: " + c.fix).c_str());
  std::printf("%s\n", last.c_str());
  return code;
}

#else

int run_doctor(const std::vector<std::string>&, bool, bool) { throw BadInput("doctor reads /proc: Linux only"); }

#endif

const Command doctor_command{
    "doctor",
    "is residency working for a process (PID), or would it for a command (-- COMMAND ...): one line per check, "
    "the first thing to fix last",
    [](CLI::App& app) {
      auto json = std::make_shared<bool>(false);
      auto words = std::make_shared<std::vector<std::string>>();
      app.add_flag("--json", *json, "print the same as JSON");
      app.add_option("TARGET", *words,
                     "a process id; or -- then a command and its arguments, which is not run: its program, the "
                     "libraries the loader would load (LD_PRELOAD included), its -m model and this environment are "
                     "checked; nothing: this environment and limits");
      app.footer("Exit status: 0 when no check FAILs, 1 when one does, 2 for bad input.");
      return [json, words, &app] {
        // CLI11 keeps the "--" it saw among the remaining arguments: the words are a command then.
        const auto rest = app.remaining();
        const bool after_dashes = std::find(rest.begin(), rest.end(), "--") != rest.end();
        return run_doctor(*words, after_dashes, *json);
      };
    }};

}  // namespace
}  // namespace residency::tool
