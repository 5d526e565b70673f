// Attention context parallelism (attn_cp > 1): SGLang's zigzag split rules pinned on hand-worked batches
// (python/sglang/srt/layers/cp/zigzag.py), and dp_gather / dp_scatter with CP shards on the host backend
// (SGLang's dp_attention.py: the shards of a DP rank back to back in CP rank order at its offset).
//
// Routing of the collective tests: world 4 = attn_dp 2 x attn_cp 2 (attn_tp 1), ranks 0, 1 = DP rank 0's CP ranks
// 0, 1 and ranks 2, 3 = DP rank 1's. DP rank 0 runs a split extend batch of sequences [10, 5] (shards [8, 7]); DP
// rank 1 a decode batch of 3 tokens that is not split (its CP rank 1 holds poison, to show that only CP rank 0's
// rows are read). Row values are small integers, exact in fp32 and int64; every output element is checked.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "epx/dp.h"
#include "epx/error.h"
#include "test_util.h"

namespace epx {
namespace {

using Rows = std::vector<int64_t>;

TEST(ZigzagSplit, OneSequenceDivisible) {
  const auto split = plan_zigzag_split(Rows{8}, 2);
  EXPECT_EQ(split.block_lens, (Rows{2, 2, 2, 2}));
  EXPECT_EQ(split.num_tokens, (Rows{4, 4}));
  EXPECT_EQ(zigzag_local_rows(split, 0), (Rows{0, 1, 6, 7}));  // blocks 0 and 3
  EXPECT_EQ(zigzag_local_rows(split, 1), (Rows{2, 3, 4, 5}));  // blocks 1 and 2
  EXPECT_EQ(zigzag_gathered_rows(split), (Rows{0, 1, 4, 5, 6, 7, 2, 3}));
  EXPECT_EQ(split.max_rank_len, 4);
  EXPECT_EQ(split.padded_rank_len, 4);
}

// Lengths not divisible by 2 * cp: L = q * 2cp + r gives the first r blocks q + 1 rows (SGLang: base + 1 if
// block_id < rem). The early blocks of every sequence come first on a rank, then the late ones.
TEST(ZigzagSplit, TwoSequencesWithRemainders) {
  const auto split = plan_zigzag_split(Rows{10, 5}, 2);
  EXPECT_EQ(split.seq_offsets, (Rows{0, 10}));
  EXPECT_EQ(split.block_lens, (Rows{3, 3, 2, 2, 2, 1, 1, 1}));
  EXPECT_EQ(split.num_tokens, (Rows{8, 7}));
  EXPECT_EQ(split.max_rank_len, 8);
  EXPECT_EQ(split.padded_rank_len, 8);
  EXPECT_EQ(zigzag_local_rows(split, 0), (Rows{0, 1, 2, 10, 11, 8, 9, 14}));
  EXPECT_EQ(zigzag_local_rows(split, 1), (Rows{3, 4, 5, 12, 6, 7, 13}));
  EXPECT_EQ(zigzag_gathered_rows(split), (Rows{0, 1, 2, 8, 9, 10, 12, 13, 5, 6, 3, 4, 11, 14, 7}));
}

TEST(ZigzagSplit, PaddingJoinsTheLastSequenceAndRankLengthsRoundUp) {
  const auto split = plan_zigzag_split(Rows{6}, 2, 9);  // 3 padding rows
  EXPECT_EQ(split.seq_lens, (Rows{9}));
  EXPECT_EQ(split.block_lens, (Rows{3, 2, 2, 2}));
  EXPECT_EQ(zigzag_local_rows(split, 0), (Rows{0, 1, 2, 7, 8}));
  EXPECT_EQ(zigzag_local_rows(split, 1), (Rows{3, 4, 5, 6}));
  EXPECT_EQ(split.num_tokens, (Rows{5, 4}));
  EXPECT_EQ(split.padded_rank_len, 8);  // 5 rounded up to 2 * cp = 4

  const auto three = plan_zigzag_split(Rows{7}, 3);
  EXPECT_EQ(three.block_lens, (Rows{2, 1, 1, 1, 1, 1}));
  EXPECT_EQ(zigzag_local_rows(three, 0), (Rows{0, 1, 6}));
  EXPECT_EQ(zigzag_local_rows(three, 1), (Rows{2, 5}));
  EXPECT_EQ(zigzag_local_rows(three, 2), (Rows{3, 4}));
  EXPECT_EQ(three.num_tokens, (Rows{3, 2, 2}));
  EXPECT_EQ(three.padded_rank_len, 6);

  // A sequence shorter than 2 * cp still splits by the same rule (empty blocks); can_zigzag_split says SGLang
  // would not split such a batch.
  const auto shorter = plan_zigzag_split(Rows{3}, 2);
  EXPECT_EQ(shorter.block_lens, (Rows{1, 1, 1, 0}));
  EXPECT_EQ(zigzag_local_rows(shorter, 0), (Rows{0}));
  EXPECT_EQ(zigzag_local_rows(shorter, 1), (Rows{1, 2}));
  const auto one = plan_zigzag_split(Rows{5, 0}, 1);  // cp 1: blocks 0 and 1, all on rank 0
  EXPECT_EQ(zigzag_local_rows(one, 0), (Rows{0, 1, 2, 3, 4}));
}

// Every batch row lands on exactly one rank, and the gathered map is a permutation that inverts the local maps.
TEST(ZigzagSplit, RandomBatchesPartitionTheRows) {
  std::mt19937 rng(3);
  for (int iter = 0; iter < 200; ++iter) {
    const int cp = 1 + static_cast<int>(rng() % 5);
    Rows lens(1 + rng() % 5);
    int64_t total = 0;
    for (auto& l : lens) total += (l = static_cast<int64_t>(rng() % 40));
    const int64_t pad = rng() % 3 == 0 ? static_cast<int64_t>(rng() % 7) : 0;
    const auto split = plan_zigzag_split(lens, cp, total + pad);
    const auto gathered = zigzag_gathered_rows(split);
    ASSERT_EQ(static_cast<int64_t>(gathered.size()), total + pad);
    Rows seen(gathered.size(), 0);
    int64_t base = 0;
    for (int c = 0; c < cp; ++c) {
      const auto local = zigzag_local_rows(split, c);
      ASSERT_EQ(static_cast<int64_t>(local.size()), split.num_tokens[c]);
      for (size_t i = 0; i < local.size(); ++i) {
        ASSERT_EQ(gathered[local[i]], base + static_cast<int64_t>(i));
        ++seen[local[i]];
      }
      base += split.num_tokens[c];
      ASSERT_LE(split.num_tokens[c], split.max_rank_len);
    }
    for (int64_t s : seen) ASSERT_EQ(s, 1);
    ASSERT_EQ(split.padded_rank_len % (2 * cp), 0);
    ASSERT_LT(split.padded_rank_len - split.max_rank_len, 2 * cp);
  }
}

TEST(ZigzagSplit, WhenSglangSplits) {
  EXPECT_TRUE(can_zigzag_split(Rows{8}, 2, ForwardMode::kExtend, 8));
  EXPECT_TRUE(can_zigzag_split(Rows{4, 9}, 2, ForwardMode::kMixed, 13));
  EXPECT_TRUE(can_zigzag_split(Rows{4}, 2, ForwardMode::kExtend, 4));       // exactly 2 * cp
  EXPECT_FALSE(can_zigzag_split(Rows{8}, 1, ForwardMode::kExtend, 8));      // no CP
  EXPECT_FALSE(can_zigzag_split(Rows{8, 3}, 2, ForwardMode::kExtend, 11));  // one sequence under 2 * cp
  EXPECT_FALSE(can_zigzag_split(Rows{8}, 2, ForwardMode::kExtend, 3));      // fewer tokens than 2 * cp
  for (ForwardMode m : {ForwardMode::kDecode, ForwardMode::kIdle, ForwardMode::kTargetVerify, ForwardMode::kDraftExtend,
                        ForwardMode::kPrebuilt}) {
    EXPECT_FALSE(can_zigzag_split(Rows{8}, 2, m, 8)) << to_string(m);
  }
  testing::expect_invalid([] { plan_zigzag_split(Rows{}, 2); }, "at least one sequence");
  testing::expect_invalid([] { plan_zigzag_split(Rows{4, -1}, 2); }, "extend_seq_lens[1] = -1");
  testing::expect_invalid([] { plan_zigzag_split(Rows{4}, 0); }, "cp_size must be in [1, 1024]");
  testing::expect_invalid([] { plan_zigzag_split(Rows{4}, 2, 3); }, "num_tokens must be -1 or in [sum");
  testing::expect_invalid([] { zigzag_local_rows(plan_zigzag_split(Rows{4}, 2), 2); }, "cp_rank must be in [0, 2)");
  testing::expect_invalid([] { can_zigzag_split(Rows{4}, 2, ForwardMode::kExtend, -1); }, "num_tokens must be >= 0");
}

// ---- dp_gather / dp_scatter with CP shards -------------------------------------------------------------

constexpr int64_t kHidden = 3;
constexpr float kPoison = -7777.f;

float value(int d, int64_t batch_row, int64_t h) { return static_cast<float>(1 + d * 1000 + batch_row * 10 + h); }

const Rows kSeqs = {10, 5};
const Rows kCounts = {15, 3};

// This rank's local rows: DP rank 0's CP shard (padded to padded_rank_len with poison), DP rank 1's whole batch on
// CP rank 0 and poison on CP rank 1.
std::vector<float> local_rows(const ParallelLayout& layout, int rank, const ZigzagSplit& split) {
  const RankCoords me = layout.coords(rank);
  std::vector<float> out;
  if (me.attn_dp_rank == 0) {
    out.assign(static_cast<size_t>(split.padded_rank_len * kHidden), kPoison);
    const auto rows = zigzag_local_rows(split, me.attn_cp_rank);
    for (size_t i = 0; i < rows.size(); ++i) {
      for (int64_t h = 0; h < kHidden; ++h) out[i * kHidden + h] = value(0, rows[i], h);
    }
  } else {
    out.assign(static_cast<size_t>(kCounts[1] * kHidden), kPoison);
    for (int64_t i = 0; me.attn_cp_rank == 0 && i < kCounts[1]; ++i) {
      for (int64_t h = 0; h < kHidden; ++h) out[i * kHidden + h] = value(1, i, h);
    }
  }
  return out;
}

TEST(DpGatherCp, ShardsLandBackToBackAndScatterReturnsThem) {
  const auto layout = ParallelLayout::create({.world_size = 4, .attn_dp_size = 2, .attn_cp_size = 2});
  ASSERT_EQ(layout.attn_tp_size(), 1);
  const auto split = plan_zigzag_split(kSeqs, 2);
  const auto gathered_rows = zigzag_gathered_rows(split);
  auto groups = create_host_groups(4, {.timeout_ms = 20'000});
  for (DpPaddingMode mode : {DpPaddingMode::kSumLen, DpPaddingMode::kMaxLen}) {
    const auto plan = plan_dp_gather(kCounts, mode);
    run_host_ranks(groups, [&](int rank, Group& group) {
      const RankCoords me = layout.coords(rank);
      const Rows shards = me.attn_dp_rank == 0 ? split.num_tokens : Rows{};
      auto local = local_rows(layout, rank, split);
      const int64_t local_len = static_cast<int64_t>(local.size()) / kHidden;
      std::vector<float> global(static_cast<size_t>(plan.buffer_len * kHidden), kPoison);
      dp_gather(group, layout, plan, TensorView::of(local.data(), DType::kFloat32, {local_len, kHidden}),
                TensorView::of(global.data(), DType::kFloat32, {plan.buffer_len, kHidden}), nullptr,
                DpGatherSource::kLeader, shards);
      // Batch row i of DP rank 0 sits at offsets[0] + zigzag_gathered_rows[i]; DP rank 1's rows in order.
      std::vector<float> want(global.size(), 0.f);
      for (int64_t i = 0; i < kCounts[0]; ++i) {
        for (int64_t h = 0; h < kHidden; ++h) want[(plan.offsets[0] + gathered_rows[i]) * kHidden + h] = value(0, i, h);
      }
      for (int64_t i = 0; i < kCounts[1]; ++i) {
        for (int64_t h = 0; h < kHidden; ++h) want[(plan.offsets[1] + i) * kHidden + h] = value(1, i, h);
      }
      ASSERT_EQ(global, want) << "rank " << rank << " " << to_string(mode);

      // kSlice with shards gives each CP rank back exactly its shard, the rest of local zero.
      std::vector<float> back(local.size(), kPoison);
      dp_scatter(group, layout, plan, TensorView::of(global.data(), DType::kFloat32, {plan.buffer_len, kHidden}),
                 TensorView::of(back.data(), DType::kFloat32, {local_len, kHidden}), DpScatterKind::kSlice, nullptr,
                 shards);
      std::vector<float> expect_back = local;
      const int64_t valid = me.attn_dp_rank == 0 ? split.num_tokens[me.attn_cp_rank] : kCounts[1];
      for (size_t i = static_cast<size_t>(valid * kHidden); i < expect_back.size(); ++i) expect_back[i] = 0.f;
      if (me.attn_dp_rank == 1) {  // the unsplit DP rank: both CP ranks receive the DP rank's rows
        for (int64_t i = 0; i < kCounts[1]; ++i) {
          for (int64_t h = 0; h < kHidden; ++h) expect_back[i * kHidden + h] = value(1, i, h);
        }
      }
      ASSERT_EQ(back, expect_back) << "rank " << rank << " " << to_string(mode);
    });
  }
}

// positions [num_tokens] (SGLang's shard_position_ids) as 1-D int64: exact in both modes.
TEST(DpGatherCp, OneDimensionalPositionsAreExact) {
  const auto layout = ParallelLayout::create({.world_size = 2, .attn_cp_size = 2});
  const auto split = plan_zigzag_split(Rows{7, 9}, 2, 18);  // two padding rows join the last sequence
  const auto plan = plan_dp_gather(Rows{18}, DpPaddingMode::kMaxLen);
  auto groups = create_host_groups(2, {.timeout_ms = 20'000});
  run_host_ranks(groups, [&](int rank, Group& group) {
    Rows local = zigzag_local_rows(split, rank);  // the value of a row is its batch row
    Rows global(18, -5);
    dp_gather(group, layout, plan, TensorView::of(local.data(), DType::kInt64, {static_cast<int64_t>(local.size())}),
              TensorView::of(global.data(), DType::kInt64, {18}), nullptr, DpGatherSource::kLeader, split.num_tokens);
    const auto at = zigzag_gathered_rows(split);
    for (int64_t i = 0; i < 18; ++i) ASSERT_EQ(global[at[i]], i) << "rank " << rank;
  });
}

// SGLang's dp_gather_partial with shards: every attention-TP rank of a CP shard holds a partial sum of its rows.
TEST(DpGatherCp, PartialSumsPerShard) {
  const auto layout = ParallelLayout::create({.world_size = 4, .attn_cp_size = 2, .attn_tp_size = 2});
  const auto split = plan_zigzag_split(Rows{9}, 2);  // shards [5, 4]
  const auto plan = plan_dp_gather(Rows{9}, DpPaddingMode::kSumLen, 2);
  auto groups = create_host_groups(4, {.timeout_ms = 20'000});
  run_host_ranks(groups, [&](int rank, Group& group) {
    const RankCoords me = layout.coords(rank);
    const auto rows = zigzag_local_rows(split, me.attn_cp_rank);
    std::vector<float> local(rows.size() * kHidden);
    for (size_t i = 0; i < rows.size(); ++i) {
      for (int64_t h = 0; h < kHidden; ++h) local[i * kHidden + h] = value(0, rows[i], h) * (me.attn_tp_rank + 1);
    }
    std::vector<float> global(9 * kHidden, kPoison);
    dp_gather(group, layout, plan,
              TensorView::of(local.data(), DType::kFloat32, {static_cast<int64_t>(rows.size()), kHidden}),
              TensorView::of(global.data(), DType::kFloat32, {9, kHidden}), nullptr, DpGatherSource::kPartialSums,
              split.num_tokens);
    const auto at = zigzag_gathered_rows(split);
    for (int64_t i = 0; i < 9; ++i) {
      for (int64_t h = 0; h < kHidden; ++h) ASSERT_EQ(global[at[i] * kHidden + h], 3 * value(0, i, h));
    }
  });
}

// kReduceScatter under CP: every CP rank receives its DP rank's full rows, summed over all ranks.
TEST(DpScatterCp, ReduceScatterGivesEveryCpRankTheDpRows) {
  const auto layout = ParallelLayout::create({.world_size = 4, .attn_dp_size = 2, .attn_cp_size = 2});
  for (DpPaddingMode mode : {DpPaddingMode::kSumLen, DpPaddingMode::kMaxLen}) {
    const auto plan = plan_dp_gather(kCounts, mode);
    auto groups = create_host_groups(4, {.timeout_ms = 20'000});
    run_host_ranks(groups, [&](int rank, Group& group) {
      std::vector<float> global(static_cast<size_t>(plan.buffer_len * kHidden));
      for (size_t i = 0; i < global.size(); ++i) global[i] = static_cast<float>((rank + 1) * (static_cast<int>(i) + 1));
      const int d = layout.coords(rank).attn_dp_rank;
      std::vector<float> local(static_cast<size_t>((kCounts[d] + 1) * kHidden), kPoison);
      dp_scatter(group, layout, plan, TensorView::of(global.data(), DType::kFloat32, {plan.buffer_len, kHidden}),
                 TensorView::of(local.data(), DType::kFloat32, {kCounts[d] + 1, kHidden}),
                 DpScatterKind::kReduceScatter);
      for (int64_t i = 0; i < kCounts[d] * kHidden; ++i) {
        ASSERT_EQ(local[i], static_cast<float>(10 * (plan.offsets[d] * kHidden + i + 1))) << "rank " << rank;
      }
      for (int64_t h = 0; h < kHidden; ++h) ASSERT_EQ(local[kCounts[d] * kHidden + h], 0.f);
    });
  }
}

TEST(DpGatherCp, RejectsBadShardsOnEveryRank) {
  const auto layout = ParallelLayout::create({.world_size = 2, .attn_cp_size = 2});
  const auto plan = plan_dp_gather(Rows{5}, DpPaddingMode::kSumLen);
  auto groups = create_host_groups(2, {.timeout_ms = 5'000});
  std::vector<float> local(5 * kHidden), global(5 * kHidden);
  const auto lv = TensorView::of(local.data(), DType::kFloat32, {5, kHidden});
  const auto gv = TensorView::of(global.data(), DType::kFloat32, {5, kHidden});
  // Rank 0's shards are rejected on rank 0 only: it raises kInvalidArgument and, having taken part with an error
  // flag, makes rank 1 (good shards [3, 2]) raise kPeerFailure in the same call.
  auto rejected = [&](const std::string& needle, const std::function<void(Group&)>& bad_call, bool scatter = false) {
    testing::expect_rejected_on_rank(groups, 0, needle, [&](int rank, Group& group) {
      if (rank == 0) return bad_call(group);
      std::vector<float> l(5 * kHidden), gl(5 * kHidden);
      const auto l_view = TensorView::of(l.data(), DType::kFloat32, {5, kHidden});
      const auto gl_view = TensorView::of(gl.data(), DType::kFloat32, {5, kHidden});
      if (scatter) {
        dp_scatter(group, layout, plan, gl_view, l_view, DpScatterKind::kReduceScatter);
      } else {
        dp_gather(group, layout, plan, l_view, gl_view, nullptr, DpGatherSource::kLeader, Rows{3, 2});
      }
    });
  };
  rejected("cp_shard_counts must hold attn_cp_size = 2 counts",
           [&](Group& g0) { dp_gather(g0, layout, plan, lv, gv, nullptr, DpGatherSource::kLeader, Rows{5}); });
  rejected("must sum to plan.num_tokens[0] = 5", [&](Group& g0) {
    dp_gather(g0, layout, plan, lv, gv, nullptr, DpGatherSource::kLeader, Rows{3, 3});
  });
  rejected("cp_shard_counts[0] must be in [0, 2^40]", [&](Group& g0) {
    dp_gather(g0, layout, plan, lv, gv, nullptr, DpGatherSource::kLeader, Rows{-1, 6});
  });
  rejected("at least cp_shard_counts[0] = 3 rows", [&](Group& g0) {
    dp_gather(g0, layout, plan, TensorView::of(local.data(), DType::kFloat32, {2, kHidden}), gv, nullptr,
              DpGatherSource::kLeader, Rows{3, 2});
  });
  rejected(
      "kReduceScatter takes no cp_shard_counts",
      [&](Group& g0) {
        dp_scatter(g0, layout, plan, gv, lv, DpScatterKind::kReduceScatter, nullptr, Rows{3, 2});
      },
      /*scatter=*/true);
  // CP ranks of one DP rank that disagree on the shards all fail, none hangs.
  std::atomic<int> num_failed{0};
  run_host_ranks(groups, [&](int rank, Group& group) {
    std::vector<float> l(5 * kHidden), gl(5 * kHidden);
    try {
      dp_gather(group, layout, plan, TensorView::of(l.data(), DType::kFloat32, {5, kHidden}),
                TensorView::of(gl.data(), DType::kFloat32, {5, kHidden}), nullptr, DpGatherSource::kLeader,
                rank == 0 ? Rows{3, 2} : Rows{2, 3});
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("rank 1 passed cp_shard_counts [2, 3], its DP leader rank 0 [3, 2]"),
                std::string::npos)
          << e.what();
      ++num_failed;
    }
  });
  EXPECT_EQ(num_failed.load(), 2);
}

}  // namespace
}  // namespace epx
