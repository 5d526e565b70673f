// EPLB placement: hand-computed small placements, the deepseek policy against a literal reference of the
// published algorithm and against brute force, invariants of every policy on random inputs (Zipf with
// exponents 0-1.5, uniform, with zeros and ties), default >= deepseek, migration-aware bounds and node
// locality, bad input, and the default policy's work bound on large shapes.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <random>

#include "eplb/placement_detail.h"
#include "epx/eplb/placement.h"
#include "epx/eplb/synthetic.h"
#include "epx/error.h"

namespace epx::eplb {
namespace {

using Weights = std::vector<std::vector<double>>;

// ---- a literal, slow reference of DeepSeek's published algorithm (one layer at a time) ----------------
struct RefPack {
  std::vector<int> pack, rank;
};
RefPack ref_packing(const std::vector<double>& w, int num_packs) {
  const int n = static_cast<int>(w.size()), per = n / num_packs;
  RefPack out{std::vector<int>(n, -1), std::vector<int>(n, -1)};
  if (per == 1) {
    for (int i = 0; i < n; ++i) out.pack[i] = i, out.rank[i] = 0;
    return out;
  }
  std::vector<int> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return w[a] > w[b]; });
  std::vector<double> pw(num_packs, 0);
  std::vector<int> pi(num_packs, 0);
  for (int g : idx) {
    int best = -1;
    for (int p = 0; p < num_packs; ++p) {
      if (pi[p] < per && (best == -1 || pw[p] < pw[best])) best = p;
    }
    out.pack[g] = best;
    out.rank[g] = pi[best]++;
    pw[best] += w[g];
  }
  return out;
}
struct RefPlacement {
  std::vector<int> phy2log, phyrank, logcnt;
};
RefPlacement ref_hierarchical(const std::vector<double>& w, int num_phy, int num_groups, int num_nodes, int num_gpus) {
  const int num_log = static_cast<int>(w.size()), group_size = num_log / num_groups;
  const int gpn = num_groups / num_nodes, ppg = num_phy / num_gpus, lpn = num_log / num_nodes,
            ppn = num_phy / num_nodes;
  std::vector<double> tpg(num_groups, 0);
  for (int e = 0; e < num_log; ++e) tpg[e / group_size] += w[e];
  const RefPack gp = ref_packing(tpg, num_nodes);
  std::vector<int> log2mlog(num_log), mlog2log(num_log);
  for (int e = 0; e < num_log; ++e) {
    const int g = e / group_size;
    log2mlog[e] = (gp.pack[g] * gpn + gp.rank[g]) * group_size + e % group_size;
  }
  for (int e = 0; e < num_log; ++e) mlog2log[log2mlog[e]] = e;
  RefPlacement out{std::vector<int>(num_phy), std::vector<int>(num_phy), std::vector<int>(num_log)};
  for (int n = 0; n < num_nodes; ++n) {
    std::vector<double> tm(lpn);
    for (int j = 0; j < lpn; ++j) tm[j] = w[mlog2log[n * lpn + j]];
    std::vector<int> phy2mlog(ppn), rank(ppn, 0), cnt(lpn, 1);
    std::iota(phy2mlog.begin(), phy2mlog.begin() + lpn, 0);
    for (int i = lpn; i < ppn; ++i) {
      int best = 0;
      for (int j = 1; j < lpn; ++j) {
        if (tm[j] / cnt[j] > tm[best] / cnt[best]) best = j;
      }
      phy2mlog[i] = best;
      rank[i] = cnt[best]++;
    }
    std::vector<double> tpp(ppn);
    for (int i = 0; i < ppn; ++i) tpp[i] = tm[phy2mlog[i]] / cnt[phy2mlog[i]];
    const RefPack pp = ref_packing(tpp, num_gpus / num_nodes);
    for (int i = 0; i < ppn; ++i) {
      const int slot = n * ppn + pp.pack[i] * ppg + pp.rank[i];
      out.phy2log[slot] = mlog2log[n * lpn + phy2mlog[i]];
      out.phyrank[slot] = rank[i];
    }
    for (int j = 0; j < lpn; ++j) out.logcnt[mlog2log[n * lpn + j]] = cnt[j];
  }
  return out;
}

// ---- invariants -------------------------------------------------------------------------------------
void check_invariants(const Placement& p, const Weights& w, const PlacementShape& shape, bool check_groups) {
  const int L = p.num_layers, E = p.num_logical, P = p.num_physical, M = p.max_replicas;
  ASSERT_EQ(L, static_cast<int>(w.size()));
  ASSERT_EQ(P, shape.num_physical);
  ASSERT_EQ(p.phy2log.size(), static_cast<size_t>(L) * P);
  ASSERT_EQ(p.logcnt.size(), static_cast<size_t>(L) * E);
  ASSERT_EQ(p.log2phy.size(), static_cast<size_t>(L) * E * M);
  const int spg = P / shape.num_gpus, gpn = shape.num_gpus / shape.num_nodes;
  int max_cnt = 0;
  for (int l = 0; l < L; ++l) {
    std::vector<int> cnt(E, 0), node_of(E, -1);
    for (int s = 0; s < P; ++s) {
      const int e = p.phy2log[l * P + s];
      ASSERT_GE(e, 0);
      ASSERT_LT(e, E);
      ++cnt[e];
      const int node = s / spg / gpn;
      if (p.hierarchical) {
        if (node_of[e] >= 0) {
          ASSERT_EQ(node_of[e], node) << "expert " << e << " spans nodes in layer " << l;
        }
        node_of[e] = node;
      }
    }
    for (int e = 0; e < E; ++e) {
      ASSERT_GE(cnt[e], 1) << "layer " << l << " expert " << e;
      ASSERT_EQ(cnt[e], p.logcnt[l * E + e]);
      max_cnt = std::max(max_cnt, cnt[e]);
      std::vector<int> seen;
      for (int k = 0; k < M; ++k) {
        const int s = p.log2phy[(l * E + e) * M + k];
        if (k < cnt[e]) {
          ASSERT_GE(s, 0);
          ASSERT_EQ(p.phy2log[l * P + s], e);
          seen.push_back(s);
        } else {
          ASSERT_EQ(s, -1);
        }
      }
      std::sort(seen.begin(), seen.end());
      ASSERT_TRUE(std::adjacent_find(seen.begin(), seen.end()) == seen.end());
    }
    if (p.hierarchical && check_groups) {  // whole groups sit on one node
      const int gs = E / shape.num_groups;
      for (int e = 0; e < E; ++e) ASSERT_EQ(node_of[e], node_of[e / gs * gs]) << "group of expert " << e;
      // equal replicas per node
      std::vector<int> per_node(shape.num_nodes, 0);
      for (int s = 0; s < P; ++s) ++per_node[s / spg / gpn];
      for (int n : per_node) ASSERT_EQ(n, P / shape.num_nodes);
    }
  }
  ASSERT_EQ(M, max_cnt);
}

TEST(EplbPlacement, HandComputedGlobal) {
  // 4 experts, 6 slots, 2 GPUs: replicas go to e0 (40) then e3 (30); packing {20,20,20,15,15,10} into 2x3.
  const Weights w = {{40, 10, 20, 30}};
  const Placement p = rebalance(w, {6, 1, 1, 2}, Policy::kDeepSeek);
  EXPECT_EQ(p.phy2log, (std::vector<int32_t>{0, 0, 1, 2, 3, 3}));
  EXPECT_EQ(p.logcnt, (std::vector<int32_t>{2, 1, 1, 2}));
  EXPECT_EQ(p.max_replicas, 2);
  EXPECT_EQ(p.log2phy, (std::vector<int32_t>{0, 1, 2, -1, 3, -1, 4, 5}));
  EXPECT_DOUBLE_EQ(balancedness(w, p.phy2log, 6, 2), 1.0);
}

TEST(EplbPlacement, HandComputedHierarchical) {
  // Groups {0,1} {2,3} {4,5} {6,7} with loads 3, 7, 11, 15 -> node 0 gets groups 3 and 0, node 1 groups 2, 1.
  const Weights w = {{1, 2, 3, 4, 5, 6, 7, 8}};
  const Placement p = rebalance(w, {12, 4, 2, 4}, Policy::kDeepSeek);
  EXPECT_TRUE(p.hierarchical);
  EXPECT_EQ(p.phy2log, (std::vector<int32_t>{7, 6, 1, 7, 6, 0, 3, 5, 4, 5, 2, 4}));
  EXPECT_EQ(p.logcnt, (std::vector<int32_t>{1, 1, 1, 1, 2, 2, 2, 2}));
  // log2phy follows replica creation order: e5's first replica sits in slot 9, its second in slot 7.
  EXPECT_EQ(p.log2phy, (std::vector<int32_t>{5, -1, 2, -1, 10, -1, 6, -1, 11, 8, 9, 7, 1, 4, 0, 3}));
  EXPECT_NEAR(balancedness(w, p.phy2log, 12, 4), 9.0 / 9.5, 1e-12);
}

TEST(EplbPlacement, DeepSeekMatchesLiteralReference) {
  std::mt19937 rng(7);
  struct Case {
    int E;
    PlacementShape s;
  };
  const Case cases[] = {{16, {24, 4, 2, 4}}, {32, {48, 8, 4, 8}}, {12, {16, 3, 2, 4}},    {64, {72, 8, 4, 8}},
                        {8, {8, 2, 2, 8}},   {16, {20, 4, 1, 4}}, {256, {288, 8, 4, 32}}, {10, {12, 5, 1, 6}}};
  for (const auto& c : cases) {
    for (int trial = 0; trial < 6; ++trial) {
      Weights w(3, std::vector<double>(c.E));
      for (auto& row : w) {
        for (auto& v : row)
          v = trial % 3 == 0 ? static_cast<double>(rng() % 5) : std::uniform_real_distribution<>(0, 100)(rng);
      }
      const Placement p = rebalance(w, c.s, Policy::kDeepSeek);
      const bool hier = c.s.num_groups % c.s.num_nodes == 0;
      ASSERT_EQ(p.hierarchical, hier);
      for (int l = 0; l < 3; ++l) {
        const RefPlacement ref =
            hier ? ref_hierarchical(w[l], c.s.num_physical, c.s.num_groups, c.s.num_nodes, c.s.num_gpus)
                 : ref_hierarchical(w[l], c.s.num_physical, 1, 1, c.s.num_gpus);
        for (int s = 0; s < c.s.num_physical; ++s) {
          ASSERT_EQ(p.phy2log[l * c.s.num_physical + s], ref.phy2log[s])
              << "E=" << c.E << " layer " << l << " slot " << s;
          ASSERT_EQ(p.log2phy[(l * c.E + ref.phy2log[s]) * p.max_replicas + ref.phyrank[s]], s);
        }
        for (int e = 0; e < c.E; ++e) ASSERT_EQ(p.logcnt[l * c.E + e], ref.logcnt[e]);
      }
    }
  }
}

TEST(EplbPlacement, DeepSeekReplicationIsMinMaxOptimal) {
  // Brute force over all replica-count vectors: greedy replication minimizes the largest load per replica.
  std::mt19937 rng(11);
  for (int trial = 0; trial < 40; ++trial) {
    const int E = 2 + static_cast<int>(rng() % 3), extra = 1 + static_cast<int>(rng() % 4);
    std::vector<double> row(E);
    for (auto& v : row) v = std::uniform_real_distribution<>(0, 10)(rng);
    // one GPU holding every slot: the placement is only replication
    const Placement p = rebalance({row}, {E + extra, 1, 1, 1}, Policy::kDeepSeek);
    double got = 0;
    for (int e = 0; e < E; ++e) got = std::max(got, row[e] / p.logcnt[e]);
    double best = std::numeric_limits<double>::infinity();
    std::vector<int> cnt(E, 1);
    std::function<void(int, int)> rec = [&](int e, int left) {
      if (e == E - 1) {
        cnt[e] = 1 + left;
        double m = 0;
        for (int k = 0; k < E; ++k) m = std::max(m, row[k] / cnt[k]);
        best = std::min(best, m);
        return;
      }
      for (int x = 0; x <= left; ++x) {
        cnt[e] = 1 + x;
        rec(e + 1, left - x);
      }
    };
    rec(0, extra);
    EXPECT_DOUBLE_EQ(got, best);
  }
}

TEST(EplbPlacement, ExhaustiveTinyShapes) {
  // Every placement of 3 experts on 2 GPUs x 2 slots: default >= deepseek, neither beats the optimum.
  std::mt19937 rng(5);
  for (int trial = 0; trial < 50; ++trial) {
    Weights w = {std::vector<double>(3)};
    for (auto& v : w[0]) v = static_cast<double>(rng() % 20);
    double optimum = 0;
    for (int code = 0; code < 81; ++code) {
      std::vector<int32_t> phy2log(4);
      for (int s = 0, c = code; s < 4; ++s, c /= 3) phy2log[s] = c % 3;
      bool all = true;
      for (int e = 0; e < 3; ++e) all = all && std::count(phy2log.begin(), phy2log.end(), e) > 0;
      if (all) optimum = std::max(optimum, balancedness(w, phy2log, 4, 2));
    }
    const double ds = balancedness(w, rebalance(w, {4, 1, 1, 2}, Policy::kDeepSeek).phy2log, 4, 2);
    const double def = balancedness(w, rebalance(w, {4, 1, 1, 2}, Policy::kDefault).phy2log, 4, 2);
    EXPECT_GE(def, ds);
    EXPECT_LE(def, optimum + 1e-12);
  }
}

TEST(EplbPlacement, InvariantsAndDefaultNeverWorse) {
  std::mt19937 rng(3);
  struct Case {
    int L, E;
    PlacementShape s;
  };
  const Case cases[] = {{4, 64, {72, 8, 2, 8}}, {3, 64, {80, 8, 4, 16}},   {4, 48, {64, 6, 4, 8}},
                        {2, 32, {32, 4, 2, 4}}, {3, 96, {144, 12, 3, 12}}, {2, 256, {288, 8, 4, 32}},
                        {3, 30, {36, 5, 1, 6}}, {2, 64, {96, 8, 8, 16}}};
  for (const auto& c : cases) {
    for (double exponent : {0.0, 0.6, 1.0, 1.5}) {
      Weights w = zipf_loads(c.L, c.E, exponent, 10000, rng());
      if (exponent == 0.0) {  // uniform random with zeros and ties
        for (auto& row : w) {
          for (auto& v : row) v = static_cast<double>(rng() % 4);
        }
      }
      const Placement ds = rebalance(w, c.s, Policy::kDeepSeek);
      const Placement def = rebalance(w, c.s, Policy::kDefault);
      check_invariants(ds, w, c.s, true);
      check_invariants(def, w, c.s, true);
      const auto b_ds = balancedness_per_layer(w, ds.phy2log, c.s.num_physical, c.s.num_gpus);
      const auto b_def = balancedness_per_layer(w, def.phy2log, c.s.num_physical, c.s.num_gpus);
      for (size_t l = 0; l < b_ds.size(); ++l) EXPECT_GE(b_def[l], b_ds[l]) << "E=" << c.E << " s=" << exponent;
    }
  }
}

TEST(EplbPlacement, DefaultBeatsDeepSeekOnSkewedDeepSeekV3Shape) {
  // The target: >= 2 points better on average at Zipf exponents >= 1.
  const PlacementShape shape{288, 8, 4, 32};
  double gain = 0;
  for (double exponent : {1.0, 1.2, 1.5}) {
    const Weights w = zipf_loads(16, 256, exponent, 32768, 99);
    const double ds = balancedness(w, rebalance(w, shape, Policy::kDeepSeek).phy2log, 288, 32);
    const double def = balancedness(w, rebalance(w, shape, Policy::kDefault).phy2log, 288, 32);
    EXPECT_GE(def, ds) << "exponent " << exponent;
    gain += (def - ds) / 3;
  }
  EXPECT_GE(gain, 0.02);
}

TEST(EplbPlacement, MigrationAwareKeepsPlacementAndBoundsLoss) {
  const PlacementShape shape{144, 8, 2, 16};
  DriftingZipf load(6, 128, 1.0, 32768, 0.02, 21);
  const Placement start = rebalance(load.expected(), shape, Policy::kDefault);
  // Unchanged load: nothing moves.
  const MigrationResult same = rebalance_migration_aware(load.expected(), shape, start.phy2log);
  EXPECT_EQ(same.moved_experts, 0);
  EXPECT_EQ(same.placement.phy2log, start.phy2log);
  for (int i = 0; i < 200; ++i) load.advance();
  const auto w = load.expected();
  for (double loss : {0.0, 0.01, 0.05}) {
    const MigrationResult r = rebalance_migration_aware(w, shape, start.phy2log, {loss});
    check_invariants(r.placement, w, shape, false);
    EXPECT_EQ(r.moved_experts, count_moved_experts(start.phy2log, r.placement.phy2log));
    EXPECT_LE(r.moved_experts, r.fresh_moved_experts);
    const auto fresh = balancedness_per_layer(w, rebalance(w, shape).phy2log, 144, 16);
    const auto got = balancedness_per_layer(w, r.placement.phy2log, 144, 16);
    for (size_t l = 0; l < got.size(); ++l) EXPECT_GE(got[l], fresh[l] - loss - 1e-12) << "layer " << l;
    if (loss == 0.01) {  // the target is <= 1/2; docs/eplb.md reports where it is missed
      EXPECT_LE(r.moved_experts, 0.55 * r.fresh_moved_experts);
    }
  }
}

// ---- the default policy's work bound (issue 13) -----------------------------------------------------
// Its refinement was quadratic in slots per GPU: 80k experts on one GPU took seconds, 2^20 experts far
// longer. The work is counted in units (detail::RefineBudget), so these checks are deterministic.

// One layer's placement is valid: every expert has a replica, logcnt matches, replicas stay on one node.
void check_layer(const detail::LayerPlacement& p, const detail::Layout& lay) {
  std::vector<int> cnt(lay.num_logical, 0), node_of(lay.num_logical, -1);
  ASSERT_EQ(p.phy2log.size(), static_cast<size_t>(lay.num_physical));
  for (int s = 0; s < lay.num_physical; ++s) {
    const int e = p.phy2log[s];
    ASSERT_GE(e, 0);
    ASSERT_LT(e, lay.num_logical);
    ++cnt[e];
    const int node = s / lay.physical_per_node;
    ASSERT_TRUE(node_of[e] < 0 || node_of[e] == node) << "expert " << e << " spans nodes";
    node_of[e] = node;
  }
  for (int e = 0; e < lay.num_logical; ++e) {
    ASSERT_GE(cnt[e], 1) << "expert " << e;
    ASSERT_EQ(cnt[e], p.logcnt[e]) << "expert " << e;
  }
}

TEST(EplbPlacement, DefaultWithManyExpertsOnOneGpu) {
  // A quarter of the largest --replicas `epx eplb plan` accepts (2^20: docs/perf-notes.md); ~0.1 s here,
  // ~1 minute with the quadratic refinement.
  const int E = 1 << 18;
  const Weights w = zipf_loads(1, E, 1.0, 1e6, 13);
  const Placement p = rebalance(w, {E, 1, 1, 1}, Policy::kDefault);
  ASSERT_EQ(p.max_replicas, 1);
  std::vector<int32_t> sorted = p.phy2log;
  std::sort(sorted.begin(), sorted.end());
  for (int e = 0; e < E; ++e) ASSERT_EQ(sorted[e], e);
  EXPECT_DOUBLE_EQ(balancedness(w, p.phy2log, E, 1), 1.0);
  // One GPU: nothing to refine, and no work spent finding that out (it was O(slots^2)).
  const detail::Layout lay = detail::make_layout(E, {E, 1, 1, 1});
  detail::LayerPlacement layer;
  detail::RefineBudget budget{detail::refine_work_limit(lay)};
  detail::place_layer_default(w[0].data(), lay, layer, budget);
  EXPECT_EQ(budget.used, 0);
  EXPECT_EQ(layer.phy2log, p.phy2log);
}

TEST(EplbPlacement, DefaultRefinementStaysWithinItsWorkBound) {
  struct Case {
    int E;
    PlacementShape s;
  };
  // Each was quadratic or worse: huge GPUs (2 x 32768 slots), many GPUs per node, many groups per node.
  const Case cases[] = {{1 << 15, {1 << 16, 1, 1, 2}},
                        {4096, {8192, 1, 1, 64}},
                        {1 << 14, {1 << 15, 1, 1, 1 << 14}},
                        {1 << 14, {1 << 15, 1 << 12, 1 << 6, 1 << 12}},
                        {1 << 14, {1 << 15, 1 << 13, 2, 16}}};
  for (const auto& c : cases) {
    const Weights w = zipf_loads(1, c.E, 0.6, 1e6, 17);
    const detail::Layout lay = detail::make_layout(c.E, c.s);
    // The documented limit: n * ceil(log2 n) + 2^23 units, n = slots + experts.
    const int64_t n = static_cast<int64_t>(c.s.num_physical) + c.E;
    int64_t log2n = 0;
    while ((int64_t{1} << log2n) < n) ++log2n;
    EXPECT_EQ(detail::refine_work_limit(lay), n * log2n + (int64_t{1} << 23)) << "E=" << c.E;
    // A smaller budget binds sooner (the default limit is reached the same way, only later): the search
    // stops inside it with a valid placement no worse than deepseek's.
    detail::LayerPlacement def, ds;
    detail::RefineBudget budget{int64_t{1} << 20};
    detail::place_layer_default(w[0].data(), lay, def, budget);
    EXPECT_LE(budget.used, budget.limit);
    check_layer(def, lay);
    std::vector<int> group_node, group_rank;
    detail::deepseek_group_packing(w[0].data(), lay, group_node, group_rank);
    detail::place_layer(w[0].data(), lay, group_node, group_rank, ds);
    EXPECT_LE(
        detail::max_gpu_load(w[0].data(), def.phy2log.data(), def.logcnt.data(), lay.num_physical, lay.slots_per_gpu),
        detail::max_gpu_load(w[0].data(), ds.phy2log.data(), ds.logcnt.data(), lay.num_physical, lay.slots_per_gpu))
        << "E=" << c.E;
  }
}

TEST(EplbPlacement, WorkBoundDoesNotBindOnRealisticShapes) {
  // The bound leaves these exactly as the unbounded search places them. The last shape is the heaviest
  // realistic one measured (128 slots per GPU, 2 replicas per expert).
  const PlacementShape shapes[] = {{288, 8, 4, 32}, {320, 8, 8, 64}, {288, 8, 1, 8}, {512, 8, 1, 4}};
  for (const auto& shape : shapes) {
    const detail::Layout lay = detail::make_layout(256, shape);
    for (double exponent : {0.6, 1.0, 1.5}) {
      const Weights w = zipf_loads(1, 256, exponent, 32768, 23);
      detail::LayerPlacement bounded, unbounded;
      detail::RefineBudget budget{detail::refine_work_limit(lay)}, unlimited{std::numeric_limits<int64_t>::max()};
      detail::place_layer_default(w[0].data(), lay, bounded, budget);
      detail::place_layer_default(w[0].data(), lay, unbounded, unlimited);
      EXPECT_LT(unlimited.used, budget.limit) << shape.num_physical << " slots, exponent " << exponent;
      EXPECT_EQ(bounded.phy2log, unbounded.phy2log);
    }
  }
}

// ---- the migration-aware search's work bound (issue 13) ---------------------------------------------
// Its GPU matching was cubic in GPUs per node, its slot matching quadratic in slots per GPU, its GPU-by-GPU
// adoption ~GPUs^2 x slots and its local search ~slots^2 x slots per GPU: `epx eplb plan --current` on 4096
// experts over 8192 slots of 8 GPUs did not finish in 100 s (docs/perf-notes.md, "EPLB placement time").

// A current placement unlike any fresh one: the trivial placement shuffled, every layer.
std::vector<int32_t> shuffled_placement(int num_layers, int num_logical, int num_physical, uint64_t seed) {
  std::vector<int32_t> out = trivial_phy2log(num_layers, num_logical, num_physical);
  std::mt19937_64 rng(seed);
  for (int l = 0; l < num_layers; ++l) {
    std::shuffle(out.begin() + static_cast<int64_t>(l) * num_physical,
                 out.begin() + static_cast<int64_t>(l + 1) * num_physical, rng);
  }
  return out;
}

TEST(EplbPlacement, MigrationAwareOnLargeShapesIsBounded) {
  struct Case {
    int E;
    PlacementShape s;
  };
  // Before: > 100 s, 45 s, > 100 s and > 100 s of `epx eplb plan --current` (CPU, RelWithDebInfo).
  const Case cases[] = {
      {4096, {8192, 1, 1, 8}}, {8192, {16384, 1, 1, 64}}, {8192, {16384, 1, 1, 8192}}, {16384, {32768, 64, 8, 64}}};
  const auto start = std::chrono::steady_clock::now();
  for (const auto& c : cases) {
    const Weights w = zipf_loads(1, c.E, 0.6, 1e6, 29);
    const auto current = shuffled_placement(1, c.E, c.s.num_physical, 31);
    const double loss = 0.01;
    const MigrationResult r = rebalance_migration_aware(w, c.s, current, {loss});
    // Valid (every expert present, log2phy consistent) and within the loss bound of the fresh placement.
    const Placement again = placement_from_phy2log(r.placement.phy2log, 1, c.E, c.s.num_physical);
    EXPECT_EQ(r.placement.logcnt, again.logcnt) << "E=" << c.E;
    EXPECT_EQ(r.placement.log2phy, again.log2phy) << "E=" << c.E;
    EXPECT_GE(balancedness(w, r.placement.phy2log, c.s.num_physical, c.s.num_gpus), r.fresh_balancedness - loss - 1e-12)
        << "E=" << c.E;
    EXPECT_LE(r.moved_experts, r.fresh_moved_experts) << "E=" << c.E;
  }
  // Loose: ~1 s in a release build, 20.8 s in CI's clang ASan+UBSan build on 2 shared cores (2026-12-01), so the
  // bound is 20 s without sanitizers and 90 s with them; before, each case took a minute or more in a release build.
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(undefined_behavior_sanitizer)
  constexpr double kLimitSeconds = 90.0;
#else
  constexpr double kLimitSeconds = 20.0;
#endif
#elif defined(__SANITIZE_ADDRESS__)
  constexpr double kLimitSeconds = 90.0;
#else
  constexpr double kLimitSeconds = 20.0;
#endif
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), kLimitSeconds);
}

TEST(EplbPlacement, MigrationSearchStaysWithinItsWorkBound) {
  // With budgets from none to ample, the layer is valid and within the loss bound of the fresh layer (the
  // renamed fresh layer is the fallback), and the search never spends more than it was given.
  const int E = 2048;
  const PlacementShape shape{4096, 16, 4, 32};
  const detail::Layout lay = detail::make_layout(E, shape);
  // The documented limit: n * ceil(log2 n) + 2^28 units, n = slots + experts (6144: 13 bits).
  EXPECT_EQ(detail::migration_work_limit(lay), int64_t{6144} * 13 + (int64_t{1} << 28));
  const Weights w = zipf_loads(1, E, 1.0, 1e6, 37);
  const auto current = shuffled_placement(1, E, shape.num_physical, 41);
  const auto fresh = rebalance(w, shape).phy2log;
  const double fresh_bal = balancedness(w, fresh, shape.num_physical, shape.num_gpus);
  for (const int64_t limit : {int64_t{0}, int64_t{1} << 12, int64_t{1} << 16, int64_t{1} << 20, int64_t{1} << 24}) {
    detail::RefineBudget budget{limit};
    std::vector<int32_t> out(shape.num_physical, -1);
    detail::migrate_layer(w[0].data(), lay, shape.num_nodes, fresh.data(), current.data(), 0.01, budget, out.data());
    EXPECT_LE(budget.used, budget.limit);
    const Placement p = placement_from_phy2log(out, 1, E, shape.num_physical);  // throws if an expert is missing
    EXPECT_GE(balancedness(w, p.phy2log, shape.num_physical, shape.num_gpus), fresh_bal - 0.01 - 1e-12)
        << "limit " << limit;
  }
}

TEST(EplbPlacement, MigrationWorkBoundDoesNotBindOnRealisticShapes) {
  // The bound leaves these exactly as the unbounded search places them: the shapes of the default policy's
  // test, each from the trivial placement, a shuffled one and a fresh placement of other loads.
  const PlacementShape shapes[] = {{288, 8, 4, 32}, {320, 8, 8, 64}, {288, 8, 1, 8}, {512, 8, 1, 4}};
  for (const auto& shape : shapes) {
    const detail::Layout lay = detail::make_layout(256, shape);
    const std::vector<int32_t> currents[] = {trivial_phy2log(1, 256, shape.num_physical),
                                             shuffled_placement(1, 256, shape.num_physical, 43),
                                             rebalance(zipf_loads(1, 256, 1.0, 32768, 47), shape).phy2log};
    for (double exponent : {0.6, 1.0, 1.5}) {
      const Weights w = zipf_loads(1, 256, exponent, 32768, 23);
      const auto fresh = rebalance(w, shape).phy2log;
      for (const auto& current : currents) {
        std::vector<int32_t> bounded(shape.num_physical), unbounded(shape.num_physical);
        detail::RefineBudget budget{detail::migration_work_limit(lay)}, unlimited{std::numeric_limits<int64_t>::max()};
        detail::migrate_layer(w[0].data(), lay, shape.num_nodes, fresh.data(), current.data(), 0.01, budget,
                              bounded.data());
        detail::migrate_layer(w[0].data(), lay, shape.num_nodes, fresh.data(), current.data(), 0.01, unlimited,
                              unbounded.data());
        EXPECT_LT(unlimited.used, budget.limit) << shape.num_physical << " slots, exponent " << exponent;
        EXPECT_EQ(bounded, unbounded);
      }
    }
  }
}

// ---- log2phy is built only where it is returned (issue 13) --------------------------------------------
TEST(EplbPlacement, BalancednessOfAHotPlacementBuildsNoLog2phy) {
  // One expert on 2^20 - 2^17 + 1 of 2^20 slots: its log2phy would be 2^17 x 917505 int32 (448 GiB). Before, the
  // balancedness and the migration-aware validation of such a placement built it (std::bad_alloc).
  const int E = 1 << 17, P = 1 << 20;
  std::vector<int32_t> hot(P, 0);
  std::iota(hot.begin(), hot.begin() + E, 0);
  const Weights w(1, std::vector<double>(E, 1.0));
  EXPECT_DOUBLE_EQ(balancedness(w, hot, P, 1), 1.0);
  // Two GPUs: the first holds experts 1..E-1 and P/2 - E + 1 replicas of expert 0, the second P/2 of them.
  const double per_replica = 1.0 / (P - E + 1);
  const double gpu0 = (E - 1) + (P / 2 - E + 1) * per_replica, gpu1 = (P / 2) * per_replica;
  EXPECT_NEAR(balancedness(w, hot, P, 2), (gpu0 + gpu1) / 2 / gpu0, 1e-12);
  const Placement p = detail::placement_from_phy2log_unmapped(hot, 1, E, P);
  EXPECT_EQ(p.max_replicas, P - E + 1);
  EXPECT_TRUE(p.log2phy.empty());
  // On one GPU the hot placement is already balanced: the migration-aware result keeps it.
  const MigrationResult r = detail::rebalance_migration_aware_unmapped(w, {P, 1, 1, 1}, hot, {0.01});
  EXPECT_EQ(r.moved_experts, 0);
  EXPECT_EQ(r.placement.max_replicas, P - E + 1);
  EXPECT_TRUE(r.placement.log2phy.empty());
}

void expect_error(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    FAIL() << "expected an error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(EplbPlacement, RejectsBadInput) {
  const Weights ok = {{1, 2, 3, 4}};
  expect_error([] { rebalance({}, {4, 1, 1, 1}); }, "weight must have >= 1 layer");
  expect_error([] { rebalance({{}}, {4, 1, 1, 1}); }, ">= 1 logical expert");
  expect_error([] { rebalance({{1, 2}, {1}}, {4, 1, 1, 1}); }, "ragged: row 1 has 1");
  expect_error([] { rebalance({{1, -2}}, {4, 1, 1, 1}); }, "weight[0][1] must be finite and >= 0");
  expect_error([] { rebalance({{1, std::nan("")}}, {4, 1, 1, 1}); }, "weight[0][1]");
  expect_error([] { rebalance({{1, INFINITY}}, {4, 1, 1, 1}); }, "weight[0][1]");
  expect_error([&] { rebalance(ok, {3, 1, 1, 1}); }, "must be >= the 4 logical experts, got 3");
  expect_error([&] { rebalance(ok, {6, 1, 1, 4}); }, "num_replicas (6) must be divisible by num_gpus (4)");
  expect_error([&] { rebalance(ok, {8, 1, 3, 4}); }, "num_gpus (4) must be divisible by num_nodes (3)");
  expect_error([&] { rebalance({{1, 2, 3, 4, 5, 6}}, {8, 4, 2, 4}); }, "divisible by num_groups (4)");
  expect_error([&] { rebalance(ok, {8, 0, 1, 4}); }, "num_groups must be >= 1");
  expect_error([&] { rebalance_migration_aware(ok, {4, 1, 1, 1}, {0, 1, 2}); }, "current phy2log must have");
  expect_error([&] { rebalance_migration_aware(ok, {4, 1, 1, 1}, {0, 1, 2, 2}); }, "logical expert 3 has no replica");
  expect_error([&] { rebalance_migration_aware(ok, {4, 1, 1, 1}, {0, 1, 2, 3}, {1.5}); }, "max_balance_loss");
  expect_error([] { policy_from_string("greedy"); }, "'greedy'");
}

// ---- node locality of migration-aware placements (issue 16) -----------------------------------------
// The hierarchical policy keeps an expert's replicas inside one node (a replica on a second node doubles the
// expert's inter-node traffic). Mixing the current and the fresh layer GPU by GPU could leave an expert on
// two nodes; so could keeping a current layer that already splits experts (the trivial one does whenever
// slots outnumber experts). Random shapes (2-4 nodes, 1-4 GPUs per node, 0-3 redundant slots per GPU beyond
// the experts' share), random loads (Zipf 0-1.5, uniform with zeros) and three kinds of current layer.
TEST(EplbPlacement, MigrationAwareKeepsEveryExpertInOneNode) {
  std::mt19937_64 rng(16);
  int64_t split_currents = 0;
  for (int trial = 0; trial < 80; ++trial) {
    const int nodes = 2 + static_cast<int>(rng() % 3), gpus_per_node = 1 + static_cast<int>(rng() % 4);
    const int gpus = nodes * gpus_per_node, groups = nodes * (1 + static_cast<int>(rng() % 2));
    const int E = groups * (1 + static_cast<int>(rng() % 6));
    const int slots_per_gpu = (E + gpus - 1) / gpus + static_cast<int>(rng() % 4);
    const PlacementShape shape{gpus * slots_per_gpu, groups, nodes, gpus};
    const int L = 3, P = shape.num_physical;
    Weights w;
    if (trial % 3 == 2) {
      std::uniform_real_distribution<double> u(0.0, 100.0);
      w.assign(L, std::vector<double>(E));
      for (auto& row : w) {
        for (double& x : row) x = rng() % 4 == 0 ? 0.0 : u(rng);
      }
    } else {
      w = zipf_loads(L, E, 0.5 * static_cast<double>(rng() % 4), 10000, rng());
    }
    const std::vector<int32_t> currents[] = {trivial_phy2log(L, E, P), shuffled_placement(L, E, P, rng()),
                                             rebalance(zipf_loads(L, E, 1.0, 10000, rng()), shape).phy2log};
    for (const auto& current : currents) {
      for (int l = 0; l < L; ++l) {
        std::vector<int> node_of(E, -1);
        bool split = false;
        for (int s = 0; s < P; ++s) {
          const int e = current[l * P + s], node = s / (P / nodes);
          split |= node_of[e] >= 0 && node_of[e] != node;
          node_of[e] = node;
        }
        split_currents += split;
      }
      for (double loss : {0.0, 0.01, 0.05}) {
        const MigrationResult r = rebalance_migration_aware(w, shape, current, {loss});
        ASSERT_TRUE(r.placement.hierarchical);
        SCOPED_TRACE(fmt::format("trial {}: {} experts on {} slots, {} nodes x {} GPUs, {} groups, loss {}", trial, E,
                                 P, nodes, gpus_per_node, groups, loss));
        check_invariants(r.placement, w, shape, false);  // every expert present, each in one node
        const auto fresh = balancedness_per_layer(w, rebalance(w, shape).phy2log, P, gpus);
        const auto got = balancedness_per_layer(w, r.placement.phy2log, P, gpus);
        for (int l = 0; l < L; ++l) ASSERT_GE(got[l], fresh[l] - loss - 1e-12) << "layer " << l;
      }
    }
  }
  EXPECT_GT(split_currents, 100);  // the inputs do exercise current layers that split experts
}

}  // namespace
}  // namespace epx::eplb
