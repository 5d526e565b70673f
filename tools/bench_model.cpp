// `epx bench --model`: see bench_model.h.
#include "bench_model.h"

#include <fmt/format.h>

#include <cstdio>
#include <numeric>
#include <string>

#include "command.h"
#include "epx/quant.h"
#include "epx/version.h"

namespace epx::cli {
namespace {

using scale_model::LegRows;
using scale_model::PhaseTime;
using scale_model::RoutingStats;
using scale_model::Shape;

constexpr int64_t kMaxRanks = 1024;
constexpr int64_t kBaseExperts = 256;  // DeepSeek-V3's routed experts; more fill every GPU (EP72: 288)

nlohmann::json leg_json(const LegRows& rows) { return {{"busiest", rows.busiest}, {"mean", rows.mean}}; }

nlohmann::json stats_json(const RoutingStats& s) {
  return {{"nodes_per_token", s.nodes_per_token},
          {"gpus_per_token", s.gpus_per_token},
          {"max_nodes_per_token", s.max_nodes_per_token},
          {"network_rows_per_token", leg_json(s.network_rows)},
          {"nvlink_rows_per_token", leg_json(s.nvlink_rows)},
          {"ll_network_pairs_per_token", leg_json(s.ll_network_pairs)},
          {"ll_nvlink_pairs_per_token", leg_json(s.ll_nvlink_pairs)}};
}

nlohmann::json phase_json(const std::string& name, int64_t num_tokens, double row_bytes, const PhaseTime& t,
                          double network_row_bytes = 0) {
  return {{"name", name},
          {"num_tokens", num_tokens},
          {"row_bytes", row_bytes},
          {"network_row_bytes", network_row_bytes > 0 ? network_row_bytes : row_bytes},
          {"network_bytes", t.network_bytes},
          {"nvlink_bytes", t.nvlink_bytes},
          {"network_us", t.network_us},
          {"nvlink_us", t.nvlink_us},
          {"time_us", t.time_us}};
}

// One configuration: routing both ways, the five phases from the exact statistics.
nlohmann::json model_one(const std::string& name, const Shape& shape, const ModelConfig& c) {
  const RoutingStats exact = scale_model::routing_stats_exact(shape);
  const RoutingStats mc = scale_model::routing_stats_monte_carlo(shape, c.num_samples, c.seed);
  const double bf16 = static_cast<double>(c.hidden) * 2;
  const double fp8 = static_cast<double>(c.hidden + c.hidden / kFp8BlockSize * 4);  // x + fp32 scales
  const int N = shape.num_nodes;
  nlohmann::json phases = nlohmann::json::array();
  phases.push_back(
      phase_json("dispatch_bf16", c.num_tokens, bf16, scale_model::normal_time(exact, N, c.num_tokens, bf16, c.links)));
  phases.push_back(
      phase_json("dispatch_fp8", c.num_tokens, fp8, scale_model::normal_time(exact, N, c.num_tokens, fp8, c.links)));
  const double partial = c.fp32_node_partials ? static_cast<double>(c.hidden) * 4 : bf16;  // the combine's network row
  phases.push_back(phase_json("combine_bf16", c.num_tokens, bf16,
                              scale_model::normal_time(exact, N, c.num_tokens, bf16, c.links, partial), partial));
  phases.push_back(phase_json("ll_dispatch_fp8", c.num_ll_tokens, fp8,
                              scale_model::low_latency_time(exact, N, c.num_ll_tokens, fp8, c.links)));
  phases.push_back(phase_json("ll_combine_bf16", c.num_ll_tokens, bf16,
                              scale_model::low_latency_time(exact, N, c.num_ll_tokens, bf16, c.links)));
  return {{"name", name},
          {"num_nodes", shape.num_nodes},
          {"gpus_per_node", shape.gpus_per_node},
          {"num_experts", shape.num_experts},
          {"num_groups", shape.num_groups},
          {"num_topk_groups", shape.num_topk_groups},
          {"routing", {{"exact", stats_json(exact)}, {"monte_carlo", stats_json(mc)}}},
          {"phases", phases}};
}

}  // namespace

std::vector<int64_t> model_experts(const ModelConfig& c) {
  std::vector<int64_t> out;
  for (int n : c.num_nodes) {
    const int64_t ranks = int64_t{n} * c.gpus_per_node;
    if (ranks > kMaxRanks) {
      throw BadInput(
          fmt::format("--nodes {} x --gpus-per-node {} = {} ranks exceeds {}", n, c.gpus_per_node, ranks, kMaxRanks));
    }
    if (c.num_topk_groups > c.num_groups) {
      throw BadInput(fmt::format("--topk-group {} must be <= --groups {}", c.num_topk_groups, c.num_groups));
    }
    int64_t experts = c.num_experts;
    if (experts == 0) {
      const int64_t step = std::lcm(ranks, int64_t{c.num_groups});
      experts = (kBaseExperts + step - 1) / step * step;
    } else if (experts % ranks != 0) {
      throw BadInput(fmt::format("--experts {} must be divisible by the {} ranks of --nodes {} x --gpus-per-node {}",
                                 experts, ranks, n, c.gpus_per_node));
    } else if (experts % c.num_groups != 0) {
      throw BadInput(fmt::format("--experts {} must be divisible by --groups {}", experts, c.num_groups));
    }
    const int64_t choices = experts / c.num_groups * c.num_topk_groups;
    if (c.num_topk > choices) {
      throw BadInput(
          fmt::format("--topk {} exceeds the {} experts a token chooses from (--topk-group {} of --groups "
                      "{}, {} experts)",
                      c.num_topk, choices, c.num_topk_groups, c.num_groups, experts));
    }
    out.push_back(experts);
  }
  return out;
}

nlohmann::json run_model(const ModelConfig& c) {
  const std::vector<int64_t> experts = model_experts(c);
  nlohmann::json configs = nlohmann::json::array();
  for (size_t i = 0; i < c.num_nodes.size(); ++i) {
    Shape shape;
    shape.num_nodes = c.num_nodes[i];
    shape.gpus_per_node = c.gpus_per_node;
    shape.num_experts = experts[i];
    shape.num_topk = c.num_topk;
    shape.num_groups = c.num_groups;
    shape.num_topk_groups = c.num_topk_groups;
    configs.push_back(model_one(fmt::format("EP{}", shape.num_nodes * shape.gpus_per_node), shape, c));
  }
  // The configuration measured in docs/status.md: 2 GPUs of one node, uniform top-k of 256 (`epx bench`'s
  // routing: no groups), NVLink only.
  Shape ep2;
  ep2.num_nodes = 1;
  ep2.gpus_per_node = 2;
  ep2.num_experts = kBaseExperts;
  ep2.num_topk = c.num_topk;
  ep2.num_groups = 1;
  ep2.num_topk_groups = 1;
  return {{"backend", "model"},
          {"epx_version", version()},
          {"model",
           {{"num_tokens", c.num_tokens},
            {"num_ll_tokens", c.num_ll_tokens},
            {"hidden", c.hidden},
            {"num_topk", c.num_topk},
            {"num_groups", c.num_groups},
            {"num_topk_groups", c.num_topk_groups},
            {"network_gbps", c.links.network_gbps},
            {"nvlink_gbps", c.links.nvlink_gbps},
            {"latency_us", c.links.latency_us},
            {"chunk_tokens", c.links.chunk_tokens},
            {"node_partials", c.fp32_node_partials ? "fp32" : "bf16"},
            {"monte_carlo_tokens", c.num_samples},
            {"seed", c.seed}}},
          {"configs", configs},
          {"check", model_one("EP2 uniform (as `epx bench` routes)", ep2, c)}};
}

void print_model_report(const nlohmann::json& r) {
  const auto& m = r["model"];
  std::printf("epx bench --model: predicted time per call of the busiest rank (docs/internode.md \"Scale model\")\n");
  std::printf(
      "hidden %lld, top-%d experts in the top-%d of %d groups; network %g GB/s + %g us, NVLink %g GB/s per "
      "GPU; prefill %lld tokens/rank, decode %lld; %s combine partials on the network\n",
      m["hidden"].get<long long>(), m["num_topk"].get<int>(), m["num_topk_groups"].get<int>(),
      m["num_groups"].get<int>(), m["network_gbps"].get<double>(), m["latency_us"].get<double>(),
      m["nvlink_gbps"].get<double>(), m["num_tokens"].get<long long>(), m["num_ll_tokens"].get<long long>(),
      m["node_partials"].get<std::string>().c_str());
  std::printf("%-7s %-6s %7s %-13s %-13s %8s %8s | %9s %9s %9s | %9s %9s\n", "config", "nodes", "experts",
              "nodes/token", "GPUs/token", "net", "NVLink", "prefill", "prefill", "prefill", "decode", "decode");
  std::printf("%-7s %-6s %7s %-13s %-13s %8s %8s | %9s %9s %9s | %9s %9s\n", "", "", "", "exact (MC)", "exact (MC)",
              "rows/tok", "rows/tok", "bf16 disp", "fp8 disp", "combine", "fp8 disp", "combine");
  auto row = [](const nlohmann::json& cfg, const std::string& label) {
    const auto& e = cfg["routing"]["exact"];
    const auto& mc = cfg["routing"]["monte_carlo"];
    const auto& p = cfg["phases"];
    std::printf(
        "%-7s %-6s %7lld %5.2f (%5.2f) %5.2f (%5.2f) %8.2f %8.2f | %9.0f %9.0f %9.0f | %9.1f %9.1f\n", label.c_str(),
        fmt::format("{}x{}", cfg["num_nodes"].get<int>(), cfg["gpus_per_node"].get<int>()).c_str(),
        cfg["num_experts"].get<long long>(), e["nodes_per_token"].get<double>(), mc["nodes_per_token"].get<double>(),
        e["gpus_per_token"].get<double>(), mc["gpus_per_token"].get<double>(),
        e["network_rows_per_token"]["busiest"].get<double>(), e["nvlink_rows_per_token"]["busiest"].get<double>(),
        p[0]["time_us"].get<double>(), p[1]["time_us"].get<double>(), p[2]["time_us"].get<double>(),
        p[3]["time_us"].get<double>(), p[4]["time_us"].get<double>());
  };
  for (const auto& cfg : r["configs"]) row(cfg, cfg["name"].get<std::string>());
  std::printf("times in us; rows per token of a rank's batch, busiest rank (hierarchical normal path)\n");
  std::printf("check, EP2 of one node, uniform top-%d of 256 (`epx bench`'s routing; measured: docs/status.md):\n",
              m["num_topk"].get<int>());
  row(r["check"], "EP2");
}

}  // namespace epx::cli
