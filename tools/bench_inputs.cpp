#include "bench_inputs.h"

#include "epx/quant.h"
#include "epx/routing.h"
#include "epx/tensor.h"
#include "testing/routing.h"

namespace epx::cli {

std::vector<RankInputs> make_rank_inputs(std::mt19937_64& rng, int num_ranks, int64_t num_tokens, int64_t hidden,
                                         int num_topk, int64_t num_experts) {
  std::vector<RankInputs> inputs(num_ranks);
  for (auto& in : inputs) {
    in.num_tokens = num_tokens;
    std::uniform_int_distribution<int> value(-8, 8);
    in.x.resize(num_tokens * hidden);
    for (auto& v : in.x) v = float_to_bf16(static_cast<float>(value(rng)));
    in.topk = testing::random_distinct_topk(rng, num_tokens, num_topk, num_experts);
    std::uniform_int_distribution<int> eighths(1, 4);
    in.weights.resize(num_tokens * num_topk);
    for (auto& w : in.weights) w = static_cast<float>(eighths(rng)) / 8.f;
    in.x_fp8.resize(num_tokens * hidden);
    in.x_scales.resize(num_tokens * (hidden / kFp8BlockSize));
    quantize_fp8_host(TensorView::of(in.x.data(), DType::kBFloat16, {num_tokens, hidden}),
                      TensorView::of(in.x_fp8.data(), DType::kFloat8E4M3, {num_tokens, hidden}),
                      TensorView::of(in.x_scales.data(), DType::kFloat32, {num_tokens, hidden / kFp8BlockSize}),
                      ScaleFormat::kFloat32);
  }
  return inputs;
}

int64_t count_identity_combine_mismatches(const RankInputs& in, const std::vector<uint16_t>& out, int64_t hidden,
                                          int num_topk, int64_t num_experts, int num_ranks) {
  const int64_t num_tokens = in.num_tokens;
  if (out.size() != static_cast<size_t>(num_tokens * hidden)) return num_tokens * hidden;
  const HostLayout layout =
      compute_layout_host(TensorView::of(const_cast<int64_t*>(in.topk.data()), DType::kInt64, {num_tokens, num_topk}),
                          num_experts, num_ranks);
  int64_t bad = 0;
  for (int64_t t = 0; t < num_tokens; ++t) {
    int visits = 0;
    for (int d = 0; d < num_ranks; ++d) visits += layout.is_token_in_rank[t * num_ranks + d];
    for (int64_t c = 0; c < hidden; ++c) {
      bad += bf16_to_float(out[t * hidden + c]) != bf16_to_float(in.x[t * hidden + c]) * static_cast<float>(visits);
    }
  }
  return bad;
}

}  // namespace epx::cli
