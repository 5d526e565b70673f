// `epx bench --model`: the scale model of issue 17 (src/ep/scale_model.h, docs/internode.md "Scale model"),
// printed for several node counts. Pure arithmetic: no GPU, no group, well under a second.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <vector>

#include "ep/scale_model.h"

namespace epx::cli {

struct ModelConfig {
  std::vector<int> num_nodes = {1, 2, 4, 9};  // --nodes: EP8, EP16, EP32, EP72 with 8 GPUs per node
  int gpus_per_node = 8;
  int64_t num_tokens = 4096;    // per rank, prefill (normal path)
  int64_t num_ll_tokens = 128;  // per rank, decode (low-latency path)
  int64_t hidden = 7168;
  int num_topk = 8;
  int64_t num_experts = 0;  // 0: per configuration, the smallest multiple of lcm(ranks, groups) >= 256
  int num_groups = 8;
  int num_topk_groups = 4;
  scale_model::Links links;
  uint64_t seed = 1;
  int64_t num_samples = int64_t{1} << 16;  // Monte-Carlo tokens per configuration
  // --node-partials fp32: the normal combine's network leg carries fp32 partials (NodePartials::kFloat32, hidden x 4
  // per row); default bf16 partials (NodePartials::kBFloat16, DeepEP's internode choice; hidden x 2).
  bool fp32_node_partials = false;
};

// Each configuration's expert count (ModelConfig::num_experts or its default). Throws BadInput naming the flag
// and its bound for a shape the model cannot take (experts that do not split over the ranks or groups, top-k
// above the experts of the chosen groups, more than 1024 ranks).
std::vector<int64_t> model_experts(const ModelConfig& config);

// {"model": settings, "configs": [{"name", "num_nodes", "gpus_per_node", "num_experts", "routing": {"exact",
// "monte_carlo"}, "phases": [{"name", "num_tokens", "row_bytes", "network_bytes", "nvlink_bytes", "network_us",
// "nvlink_us", "time_us"}]}], "check": the EP2 configuration of docs/status.md (1 node x 2 GPUs, uniform top-k of
// 256 as `epx bench` routes)}.
nlohmann::json run_model(const ModelConfig& config);
void print_model_report(const nlohmann::json& report);

}  // namespace epx::cli
