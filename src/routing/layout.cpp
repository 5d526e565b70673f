#include <algorithm>

#include "core/check.h"
#include "epx/routing.h"

namespace epx {

void check_expert_split(int64_t num_experts, int num_ranks) {
  EPX_CHECK_ARG(num_ranks >= 1, "num_ranks must be >= 1, got {}", num_ranks);
  EPX_CHECK_ARG(num_experts >= 1, "num_experts must be >= 1, got {}", num_experts);
  EPX_CHECK_ARG(num_experts % num_ranks == 0, "num_experts ({}) must be divisible by num_ranks ({})", num_experts,
                num_ranks);
}

int64_t topk_at(const TensorView& topk_idx, int64_t token, int64_t slot) {
  const int64_t i = token * topk_idx.strides[0] + slot * topk_idx.strides[1];
  return topk_idx.dtype == DType::kInt64 ? topk_idx.data_as<const int64_t>()[i]
                                         : static_cast<int64_t>(topk_idx.data_as<const int32_t>()[i]);
}

void compute_layout_host(const TensorView& topk_idx, int64_t num_experts, int num_ranks,
                         const TensorView& num_tokens_per_rank, const TensorView& num_tokens_per_expert,
                         const TensorView& is_token_in_rank) {
  check_expert_split(num_experts, num_ranks);
  check_tensor(topk_idx, "topk_idx", {DType::kInt64, DType::kInt32}, {-1, -1});
  check_device(topk_idx, "topk_idx", Device::cpu());
  const int64_t num_tokens = topk_idx.shape[0];
  const int64_t num_topk = topk_idx.shape[1];
  check_tensor(num_tokens_per_rank, "num_tokens_per_rank", DType::kInt32, {num_ranks});
  check_tensor(num_tokens_per_expert, "num_tokens_per_expert", DType::kInt32, {num_experts});
  check_tensor(is_token_in_rank, "is_token_in_rank", DType::kBool, {num_tokens, num_ranks});
  for (const auto* t : {&num_tokens_per_rank, &num_tokens_per_expert, &is_token_in_rank}) {
    check_device(*t, "layout output", Device::cpu());
  }
  // Validate everything before writing anything.
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t k = 0; k < num_topk; ++k) {
      const int64_t e = topk_at(topk_idx, t, k);
      EPX_CHECK_ARG(e >= -1 && e < num_experts, "topk_idx[{}][{}] = {} is outside [-1, num_experts = {})", t, k, e,
                    num_experts);
    }
  }
  const int64_t experts_per_rank = num_experts / num_ranks;
  auto* per_rank = num_tokens_per_rank.data_as<int32_t>();
  auto* per_expert = num_tokens_per_expert.data_as<int32_t>();
  auto* in_rank = is_token_in_rank.data_as<uint8_t>();
  std::fill(per_rank, per_rank + num_ranks, 0);
  std::fill(per_expert, per_expert + num_experts, 0);
  std::fill(in_rank, in_rank + num_tokens * num_ranks, 0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    uint8_t* row = in_rank + t * num_ranks;
    for (int64_t k = 0; k < num_topk; ++k) {
      const int64_t e = topk_at(topk_idx, t, k);
      if (e < 0) continue;
      ++per_expert[e];
      row[e / experts_per_rank] = 1;
    }
    for (int r = 0; r < num_ranks; ++r) per_rank[r] += row[r];
  }
}

HostLayout compute_layout_host(const TensorView& topk_idx, int64_t num_experts, int num_ranks) {
  check_expert_split(num_experts, num_ranks);
  check_tensor(topk_idx, "topk_idx", {DType::kInt64, DType::kInt32}, {-1, -1});
  const int64_t num_tokens = topk_idx.shape[0];
  HostLayout layout;
  layout.num_tokens_per_rank.resize(num_ranks);
  layout.num_tokens_per_expert.resize(num_experts);
  layout.is_token_in_rank.resize(detail::checked_mul(num_tokens, num_ranks, "num_tokens * num_ranks"));
  compute_layout_host(topk_idx, num_experts, num_ranks,
                      TensorView::of(layout.num_tokens_per_rank.data(), DType::kInt32, {num_ranks}),
                      TensorView::of(layout.num_tokens_per_expert.data(), DType::kInt32, {num_experts}),
                      TensorView::of(layout.is_token_in_rank.data(), DType::kBool, {num_tokens, num_ranks}));
  return layout;
}

}  // namespace epx
