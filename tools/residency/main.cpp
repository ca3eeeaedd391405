// SPDX-License-Identifier: MIT
// residency: the command-line tool. Subcommands register themselves (command.hpp).
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "command.hpp"
#include "residency/residency.h"
#include "residency/text.hpp"
#if defined(RESIDENCY_HAVE_WORKLOAD)
#include "workload/cleanup.hpp"
#endif

namespace residency::tool {
namespace {
struct Entry {
  std::string name, help;
  Command::Setup setup;
};
std::vector<Entry>& registry() {
  static std::vector<Entry> r;
  return r;
}
}  // namespace

Command::Command(std::string name, std::string help, Setup setup) {
  registry().push_back({std::move(name), std::move(help), std::move(setup)});
}

namespace {
// What an option's value is, in its help (CLI11 names them by C++ type: TEXT, UINT): by the
// option's name, the same word everywhere. A name not here keeps CLI11's word, and the tool's
// test (no TEXT in any help) names it.
void name_placeholders(CLI::App& sub) {
  static const std::map<std::string, std::string> kWhat = {{"pid", "PID"},
                                                           {"keep-alive", "DURATION"},
                                                           {"wired-limit", "SIZE|N%"},
                                                           {"size", "SIZE"},
                                                           {"model-size", "SIZE"},
                                                           {"iters", "N"},
                                                           {"rounds", "N"},
                                                           {"threads", "N"},
                                                           {"seed", "N"},
                                                           {"pauses", "MS,..."},
                                                           {"out", "DIR"},
                                                           {"llama-dir", "DIR"},
                                                           {"preload", "FILE"},
                                                           {"engine", "FILE"},
                                                           {"backend", "NAME"},
                                                           {"policies", "NAME,..."},
                                                           {"configs", "NAME,..."},
                                                           {"pressure", "PRESSURE"},
                                                           {"profile", "NAME"},
                                                           {"type", "TYPE"},
                                                           {"FILE", "FILE"},
                                                           {"TARGET", "PID|-- COMMAND"},
                                                           {"MODEL", "GGUF"},
                                                           {"OUT", "FILE"}};
  for (CLI::Option* o : sub.get_options()) {
    if (o->get_type_size() == 0) continue;  // a flag: no value
    const auto& longs = o->get_lnames();
    const auto it = kWhat.find(longs.empty() ? o->get_name() : longs.front());
    if (it != kWhat.end()) o->type_name(it->second);
  }
}
}  // namespace
}  // namespace residency::tool

namespace {
// CLI11's messages in the tool's voice: ours start in lower case ("unknown command 'x'"), CLI11's
// with a capital ("The following argument was not expected: --x", "A subcommand is required",
// "--iters: At Most 1 required but received 2"). A first word in capitals (FILE, OUT) is a
// placeholder's name and stays as it is.
std::string cli11_voice(std::string m) {
  if (const auto at = m.find("At Most "); at != std::string::npos) m.replace(at, 8, "at most ");
  if (m.size() > 1 && std::isupper(static_cast<unsigned char>(m[0])) && std::islower(static_cast<unsigned char>(m[1])))
    m[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(m[0])));
  return m;
}

// stdout was written whole (see output_ok below): 0, else one message and 1.
int output_ok_plain() {
  errno = 0;
  if (std::fflush(stdout) == 0 && !std::ferror(stdout)) return residency::tool::kExitOk;
  std::fprintf(stderr, "residency: error: %s\n", residency::tool::output_error_text(errno).c_str());
  return residency::tool::kExitFailure;
}
}  // namespace

int main(int argc, char** argv) {
  using namespace residency::tool;
  // A closed stdout (`| head` that has exited) is a write error, not death by SIGPIPE: dying
  // skips the destructors, which unlock, leave a shared budget's ledger and remove temporary
  // files. Every subcommand then ends through output_ok below (exit 1, one message) or stops at
  // its next write (idle). The cleanup handlers ignore only the SIGPIPE of our own write; one
  // sent with kill still ends the process (after removing idle's files).
#if defined(RESIDENCY_HAVE_WORKLOAD)
  residency::workload::CleanupRegistry::install_signal_handlers();
#else
  std::signal(SIGPIPE, SIG_IGN);  // no child processes without the workload library
#endif
  // Into a file or a pipe, what a command prints is written once, at the end (output_ok's flush),
  // so that a failure (a full disk, a closed pipe) is found there with its errno. With stdio's own
  // 4 KiB buffer a longer output (stat --json with many processes) failed mid-print, and by the end
  // the errno was gone: "the reason is unknown". The commands that print as they go (idle,
  // llama-idle, hold) flush each line themselves.
  if (::isatty(STDOUT_FILENO) == 0) {
    static char whole_output[1 << 20];
    (void)std::setvbuf(stdout, whole_output, _IOFBF, sizeof whole_output);
  }
  CLI::App app{"residency: keep model memory resident while requests flow, and measure what idle costs"};
  app.name("residency");
  app.require_subcommand(1);
  // CLI11's own words in the tool's: lower case, and "command" as in `residency help COMMAND`.
  // The subcommands take the help flag's description from here.
  app.set_help_flag("-h,--help", "print this help and exit");
  app.add_flag("-V,--version")->description("print the version and exit");  // answered before parsing (below)
  app.get_formatter()->label("SUBCOMMAND", "COMMAND");
  app.get_formatter()->label("Excludes", "not with");
  std::map<CLI::App*, std::function<int()>> runners;
  auto& entries = registry();
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.name < b.name; });
  auto command_names = [&entries] {  // for the messages that list what is accepted
    std::string names;
    for (const auto& e : entries) names += (names.empty() ? "" : ", ") + e.name;
    return names;
  };
  for (auto& e : entries) {
    CLI::App* sub = app.add_subcommand(e.name, e.help);
    sub->group("Commands");
    runners[sub] = e.setup(*sub);
    name_placeholders(*sub);
  }
  app.footer(
      "residency help COMMAND, or residency COMMAND --help: one command's options. residency --version: the version.");
  if (argc < 2) {  // no subcommand: say what there is
    std::fputs(app.help().c_str(), stderr);
    return kExitBadInput;
  }
  const std::string first = argv[1];
  if (first == "--version" || first == "-V") {
    std::printf("residency %s\n", residency_version());
    return output_ok_plain();
  }
  if (first == "help") {  // residency help [COMMAND]
    if (argc == 2) {
      std::fputs(app.help().c_str(), stdout);
      return output_ok_plain();
    }
    const auto e = std::find_if(entries.begin(), entries.end(), [&](const Entry& x) { return x.name == argv[2]; });
    if (argc > 3 || e == entries.end()) {
      const std::string names = command_names();
      std::fprintf(stderr, "residency help: %s; accepted: one of %s, or nothing\n",
                   argc > 3 ? "one command at most" : ("unknown command '" + residency::printable(argv[2]) + "'").c_str(),
                   names.c_str());
      return kExitBadInput;
    }
    std::fputs(app.get_subcommand(e->name)->help("residency").c_str(), stdout);
    return output_ok_plain();
  }
  // An option before the command: only --help and --version are residency's own (CLI11 would say
  // only "a subcommand is required", or blame the command that follows).
  if (argv[1][0] == '-' && first != "-h" && first != "--help") {
    const std::string names = command_names();
    std::fprintf(stderr, "residency: unknown option '%s'; accepted: --help, --version, or a command first: %s, help\n",
                 residency::printable(argv[1]).c_str(), names.c_str());
    return kExitBadInput;
  }
  if (argv[1][0] != '-' && std::none_of(entries.begin(), entries.end(), [&](const Entry& e) { return e.name == argv[1]; })) {
    const std::string names = command_names();
    std::fprintf(stderr, "residency: unknown command '%s'; accepted: %s, help (residency help says more)\n",
                 residency::printable(argv[1]).c_str(), names.c_str());
    return kExitBadInput;
  }
  // "residency idle: ..." when the error is in a subcommand's options.
  auto who = [&app] {
    for (const CLI::App* sub : app.get_subcommands()) return "residency " + sub->get_name();
    return std::string("residency");
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const OptionError& e) {  // already quotes the value printably
    std::fprintf(stderr, "%s: %s\n", who().c_str(), e.what());
    return kExitBadInput;
  } catch (const CLI::ParseError& e) {  // CLI11's own messages quote raw arguments
    std::fprintf(stderr, "%s: %s (--help lists the options)\n", who().c_str(),
                 residency::printable(cli11_voice(e.what()), 400).c_str());
    return kExitBadInput;
  }
  // What was printed must have been written: stdout on a full disk, /dev/full or a closed pipe
  // is a failure, said on stderr, not exit 0.
  auto output_ok = [](const std::string& name, int code) {
    errno = 0;
    if (std::fflush(stdout) == 0 && !std::ferror(stdout)) return code;
    const int err = errno;
    std::fprintf(stderr, "residency %s: error: %s\n", name.c_str(), output_error_text(err).c_str());
    return code == 0 ? kExitFailure : code;
  };
  for (auto& [sub, run] : runners) {
    if (!sub->parsed()) continue;
    try {
      return output_ok(sub->get_name(), run());
    } catch (const BadInput& e) {
      std::fprintf(stderr, "residency %s: %s\n", sub->get_name().c_str(), e.what());
      return kExitBadInput;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "residency %s: error: %s\n", sub->get_name().c_str(), e.what());
      return kExitFailure;
    }
  }
  return kExitBadInput;
}
