// `epx eplb plan` and `epx eplb simulate`: expert placement from a load file, and a simulated serving run
// with load recording (SGLang's recorder modes, --record-mode / --records) and rebalancing. Both print JSON on
// stdout.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "command.h"
#include "eplb/placement_detail.h"
#include "eplb_input.h"
#include "epx/eplb/expert_location.h"
#include "epx/eplb/manager.h"
#include "epx/eplb/placement.h"
#include "epx/eplb/recorder.h"
#include "epx/eplb/sglang_format.h"
#include "epx/eplb/synthetic.h"
#include "epx/error.h"

namespace epx::cli {

namespace {

using namespace epx::eplb;

// Bounds of the flags (--help shows them). Sizes up to 2^20 keep every index product of the library in
// int64 and far from int32 per layer; the memory a run needs is checked separately (check_fits_in_memory).
constexpr int64_t kMaxSize = int64_t{1} << 20;
constexpr int64_t kMaxInt = INT32_MAX;
constexpr double kMaxExpertBytes = 1e15;               // moved_bytes = moved_experts x this stays far from overflow
constexpr int64_t kMaxStepLoad = int64_t{1} << 30;     // --tokens x --topk
constexpr int64_t kMaxRecordBytes = int64_t{1} << 40;  // --record-max-bytes
// A file's text as a parsed JSON document or vectors of doubles: at most this many bytes per byte of text.
constexpr double kParseBytesPerByte = 16;

// The placement shape's rules (the library's make_layout), naming the flags. `logical` names where the
// logical expert count comes from ("columns of --weights", "--experts").
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

struct SimArgs {
  int layers = 61, experts = 256, replicas = 288, groups = 8, nodes = 4, gpus = 32;
  double exponent = 1.0, drift = 0.01;
  int steps = 1000, tokens = 4096, topk = 8, buffer = 100, every = 100, layers_per_step = 8, report_every = 50;
  double threshold = 1.0, max_balance_loss = 0.01;  // threshold: SGLang's default, never skip
  std::string gate = "mean_step";
  std::string policy = "default";
  std::string plot;  // PNG path: drawn by the Python package's epx.plot (matplotlib)
  bool no_migration = false;
  uint64_t seed = 1;
  double expert_bytes = 3.0 * 7168 * 2048;  // DeepSeek-V3 expert: three 7168 x 2048 fp8 matrices
  std::string record_mode = "stat";
  std::string records;  // per_pass / per_token records as JSON (LoadRecorder::records_json)
  int64_t record_max_bytes = RecorderOptions{}.max_record_bytes;
};

// per_token: one pass's tokens made up from its physical counts. Per layer the slot choices, in slot order, are
// dealt to the tokens column by column (choice j goes to token j % num_tokens, top-k position j / num_tokens),
// so a token repeats a slot only when the slot has more choices than there are tokens; -1 pads. num_tokens is the
// fewest that holds every layer's choices, so the counts record_token_pass derives are exactly `physical`.
// topk: [num_layers * num_tokens * num_topk].
int64_t tokens_from_counts(const std::vector<int64_t>& physical, int num_layers, int num_topk,
                           std::vector<int64_t>& topk) {
  const size_t num_physical = physical.size() / num_layers;
  int64_t num_tokens = 0;
  for (int l = 0; l < num_layers; ++l) {
    int64_t sum = 0;
    for (size_t p = 0; p < num_physical; ++p) sum += physical[l * num_physical + p];
    num_tokens = std::max(num_tokens, (sum + num_topk - 1) / num_topk);
  }
  topk.assign(static_cast<size_t>(num_layers) * num_tokens * num_topk, -1);
  for (int l = 0; l < num_layers; ++l) {
    int64_t j = 0;
    int64_t* layer = topk.data() + static_cast<int64_t>(l) * num_tokens * num_topk;
    for (size_t p = 0; p < num_physical; ++p) {
      for (int64_t c = physical[l * num_physical + p]; c > 0; --c, ++j) {
        layer[(j % num_tokens) * num_topk + j / num_tokens] = static_cast<int64_t>(p);
      }
    }
  }
  return num_tokens;
}

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
// path as one single-quoted shell word: each ' becomes '\'' so a path cannot end the quoting.
std::string shell_quote(const std::string& path) {
  std::string quoted = "'";
  for (const char c : path) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

void plot_with_python(const nlohmann::json& result, const std::string& png) {
  const std::string json_path = png + ".json";
  std::ofstream(json_path) << result.dump();
  const char* python = std::getenv("EPX_PYTHON");
  const std::string command = std::string(python != nullptr ? python : "python3") + " -m epx.plot " +
                              shell_quote(json_path) + " " + shell_quote(png);
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
  // Ranges are checked by CLI11; here the rules between flags and the products, before any work.
  check_shape(a.experts, "--experts", a.replicas, a.groups, a.nodes, a.gpus);
  if (a.every < a.buffer) {
    throw BadInput(
        fmt::format("--every {} must be >= --buffer {} (a rebalance reads a full recorder buffer)", a.every, a.buffer));
  }
  // NOTE: one step's count of an expert is about --tokens x --topk (all of it with a steep Zipf) plus noise,
  // and the recorder keeps per-step counts in int32.
  if (static_cast<int64_t>(a.tokens) * a.topk > kMaxStepLoad) {
    throw BadInput(fmt::format("--tokens {} x --topk {} = {} exceeds 2^30 (per-step expert counts are int32)", a.tokens,
                               a.topk, static_cast<int64_t>(a.tokens) * a.topk));
  }
  const RecordMode mode = record_mode_from_string(a.record_mode);  // checked by CLI11
  const bool detailed = mode == RecordMode::kPerPass || mode == RecordMode::kPerToken;
  if (!a.records.empty() && !detailed) {
    throw BadInput(
        fmt::format("--records needs --record-mode per_pass or per_token, got --record-mode {} (stat "
                    "modes keep no per-pass records)",
                    a.record_mode));
  }
  // A lower bound: per (layer, slot) the two recorders' rings of int32 counts (min(--buffer, --steps) + 1 steps
  // each), their int64 sums, two placements (8 bytes each) and the step's int64 counts; per (layer, expert) the
  // sampled int64 count and the popularity order; per timeline entry a JSON object (>= 128 bytes).
  const double ring_steps = std::min(a.buffer, a.steps) + 1.0;
  const double slots = static_cast<double>(a.layers) * a.replicas;
  double bytes = slots * (8 * ring_steps + 16 + 16 + 8) + static_cast<double>(a.layers) * a.experts * 12 +
                 static_cast<double>(a.steps / a.report_every) * 128;
  std::string what = fmt::format(
      "simulate: --layers {} x --replicas {} x (2 x 4 bytes x (min(--buffer {}, --steps {}) + 1) + 40 bytes) + "
      "--layers x --experts {} x 12 bytes + --steps / --report-every {} x 128 bytes",
      a.layers, a.replicas, a.buffer, a.steps, a.experts, a.report_every);
  if (detailed) {
    // The records (at most --record-max-bytes, as the recorder counts them) and, per_token, one pass's made-up
    // tokens: --layers x (--tokens x --topk, the expected choices per layer) x 8 bytes.
    const double pass_bytes =
        slots * 4 + (mode == RecordMode::kPerToken ? static_cast<double>(a.layers) * a.tokens * a.topk * 4 : 0.0);
    bytes += std::min(static_cast<double>(a.record_max_bytes), pass_bytes * a.steps);
    what += fmt::format(" + min(--record-max-bytes {}, --steps x one record)", a.record_max_bytes);
    if (mode == RecordMode::kPerToken) {
      bytes += static_cast<double>(a.layers) * a.tokens * a.topk * 8;
      what += " + --layers x --tokens x --topk x 8 bytes";
    }
  }
  check_fits_in_memory(bytes, what);

  DriftingZipf load(a.layers, a.experts, a.exponent, static_cast<double>(a.tokens) * a.topk, a.drift, a.seed);
  // The manager's recorder (and the static run's) in a stat mode; per_pass / per_token records of the managed run's
  // passes go to a recorder of their own, which sees each pass under the placement it ran with (the manager's
  // own recorder cannot take per_token passes: it records counts).
  RecorderOptions rec;
  rec.buffer_steps = a.buffer;
  rec.mode = detailed ? RecordMode::kStat : mode;
  ManagerOptions opt;
  opt.num_groups = a.groups;
  opt.rebalance_every_steps = a.every;
  opt.utilization_threshold = a.threshold;
  opt.gate_statistic = gate_statistic_from_string(a.gate);
  opt.layers_per_step = a.layers_per_step;
  opt.policy = policy_from_string(a.policy);
  opt.migration_aware = !a.no_migration;
  opt.migration.max_balance_loss = a.max_balance_loss;
  // The library's own shape check as a backstop (the deepseek policy: the shape rules are the same, and it is
  // near-linear in the slots).
  rebalance({std::vector<double>(a.experts, 1.0)}, {a.replicas, a.groups, a.nodes, a.gpus}, Policy::kDeepSeek);
  if (validate_only()) return;
  // Opened before the run, so an unwritable path fails before the work.
  std::ofstream records_file;
  if (!a.records.empty()) {
    records_file.open(a.records);
    if (!records_file) throw BadInput(fmt::format("--records: cannot write '{}'", a.records));
  }
  const auto initial = ExpertLocation::trivial(a.layers, a.experts, a.replicas, a.gpus, a.nodes);
  std::optional<LoadRecorder> recorder;
  if (detailed) {
    RecorderOptions record_options;
    record_options.buffer_steps = 1;
    record_options.mode = mode;
    record_options.max_record_bytes = a.record_max_bytes;
    recorder.emplace(a.layers, a.experts, a.replicas, a.gpus, record_options);
  }
  std::vector<int64_t> topk;
  RebalanceManager managed(initial, rec, opt);
  LoadRecorder fixed(a.layers, a.experts, a.replicas, a.gpus, rec);  // the same load, never rebalanced

  nlohmann::json timeline = nlohmann::json::array();
  nlohmann::json rebalances = nlohmann::json::array();
  std::vector<int64_t> physical;
  double sum_with = 0, sum_without = 0;
  int64_t computed = 0, skipped = 0;
  for (int64_t step = 0; step < a.steps; ++step) {
    const auto logical = load.sample();
    to_physical(managed.location(), logical, step, physical);
    if (mode == RecordMode::kPerPass) {
      recorder->record_pass(managed.location(), physical);
      recorder->end_step();
    } else if (mode == RecordMode::kPerToken) {
      const int64_t num_tokens = tokens_from_counts(physical, a.layers, a.topk, topk);
      recorder->record_token_pass(managed.location(), topk, num_tokens, a.topk);
      recorder->end_step();
    }
    const StepReport report = managed.step(physical);
    computed += report.rebalance_computed;
    skipped += report.rebalance_skipped;
    if (report.rebalance_due) rebalances.push_back(nlohmann::json::parse(to_json(report.rebalance)));
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
                     {"gate_statistic", a.gate},
                     {"layers_per_step", a.layers_per_step},
                     {"policy", a.policy},
                     {"migration_aware", !a.no_migration},
                     {"seed", a.seed},
                     {"expert_bytes", a.expert_bytes},
                     {"record_mode", a.record_mode}};
  out["utilization_window_steps"] = 10;
  out["timeline"] = std::move(timeline);
  out["mean_utilization_rebalanced"] = sum_with / a.steps;
  out["mean_utilization_static"] = sum_without / a.steps;
  out["rebalances_computed"] = computed;
  out["rebalances_skipped"] = skipped;
  out["rebalances"] = std::move(rebalances);
  out["moved_experts"] = managed.total_moved_experts();
  out["moved_bytes"] = static_cast<double>(managed.total_moved_experts()) * a.expert_bytes;
  if (recorder) {
    out["records"] = {{"kept", recorder->records().size()},
                      {"dropped_passes", recorder->dropped_passes()},
                      {"bytes", recorder->record_bytes()},
                      {"max_bytes", a.record_max_bytes},
                      {"file", a.records.empty() ? nlohmann::json(nullptr) : nlohmann::json(a.records)}};
  }
  if (records_file.is_open()) {
    records_file << recorder->records_json(managed.location()) << "\n";
    records_file.close();
    if (!records_file) throw Error(ErrorCode::kInternal, fmt::format("--records: writing '{}' failed", a.records));
  }
  std::cout << out.dump() << "\n";
  if (!a.plot.empty()) plot_with_python(out, a.plot);
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

}  // namespace epx::cli
