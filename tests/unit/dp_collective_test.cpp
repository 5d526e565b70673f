// DP attention collectives on the host backend (ranks as threads): gather / scatter in both padding
// modes with idle ranks and attention-TP replicas, and the per-step batch-metadata sync.
//
// Data: DP rank d's leader holds rows value(d, t, h) drawn from a per-(seed, d) generator; non-leader
// replicas hold poison (1e6) so a row that came from them shows. Every output element is checked.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "epx/dp.h"
#include "epx/error.h"
#include "epx/quant.h"
#include "test_util.h"

namespace epx {
namespace {

constexpr int64_t kHidden = 48;
constexpr float kPoison = 1e6f;

struct Case {
  int world;
  int attn_dp;
};

// The rows of DP rank d, as fp32 (bf16-representable, so both dtypes carry them exactly).
std::vector<float> dp_rows(uint64_t seed, int d, int64_t count) {
  std::mt19937 rng(static_cast<uint32_t>(seed * 131 + d));
  const auto bits = testing::random_bf16(rng, static_cast<size_t>(count * kHidden));
  std::vector<float> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = bf16_to_float(bits[i]);
  return out;
}

// A host buffer of `rows` x kHidden in `dtype`, filled from fp32 values (or `fill` past values.size()).
struct HostBuf {
  DType dtype;
  std::vector<float> f32;
  std::vector<uint16_t> bf16;
  int64_t rows;

  HostBuf(DType dtype, int64_t rows, const std::vector<float>& values, float fill) : dtype(dtype), rows(rows) {
    const size_t n = static_cast<size_t>(rows * kHidden);
    if (dtype == DType::kFloat32) {
      f32.assign(n, fill);
      std::copy(values.begin(), values.end(), f32.begin());
    } else {
      bf16.assign(n, float_to_bf16(fill));
      for (size_t i = 0; i < values.size(); ++i) bf16[i] = float_to_bf16(values[i]);
    }
  }
  TensorView view() {
    void* p = dtype == DType::kFloat32 ? static_cast<void*>(f32.data()) : static_cast<void*>(bf16.data());
    return TensorView::of(rows == 0 ? nullptr : p, dtype, {rows, kHidden});
  }
  float at(int64_t i) const { return dtype == DType::kFloat32 ? f32[i] : bf16_to_float(bf16[i]); }
};

TEST(DpGather, BothModesIdleRanksAndTpReplicasMatchConcatenation) {
  std::mt19937 rng(5);
  int num_checked = 0;
  for (const Case c : {Case{1, 1}, Case{3, 3}, Case{4, 4}, Case{4, 2}, Case{8, 4}, Case{6, 2}}) {
    const auto layout = ParallelLayout::create({.world_size = c.world, .attn_dp_size = c.attn_dp});
    auto groups = create_host_groups(c.world, {.timeout_ms = 20'000});
    for (int iter = 0; iter < 4; ++iter) {
      std::vector<int64_t> counts(c.attn_dp);
      for (auto& n : counts) n = rng() % 3 == 0 ? 0 : static_cast<int64_t>(rng() % 40);  // some DP ranks idle
      for (DpPaddingMode mode : {DpPaddingMode::kMaxLen, DpPaddingMode::kSumLen}) {
        for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
          const uint64_t seed = rng();
          const DpGatherPlan plan = plan_dp_gather(counts, mode, layout.attn_tp_size());
          std::atomic<int> checked{0};
          run_host_ranks(groups, [&](int rank, Group& group) {
            const int d = layout.coords(rank).attn_dp_rank;
            const int64_t extra = rank % 3;  // CUDA-graph style padding rows beyond the count
            const auto rows = dp_rows(seed, d, counts[d]);
            HostBuf local(dtype, counts[d] + extra, layout.is_dp_leader(rank) ? rows : std::vector<float>{}, kPoison);
            HostBuf global(dtype, plan.buffer_len, {}, -7.f);  // poisoned: every row must be written
            dp_gather(group, layout, plan, local.view(), global.view());
            std::vector<float> expected(static_cast<size_t>(plan.buffer_len * kHidden), 0.f);
            for (int e = 0; e < c.attn_dp; ++e) {
              const auto src = dp_rows(seed, e, counts[e]);
              std::copy(src.begin(), src.end(), expected.begin() + plan.offsets[e] * kHidden);
            }
            for (size_t i = 0; i < expected.size(); ++i) {
              if (global.at(static_cast<int64_t>(i)) != expected[i]) {
                ADD_FAILURE() << "rank " << rank << " " << to_string(mode) << " " << to_string(dtype) << " element "
                              << i << ": " << global.at(static_cast<int64_t>(i)) << " != " << expected[i];
                return;
              }
            }
            // Scatter (slice) is the inverse: this rank's rows back, padding rows zeroed.
            HostBuf back(dtype, counts[d] + extra, {}, kPoison);
            dp_scatter(group, layout, plan, global.view(), back.view(), DpScatterKind::kSlice);
            for (int64_t i = 0; i < back.rows * kHidden; ++i) {
              const float want = i < counts[d] * kHidden ? rows[i] : 0.f;
              if (back.at(i) != want) {
                ADD_FAILURE() << "rank " << rank << " scatter element " << i << ": " << back.at(i) << " != " << want;
                return;
              }
            }
            ++checked;
          });
          ASSERT_EQ(checked.load(), c.world);
          ++num_checked;
        }
      }
    }
  }
  EXPECT_EQ(num_checked, 6 * 4 * 2 * 2);
}

TEST(DpGather, SumLenWritesNegativeZeroAsPositiveZero) {
  // An all-reduce of 0 + (-0) gives +0; MAX_LEN copies bits.
  const auto layout = ParallelLayout::pure_dp(2);
  auto groups = create_host_groups(2);
  const std::vector<int64_t> counts{1, 1};
  for (DpPaddingMode mode : {DpPaddingMode::kMaxLen, DpPaddingMode::kSumLen}) {
    const auto plan = plan_dp_gather(counts, mode);
    run_host_ranks(groups, [&](int rank, Group& group) {
      std::vector<float> local(kHidden, -0.f), global(2 * kHidden, 1.f);
      dp_gather(group, layout, plan, TensorView::of(local.data(), DType::kFloat32, {1, kHidden}),
                TensorView::of(global.data(), DType::kFloat32, {2, kHidden}));
      for (float v : global) {
        EXPECT_EQ(v, 0.f);
        EXPECT_EQ(std::signbit(v), mode == DpPaddingMode::kMaxLen);
      }
    });
  }
}

TEST(DpGather, SumLenBf16BitsMatchZeroPlusX) {
  // bf16 rows: -0 -> +0, a signaling NaN is quieted, everything else keeps its bits (as 0.f + x would).
  const auto layout = ParallelLayout::pure_dp(2);
  auto groups = create_host_groups(2);
  const std::vector<int64_t> counts{1, 0};
  const auto plan = plan_dp_gather(counts, DpPaddingMode::kSumLen);
  run_host_ranks(groups, [&](int rank, Group& group) {
    std::vector<uint16_t> local(kHidden, 0x3f80), global(kHidden, 0xffff);
    local[0] = 0x8000;  // -0
    local[1] = 0x7f81;  // signaling NaN
    local[2] = 0xffc3;  // quiet NaN
    local[3] = 0xff80;  // -inf
    local[4] = 0x0001;  // smallest subnormal
    dp_gather(group, layout, plan, TensorView::of(local.data(), DType::kBFloat16, {rank == 0 ? 1 : 0, kHidden}),
              TensorView::of(global.data(), DType::kBFloat16, {1, kHidden}));
    for (int64_t h = 0; h < kHidden; ++h) {
      EXPECT_EQ(global[h], float_to_bf16(0.f + bf16_to_float(local[h]))) << "rank " << rank << " h " << h;
    }
    EXPECT_EQ(global[0], 0x0000);
    EXPECT_EQ(global[1], 0x7fc1);
  });
}

// Attention-TP partial sums (SGLang's dp_gather_partial): every TP rank of a DP rank holds a partial sum of its
// rows, and the gather returns their sum (fp32, TP-rank order, one rounding) in either padding mode, every other row
// zero (MAX_LEN: the padding of each slot); ranks that disagree on the source raise on every rank.
TEST(DpGather, PartialSumsReduceAndGatherInOneStep) {
  std::mt19937 rng(12);
  for (const Case c : {Case{4, 2}, Case{6, 2}, Case{8, 4}, Case{3, 3}}) {
    const auto layout = ParallelLayout::create({.world_size = c.world, .attn_dp_size = c.attn_dp});
    auto groups = create_host_groups(c.world);
    for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
      for (DpPaddingMode mode : {DpPaddingMode::kSumLen, DpPaddingMode::kMaxLen}) {
        std::vector<int64_t> counts(c.attn_dp);
        for (auto& n : counts) n = rng() % 4 == 0 ? 0 : static_cast<int64_t>(rng() % 30);
        const auto plan = plan_dp_gather(counts, mode, layout.attn_tp_size());
        const uint64_t seed = rng();
        auto partial = [&](int r) {  // rank r's partial sum of its DP rank's rows
          return dp_rows(seed + 7919 * static_cast<uint64_t>(r), 0, counts[layout.coords(r).attn_dp_rank]);
        };
        run_host_ranks(groups, [&](int rank, Group& group) {
          const int d = layout.coords(rank).attn_dp_rank;
          HostBuf local(dtype, counts[d] + 1, partial(rank), kPoison);
          HostBuf global(dtype, plan.buffer_len, {}, kPoison);
          dp_gather(group, layout, plan, local.view(), global.view(), nullptr, DpGatherSource::kPartialSums);
          for (int dd = 0; dd < c.attn_dp; ++dd) {
            std::vector<float> sum(static_cast<size_t>(counts[dd] * kHidden), 0.f);
            for (int t = 0; t < layout.attn_tp_size(); ++t) {
              const auto p = partial(layout.attn_rank(dd, 0, t));
              for (size_t i = 0; i < sum.size(); ++i) sum[i] += p[i];
            }
            for (size_t i = 0; i < sum.size(); ++i) {
              const float want = dtype == DType::kFloat32 ? sum[i] : bf16_to_float(float_to_bf16(sum[i]));
              ASSERT_EQ(global.at(plan.offsets[dd] * kHidden + static_cast<int64_t>(i)), want)
                  << "rank " << rank << " DP rank " << dd << " element " << i << " " << to_string(mode);
            }
          }
          // Every row outside the DP ranks' blocks (MAX_LEN: the slots' padding) is zero.
          for (int64_t row = 0; row < plan.buffer_len; ++row) {
            bool inside = false;
            for (int dd = 0; dd < c.attn_dp; ++dd) {
              inside = inside || (row >= plan.offsets[dd] && row < plan.offsets[dd] + counts[dd]);
            }
            if (inside) continue;
            for (int64_t i = 0; i < kHidden; ++i) {
              ASSERT_EQ(global.at(row * kHidden + i), 0.f)
                  << "rank " << rank << " row " << row << " " << to_string(mode);
            }
          }
        });
      }
    }
  }
  const auto layout = ParallelLayout::create({.world_size = 4, .attn_dp_size = 2});
  auto groups = create_host_groups(4);
  run_host_ranks(groups, [&](int rank, Group& group) {
    HostBuf local(DType::kFloat32, 3, {}, 1.f);
    const std::vector<int64_t> three = {3, 3};
    const auto sum_plan = plan_dp_gather(three, DpPaddingMode::kSumLen, 2);
    HostBuf sum_global(DType::kFloat32, sum_plan.buffer_len, {}, 0.f);
    const auto source = rank == 1 ? DpGatherSource::kLeader : DpGatherSource::kPartialSums;
    try {
      dp_gather(group, layout, sum_plan, local.view(), sum_global.view(), nullptr, source);
      ADD_FAILURE() << "disagreeing sources accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("rank 1 passed source"), std::string::npos) << e.what();
    }
  });
}

TEST(DpScatter, ReduceScatterSumsEveryRanksPartialBuffer) {
  std::mt19937 rng(9);
  for (const Case c : {Case{2, 2}, Case{4, 4}, Case{4, 2}, Case{5, 5}}) {
    const auto layout = ParallelLayout::create({.world_size = c.world, .attn_dp_size = c.attn_dp});
    auto groups = create_host_groups(c.world);
    for (DpPaddingMode mode : {DpPaddingMode::kMaxLen, DpPaddingMode::kSumLen}) {
      for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
        std::vector<int64_t> counts(c.attn_dp);
        for (auto& n : counts) n = rng() % 4 == 0 ? 0 : static_cast<int64_t>(rng() % 30);
        const auto plan = plan_dp_gather(counts, mode, layout.attn_tp_size());
        const uint64_t seed = rng();
        // Rank r's partial global buffer: random bf16-representable values.
        auto partial = [&](int r) {
          std::mt19937 g(static_cast<uint32_t>(seed + 1000 * r));
          const auto bits = testing::random_bf16(g, static_cast<size_t>(plan.buffer_len * kHidden));
          std::vector<float> v(bits.size());
          for (size_t i = 0; i < bits.size(); ++i) v[i] = bf16_to_float(bits[i]);
          return v;
        };
        run_host_ranks(groups, [&](int rank, Group& group) {
          const int d = layout.coords(rank).attn_dp_rank;
          HostBuf global(dtype, plan.buffer_len, partial(rank), 0.f);
          HostBuf local(dtype, counts[d] + 2, {}, kPoison);
          dp_scatter(group, layout, plan, global.view(), local.view(), DpScatterKind::kReduceScatter);
          std::vector<float> sum(static_cast<size_t>(counts[d] * kHidden), 0.f);
          for (int r = 0; r < c.world; ++r) {
            const auto p = partial(r);
            for (size_t i = 0; i < sum.size(); ++i) sum[i] += p[plan.offsets[d] * kHidden + i];
          }
          for (int64_t i = 0; i < local.rows * kHidden; ++i) {
            float want = 0.f;
            if (i < counts[d] * kHidden)
              want = dtype == DType::kFloat32 ? sum[i] : bf16_to_float(float_to_bf16(sum[i]));
            ASSERT_EQ(local.at(i), want) << "rank " << rank << " element " << i;
          }
        });
      }
    }
  }
}

TEST(DpGather, RejectsBadArgumentsOnEveryRank) {
  const auto layout = ParallelLayout::pure_dp(2);
  auto groups = create_host_groups(2, {.timeout_ms = 5'000});
  const std::vector<int64_t> counts{3, 2};
  const auto plan = plan_dp_gather(counts, DpPaddingMode::kSumLen);
  std::vector<float> local(3 * kHidden), global(5 * kHidden);
  auto lv = TensorView::of(local.data(), DType::kFloat32, {3, kHidden});
  auto gv = TensorView::of(global.data(), DType::kFloat32, {5, kHidden});
  // Rank 0's arguments are rejected on rank 0 only: it raises kInvalidArgument and, having taken part with an error
  // flag, makes rank 1 (good arguments) raise kPeerFailure in the same call.
  auto rejected = [&](const std::string& needle, const std::function<void(Group&)>& bad_call) {
    testing::expect_rejected_on_rank(groups, 0, needle, [&](int rank, Group& group) {
      if (rank == 0) return bad_call(group);
      std::vector<float> l(2 * kHidden), gl(5 * kHidden);
      dp_gather(group, layout, plan, TensorView::of(l.data(), DType::kFloat32, {2, kHidden}),
                TensorView::of(gl.data(), DType::kFloat32, {5, kHidden}));
    });
  };
  rejected("at least plan.num_tokens[0] = 3 rows", [&](Group& g0) {
    dp_gather(g0, layout, plan, TensorView::of(local.data(), DType::kFloat32, {2, kHidden}), gv);
  });
  rejected("global dim 0 must be 5", [&](Group& g0) {
    dp_gather(g0, layout, plan, lv, TensorView::of(global.data(), DType::kFloat32, {4, kHidden}));
  });
  rejected("same dtype", [&](Group& g0) {
    dp_gather(g0, layout, plan, TensorView::of(local.data(), DType::kBFloat16, {3, kHidden}), gv);
  });
  rejected("local must be bf16 or fp32 or int32 or int64, got", [&](Group& g0) {
    dp_gather(g0, layout, plan, TensorView::of(local.data(), DType::kUInt8, {3, kHidden}), gv);
  });
  rejected("local must have 2 dims",
           [&](Group& g0) { dp_gather(g0, layout, plan, TensorView::of(local.data(), DType::kFloat32, {3}), gv); });
  rejected("global must be [buffer_len] or [buffer_len, hidden]", [&](Group& g0) {
    dp_gather(g0, layout, plan, lv, TensorView::of(global.data(), DType::kFloat32, {5, 2, 3}));
  });
  rejected("layout.world_size() 4 must equal group.num_ranks() 2",
           [&](Group& g0) { dp_gather(g0, ParallelLayout::pure_dp(4), plan, lv, gv); });
  DpGatherPlan edited = plan;
  edited.offsets[1] = 2;
  rejected("plan.offsets[1] must be 3 for SUM_LEN, got 2", [&](Group& g0) { dp_gather(g0, layout, edited, lv, gv); });
  DpGatherPlan longer = plan;
  longer.buffer_len = 7;
  rejected("plan.buffer_len must be 5", [&](Group& g0) {
    dp_gather(g0, layout, longer, lv, TensorView::of(global.data(), DType::kFloat32, {7, 1}));
  });
  // MAX_LEN with attention TP: a slot that the TP ranks cannot split evenly (a plan made with the default
  // attn_tp_size = 1) is refused on every backend (the cuda path splits the slot over the TP ranks).
  const auto tp = ParallelLayout::create({.world_size = 2, .attn_tp_size = 2});
  const auto plan_tp1 = plan_dp_gather(std::vector<int64_t>{3}, DpPaddingMode::kMaxLen);
  rejected("plan.slot_len = 3 must be a multiple of layout.attn_tp_size() = 2", [&](Group& g0) {
    dp_gather(g0, tp, plan_tp1, lv, TensorView::of(global.data(), DType::kFloat32, {3, kHidden}));
  });
  const auto cp = ParallelLayout::create({.world_size = 2, .attn_cp_size = 2});
  const auto plan1 = plan_dp_gather(std::vector<int64_t>{3}, DpPaddingMode::kMaxLen);
  rejected("cp_shard_counts must hold attn_cp_size = 2 counts", [&](Group& g0) {
    dp_gather(g0, cp, plan1, lv, TensorView::of(global.data(), DType::kFloat32, {3, kHidden}), nullptr,
              DpGatherSource::kLeader, std::vector<int64_t>{3});
  });

  // Ranks that disagree on the plan all fail, none hangs.
  std::atomic<int> num_failed{0};
  const auto other = plan_dp_gather(std::vector<int64_t>{3, 1}, DpPaddingMode::kSumLen);
  run_host_ranks(groups, [&](int rank, Group& group) {
    std::vector<float> l(3 * kHidden), gl(5 * kHidden);
    const auto& p = rank == 0 ? plan : other;
    try {
      dp_gather(group, layout, p, TensorView::of(l.data(), DType::kFloat32, {3, kHidden}),
                TensorView::of(gl.data(), DType::kFloat32, {p.buffer_len, kHidden}));
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("rank 1 passed a different plan than rank 0"), std::string::npos)
          << e.what();
      ++num_failed;
    }
  });
  EXPECT_EQ(num_failed.load(), 2);
}

// A rank whose dp_gather / dp_scatter arguments are rejected on that rank only still takes part in the call with an
// error flag: it raises kInvalidArgument naming the argument and the bound, every peer kPeerFailure naming it and the
// message, in the same call and long before the 60 s timeout; the next call, good on every rank, is correct
// everywhere (before, the bad rank skipped the collective and its peers paired the call with its next one).
// Routing: 4 ranks, pure DP (rank r = DP rank r, its own leader), counts [3, 0, 5, 2] (rank 1 idle). Bad ranks:
// rank 2 passes a local of 4 rows for its 5; rank 1 (idle) a bf16 local beside its fp32 global; rank 3 uint8
// local and global. Gather in both modes and reduce-scatter; after each failure a gather and a reduce-scatter,
// fp32, with fresh data, every element checked on every rank.
TEST(DpCollective, OneRankWithBadArgumentsFailsTheSameCallOnEveryRank) {
  const auto layout = ParallelLayout::pure_dp(4);
  auto groups = create_host_groups(4, {.timeout_ms = 60'000});
  const std::vector<int64_t> counts{3, 0, 5, 2};
  struct Bad {
    int rank;
    DType local_dtype;
    DType global_dtype;
    int64_t missing_rows;
    std::string needle;
  };
  const std::vector<Bad> bads = {
      {2, DType::kFloat32, DType::kFloat32, 1, "local must have at least plan.num_tokens[2] = 5 rows"},
      {1, DType::kBFloat16, DType::kFloat32, 0, "local and global must have the same dtype"},
      {3, DType::kUInt8, DType::kUInt8, 0, "global must be bf16 or fp32 or int32 or int64, got uint8"},
  };
  std::mt19937 rng(std::random_device{}());
  int num_rounds = 0;
  for (DpPaddingMode mode : {DpPaddingMode::kMaxLen, DpPaddingMode::kSumLen}) {
    const auto plan = plan_dp_gather(counts, mode);
    for (const Bad& bad : bads) {
      for (const bool gather : {true, false}) {
        const uint64_t seed = rng();
        SCOPED_TRACE(::testing::Message() << to_string(mode) << (gather ? " gather" : " reduce-scatter")
                                          << ", bad rank " << bad.rank << ", seed " << seed);
        // Rank r's partial global buffer for the reduce-scatter (bf16-representable fp32 values).
        auto partial = [&](int r) {
          std::mt19937 g(static_cast<uint32_t>(seed + 1000 * r));
          const auto bits = testing::random_bf16(g, static_cast<size_t>(plan.buffer_len * kHidden));
          std::vector<float> v(bits.size());
          for (size_t i = 0; i < bits.size(); ++i) v[i] = bf16_to_float(bits[i]);
          return v;
        };
        std::atomic<int> num_checked{0};
        run_host_ranks(groups, [&](int rank, Group& group) {
          const int64_t count = counts[rank];
          // The failing call.
          const bool is_bad = rank == bad.rank;
          const DType local_dtype = is_bad ? bad.local_dtype : DType::kFloat32;
          const DType global_dtype = is_bad ? bad.global_dtype : DType::kFloat32;
          const int64_t local_rows = count - (is_bad ? bad.missing_rows : 0);
          std::vector<uint64_t> local_mem(static_cast<size_t>(std::max<int64_t>(local_rows * kHidden, 1)), 0);
          std::vector<uint64_t> global_mem(static_cast<size_t>(std::max<int64_t>(plan.buffer_len * kHidden, 1)), 0);
          const auto local = TensorView::of(local_mem.data(), local_dtype, {local_rows, kHidden});
          const auto global = TensorView::of(global_mem.data(), global_dtype, {plan.buffer_len, kHidden});
          const auto start = std::chrono::steady_clock::now();
          try {
            if (gather) {
              dp_gather(group, layout, plan, local, global);
            } else {
              dp_scatter(group, layout, plan, global, local, DpScatterKind::kReduceScatter);
            }
            ADD_FAILURE() << "rank " << rank << ": no error";
          } catch (const Error& e) {
            const std::string what = e.what();
            EXPECT_EQ(e.code(), is_bad ? ErrorCode::kInvalidArgument : ErrorCode::kPeerFailure) << what;
            EXPECT_NE(what.find(bad.needle), std::string::npos) << what;
            if (!is_bad) {
              EXPECT_NE(what.find("failed on ranks [" + std::to_string(bad.rank) + "]"), std::string::npos) << what;
            }
          }
          EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20)) << "rank " << rank;

          // The next gather: every rank's rows at their offsets, zero elsewhere.
          const auto rows = dp_rows(seed, rank, count);
          HostBuf in(DType::kFloat32, count, rows, kPoison);
          HostBuf out(DType::kFloat32, plan.buffer_len, {}, -7.f);
          dp_gather(group, layout, plan, in.view(), out.view());
          for (int d = 0; d < 4; ++d) {
            const auto src = dp_rows(seed, d, counts[d]);
            const int64_t end = d + 1 < 4 ? plan.offsets[d + 1] : plan.buffer_len;
            for (int64_t i = plan.offsets[d] * kHidden; i < end * kHidden; ++i) {
              const int64_t j = i - plan.offsets[d] * kHidden;
              const float want = j < counts[d] * kHidden ? src[j] : 0.f;
              ASSERT_EQ(out.at(i), want) << "rank " << rank << " gathered element " << i;
            }
          }
          // The next reduce-scatter: the fp32 sum over ranks in rank order of this rank's rows.
          HostBuf part(DType::kFloat32, plan.buffer_len, partial(rank), 0.f);
          HostBuf mine(DType::kFloat32, count + 1, {}, kPoison);  // one padding row, zeroed
          dp_scatter(group, layout, plan, part.view(), mine.view(), DpScatterKind::kReduceScatter);
          std::vector<float> sum(static_cast<size_t>(count * kHidden), 0.f);
          for (int r = 0; r < 4; ++r) {
            const auto p = partial(r);
            for (size_t i = 0; i < sum.size(); ++i) sum[i] += p[plan.offsets[rank] * kHidden + i];
          }
          for (int64_t i = 0; i < mine.rows * kHidden; ++i) {
            ASSERT_EQ(mine.at(i), i < count * kHidden ? sum[i] : 0.f) << "rank " << rank << " scattered element " << i;
          }
          ++num_checked;
        });
        ASSERT_EQ(num_checked.load(), 4);
        ++num_rounds;
      }
    }
  }
  EXPECT_EQ(num_rounds, 2 * 3 * 2);
}

// kSlice has no collective: a rank whose slice is rejected raises alone, and its peers' slices and the next
// collective are unaffected. Routing as above.
TEST(DpScatter, RejectedSliceRaisesOnlyOnItsRank) {
  const auto layout = ParallelLayout::pure_dp(4);
  auto groups = create_host_groups(4, {.timeout_ms = 60'000});
  const std::vector<int64_t> counts{3, 0, 5, 2};
  const auto plan = plan_dp_gather(counts, DpPaddingMode::kSumLen);
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::atomic<int> num_checked{0};
  run_host_ranks(groups, [&](int rank, Group& group) {
    std::vector<float> all;
    for (int d = 0; d < 4; ++d) {
      const auto rows = dp_rows(seed, d, counts[d]);
      all.insert(all.end(), rows.begin(), rows.end());
    }
    HostBuf global(DType::kFloat32, plan.buffer_len, all, 0.f);
    HostBuf local(DType::kFloat32, rank == 2 ? 4 : counts[rank], {}, kPoison);
    if (rank == 2) {
      testing::expect_invalid([&] { dp_scatter(group, layout, plan, global.view(), local.view()); },
                              "local must have at least plan.num_tokens[2] = 5 rows");
    } else {
      dp_scatter(group, layout, plan, global.view(), local.view());
      const auto rows = dp_rows(seed, rank, counts[rank]);
      for (int64_t i = 0; i < counts[rank] * kHidden; ++i) ASSERT_EQ(local.at(i), rows[i]) << "rank " << rank;
    }
    // The next collective pairs up on every rank.
    HostBuf in(DType::kFloat32, counts[rank], dp_rows(seed, rank, counts[rank]), kPoison);
    HostBuf out(DType::kFloat32, plan.buffer_len, {}, -7.f);
    dp_gather(group, layout, plan, in.view(), out.view());
    for (int64_t i = 0; i < plan.buffer_len * kHidden; ++i) ASSERT_EQ(out.at(i), all[i]) << "rank " << rank;
    ++num_checked;
  });
  EXPECT_EQ(num_checked.load(), 4);
}

// Integer tensors (input ids, positions), [rows, hidden] and 1-D [rows]: values past 2^24 (int32) and 2^53
// (int64) that a float path would round, and negatives; every element of gather and slice scatter checked.
template <typename T>
void check_integer_gather(int world, int attn_dp, bool one_dim, std::mt19937& rng) {
  const auto layout = ParallelLayout::create({.world_size = world, .attn_dp_size = attn_dp});
  auto groups = create_host_groups(world, {.timeout_ms = 20'000});
  const DType dtype = sizeof(T) == 4 ? DType::kInt32 : DType::kInt64;
  const int64_t hidden = one_dim ? 1 : 5;
  T big;
  if constexpr (sizeof(T) == 4) {
    big = (1 << 24) + 1;
  } else {
    big = (int64_t{1} << 53) + 1;
  }
  auto value = [&](int d, int64_t i) { return static_cast<T>((i % 2 == 0 ? 1 : -1) * (big + 1000 * d + i)); };
  for (DpPaddingMode mode : {DpPaddingMode::kMaxLen, DpPaddingMode::kSumLen}) {
    std::vector<int64_t> counts(attn_dp);
    for (auto& n : counts) n = rng() % 3 == 0 ? 0 : static_cast<int64_t>(1 + rng() % 20);
    const auto plan = plan_dp_gather(counts, mode, layout.attn_tp_size());
    auto shape = [&](int64_t rows) {
      return one_dim ? std::vector<int64_t>{rows} : std::vector<int64_t>{rows, hidden};
    };
    std::atomic<int> checked{0};
    run_host_ranks(groups, [&](int rank, Group& group) {
      const int d = layout.coords(rank).attn_dp_rank;
      std::vector<T> local(static_cast<size_t>((counts[d] + 2) * hidden), T{77});  // 2 padding rows
      if (layout.is_dp_leader(rank)) {
        for (int64_t i = 0; i < counts[d] * hidden; ++i) local[i] = value(d, i);
      }
      std::vector<T> global(static_cast<size_t>(std::max<int64_t>(plan.buffer_len * hidden, 1)), T{-9});
      dp_gather(group, layout, plan, TensorView::of(local.data(), dtype, shape(counts[d] + 2)),
                TensorView::of(global.data(), dtype, shape(plan.buffer_len)));
      std::vector<T> want(static_cast<size_t>(plan.buffer_len * hidden), T{0});
      for (int e = 0; e < attn_dp; ++e) {
        for (int64_t i = 0; i < counts[e] * hidden; ++i) want[plan.offsets[e] * hidden + i] = value(e, i);
      }
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_EQ(global[i], want[i]) << "rank " << rank << " " << to_string(mode) << " element " << i;
      }
      std::vector<T> back(static_cast<size_t>((counts[d] + 2) * hidden), T{55});
      dp_scatter(group, layout, plan, TensorView::of(global.data(), dtype, shape(plan.buffer_len)),
                 TensorView::of(back.data(), dtype, shape(counts[d] + 2)), DpScatterKind::kSlice);
      for (int64_t i = 0; i < (counts[d] + 2) * hidden; ++i) {
        ASSERT_EQ(back[i], i < counts[d] * hidden ? value(d, i) : T{0}) << "rank " << rank << " element " << i;
      }
      ++checked;
    });
    ASSERT_EQ(checked.load(), world);
  }
}

TEST(DpGather, IntegerTensorsTwoAndOneDimensionalAreExact) {
  std::mt19937 rng(13);
  for (const Case c : {Case{4, 4}, Case{4, 2}, Case{3, 3}}) {
    for (bool one_dim : {false, true}) {
      check_integer_gather<int32_t>(c.world, c.attn_dp, one_dim, rng);
      check_integer_gather<int64_t>(c.world, c.attn_dp, one_dim, rng);
    }
  }
}

TEST(DpScatter, ReduceScatterSumsIntegersExactly) {
  // 4 ranks, attention TP 2 (DP rank 0 = ranks {0, 1}, DP rank 1 = {2, 3}); every rank's partial buffer
  // holds big + rank at every element, so a row's sum is 4 * big + 6: exact in the integer's own width
  // (fp32 would round 4 * (2^24 + 1) + 6; fp64 would round 4 * (2^53 + 1) + 6), and int32 wraps modulo 2^32
  // as NCCL's integer sum does.
  const auto layout = ParallelLayout::create({.world_size = 4, .attn_dp_size = 2});
  auto groups = create_host_groups(4, {.timeout_ms = 20'000});
  const std::vector<int64_t> counts{3, 2};
  for (DpPaddingMode mode : {DpPaddingMode::kMaxLen, DpPaddingMode::kSumLen}) {
    const auto plan = plan_dp_gather(counts, mode, layout.attn_tp_size());
    run_host_ranks(groups, [&](int rank, Group& group) {
      const int d = layout.coords(rank).attn_dp_rank;
      const int64_t n = counts[d];
      {
        const int64_t big = (int64_t{1} << 53) + 1;
        std::vector<int64_t> partial(static_cast<size_t>(plan.buffer_len), big + rank);
        std::vector<int64_t> local(static_cast<size_t>(n + 1), -1);
        dp_scatter(group, layout, plan, TensorView::of(partial.data(), DType::kInt64, {plan.buffer_len}),
                   TensorView::of(local.data(), DType::kInt64, {n + 1}), DpScatterKind::kReduceScatter);
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(local[i], 4 * big + 6) << "rank " << rank << " row " << i;
        EXPECT_EQ(local[n], 0);
      }
      {
        const int32_t big = (1 << 24) + 1;
        std::vector<int32_t> partial(static_cast<size_t>(plan.buffer_len * 2), big + rank);
        std::vector<int32_t> local(static_cast<size_t>(n * 2), -1);
        dp_scatter(group, layout, plan, TensorView::of(partial.data(), DType::kInt32, {plan.buffer_len, 2}),
                   TensorView::of(local.data(), DType::kInt32, {n, 2}), DpScatterKind::kReduceScatter);
        for (int64_t i = 0; i < n * 2; ++i) ASSERT_EQ(local[i], 4 * big + 6) << "rank " << rank << " element " << i;
      }
      {
        // INT32_MAX on rank 0, 1 on every other rank: wraps to INT32_MIN + 2.
        const int32_t v = rank == 0 ? INT32_MAX : 1;
        std::vector<int32_t> partial(static_cast<size_t>(plan.buffer_len), v);
        std::vector<int32_t> local(static_cast<size_t>(n), 0);
        dp_scatter(group, layout, plan, TensorView::of(partial.data(), DType::kInt32, {plan.buffer_len}),
                   TensorView::of(local.data(), DType::kInt32, {n}), DpScatterKind::kReduceScatter);
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(local[i], INT32_MIN + 2) << "rank " << rank << " row " << i;
      }
    });
  }
}

TEST(DpStep, SyncPlanGatherMoeReduceScatter) {
  // A whole DP-attention step on 4 ranks = 2 DP ranks x attention TP 2: agree on the counts, choose the
  // mode, gather, let every rank compute a partial MoE output (its weight (rank + 1) times the global
  // batch), reduce-scatter back. Each token must come back as x * (1 + 2 + 3 + 4). Values are small
  // integers, so fp32 sums are exact.
  const auto layout = ParallelLayout::create({.world_size = 4, .attn_dp_size = 2});
  auto groups = create_host_groups(4, {.timeout_ms = 20'000});
  std::mt19937 rng(33);
  constexpr int kSteps = 12;
  std::vector<std::vector<int64_t>> counts(kSteps, std::vector<int64_t>(2));
  std::vector<bool> extend(kSteps);
  for (int s = 0; s < kSteps; ++s) {
    for (auto& n : counts[s]) n = rng() % 3 == 0 ? 0 : static_cast<int64_t>(rng() % 50);
    extend[s] = rng() % 2;
  }
  std::atomic<int> num_modes[2] = {0, 0};
  run_host_ranks(groups, [&](int rank, Group& group) {
    BatchMetadataSync sync(group, layout);
    const int d = layout.coords(rank).attn_dp_rank;
    for (int s = 0; s < kSteps; ++s) {
      std::optional<BatchMetadata> mine;
      if (counts[s][d] > 0) {
        mine = BatchMetadata{};
        mine->num_tokens = counts[s][d];
        mine->forward_mode = extend[s] ? ForwardMode::kExtend : ForwardMode::kDecode;
        mine->is_extend_in_batch = extend[s];
      }
      const BatchSyncResult r = sync.sync(mine);
      ASSERT_EQ(r.global.num_tokens, counts[s]);
      if (!r.runs_batch) continue;  // nobody has tokens: no gather this step
      const DpPaddingMode mode =
          choose_padding_mode(r.global.num_tokens, {.is_extend_in_batch = r.global.is_extend_in_batch});
      if (rank == 0) ++num_modes[static_cast<int>(mode)];
      const DpGatherPlan plan = plan_dp_gather(r.global.num_tokens, mode, layout.attn_tp_size());
      std::vector<float> x(static_cast<size_t>(counts[s][d] * kHidden));
      for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 7 + s * 3 + d * 11) % 17) - 8.f;
      std::vector<float> global(static_cast<size_t>(plan.buffer_len * kHidden), -1.f);
      const auto gv = TensorView::of(global.data(), DType::kFloat32, {plan.buffer_len, kHidden});
      dp_gather(group, layout, plan, TensorView::of(x.data(), DType::kFloat32, {counts[s][d], kHidden}), gv);
      for (float& v : global) v *= static_cast<float>(rank + 1);
      std::vector<float> out(x.size(), 99.f);
      dp_scatter(group, layout, plan, gv, TensorView::of(out.data(), DType::kFloat32, {counts[s][d], kHidden}),
                 DpScatterKind::kReduceScatter);
      for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(out[i], 10.f * x[i]) << "rank " << rank << " step " << s;
    }
  });
  EXPECT_GT(num_modes[0].load(), 0);  // MAX_LEN steps
  EXPECT_GT(num_modes[1].load(), 0);  // SUM_LEN steps
}

// ---- batch-metadata sync -----------------------------------------------------------------------------

BatchMetadata random_record(std::mt19937& rng) {
  static const ForwardMode kModes[] = {ForwardMode::kExtend,       ForwardMode::kDecode,      ForwardMode::kMixed,
                                       ForwardMode::kTargetVerify, ForwardMode::kDraftExtend, ForwardMode::kPrebuilt};
  BatchMetadata m;
  m.forward_mode = rng() % 4 == 0 ? kModes[rng() % 6] : (rng() % 2 ? ForwardMode::kDecode : ForwardMode::kIdle);
  const bool no_tokens = m.forward_mode == ForwardMode::kIdle || m.forward_mode == ForwardMode::kPrebuilt;
  m.num_tokens = no_tokens ? 0 : static_cast<int64_t>(rng() % 500);
  m.num_tokens_for_logprob = static_cast<int64_t>(rng() % (m.num_tokens + 1));
  m.can_run_decode_graph = rng() % 5 != 0;
  m.is_extend_in_batch = m.forward_mode == ForwardMode::kExtend;
  m.can_run_tbo = rng() % 6 != 0;
  m.can_run_prefill_graph = rng() % 5 != 0;
  m.prefill_graph_max_prefix_len = static_cast<int64_t>(rng() % 10000);
  m.can_run_draft_graph = rng() % 5 != 0;
  m.is_health_check = rng() % 10 == 0;
  m.attention_pairs = static_cast<int64_t>(rng() % 100000);
  return m;
}

// The reductions written out independently of the library's loop.
void expect_reduced(const std::vector<BatchMetadata>& recs, const GlobalBatchInfo& g) {
  std::vector<int64_t> tokens, logprob, pairs;
  std::vector<ForwardMode> busy;
  for (const auto& m : recs) {
    tokens.push_back(m.num_tokens);
    logprob.push_back(m.num_tokens_for_logprob);
    pairs.push_back(m.attention_pairs);
    if (m.forward_mode != ForwardMode::kIdle) busy.push_back(m.forward_mode);
  }
  auto all = [&](auto field) { return std::all_of(recs.begin(), recs.end(), field); };
  auto any = [&](auto field) { return std::any_of(recs.begin(), recs.end(), field); };
  EXPECT_EQ(g.num_tokens, tokens);
  EXPECT_EQ(g.num_tokens_for_logprob, logprob);
  EXPECT_EQ(g.attention_pairs, pairs);
  EXPECT_EQ(g.can_run_decode_graph, all([](const BatchMetadata& m) { return m.can_run_decode_graph; }));
  EXPECT_EQ(g.can_run_prefill_graph, all([](const BatchMetadata& m) { return m.can_run_prefill_graph; }));
  EXPECT_EQ(g.can_run_draft_graph, all([](const BatchMetadata& m) { return m.can_run_draft_graph; }));
  EXPECT_EQ(g.is_extend_in_batch, any([](const BatchMetadata& m) { return m.is_extend_in_batch; }));
  EXPECT_EQ(g.is_health_check, any([](const BatchMetadata& m) { return m.is_health_check; }));
  EXPECT_EQ(g.any_tokens, any([](const BatchMetadata& m) { return m.num_tokens > 0; }));
  int64_t max_prefix = 0;
  for (const auto& m : recs) max_prefix = std::max(max_prefix, m.prefill_graph_max_prefix_len);
  EXPECT_EQ(g.prefill_graph_max_prefix_len, max_prefix);
  const bool agree = !busy.empty() && std::count(busy.begin(), busy.end(), busy[0]) == std::ssize(busy);
  if (busy.empty()) {
    EXPECT_EQ(g.forward_mode, ForwardMode::kIdle);
  } else if (agree) {
    EXPECT_EQ(g.forward_mode, busy[0]);
  } else {
    EXPECT_FALSE(g.forward_mode.has_value());
  }
  EXPECT_EQ(g.can_run_tbo, agree && all([](const BatchMetadata& m) { return m.can_run_tbo; }));
}

TEST(BatchMetadata, HandWorkedReduction) {
  BatchMetadata a;
  a.forward_mode = ForwardMode::kDecode;
  a.num_tokens = 10;
  a.num_tokens_for_logprob = 4;
  a.attention_pairs = 640;
  a.prefill_graph_max_prefix_len = 100;
  BatchMetadata c = a;
  c.num_tokens = 7;
  c.can_run_decode_graph = false;  // one veto
  c.prefill_graph_max_prefix_len = 300;
  const std::vector<BatchMetadata> recs{a, BatchMetadata::idle(), c};
  const GlobalBatchInfo g = reduce_batch_metadata(recs);
  EXPECT_EQ(g.num_tokens, (std::vector<int64_t>{10, 0, 7}));
  EXPECT_EQ(g.num_tokens_for_logprob, (std::vector<int64_t>{4, 0, 4}));
  EXPECT_EQ(g.attention_pairs, (std::vector<int64_t>{640, 0, 640}));
  EXPECT_FALSE(g.can_run_decode_graph);
  EXPECT_FALSE(g.can_run_prefill_graph);  // the idle rank's fallback record vetoes the prefill graph
  EXPECT_EQ(g.prefill_graph_max_prefix_len, 300);
  EXPECT_EQ(g.forward_mode, ForwardMode::kDecode);  // the idle rank does not count
  EXPECT_TRUE(g.can_run_tbo);
  EXPECT_TRUE(g.any_tokens);

  BatchMetadata e = a;
  e.forward_mode = ForwardMode::kExtend;
  e.is_extend_in_batch = true;
  const GlobalBatchInfo mixed = reduce_batch_metadata(std::vector<BatchMetadata>{a, e});
  EXPECT_FALSE(mixed.forward_mode.has_value());  // disagreement: no global mode, no TBO
  EXPECT_FALSE(mixed.can_run_tbo);
  EXPECT_TRUE(mixed.is_extend_in_batch);

  const GlobalBatchInfo idle = reduce_batch_metadata(std::vector<BatchMetadata>{BatchMetadata::idle(), {}});
  EXPECT_EQ(idle.forward_mode, ForwardMode::kIdle);
  EXPECT_FALSE(idle.can_run_tbo);
  EXPECT_FALSE(idle.any_tokens);
  EXPECT_TRUE(idle.can_run_decode_graph);  // the fallback record votes 1 for the decode graph
  EXPECT_FALSE(idle.can_run_prefill_graph);
}

// SGLang's fallback record (scheduler_dp_attn_mixin.py, MLPSyncBatchInfo._get_fallback_tensor): 0 tokens,
// decode-graph vote 1, is_extend 0, TBO vote 1, IDLE, prefill-graph vote 0. One idle DP rank therefore
// turns the prefill graph off for the step; the decode and draft graphs stay on.
TEST(BatchMetadata, IdleFallbackRecordVetoesOnlyThePrefillGraph) {
  const BatchMetadata idle = BatchMetadata::idle();
  EXPECT_EQ(idle.num_tokens, 0);
  EXPECT_EQ(idle.num_tokens_for_logprob, 0);
  EXPECT_TRUE(idle.can_run_decode_graph);
  EXPECT_FALSE(idle.is_extend_in_batch);
  EXPECT_TRUE(idle.can_run_tbo);
  EXPECT_EQ(idle.forward_mode, ForwardMode::kIdle);
  EXPECT_FALSE(idle.can_run_prefill_graph);
  EXPECT_EQ(idle.prefill_graph_max_prefix_len, 0);
  EXPECT_TRUE(idle.can_run_draft_graph);
  EXPECT_FALSE(idle.is_health_check);
  EXPECT_EQ(idle.attention_pairs, 0);

  BatchMetadata extend;
  extend.forward_mode = ForwardMode::kExtend;
  extend.num_tokens = 64;
  extend.is_extend_in_batch = true;
  extend.can_run_prefill_graph = true;
  const GlobalBatchInfo both = reduce_batch_metadata(std::vector<BatchMetadata>{extend, extend});
  EXPECT_TRUE(both.can_run_prefill_graph);
  const GlobalBatchInfo with_idle = reduce_batch_metadata(std::vector<BatchMetadata>{extend, idle});
  EXPECT_FALSE(with_idle.can_run_prefill_graph);
  EXPECT_TRUE(with_idle.can_run_decode_graph);
  EXPECT_TRUE(with_idle.can_run_draft_graph);

  // The same through the sync: rank 1 passes nullopt, so the fallback record is sent.
  const auto layout = ParallelLayout::pure_dp(2);
  auto groups = create_host_groups(2, {.timeout_ms = 20'000});
  std::vector<GlobalBatchInfo> seen(2);
  run_host_ranks(groups, [&](int rank, Group& group) {
    BatchMetadataSync sync(group, layout);
    seen[rank] = sync.sync(rank == 0 ? std::optional<BatchMetadata>(extend) : std::nullopt).global;
  });
  for (const auto& g : seen) {
    EXPECT_FALSE(g.can_run_prefill_graph);
    EXPECT_TRUE(g.can_run_decode_graph);
    EXPECT_EQ(g.forward_mode, ForwardMode::kExtend);
  }
}

// PREBUILT (disaggregated decode, KV cache from the prefill side), as SGLang's prepare_mlp_sync_batch_raw
// treats it: 0 tokens, decode-graph vote 1, not extend; its own mode in the agreement (only IDLE is left
// out), so PREBUILT beside DECODE disagrees and TBO is off; and the rank runs an inner idle batch when some
// rank has tokens.
TEST(BatchMetadata, PrebuiltRecordAgreementAndIdleBatch) {
  const BatchMetadata p = BatchMetadata::prebuilt();
  EXPECT_EQ(p.forward_mode, ForwardMode::kPrebuilt);
  EXPECT_EQ(p.num_tokens, 0);
  EXPECT_EQ(p.num_tokens_for_logprob, 0);
  EXPECT_TRUE(p.can_run_decode_graph);
  EXPECT_FALSE(p.is_extend_in_batch);
  EXPECT_TRUE(p.can_run_tbo);

  BatchMetadata decode;
  decode.forward_mode = ForwardMode::kDecode;
  decode.num_tokens = 32;
  const GlobalBatchInfo mixed = reduce_batch_metadata(std::vector<BatchMetadata>{decode, p});
  EXPECT_FALSE(mixed.forward_mode.has_value());
  EXPECT_FALSE(mixed.can_run_tbo);
  EXPECT_TRUE(mixed.any_tokens);
  EXPECT_FALSE(mixed.is_extend_in_batch);
  const GlobalBatchInfo all = reduce_batch_metadata(std::vector<BatchMetadata>{p, BatchMetadata::idle(), p});
  EXPECT_EQ(all.forward_mode, ForwardMode::kPrebuilt);
  EXPECT_TRUE(all.can_run_tbo);
  EXPECT_FALSE(all.any_tokens);

  BatchMetadata bad = p;
  bad.num_tokens = 5;
  EXPECT_THROW(reduce_batch_metadata(std::vector<BatchMetadata>{bad}), Error);
  bad = p;
  bad.num_tokens_for_logprob = 1;
  EXPECT_THROW(reduce_batch_metadata(std::vector<BatchMetadata>{bad}), Error);

  // Over the wire (value 6): rank 0 decodes, rank 1 is PREBUILT and runs an idle batch.
  const auto layout = ParallelLayout::pure_dp(2);
  auto groups = create_host_groups(2, {.timeout_ms = 20'000});
  std::vector<BatchSyncResult> res(2);
  run_host_ranks(groups, [&](int rank, Group& group) {
    BatchMetadataSync sync(group, layout);
    res[rank] = sync.sync(rank == 0 ? decode : p);
  });
  for (const auto& r : res) {
    EXPECT_FALSE(r.global.forward_mode.has_value());
    EXPECT_FALSE(r.global.can_run_tbo);
    EXPECT_EQ(r.global.num_tokens, (std::vector<int64_t>{32, 0}));
  }
  EXPECT_FALSE(res[0].run_idle_batch);
  EXPECT_TRUE(res[1].run_idle_batch);
  EXPECT_TRUE(res[1].runs_batch);
}

TEST(BatchMetadata, RandomReductions) {
  std::mt19937 rng(3);
  for (int iter = 0; iter < 500; ++iter) {
    std::vector<BatchMetadata> recs(1 + rng() % 8);
    for (auto& r : recs) r = random_record(rng);
    expect_reduced(recs, reduce_batch_metadata(recs));
  }
}

TEST(BatchMetadata, SyncAgreesOnEveryRankAndRunsIdleBatches) {
  std::mt19937 rng(21);
  for (const Case c : {Case{4, 4}, Case{6, 3}, Case{8, 2}}) {
    const auto layout = ParallelLayout::create({.world_size = c.world, .attn_dp_size = c.attn_dp});
    auto groups = create_host_groups(c.world, {.timeout_ms = 20'000});
    constexpr int kSteps = 25;
    // Per step and DP rank: a record or none (no batch). Non-leaders pass a different record that must
    // be ignored.
    std::vector<std::vector<std::optional<BatchMetadata>>> plan(kSteps);
    for (auto& step : plan) {
      step.resize(c.attn_dp);
      const bool all_idle = rng() % 5 == 0;
      for (auto& r : step) {
        if (!all_idle && rng() % 3 != 0) r = random_record(rng);
      }
    }
    run_host_ranks(groups, [&](int rank, Group& group) {
      BatchMetadataSync sync(group, layout);
      const int d = layout.coords(rank).attn_dp_rank;
      std::mt19937 local_rng(static_cast<uint32_t>(rank));
      for (int s = 0; s < kSteps; ++s) {
        std::optional<BatchMetadata> mine = plan[s][d];
        if (!layout.is_dp_leader(rank) && mine) mine = random_record(local_rng);
        const BatchSyncResult res = sync.sync(mine);
        std::vector<BatchMetadata> recs;
        for (const auto& r : plan[s]) recs.push_back(r.value_or(BatchMetadata::idle()));
        expect_reduced(recs, res.global);
        const bool has_batch =
            mine && mine->forward_mode != ForwardMode::kIdle && mine->forward_mode != ForwardMode::kPrebuilt;
        EXPECT_EQ(res.run_idle_batch, !has_batch && res.global.any_tokens) << "rank " << rank << " step " << s;
        EXPECT_EQ(res.runs_batch, has_batch || res.global.any_tokens);
        EXPECT_GE(res.step_wait_s, 0.0);
      }
    });
  }
}

TEST(BatchMetadata, OneDpRankSkipsTheExchange) {
  // attn_dp 1 over 2 ranks: rank 1 never calls; rank 0 would time out (200 ms) if it communicated.
  const auto layout = ParallelLayout::create({.world_size = 2, .attn_dp_size = 1});
  auto groups = create_host_groups(2, {.timeout_ms = 200});
  BatchMetadataSync sync(*groups[0], layout);
  BatchMetadata m;
  m.forward_mode = ForwardMode::kExtend;
  m.num_tokens = 99;
  m.is_extend_in_batch = true;
  const auto res = sync.sync(m);
  EXPECT_EQ(res.global.num_tokens, std::vector<int64_t>{99});
  EXPECT_EQ(res.global.forward_mode, ForwardMode::kExtend);
  EXPECT_TRUE(res.runs_batch);
  EXPECT_FALSE(res.run_idle_batch);
  EXPECT_EQ(res.step_wait_s, 0.0);
  const auto idle = sync.sync(std::nullopt);
  EXPECT_FALSE(idle.runs_batch);
  EXPECT_FALSE(idle.global.any_tokens);
}

TEST(BatchMetadata, WaitingTimeIsCarriedUntilABatchRuns) {
  const auto layout = ParallelLayout::pure_dp(2);
  auto groups = create_host_groups(2, {.timeout_ms = 20'000});
  using namespace std::chrono_literals;
  std::vector<BatchSyncResult> r0(3);
  double carried_after_step0 = 0.0;
  run_host_ranks(groups, [&](int rank, Group& group) {
    BatchMetadataSync sync(group, layout);
    BatchMetadata busy;
    busy.forward_mode = ForwardMode::kDecode;
    busy.num_tokens = 8;
    // Step 0: nobody has a batch; rank 1 arrives 80 ms late.
    if (rank == 1) std::this_thread::sleep_for(80ms);
    auto a = sync.sync(std::nullopt);
    if (rank == 0) {
      r0[0] = a;
      carried_after_step0 = sync.carried_wait_s();
    }
    // Step 1: rank 0 has a batch; rank 1 arrives 50 ms late and runs an idle batch.
    if (rank == 1) std::this_thread::sleep_for(50ms);
    auto b = sync.sync(rank == 0 ? std::optional<BatchMetadata>(busy) : std::nullopt);
    if (rank == 0) r0[1] = b;
    if (rank == 1) {
      EXPECT_TRUE(b.run_idle_batch);
      EXPECT_TRUE(b.runs_batch);
    }
    // Step 2: both busy, no delay.
    auto c = sync.sync(busy);
    if (rank == 0) {
      r0[2] = c;
      EXPECT_EQ(sync.carried_wait_s(), 0.0);
    }
  });
  EXPECT_FALSE(r0[0].runs_batch);
  EXPECT_GE(r0[0].step_wait_s, 0.070);
  EXPECT_EQ(r0[0].wait_s, 0.0);  // carried, not attributed
  EXPECT_DOUBLE_EQ(carried_after_step0, r0[0].step_wait_s);
  EXPECT_TRUE(r0[1].runs_batch);
  EXPECT_GE(r0[1].step_wait_s, 0.040);
  EXPECT_DOUBLE_EQ(r0[1].wait_s, r0[0].step_wait_s + r0[1].step_wait_s);  // >= 110 ms
  EXPECT_LT(r0[2].wait_s, 0.040);
}

// Inactive (dead or absent) ranks, as SGLang's MLPSyncBatchInfo.all_gather with its active-ranks mask: the
// DP ranks whose leader is inactive count as the fallback record, nobody waits for them, the step does not
// fail. 6 ranks = 3 DP ranks x attention TP 2 (DP rank d = ranks {2d, 2d + 1}, leader 2d). Rank 2 (leader of
// DP rank 1) and rank 5 (a non-leader of DP rank 2) never call; the group's timeout is 60 s, so a wait for
// them would show as a slow test, and the test asserts each step takes under 5 s.
TEST(BatchMetadata, InactiveRanksCountAsTheFallbackRecord) {
  const auto layout = ParallelLayout::create({.world_size = 6, .attn_dp_size = 3});
  auto groups = create_host_groups(6, {.timeout_ms = 60'000});
  const std::vector<int> inactive{2, 5};
  BatchMetadata extend;
  extend.forward_mode = ForwardMode::kExtend;
  extend.num_tokens = 40;
  extend.num_tokens_for_logprob = 3;
  extend.is_extend_in_batch = true;
  extend.can_run_decode_graph = false;
  extend.attention_pairs = 9;
  BatchMetadata dp2 = extend;
  dp2.num_tokens = 7;
  std::atomic<int> num_checked{0};
  run_host_ranks(groups, [&](int rank, Group& group) {
    if (rank == 2 || rank == 5) return;  // dead
    BatchMetadataSync sync(group, layout);
    const int d = layout.coords(rank).attn_dp_rank;
    for (int step = 0; step < 3; ++step) {
      const auto start = std::chrono::steady_clock::now();
      std::optional<BatchMetadata> mine;
      if (d == 0) mine = extend;
      if (d == 1) mine = extend;  // rank 3, not the leader: ignored as ever
      if (d == 2) mine = dp2;
      const BatchSyncResult res = sync.sync(mine, inactive);
      EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
      // DP rank 1 is the fallback record: 0 tokens, IDLE (left out of the mode agreement), prefill-graph veto.
      EXPECT_EQ(res.global.num_tokens, (std::vector<int64_t>{40, 0, 7})) << "rank " << rank;
      EXPECT_EQ(res.global.num_tokens_for_logprob, (std::vector<int64_t>{3, 0, 3}));
      EXPECT_EQ(res.global.attention_pairs, (std::vector<int64_t>{9, 0, 9}));
      EXPECT_EQ(res.global.forward_mode, ForwardMode::kExtend);
      EXPECT_FALSE(res.global.can_run_prefill_graph);
      EXPECT_FALSE(res.global.can_run_decode_graph);
      EXPECT_TRUE(res.global.is_extend_in_batch);
      EXPECT_TRUE(res.global.can_run_tbo);
      EXPECT_TRUE(res.global.any_tokens);
      EXPECT_EQ(res.run_idle_batch, !mine.has_value());
      EXPECT_TRUE(res.runs_batch);
      // The same step without the list would wait for ranks 2 and 5; reduce_batch_metadata over the records
      // with DP rank 1 as idle() is the reference.
      expect_reduced({extend, BatchMetadata::idle(), dp2}, res.global);
    }
    ++num_checked;
  });
  EXPECT_EQ(num_checked.load(), 4);
}

TEST(BatchMetadata, InactiveRanksAreCheckedAndMustAgree) {
  const auto layout = ParallelLayout::pure_dp(4);
  auto groups = create_host_groups(4, {.timeout_ms = 60'000});
  BatchMetadataSync sync0(*groups[0], layout);
  auto expect_arg = [](const std::function<void()>& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error, expected " << needle;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  // Checked on the calling rank before any communication.
  expect_arg([&] { sync0.sync(std::nullopt, std::vector<int>{4}); }, "inactive rank 4 is not in [0, 4)");
  expect_arg([&] { sync0.sync(std::nullopt, std::vector<int>{-1}); }, "inactive rank -1 is not in [0, 4)");
  expect_arg([&] { sync0.sync(std::nullopt, std::vector<int>{1, 0}); }, "rank 0 names itself inactive");
  // Rank 3 is dead; rank 2 also leaves out rank 1 (which is alive and calls): every rank that compares the
  // lists raises kInvalidArgument, none waits for the timeout.
  std::atomic<int> num_failed{0};
  const auto start = std::chrono::steady_clock::now();
  run_host_ranks(groups, [&](int rank, Group& group) {
    if (rank == 3) return;
    BatchMetadataSync sync(group, layout);
    const std::vector<int> list = rank == 2 ? std::vector<int>{1, 3} : std::vector<int>{3};
    try {
      sync.sync(std::nullopt, list);
      ADD_FAILURE() << "rank " << rank << " did not see the mismatch";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find("named other inactive ranks"), std::string::npos) << e.what();
      ++num_failed;
    }
  });
  EXPECT_EQ(num_failed.load(), 3);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
}

// A rank that cannot make a step's sync (the Python binding could not convert its arguments) calls fail() instead:
// its peers raise kPeerFailure naming it at once instead of waiting for the 60 s timeout, and the next step's sync
// works on every rank (the collective numbers stayed in step). 4 ranks, pure DP. Second round: rank 3 is dead and
// left out; rank 1 fails with the list, so it does not wait for rank 3 either.
TEST(BatchMetadata, FailKeepsTheGroupInStepAndPeersRaiseAtOnce) {
  const auto layout = ParallelLayout::pure_dp(4);
  auto groups = create_host_groups(4, {.timeout_ms = 60'000});
  BatchMetadata decode;
  decode.forward_mode = ForwardMode::kDecode;
  decode.num_tokens = 3;
  std::atomic<int> num_peer_failures{0};
  const auto start = std::chrono::steady_clock::now();
  run_host_ranks(groups, [&](int rank, Group& group) {
    BatchMetadataSync sync(group, layout);
    if (rank == 1) {
      sync.fail("local: expected a BatchMetadata or None, got str");
    } else {
      try {
        sync.sync(decode);
        ADD_FAILURE() << "rank " << rank << " did not see rank 1 fail";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kPeerFailure) << e.what();
        EXPECT_NE(std::string(e.what()).find("expected a BatchMetadata or None, got str"), std::string::npos)
            << e.what();
        ++num_peer_failures;
      }
    }
    const BatchSyncResult next = sync.sync(decode);
    EXPECT_EQ(next.global.num_tokens, (std::vector<int64_t>{3, 3, 3, 3}));
  });
  EXPECT_EQ(num_peer_failures.load(), 3);

  const std::vector<int> dead{3};
  num_peer_failures = 0;
  run_host_ranks(groups, [&](int rank, Group& group) {
    if (rank == 3) return;
    BatchMetadataSync sync(group, layout);
    if (rank == 1) {
      sync.fail("inactive_ranks: expected a sequence of ints", dead);
    } else {
      try {
        sync.sync(decode, dead);
        ADD_FAILURE() << "rank " << rank << " did not see rank 1 fail";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kPeerFailure) << e.what();
        ++num_peer_failures;
      }
    }
    EXPECT_EQ(sync.sync(decode, dead).global.num_tokens, (std::vector<int64_t>{3, 3, 3, 0}));
  });
  EXPECT_EQ(num_peer_failures.load(), 2);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 30.0);
}

TEST(BatchMetadata, RejectsBadRecords) {
  const auto layout = ParallelLayout::pure_dp(2);
  auto groups = create_host_groups(2, {.timeout_ms = 200});
  BatchMetadataSync sync(*groups[0], layout);
  BatchMetadata m;
  m.num_tokens = 5;  // IDLE with tokens
  try {
    sync.sync(m);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("an IDLE record must have num_tokens 0, got 5"), std::string::npos);
  }
  m.forward_mode = ForwardMode::kDecode;
  m.num_tokens = -1;
  EXPECT_THROW(sync.sync(m), Error);
  m.num_tokens = 1;
  m.attention_pairs = -3;
  EXPECT_THROW(reduce_batch_metadata(std::vector<BatchMetadata>{m}), Error);
  EXPECT_THROW(reduce_batch_metadata(std::vector<BatchMetadata>{}), Error);
  EXPECT_THROW(BatchMetadataSync(*groups[0], ParallelLayout::pure_dp(3)), Error);
  // A peer that never arrives: a timeout error, not a hang.
  m.attention_pairs = 0;
  try {
    sync.sync(m);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
  }
}

}  // namespace
}  // namespace epx
