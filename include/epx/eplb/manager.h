// The rebalance manager: records load every forward pass, periodically computes a new placement, and
// applies it a few layers per step so serving never stalls for all layers at once.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "epx/eplb/expert_location.h"
#include "epx/eplb/placement.h"
#include "epx/eplb/recorder.h"

namespace epx::eplb {

// The statistic a due rebalance compares with ManagerOptions::utilization_threshold.
//   kMeanStepUtilization SGLang's: the mean of the per-step utilizations (LoadRecorder::step_utilizations) of
//                        the steps since the last due rebalance (computed or skipped), at most the last
//                        kMaxUtilizationWindow (SGLang's 1000-pass history, cleared at every rebalance).
//   kBufferUtilization   one ratio of the buffer's summed counts (LoadRecorder::utilization(buffer_steps)):
//                        epx's earlier gate. Noise averages out in the sum, so on noisy loads it is higher
//                        than the mean of per-step values and skips more often.
enum class GateStatistic : uint8_t { kMeanStepUtilization, kBufferUtilization };
const char* to_string(GateStatistic statistic) noexcept;
// "mean_step" or "buffer"; throws Error(kInvalidArgument) otherwise.
GateStatistic gate_statistic_from_string(const std::string& name);

struct ManagerOptions {
  int num_groups = 1;                // expert groups of the model (for the hierarchical policy)
  int rebalance_every_steps = 1000;  // N: a rebalance is considered every N steps; N >= buffer_steps
  // A due rebalance is skipped only when the gate statistic is strictly above this (SGLang's
  // eplb_min_rebalancing_utilization_threshold, default 1.0). Utilization never exceeds 1, so the default
  // rebalances every N steps. In [0, 1].
  double utilization_threshold = 1.0;
  GateStatistic gate_statistic = GateStatistic::kMeanStepUtilization;
  int layers_per_step = 0;  // K: layers applied per step once a placement is computed; 0 = all
  Policy policy = Policy::kDefault;
  bool migration_aware = true;  // keep experts in place unless moving buys balance (kDefault only)
  MigrationOptions migration;
};

// One layer whose placement changed in this step: relocate its weights from old to new.
struct LayerUpdate {
  int layer = 0;
  std::vector<int32_t> old_phy2log;  // [num_physical]
  std::vector<int32_t> new_phy2log;  // [num_physical]
};

// What a due rebalance saw and decided; SGLang logs the same numbers ("[Expert Balancedness]" per pass and
// "[EPLBManager] Skipped ep rebalancing" when the gate skips). Balancedness / utilization of a step's counts =
// (mean GPU load + 1e-5) / (max GPU load + 1e-5) per layer, averaged over layers.
struct RebalanceReport {
  int64_t step = 0;                           // index of the step at which the rebalance was due
  double current_step_balancedness = 0;       // SGLang current_pass_balancedness: this step's utilization
  double last_10_average_balancedness = 0;    // SGLang last_10_average_balancedness: mean of the last 10 steps'
  double last_100_average_balancedness = 0;   //   utilizations (fewer when fewer were recorded since the
  double last_1000_average_balancedness = 0;  //   recorder was created or cleared)
  int64_t gpu_physical_count_sum = 0;         // SGLang gpu_physical_count_sum: this step's counts summed
  GateStatistic gate_statistic = GateStatistic::kMeanStepUtilization;
  int gate_window_steps = 0;    // steps the gate statistic covered
  double gate_utilization = 0;  // the gate statistic
  double threshold = 0;         // ManagerOptions::utilization_threshold
  bool skipped = false;         // gate_utilization > threshold: nothing computed
  // Placement quality on the buffer's logical loads (balancedness(), epx/eplb/placement.h): of the placement in
  // force and of the new one (equal to `before` when skipped).
  double placement_balancedness_before = 0;
  double placement_balancedness_after = 0;
  int64_t moved_experts = 0;   // slots that the new placement changes, over all its layers (0 when skipped)
  int num_changed_layers = 0;  // layers the new placement changes (applied K per step)
};
// One line in SGLang's wording: "[Expert Balancedness] forward_pass_id=... current_pass_balancedness=...
// last_10_average_balancedness=... ... gpu_physical_count_sum=... [EPLBManager] rebalance computed|skipped ...".
std::string to_log_line(const RebalanceReport& report);
// A JSON object with the struct's fields by name (gate_statistic as to_string()).
std::string to_json(const RebalanceReport& report);

struct StepReport {
  int64_t step = 0;                  // index of the step just recorded
  double utilization = 0;            // over the whole buffer (one ratio of summed counts), at this step
  double step_utilization = 0;       // of this step's own counts (LoadRecorder::step_utilizations)
  bool rebalance_computed = false;   // a new placement was computed in this step
  bool rebalance_skipped = false;    // a rebalance was due but the gate statistic was above the threshold
  bool rebalance_due = false;        // a rebalance was considered in this step: `rebalance` is filled
  RebalanceReport rebalance;         // when rebalance_due; also logged at info level (to_log_line)
  std::vector<LayerUpdate> updates;  // layers switched to the new placement in this step
  int64_t moved_experts = 0;         // slots that changed in `updates`
};

// Not thread-safe; one manager per process (all ranks see the same placement).
class RebalanceManager {
 public:
  // Throws Error(kInvalidArgument) for rebalance_every_steps < buffer_steps, utilization_threshold outside
  // [0, 1] (or NaN), layers_per_step < 0, or a num_groups the placement cannot use (checked on the first
  // rebalance).
  RebalanceManager(ExpertLocation initial, const RecorderOptions& recorder_options, const ManagerOptions& options);

  // Once per forward pass: records physical_counts ([num_layers * num_physical] under location(); the global
  // counts, e.g. all_reduce_counts of every rank's DispatchCounts), closes the step, and every N steps
  // computes a new placement from the buffered logical loads unless the gate statistic is strictly above
  // the threshold. Pending layers are applied K per step, starting in the step that computed them;
  // location() reflects them on return. A due step while layers are still pending is not a rebalance
  // (rebalance_due stays false); the next multiple of N is.
  StepReport step(std::span<const int64_t> physical_counts);

  const ExpertLocation& location() const { return location_; }
  const LoadRecorder& recorder() const { return recorder_; }
  LoadRecorder& recorder() { return recorder_; }
  int num_pending_layers() const { return static_cast<int>(pending_layers_.size()); }
  int64_t num_rebalances() const { return num_rebalances_; }
  int64_t total_moved_experts() const { return total_moved_experts_; }

 private:
  ExpertLocation location_;
  LoadRecorder recorder_;
  ManagerOptions options_;
  std::vector<int32_t> target_phy2log_;  // [num_layers * num_physical] while layers are pending
  std::vector<int> pending_layers_;
  int64_t last_due_step_ = -1;  // step index of the last due rebalance (computed or skipped)
  int64_t num_rebalances_ = 0;
  int64_t total_moved_experts_ = 0;
};

}  // namespace epx::eplb
