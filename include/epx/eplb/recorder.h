// Expert load recording: per step, per layer, per physical expert slot counts in a ring buffer.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "epx/eplb/expert_location.h"

namespace epx::eplb {

// What the recorder keeps besides the per-step counts (which every mode keeps):
//   kStat       nothing more: the passes of a step are summed into the step's counts.
//   kStatApprox as kStat, for counts that may be rounded up: SGLang's `stat_approx`, which takes the
//               per-local-expert receive counts of the normal dispatch (num_recv_tokens_per_expert, each
//               rounded up to expert_alignment, 128 under DeepGEMM) instead of counting top-k choices. Only
//               in this mode does DispatchCounts accept aligned (> 1) normal-dispatch counts
//               (epx/eplb/dispatch_counts.h).
//   kPerPass    also each forward pass's own counts (passes(); a step may hold several passes, e.g. the
//               two micro-batches of two-batch overlap).
//   kPerToken   also the physical slot each token chose in each layer (tokens()); counts are derived
//               from them. Memory grows with tokens: use a small buffer.
enum class RecordMode : uint8_t { kStat, kPerPass, kPerToken, kStatApprox };
const char* to_string(RecordMode mode) noexcept;
// "stat", "stat_approx", "per_pass" or "per_token"; throws Error(kInvalidArgument) otherwise.
RecordMode record_mode_from_string(const std::string& name);

struct RecorderOptions {
  int buffer_steps = 1000;  // ring size in steps, >= 1. Memory: buffer_steps * num_layers * num_physical * 4 bytes
  RecordMode mode = RecordMode::kStat;
};

// The standard utilization windows, in steps (SGLang's last_10/100/1000_average_balancedness).
inline constexpr int kUtilizationWindows[] = {10, 100, 1000};
// Per-step utilizations kept at least this far back (the largest standard window).
inline constexpr int kMaxUtilizationWindow = 1000;

// Not thread-safe: one recorder per rank (or guard it).
class LoadRecorder {
 public:
  // Throws Error(kInvalidArgument) for counts < 1, num_physical % num_gpus != 0 or buffer_steps < 1.
  LoadRecorder(int num_layers, int num_logical, int num_physical, int num_gpus, const RecorderOptions& options = {});

  // Adds one forward pass's counts under `location` (whose phy2log maps them to logical experts).
  // physical_counts: [num_layers * num_physical], each in [0, 2^31). Not allowed in kPerToken mode.
  void record_pass(const ExpertLocation& location, std::span<const int64_t> physical_counts);
  // kPerToken mode only: the physical slots chosen in `layer` by this pass's tokens, -1 ignored.
  // topk_physical: [num_tokens * num_topk].
  void record_tokens(const ExpertLocation& location, int layer, std::span<const int64_t> topk_physical);
  // Closes the current step: it enters the ring, evicting the oldest step when full.
  void end_step();

  int64_t num_steps() const { return num_steps_; }  // steps closed so far
  int buffer_steps() const { return options_.buffer_steps; }
  int steps_in_buffer() const { return static_cast<int>(ring_.size()); }
  RecordMode mode() const { return options_.mode; }

  // Sums over the last min(window, steps_in_buffer()) closed steps; window >= 1. O(1) per element when the
  // window covers the whole buffer (a running sum), else O(window).
  std::vector<int64_t> physical_loads(int window) const;  // [num_layers * num_physical]
  // Physical counts mapped to logical experts with the placement each step was recorded under.
  std::vector<int64_t> logical_loads(int window) const;  // [num_layers * num_logical]
  // (mean GPU load + 1e-5) / (max GPU load + 1e-5) per layer over the window, under the placement each
  // step was recorded under. [num_layers]
  std::vector<double> utilization_per_layer(int window) const;
  // utilization_per_layer averaged over layers: one ratio of the window's summed counts.
  double utilization(int window) const;

  // Per-step utilization: utilization_per_layer of one step's own counts, averaged over layers, computed when
  // the step closes (1 for a step without counts). SGLang computes this per forward pass ("balancedness")
  // from the global physical counts; one epx step is one SGLang forward pass (the passes of a step, e.g. two
  // TBO micro-batches, are summed first). Kept for the last max(kMaxUtilizationWindow, buffer_steps) steps.
  // The values of the last min(window, available) closed steps since construction or clear(), oldest first;
  // window >= 1.
  std::vector<double> step_utilizations(int window) const;
  // Their mean (SGLang's last_<window>_average_balancedness and, over the steps since the last rebalance
  // attempt, its rebalance gate statistic); 1 when no step was closed. This is lower than utilization(window)
  // on noisy loads: the max of each step's GPU loads is averaged, not the max of their sum.
  double mean_step_utilization(int window) const;
  // Counts of the last closed step summed over layers and slots (SGLang's gpu_physical_count_sum); 0 before
  // the first step.
  int64_t last_step_count_sum() const { return last_step_count_sum_; }

  struct PassRecord {
    int64_t step;                 // index of the step the pass belongs to
    std::vector<int32_t> counts;  // [num_layers * num_physical]
  };
  // kPerPass: the passes of the buffered steps, oldest first. Empty in other modes.
  std::vector<PassRecord> passes() const;
  struct TokenRecord {
    int64_t step;
    int layer;
    std::vector<int32_t> topk_physical;  // as recorded, -1 kept
  };
  // kPerToken: the token records of the buffered steps, oldest first. Empty in other modes.
  std::vector<TokenRecord> tokens() const;

  // Drops everything recorded, per-step utilizations included (num_steps() keeps counting).
  void clear();

 private:
  struct Step {
    int64_t index = 0;
    std::shared_ptr<const std::vector<int32_t>> phy2log;  // placement in force, [num_layers * num_physical]
    std::vector<int32_t> counts;                          // [num_layers * num_physical]
    std::vector<PassRecord> passes;
    std::vector<TokenRecord> tokens;
  };
  void check_location(const ExpertLocation& location) const;
  std::vector<const Step*> window_steps(int window) const;
  double counts_utilization(const int32_t* counts) const;  // [num_layers * num_physical]

  int num_layers_, num_logical_, num_physical_, num_gpus_;
  RecorderOptions options_;
  Step open_;
  std::vector<Step> ring_;           // oldest first after rotation; see ring_head_
  int ring_head_ = 0;                // index of the oldest step once the ring is full
  std::vector<int64_t> buffer_sum_;  // [num_layers * num_physical] counts summed over the ring
  int64_t num_steps_ = 0;
  std::vector<double> step_utilization_;  // ring of per-step utilizations, capacity max(1000, buffer_steps)
  int step_utilization_head_ = 0;         // index of the oldest value once the ring is full
  int64_t last_step_count_sum_ = 0;
};

}  // namespace epx::eplb
