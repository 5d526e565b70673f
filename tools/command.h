// The epx CLI's subcommands register themselves here (one file per command family), so adding a
// command touches no other file.
//
// A command's callback signals failure by throwing: CLI::RuntimeError(code) for a chosen exit code,
// epx::Error(kInvalidArgument) or BadInput for bad user input (exit 2, one line on stderr), any
// other epx::Error for a runtime failure (exit 1).
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <stdexcept>
#include <string>

namespace epx::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitBadInput = 2;

// Bad user input found by the CLI itself (a file that does not parse, say): exit 2.
struct BadInput : std::runtime_error {
  using std::runtime_error::runtime_error;
};

using Registrar = std::function<void(CLI::App& app)>;

// Call from a static initializer: `static const bool kRegistered = register_command(20, add_eplb);`
// `order` sorts the subcommands in --help.
bool register_command(int order, Registrar registrar);

}  // namespace epx::cli
