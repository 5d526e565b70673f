#include "epx/eplb/manager.h"

#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "eplb/placement_detail.h"
#include "epx/log.h"

namespace epx::eplb {

const char* to_string(GateStatistic statistic) noexcept {
  switch (statistic) {
    case GateStatistic::kMeanStepUtilization:
      return "mean_step";
    case GateStatistic::kBufferUtilization:
      return "buffer";
  }
  return "?";
}

GateStatistic gate_statistic_from_string(const std::string& name) {
  if (name == "mean_step") return GateStatistic::kMeanStepUtilization;
  if (name == "buffer") return GateStatistic::kBufferUtilization;
  epx::detail::raise(ErrorCode::kInvalidArgument, "gate statistic must be 'mean_step' or 'buffer', got '{}'", name);
}

std::string to_log_line(const RebalanceReport& r) {
  std::string line = fmt::format(
      "[Expert Balancedness] forward_pass_id={} current_pass_balancedness={:.3f} last_10_average_balancedness={:.3f} "
      "last_100_average_balancedness={:.3f} last_1000_average_balancedness={:.3f} gpu_physical_count_sum={} ",
      r.step, r.current_step_balancedness, r.last_10_average_balancedness, r.last_100_average_balancedness,
      r.last_1000_average_balancedness, r.gpu_physical_count_sum);
  if (r.skipped) {
    line += fmt::format(
        "[EPLBManager] Skipped ep rebalancing: current GPU utilization {:.2f} > minimum rebalance threshold {:.2f} "
        "({} over {} steps)",
        r.gate_utilization, r.threshold, to_string(r.gate_statistic), r.gate_window_steps);
  } else {
    line += fmt::format(
        "[EPLBManager] rebalance computed: GPU utilization {:.3f} ({} over {} steps, threshold {:.2f}) "
        "placement_balancedness {:.3f} -> {:.3f} moved_experts={} layers={}",
        r.gate_utilization, to_string(r.gate_statistic), r.gate_window_steps, r.threshold,
        r.placement_balancedness_before, r.placement_balancedness_after, r.moved_experts, r.num_changed_layers);
  }
  return line;
}

std::string to_json(const RebalanceReport& r) {
  const nlohmann::json j = {{"step", r.step},
                            {"current_step_balancedness", r.current_step_balancedness},
                            {"last_10_average_balancedness", r.last_10_average_balancedness},
                            {"last_100_average_balancedness", r.last_100_average_balancedness},
                            {"last_1000_average_balancedness", r.last_1000_average_balancedness},
                            {"gpu_physical_count_sum", r.gpu_physical_count_sum},
                            {"gate_statistic", to_string(r.gate_statistic)},
                            {"gate_window_steps", r.gate_window_steps},
                            {"gate_utilization", r.gate_utilization},
                            {"threshold", r.threshold},
                            {"skipped", r.skipped},
                            {"placement_balancedness_before", r.placement_balancedness_before},
                            {"placement_balancedness_after", r.placement_balancedness_after},
                            {"moved_experts", r.moved_experts},
                            {"num_changed_layers", r.num_changed_layers}};
  return j.dump();
}

RebalanceManager::RebalanceManager(ExpertLocation initial, const RecorderOptions& recorder_options,
                                   const ManagerOptions& options)
    : location_(std::move(initial)),
      recorder_(location_.num_layers(), location_.num_logical(), location_.num_physical(), location_.num_gpus(),
                recorder_options),
      options_(options) {
  EPX_CHECK_ARG(options.rebalance_every_steps >= recorder_options.buffer_steps,
                "rebalance_every_steps ({}) must be >= the recorder buffer size ({} steps)",
                options.rebalance_every_steps, recorder_options.buffer_steps);
  // NOTE: written so that NaN fails too. SGLang does not check; utilization is in (0, 1], so values above 1
  // would act as 1 and negative ones would skip every rebalance: both are rejected as likely mistakes.
  EPX_CHECK_ARG(options.utilization_threshold >= 0 && options.utilization_threshold <= 1,
                "utilization_threshold must be in [0, 1] (1 = never skip, SGLang's default), got {}",
                options.utilization_threshold);
  EPX_CHECK_ARG(options.layers_per_step >= 0, "layers_per_step must be >= 0, got {}", options.layers_per_step);
  EPX_CHECK_ARG(options.num_groups >= 1, "num_groups must be >= 1, got {}", options.num_groups);
}

StepReport RebalanceManager::step(std::span<const int64_t> physical_counts) {
  recorder_.record_pass(location_, physical_counts);
  recorder_.end_step();
  StepReport report;
  report.step = recorder_.num_steps() - 1;
  report.utilization = recorder_.utilization(recorder_.buffer_steps());

  report.step_utilization = recorder_.step_utilizations(1).back();

  const bool due = recorder_.num_steps() % options_.rebalance_every_steps == 0;
  if (due && pending_layers_.empty()) {
    report.rebalance_due = true;
    RebalanceReport& rb = report.rebalance;
    rb.step = report.step;
    rb.current_step_balancedness = report.step_utilization;
    rb.last_10_average_balancedness = recorder_.mean_step_utilization(10);
    rb.last_100_average_balancedness = recorder_.mean_step_utilization(100);
    rb.last_1000_average_balancedness = recorder_.mean_step_utilization(1000);
    rb.gpu_physical_count_sum = recorder_.last_step_count_sum();
    rb.gate_statistic = options_.gate_statistic;
    rb.threshold = options_.utilization_threshold;
    if (options_.gate_statistic == GateStatistic::kMeanStepUtilization) {
      rb.gate_window_steps = static_cast<int>(std::min<int64_t>(report.step - last_due_step_, kMaxUtilizationWindow));
      rb.gate_utilization = recorder_.mean_step_utilization(rb.gate_window_steps);
    } else {
      rb.gate_window_steps = recorder_.steps_in_buffer();
      rb.gate_utilization = report.utilization;
    }
    last_due_step_ = report.step;

    const int num_layers = location_.num_layers(), num_logical = location_.num_logical();
    const auto loads = recorder_.logical_loads(recorder_.buffer_steps());
    std::vector<std::vector<double>> weight(num_layers, std::vector<double>(num_logical));
    for (int l = 0; l < num_layers; ++l) {
      for (int e = 0; e < num_logical; ++e) {
        weight[l][e] = static_cast<double>(loads[static_cast<int64_t>(l) * num_logical + e]);
      }
    }
    const std::vector<int32_t>& current = *location_.phy2log_table();
    rb.placement_balancedness_before = balancedness(weight, current, location_.num_physical(), location_.num_gpus());
    rb.placement_balancedness_after = rb.placement_balancedness_before;
    // SGLang: skip only when strictly above the threshold.
    if (rb.gate_utilization > options_.utilization_threshold) {
      rb.skipped = true;
      report.rebalance_skipped = true;
    } else {
      const PlacementShape shape{location_.num_physical(), options_.num_groups, location_.num_nodes(),
                                 location_.num_gpus()};
      // NOTE: only phy2log is needed: the *_unmapped forms skip log2phy, which a hot expert can make huge.
      if (options_.migration_aware && options_.policy == Policy::kDefault) {
        target_phy2log_ =
            detail::rebalance_migration_aware_unmapped(weight, shape, current, options_.migration).placement.phy2log;
      } else {
        target_phy2log_ = detail::rebalance_unmapped(weight, shape, options_.policy).placement.phy2log;
      }
      report.rebalance_computed = true;
      ++num_rebalances_;
      const int num_physical = location_.num_physical();
      for (int l = 0; l < num_layers; ++l) {
        const auto cur = location_.phy2log(l);
        if (!std::equal(cur.begin(), cur.end(), target_phy2log_.begin() + static_cast<int64_t>(l) * num_physical)) {
          pending_layers_.push_back(l);
        }
      }
      rb.placement_balancedness_after =
          balancedness(weight, target_phy2log_, location_.num_physical(), location_.num_gpus());
      rb.moved_experts = count_moved_experts(current, target_phy2log_);
      rb.num_changed_layers = static_cast<int>(pending_layers_.size());
    }
    epx::log(LogLevel::kInfo, to_log_line(rb));
  }

  const int budget = options_.layers_per_step == 0 ? static_cast<int>(pending_layers_.size())
                                                   : std::min<int>(options_.layers_per_step, pending_layers_.size());
  const int num_physical = location_.num_physical();
  for (int i = 0; i < budget; ++i) {
    const int l = pending_layers_[i];
    LayerUpdate update;
    update.layer = l;
    const auto cur = location_.phy2log(l);
    update.old_phy2log.assign(cur.begin(), cur.end());
    const auto first = target_phy2log_.begin() + static_cast<int64_t>(l) * num_physical;
    update.new_phy2log.assign(first, first + num_physical);
    location_.set_layer(l, update.new_phy2log);
    for (int s = 0; s < num_physical; ++s) report.moved_experts += update.old_phy2log[s] != update.new_phy2log[s];
    report.updates.push_back(std::move(update));
  }
  pending_layers_.erase(pending_layers_.begin(), pending_layers_.begin() + budget);
  total_moved_experts_ += report.moved_experts;
  return report;
}

}  // namespace epx::eplb
