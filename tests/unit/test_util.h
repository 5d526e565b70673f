// Shared helpers for the CPU unit tests: seeded random data and tensor builders.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "epx/error.h"
#include "epx/group.h"
#include "epx/quant.h"
#include "epx/tensor.h"

namespace epx::testing {

// A generator with a fresh seed (std::random_device), named in every failure message of the scope it lives in.
struct SeededRng : std::mt19937 {
  SeededRng() : SeededRng(std::random_device{}()) {}
  explicit SeededRng(unsigned seed) : std::mt19937(seed), trace(__FILE__, __LINE__, "seed " + std::to_string(seed)) {}
  ::testing::ScopedTrace trace;
};

// fn() must throw Error(kInvalidArgument) whose message contains `needle`.
inline void expect_invalid(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected kInvalidArgument mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// Random bf16 values in [-range, range].
inline std::vector<uint16_t> random_bf16(std::mt19937& rng, size_t n, float range = 4.f) {
  std::uniform_real_distribution<float> dist(-range, range);
  std::vector<uint16_t> out(n);
  for (auto& v : out) v = float_to_bf16(dist(rng));
  return out;
}

// topk_idx [T, K]: distinct experts per token from [0, num_experts), each slot -1 with probability p_masked.
inline std::vector<int64_t> random_topk(std::mt19937& rng, int64_t num_tokens, int num_topk, int64_t num_experts,
                                        double p_masked = 0.0) {
  std::vector<int64_t> out(num_tokens * num_topk);
  std::uniform_int_distribution<int64_t> pick(0, num_experts - 1);
  std::bernoulli_distribution masked(p_masked);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int k = 0; k < num_topk; ++k) {
      int64_t e;
      bool fresh;
      do {
        e = pick(rng);
        fresh = true;
        for (int j = 0; j < k; ++j) fresh = fresh && out[t * num_topk + j] != e;
      } while (!fresh && num_topk <= num_experts);
      out[t * num_topk + k] = e;
    }
    for (int k = 0; k < num_topk; ++k) {
      if (masked(rng)) out[t * num_topk + k] = -1;
    }
  }
  return out;
}

// Runs fn(rank) on one thread per rank, joins them all and rethrows the first exception by rank order
// (like run_host_ranks, for code that holds per-rank objects rather than groups).
inline void on_ranks(int num_ranks, const std::function<void(int rank)>& fn) {
  std::vector<std::exception_ptr> errors(num_ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < num_ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

// Runs call(rank, group) on every rank of `groups` as threads: rank `bad` must raise kInvalidArgument whose message
// contains `needle`, every other rank kPeerFailure naming rank `bad` and the same message (the bad rank took part in
// the collective with an error flag, so the peers fail the same call instead of waiting for it).
inline void expect_rejected_on_rank(const std::vector<std::shared_ptr<Group>>& groups, int bad,
                                    const std::string& needle, const std::function<void(int, Group&)>& call) {
  run_host_ranks(groups, [&](int rank, Group& group) {
    try {
      call(rank, group);
      ADD_FAILURE() << "rank " << rank << ": no error; expected one mentioning '" << needle << "'";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_EQ(e.code(), rank == bad ? ErrorCode::kInvalidArgument : ErrorCode::kPeerFailure) << what;
      EXPECT_NE(what.find(needle), std::string::npos) << what;
      if (rank != bad) {
        EXPECT_NE(what.find("failed on ranks [" + std::to_string(bad) + "]"), std::string::npos) << what;
      }
    }
  });
}

#ifdef EPX_CLI_PATH
struct CliResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

// Runs the built epx CLI with `args` (shell words). stdout and stderr go to files unique to this process
// and call, since CTest runs test cases as parallel processes.
inline CliResult run_cli(const std::string& args) {
  static std::atomic<int> counter{0};
  const auto dir = std::filesystem::temp_directory_path() /
                   ("epx_cli_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
  std::filesystem::create_directories(dir);
  const auto out = dir / "stdout", err = dir / "stderr";
  const std::string cmd = std::string(EPX_CLI_PATH) + " " + args + " >" + out.string() + " 2>" + err.string();
  const int status = std::system(cmd.c_str());
  auto slurp = [](const std::filesystem::path& p) {
    std::ifstream in(p);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  };
  CliResult r{WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out), slurp(err)};
  std::filesystem::remove_all(dir);
  return r;
}

// run_cli, timed: *seconds is the wall time of the run itself. NOTE: an untimed `epx --version` goes first, so that
// a time bound does not include the process's cold start (the first exec after a build loads the binary and its
// CUDA/NCCL libraries from disk: 7.3 s once on the 2-core CI machine, for a rejection that takes milliseconds).
inline CliResult run_cli_timed(const std::string& args, double* seconds) {
  EXPECT_EQ(run_cli("--version").exit_code, 0);
  const auto start = std::chrono::steady_clock::now();
  CliResult r = run_cli(args);
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

// Bad CLI input: exit code 2, nothing on stdout, exactly one line on stderr containing `needle`.
inline void expect_bad_input_result(const CliResult& r, const std::string& args, const std::string& needle) {
  EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.out << r.err;
  EXPECT_TRUE(r.out.empty()) << args << ": " << r.out;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << args << ": " << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << args << ": " << r.err;
}

// Runs the CLI and checks it as bad input. Returns the run so callers can check more of it without running the CLI
// again.
inline CliResult expect_bad_input(const std::string& args, const std::string& needle) {
  auto r = run_cli(args);
  expect_bad_input_result(r, args, needle);
  return r;
}
#endif

}  // namespace epx::testing
