// One rank's expert counts of a forward pass, taken from what the dispatch already reports, and the sum of
// every rank's counts over the EP group: the global physical counts the recorder and the rebalancer read.
//
// A serving step on each rank:
//   DispatchCounts counts(L, P, R, group.rank(), RecordMode::kStatApprox);
//   per MoE layer:   counts.add_normal_dispatch(layer, result.num_recv_tokens_per_expert, expert_alignment);
//                or  counts.add_low_latency_cumulative(layer, cumulative_recv_counts);  // host copy
//   after the pass:  auto global = counts.take(); all_reduce_counts(group, global); manager.step(global);
// Every rank then holds the same global counts, so every rank's manager computes the same placement.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "epx/eplb/recorder.h"
#include "epx/group.h"

namespace epx::eplb {

// Accumulates one rank's counts of the current pass in global slot order ([num_layers * num_physical]; the
// rank's own slots are [rank * num_physical / num_gpus, (rank + 1) * num_physical / num_gpus)). SGLang's
// single-pass gatherers:
//   add_normal_dispatch        its stat_approx gatherer (DeepEP normal num_recv_tokens_per_expert);
//   add_low_latency_cumulative its low-latency gatherer (the per-local-expert receive counts of each call);
//   add_topk                   its select-experts gatherer (every slot this rank's tokens chose).
// The first two count what this rank *received* (its own slots only); add_topk counts what this rank *sent*
// (any slot). Summed over ranks both give the same global counts (with expert_alignment 1), but one pass
// must not mix them, or the sum counts each pair twice: a mix throws. Not thread-safe; one per rank.
class DispatchCounts {
 public:
  // Throws Error(kInvalidArgument) for counts < 1, num_physical % num_gpus != 0, rank outside [0, num_gpus)
  // or mode kPerToken (which records tokens: LoadRecorder::record_tokens).
  DispatchCounts(int num_layers, int num_physical, int num_gpus, int rank, RecordMode mode);

  // Normal dispatch of `layer` on this rank: DispatchResult::num_recv_tokens_per_expert, [num_physical /
  // num_gpus], each already rounded up to `expert_alignment` by the dispatch. With expert_alignment > 1 the
  // counts are approximate (a local expert that received 1 pair counts 128), which only kStatApprox accepts,
  // as in SGLang; other modes throw and need expert_alignment 1 (exact) or add_topk. Counts must be >= 0.
  void add_normal_dispatch(int layer, std::span<const int32_t> num_recv_tokens_per_expert, int expert_alignment);
  // Low-latency dispatch of `layer` on this rank: a host copy of the int32 [num_physical / num_gpus]
  // cumulative_recv_counts that the dispatch increments (LowLatencyDispatchArgs). Adds the increase since the
  // last call for the same layer, modulo 2^32 (so the int32 counters may wrap); the first call of a layer
  // adds the values themselves (counters start at 0). Use one counter array per layer, or one read per
  // dispatch per layer; after zeroing a counter call reset_low_latency_baseline(layer). Exact in every mode.
  void add_low_latency_cumulative(int layer, std::span<const int32_t> cumulative_recv_counts);
  void reset_low_latency_baseline(int layer);
  // The physical slots chosen by this rank's tokens in `layer` ([num_tokens * num_topk], -1 ignored): each
  // counts once for its slot. Exact in every mode.
  void add_topk(int layer, std::span<const int64_t> topk_physical);

  // This rank's counts of the pass, [num_layers * num_physical]; starts the next pass (counts zeroed, mix
  // check reset; the low-latency baselines are kept).
  std::vector<int64_t> take();

  int rank() const { return rank_; }
  int num_gpus() const { return num_gpus_; }
  RecordMode mode() const { return mode_; }

 private:
  enum class Source : uint8_t { kNone, kReceived, kSent };
  void use_source(Source source, const char* call);
  void check_layer(int layer) const;

  int num_layers_, num_physical_, num_gpus_, rank_, slots_per_gpu_;
  RecordMode mode_;
  Source source_ = Source::kNone;
  std::vector<int64_t> counts_;        // [num_layers * num_physical]
  std::vector<uint32_t> ll_baseline_;  // [num_layers * slots_per_gpu]: last cumulative value seen
};

// Sums `counts` element-wise over the ranks of `group`, in rank order, into `counts` on every rank (an
// all-reduce over the EP group; SGLang all-reduces its logical counts and reduces its per-GPU counts the same
// way). Built on Group::all_gather_bytes, so it runs on host groups (ranks as threads) and CUDA groups alike:
// counts are host memory, the call blocks like a barrier and allocates num_ranks * counts.size() int64 on the
// host. Collective: every rank calls it. Every rank checks the same gathered data, so a bad input throws
// Error(kInvalidArgument) on every rank: counts of different sizes on different ranks (naming the ranks),
// a negative count or a sum above INT64_MAX (naming the rank and index). Throws kTimeout like the group.
void all_reduce_counts(Group& group, std::span<int64_t> counts);

}  // namespace epx::eplb
