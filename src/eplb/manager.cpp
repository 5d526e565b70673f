#include "epx/eplb/manager.h"

#include <algorithm>

#include "core/check.h"
#include "eplb/placement_detail.h"

namespace epx::eplb {

RebalanceManager::RebalanceManager(ExpertLocation initial, const RecorderOptions& recorder_options,
                                   const ManagerOptions& options)
    : location_(std::move(initial)),
      recorder_(location_.num_layers(), location_.num_logical(), location_.num_physical(), location_.num_gpus(),
                recorder_options),
      options_(options) {
  EPX_CHECK_ARG(options.rebalance_every_steps >= recorder_options.buffer_steps,
                "rebalance_every_steps ({}) must be >= the recorder buffer size ({} steps)",
                options.rebalance_every_steps, recorder_options.buffer_steps);
  EPX_CHECK_ARG(options.utilization_threshold >= 0 && options.utilization_threshold <= 1,
                "utilization_threshold must be in [0, 1], got {}", options.utilization_threshold);
  EPX_CHECK_ARG(options.layers_per_step >= 0, "layers_per_step must be >= 0, got {}", options.layers_per_step);
  EPX_CHECK_ARG(options.num_groups >= 1, "num_groups must be >= 1, got {}", options.num_groups);
}

StepReport RebalanceManager::step(std::span<const int64_t> physical_counts) {
  recorder_.record_pass(location_, physical_counts);
  recorder_.end_step();
  StepReport report;
  report.step = recorder_.num_steps() - 1;
  report.utilization = recorder_.utilization(recorder_.buffer_steps());

  const bool due = recorder_.num_steps() % options_.rebalance_every_steps == 0;
  if (due && pending_layers_.empty()) {
    if (report.utilization >= options_.utilization_threshold) {
      report.rebalance_skipped = true;
    } else {
      const int num_layers = location_.num_layers(), num_logical = location_.num_logical();
      const auto loads = recorder_.logical_loads(recorder_.buffer_steps());
      std::vector<std::vector<double>> weight(num_layers, std::vector<double>(num_logical));
      for (int l = 0; l < num_layers; ++l) {
        for (int e = 0; e < num_logical; ++e) {
          weight[l][e] = static_cast<double>(loads[static_cast<int64_t>(l) * num_logical + e]);
        }
      }
      const PlacementShape shape{location_.num_physical(), options_.num_groups, location_.num_nodes(),
                                 location_.num_gpus()};
      // NOTE: only phy2log is needed: the *_unmapped forms skip log2phy, which a hot expert can make huge.
      if (options_.migration_aware && options_.policy == Policy::kDefault) {
        target_phy2log_ =
            detail::rebalance_migration_aware_unmapped(weight, shape, *location_.phy2log_table(), options_.migration)
                .placement.phy2log;
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
    }
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
