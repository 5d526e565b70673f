// The epx CLI's contract (tools/command.h), through the built CLI (EPX_CLI_PATH): every bad invocation
// exits 2 with exactly one stderr line `epx: ...` naming the flag and its bound, sizes whose product cannot
// fit in memory are rejected at once, and --help tells the truth about the bounds.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "test_util.h"

namespace epx {
namespace {

using testing::expect_bad_input;
using testing::run_cli;

// expect_bad_input, plus: the line starts with "epx: ", uses no library argument name, and came fast (within
// `max_seconds`: the check precedes any work; a check that must follow real work, such as a placement, passes a
// bound for that work).
void expect_rejected(const std::string& args, const std::string& needle, double max_seconds = 5.0) {
  double seconds = 0;
  const auto r = testing::run_cli_timed(args, &seconds);
  testing::expect_bad_input_result(r, args, needle);
  EXPECT_LT(seconds, max_seconds) << args;
  EXPECT_EQ(r.err.rfind("epx: ", 0), 0u) << args << ": " << r.err;
  for (const char* library_name : {"num_", "_size", "_steps", "max_balance_loss"}) {
    EXPECT_EQ(r.err.find(library_name), std::string::npos) << args << ": " << r.err;
  }
}

std::filesystem::path temp_dir() {
  const auto dir = std::filesystem::temp_directory_path() / ("epx_cli_contract_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return dir;
}

std::string temp_file(const std::string& name, const std::string& text) {
  const auto p = temp_dir() / name;
  std::ofstream(p) << text;
  return p.string();
}

TEST(CliContract, ParseErrorsExitTwoWithOneLine) {
  // Before: CLI11's own exit codes (104-114) and a second line "Run with --help for more information."
  expect_rejected("bench --ranks abc", "--ranks: 'abc' is not a decimal integer (expected one in [1, 1024])");
  expect_rejected("bench --tokens 99999999", "--tokens: 99999999 is outside [0, 1048576]");
  expect_rejected("bench --ranks 99999999999999999999", "--ranks: 99999999999999999999 is outside [1, 1024]");
  expect_rejected("bench --topk 0x4", "--topk: '0x4' is not a decimal integer");
  expect_rejected("bench --sms 24,", "--sms: '' (item 1) is not an integer in [1, 1024]");
  expect_rejected("bench --seed -1", "--seed: '-1' is not a decimal integer in [0, 2^64 - 1]");
  expect_rejected("bench --no-such-flag", "--no-such-flag");
  expect_rejected("bench --ranks", "--ranks");
  expect_rejected("frobnicate", "epx has no subcommand 'frobnicate'");
  expect_rejected("", "epx needs a subcommand: one of bench, eplb, dp, tbo, doctor");
  expect_rejected("eplb", "epx eplb needs a subcommand: one of plan, simulate");
  expect_rejected("eplb plan --replicas 4 --groups 1 --nodes 1 --gpus 1", "--weights is required");
}

TEST(CliContract, BenchRanksZeroIsAnError) {
  // Before: --ranks 0 silently meant "all GPUs" (host backend: 4 ranks) and ran.
  expect_rejected("bench --host --quiet --ranks 0 --tokens 8 --hidden 128 --ll-tokens 1 --warmup 0 --iters 1",
                  "--ranks: 0 is outside [1, 1024]");
}

TEST(CliContract, BenchExpertsMustSplitOverTheDefaultRanks) {
  // Before: "num_experts (6) must be divisible by num_ranks (4)", the library's names.
  expect_rejected("bench --host --quiet --experts 6 --tokens 8 --hidden 128",
                  "--experts 6 must be divisible by the 4 ranks (the host backend's default; set --ranks)");
}

TEST(CliContract, BenchSizesCheckedAgainstMemory) {
  // Before: std::bad_alloc (exit 1) or minutes of work. 1024 ranks x 2^36 elements: far beyond any machine.
  expect_rejected("bench --host --quiet --ranks 1024 --experts 1024 --tokens 1048576 --hidden 65536",
                  "bench on the host backend: 1024 ranks x (--tokens 1048576 x --hidden 65536 x 7 bytes");
  expect_rejected("bench --host --quiet --ranks 1 --topk 1 --experts 4096 --ll-tokens 4096 --hidden 65536 --tokens 0",
                  "each rank's low-latency receive buffer, --experts 4096 x --ll-tokens 4096 x --hidden 65536 x 2 "
                  "bytes, needs at least 2 TiB");
  const auto r = run_cli("bench --host --quiet --ranks 1024 --experts 1024 --tokens 1048576 --hidden 65536");
  EXPECT_NE(r.err.find("of physical memory"), std::string::npos) << r.err;
}

TEST(CliContract, BenchJsonPathCheckedBeforeTheRun) {
  // Before: the unwritable path was found after the whole run.
  expect_rejected("bench --host --quiet --tokens 8 --hidden 128 --json /nonexistent/dir/out.json",
                  "--json: cannot write '/nonexistent/dir/out.json'");
}

TEST(CliContract, BenchNodesFlagsChecked) {
  // `epx bench --nodes N` (issue 17): the node count must split the ranks, and flags of other runs are refused.
  expect_rejected("bench --host --quiet --ranks 4 --nodes 3 --tokens 8 --hidden 128",
                  "--nodes 3 must divide the 4 ranks of --ranks");
  expect_rejected("bench --host --quiet --nodes 8 --tokens 8 --hidden 128",
                  "--nodes 8 must divide the 4 ranks (the host backend's default; set --ranks)");
  expect_rejected("bench --host --quiet --nodes 0", "--nodes: '0' is not an integer in [1, 1024]");
  expect_rejected("bench --host --quiet --nodes -2", "--nodes: '-2' is not an integer in [1, 1024]");
  expect_rejected("bench --host --quiet --nodes 2,4",
                  "--nodes: '2,4' is not an integer in [1, 1024] (a comma-separated list needs --model)");
  expect_rejected("bench --host --quiet --nodes 1", "--nodes 1 has no network leg");
  expect_rejected("bench --host --quiet --ranks 4 --nodes 2 --gpus-per-node 4",
                  "--nodes 2 x --gpus-per-node 4 = 8 ranks, but --ranks is 4");
  expect_rejected("bench --host --quiet --nodes 1024 --gpus-per-node 2",
                  "--nodes 1024 x --gpus-per-node 2 = 2048 ranks exceeds 1024");
  expect_rejected("bench --host --quiet --nodes 2 --gpus-per-node 0", "--gpus-per-node: 0 is outside [1, 72]");
  expect_rejected("bench --host --quiet --gpus-per-node 2", "--gpus-per-node applies only to --nodes or --model");
  expect_rejected("bench --host --quiet --nodes 2 --routing flat",
                  "--routing: 'flat' is not one of auto | hierarchical");
  expect_rejected("bench --host --quiet --routing auto", "--nodes 1 has no network leg");
  expect_rejected("bench --host --quiet --nodes 2 --experts 6",
                  "--experts 6 must be divisible by the 4 ranks (the host backend's default; set --ranks)");
  expect_rejected("bench --host --quiet --nodes 2 --dp",
                  "--dp does not apply to --nodes / --routing (a run of dispatch/combine only)");
  expect_rejected("bench --host --quiet --nodes 2 --sms 8,24", "--sms takes one value with --nodes / --routing, got 2");
  expect_rejected("bench --model --routing hierarchical", "--routing does not apply to --model");
  expect_rejected("bench --host --quiet --nodes 2 --node-partials fp16",
                  "--node-partials: 'fp16' is not one of fp32 | bf16");
  expect_rejected("bench --host --quiet --node-partials bf16",
                  "--node-partials applies only to --nodes / --routing or --model (the hierarchical combine)");
  expect_rejected("bench --host --quiet --processes", "--processes applies only to --nodes / --routing");
  expect_rejected("bench --model --processes", "--processes applies only to --nodes / --routing");
  expect_rejected("bench --host --quiet --ranks 2 --routing hierarchical --processes",
                  "--processes times the network leg on NCCL: it needs --nodes 2 or more, got 1");
  expect_rejected("bench --host --quiet --nodes 2 --processes",
                  "--processes runs ranks as processes on NCCL groups: it needs the cuda backend and a visible GPU");
  expect_rejected("bench --backend gpu", "--backend: 'gpu' is not one of auto | host | cuda");
  expect_rejected("bench --model --backend host", "--backend does not apply to --model");
  expect_rejected("bench --host --quiet --ranks 1024 --experts 1024 --nodes 2 --tokens 1048576 --hidden 65536",
                  "bench --nodes on the host backend: 1024 ranks x --tokens 1048576 x --hidden 65536 x 14 bytes");
  expect_rejected("bench --host --quiet --nodes 2 --tokens 8 --hidden 128 --json /nonexistent/dir/out.json",
                  "--json: cannot write '/nonexistent/dir/out.json'");
}

TEST(CliContract, EplbSizesCheckedUpFront) {
  // Before: --replicas 2000000000 and --layers 2147483647 allocated (bad_alloc, exit 1) or ran for minutes.
  const std::string ok = temp_file("ok.csv", "1,2,3,4\n");
  expect_rejected("eplb plan --weights " + ok + " --replicas 2000000000 --groups 1 --nodes 1 --gpus 1",
                  "--replicas: 2000000000 is outside [1, 1048576]");
  expect_rejected("eplb simulate --layers 2147483647", "--layers: 2147483647 is outside [1, 1048576]");
  std::string many_layers;
  for (int l = 0; l < 65536; ++l) many_layers += "1,2,3,4\n";
  const std::string tall = temp_file("tall.csv", many_layers);
  expect_rejected("eplb plan --weights " + tall + " --replicas 1048576 --groups 1 --nodes 1 --gpus 1",
                  "plan: 65536 layers (rows of --weights) x --replicas 1048576 x 48 bytes per slot needs at least");
  expect_rejected("eplb simulate --layers 1048576 --replicas 1048576 --gpus 1 --nodes 1 --groups 1",
                  "simulate: --layers 1048576 x --replicas 1048576");
  expect_rejected("eplb simulate --tokens 1073741824 --topk 8",
                  "--tokens 1073741824 x --topk 8 = 8589934592 exceeds 2^30");
}

TEST(CliContract, EplbSimulateFlagsCheckedBeforeTheRun) {
  // Before: nan was accepted and rejected by the library only at the first rebalance (after --every steps);
  // negative or nan --expert-bytes were accepted and printed as moved_bytes.
  expect_rejected("eplb simulate --max-balance-loss nan", "--max-balance-loss: 'nan' is not a finite decimal number");
  expect_rejected("eplb simulate --max-balance-loss 2", "--max-balance-loss: 2 is outside [0, 1]");
  expect_rejected("eplb simulate --expert-bytes -1", "--expert-bytes: -1 is outside [0, 1e+15]");
  expect_rejected("eplb simulate --expert-bytes nan", "--expert-bytes: 'nan' is not a finite decimal number");
  expect_rejected("eplb simulate --threshold 1.5", "--threshold: 1.5 is outside [0, 1]");
  expect_rejected("eplb simulate --drift -0.1", "--drift: -0.1 is outside [0, 1]");
  expect_rejected("eplb simulate --policy fancy", "--policy: 'fancy' is not one of deepseek | default");
  expect_rejected("eplb simulate --replicas 290", "--replicas 290 must be divisible by --gpus 32");
  expect_rejected("eplb simulate --experts 300", "--replicas 288 must be >= the 300 logical experts (--experts)");
  expect_rejected("eplb simulate --experts 252 --replicas 256", "must be divisible by --groups 8");
  expect_rejected("eplb simulate --gpus 6 --replicas 288", "--gpus 6 must be divisible by --nodes 4");
}

TEST(CliContract, EplbSimulateRecordFlags) {
  expect_rejected("eplb simulate --record-mode per_step",
                  "--record-mode: 'per_step' is not one of stat | stat_approx | per_pass | per_token");
  expect_rejected("eplb simulate --records " + (temp_dir() / "r.json").string(),
                  "--records needs --record-mode per_pass or per_token, got --record-mode stat");
  expect_rejected("eplb simulate --record-mode stat_approx --records " + (temp_dir() / "r.json").string(),
                  "--records needs --record-mode per_pass or per_token, got --record-mode stat_approx");
  expect_rejected("eplb simulate --record-mode per_pass --records /nonexistent/dir/r.json",
                  "--records: cannot write '/nonexistent/dir/r.json'");
  expect_rejected("eplb simulate --record-max-bytes -1", "--record-max-bytes: -1 is outside [0, 1099511627776]");
  expect_rejected("eplb simulate --record-max-bytes 1e6", "--record-max-bytes: '1e6' is not a decimal integer");
  expect_rejected("eplb simulate --record-mode", "--record-mode");
}

TEST(CliContract, EplbInputFilesAreRegularAndBounded) {
  // Before: /dev/zero was read until memory ran out, a FIFO blocked the open until a writer came, and a procfs
  // file (st_size 0, endless) was read whole. Now anything but a regular file is rejected before it is opened, a
  // regular file above 1 GiB before it is read, and the read stops at the bound whatever st_size says.
  const std::string shape = " --replicas 4 --groups 1 --nodes 1 --gpus 1";
  const std::string ok = temp_file("ok.csv", "1,2,3,4\n");
  expect_rejected("eplb plan --weights /dev/zero" + shape,
                  "--weights '/dev/zero' is a character device, not a regular file (input files are regular files of "
                  "at most 1 GiB)");
  expect_rejected("eplb plan --weights " + ok + " --current /dev/zero" + shape,
                  "--current '/dev/zero' is a character device, not a regular file");

  // A FIFO: before the fix the CLI blocked in open() until a writer came; this writer lets such a CLI go on (to
  // an empty file, a different message) instead of hanging the test.
  const auto fifo = temp_dir() / "fifo";
  std::filesystem::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  std::atomic<bool> done{false};
  std::thread writer([&] {
    while (!done) {
      const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);  // fails (ENXIO) while no reader waits
      if (fd >= 0) ::close(fd);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  expect_rejected("eplb plan --weights " + fifo.string() + shape,
                  "--weights '" + fifo.string() + "' is a FIFO (named pipe), not a regular file");
  done = true;
  writer.join();

  // A sparse 2 GiB file: rejected by its size before a byte is read.
  const std::string big = temp_file("big.csv", "");
  std::filesystem::resize_file(big, int64_t{2} << 30);
  expect_rejected("eplb plan --weights " + big + shape,
                  "--weights '" + big + "' holds 2 GiB, more than the 1 GiB an input file may hold");
  std::filesystem::remove(big);

  // A regular file whose st_size (0) says nothing: /proc/self/pagemap yields 8 bytes per page of the address
  // space, hundreds of GB. The read stops at the bound (or where memory / 16 is lower, on a small machine).
  if (::access("/proc/self/pagemap", R_OK) != 0) GTEST_SKIP() << "/proc/self/pagemap is not readable here";
  const auto r = run_cli("eplb plan --weights /proc/self/pagemap" + shape);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_TRUE(r.err.rfind("epx: --weights '/proc/self/pagemap' holds more than the 1 GiB an input file may hold", 0) ==
                  0 ||
              r.err.rfind("epx: parsing --weights '/proc/self/pagemap' (more than ", 0) == 0)
      << r.err;
}

TEST(CliContract, EplbLog2phyCheckedBeforeItIsBuilt) {
  // log2phy is [layers, experts, max replicas]: one hot expert among 2^19 takes 2^19 + 1 of 2^20 slots, and the
  // table would need 2^38 entries (1 TiB as int32; before: std::bad_alloc, exit 1, or the OOM killer where the
  // product fits in address space but not in memory). The check comes once the placement is known, so each
  // rejection first places 2^20 slots: ~1-3 s alone, 5.4 s on CI's two loaded cores (a CI failure, 2026-12-02).
  // The bound is for that work; the message is what shows the table was never built.
  constexpr double kPlacementSeconds = 60.0;
  std::string hot = "1000000";
  for (int e = 1; e < (1 << 19); ++e) hot += ",1";
  const std::string file = temp_file("hot.csv", hot + "\n");
  for (const char* policy : {"default", "deepseek"}) {
    expect_rejected(
        "eplb plan --weights " + file + " --replicas 1048576 --groups 1 --nodes 1 --gpus 1 --policy " + policy,
        "plan: log2phy, 1 layers (rows of --weights) x 524288 logical experts (columns) x 524289 replicas "
        "(the placement gives expert 0 of layer 0 that many of the --replicas 1048576 slots) x 20 bytes "
        "needs at least 5 TiB",
        kPlacementSeconds);
  }
  // The same from --current: the placement validated and scored without building the current one's log2phy
  // (before: std::bad_alloc there), kept on one GPU (already balanced), then rejected by its log2phy.
  std::string uniform = "1", current = "[0";
  for (int e = 1; e < (1 << 17); ++e) {
    uniform += ",1";
    current += fmt::format(",{}", e);  // NOTE: not "," + std::to_string(e): GCC 12 -O3 warns -Wrestrict on it
  }
  for (int s = 1 << 17; s < (1 << 20); ++s) current += ",0";
  const std::string weights = temp_file("uniform.csv", uniform + "\n");
  const std::string placement = temp_file("hot.json", "{\"phy2log\": [" + current + "]]}");
  expect_rejected("eplb plan --weights " + weights + " --current " + placement +
                      " --replicas 1048576 --groups 1 --nodes 1 --gpus 1",
                  "plan: log2phy, 1 layers (rows of --weights) x 131072 logical experts (columns) x 917505 replicas "
                  "(the placement gives expert 0 of layer 0",
                  kPlacementSeconds);
}

TEST(CliContract, TboDecodeAndExtendShareOneBound) {
  // Before: --decode had no upper bound (2^62 was accepted) while --extend stopped at 2^40 with the library's
  // name (extend_lens[0]).
  expect_rejected("tbo split --decode 4611686018427387904 --tokens-per-seq 2",
                  "--decode must be >= 0 and <= 2^40 = 1099511627776, got 4611686018427387904");
  expect_rejected("tbo split --extend 1099511627777", "--extend: length 1099511627777 of sequence 0 exceeds 2^40");
  expect_rejected("tbo split --extend 1099511627776,1",
                  "--extend: the lengths sum to more than 2^40 = 1099511627776 tokens");
  expect_rejected("tbo split --decode 16 --tokens-per-seq 1099511627777", "--tokens-per-seq must be >= 1 and <= 2^40");
  expect_rejected("tbo split --extend 10,20 --threshold 0x0.1", "--threshold: '0x0.1' is not a number");
  const auto r = run_cli("tbo split --decode 1099511627776 --tokens-per-seq 2");
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

TEST(CliContract, DpNamesFlagsNotFields) {
  // Before: "world_size 8 must be divisible by attn_cp_size * attn_dp_size = 3 ...".
  expect_rejected("dp groups --world 8 --attn-dp 3", "--world 8 must be divisible by --attn-cp * --attn-dp = 3");
  expect_rejected("dp groups --world 0", "--world must be in [1, 1024], got 0");
  expect_rejected("dp groups --world 8 --attn-dp 16", "--attn-dp must be in [1, 8] (--world), got 16");
  expect_rejected("dp padding-mode --tokens 1099511627777", "--tokens: count 1099511627777 of DP rank 0 exceeds 2^40");
  expect_rejected("dp padding-mode --tokens 1099511627776,1",
                  "--tokens: the counts sum to 1099511627777, more than 2^40 rows");
}

TEST(CliContract, HelpTellsTheBounds) {
  auto r = run_cli("--help");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(r.err.empty()) << r.err;
  for (const char* sub : {"bench", "eplb", "dp", "tbo", "doctor"}) EXPECT_NE(r.out.find(sub), std::string::npos);
  EXPECT_NE(r.out.find("2 bad input"), std::string::npos) << r.out;
  r = run_cli("bench --help");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("in [1, 1024]"), std::string::npos) << r.out;  // --ranks: 0 is no longer accepted
  for (const char* text : {"--routing", "dividing --ranks", "auto | hierarchical", "auto | host | cuda",
                           "--node-partials", "fp32 | bf16"}) {
    EXPECT_NE(r.out.find(text), std::string::npos) << text << "\n" << r.out;
  }
  r = run_cli("eplb simulate --help");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  for (const char* bound : {"in [1, 1048576]", "in [0, 1e+15]", "deepseek | default"}) {
    EXPECT_NE(r.out.find(bound), std::string::npos) << bound << "\n" << r.out;
  }
  r = run_cli("eplb plan --help");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("each row's sum finite"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("a regular file of at most 1 GiB"), std::string::npos) << r.out;
  r = run_cli("tbo split --help");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("N in [0, 2^40]"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace epx
