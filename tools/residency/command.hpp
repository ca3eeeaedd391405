// residency tool: how a subcommand plugs in.
//
// Each subcommand lives in its own file and registers itself with a static Command object:
//   static const residency::tool::Command cmd{"stat", "what this machine holds resident",
//       [](CLI::App& app) { /* add options */ return [] { return run(); }; }};
// main.cpp knows none of them by name. Exit status: 0 success, 1 a failure while running,
// 2 bad input (arguments, files, environment) with one line saying what was wrong.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>

namespace residency::tool {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitBadInput = 2;

// Thrown by a subcommand for bad input; main prints "residency <cmd>: <message>" and exits 2.
struct BadInput : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Command {
  // setup adds the subcommand's options to `app` and returns what runs it.
  using Setup = std::function<std::function<int()>(CLI::App& app)>;
  Command(std::string name, std::string help, Setup setup);
};

}  // namespace residency::tool
