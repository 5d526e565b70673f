// The epx CLI's own commands: --version, doctor, bench on the host backend, bad input.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "test_util.h"

namespace epx {
namespace {

using testing::run_cli;

TEST(Cli, Version) {
  const auto r = run_cli("--version");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("epx 0."), std::string::npos) << r.out;
}

TEST(Cli, DoctorRunsWithOrWithoutGpu) {
  auto r = run_cli("doctor");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("host: "), std::string::npos) << r.out;
  r = run_cli("doctor --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_TRUE(j.contains("verdicts"));
  EXPECT_FALSE(j["verdicts"].empty());
}

TEST(Cli, HostBenchPassesItsCheck) {
  const auto r = run_cli(
      "bench --host --quiet --ranks 3 --experts 48 --tokens 64 --hidden 256 --ll-tokens 16 --warmup 0 --iters 2");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("check: passed"), std::string::npos) << r.out;
  for (const char* phase :
       {"layout", "dispatch_bf16", "dispatch_fp8", "combine", "ll_dispatch_bf16", "ll_combine", "ll_dispatch_fp8"}) {
    EXPECT_NE(r.out.find(phase), std::string::npos) << phase;
  }
}

TEST(Cli, BenchBadInputExitsTwo) {
  auto r = run_cli("bench --host --hidden 200");
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("--hidden must be a multiple of 128"), std::string::npos) << r.err;
  r = run_cli("bench --host --ranks 3 --experts 256");  // 256 experts over 3 ranks
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("divisible"), std::string::npos) << r.err;
  r = run_cli("frobnicate");
  EXPECT_NE(r.exit_code, 0);
}

}  // namespace
}  // namespace epx
