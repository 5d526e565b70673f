// Backend-independent argument checks of the Buffer API (include/epx/buffer.h). Both backends call
// these before touching memory; they read only shapes, dtypes and scalars, never tensor contents
// (value checks such as topk_idx ranges need device reads and stay with each backend).
// Every check throws Error(kInvalidArgument) whose message names the argument and the bound; the bounds
// themselves (kMaxExperts, kMaxWorstTokens, kLowLatencyMax*) are in core/limits.h.
#pragma once

#include <cstdint>

#include "core/limits.h"
#include "epx/buffer.h"

namespace epx::ep {

// Shapes of a validated normal dispatch.
struct DispatchShape {
  int64_t num_tokens = 0;  // T
  int64_t hidden = 0;      // H
  int64_t num_topk = 0;    // K; 0 in cached mode
  bool is_fp8 = false;
  bool is_cached = false;   // args.handle is set
  int64_t scale_bytes = 0;  // bytes of one token's scales (x_scales.shape[1] * element size); 0 without fp8
};

// get_dispatch_layout: topk_idx int32/int64 [T, K] on `device`, num_experts in [1, 2^31 - 1] divisible by
// num_ranks.
void validate_layout_args(const TensorView& topk_idx, int64_t num_experts, int num_ranks, Device device);

// Normal dispatch. In cached mode also checks handle->num_tokens() == T. num_worst_tokens in [0, 2^31 - 1],
// num_experts <= 2^31 - 1, and every tensor's element count and bytes fit in int64.
DispatchShape validate_dispatch(const DispatchArgs& args, int num_ranks, Device device);

// The SM count of one normal call: num_sms (DispatchArgs/CombineArgs) in [0, buffer_num_sms], 0 meaning
// buffer_num_sms (BufferOptions::num_sms).
int resolve_num_sms(int num_sms, int buffer_num_sms);

// Normal combine. num_tokens: the handle's T; num_rows: rows of the dispatch's outputs (the received
// count, or num_worst_tokens in worst-token mode).
void validate_combine(const CombineArgs& args, int64_t num_tokens, int64_t num_rows, Device device);
// A combine on the hierarchical routing: Error(kUnsupported) when args.order_topk_idx is given (flat routing only).
void refuse_combine_order_on_hierarchical(const CombineArgs& args);

// Shapes of a validated low-latency dispatch.
struct LowLatencyShape {
  int64_t num_tokens = 0;
  int64_t hidden = 0;
  int64_t num_topk = 0;
  int64_t num_local_experts = 0;
};

// Low-latency dispatch: T <= max_tokens_per_rank, H % 128 == 0, H <= 16384, K <= 16, experts <= 1024
// and divisible by num_ranks, num_ranks * max_tokens_per_rank < 2^31 (slot indices are packed in 32 bits).
LowLatencyShape validate_low_latency_dispatch(const LowLatencyDispatchArgs& args, int num_ranks, Device device);

// Low-latency combine against the dispatch that made the handle: x [E_local, R * M, H] bf16 with the
// dispatch's H, topk_idx / topk_weights [T, K] with the dispatch's T and K, out (optional) [T, H] bf16.
void validate_low_latency_combine(const LowLatencyCombineArgs& args, const LowLatencyShape& dispatch_shape,
                                  int64_t max_tokens_per_rank, int num_ranks, Device device);

// BufferOptions ranges: num_sms in [1, kMaxNumSms], byte counts >= 0, normal.max_copy_chunks in
// [1, kNormalMaxCopyChunks], low_latency.combine_send_parts in {1, 2, 4, 8},
// low_latency.combine_solo_max_rows >= 0.
void validate_options(const BufferOptions& options);

// Whether normal dispatch/combine take the hierarchical routing: BufferOptions::normal_routing, kAuto resolved by the
// number of nodes of `topology` and by the backend's cap of the flat routing (`flat_max_ranks`; the cuda backend's is
// kNormalMaxRanks): one node of more ranks than that takes the hierarchical routing forced on one node, which runs
// there, instead of a flat routing the backend would refuse.
inline bool normal_hierarchical(const BufferOptions& options, const Topology& topology, int flat_max_ranks) {
  return options.normal_routing == NormalRouting::kHierarchical ||
         (options.normal_routing == NormalRouting::kAuto &&
          (topology.num_nodes > 1 || topology.num_ranks() > flat_max_ranks));
}

// Whether low-latency calls take the hierarchical routing: BufferOptions::low_latency_routing, kAuto resolved by
// the number of nodes of `topology`.
inline bool low_latency_hierarchical(const BufferOptions& options, const Topology& topology) {
  return options.low_latency_routing == LowLatencyRouting::kHierarchical ||
         (options.low_latency_routing == LowLatencyRouting::kAuto && topology.num_nodes > 1);
}

// Collective over `group` (one all_gather): validates this rank's options and checks that every rank passed
// the same ones where they size or lay out memory that peers index or pick the protocol (the byte counts,
// num_sms, NormalConfig except stage_timeline, LowLatencyConfig, both routings). Fails alike on every rank: the rank
// with invalid options raises its own kInvalidArgument, its peers kPeerFailure; options that differ raise
// kInvalidArgument naming the field and both ranks' values.
void agree_on_options(Group& group, const BufferOptions& options);

}  // namespace epx::ep
