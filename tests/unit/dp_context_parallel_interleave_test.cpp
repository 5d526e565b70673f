// Attention context parallelism (attn_cp > 1): SGLang's interleave (round-robin) split pinned on hand-worked
// batches (python/sglang/srt/layers/cp/interleave.py, InterleaveCPStrategy.can_apply / build_metadata), checked
// against a brute-force restatement of build_metadata on random batches, and dp_gather / dp_scatter with its shards
// on the host backend.
//
// SGLang's rule: CP rank c holds the batch rows c, c + cp, c + 2cp, ... below num_tokens (padding rows included), in
// ascending order; per_rank_actual_token counts them, per_rank_real_token counts those below the sum of the extend
// lengths; restore_indices is the argsort of the rank-major row list; the physical rank length is the max rounded up
// to a multiple of cp (padding.py).
//
// Routing of the collective test: world 4 = attn_dp 2 x attn_cp 2 (attn_tp 1), ranks 0, 1 = DP rank 0's CP ranks
// 0, 1 and ranks 2, 3 = DP rank 1's. Both DP ranks run split extend batches: DP rank 0 sequences [7, 4] with one
// padding row (12 rows, shards [6, 6]), DP rank 1 one sequence of 3 (shards [2, 1]). Each CP rank's local tensor is
// its shard padded to padded_rank_len with poison. Row values are small integers, exact in fp32; every output
// element is checked.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "epx/dp.h"
#include "epx/error.h"
#include "test_util.h"

namespace epx {
namespace {

using Rows = std::vector<int64_t>;

// cp = 3, sequences [5, 3] (rows 0-4 and 5-7), num_tokens 10: rows 8 and 9 are padding.
//   rank c takes rows c, c + 3, ... < 10:   rank 0: 0 3 6 9   rank 1: 1 4 7   rank 2: 2 5 8
//   per_rank_actual_token [4, 3, 3]; real rows (< 8): rank 0: 0 3 6, rank 1: 1 4 7, rank 2: 2 5 -> [3, 3, 2]
//   max_rank_len 4, physical length 4 rounded up to a multiple of cp = 6
//   rank-major list [0 3 6 9 | 1 4 7 | 2 5 8]; row i sits at position start[i % 3] + i / 3 with starts [0, 4, 7]:
//     restore_indices = [0, 4, 7, 1, 5, 8, 2, 6, 9, 3]
//   real rank-major list [0 3 6 | 1 4 7 | 2 5], starts [0, 3, 6]: restore_real_indices = [0, 3, 6, 1, 4, 7, 2, 5]
TEST(InterleaveSplit, HandWorkedWithPadding) {
  const auto split = plan_interleave_split(Rows{5, 3}, 3, 10);
  EXPECT_EQ(split.seq_lens, (Rows{5, 3}));  // padding does not join a sequence (zigzag's does)
  EXPECT_EQ(split.seq_offsets, (Rows{0, 5}));
  EXPECT_EQ(split.num_batch_tokens, 10);
  EXPECT_EQ(split.num_real_batch_tokens, 8);
  EXPECT_EQ(split.num_tokens, (Rows{4, 3, 3}));
  EXPECT_EQ(split.num_real_tokens, (Rows{3, 3, 2}));
  EXPECT_EQ(split.max_rank_len, 4);
  EXPECT_EQ(split.padded_rank_len, 6);
  EXPECT_EQ(interleave_local_rows(split, 0), (Rows{0, 3, 6, 9}));
  EXPECT_EQ(interleave_local_rows(split, 1), (Rows{1, 4, 7}));
  EXPECT_EQ(interleave_local_rows(split, 2), (Rows{2, 5, 8}));
  EXPECT_EQ(interleave_gathered_rows(split), (Rows{0, 4, 7, 1, 5, 8, 2, 6, 9, 3}));
  EXPECT_EQ(interleave_gathered_rows(split, /*real_rows_only=*/true), (Rows{0, 3, 6, 1, 4, 7, 2, 5}));
}

// The example of SGLang's module docstring: cp 4, rank 1 owns every fourth token from token 1.
TEST(InterleaveSplit, OneSequenceDivisible) {
  const auto split = plan_interleave_split(Rows{20}, 4);
  EXPECT_EQ(interleave_local_rows(split, 0), (Rows{0, 4, 8, 12, 16}));
  EXPECT_EQ(interleave_local_rows(split, 1), (Rows{1, 5, 9, 13, 17}));
  EXPECT_EQ(interleave_local_rows(split, 3), (Rows{3, 7, 11, 15, 19}));
  EXPECT_EQ(split.num_tokens, (Rows{5, 5, 5, 5}));
  EXPECT_EQ(split.num_real_tokens, split.num_tokens);
  EXPECT_EQ(split.padded_rank_len, 8);  // 5 rounded up to cp = 4
  // Rank-major [0 4 8 12 16 | 1 5 ... | 2 6 ... | 3 7 ...]: row i at 5 * (i % 4) + i / 4.
  const auto gathered = interleave_gathered_rows(split);
  for (int64_t i = 0; i < 20; ++i) EXPECT_EQ(gathered[i], 5 * (i % 4) + i / 4) << i;
}

// Fewer rows than ranks: rows 0, 1 go to ranks 0, 1; ranks 2, 3 hold nothing (can_interleave_split says SGLang
// would not split such a batch). cp 1: every row on rank 0, in order.
TEST(InterleaveSplit, FewerRowsThanRanksAndNoCp) {
  const auto split = plan_interleave_split(Rows{2}, 4);
  EXPECT_EQ(split.num_tokens, (Rows{1, 1, 0, 0}));
  EXPECT_EQ(split.max_rank_len, 1);
  EXPECT_EQ(split.padded_rank_len, 4);
  EXPECT_EQ(interleave_local_rows(split, 2), Rows{});
  EXPECT_EQ(interleave_gathered_rows(split), (Rows{0, 1}));
  const auto one = plan_interleave_split(Rows{3, 0, 2}, 1);
  EXPECT_EQ(interleave_local_rows(one, 0), (Rows{0, 1, 2, 3, 4}));
  EXPECT_EQ(interleave_gathered_rows(one), (Rows{0, 1, 2, 3, 4}));
  EXPECT_EQ(one.padded_rank_len, 5);
  const auto empty = plan_interleave_split(Rows{0}, 2, 0);
  EXPECT_EQ(empty.num_tokens, (Rows{0, 0}));
  EXPECT_EQ(empty.padded_rank_len, 0);
}

// SGLang's query_request_indices / query_cache_lengths: request = bisect_right(seq_ends, row), cache length =
// prefix + (row - seq_start) + 1, for the real rows only.
//   Sequences [5, 3] (rows 0-4, 5-7), prefixes [4, 0], cp 3, 10 rows:
//     rank 0 real rows 0 3 6 -> sequences 0 0 1, KV 4+0+1 = 5, 4+3+1 = 8, 0+1+1 = 2 (row 9 is padding: no query)
//     rank 1 real rows 1 4 7 -> sequences 0 0 1, KV 6, 9, 3
//     rank 2 real rows 2 5   -> sequences 0 1,   KV 7, 1   (row 8 is padding)
//   Sequences [3, 0, 2] (rows 0-2, none, 3-4), no prefixes, cp 2: the empty sequence gets no rows.
//     rank 0 rows 0 2 4 -> sequences 0 0 2, KV 1 3 2;  rank 1 rows 1 3 -> sequences 0 2, KV 2 1
TEST(InterleaveSplit, LocalQueries) {
  const auto split = plan_interleave_split(Rows{5, 3}, 3, 10);
  const Rows prefix = {4, 0};
  auto q = interleave_local_queries(split, 0, prefix);
  EXPECT_EQ(q.seq_idx, (Rows{0, 0, 1}));
  EXPECT_EQ(q.kv_lens, (Rows{5, 8, 2}));
  q = interleave_local_queries(split, 1, prefix);
  EXPECT_EQ(q.seq_idx, (Rows{0, 0, 1}));
  EXPECT_EQ(q.kv_lens, (Rows{6, 9, 3}));
  q = interleave_local_queries(split, 2, prefix);
  EXPECT_EQ(q.seq_idx, (Rows{0, 1}));
  EXPECT_EQ(q.kv_lens, (Rows{7, 1}));

  const auto gap = plan_interleave_split(Rows{3, 0, 2}, 2);
  q = interleave_local_queries(gap, 0);
  EXPECT_EQ(q.seq_idx, (Rows{0, 0, 2}));
  EXPECT_EQ(q.kv_lens, (Rows{1, 3, 2}));
  q = interleave_local_queries(gap, 1);
  EXPECT_EQ(q.seq_idx, (Rows{0, 2}));
  EXPECT_EQ(q.kv_lens, (Rows{2, 1}));
}

// Brute force, restating build_metadata step by step: each rank's rows by filtering every row, the rank-major list,
// its argsort (a stable sort by value), the real-row variants, and the query metadata by a search over the
// sequence ends.
TEST(InterleaveSplit, RandomBatchesMatchBruteForce) {
  std::mt19937 rng(5);
  for (int iter = 0; iter < 300; ++iter) {
    const int cp = 1 + static_cast<int>(rng() % 6);
    Rows lens(1 + rng() % 5), prefix(lens.size());
    int64_t real = 0;
    for (auto& l : lens) real += (l = static_cast<int64_t>(rng() % 30));
    for (auto& p : prefix) p = static_cast<int64_t>(rng() % 50);
    const int64_t pad = rng() % 2 == 0 ? static_cast<int64_t>(rng() % 9) : 0;
    const int64_t total = real + pad;
    const auto split = plan_interleave_split(lens, cp, iter % 7 == 0 && pad == 0 ? -1 : total);
    ASSERT_EQ(split.num_batch_tokens, total);
    ASSERT_EQ(split.num_real_batch_tokens, real);

    std::vector<Rows> per_rank(cp), per_rank_real(cp);
    for (int64_t row = 0; row < total; ++row) {
      for (int c = 0; c < cp; ++c) {
        if (row % cp != c) continue;
        per_rank[c].push_back(row);
        if (row < real) per_rank_real[c].push_back(row);
      }
    }
    Rows rank_major, rank_major_real;
    for (int c = 0; c < cp; ++c) {
      ASSERT_EQ(interleave_local_rows(split, c), per_rank[c]);
      ASSERT_EQ(split.num_tokens[c], static_cast<int64_t>(per_rank[c].size()));
      ASSERT_EQ(split.num_real_tokens[c], static_cast<int64_t>(per_rank_real[c].size()));
      rank_major.insert(rank_major.end(), per_rank[c].begin(), per_rank[c].end());
      rank_major_real.insert(rank_major_real.end(), per_rank_real[c].begin(), per_rank_real[c].end());
    }
    const auto argsort = [](const Rows& v) {
      Rows idx(v.size());
      std::iota(idx.begin(), idx.end(), 0);
      std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return v[a] < v[b]; });
      return idx;
    };
    ASSERT_EQ(interleave_gathered_rows(split), argsort(rank_major));
    ASSERT_EQ(interleave_gathered_rows(split, true), argsort(rank_major_real));

    int64_t max_len = 0;
    for (const auto& r : per_rank) max_len = std::max<int64_t>(max_len, static_cast<int64_t>(r.size()));
    ASSERT_EQ(split.max_rank_len, max_len);
    ASSERT_EQ(split.padded_rank_len, (max_len + cp - 1) / cp * cp);

    Rows seq_ends(lens.size());
    std::partial_sum(lens.begin(), lens.end(), seq_ends.begin());
    for (int c = 0; c < cp; ++c) {
      const auto q = interleave_local_queries(split, c, prefix);
      ASSERT_EQ(q.seq_idx.size(), per_rank_real[c].size());
      for (size_t i = 0; i < per_rank_real[c].size(); ++i) {
        const int64_t row = per_rank_real[c][i];
        const int64_t s = std::upper_bound(seq_ends.begin(), seq_ends.end(), row) - seq_ends.begin();
        const int64_t start = s == 0 ? 0 : seq_ends[s - 1];
        ASSERT_EQ(q.seq_idx[i], s);
        ASSERT_EQ(q.kv_lens[i], prefix[s] + row - start + 1);
      }
    }
  }
}

TEST(InterleaveSplit, WhenSglangSplits) {
  EXPECT_TRUE(can_interleave_split(2, ForwardMode::kExtend, 2));  // exactly cp rows
  EXPECT_TRUE(can_interleave_split(4, ForwardMode::kMixed, 9));
  EXPECT_FALSE(can_interleave_split(1, ForwardMode::kExtend, 8));  // no CP
  EXPECT_FALSE(can_interleave_split(4, ForwardMode::kExtend, 3));  // fewer rows than ranks
  for (ForwardMode m : {ForwardMode::kDecode, ForwardMode::kIdle, ForwardMode::kTargetVerify, ForwardMode::kDraftExtend,
                        ForwardMode::kPrebuilt}) {
    EXPECT_FALSE(can_interleave_split(2, m, 8)) << to_string(m);
  }
  // A sequence shorter than cp does not stop interleave; it stops zigzag (every sequence needs 2 * cp rows).
  EXPECT_TRUE(can_cp_split(CpStrategy::kInterleave, Rows{8, 1}, 2, ForwardMode::kExtend, 9));
  EXPECT_FALSE(can_cp_split(CpStrategy::kZigzag, Rows{8, 1}, 2, ForwardMode::kExtend, 9));
  EXPECT_TRUE(can_cp_split(CpStrategy::kZigzag, Rows{8}, 2, ForwardMode::kExtend, 8));

  EXPECT_EQ(parse_cp_strategy("zigzag"), CpStrategy::kZigzag);
  EXPECT_EQ(parse_cp_strategy("interleave"), CpStrategy::kInterleave);
  EXPECT_STREQ(to_string(CpStrategy::kZigzag), "zigzag");
  EXPECT_STREQ(to_string(CpStrategy::kInterleave), "interleave");
}

TEST(InterleaveSplit, RejectsBadInput) {
  testing::expect_invalid([] { parse_cp_strategy("round-robin-split"); },
                          "cp_strategy must be \"zigzag\" or \"interleave\", got \"round-robin-split\"");
  testing::expect_invalid([] { parse_cp_strategy("Zigzag"); }, "cp_strategy must be");
  testing::expect_invalid([] { plan_interleave_split(Rows{}, 2); }, "at least one sequence");
  testing::expect_invalid([] { plan_interleave_split(Rows{4, -1}, 2); }, "extend_seq_lens[1] = -1");
  testing::expect_invalid([] { plan_interleave_split(Rows{4}, 0); }, "cp_size must be in [1, 1024]");
  testing::expect_invalid([] { plan_interleave_split(Rows{4}, 1025); }, "cp_size must be in [1, 1024]");
  testing::expect_invalid([] { plan_interleave_split(Rows{4}, 2, 3); }, "num_tokens must be -1 or in [sum");
  testing::expect_invalid([] { interleave_local_rows(plan_interleave_split(Rows{4}, 2), 2); },
                          "interleave_local_rows: cp_rank must be in [0, 2)");
  testing::expect_invalid([] { interleave_local_queries(plan_interleave_split(Rows{4}, 2), -1); },
                          "interleave_local_queries: cp_rank must be in [0, 2)");
  testing::expect_invalid(
      [] {
        interleave_local_queries(plan_interleave_split(Rows{4, 2}, 2), 0, Rows{1});
      },
      "prefix_lens must be empty or hold num_seqs = 2 lengths, got 1");
  testing::expect_invalid(
      [] {
        interleave_local_queries(plan_interleave_split(Rows{4, 2}, 2), 0, Rows{1, -3});
      },
      "prefix_lens[1] must be in [0, 2^40], got -3");
  testing::expect_invalid([] { can_interleave_split(2, ForwardMode::kExtend, -1); }, "num_tokens must be >= 0");
  testing::expect_invalid([] { can_interleave_split(0, ForwardMode::kExtend, 4); }, "cp_size must be in [1, 1024]");
  testing::expect_invalid([] { can_cp_split(CpStrategy::kInterleave, Rows{-2}, 2, ForwardMode::kExtend, 4); },
                          "can_cp_split: extend_seq_lens[0] = -2");
  // A split edited by hand is refused rather than giving rows out of range.
  auto edited = plan_interleave_split(Rows{6}, 2);
  edited.num_tokens[1] = 5;
  testing::expect_invalid([&] { interleave_gathered_rows(edited); }, "split must come from plan_interleave_split");
  edited = plan_interleave_split(Rows{6}, 2);
  edited.num_batch_tokens = 4;
  testing::expect_invalid([&] { interleave_local_rows(edited, 0); }, "split must come from plan_interleave_split");
}

// ---- dp_gather / dp_scatter with interleave shards -----------------------------------------------------

constexpr int64_t kHidden = 3;
constexpr float kPoison = -7777.f;

float value(int d, int64_t batch_row, int64_t h) { return static_cast<float>(1 + d * 1000 + batch_row * 10 + h); }

TEST(DpGatherCpInterleave, ShardsLandBackToBackAndScatterReturnsThem) {
  const auto layout = ParallelLayout::create({.world_size = 4, .attn_dp_size = 2, .attn_cp_size = 2});
  ASSERT_EQ(layout.attn_tp_size(), 1);
  const InterleaveSplit splits[2] = {plan_interleave_split(Rows{7, 4}, 2, 12), plan_interleave_split(Rows{3}, 2)};
  ASSERT_EQ(splits[0].num_tokens, (Rows{6, 6}));
  ASSERT_EQ(splits[1].num_tokens, (Rows{2, 1}));
  const Rows counts = {12, 3};
  auto groups = create_host_groups(4, {.timeout_ms = 20'000});
  for (DpPaddingMode mode : {DpPaddingMode::kSumLen, DpPaddingMode::kMaxLen}) {
    const auto plan = plan_dp_gather(counts, mode);
    run_host_ranks(groups, [&](int rank, Group& group) {
      const RankCoords me = layout.coords(rank);
      const InterleaveSplit& split = splits[me.attn_dp_rank];
      const auto rows = interleave_local_rows(split, me.attn_cp_rank);
      std::vector<float> local(static_cast<size_t>(split.padded_rank_len * kHidden), kPoison);
      for (size_t i = 0; i < rows.size(); ++i) {
        for (int64_t h = 0; h < kHidden; ++h) local[i * kHidden + h] = value(me.attn_dp_rank, rows[i], h);
      }
      const int64_t local_len = split.padded_rank_len;
      std::vector<float> global(static_cast<size_t>(plan.buffer_len * kHidden), kPoison);
      dp_gather(group, layout, plan, TensorView::of(local.data(), DType::kFloat32, {local_len, kHidden}),
                TensorView::of(global.data(), DType::kFloat32, {plan.buffer_len, kHidden}), nullptr,
                DpGatherSource::kLeader, split.num_tokens);
      // Batch row i of DP rank d at offsets[d] + interleave_gathered_rows[i]; every other row zero.
      std::vector<float> want(global.size(), 0.f);
      for (int d = 0; d < 2; ++d) {
        const auto at = interleave_gathered_rows(splits[d]);
        for (int64_t i = 0; i < counts[d]; ++i) {
          for (int64_t h = 0; h < kHidden; ++h) want[(plan.offsets[d] + at[i]) * kHidden + h] = value(d, i, h);
        }
      }
      ASSERT_EQ(global, want) << "rank " << rank << " " << to_string(mode);

      // kSlice with the shards gives each CP rank back its shard, the rest of local (its padding) zero.
      std::vector<float> back(local.size(), kPoison);
      dp_scatter(group, layout, plan, TensorView::of(global.data(), DType::kFloat32, {plan.buffer_len, kHidden}),
                 TensorView::of(back.data(), DType::kFloat32, {local_len, kHidden}), DpScatterKind::kSlice, nullptr,
                 split.num_tokens);
      std::vector<float> expect_back = local;
      for (size_t i = rows.size() * kHidden; i < expect_back.size(); ++i) expect_back[i] = 0.f;
      ASSERT_EQ(back, expect_back) << "rank " << rank << " " << to_string(mode);
    });
  }
}

}  // namespace
}  // namespace epx
