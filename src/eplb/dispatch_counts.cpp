#include "epx/eplb/dispatch_counts.h"

#include <algorithm>
#include <limits>

#include "core/check.h"

namespace epx::eplb {

DispatchCounts::DispatchCounts(int num_layers, int num_physical, int num_gpus, int rank, RecordMode mode)
    : num_layers_(num_layers), num_physical_(num_physical), num_gpus_(num_gpus), rank_(rank), mode_(mode) {
  EPX_CHECK_ARG(num_layers >= 1 && num_physical >= 1, "num_layers and num_physical must be >= 1, got {}, {}",
                num_layers, num_physical);
  EPX_CHECK_ARG(num_gpus >= 1 && num_physical % num_gpus == 0, "num_physical ({}) must be divisible by num_gpus ({})",
                num_physical, num_gpus);
  EPX_CHECK_ARG(rank >= 0 && rank < num_gpus, "rank must be in [0, {}), got {}", num_gpus, rank);
  EPX_CHECK_ARG(mode != RecordMode::kPerToken,
                "DispatchCounts does not serve per_token mode (use LoadRecorder::record_token_pass)");
  slots_per_gpu_ = num_physical / num_gpus;
  counts_.assign(static_cast<size_t>(num_layers) * num_physical, 0);
  ll_baseline_.assign(static_cast<size_t>(num_layers) * slots_per_gpu_, 0);
}

void DispatchCounts::check_layer(int layer) const {
  EPX_CHECK_ARG(layer >= 0 && layer < num_layers_, "layer must be in [0, {}), got {}", num_layers_, layer);
}

void DispatchCounts::use_source(Source source, const char* call) {
  EPX_CHECK_ARG(source_ == Source::kNone || source_ == source,
                "{}: this pass already has {} counts; received (dispatch) and sent (top-k) counts of one pass "
                "would count each pair twice once summed over ranks",
                call, source_ == Source::kSent ? "sent (add_topk)" : "received (dispatch)");
  source_ = source;
}

void DispatchCounts::add_normal_dispatch(int layer, std::span<const int32_t> num_recv_tokens_per_expert,
                                         int expert_alignment) {
  check_layer(layer);
  EPX_CHECK_ARG(expert_alignment >= 1, "expert_alignment must be >= 1, got {}", expert_alignment);
  EPX_CHECK_ARG(expert_alignment == 1 || mode_ == RecordMode::kStatApprox,
                "normal-dispatch counts rounded up to expert_alignment {} are approximate: only stat_approx mode "
                "takes them (the recorder is in {}; use expert_alignment 1 or add_topk)",
                expert_alignment, to_string(mode_));
  EPX_CHECK_ARG(num_recv_tokens_per_expert.size() == static_cast<size_t>(slots_per_gpu_),
                "num_recv_tokens_per_expert must have num_physical / num_gpus = {} entries, got {}", slots_per_gpu_,
                num_recv_tokens_per_expert.size());
  for (size_t i = 0; i < num_recv_tokens_per_expert.size(); ++i) {
    EPX_CHECK_ARG(num_recv_tokens_per_expert[i] >= 0, "num_recv_tokens_per_expert[{}] must be >= 0, got {}", i,
                  num_recv_tokens_per_expert[i]);
  }
  use_source(Source::kReceived, "add_normal_dispatch");
  int64_t* out = counts_.data() + static_cast<int64_t>(layer) * num_physical_ + int64_t{rank_} * slots_per_gpu_;
  for (int i = 0; i < slots_per_gpu_; ++i) out[i] += num_recv_tokens_per_expert[i];
}

void DispatchCounts::add_low_latency_cumulative(int layer, std::span<const int32_t> cumulative_recv_counts) {
  check_layer(layer);
  EPX_CHECK_ARG(cumulative_recv_counts.size() == static_cast<size_t>(slots_per_gpu_),
                "cumulative_recv_counts must have num_physical / num_gpus = {} entries, got {}", slots_per_gpu_,
                cumulative_recv_counts.size());
  use_source(Source::kReceived, "add_low_latency_cumulative");
  uint32_t* base = ll_baseline_.data() + static_cast<int64_t>(layer) * slots_per_gpu_;
  int64_t* out = counts_.data() + static_cast<int64_t>(layer) * num_physical_ + int64_t{rank_} * slots_per_gpu_;
  for (int i = 0; i < slots_per_gpu_; ++i) {
    // NOTE: unsigned subtraction is the increase modulo 2^32, right across a wrap of the int32 counter.
    const auto now = static_cast<uint32_t>(cumulative_recv_counts[i]);
    out[i] += static_cast<int64_t>(now - base[i]);
    base[i] = now;
  }
}

void DispatchCounts::reset_low_latency_baseline(int layer) {
  check_layer(layer);
  std::fill_n(ll_baseline_.begin() + static_cast<int64_t>(layer) * slots_per_gpu_, slots_per_gpu_, 0u);
}

void DispatchCounts::add_topk(int layer, std::span<const int64_t> topk_physical) {
  check_layer(layer);
  for (size_t i = 0; i < topk_physical.size(); ++i) {
    EPX_CHECK_ARG(topk_physical[i] >= -1 && topk_physical[i] < num_physical_,
                  "topk_physical[{}] must be in [-1, {}), got {}", i, num_physical_, topk_physical[i]);
  }
  use_source(Source::kSent, "add_topk");
  int64_t* out = counts_.data() + static_cast<int64_t>(layer) * num_physical_;
  for (int64_t s : topk_physical) {
    if (s >= 0) ++out[s];
  }
}

std::vector<int64_t> DispatchCounts::take() {
  std::vector<int64_t> out(counts_.size(), 0);
  out.swap(counts_);
  source_ = Source::kNone;
  return out;
}

void all_reduce_counts(Group& group, std::span<int64_t> counts) {
  const int num_ranks = group.num_ranks();
  // NOTE: sizes first, so that ranks with different sizes all throw instead of reading past a peer's data.
  const auto size = static_cast<int64_t>(counts.size());
  std::vector<int64_t> sizes(num_ranks);
  group.all_gather_bytes(&size, sizes.data(), sizeof(int64_t));
  for (int r = 1; r < num_ranks; ++r) {
    EPX_CHECK_ARG(sizes[r] == sizes[0], "all_reduce_counts: rank {} passed {} counts, rank 0 passed {}", r, sizes[r],
                  sizes[0]);
  }
  if (size == 0) return;
  std::vector<int64_t> all(static_cast<size_t>(num_ranks) * counts.size());
  group.all_gather_bytes(counts.data(), all.data(), counts.size() * sizeof(int64_t));
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  for (size_t i = 0; i < counts.size(); ++i) {
    int64_t sum = 0;
    for (int r = 0; r < num_ranks; ++r) {
      const int64_t c = all[static_cast<size_t>(r) * counts.size() + i];
      EPX_CHECK_ARG(c >= 0, "all_reduce_counts: rank {} has counts[{}] = {} (must be >= 0)", r, i, c);
      EPX_CHECK_ARG(c <= kMax - sum, "all_reduce_counts: counts[{}] summed over ranks 0..{} exceeds INT64_MAX", i, r);
      sum += c;
    }
    counts[i] = sum;
  }
}

}  // namespace epx::eplb
