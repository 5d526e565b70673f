// `epx eplb plan` and `epx eplb simulate`: expert placement from a load file, and a simulated serving run
// with load recording and rebalancing. Both print JSON on stdout.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "command.h"
#include "epx/eplb/expert_location.h"
#include "epx/eplb/manager.h"
#include "epx/eplb/placement.h"
#include "epx/eplb/synthetic.h"
#include "epx/error.h"

namespace epx::cli {

namespace {

using namespace epx::eplb;

std::string read_file(const std::string& path, const char* option) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw BadInput(std::string("cannot read ") + option + " file '" + path + "'");
  std::stringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

// JSON {"weights": [[...], ...]} (or a bare array of rows), or CSV with one layer a line.
std::vector<std::vector<double>> parse_weights(const std::string& text, const std::string& path) {
  const size_t first = text.find_first_not_of(" \t\r\n");
  if (first != std::string::npos && (text[first] == '{' || text[first] == '[')) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      throw BadInput("--weights '" + path + "' is not valid JSON: " + e.what());
    }
    const nlohmann::json& rows = j.is_object() && j.contains("weights") ? j["weights"] : j;
    if (!rows.is_array()) throw BadInput("--weights JSON must hold an array of rows in field 'weights'");
    std::vector<std::vector<double>> out;
    for (size_t l = 0; l < rows.size(); ++l) {
      if (!rows[l].is_array()) throw BadInput("--weights row " + std::to_string(l) + " is not an array");
      std::vector<double> row;
      for (size_t e = 0; e < rows[l].size(); ++e) {
        if (!rows[l][e].is_number()) {
          throw BadInput("--weights[" + std::to_string(l) + "][" + std::to_string(e) + "] is not a number");
        }
        row.push_back(rows[l][e].get<double>());
      }
      out.push_back(std::move(row));
    }
    return out;
  }
  std::vector<std::vector<double>> out;
  std::istringstream lines(text);
  std::string line;
  int line_no = 0;
  while (std::getline(lines, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    std::vector<double> row;
    std::istringstream cells(line);
    std::string cell;
    int col = 0;
    while (std::getline(cells, cell, ',')) {
      ++col;
      const char* begin = cell.c_str();
      char* end = nullptr;
      const double v = std::strtod(begin, &end);
      while (end != nullptr && (*end == ' ' || *end == '\t' || *end == '\r')) ++end;
      if (end == begin || *end != '\0') {
        throw BadInput("--weights '" + path + "' line " + std::to_string(line_no) + " column " + std::to_string(col) +
                       ": '" + cell + "' is not a number");
      }
      row.push_back(v);
    }
    out.push_back(std::move(row));
  }
  return out;
}

// An ExpertLocation JSON or {"phy2log": [[...], ...]}.
std::vector<int32_t> parse_current(const std::string& text, int num_layers, int num_physical) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw BadInput(std::string("--current is not valid JSON: ") + e.what());
  }
  if (!j.is_object() || !j.contains("phy2log") || !j["phy2log"].is_array()) {
    throw BadInput("--current JSON needs a field 'phy2log' with one row per layer");
  }
  const auto& rows = j["phy2log"];
  if (rows.size() != static_cast<size_t>(num_layers)) {
    throw BadInput("--current has " + std::to_string(rows.size()) + " layers, --weights has " +
                   std::to_string(num_layers));
  }
  std::vector<int32_t> out;
  for (size_t l = 0; l < rows.size(); ++l) {
    if (!rows[l].is_array() || rows[l].size() != static_cast<size_t>(num_physical)) {
      throw BadInput("--current phy2log row " + std::to_string(l) +
                     " must have --replicas = " + std::to_string(num_physical) + " entries");
    }
    for (const auto& v : rows[l]) {
      if (!v.is_number_integer()) throw BadInput("--current phy2log row " + std::to_string(l) + " has a non-integer");
      out.push_back(v.get<int32_t>());
    }
  }
  return out;
}

nlohmann::json rows_of(const std::vector<int32_t>& flat, int num_rows) {
  auto out = nlohmann::json::array();
  const size_t width = flat.size() / num_rows;
  for (int r = 0; r < num_rows; ++r) {
    out.push_back(std::vector<int32_t>(flat.begin() + r * width, flat.begin() + (r + 1) * width));
  }
  return out;
}

struct PlanArgs {
  std::string weights, current, policy = "default";
  int replicas = 0, groups = 1, nodes = 1, gpus = 1;
  double max_balance_loss = 0.01;
  bool fresh = false;
};

void run_plan(const PlanArgs& a) {
  const auto weight = parse_weights(read_file(a.weights, "--weights"), a.weights);
  if (weight.empty()) throw BadInput("--weights '" + a.weights + "' holds no layers");
  const Policy policy = policy_from_string(a.policy);
  const PlacementShape shape{a.replicas, a.groups, a.nodes, a.gpus};
  const int num_layers = static_cast<int>(weight.size());
  nlohmann::json out;
  Placement placement;
  std::vector<int32_t> current;
  if (!a.current.empty()) current = parse_current(read_file(a.current, "--current"), num_layers, a.replicas);
  if (!current.empty() && policy == Policy::kDefault && !a.fresh) {
    MigrationResult r = rebalance_migration_aware(weight, shape, current, {a.max_balance_loss});
    placement = std::move(r.placement);
    out["mode"] = "migration_aware";
    out["fresh_moved_experts"] = r.fresh_moved_experts;
    out["fresh_balancedness"] = r.fresh_balancedness;
  } else {
    placement = rebalance(weight, shape, policy);
    out["mode"] = "fresh";
  }
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

struct SimArgs {
  int layers = 61, experts = 256, replicas = 288, groups = 8, nodes = 4, gpus = 32;
  double exponent = 1.0, drift = 0.01;
  int steps = 1000, tokens = 4096, topk = 8, buffer = 100, every = 100, layers_per_step = 8, report_every = 50;
  double threshold = 0.95, max_balance_loss = 0.01;
  std::string policy = "default";
  std::string plot;  // PNG path: drawn by the Python package's epx.plot (matplotlib)
  bool no_migration = false;
  uint64_t seed = 1;
  double expert_bytes = 3.0 * 7168 * 2048;  // DeepSeek-V3 expert: three 7168 x 2048 fp8 matrices
};

// Splits each logical count over the expert's replicas (evenly, remainder rotating with the step).
void to_physical(const ExpertLocation& loc, const std::vector<int64_t>& logical, int64_t step,
                 std::vector<int64_t>& physical) {
  const int num_logical = loc.num_logical(), num_physical = loc.num_physical();
  physical.assign(static_cast<size_t>(loc.num_layers()) * num_physical, 0);
  for (int l = 0; l < loc.num_layers(); ++l) {
    for (int e = 0; e < num_logical; ++e) {
      const auto reps = loc.replicas(l, e);
      const int64_t c = logical[static_cast<int64_t>(l) * num_logical + e];
      const int64_t n = static_cast<int64_t>(reps.size());
      for (int64_t k = 0; k < n; ++k) {
        physical[static_cast<int64_t>(l) * num_physical + reps[k]] = c / n + (((k + step) % n) < c % n ? 1 : 0);
      }
    }
  }
}

// Draws the simulation with the Python package (python3 -m epx.plot; $EPX_PYTHON picks the interpreter).
// NOTE: the chart needs matplotlib, which the C++ tool does not carry; a missing package is a failure
// with a message that says what to install, not a silent skip.
void plot_with_python(const nlohmann::json& result, const std::string& png) {
  const std::string json_path = png + ".json";
  std::ofstream(json_path) << result.dump();
  const char* python = std::getenv("EPX_PYTHON");
  const std::string command =
      std::string(python != nullptr ? python : "python3") + " -m epx.plot '" + json_path + "' '" + png + "'";
  const int rc = std::system(command.c_str());
  std::remove(json_path.c_str());
  if (rc != 0) {
    std::cerr << "epx: --plot needs the epx Python package and matplotlib (pip install . matplotlib); `" << command
              << "` exited with " << rc << "\n";
    throw CLI::RuntimeError(kExitFailure);
  }
  std::cerr << "epx: wrote " << png << "\n";
}

void run_simulate(const SimArgs& a) {
  if (a.steps < 1) throw BadInput("--steps must be >= 1");
  if (a.report_every < 1) throw BadInput("--report-every must be >= 1");
  if (a.tokens < 0 || a.topk < 1) throw BadInput("--tokens must be >= 0 and --topk >= 1");
  DriftingZipf load(a.layers, a.experts, a.exponent, static_cast<double>(a.tokens) * a.topk, a.drift, a.seed);
  const RecorderOptions rec{a.buffer, RecordMode::kStat};
  ManagerOptions opt;
  opt.num_groups = a.groups;
  opt.rebalance_every_steps = a.every;
  opt.utilization_threshold = a.threshold;
  opt.layers_per_step = a.layers_per_step;
  opt.policy = policy_from_string(a.policy);
  opt.migration_aware = !a.no_migration;
  opt.migration.max_balance_loss = a.max_balance_loss;
  const auto initial = ExpertLocation::trivial(a.layers, a.experts, a.replicas, a.gpus, a.nodes);
  RebalanceManager managed(initial, rec, opt);
  LoadRecorder fixed(a.layers, a.experts, a.replicas, a.gpus, rec);  // the same load, never rebalanced
  // Validate the shape up front so bad input fails before the run.
  rebalance({std::vector<double>(a.experts, 1.0)}, {a.replicas, a.groups, a.nodes, a.gpus}, opt.policy);

  nlohmann::json timeline = nlohmann::json::array();
  std::vector<int64_t> physical;
  double sum_with = 0, sum_without = 0;
  int64_t computed = 0, skipped = 0;
  for (int64_t step = 0; step < a.steps; ++step) {
    const auto logical = load.sample();
    to_physical(managed.location(), logical, step, physical);
    const StepReport report = managed.step(physical);
    computed += report.rebalance_computed;
    skipped += report.rebalance_skipped;
    to_physical(initial, logical, step, physical);
    fixed.record_pass(initial, physical);
    fixed.end_step();
    const double with = managed.recorder().utilization(10), without = fixed.utilization(10);
    sum_with += with;
    sum_without += without;
    if ((step + 1) % a.report_every == 0) {
      timeline.push_back({{"step", step + 1}, {"utilization_rebalanced", with}, {"utilization_static", without}});
    }
    load.advance();
  }
  nlohmann::json out;
  out["settings"] = {{"layers", a.layers},
                     {"experts", a.experts},
                     {"replicas", a.replicas},
                     {"groups", a.groups},
                     {"nodes", a.nodes},
                     {"gpus", a.gpus},
                     {"exponent", a.exponent},
                     {"drift", a.drift},
                     {"steps", a.steps},
                     {"tokens", a.tokens},
                     {"topk", a.topk},
                     {"buffer_steps", a.buffer},
                     {"rebalance_every", a.every},
                     {"threshold", a.threshold},
                     {"layers_per_step", a.layers_per_step},
                     {"policy", a.policy},
                     {"migration_aware", !a.no_migration},
                     {"seed", a.seed},
                     {"expert_bytes", a.expert_bytes}};
  out["utilization_window_steps"] = 10;
  out["timeline"] = std::move(timeline);
  out["mean_utilization_rebalanced"] = sum_with / a.steps;
  out["mean_utilization_static"] = sum_without / a.steps;
  out["rebalances_computed"] = computed;
  out["rebalances_skipped"] = skipped;
  out["moved_experts"] = managed.total_moved_experts();
  out["moved_bytes"] = static_cast<double>(managed.total_moved_experts()) * a.expert_bytes;
  std::cout << out.dump() << "\n";
  if (!a.plot.empty()) plot_with_python(out, a.plot);
}

void add_eplb(CLI::App& app) {
  auto* eplb = app.add_subcommand("eplb", "Expert-parallel load balancing: placement and simulation");
  eplb->require_subcommand(1);

  auto plan_args = std::make_shared<PlanArgs>();
  auto* plan = eplb->add_subcommand("plan", "Compute an expert placement from a load file; prints JSON");
  plan->add_option("--weights", plan_args->weights, "JSON {\"weights\": [[...], ...]} or CSV, layers x logical")
      ->required();
  plan->add_option("--replicas", plan_args->replicas, "Physical experts per layer")->required();
  plan->add_option("--groups", plan_args->groups, "Expert groups")->required();
  plan->add_option("--nodes", plan_args->nodes, "Nodes")->required();
  plan->add_option("--gpus", plan_args->gpus, "GPUs")->required();
  plan->add_option("--policy", plan_args->policy, "deepseek | default")->capture_default_str();
  plan->add_option("--current", plan_args->current,
                   "Current placement JSON ({\"phy2log\": [[...]]}); reports moved_experts, and with the default "
                   "policy keeps experts in place unless moving buys balance");
  plan->add_option("--max-balance-loss", plan_args->max_balance_loss,
                   "Migration-aware: allowed balancedness loss vs a fresh placement")
      ->capture_default_str();
  plan->add_flag("--fresh", plan_args->fresh, "With --current: compute a fresh placement anyway");
  plan->callback([plan_args] { run_plan(*plan_args); });

  auto sim = std::make_shared<SimArgs>();
  auto* s = eplb->add_subcommand("simulate", "Simulate serving with a drifting Zipf load, with and without EPLB");
  s->add_option("--layers", sim->layers)->capture_default_str();
  s->add_option("--experts", sim->experts, "Logical experts")->capture_default_str();
  s->add_option("--replicas", sim->replicas, "Physical experts")->capture_default_str();
  s->add_option("--groups", sim->groups)->capture_default_str();
  s->add_option("--nodes", sim->nodes)->capture_default_str();
  s->add_option("--gpus", sim->gpus)->capture_default_str();
  s->add_option("--exponent", sim->exponent, "Zipf exponent")->capture_default_str();
  s->add_option("--drift", sim->drift, "Per-step probability that two neighbours in popularity swap")
      ->capture_default_str();
  s->add_option("--steps", sim->steps)->capture_default_str();
  s->add_option("--tokens", sim->tokens, "Tokens per step")->capture_default_str();
  s->add_option("--topk", sim->topk)->capture_default_str();
  s->add_option("--buffer", sim->buffer, "Recorder buffer, steps")->capture_default_str();
  s->add_option("--every", sim->every, "Rebalance every N steps (>= --buffer)")->capture_default_str();
  s->add_option("--threshold", sim->threshold, "Rebalance only below this utilization")->capture_default_str();
  s->add_option("--layers-per-step", sim->layers_per_step, "Layers applied per step (0 = all)")->capture_default_str();
  s->add_option("--policy", sim->policy, "deepseek | default")->capture_default_str();
  s->add_flag("--no-migration", sim->no_migration, "Fresh placements instead of migration-aware ones");
  s->add_option("--max-balance-loss", sim->max_balance_loss)->capture_default_str();
  s->add_option("--seed", sim->seed)->capture_default_str();
  s->add_option("--expert-bytes", sim->expert_bytes, "Bytes of one expert's weights")->capture_default_str();
  s->add_option("--report-every", sim->report_every, "Timeline sampling, steps")->capture_default_str();
  s->add_option("--plot", sim->plot, "Also draw utilization over time into this PNG (python3 -m epx.plot, matplotlib)");
  s->callback([sim] { run_simulate(*sim); });
}

const bool kRegistered = register_command(30, add_eplb);

}  // namespace

}  // namespace epx::cli
