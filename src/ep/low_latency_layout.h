// Memory layout of the low-latency path (plain C++: the size hint uses it in host-only builds too).
// See low_latency.h for the protocol.
#pragma once

#include <cstdint>

#include "core/limits.h"

namespace epx::cuda {

// Byte offsets of one buffer set inside a rank's region. The dispatch_* parts are the staging area peers
// write into (source s's pairs for local expert e at rows [s * M, s * M + count)); the recv_* parts are the
// packed outputs the receive kernel copies them into (local only, never written by a peer).
struct LowLatencySet {
  int64_t dispatch_data;      // [E_local][R * M][H] bf16 or fp8
  int64_t dispatch_scales;    // [E_local][R * M][H / 128] fp32 (or uint8 UE8M0, packed the same way)
  int64_t dispatch_src_info;  // [E_local][R * M] int32: source token (valid below the block's count)
  int64_t dispatch_slot_k;    // [E_local][R * M] int32: the top-k slot the pair came from
  int64_t dispatch_signals;   // [E_local][R] uint64: (tag << 32) | count, written by source rank s
  int64_t dispatch_owner;     // [E_local][R * M] int32: the local expert whose block wrote the pair's token row
                              // (token-staged; its signal covers the row)
  int64_t recv_x;             // [E_local][R * M][H] bf16 or fp8: packed rows (local only)
  int64_t recv_x_scales;      // [E_local][R * M][H / 128] fp32 or uint8: packed rows (local only)
  int64_t recv_src_info;      // [E_local][R * M] int32: packed rows' source token, -1 past the count (local only)
  int64_t recv_count;         // [E_local] int32 (local only)
  int64_t layout_range;       // [E_local][R] int64: (prefix begin << 32) | count (local only)
  int64_t combine_data;       // [M][kLowLatencyMaxTopk][H] bf16: one row per (token, k)
  int64_t combine_signals;  // [num_experts] uint64: (tag << kCombineIdBits) | dispatch id, written by the expert's rank
  // LowLatencyConfig::expert_side_reduction (flat routing): combine_data holds one bf16 partial row per (token,
  // expert rank q) at [t][q] (q < kLowLatencyFlatMaxRanks <= kLowLatencyMaxTopk), combine_signals[q] is rank q's
  // signal, and these:
  int64_t pair_map;         // [R][M][kLowLatencyMaxTopk] int64: (dispatch tag << 32) | (e_local * R * M + packed row)
                            // of source r's pair (t, k) here, written by the dispatch receive (local only)
  int64_t combine_weights;  // [R][M][kLowLatencyMaxTopk] fp32: source r's topk_weights, written by source r
  int64_t weights_signals;  // [R] uint64: (tag << 32) from source r once its weights are written
};

struct LowLatencyLayout {
  int64_t max_tokens_per_rank = 0;  // M
  int64_t hidden = 0;               // H
  int64_t num_experts = 0;          // E
  int num_ranks = 0;                // R
  int64_t num_local_experts = 0;    // E / R
  LowLatencySet sets[2];
  int64_t control_offset = 0;  // LowLatencyControl, local only
  int64_t total_bytes = 0;

  static LowLatencyLayout make(int64_t max_tokens_per_rank, int64_t hidden, int num_ranks, int64_t num_experts);
};

// Device-side state of one rank, at control_offset in its region (zeroed once at allocation).
struct LowLatencyControl {
  uint64_t dispatch_seq[2];
  uint64_t combine_seq[2];
  unsigned int dispatch_ticket[2];
  unsigned int combine_ticket[2];
  int mask[kLowLatencyMaxRanks];                           // 1 = masked
  unsigned int combine_parts_done[kLowLatencyMaxExperts];  // per local expert: combine-send blocks finished
  // Per set and destination rank: expert-side reduction send blocks done with that destination (a power of two).
  unsigned int partial_sends_done[2][kLowLatencyFlatMaxRanks];  // (the expert-side reduction is flat only)
  // Per set and source rank: the low 32 bits of the tag of the last dispatch on the set whose receive here missed some
  // or all of that source's pairs (a wait that timed out, or the source masked); the combine that reverses it then
  // signals the source kCombineNoRows (low_latency.h). Entries of older dispatches never match.
  uint32_t recv_lost[2][kLowLatencyMaxRanks];
};

}  // namespace epx::cuda
