// Fuzzes the epx command line: the input, split at NUL bytes, is argv[1..], run in process through the
// binary's own entry point epx::cli::run (tools/command.h) in validate-only mode: every flag, file and size
// check of a real run, then each command returns before its work (no placement, simulation or benchmark,
// no file written, no process started; dp, tbo and doctor run in full).
//
// Input files: "@/" in an argument names a directory with prepared files (w.json, w.csv, c.json, bad.csv
// and an empty directory d), e.g. "--weights=@/w.csv" (tests/fuzz/corpus/cli_fuzz has examples).
//
// Oracle, the CLI contract (tools/command.h): run returns 0, 1 or 2 and never throws or exits; exit 2 and
// exit 1 print exactly one line `epx: ...` (or `epx <code>: ...` for a library failure) on stderr; exit 0
// prints nothing on stderr. A crash, UB or a leak is a finding too.
//
// stderr is captured per input (a memfd on fd 2); sanitizer reports go to the original stderr. stdout
// (results, --help) goes to /dev/null.
#include <fcntl.h>
#include <fmt/format.h>
#include <sanitizer/common_interface_defs.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "command.h"

namespace {

namespace fs = std::filesystem;

std::string g_dir;      // the prepared files, with a trailing '/'
int g_capture_fd = -1;  // stderr of one run

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "cli_fuzz: contract broken: %s\n", what.c_str());
  std::abort();
}

void remove_fixture() {
  std::error_code ignored;
  fs::remove_all(g_dir, ignored);
}

void make_fixture() {
  std::string templ = (fs::temp_directory_path() / "epx_cli_fuzz.XXXXXX").string();
  if (::mkdtemp(templ.data()) == nullptr) fail("mkdtemp failed");
  g_dir = templ + "/";
  std::atexit(remove_fixture);
  std::ofstream(g_dir + "w.json") << R"({"weights": [[1, 2, 3, 4], [4, 3, 2, 1]]})";
  std::ofstream(g_dir + "w.csv") << "1,2,3,4\n5,6,7,8\n";
  std::ofstream(g_dir + "c.json") << R"({"phy2log": [[0, 1, 2, 3], [3, 2, 1, 0]]})";
  std::ofstream(g_dir + "bad.csv") << "1,,2\n";
  fs::create_directory(g_dir + "d");
  g_capture_fd = ::memfd_create("epx_cli_fuzz_stderr", 0);
  if (g_capture_fd < 0) fail("memfd_create failed");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Sanitizer reports keep the real stderr while fd 2 is captured.
  static const int report_fd = ::dup(2);
  __sanitizer_set_report_fd(reinterpret_cast<void*>(static_cast<intptr_t>(report_fd)));
  const int null_fd = ::open("/dev/null", O_RDWR);
  ::dup2(null_fd, 0);  // `--weights /dev/stdin` reads nothing instead of waiting
  ::dup2(null_fd, 1);
  ::close(null_fd);
  epx::cli::set_validate_only(true);
  make_fixture();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> args{"epx"};
  std::string arg;
  for (size_t i = 0; i <= size; ++i) {
    if (i == size || data[i] == '\0') {
      for (size_t at = arg.find("@/"); at != std::string::npos; at = arg.find("@/", at + g_dir.size())) {
        arg.replace(at, 2, g_dir);
      }
      args.push_back(std::move(arg));
      arg.clear();
    } else {
      arg.push_back(static_cast<char>(data[i]));
    }
  }
  if (size == 0) args.pop_back();  // no input: no arguments
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());

  const int fd = g_capture_fd;
  ::ftruncate(fd, 0);
  ::lseek(fd, 0, SEEK_SET);
  std::fflush(stderr);
  const int saved = ::dup(2);
  ::dup2(fd, 2);
  int rc = -1;
  try {
    rc = epx::cli::run(static_cast<int>(argv.size()), argv.data());
  } catch (...) {
    ::dup2(saved, 2);
    fail("an exception escaped epx::cli::run");
  }
  std::fflush(stderr);
  std::cerr.flush();
  ::dup2(saved, 2);
  ::close(saved);

  std::string err(static_cast<size_t>(::lseek(fd, 0, SEEK_END)), '\0');
  if (!err.empty() && ::pread(fd, err.data(), err.size(), 0) != static_cast<ssize_t>(err.size())) fail("pread");
  std::string shown;
  for (size_t i = 1; i < args.size(); ++i) shown += (i > 1 ? " " : "") + fmt::format("'{}'", args[i]);
  if (rc != 0 && rc != 1 && rc != 2) fail(fmt::format("epx {} exited {}", shown, rc));
  if (rc == 0 && !err.empty()) fail(fmt::format("epx {} exited 0 with stderr: {}", shown, err));
  if (rc != 0) {
    const bool one_line = err.size() > 6 && err.back() == '\n' && err.find('\n') == err.size() - 1;
    const bool prefixed = err.rfind("epx: ", 0) == 0 || (rc == 1 && err.rfind("epx ", 0) == 0);
    if (!one_line || !prefixed) fail(fmt::format("epx {} exited {} with stderr: {}", shown, rc, err));
  }
  return 0;
}
