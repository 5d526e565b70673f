// The epx CLI's own commands: --version, doctor, bench on the host backend, bad input.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
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

// `epx bench --nodes`: the hierarchical normal path on the host backend beside the flat one. Reads the JSON report.
nlohmann::json run_nodes_bench(const std::string& flags) {
  static int counter = 0;
  const auto path = std::filesystem::temp_directory_path() /
                    ("epx_cli_nodes_" + std::to_string(::getpid()) + "_" + std::to_string(counter++) + ".json");
  double seconds = 0;
  const auto r =
      testing::run_cli_timed("bench --host --quiet --tokens 64 --hidden 256 --experts 32 --warmup 0 --iters 2 " +
                                 flags + " --json " + path.string(),
                             &seconds);
  EXPECT_LT(seconds, 10.0) << flags;
  EXPECT_EQ(r.exit_code, 0) << flags << "\n" << r.out << r.err;
  EXPECT_NE(r.out.find("check: passed"), std::string::npos) << r.out;
  std::ifstream file(path);
  nlohmann::json report;
  if (!file) {
    ADD_FAILURE() << "no JSON report at " << path;
    return report;
  }
  file >> report;
  std::filesystem::remove(path);
  return report;
}

TEST(Cli, HostBenchNodesMatchesTheFlatPath) {
  const auto report = run_nodes_bench("--ranks 4 --nodes 2");
  ASSERT_TRUE(report.contains("check")) << report.dump(2);
  EXPECT_TRUE(report["check"]["passed"].get<bool>()) << report.dump(2);
  EXPECT_EQ(report["run"], "nodes");
  EXPECT_EQ(report["settings"]["num_nodes"], 2);
  EXPECT_EQ(report["settings"]["gpus_per_node"], 2);
  EXPECT_EQ(report["check"]["details"].size(), 8u);  // 5 of the normal path, 3 of the low-latency path
  for (const auto& c : report["check"]["details"]) EXPECT_EQ(c["mismatches"], 0) << c.dump();
  // 64 tokens x top-8 of 32 experts over 2 nodes: nearly every token reaches the other node.
  EXPECT_GT(report["legs"]["network_rows"].get<double>(), 4 * 32);
  EXPECT_LE(report["legs"]["network_rows"].get<double>(), 4 * 64);
  EXPECT_GT(report["legs"]["node_rows"].get<double>(), 0);
  EXPECT_GT(report["legs"]["ll_network_records"].get<double>(), 0);
  EXPECT_GT(report["legs"]["ll_node_pairs"].get<double>(), 0);
  EXPECT_LT(report["legs"]["ll_node_pairs"].get<double>(), report["legs"]["ll_flat_peer_pairs"].get<double>());
  ASSERT_EQ(report["phases"].size(), 12u);  // 4 normal and 2 low-latency phases, each hierarchical and flat
  int hierarchical = 0;
  for (const auto& p : report["phases"]) {
    EXPECT_GT(p["time_us"].get<double>(), 0) << p.dump();
    if (p["routing"] != "hierarchical") {
      EXPECT_GT(p["peer_bytes"].get<double>(), 0) << p.dump();
      if (!p["phase"].get<std::string>().starts_with("ll_")) {
        EXPECT_GT(p["cross_node_bytes"].get<double>(), 0) << p.dump();
      }
      continue;
    }
    ++hierarchical;
    EXPECT_GT(p["network_bytes"].get<double>(), 0) << p.dump();
    EXPECT_GT(p["node_bytes"].get<double>(), 0) << p.dump();
  }
  EXPECT_EQ(hierarchical, 6);
  // The combine's network leg carries fp32 partials: twice the bf16 dispatch's bytes.
  EXPECT_EQ(report["phases"][6]["network_bytes"].get<double>(), 2 * report["phases"][0]["network_bytes"].get<double>());
}

TEST(Cli, HostBenchRoutingHierarchicalOnOneNode) {
  const auto report = run_nodes_bench("--ranks 2 --routing hierarchical");
  ASSERT_TRUE(report.contains("check")) << report.dump(2);
  EXPECT_TRUE(report["check"]["passed"].get<bool>()) << report.dump(2);
  EXPECT_EQ(report["settings"]["num_nodes"], 1);
  EXPECT_EQ(report["legs"]["network_rows"], 0);  // one node: everything goes over the node leg
  EXPECT_GT(report["legs"]["node_rows"].get<double>(), 0);
  EXPECT_EQ(report["legs"]["node_rows"], report["legs"]["flat_peer_rows"]);
  EXPECT_EQ(report["legs"]["ll_network_records"], 0);
  EXPECT_EQ(report["legs"]["ll_node_pairs"], report["legs"]["ll_flat_peer_pairs"]);
}

TEST(Cli, HostBenchNodesOneRankPerNode) {
  const auto report = run_nodes_bench("--nodes 4 --gpus-per-node 1");  // sets --ranks 4
  ASSERT_TRUE(report.contains("check")) << report.dump(2);
  EXPECT_TRUE(report["check"]["passed"].get<bool>()) << report.dump(2);
  EXPECT_EQ(report["settings"]["num_ranks"], 4);
  EXPECT_EQ(report["legs"]["node_rows"], 0);  // one rank per node: no forwarding inside a node
  EXPECT_EQ(report["legs"]["network_rows"], report["legs"]["flat_cross_node_rows"]);
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
