// The epx CLI's subcommands register themselves here (one file per command family), so adding a
// command touches no other file.
//
// The CLI contract (tests/unit/cli_contract_test.cpp):
// - Every bad invocation exits 2 with exactly one line on stderr, `epx: <what is wrong>`, naming the flag
//   (never the library's argument name) and the bound it broke; nothing on stdout.
// - Numbers are plain decimal (no hex, no inf/nan); every numeric flag has a range, checked by CLI11
//   before the value is converted (the validators below), and shown in --help.
// - Sizes whose product would not fit in this machine's memory are rejected before any work
//   (check_fits_in_memory), naming the product.
// - A runtime failure (not the user's input) exits 1 with one line on stderr.
//
// A command's callback signals failure by throwing: CLI::RuntimeError(code) for a chosen exit code
// (nothing printed), BadInput for bad user input (exit 2), epx::Error(kInvalidArgument) from the library
// (exit 2; a last resort, since its message names the library's arguments: validate first), any other
// exception for a runtime failure (exit 1).
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace epx::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitBadInput = 2;

// Bad user input found by the CLI itself (a file that does not parse, say): exit 2. The message names
// the flag and the bound.
struct BadInput : std::runtime_error {
  using std::runtime_error::runtime_error;
};

using Registrar = std::function<void(CLI::App& app)>;

// Call from a static initializer: `static const bool kRegistered = register_command(20, add_eplb);`
// `order` sorts the subcommands in --help.
bool register_command(int order, Registrar registrar);

// The whole CLI: builds the app from the registered commands, parses argv (argv[0] is the program name),
// runs the chosen command and returns the exit status (kExitOk, kExitFailure or kExitBadInput) after
// printing the one line the contract asks for. Never calls exit(); safe to call again in one process.
int run(int argc, const char* const* argv);

// Validate-only mode, for tests/fuzz/cli_fuzz.cpp: a command makes every check it makes on a real run
// (flags, input files, sizes against memory), then returns before its work (placement, simulation,
// benchmark) and before writing any file or starting a process. Commands whose whole work is a cheap
// computation printed on stdout (dp, tbo, doctor) run in full. Checks of the work's own result come after it
// and are skipped (`eplb plan`'s log2phy size, known once the placement is). Off unless set.
void set_validate_only(bool on);
bool validate_only();

// ---- parsing numbers ---------------------------------------------------------------------------------
// A decimal integer: optional '-', digits, nothing else (no '+', spaces, hex, or exponent). nullopt when
// the text is not one or does not fit int64.
std::optional<int64_t> parse_decimal_int(std::string_view text);
// A decimal number: [-+]? (digits [. digits?] | . digits) ([eE] [-+]? digits)?, finite as a double.
// nullopt for anything else (hex, inf, nan, 1e999, trailing characters).
std::optional<double> parse_decimal_number(std::string_view text);

// CLI11 validators: they see the option's text before conversion; CLI11 prefixes the message with the
// flag, e.g. `--ranks: 0 is outside [1, 1024]`.
CLI::Validator int_in(int64_t lo, int64_t hi);
CLI::Validator uint64_any();  // a decimal integer in [0, 2^64 - 1] (seeds)
CLI::Validator number_in(double lo, double hi);
CLI::Validator one_of(std::vector<std::string> choices);

// ---- sizes against memory ----------------------------------------------------------------------------
// This machine's physical memory, bytes: sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGE_SIZE).
double physical_memory_bytes();
// "1.5 GiB", "512 MiB", "12 KiB", "7 bytes".
std::string format_bytes(double bytes);
// Throws BadInput("<what> needs at least <bytes>, more than this machine's <physical memory>") when
// `bytes` (a lower bound of what the run will allocate; computed in double so it cannot wrap) exceeds
// physical memory. `what` names the product, e.g. "--tokens 1048576 x --hidden 65536 x 5 bytes x 4 ranks".
void check_fits_in_memory(double bytes, const std::string& what);

// The most bytes read_input_file reads from one file: above any load or placement file the EPLB flags accept in
// practice (2^20 experts x 61 layers as CSV of 8-character cells is 0.5 GiB). Parsing takes up to ~16 bytes per
// byte, checked against memory separately.
inline constexpr int64_t kMaxInputFileBytes = int64_t{1} << 30;

// The contents of the regular file given to `option`. BadInput naming option, path and the bound for: a missing
// or unreadable file, a directory, anything not a regular file (a FIFO, /dev/zero, a socket: rejected before it
// is read, never waited on), more than kMaxInputFileBytes, or more than physical memory / `bytes_per_byte` (the
// parsed form's size). The read stops within 64 KiB past the bound whatever st_size says (procfs files report 0).
std::string read_input_file(const std::string& path, const std::string& option, double bytes_per_byte);

}  // namespace epx::cli
