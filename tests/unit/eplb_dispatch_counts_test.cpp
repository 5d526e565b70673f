// EPLB counts from the dispatch (issue 16): one rank's counts of a pass from normal-dispatch receive counts
// (exact, or rounded up to expert_alignment in stat_approx mode as SGLang's), low-latency cumulative counters
// (increase since the last read, across an int32 wrap) and top-k choices, summed over the EP group by
// all_reduce_counts on host groups (ranks as threads), and a rebalance manager per rank fed with them.
//
// Routing of the multi-rank tests: 4 ranks, 2 layers, 16 physical slots (4 per rank), every rank routes its
// own random tokens (top-4, some -1) to any slot; a rank "receives" the (token, slot) pairs whose slot is
// one of its own, as a dispatch would report them.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <random>

#include "epx/eplb/dispatch_counts.h"
#include "epx/eplb/expert_location.h"
#include "epx/eplb/manager.h"
#include "epx/error.h"
#include "epx/group.h"
#include "test_util.h"

namespace epx::eplb {
namespace {

constexpr int kRanks = 4, kLayers = 2, kSlots = 16, kSlotsPerRank = kSlots / kRanks, kTopk = 4;

using epx::testing::expect_invalid;

// topk[rank][layer]: [tokens * kTopk] physical slots, -1 for none.
using Routing = std::vector<std::vector<std::vector<int64_t>>>;
Routing random_routing(uint64_t seed) {
  std::mt19937_64 rng(seed);
  Routing out(kRanks, std::vector<std::vector<int64_t>>(kLayers));
  for (auto& rank : out) {
    for (auto& layer : rank) {
      const int tokens = static_cast<int>(rng() % 40);
      for (int i = 0; i < tokens * kTopk; ++i) {
        layer.push_back(rng() % 8 == 0 ? -1 : static_cast<int64_t>(rng() % kSlots));
      }
    }
  }
  return out;
}

// The global counts: every (token, slot) pair of every rank. [kLayers * kSlots]
std::vector<int64_t> global_counts(const Routing& routing) {
  std::vector<int64_t> out(kLayers * kSlots, 0);
  for (const auto& rank : routing) {
    for (int l = 0; l < kLayers; ++l) {
      for (int64_t s : rank[l]) {
        if (s >= 0) ++out[l * kSlots + s];
      }
    }
  }
  return out;
}

// What rank `dst` receives per local slot in `layer`: int32 [kSlotsPerRank].
std::vector<int32_t> received(const Routing& routing, int dst, int layer) {
  std::vector<int32_t> out(kSlotsPerRank, 0);
  for (const auto& rank : routing) {
    for (int64_t s : rank[layer]) {
      if (s >= 0 && s / kSlotsPerRank == dst) ++out[s % kSlotsPerRank];
    }
  }
  return out;
}

std::vector<int32_t> align_up(std::vector<int32_t> counts, int alignment) {
  for (int32_t& c : counts) c = (c + alignment - 1) / alignment * alignment;
  return counts;
}

TEST(EplbDispatchCounts, EverySourceSumsToTheGlobalCountsOverHostRanks) {
  const Routing routing = random_routing(16);
  const std::vector<int64_t> expected = global_counts(routing);
  std::vector<int64_t> expected_approx(kLayers * kSlots);
  for (int r = 0; r < kRanks; ++r) {
    for (int l = 0; l < kLayers; ++l) {
      const auto aligned = align_up(received(routing, r, l), 128);
      for (int i = 0; i < kSlotsPerRank; ++i) expected_approx[l * kSlots + r * kSlotsPerRank + i] = aligned[i];
    }
  }
  auto groups = create_host_groups(kRanks, {.timeout_ms = 20'000});
  std::mutex mu;
  // Per source (top-k, normal, low-latency pass 1 and 2, stat_approx): every rank's reduced counts.
  std::vector<std::vector<int64_t>> results[5];
  run_host_ranks(groups, [&](int rank, Group& group) {
    std::vector<std::vector<int64_t>> got;
    // 1. top-k choices (SGLang's select-experts gatherer): this rank's pairs, any slot.
    DispatchCounts sent(kLayers, kSlots, kRanks, rank, RecordMode::kStat);
    for (int l = 0; l < kLayers; ++l) sent.add_topk(l, routing[rank][l]);
    got.push_back(sent.take());
    // 2. normal-dispatch receive counts, exact (expert_alignment 1).
    DispatchCounts normal(kLayers, kSlots, kRanks, rank, RecordMode::kStat);
    for (int l = 0; l < kLayers; ++l) normal.add_normal_dispatch(l, received(routing, rank, l), 1);
    got.push_back(normal.take());
    // 3. low-latency cumulative counters: two dispatches of the same routing, read after each.
    DispatchCounts ll(kLayers, kSlots, kRanks, rank, RecordMode::kStat);
    std::vector<std::vector<int32_t>> cumulative(kLayers, std::vector<int32_t>(kSlotsPerRank, 0));
    for (int call = 0; call < 2; ++call) {
      for (int l = 0; l < kLayers; ++l) {
        const auto r = received(routing, rank, l);
        for (int i = 0; i < kSlotsPerRank; ++i) cumulative[l][i] += r[i];
        ll.add_low_latency_cumulative(l, cumulative[l]);
      }
      got.push_back(ll.take());
    }
    // 4. stat_approx: receive counts rounded up to 128 (DeepGEMM's alignment), as SGLang records them.
    DispatchCounts approx(kLayers, kSlots, kRanks, rank, RecordMode::kStatApprox);
    for (int l = 0; l < kLayers; ++l) approx.add_normal_dispatch(l, align_up(received(routing, rank, l), 128), 128);
    got.push_back(approx.take());
    for (auto& counts : got) all_reduce_counts(group, counts);
    std::lock_guard<std::mutex> lock(mu);
    ASSERT_EQ(got.size(), 5u);
    for (size_t k = 0; k < got.size(); ++k) results[k].push_back(got[k]);
  });
  for (int source = 0; source < 4; ++source) {  // each low-latency pass saw one dispatch
    ASSERT_EQ(results[source].size(), static_cast<size_t>(kRanks));
    for (const auto& counts : results[source]) EXPECT_EQ(counts, expected) << "source " << source;
  }
  for (const auto& counts : results[4]) EXPECT_EQ(counts, expected_approx);
}

TEST(EplbDispatchCounts, ChecksModesSourcesAndWraps) {
  DispatchCounts stat(kLayers, kSlots, kRanks, 1, RecordMode::kStat);
  const std::vector<int32_t> four{1, 2, 3, 4};
  expect_invalid([&] { stat.add_normal_dispatch(0, four, 128); },
                 "rounded up to expert_alignment 128 are approximate: only stat_approx mode takes them");
  expect_invalid(
      [&] {
        stat.add_normal_dispatch(0, std::vector<int32_t>{1, 2}, 1);
      },
      "must have num_physical / num_gpus = 4 entries, got 2");
  expect_invalid([&] { stat.add_normal_dispatch(2, four, 1); }, "layer must be in [0, 2), got 2");
  expect_invalid(
      [&] {
        stat.add_normal_dispatch(0, std::vector<int32_t>{0, -1, 0, 0}, 1);
      },
      "num_recv_tokens_per_expert[1] must be >= 0, got -1");
  stat.add_normal_dispatch(0, four, 1);
  expect_invalid([&] { stat.add_topk(1, std::vector<int64_t>{3}); }, "would count each pair twice");
  auto counts = stat.take();  // rank 1's slots are 4..7
  EXPECT_EQ(std::vector<int64_t>(counts.begin() + 4, counts.begin() + 8), (std::vector<int64_t>{1, 2, 3, 4}));
  EXPECT_EQ(std::count(counts.begin(), counts.end(), 0), kLayers * kSlots - 4);
  stat.add_topk(1, std::vector<int64_t>{3, -1, 3, 15});  // a new pass may use the other source
  counts = stat.take();
  EXPECT_EQ(counts[kSlots + 3], 2);
  EXPECT_EQ(counts[kSlots + 15], 1);
  expect_invalid([&] { stat.add_topk(0, std::vector<int64_t>{16}); }, "topk_physical[0] must be in [-1, 16), got 16");

  // Low-latency counters: the increase modulo 2^32, so an int32 wrap still counts right.
  DispatchCounts ll(1, 4, 1, 0, RecordMode::kStat);
  const int32_t near_max = std::numeric_limits<int32_t>::max() - 4;
  ll.add_low_latency_cumulative(0, std::vector<int32_t>{near_max, 0, 7, 0});
  EXPECT_EQ(ll.take(), (std::vector<int64_t>{near_max, 0, 7, 0}));  // the first read counts from 0
  ll.add_low_latency_cumulative(0, std::vector<int32_t>{std::numeric_limits<int32_t>::min() + 4, 1, 7, 0});
  EXPECT_EQ(ll.take(), (std::vector<int64_t>{9, 1, 0, 0}));
  ll.reset_low_latency_baseline(0);  // the caller zeroed its counters
  ll.add_low_latency_cumulative(0, std::vector<int32_t>{2, 0, 0, 5});
  EXPECT_EQ(ll.take(), (std::vector<int64_t>{2, 0, 0, 5}));

  expect_invalid([] { DispatchCounts(1, 4, 2, 2, RecordMode::kStat); }, "rank must be in [0, 2), got 2");
  expect_invalid([] { DispatchCounts(1, 5, 2, 0, RecordMode::kStat); }, "num_physical (5) must be divisible");
  expect_invalid([] { DispatchCounts(1, 4, 2, 0, RecordMode::kPerToken); }, "per_token");
}

TEST(EplbDispatchCounts, AllReduceRejectsMismatchesOnEveryRank) {
  auto groups = create_host_groups(3, {.timeout_ms = 20'000});
  std::atomic<int> size_errors{0}, sign_errors{0};
  run_host_ranks(groups, [&](int rank, Group& group) {
    std::vector<int64_t> counts(rank == 1 ? 3 : 2, 1);
    try {
      all_reduce_counts(group, counts);
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kInvalidArgument &&
          std::string(e.what()).find("rank 1 passed 3 counts, rank 0 passed 2") != std::string::npos) {
        ++size_errors;
      }
    }
    std::vector<int64_t> signed_counts{1, rank == 2 ? -5 : 1};
    try {
      all_reduce_counts(group, signed_counts);
    } catch (const Error& e) {
      if (std::string(e.what()).find("rank 2 has counts[1] = -5") != std::string::npos) ++sign_errors;
    }
    std::vector<int64_t> ok{rank, 10};
    all_reduce_counts(group, ok);
    EXPECT_EQ(ok, (std::vector<int64_t>{0 + 1 + 2, 30}));
  });
  EXPECT_EQ(size_errors, 3);
  EXPECT_EQ(sign_errors, 3);
}

TEST(EplbDispatchCounts, ManagersFedWithReducedCountsAgreeOnEveryRank) {
  // Each rank runs its own manager on the all-reduced counts: the placements must be identical, and equal to
  // a single manager fed the global counts directly.
  const auto initial = ExpertLocation::trivial(kLayers, 12, kSlots, kRanks, 2);
  ManagerOptions opt;
  opt.num_groups = 2;
  opt.rebalance_every_steps = 3;
  const int kSteps = 7;
  std::vector<Routing> routings;
  for (int step = 0; step < kSteps; ++step) routings.push_back(random_routing(100 + step));
  RebalanceManager reference(initial, {3}, opt);
  for (const auto& routing : routings) {
    // Slot ids in the routing are physical already; the reference sees the same global counts.
    reference.step(global_counts(routing));
  }
  auto groups = create_host_groups(kRanks, {.timeout_ms = 20'000});
  std::mutex mu;
  std::vector<std::vector<int32_t>> placements;
  run_host_ranks(groups, [&](int rank, Group& group) {
    RebalanceManager m(initial, {3}, opt);
    DispatchCounts counts(kLayers, kSlots, kRanks, rank, RecordMode::kStat);
    for (const auto& routing : routings) {
      for (int l = 0; l < kLayers; ++l) counts.add_normal_dispatch(l, received(routing, rank, l), 1);
      auto global = counts.take();
      all_reduce_counts(group, global);
      m.step(global);
    }
    std::lock_guard<std::mutex> lock(mu);
    placements.push_back(*m.location().phy2log_table());
  });
  ASSERT_EQ(placements.size(), static_cast<size_t>(kRanks));
  EXPECT_GE(reference.num_rebalances(), 2);
  for (const auto& p : placements) EXPECT_EQ(p, *reference.location().phy2log_table());
}

}  // namespace
}  // namespace epx::eplb
