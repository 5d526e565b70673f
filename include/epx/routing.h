// Routing layout: from top-k expert choices to what each rank sends and receives.
//
// Experts are split evenly over ranks: expert e lives on rank e / (num_experts / num_ranks).
// topk_idx entries equal to -1 mean "no expert" and are ignored.
#pragma once

#include <cstdint>
#include <vector>

#include "epx/tensor.h"

namespace epx {

// Checks num_experts > 0, num_ranks > 0, num_experts % num_ranks == 0; throws kInvalidArgument.
void check_expert_split(int64_t num_experts, int num_ranks);

// Host implementation of the layout. topk_idx: int32 or int64 [T, K] on the CPU; every entry in
// [-1, num_experts) (else kInvalidArgument naming the token, slot and value). Outputs (CPU, contiguous):
//   num_tokens_per_rank    int32 [num_ranks]    tokens with at least one expert on the rank
//   num_tokens_per_expert  int32 [num_experts]  (token, slot) entries that chose the expert
//   is_token_in_rank       bool  [T, num_ranks]
void compute_layout_host(const TensorView& topk_idx, int64_t num_experts, int num_ranks,
                         const TensorView& num_tokens_per_rank, const TensorView& num_tokens_per_expert,
                         const TensorView& is_token_in_rank);

// Convenience form for host code and tests.
struct HostLayout {
  std::vector<int32_t> num_tokens_per_rank;    // [num_ranks]
  std::vector<int32_t> num_tokens_per_expert;  // [num_experts]
  std::vector<uint8_t> is_token_in_rank;       // [T, num_ranks], 0 or 1
};
HostLayout compute_layout_host(const TensorView& topk_idx, int64_t num_experts, int num_ranks);

// Reads entry (token, slot) of an int32/int64 topk_idx view on the CPU.
int64_t topk_at(const TensorView& topk_idx, int64_t token, int64_t slot);

}  // namespace epx
