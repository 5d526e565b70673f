#include "ep/low_latency_layout.h"

#include "ep/normal_region.h"

namespace epx::cuda {
namespace {

constexpr int64_t kBlock = 128;  // fp8 channels per scale
// The expert-side reduction's partial rows [t][q] live in combine_data's [t][k] rows.
static_assert(kLowLatencyFlatMaxRanks <= kLowLatencyMaxTopk);
static_assert(kCudaMaxRanks >= kLowLatencyMaxRanks && kCudaMaxRanks >= kHierarchicalMaxRanks);

}  // namespace

LowLatencyLayout LowLatencyLayout::make(int64_t max_tokens_per_rank, int64_t hidden, int num_ranks,
                                        int64_t num_experts) {
  LowLatencyLayout l;
  l.max_tokens_per_rank = max_tokens_per_rank;
  l.hidden = hidden;
  l.num_experts = num_experts;
  l.num_ranks = num_ranks;
  l.num_local_experts = num_experts / num_ranks;
  const int64_t slots = l.num_local_experts * num_ranks * max_tokens_per_rank;
  int64_t offset = 0;
  auto take = [&](int64_t bytes) {
    const int64_t at = offset;
    offset = align_up(offset + bytes, 256);
    return at;
  };
  // NOTE: the control block comes first, so its offset does not depend on the shapes.
  l.control_offset = take(sizeof(LowLatencyControl));
  for (auto& s : l.sets) {
    s.dispatch_data = take(slots * hidden * 2);
    s.dispatch_scales = take(slots * (hidden / kBlock) * 4);
    s.dispatch_src_info = take(slots * 4);
    s.dispatch_slot_k = take(slots * 4);
    s.dispatch_signals = take(l.num_local_experts * num_ranks * 8);
    s.dispatch_owner = take(slots * 4);
    s.recv_x = take(slots * hidden * 2);
    s.recv_x_scales = take(slots * (hidden / kBlock) * 4);
    s.recv_src_info = take(slots * 4);
    s.recv_count = take(l.num_local_experts * 4);
    s.layout_range = take(l.num_local_experts * num_ranks * 8);
    s.combine_data = take(max_tokens_per_rank * kLowLatencyMaxTopk * hidden * 2);
    s.combine_signals = take(num_experts * 8);
    s.pair_map = take(num_ranks * max_tokens_per_rank * kLowLatencyMaxTopk * 8);
    s.combine_weights = take(num_ranks * max_tokens_per_rank * kLowLatencyMaxTopk * 4);
    s.weights_signals = take(num_ranks * 8);
  }
  l.total_bytes = offset;
  return l;
}

}  // namespace epx::cuda
