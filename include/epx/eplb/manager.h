// The rebalance manager: records load every forward pass, periodically computes a new placement, and
// applies it a few layers per step so serving never stalls for all layers at once.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "epx/eplb/expert_location.h"
#include "epx/eplb/placement.h"
#include "epx/eplb/recorder.h"

namespace epx::eplb {

struct ManagerOptions {
  int num_groups = 1;                  // expert groups of the model (for the hierarchical policy)
  int rebalance_every_steps = 1000;    // N: a rebalance is considered every N steps; N >= buffer_steps
  double utilization_threshold = 0.9;  // skip the rebalance while utilization over the buffer is >= this
  int layers_per_step = 0;             // K: layers applied per step once a placement is computed; 0 = all
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

struct StepReport {
  int64_t step = 0;                  // index of the step just recorded
  double utilization = 0;            // over the whole buffer, at this step
  bool rebalance_computed = false;   // a new placement was computed in this step
  bool rebalance_skipped = false;    // a rebalance was due but utilization was >= the threshold
  std::vector<LayerUpdate> updates;  // layers switched to the new placement in this step
  int64_t moved_experts = 0;         // slots that changed in `updates`
};

// Not thread-safe; one manager per process (all ranks see the same placement).
class RebalanceManager {
 public:
  // Throws Error(kInvalidArgument) for rebalance_every_steps < buffer_steps, threshold outside [0, 1],
  // layers_per_step < 0, or a num_groups the placement cannot use (checked on the first rebalance).
  RebalanceManager(ExpertLocation initial, const RecorderOptions& recorder_options, const ManagerOptions& options);

  // Once per forward pass: records physical_counts ([num_layers * num_physical] under location()), closes
  // the step, and every N steps computes a new placement from the buffered logical loads (unless
  // utilization is at or above the threshold). Pending layers are applied K per step, starting in the
  // step that computed them; location() reflects them on return. A new rebalance is not started while
  // layers are still pending.
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
  int64_t num_rebalances_ = 0;
  int64_t total_moved_experts_ = 0;
};

}  // namespace epx::eplb
