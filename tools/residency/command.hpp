// SPDX-License-Identifier: MIT
// residency tool: how a subcommand plugs in.
//
// Each subcommand lives in its own file and registers itself with a static Command object:
//   static const residency::tool::Command cmd{"stat", "what this machine holds resident",
//       [](CLI::App& app) { /* add options */ return [] { return run(); }; }};
// main.cpp knows none of them by name. Exit status: 0 success, 1 a failure while running,
// 2 bad input (arguments, files, environment) with one line saying what was wrong.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <string>

#include "residency/config.hpp"
#include "residency/text.hpp"

namespace residency::tool {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitBadInput = 2;

// Thrown by a subcommand for bad input; main prints "residency <cmd>: <message>" and exits 2.
struct BadInput : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// An option's error that already quotes the user's value through printable(): main prints it as
// it is (other parse errors from CLI11 echo raw values and are escaped there).
struct OptionError : CLI::ValidationError {
  explicit OptionError(const std::string& message) : CLI::ValidationError(message) {}
};

// A text option whose absence is visible: `target` stays empty unless it is given, even as "".
inline CLI::Option* add_text_option(CLI::App& app, const std::string& name, std::optional<std::string>& target,
                                    const std::string& help) {
  return app.add_option_function<std::string>(
      name, [&target](const std::string& v) { target = v; }, help);
}

// A whole-number option read strictly (ASCII digits only: no sign, exponent, hex, spaces or other
// scripts' digits) and checked against [lo, hi] before it is stored; the error names the option,
// the value and the range (`range_text`, default "lo to hi").
template <typename T>
CLI::Option* add_whole_number(CLI::App& app, const std::string& name, T& target, std::uint64_t lo, std::uint64_t hi,
                              const std::string& help, std::string range_text = "") {
  if (range_text.empty()) range_text = std::to_string(lo) + " to " + std::to_string(hi);
  return app.add_option_function<std::string>(
      name,
      [&target, name, lo, hi, range_text](const std::string& v) {
        const std::string where = name + " '" + printable(v) + "': ";
        if (v.empty() || v.find_first_not_of("0123456789") != std::string::npos) {
          throw OptionError(where + "not a whole number; accepted: " + range_text);
        }
        std::uint64_t n = 0;
        bool too_large = false;
        for (std::size_t i = 0; !too_large && i < v.size(); ++i) {
          const auto d = static_cast<std::uint64_t>(v[i] - '0');
          too_large = n > (UINT64_MAX - d) / 10;
          n = n * 10 + d;
        }
        if (too_large || n > hi) throw OptionError(where + "too large; accepted: " + range_text);
        if (n < lo) throw OptionError(where + "too small; accepted: " + range_text);
        target = static_cast<T>(n);
      },
      help);
}

// What a subcommand says when its output could not be written (a closed pipe, a full disk), after
// "error: ". `err` is the errno of the failed write or flush; 0 when there is none to give: the
// stream's error flag was set by an earlier write whose errno is gone (hold flushes its own lines,
// so main's final flush finds nothing left to write).
inline std::string output_error_text(int err) {
  return std::string("cannot write the output to stdout: ") +
         (err != 0 ? std::strerror(err) : "the reason is unknown (the C library gave no error number)");
}

struct Command {
  // setup adds the subcommand's options to `app` and returns what runs it.
  using Setup = std::function<std::function<int()>(CLI::App& app)>;
  Command(std::string name, std::string help, Setup setup);
};

}  // namespace residency::tool
