// DP attention planning: rank arithmetic and group lists, padding-mode choice, the gather plan, and the
// `epx dp` CLI (run as the built binary, EPX_CLI_PATH).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "epx/dp.h"
#include "epx/error.h"
#include "test_util.h"

namespace epx {
namespace {

using Groups = std::vector<std::vector<int>>;

TEST(ParallelLayout, EightRankExampleFromTheIssue) {
  // 8 GPUs, attn_cp 2, attn_tp 4, moe_dp 2, moe_ep 4.
  const auto layout = ParallelLayout::create(
      {.world_size = 8, .attn_dp_size = 1, .attn_cp_size = 2, .attn_tp_size = 4, .moe_ep_size = 4, .moe_dp_size = 2});
  EXPECT_EQ(layout.sizes().moe_tp_size, 1);
  EXPECT_EQ(layout.groups(ParallelGroupKind::kAttnCp), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(layout.groups(ParallelGroupKind::kAttnTp), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(layout.groups(ParallelGroupKind::kAttnDp), (Groups{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}));
  EXPECT_EQ(layout.groups(ParallelGroupKind::kMoeEp), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(layout.groups(ParallelGroupKind::kMoeDp), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(layout.group_of(ParallelGroupKind::kAttnCp, 6), (std::vector<int>{2, 6}));
  const RankCoords c = layout.coords(6);
  EXPECT_EQ(c.attn_tp_rank, 2);
  EXPECT_EQ(c.attn_cp_rank, 1);
  EXPECT_EQ(c.attn_dp_rank, 0);
  EXPECT_EQ(c.moe_ep_rank, 2);
  EXPECT_EQ(c.moe_dp_rank, 1);
  EXPECT_EQ(layout.dp_leader(0), 0);
  EXPECT_TRUE(layout.is_dp_leader(0));
  EXPECT_FALSE(layout.is_dp_leader(4));  // attn_cp_rank 1
}

TEST(ParallelLayout, DpAttentionWithTp) {
  // 8 ranks, 4 DP ranks of attention TP 2; the MoE is EP over all 8.
  const auto layout = ParallelLayout::create({.world_size = 8, .attn_dp_size = 4});
  EXPECT_EQ(layout.attn_tp_size(), 2);
  EXPECT_EQ(layout.sizes().moe_ep_size, 8);
  EXPECT_EQ(layout.groups(ParallelGroupKind::kAttnTp), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(layout.groups(ParallelGroupKind::kAttnDp), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(layout.groups(ParallelGroupKind::kMoeEp), (Groups{{0, 1, 2, 3, 4, 5, 6, 7}}));
  EXPECT_EQ(layout.dp_leader(3), 6);
  EXPECT_EQ(layout.coords(5).attn_dp_rank, 2);
  const auto dp = ParallelLayout::pure_dp(3);
  EXPECT_EQ(dp.attn_dp_size(), 3);
  EXPECT_EQ(dp.attn_tp_size(), 1);
  EXPECT_EQ(dp.sizes().moe_ep_size, 3);
}

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; ++i) {
    if (n % i == 0) d.push_back(i);
  }
  return d;
}

TEST(ParallelLayout, EveryFactorizationPartitionsTheRanks) {
  const ParallelGroupKind kinds[] = {ParallelGroupKind::kAttnTp, ParallelGroupKind::kAttnCp, ParallelGroupKind::kAttnDp,
                                     ParallelGroupKind::kMoeTp,  ParallelGroupKind::kMoeEp,  ParallelGroupKind::kMoeDp};
  int num_layouts = 0;
  for (int world : {1, 2, 6, 8, 12}) {
    for (int dp : divisors(world)) {
      for (int cp : divisors(world / dp)) {
        for (int moe_dp : divisors(world)) {
          for (int moe_ep : divisors(world / moe_dp)) {
            const auto layout = ParallelLayout::create({.world_size = world,
                                                        .attn_dp_size = dp,
                                                        .attn_cp_size = cp,
                                                        .moe_ep_size = moe_ep,
                                                        .moe_dp_size = moe_dp});
            const ParallelSizes& s = layout.sizes();
            ASSERT_EQ(s.attn_tp_size * s.attn_cp_size * s.attn_dp_size, world);
            ASSERT_EQ(s.moe_tp_size * s.moe_ep_size * s.moe_dp_size, world);
            ++num_layouts;
            for (ParallelGroupKind kind : kinds) {
              // Every rank in exactly one group; members differ only in the group's own coordinate.
              std::vector<int> seen(world, 0);
              for (const auto& g : layout.groups(kind)) {
                ASSERT_TRUE(std::is_sorted(g.begin(), g.end()));
                for (size_t i = 0; i < g.size(); ++i) {
                  ++seen[g[i]];
                  const RankCoords a = layout.coords(g[0]), b = layout.coords(g[i]);
                  const int attn_same = (a.attn_tp_rank == b.attn_tp_rank) + (a.attn_cp_rank == b.attn_cp_rank) +
                                        (a.attn_dp_rank == b.attn_dp_rank);
                  const int moe_same = (a.moe_tp_rank == b.moe_tp_rank) + (a.moe_ep_rank == b.moe_ep_rank) +
                                       (a.moe_dp_rank == b.moe_dp_rank);
                  const bool attn_kind = kind <= ParallelGroupKind::kAttnDp;
                  ASSERT_GE(attn_kind ? attn_same : moe_same, i == 0 ? 3 : 2) << to_string(kind) << " rank " << g[i];
                }
                ASSERT_EQ(layout.group_of(kind, g.back()), g);
              }
              for (int r = 0; r < world; ++r) ASSERT_EQ(seen[r], 1) << to_string(kind) << " rank " << r;
            }
            for (int r = 0; r < world; ++r) {
              const RankCoords c = layout.coords(r);
              ASSERT_EQ(layout.attn_rank(c.attn_dp_rank, c.attn_cp_rank, c.attn_tp_rank), r);
              ASSERT_EQ((c.moe_dp_rank * s.moe_ep_size + c.moe_ep_rank) * s.moe_tp_size + c.moe_tp_rank, r);
            }
          }
        }
      }
    }
  }
  EXPECT_GT(num_layouts, 100);
}

using epx::testing::expect_invalid;

TEST(ParallelLayout, RejectsBadSizes) {
  expect_invalid([] { ParallelLayout::create({.world_size = 0}); }, "world_size must be in [1, 1024]");
  expect_invalid([] { ParallelLayout::create({.world_size = 8, .attn_dp_size = 3}); }, "divisible by");
  expect_invalid([] { ParallelLayout::create({.world_size = 8, .attn_dp_size = 2, .attn_tp_size = 2}); },
                 "must equal world_size 8");
  expect_invalid([] { ParallelLayout::create({.world_size = 8, .moe_ep_size = 3}); }, "moe_ep_size");
  expect_invalid([] { ParallelLayout::create({.world_size = 4, .attn_dp_size = 0}); }, "attn_dp_size must be >= 1");
  const auto layout = ParallelLayout::pure_dp(4);
  expect_invalid([&] { layout.coords(4); }, "rank must be in [0, 4)");
  expect_invalid([&] { layout.attn_rank(0, 1, 0); }, "attn_cp_rank must be in [0, 1)");
}

TEST(PaddingMode, HandWorkedRules) {
  using M = DpPaddingMode;
  const std::vector<int64_t> a{3000, 200};
  EXPECT_EQ(choose_padding_mode(a), M::kMaxLen);                                 // 2 * 3200 >= 3000 * 2
  EXPECT_EQ(choose_padding_mode(std::vector<int64_t>{3000, 0}), M::kMaxLen);     // 6000 >= 6000
  EXPECT_EQ(choose_padding_mode(std::vector<int64_t>{3000, 0, 0}), M::kSumLen);  // 6000 < 9000
  EXPECT_EQ(choose_padding_mode(std::vector<int64_t>{3000, 1, 0}), M::kSumLen);  // 6002 < 9000
  EXPECT_EQ(choose_padding_mode(std::vector<int64_t>{0, 0, 0, 0}), M::kMaxLen);  // all idle: 0 >= 0
  EXPECT_EQ(choose_padding_mode(a, {.is_extend_in_batch = true}), M::kSumLen);
  EXPECT_EQ(choose_padding_mode(std::vector<int64_t>{3000}, {.is_extend_in_batch = true}), M::kMaxLen);
  EXPECT_EQ(choose_padding_mode(std::vector<int64_t>{3000, 0, 0}, {.in_cuda_graph = true}), M::kMaxLen);
  EXPECT_EQ(choose_padding_mode(a, {.is_extend_in_batch = true, .in_cuda_graph = true}), M::kMaxLen);
  EXPECT_EQ(choose_padding_mode(a, {.is_extend_in_batch = true, .symmetric_a2a = true}), M::kMaxLen);
  EXPECT_STREQ(to_string(M::kMaxLen), "MAX_LEN");
  EXPECT_STREQ(to_string(M::kSumLen), "SUM_LEN");
}

TEST(PaddingMode, RandomCountsPickTheCheaperCollective) {
  std::mt19937 rng(11);
  for (int iter = 0; iter < 2000; ++iter) {
    const int width = 1 + static_cast<int>(rng() % 9);
    std::vector<int64_t> counts(width);
    for (auto& c : counts) c = rng() % 3 == 0 ? 0 : static_cast<int64_t>(rng() % 5000);
    // Bytes moved per rank: all-gather of the padded buffer vs all-reduce (2x) of the summed buffer.
    const int64_t max = *std::max_element(counts.begin(), counts.end());
    const int64_t sum = std::accumulate(counts.begin(), counts.end(), int64_t{0});
    const int64_t gather_rows = max * width, all_reduce_rows = 2 * sum;
    const DpPaddingMode expected = gather_rows <= all_reduce_rows ? DpPaddingMode::kMaxLen : DpPaddingMode::kSumLen;
    ASSERT_EQ(choose_padding_mode(counts), expected);
    const DpGatherPlan plan = plan_dp_gather(counts, expected);
    ASSERT_EQ(plan.buffer_len, expected == DpPaddingMode::kMaxLen ? gather_rows : sum);
    // Slices are disjoint, in DP-rank order, inside the buffer.
    int64_t end = 0;
    for (int d = 0; d < width; ++d) {
      ASSERT_GE(plan.offsets[d], end);
      end = plan.offsets[d] + counts[d];
      ASSERT_LE(end, plan.buffer_len);
    }
  }
}

TEST(GatherPlan, HandWorkedPlans) {
  const auto max = plan_dp_gather(std::vector<int64_t>{3000, 200}, DpPaddingMode::kMaxLen);
  EXPECT_EQ(max.buffer_len, 6000);
  EXPECT_EQ(max.slot_len, 3000);
  EXPECT_EQ(max.offsets, (std::vector<int64_t>{0, 3000}));
  EXPECT_EQ(max.num_tokens, (std::vector<int64_t>{3000, 200}));
  const auto sum = plan_dp_gather(std::vector<int64_t>{3, 0, 5}, DpPaddingMode::kSumLen);
  EXPECT_EQ(sum.buffer_len, 8);
  EXPECT_EQ(sum.slot_len, 0);
  EXPECT_EQ(sum.offsets, (std::vector<int64_t>{0, 3, 3}));
  // MAX_LEN slots round up to the attention-TP size.
  const auto tp = plan_dp_gather(std::vector<int64_t>{5, 2}, DpPaddingMode::kMaxLen, 4);
  EXPECT_EQ(tp.slot_len, 8);
  EXPECT_EQ(tp.buffer_len, 16);
  EXPECT_EQ(tp.offsets, (std::vector<int64_t>{0, 8}));
  const auto idle = plan_dp_gather(std::vector<int64_t>{0, 0}, DpPaddingMode::kMaxLen);
  EXPECT_EQ(idle.buffer_len, 0);
}

TEST(GatherPlan, RejectsBadCounts) {
  expect_invalid(
      [] {
        plan_dp_gather(std::vector<int64_t>{4, -1}, DpPaddingMode::kSumLen);
      },
      "num_tokens_per_dp_rank[1] must be in [0, 2^40], got -1");
  expect_invalid([] { plan_dp_gather(std::vector<int64_t>{}, DpPaddingMode::kSumLen); },
                 "must name 1 to 1024 DP ranks, got 0");
  expect_invalid([] { plan_dp_gather(std::vector<int64_t>{1}, DpPaddingMode::kMaxLen, 0); },
                 "attn_tp_size must be in [1, 1024]");
  expect_invalid([] { choose_padding_mode(std::vector<int64_t>{-5}); }, "got -5");
}

// ---- CLI ---------------------------------------------------------------------------------------------

using epx::testing::CliResult;
using epx::testing::expect_bad_input;
using epx::testing::run_cli;

TEST(DpCli, PaddingModeJson) {
  auto r = run_cli("dp padding-mode --tokens 3000,200");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "{\"mode\": \"MAX_LEN\", \"buffer_len\": 6000, \"offsets\": [0, 3000]}\n");
  r = run_cli("dp padding-mode --tokens 3000,200 --extend");
  EXPECT_EQ(r.out, "{\"mode\": \"SUM_LEN\", \"buffer_len\": 3200, \"offsets\": [0, 3000]}\n");
  r = run_cli("dp padding-mode --tokens 3000,200 --extend --graph");
  EXPECT_EQ(r.out, "{\"mode\": \"MAX_LEN\", \"buffer_len\": 6000, \"offsets\": [0, 3000]}\n");
  r = run_cli("dp padding-mode --tokens 3000,0,0,7");
  EXPECT_EQ(r.out, "{\"mode\": \"SUM_LEN\", \"buffer_len\": 3007, \"offsets\": [0, 3000, 3000, 3000]}\n");
  r = run_cli("dp padding-mode --tokens 3000,0,0,7 --symmetric-a2a");
  EXPECT_EQ(r.out, "{\"mode\": \"MAX_LEN\", \"buffer_len\": 12000, \"offsets\": [0, 3000, 6000, 9000]}\n");
  r = run_cli("dp padding-mode --tokens 5,2 --attn-tp 4");
  EXPECT_EQ(r.out, "{\"mode\": \"MAX_LEN\", \"buffer_len\": 16, \"offsets\": [0, 8]}\n");
}

TEST(DpCli, BadInputExitsTwoWithOneLine) {
  expect_bad_input("dp padding-mode --tokens 3000,-200", "negative");
  expect_bad_input("dp padding-mode --tokens=-1", "negative");
  expect_bad_input("dp padding-mode --tokens 3000,abc", "not an integer");
  expect_bad_input("dp padding-mode --tokens 3000,,5", "not an integer");
  expect_bad_input("dp padding-mode --tokens 1,2 --attn-tp 0", "--attn-tp must be in [1, 1024]");
  expect_bad_input("dp groups --world 8 --attn-dp 3", "divisible");
  expect_bad_input("dp padding-mode", "needs --tokens");
  expect_bad_input("dp groups", "needs --world");
}

TEST(DpCli, Groups) {
  const auto r = run_cli("dp groups --world 8 --attn-cp 2 --moe-dp 2 --moe-ep 4");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("\"attn_cp\": [[0, 4], [1, 5], [2, 6], [3, 7]]"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"attn_tp\": [[0, 1, 2, 3], [4, 5, 6, 7]]"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"moe_ep\": [[0, 1, 2, 3], [4, 5, 6, 7]]"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"moe_dp\": [[0, 4], [1, 5], [2, 6], [3, 7]]"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace epx
