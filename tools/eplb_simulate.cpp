// `epx eplb simulate`: a simulated serving run with load recording (SGLang's recorder modes, --record-mode /
// --records) and rebalancing, beside the same load never rebalanced. Prints JSON on stdout. The flags are in
// cmd_eplb.cpp.
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
#include "eplb_command.h"
#include "epx/eplb/expert_location.h"
#include "epx/eplb/manager.h"
#include "epx/eplb/placement.h"
#include "epx/eplb/recorder.h"
#include "epx/eplb/synthetic.h"
#include "epx/error.h"

namespace epx::cli::eplb_cmd {

using namespace epx::eplb;

namespace {

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

}  // namespace

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

}  // namespace epx::cli::eplb_cmd
