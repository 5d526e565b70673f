// `epx eplb plan` and `epx eplb simulate`: expert placement from a load file, and a simulated serving run
// with load recording (SGLang's recorder modes, --record-mode / --records) and rebalancing. Both print JSON on
// stdout. This file holds the flags of both and `plan`; `simulate` runs in eplb_simulate.cpp.
#include <fmt/format.h>

#include <algorithm>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "command.h"
#include "eplb/placement_detail.h"
#include "eplb_command.h"
#include "eplb_input.h"
#include "epx/eplb/placement.h"
#include "epx/eplb/sglang_format.h"
#include "epx/error.h"

namespace epx::cli::eplb_cmd {

using namespace epx::eplb;

void check_shape(int64_t num_logical, const char* logical, int64_t replicas, int64_t groups, int64_t nodes,
                 int64_t gpus) {
  if (num_logical > kMaxSize) {
    throw BadInput(
        fmt::format("{} logical experts ({}) exceed the bound of --replicas, {}", num_logical, logical, kMaxSize));
  }
  if (replicas < num_logical) {
    throw BadInput(fmt::format("--replicas {} must be >= the {} logical experts ({})", replicas, num_logical, logical));
  }
  if (replicas % gpus != 0) {
    throw BadInput(fmt::format("--replicas {} must be divisible by --gpus {} (equal slots per GPU)", replicas, gpus));
  }
  if (gpus % nodes != 0) throw BadInput(fmt::format("--gpus {} must be divisible by --nodes {}", gpus, nodes));
  if (groups % nodes == 0 && num_logical % groups != 0) {
    throw BadInput(
        fmt::format("the {} logical experts ({}) must be divisible by --groups {} (the hierarchical "
                    "policy applies since --groups is a multiple of --nodes {})",
                    num_logical, logical, groups, nodes));
  }
}

namespace {

// A file's text as a parsed JSON document or vectors of doubles: at most this many bytes per byte of text.
constexpr double kParseBytesPerByte = 16;

nlohmann::json rows_of(const std::vector<int32_t>& flat, int num_rows) {
  auto out = nlohmann::json::array();
  const size_t width = flat.size() / num_rows;
  for (int r = 0; r < num_rows; ++r) {
    out.push_back(std::vector<int32_t>(flat.begin() + r * width, flat.begin() + (r + 1) * width));
  }
  return out;
}

// log2phy is [layers, logical experts, max replicas]: one hot expert on most of 2^20 slots makes it hundreds of GB
// while phy2log stays small. Its size is known only once the placement is, so it is checked then, before it is
// built. NOTE: a lower bound per entry: the table (4 bytes) and its JSON node (16).
void check_log2phy_fits(const Placement& p) {
  const auto hottest = std::max_element(p.logcnt.begin(), p.logcnt.end()) - p.logcnt.begin();
  check_fits_in_memory(
      static_cast<double>(p.num_layers) * p.num_logical * p.max_replicas * 20,
      fmt::format("plan: log2phy, {} layers (rows of --weights) x {} logical experts (columns) x {} replicas (the "
                  "placement gives expert {} of layer {} that many of the --replicas {} slots) x 20 bytes",
                  p.num_layers, p.num_logical, p.max_replicas, hottest % p.num_logical, hottest / p.num_logical,
                  p.num_physical));
}

struct PlanArgs {
  std::string weights, current, policy = "default";
  std::string format = "epx";  // "sglang": only SGLang's --init-expert-location object
  int replicas = 0, groups = 1, nodes = 1, gpus = 1;
  double max_balance_loss = 0.01;
  bool fresh = false;
};

void run_plan(const PlanArgs& a) {
  // Every check before any placement work: flags (CLI11), then the files, then the products.
  const auto weight = parse_weights(read_input_file(a.weights, "--weights", kParseBytesPerByte), a.weights);
  check_weights(weight, a.weights);
  if (weight.size() > static_cast<size_t>(kMaxInt)) {
    throw BadInput(fmt::format("--weights '{}' holds {} layers, more than {}", a.weights, weight.size(), kMaxInt));
  }
  const int num_layers = static_cast<int>(weight.size());
  const int num_logical = static_cast<int>(std::min(weight[0].size(), static_cast<size_t>(kMaxSize + 1)));
  check_shape(num_logical, "columns of --weights", a.replicas, a.groups, a.nodes, a.gpus);
  // NOTE: a lower bound per slot: phy2log, its ranks, log2phy and the trivial placement (4 bytes each), and
  // the printed phy2log and log2phy (a 16-byte JSON node each).
  check_fits_in_memory(
      static_cast<double>(num_layers) * a.replicas * 48,
      fmt::format("plan: {} layers (rows of --weights) x --replicas {} x 48 bytes per slot", num_layers, a.replicas));
  const Policy policy = policy_from_string(a.policy);
  const PlacementShape shape{a.replicas, a.groups, a.nodes, a.gpus};
  nlohmann::json out;
  Placement placement;
  std::vector<int32_t> current;
  if (!a.current.empty()) {
    current =
        parse_current(read_input_file(a.current, "--current", kParseBytesPerByte), num_layers, num_logical, a.replicas);
  }
  if (validate_only()) return;
  std::vector<int32_t> phyrank;  // the order of each expert's replicas in log2phy (empty: slot order)
  if (!current.empty() && policy == Policy::kDefault && !a.fresh) {
    MigrationResult r = eplb::detail::rebalance_migration_aware_unmapped(weight, shape, current, {a.max_balance_loss});
    placement = std::move(r.placement);
    out["mode"] = "migration_aware";
    out["fresh_moved_experts"] = r.fresh_moved_experts;
    out["fresh_balancedness"] = r.fresh_balancedness;
  } else {
    eplb::detail::UnmappedPlacement u = eplb::detail::rebalance_unmapped(weight, shape, policy);
    placement = std::move(u.placement);
    phyrank = std::move(u.phyrank);
    out["mode"] = "fresh";
  }
  if (a.format == "sglang") {
    // NOTE: the only key: SGLang passes the object's keys as keywords of init_by_mapping, which takes no other.
    std::cout << to_sglang_expert_location_json(placement.phy2log, num_layers) << "\n";
    return;
  }
  check_log2phy_fits(placement);
  eplb::detail::build_log2phy(placement, phyrank);
  out["policy"] = to_string(policy);
  out["hierarchical"] = placement.hierarchical;
  out["phy2log"] = rows_of(placement.phy2log, num_layers);
  auto log2phy = nlohmann::json::array();
  for (int l = 0; l < num_layers; ++l) {
    auto layer = nlohmann::json::array();
    for (int e = 0; e < placement.num_logical; ++e) {
      const auto first =
          placement.log2phy.begin() + (static_cast<int64_t>(l) * placement.num_logical + e) * placement.max_replicas;
      layer.push_back(std::vector<int32_t>(first, first + placement.max_replicas));
    }
    log2phy.push_back(std::move(layer));
  }
  out["log2phy"] = std::move(log2phy);
  out["logcnt"] = rows_of(placement.logcnt, num_layers);
  out["balancedness_before"] =
      balancedness(weight, trivial_phy2log(num_layers, placement.num_logical, a.replicas), a.replicas, a.gpus);
  out["balancedness_after"] = balancedness(weight, placement.phy2log, a.replicas, a.gpus);
  if (!current.empty()) {
    out["balancedness_current"] = balancedness(weight, current, a.replicas, a.gpus);
    out["moved_experts"] = count_moved_experts(current, placement.phy2log);
  }
  std::cout << out.dump() << "\n";
}

void add_eplb(CLI::App& app) {
  auto* eplb = app.add_subcommand("eplb", "Expert-parallel load balancing: placement and simulation");
  eplb->require_subcommand(1);

  auto plan_args = std::make_shared<PlanArgs>();
  auto* plan = eplb->add_subcommand("plan", "Compute an expert placement from a load file; prints JSON");
  plan->add_option("--weights", plan_args->weights,
                   "JSON {\"weights\": [[...], ...]}, SGLang's {\"logical_count\": ...} (2-D, or 3-D with the passes "
                   "summed; its .pt dump converted to JSON) or CSV (plain decimal numbers), layers x logical; loads "
                   "finite, >= 0, each row's sum finite; a regular file of at most " +
                       format_bytes(kMaxInputFileBytes))
      ->required();
  plan->add_option("--replicas", plan_args->replicas,
                   "Physical experts per layer (>= the logical experts, a multiple of --gpus)")
      ->required()
      ->check(int_in(1, kMaxSize));
  plan->add_option("--groups", plan_args->groups, "Expert groups")->required()->check(int_in(1, kMaxSize));
  plan->add_option("--nodes", plan_args->nodes, "Nodes")->required()->check(int_in(1, kMaxSize));
  plan->add_option("--gpus", plan_args->gpus, "GPUs (a multiple of --nodes)")->required()->check(int_in(1, kMaxSize));
  plan->add_option("--policy", plan_args->policy, "Placement policy")
      ->capture_default_str()
      ->check(one_of({"deepseek", "default"}));
  plan->add_option("--current", plan_args->current,
                   "Current placement JSON ({\"phy2log\": [[...]]} or SGLang's {\"physical_to_logical_map\": "
                   "[[...]]}, every logical expert in each row; a regular file of at most " +
                       format_bytes(kMaxInputFileBytes) +
                       "); reports moved_experts, and with the default policy keeps experts in place unless moving "
                       "buys balance");
  plan->add_option("--max-balance-loss", plan_args->max_balance_loss,
                   "Migration-aware: allowed balancedness loss vs a fresh placement")
      ->capture_default_str()
      ->check(number_in(0, 1));
  plan->add_flag("--fresh", plan_args->fresh, "With --current: compute a fresh placement anyway");
  plan->add_option("--format", plan_args->format,
                   "Output: epx (the placement, balancedness and moves) or sglang (only {\"physical_to_logical_map\": "
                   "[[...]]}, a file SGLang's --init-expert-location accepts)")
      ->capture_default_str()
      ->check(one_of({"epx", "sglang"}));
  plan->callback([plan_args] { run_plan(*plan_args); });

  auto sim = std::make_shared<SimArgs>();
  auto* s = eplb->add_subcommand("simulate", "Simulate serving with a drifting Zipf load, with and without EPLB");
  s->add_option("--layers", sim->layers, "MoE layers")->capture_default_str()->check(int_in(1, kMaxSize));
  s->add_option("--experts", sim->experts, "Logical experts")->capture_default_str()->check(int_in(1, kMaxSize));
  s->add_option("--replicas", sim->replicas, "Physical experts (>= --experts, a multiple of --gpus)")
      ->capture_default_str()
      ->check(int_in(1, kMaxSize));
  s->add_option("--groups", sim->groups, "Expert groups")->capture_default_str()->check(int_in(1, kMaxSize));
  s->add_option("--nodes", sim->nodes, "Nodes")->capture_default_str()->check(int_in(1, kMaxSize));
  s->add_option("--gpus", sim->gpus, "GPUs (a multiple of --nodes)")->capture_default_str()->check(int_in(1, kMaxSize));
  s->add_option("--exponent", sim->exponent, "Zipf exponent")->capture_default_str()->check(number_in(0, 100));
  s->add_option("--drift", sim->drift, "Per-step probability that two neighbours in popularity swap")
      ->capture_default_str()
      ->check(number_in(0, 1));
  s->add_option("--steps", sim->steps, "Simulated steps")->capture_default_str()->check(int_in(1, kMaxInt));
  s->add_option("--tokens", sim->tokens, "Tokens per step (--tokens x --topk <= 2^30)")
      ->capture_default_str()
      ->check(int_in(0, kMaxStepLoad));
  s->add_option("--topk", sim->topk, "Experts per token")->capture_default_str()->check(int_in(1, 1024));
  s->add_option("--buffer", sim->buffer, "Recorder buffer, steps")->capture_default_str()->check(int_in(1, kMaxInt));
  s->add_option("--every", sim->every, "Rebalance every N steps (>= --buffer)")
      ->capture_default_str()
      ->check(int_in(1, kMaxInt));
  s->add_option("--threshold", sim->threshold,
                "Skip a due rebalance only when the gate statistic is above this (1 = never skip, SGLang's default)")
      ->capture_default_str()
      ->check(number_in(0, 1));
  s->add_option("--gate", sim->gate,
                "Gate statistic: mean_step (SGLang's: mean of per-step utilizations since the last due rebalance) or "
                "buffer (one ratio of the buffer's summed counts)")
      ->capture_default_str()
      ->check(one_of({"mean_step", "buffer"}));
  s->add_option("--layers-per-step", sim->layers_per_step, "Layers applied per step (0 = all)")
      ->capture_default_str()
      ->check(int_in(0, kMaxInt));
  s->add_option("--policy", sim->policy, "Placement policy")
      ->capture_default_str()
      ->check(one_of({"deepseek", "default"}));
  s->add_flag("--no-migration", sim->no_migration, "Fresh placements instead of migration-aware ones");
  s->add_option("--max-balance-loss", sim->max_balance_loss,
                "Migration-aware: allowed balancedness loss vs a fresh placement")
      ->capture_default_str()
      ->check(number_in(0, 1));
  s->add_option("--seed", sim->seed, "Random seed")->capture_default_str()->check(uint64_any());
  s->add_option("--expert-bytes", sim->expert_bytes,
                "Bytes of one expert's weights, for moved_bytes (default 44040192: a DeepSeek-V3 expert, three 7168 x "
                "2048 fp8 matrices)")
      ->check(number_in(0, kMaxExpertBytes));
  s->add_option("--report-every", sim->report_every, "Timeline sampling, steps")
      ->capture_default_str()
      ->check(int_in(1, kMaxInt));
  s->add_option("--record-mode", sim->record_mode,
                "Load recorder mode (SGLang's --expert-distribution-recorder-mode): stat and stat_approx keep per-step "
                "counts only; per_pass also keeps one record per simulated pass (its counts per layer and slot); "
                "per_token one with every token's top-k slots (tokens made up from the pass's counts)")
      ->capture_default_str()
      ->check(one_of({"stat", "stat_approx", "per_pass", "per_token"}));
  s->add_option("--records", sim->records,
                "Write the per_pass / per_token records of the rebalanced run to this file as JSON (SGLang's dump "
                "fields, docs/eplb.md); needs --record-mode per_pass or per_token");
  s->add_option("--record-max-bytes", sim->record_max_bytes,
                "Memory cap of the records; passes beyond it are dropped and counted (records.dropped_passes)")
      ->capture_default_str()
      ->check(int_in(0, kMaxRecordBytes));
  s->add_option("--plot", sim->plot, "Also draw utilization over time into this PNG (python3 -m epx.plot, matplotlib)");
  s->callback([sim] { run_simulate(*sim); });
}

const bool kRegistered = register_command(30, add_eplb);

}  // namespace

}  // namespace epx::cli::eplb_cmd
