// The scale model (src/ep/scale_model.h, issue 17): the exact routing statistics against a Monte-Carlo draw of
// the same routing (DeepSeek shapes EP8-EP72, groups aligned with nodes and straddling them), cases computed by
// hand, the timing formulas, and `epx bench --model`'s CLI contract.
#include "ep/scale_model.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "epx/error.h"
#include "test_util.h"

namespace epx {
namespace {

using scale_model::Links;
using scale_model::RoutingStats;
using scale_model::Shape;

Shape make_shape(int nodes, int gpus, int64_t experts, int topk, int groups, int topk_groups) {
  Shape s;
  s.num_nodes = nodes;
  s.gpus_per_node = gpus;
  s.num_experts = experts;
  s.num_topk = topk;
  s.num_groups = groups;
  s.num_topk_groups = topk_groups;
  return s;
}

std::string describe(const Shape& s) {
  return fmt::format("{} nodes x {} GPUs, {} experts, top-{}, {} groups, top-{} groups", s.num_nodes, s.gpus_per_node,
                     s.num_experts, s.num_topk, s.num_groups, s.num_topk_groups);
}

// C(n, k) / C(m, k) for small k, by hand.
double choose_ratio(int n, int m, int k) {
  double p = 1;
  for (int i = 0; i < k; ++i) p *= static_cast<double>(n - i) / (m - i);
  return p;
}

TEST(ScaleModel, ExactMatchesMonteCarlo) {
  // 2^17 tokens: the standard error of a per-token mean is below 0.3% of it; busiest-rank values carry the
  // extra noise of a max over ranks (more for more ranks), hence their wider bound.
  const Shape shapes[] = {
      make_shape(1, 8, 256, 8, 8, 4), make_shape(2, 8, 256, 8, 8, 4), make_shape(4, 8, 256, 8, 8, 4),
      make_shape(9, 8, 288, 8, 8, 4), make_shape(1, 2, 256, 8, 1, 1), make_shape(3, 2, 96, 6, 4, 2),
      make_shape(2, 4, 64, 3, 16, 5), make_shape(5, 1, 40, 2, 8, 3),
  };
  for (const Shape& s : shapes) {
    SCOPED_TRACE(describe(s));
    const RoutingStats exact = scale_model::routing_stats_exact(s);
    const RoutingStats mc = scale_model::routing_stats_monte_carlo(s, int64_t{1} << 17, 7);
    auto near = [](double a, double b, double rel) { return std::abs(a - b) <= rel * std::max(std::abs(a), 0.02); };
    EXPECT_PRED3(near, exact.nodes_per_token, mc.nodes_per_token, 0.01);
    EXPECT_PRED3(near, exact.gpus_per_token, mc.gpus_per_token, 0.01);
    EXPECT_PRED3(near, exact.network_rows.mean, mc.network_rows.mean, 0.01);
    EXPECT_PRED3(near, exact.nvlink_rows.mean, mc.nvlink_rows.mean, 0.01);
    EXPECT_PRED3(near, exact.ll_network_pairs.mean, mc.ll_network_pairs.mean, 0.01);
    EXPECT_PRED3(near, exact.ll_nvlink_pairs.mean, mc.ll_nvlink_pairs.mean, 0.01);
    EXPECT_PRED3(near, exact.network_rows.busiest, mc.network_rows.busiest, 0.05);
    EXPECT_PRED3(near, exact.nvlink_rows.busiest, mc.nvlink_rows.busiest, 0.05);
    EXPECT_LE(mc.max_nodes_per_token, exact.max_nodes_per_token);  // the exact one is an upper bound
  }
}

TEST(ScaleModel, MonteCarloIsReproducible) {
  const Shape s = make_shape(4, 8, 256, 8, 8, 4);
  const RoutingStats a = scale_model::routing_stats_monte_carlo(s, 5000, 3);
  const RoutingStats b = scale_model::routing_stats_monte_carlo(s, 5000, 3);
  EXPECT_EQ(a.nodes_per_token, b.nodes_per_token);
  EXPECT_EQ(a.network_rows.busiest, b.network_rows.busiest);
}

TEST(ScaleModel, GroupsAlignedWithNodesReachAtMostTopkGroupNodes) {
  // EP16/EP32: 8 groups on 2 or 4 nodes, each group on one node.
  for (int nodes : {2, 4}) {
    const RoutingStats mc = scale_model::routing_stats_monte_carlo(make_shape(nodes, 8, 256, 8, 8, 4), 20000, 1);
    EXPECT_LE(mc.max_nodes_per_token, std::min(nodes, 4));
    EXPECT_EQ(scale_model::routing_stats_exact(make_shape(nodes, 8, 256, 8, 8, 4)).max_nodes_per_token,
              std::min(nodes, 4));
  }
  // EP72 on 9 nodes: 8 groups of 36 straddle nodes of 32 experts: up to 8 nodes (top-4 groups, two nodes each).
  EXPECT_EQ(scale_model::routing_stats_exact(make_shape(9, 8, 288, 8, 8, 4)).max_nodes_per_token, 8);
  const RoutingStats ep72 = scale_model::routing_stats_monte_carlo(make_shape(9, 8, 288, 8, 8, 4), 50000, 1);
  EXPECT_GT(ep72.max_nodes_per_token, 4);
}

TEST(ScaleModel, OneNodeSendsNothingOverTheNetwork) {
  for (const Shape& s : {make_shape(1, 8, 256, 8, 8, 4), make_shape(1, 2, 256, 8, 1, 1)}) {
    SCOPED_TRACE(describe(s));
    for (const RoutingStats& st :
         {scale_model::routing_stats_exact(s), scale_model::routing_stats_monte_carlo(s, 4096, 1)}) {
      EXPECT_NEAR(st.nodes_per_token, 1.0, 1e-12);
      EXPECT_EQ(st.network_rows.busiest, 0);
      EXPECT_EQ(st.ll_network_pairs.busiest, 0);
      const auto t = scale_model::normal_time(st, 1, 4096, 14336, Links{});
      EXPECT_EQ(t.network_bytes, 0);
      EXPECT_DOUBLE_EQ(t.time_us, t.nvlink_us);  // no latency, no pipeline term
      const auto ll = scale_model::low_latency_time(st, 1, 128, 7392, Links{});
      EXPECT_EQ(ll.network_bytes, 0);
      EXPECT_DOUBLE_EQ(ll.time_us, ll.nvlink_us);
    }
  }
}

TEST(ScaleModel, HandComputedCases) {
  // EP2, uniform top-8 of 256 (`epx bench`'s routing): the other rank is reached unless all 8 land among the
  // 128 experts of the own rank.
  {
    const double p = 1 - choose_ratio(128, 256, 8);
    const RoutingStats st = scale_model::routing_stats_exact(make_shape(1, 2, 256, 8, 1, 1));
    EXPECT_NEAR(st.gpus_per_token, 2 * p, 1e-12);
    EXPECT_NEAR(st.nvlink_rows.busiest, p, 1e-12);
    EXPECT_NEAR(st.ll_nvlink_pairs.busiest, 4.0, 1e-12);  // 8 slots, half on the other rank
    Links links;
    links.nvlink_gbps = 385;
    const auto t = scale_model::normal_time(st, 1, 4096, 7168 * 2, links);
    EXPECT_NEAR(t.nvlink_bytes, 4096 * p * 14336, 1e-3);
    EXPECT_NEAR(t.time_us, 4096 * p * 14336 / 385e3, 1e-9);  // ~152 us, docs/status.md's floor (151 us)
  }
  // One group per token, groups = nodes: every token stays in one node, chosen uniformly.
  {
    const RoutingStats st = scale_model::routing_stats_exact(make_shape(4, 2, 64, 4, 4, 1));
    EXPECT_NEAR(st.nodes_per_token, 1.0, 1e-12);
    EXPECT_NEAR(st.network_rows.busiest, 0.75, 1e-12);
    EXPECT_EQ(st.max_nodes_per_token, 1);
  }
  // top-k = every expert of the chosen groups: exactly topk_group nodes and all their GPUs.
  {
    const RoutingStats st = scale_model::routing_stats_exact(make_shape(4, 2, 32, 16, 4, 2));
    EXPECT_NEAR(st.nodes_per_token, 2.0, 1e-12);
    EXPECT_NEAR(st.gpus_per_token, 4.0, 1e-12);
    EXPECT_NEAR(st.network_rows.busiest, 2.0 * 3 / 4, 1e-12);  // P(node) = 1/2, three other nodes
  }
  // top-1: one GPU per token; the low-latency pairs are K (N - 1) / N per token whatever the groups.
  {
    const RoutingStats st = scale_model::routing_stats_exact(make_shape(9, 8, 288, 1, 8, 4));
    EXPECT_NEAR(st.gpus_per_token, 1.0, 1e-12);
    EXPECT_NEAR(st.nodes_per_token, 1.0, 1e-12);
    EXPECT_NEAR(st.ll_network_pairs.mean, 8.0 / 9, 1e-12);
  }
  // EP32 with DeepSeek routing: a node holds 2 of the 8 groups; P(node) = sum over j of its groups picked.
  {
    const double p_node = 40.0 / 70 * (1 - choose_ratio(96, 128, 8)) + 15.0 / 70 * (1 - choose_ratio(64, 128, 8));
    const RoutingStats st = scale_model::routing_stats_exact(make_shape(4, 8, 256, 8, 8, 4));
    EXPECT_NEAR(st.nodes_per_token, 4 * p_node, 1e-9);
    EXPECT_NEAR(st.network_rows.busiest, 3 * p_node, 1e-9);
    const double p_gpu = 0.5 * (1 - choose_ratio(120, 128, 8));  // its group picked, then one of 8 experts of 128
    EXPECT_NEAR(st.gpus_per_token, 32 * p_gpu, 1e-9);
    EXPECT_NEAR(st.nvlink_rows.busiest, 4 * 7 * p_gpu, 1e-9);  // forwarder for 4 sources, 7 other GPUs
  }
}

TEST(ScaleModel, PipelineFormula) {
  RoutingStats st;
  st.network_rows.busiest = 1.5;  // rows per token
  st.nvlink_rows.busiest = 4.0;
  Links links;
  links.network_gbps = 50;
  links.nvlink_gbps = 400;
  links.latency_us = 5;
  links.chunk_tokens = 128;
  // 2 nodes, 1024 tokens, 1000-byte rows: network 1536 rows = 1.536 MB = 30.72 us; NVLink 4.096 MB = 10.24 us;
  // one message of 1536 rows = 12 chunks.
  const auto t = scale_model::normal_time(st, 2, 1024, 1000, links);
  EXPECT_NEAR(t.network_us, 30.72, 1e-9);
  EXPECT_NEAR(t.nvlink_us, 10.24, 1e-9);
  EXPECT_NEAR(t.time_us, 5 + 30.72 + 10.24 / 12, 1e-9);
  // Low latency: both legs at once.
  st.ll_network_pairs.busiest = 1;
  st.ll_nvlink_pairs.busiest = 20;
  const auto ll = scale_model::low_latency_time(st, 2, 100, 1000, links);
  EXPECT_NEAR(ll.time_us, std::max(5 + 100 * 1000 / 50e3, 100 * 20 * 1000 / 400e3), 1e-9);
  // A network row of its own (fp32 combine partials): twice the network bytes, NVLink unchanged.
  const auto fp32 = scale_model::normal_time(st, 2, 1024, 1000, links, 2000);
  EXPECT_NEAR(fp32.network_us, 2 * 30.72, 1e-9);
  EXPECT_NEAR(fp32.nvlink_us, 10.24, 1e-9);
  EXPECT_NEAR(fp32.time_us, 5 + 2 * 30.72 + 10.24 / 12, 1e-9);
}

TEST(ScaleModel, BadShapesAreRejected) {
  testing::expect_invalid([] { scale_model::routing_stats_exact(make_shape(3, 8, 256, 8, 8, 4)); },
                          "must be divisible by the 24 ranks");
  testing::expect_invalid([] { scale_model::routing_stats_exact(make_shape(1, 8, 256, 8, 8, 9)); },
                          "num_topk_groups must be in [1, num_groups = 8]");
  testing::expect_invalid([] { scale_model::routing_stats_exact(make_shape(1, 8, 256, 9, 32, 1)); },
                          "num_topk must be in [1, num_topk_groups x num_experts / num_groups = 8]");
  testing::expect_invalid([] { scale_model::routing_stats_monte_carlo(make_shape(1, 8, 256, 8, 8, 4), 0, 1); },
                          "num_tokens must be in [1, 2^24]");
}

// ---- `epx bench --model` ---------------------------------------------------------------------------------------

TEST(ScaleModelCli, BadValuesExitTwoNamingTheFlag) {
  using testing::expect_bad_input;
  expect_bad_input("bench --model --nodes 0", "epx: --nodes: '0' (item 0) is not an integer in [1, 1024]");
  expect_bad_input("bench --model --nodes 2,", "epx: --nodes: '' (item 1) is not an integer in [1, 1024]");
  expect_bad_input("bench --model --nodes 2,x", "epx: --nodes: 'x' (item 1) is not an integer in [1, 1024]");
  expect_bad_input("bench --model --nodes 200", "epx: --nodes 200 x --gpus-per-node 8 = 1600 ranks exceeds 1024");
  expect_bad_input("bench --model --gpus-per-node 0", "epx: --gpus-per-node: 0 is outside [1, 72]");
  expect_bad_input("bench --model --net-gbps 0", "epx: --net-gbps: 0 is outside [0.1, 100000]");
  expect_bad_input("bench --model --nvlink-gbps nan", "epx: --nvlink-gbps: 'nan' is not a finite decimal number");
  expect_bad_input("bench --model --latency-us -1", "epx: --latency-us: -1 is outside [0, 1e+06]");
  expect_bad_input("bench --model --groups 0", "epx: --groups: 0 is outside [1, 256]");
  expect_bad_input("bench --model --topk-group 300", "epx: --topk-group: 300 is outside [1, 256]");
  expect_bad_input("bench --model --topk-group 9", "epx: --topk-group 9 must be <= --groups 8");
  expect_bad_input("bench --model --nodes 3 --experts 256",
                   "epx: --experts 256 must be divisible by the 24 ranks of --nodes 3 x --gpus-per-node 8");
  expect_bad_input("bench --model --nodes 1 --experts 8 --groups 16",
                   "epx: --experts 8 must be divisible by --groups 16");
  expect_bad_input("bench --model --groups 32 --topk-group 1 --topk 9",
                   "epx: --topk 9 exceeds the 8 experts a token chooses from (--topk-group 1 of --groups 32");
  expect_bad_input("bench --model --hidden 1000", "epx: --hidden must be a multiple of 128, got 1000");
  expect_bad_input("bench --model --ranks 4", "epx: --ranks does not apply to --model");
  expect_bad_input("bench --model --host", "epx: --host does not apply to --model");
  expect_bad_input("bench --model --tbo", "epx: --tbo does not apply to --model");
  expect_bad_input("bench --host --nodes 2,4",
                   "epx: --nodes: '2,4' is not an integer in [1, 1024] (a comma-separated "
                   "list needs --model)");
  expect_bad_input("bench --net-gbps 25", "epx: --net-gbps applies only to --model");
  expect_bad_input("bench --model --json /nonexistent/dir/m.json",
                   "epx: --json: cannot write '/nonexistent/dir/m.json'");
}

TEST(ScaleModelCli, PrintsTheTableAndWritesJson) {
  const auto dir = std::filesystem::temp_directory_path() / ("epx_scale_model_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto json_path = (dir / "model.json").string();
  double seconds = 0;
  const auto r = testing::run_cli_timed("bench --model --json " + json_path, &seconds);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(r.err.empty()) << r.err;
  EXPECT_LT(seconds, 3.0);  // well under a second alone; slack for a loaded CI machine
  for (const char* name : {"EP8", "EP16", "EP32", "EP72", "EP2"}) EXPECT_NE(r.out.find(name), std::string::npos);
  const nlohmann::json j = nlohmann::json::parse(std::ifstream(json_path));
  ASSERT_EQ(j["configs"].size(), 4u);
  EXPECT_EQ(j["configs"][3]["name"], "EP72");
  EXPECT_EQ(j["configs"][3]["num_experts"], 288);
  EXPECT_EQ(j["configs"][0]["phases"][0]["network_bytes"], 0.0);  // EP8: one node
  for (const auto& cfg : j["configs"]) {
    for (const auto& p : cfg["phases"]) EXPECT_GT(p["time_us"].get<double>(), 0) << cfg["name"] << p["name"];
  }
  // The EP2 check: 4096 tokens, the other rank reached with p = 1 - C(128, 8) / C(256, 8), at 385 GB/s.
  const double p = 1 - choose_ratio(128, 256, 8);
  EXPECT_NEAR(j["check"]["phases"][0]["time_us"].get<double>(), 4096 * p * 14336 / 385e3, 1e-6);
  EXPECT_EQ(j["model"]["node_partials"], "bf16");
  const auto& combine = j["configs"][1]["phases"][2];  // EP16
  EXPECT_EQ(combine["name"], "combine_bf16");
  EXPECT_EQ(combine["network_row_bytes"], 7168.0 * 2);
  // --node-partials fp32: the combine's network bytes double, dispatch unchanged.
  const auto r32 = testing::run_cli("bench --model --node-partials fp32 --json " + json_path);
  ASSERT_EQ(r32.exit_code, 0) << r32.err;
  EXPECT_NE(r32.out.find("fp32 combine partials"), std::string::npos) << r32.out;
  const nlohmann::json j32 = nlohmann::json::parse(std::ifstream(json_path));
  EXPECT_EQ(j32["model"]["node_partials"], "fp32");
  EXPECT_EQ(j32["configs"][1]["phases"][2]["network_bytes"].get<double>(),
            2 * combine["network_bytes"].get<double>());
  EXPECT_EQ(j32["configs"][1]["phases"][0]["network_bytes"], j["configs"][1]["phases"][0]["network_bytes"]);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace epx
