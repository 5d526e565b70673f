// Expert load recording: per step, per layer, per physical expert slot counts in a ring buffer.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "epx/eplb/expert_location.h"
#include "epx/forward_mode.h"

namespace epx::eplb {

// What the recorder keeps besides the per-step counts (which every mode keeps):
//   kStat       nothing more: the passes of a step are summed into the step's counts.
//   kStatApprox as kStat, for counts that may be rounded up: SGLang's `stat_approx`, which takes the
//               per-local-expert receive counts of the normal dispatch (num_recv_tokens_per_expert, each
//               rounded up to expert_alignment, 128 under DeepGEMM) instead of counting top-k choices. Only
//               in this mode does DispatchCounts accept aligned (> 1) normal-dispatch counts
//               (epx/eplb/dispatch_counts.h).
//   kPerPass    also one record per forward pass (SGLang's `per_pass`): its id, rank and counts
//               [num_layers, num_physical] (records()).
//   kPerToken   also one record per forward pass with every token's top-k physical slots in every layer
//               (SGLang's `per_token`); the counts are derived from them. Fed by record_token_pass only.
// The records of kPerPass / kPerToken are kept from construction or clear() on (not evicted with the ring, as
// SGLang keeps them until its dump), up to RecorderOptions::max_record_bytes; a pass over the cap is counted in
// dropped_passes() and its record dropped, its counts still enter the step.
enum class RecordMode : uint8_t { kStat, kPerPass, kPerToken, kStatApprox };
const char* to_string(RecordMode mode) noexcept;
// "stat", "stat_approx", "per_pass" or "per_token"; throws Error(kInvalidArgument) otherwise.
RecordMode record_mode_from_string(const std::string& name);

struct RecorderOptions {
  int buffer_steps = 1000;  // ring size in steps, >= 1. Memory: buffer_steps * num_layers * num_physical * 4 bytes
  RecordMode mode = RecordMode::kStat;
  int rank = 0;  // >= 0: written into each per_pass / per_token record (SGLang's record "rank")
  // Cap on the memory of the per_pass / per_token records, >= 0 (0 keeps none). A record takes
  // num_layers * num_physical * 4 bytes, plus per_token num_layers * num_tokens * num_topk * 4 and 8 per input id,
  // position and extend length, plus ~200 bytes. Default 256 MiB: ~930 DeepSeek-V3 per_pass records (61 x 288
  // slots) or ~120 000 per_token tokens (61 layers x top-8).
  int64_t max_record_bytes = int64_t{256} << 20;
};

// What one forward pass is (SGLang's with_forward_pass(forward_pass_id, forward_batch)).
struct PassInfo {
  // >= 0, or -1: the previous pass's id + 1 (the first pass is 1: SGLang's ModelRunner increments its
  // forward_pass_id before each forward).
  int64_t forward_pass_id = -1;
  std::optional<ForwardMode> forward_mode{};  // unknown if empty
  // per_token metadata (SGLang's forward_batch.input_ids, positions, extend_seq_lens_cpu), each optional (empty):
  std::vector<int64_t> input_ids{};        // [num_tokens]
  std::vector<int64_t> positions{};        // [num_tokens]
  std::vector<int64_t> extend_seq_lens{};  // [num_seqs], each >= 0, sum <= num_tokens
};

// One per_pass / per_token record (SGLang's _DetailAccumulator record).
struct PassRecord {
  int64_t forward_pass_id = 0;
  int rank = 0;
  int64_t step = 0;  // the step the pass was recorded in (num_steps() then)
  std::optional<ForwardMode> forward_mode;
  // This rank's counts in global slot order (SGLang's global_physical_count: what this rank's gatherer saw, not
  // reduced over ranks). [num_layers * num_physical]
  std::vector<int32_t> global_physical_count;
  std::shared_ptr<const std::vector<int32_t>> phy2log;  // the placement in force, [num_layers * num_physical]
  // per_token only:
  int64_t num_tokens = 0;
  int num_topk = 0;
  std::vector<int32_t> topk_ids;  // [num_layers * num_tokens * num_topk] physical slots, -1: none
  std::vector<int64_t> input_ids, positions, extend_seq_lens;
};

// SGLang's ForwardMode value (its IntEnum, auto() from 1): EXTEND 1, DECODE 2, MIXED 3, IDLE 4, TARGET_VERIFY 5,
// DRAFT_EXTEND 6 (DRAFT_EXTEND_V2 in newer SGLang), PREBUILT 7. What SGLang's per_token record stores as
// "forward_mode".
int sglang_forward_mode_value(ForwardMode mode) noexcept;

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
  // physical_counts: [num_layers * num_physical], each in [0, 2^31). Not allowed in kPerToken mode. kPerPass: also
  // keeps a record (info: its id and forward mode; the per_token fields must be empty).
  void record_pass(const ExpertLocation& location, std::span<const int64_t> physical_counts, const PassInfo& info = {});
  // kPerToken mode only: one forward pass's top-k physical slots in every layer, as SGLang's select-experts hook
  // sees them (after the logical-to-physical map); -1 is no expert (padding, layers not run). Counts each slot
  // choice into the step and keeps the record. topk_physical: [num_layers * num_tokens * num_topk], each in
  // [-1, num_physical); num_tokens >= 0; num_topk >= 1; info.input_ids / positions empty or [num_tokens].
  // Throws Error(kInvalidArgument) naming the argument; nothing is recorded then.
  void record_token_pass(const ExpertLocation& location, std::span<const int64_t> topk_physical, int64_t num_tokens,
                         int num_topk, const PassInfo& info = {});
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

  // kPerPass / kPerToken: the records since construction or clear(), oldest first (empty in other modes).
  const std::vector<PassRecord>& records() const { return records_; }
  int64_t dropped_passes() const { return dropped_passes_; }  // passes whose record exceeded max_record_bytes
  int64_t record_bytes() const { return record_bytes_; }      // memory the records take, as max_record_bytes counts
  // The records as SGLang's per_pass / per_token dump (expert_distribution_recorder_<time>_<rank>.pt), in JSON:
  //   {"records": [{"forward_pass_id", "rank", "gatherer_key": "primary", "global_physical_count": [L][P],
  //                 per_token: "input_ids", "positions", "extend_seq_lens", "forward_mode" (SGLang's value or
  //                 null), "topk_ids_of_layer": [L][T][K], "misc_objects": []} ...],
  //    "last_physical_to_logical_map": [L][P] (of `last_location`)}
  // plus epx's fields: per record "step", "forward_mode_name", "logical_count" [L][E] (the counts under the
  // placement the pass ran with) and per_pass "forward_mode"; top level "mode", "rank", "dropped_passes",
  // "max_record_bytes". Throws Error(kInvalidArgument) in stat / stat_approx mode (their dump is logical_count:
  // eplb/sglang_format.h) or for a location of another shape. SGLang's dump resets its recorder: call clear().
  std::string records_json(const ExpertLocation& last_location) const;

  // Drops everything recorded: steps, per-step utilizations, records and the dropped count (num_steps() and the
  // forward pass ids keep counting).
  void clear();

 private:
  struct Step {
    int64_t index = 0;
    std::shared_ptr<const std::vector<int32_t>> phy2log;  // placement in force, [num_layers * num_physical]
    std::vector<int32_t> counts;                          // [num_layers * num_physical]
  };
  void check_location(const ExpertLocation& location) const;
  void use_placement(const ExpertLocation& location);
  int64_t next_pass_id(const PassInfo& info);
  void keep_record(PassRecord record);
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
  std::vector<PassRecord> records_;
  int64_t record_bytes_ = 0;
  int64_t dropped_passes_ = 0;
  int64_t last_pass_id_ = 0;
};

}  // namespace epx::eplb
