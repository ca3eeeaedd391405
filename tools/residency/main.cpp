// SPDX-License-Identifier: MIT
// residency: the command-line tool. Subcommands register themselves (command.hpp).
#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "command.hpp"
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
}  // namespace residency::tool

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
  CLI::App app{"residency: keep model memory resident while requests flow, and measure what idle costs"};
  app.name("residency");
  app.require_subcommand(1);
  std::map<CLI::App*, std::function<int()>> runners;
  auto& entries = registry();
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.name < b.name; });
  for (auto& e : entries) {
    CLI::App* sub = app.add_subcommand(e.name, e.help);
    runners[sub] = e.setup(*sub);
  }
  if (argc < 2) {  // no subcommand: say what there is
    std::fputs(app.help().c_str(), stderr);
    return kExitBadInput;
  }
  if (argv[1][0] != '-' && std::none_of(entries.begin(), entries.end(), [&](const Entry& e) { return e.name == argv[1]; })) {
    std::string names;
    for (const auto& e : entries) names += (names.empty() ? "" : ", ") + e.name;
    std::fprintf(stderr, "residency: unknown subcommand '%s'; accepted: %s (residency --help says more)\n",
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
    std::fprintf(stderr, "%s: %s (--help lists the options)\n", who().c_str(), residency::printable(e.what(), 400).c_str());
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
