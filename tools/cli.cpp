#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <new>

#include "command.h"
#include "epx/error.h"
#include "epx/version.h"

namespace epx::cli {

namespace {
std::multimap<int, Registrar>& registry() {
  static std::multimap<int, Registrar> instance;
  return instance;
}

bool validate_only_flag = false;

bool is_digits(std::string_view s) { return !s.empty() && s.find_first_not_of("0123456789") == std::string_view::npos; }
}  // namespace

bool register_command(int order, Registrar registrar) {
  registry().emplace(order, std::move(registrar));
  return true;
}

void set_validate_only(bool on) { validate_only_flag = on; }
bool validate_only() { return validate_only_flag; }

std::optional<int64_t> parse_decimal_int(std::string_view text) {
  const std::string_view digits = !text.empty() && text[0] == '-' ? text.substr(1) : text;
  if (!is_digits(digits)) return std::nullopt;
  int64_t value = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || ptr != text.data() + text.size()) return std::nullopt;
  return value;
}

std::optional<double> parse_decimal_number(std::string_view text) {
  size_t i = 0;
  const auto digits = [&] {
    const size_t start = i;
    while (i < text.size() && text[i] >= '0' && text[i] <= '9') ++i;
    return i - start;
  };
  if (i < text.size() && (text[i] == '-' || text[i] == '+')) ++i;
  size_t mantissa = digits();
  if (i < text.size() && text[i] == '.') {
    ++i;
    mantissa += digits();
  }
  if (mantissa == 0) return std::nullopt;
  if (i < text.size() && (text[i] == 'e' || text[i] == 'E')) {
    ++i;
    if (i < text.size() && (text[i] == '-' || text[i] == '+')) ++i;
    if (digits() == 0) return std::nullopt;
  }
  if (i != text.size()) return std::nullopt;
  const std::string copy(text);  // NUL-terminated for strtod
  const double value = std::strtod(copy.c_str(), nullptr);
  if (!std::isfinite(value)) return std::nullopt;
  return value;
}

CLI::Validator int_in(int64_t lo, int64_t hi) {
  const std::string range = fmt::format("[{}, {}]", lo, hi);
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        const auto v = parse_decimal_int(text);
        if (v && *v >= lo && *v <= hi) return {};
        if (v || is_digits(text) || (text.size() > 1 && text[0] == '-' && is_digits(text.substr(1)))) {
          return fmt::format("{} is outside {}", text, range);
        }
        return fmt::format("'{}' is not a decimal integer (expected one in {})", text, range);
      },
      "in " + range);
}

CLI::Validator uint64_any() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        uint64_t v = 0;
        const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
        if (is_digits(text) && ec == std::errc() && ptr == text.data() + text.size()) return {};
        return fmt::format("'{}' is not a decimal integer in [0, 2^64 - 1]", text);
      },
      "in [0, 2^64 - 1]");
}

CLI::Validator number_in(double lo, double hi) {
  const std::string range = fmt::format("[{:g}, {:g}]", lo, hi);
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        const auto v = parse_decimal_number(text);
        if (!v) return fmt::format("'{}' is not a finite decimal number (expected one in {})", text, range);
        if (*v < lo || *v > hi) return fmt::format("{} is outside {}", text, range);
        return {};
      },
      "in " + range);
}

CLI::Validator one_of(std::vector<std::string> choices) {
  std::string list;
  for (const auto& c : choices) list += (list.empty() ? "" : " | ") + c;
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        for (const auto& c : choices) {
          if (text == c) return {};
        }
        return fmt::format("'{}' is not one of {}", text, list);
      },
      list);
}

double physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_bytes = ::sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page_bytes <= 0) return 1e300;  // unknown: do not reject on this ground
  return static_cast<double>(pages) * static_cast<double>(page_bytes);
}

std::string format_bytes(double bytes) {
  static const char* const kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return fmt::format("{:.0f} bytes", bytes);
  int unit = -1;
  while (bytes >= 1024 && unit < 5) {
    bytes /= 1024;
    ++unit;
  }
  return fmt::format("{:.3g} {}", bytes, kUnits[unit]);
}

void check_fits_in_memory(double bytes, const std::string& what) {
  const double limit = physical_memory_bytes();
  if (bytes > limit) {
    throw BadInput(fmt::format("{} needs at least {}, more than this machine's {} of physical memory", what,
                               format_bytes(bytes), format_bytes(limit)));
  }
}

namespace {

const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// Closes the descriptor on every path out of read_input_file.
struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

std::string read_input_file(const std::string& path, const std::string& option, double bytes_per_byte) {
  const std::string bound = format_bytes(static_cast<double>(kMaxInputFileBytes));
  auto cannot_read = [&] {
    return BadInput(fmt::format("cannot read {} file '{}': {}", option, path, std::strerror(errno)));
  };
  auto not_regular = [&](mode_t mode) {
    return BadInput(fmt::format("{} '{}' is {}, not a regular file (input files are regular files of at most {})",
                                option, path, file_kind(mode), bound));
  };
  auto parsing = [&](const std::string& size) {
    return fmt::format("parsing {} '{}' ({}, up to {:g} bytes in memory per byte of text)", option, path, size,
                       bytes_per_byte);
  };
  // NOTE: stat before open, since opening a FIFO blocks until a writer appears; the open does not block either,
  // and fstat checks the file actually opened, in case the path changed in between.
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw cannot_read();
  if (S_ISDIR(st.st_mode)) throw BadInput(fmt::format("{} '{}' is a directory, not a file", option, path));
  if (!S_ISREG(st.st_mode)) throw not_regular(st.st_mode);
  const Fd file{::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC)};
  if (file.fd < 0 || ::fstat(file.fd, &st) != 0) throw cannot_read();
  if (!S_ISREG(st.st_mode)) throw not_regular(st.st_mode);
  if (st.st_size > kMaxInputFileBytes) {
    throw BadInput(fmt::format("{} '{}' holds {}, more than the {} an input file may hold", option, path,
                               format_bytes(static_cast<double>(st.st_size)), bound));
  }
  check_fits_in_memory(static_cast<double>(st.st_size) * bytes_per_byte,
                       parsing(format_bytes(static_cast<double>(st.st_size))));
  // NOTE: st_size is only a hint (procfs files report 0 and some are endless; a file can grow while it is read),
  // so the read itself stops past the bound, or past what memory allows where that is lower, by less than a
  // chunk. Whole chunks: some procfs files reject reads of sizes they do not expect.
  const double memory_limit = physical_memory_bytes() / std::max(bytes_per_byte, 1.0);
  const int64_t limit = std::min(kMaxInputFileBytes, static_cast<int64_t>(std::min(memory_limit, 0x1p62)));
  std::string text;
  text.reserve(static_cast<size_t>(st.st_size));
  char chunk[1 << 16];
  while (static_cast<int64_t>(text.size()) <= limit) {
    const ssize_t got = ::read(file.fd, chunk, sizeof(chunk));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) throw cannot_read();
    if (got == 0) return text;
    text.append(chunk, static_cast<size_t>(got));
  }
  if (limit == kMaxInputFileBytes) {
    throw BadInput(fmt::format("{} '{}' holds more than the {} an input file may hold (the read stopped there)", option,
                               path, bound));
  }
  const std::string read_bytes = "more than " + format_bytes(static_cast<double>(limit));
  check_fits_in_memory(static_cast<double>(text.size()) * bytes_per_byte, parsing(read_bytes));
  throw BadInput(parsing(read_bytes) + " does not fit in this machine's memory");  // rounding passed the check
}

namespace {

// One line: newlines and tabs in a message become spaces.
std::string one_line(std::string text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  for (char& c : text) {
    if (c == '\n' || c == '\r' || c == '\t') c = ' ';
  }
  return text;
}

// "A subcommand is required" says neither which command nor which subcommands: name both.
std::string missing_subcommand(const CLI::App& app) {
  const CLI::App* at = &app;
  std::string path = "epx";
  for (bool deeper = true; deeper;) {
    deeper = false;
    for (const CLI::App* sub : at->get_subcommands()) {
      path += " " + sub->get_name();
      at = sub;
      deeper = true;
      break;
    }
  }
  std::string names;
  for (const CLI::App* sub : at->get_subcommands({})) names += (names.empty() ? "" : ", ") + sub->get_name();
  const std::vector<std::string> extras = at->remaining();
  if (!extras.empty()) {
    return fmt::format("{} has no subcommand '{}': one of {} (see {} --help)", path, extras.front(), names, path);
  }
  return fmt::format("{} needs a subcommand: one of {} (see {} --help)", path, names, path);
}

}  // namespace

int run(int argc, const char* const* argv) {
  CLI::App app{"epx: expert-parallel communication and load balancing for mixture-of-experts models"};
  app.name("epx");
  app.footer(
      "Exit status: 0 success; 1 a runtime failure (or a failed check); 2 bad input (one line on stderr, "
      "`epx: ...`, naming the flag and its bound).");
  app.set_version_flag("--version", std::string("epx ") + epx::version() +
                                        (epx::built_with_cuda() ? " (cuda backend)" : " (host backend only)"));
  app.require_subcommand(1);
  for (auto& [order, registrar] : registry()) registrar(app);
  auto bad_input = [](const std::string& message) {
    std::fprintf(stderr, "epx: %s\n", one_line(message).c_str());
    return kExitBadInput;
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const std::string name = e.get_name();
    if (name == "CallForHelp" || name == "CallForAllHelp" || name == "CallForVersion" || name == "RuntimeError" ||
        e.get_exit_code() == 0) {
      return app.exit(e);
    }
    if (name == "RequiredError" && std::string(e.what()).rfind("A subcommand", 0) == 0) {
      return bad_input(missing_subcommand(app));
    }
    return bad_input(e.what());
  } catch (const BadInput& e) {
    return bad_input(e.what());
  } catch (const epx::Error& e) {
    // what() is "epx invalid_argument: <message>"; the CLI's line is "epx: <message>".
    std::string message = e.what();
    const std::string prefix = std::string("epx ") + epx::to_string(e.code()) + ": ";
    if (e.code() == epx::ErrorCode::kInvalidArgument) {
      if (message.rfind(prefix, 0) == 0) message.erase(0, prefix.size());
      return bad_input(message);
    }
    std::fprintf(stderr, "%s\n", one_line(message).c_str());
    return kExitFailure;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "epx: out of memory (std::bad_alloc)\n");
    return kExitFailure;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epx: %s\n", one_line(e.what()).c_str());
    return kExitFailure;
  }
  return kExitOk;
}

}  // namespace epx::cli
