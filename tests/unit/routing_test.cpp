// Layout against a brute-force count on random inputs: tokens {0, 1, 7, 4096}, top-k 1-9,
// experts 8-512, ranks 1-16, with -1 entries; int32 and int64 indices; bad input.
#include "epx/routing.h"

#include <gtest/gtest.h>

#include <random>
#include <set>

#include "epx/error.h"
#include "test_util.h"

namespace epx {
namespace {

TEST(Routing, MatchesBruteForce) {
  std::mt19937 rng(1234);
  for (int64_t num_tokens : {0, 1, 7, 4096}) {
    for (int num_ranks : {1, 2, 3, 4, 8, 16}) {
      for (int64_t experts_per_rank : {8, 32}) {
        const int64_t num_experts = std::min<int64_t>(512, experts_per_rank * num_ranks);
        if (num_experts % num_ranks != 0) continue;
        const int num_topk = 1 + static_cast<int>(rng() % 9);
        auto topk = testing::random_topk(rng, num_tokens, num_topk, num_experts, 0.1);
        std::vector<int32_t> topk32(topk.begin(), topk.end());
        const auto v64 = TensorView::of(topk.data(), DType::kInt64, {num_tokens, num_topk});
        const auto v32 = TensorView::of(topk32.data(), DType::kInt32, {num_tokens, num_topk});
        const HostLayout got = compute_layout_host(v64, num_experts, num_ranks);
        const HostLayout got32 = compute_layout_host(v32, num_experts, num_ranks);
        EXPECT_EQ(got.num_tokens_per_rank, got32.num_tokens_per_rank);
        EXPECT_EQ(got.num_tokens_per_expert, got32.num_tokens_per_expert);
        EXPECT_EQ(got.is_token_in_rank, got32.is_token_in_rank);

        std::vector<int32_t> per_rank(num_ranks, 0), per_expert(num_experts, 0);
        for (int64_t t = 0; t < num_tokens; ++t) {
          std::set<int64_t> ranks;
          for (int k = 0; k < num_topk; ++k) {
            const int64_t e = topk[t * num_topk + k];
            if (e < 0) continue;
            ++per_expert[e];
            ranks.insert(e / (num_experts / num_ranks));
          }
          for (int r = 0; r < num_ranks; ++r) {
            ASSERT_EQ(got.is_token_in_rank[t * num_ranks + r], ranks.count(r) ? 1 : 0) << "token " << t;
          }
          for (int64_t r : ranks) ++per_rank[r];
        }
        EXPECT_EQ(got.num_tokens_per_rank, per_rank);
        EXPECT_EQ(got.num_tokens_per_expert, per_expert);
      }
    }
  }
}

TEST(Routing, RejectsBadInput) {
  std::vector<int64_t> topk = {0, 1, 2, 8};  // 8 >= num_experts
  const auto v = TensorView::of(topk.data(), DType::kInt64, {2, 2});
  try {
    compute_layout_host(v, 8, 2);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("topk_idx[1][1] = 8"), std::string::npos) << e.what();
  }
  topk[3] = -2;
  EXPECT_THROW(compute_layout_host(v, 8, 2), Error);
  topk[3] = 3;
  EXPECT_THROW(compute_layout_host(v, 9, 2), Error);  // 9 experts over 2 ranks
  EXPECT_THROW(compute_layout_host(v, 8, 0), Error);
  std::vector<float> wrong(4);
  EXPECT_THROW(compute_layout_host(TensorView::of(wrong.data(), DType::kFloat32, {2, 2}), 8, 2), Error);
  EXPECT_NO_THROW(compute_layout_host(v, 8, 2));
}

}  // namespace
}  // namespace epx
