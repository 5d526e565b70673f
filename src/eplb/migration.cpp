// Migration-aware rebalancing (see rebalance_migration_aware in epx/eplb/placement.h).
#include <algorithm>
#include <limits>
#include <numeric>

#include "core/check.h"
#include "eplb/placement_detail.h"
#include "epx/eplb/placement.h"

namespace epx::eplb {

namespace {

using detail::ceil_log2;
using detail::Layout;
using detail::RefineBudget;

// Units of greedy_match: sorting n^2 pairs.
int64_t match_units(int64_t n) { return n * n * (1 + ceil_log2(n * n)); }

// Greedy maximum-overlap matching of n items to n items: repeatedly pairs the unmatched pair with the
// largest score (ties: lowest indices, the pair a row-major scan of the unmatched pairs meets first), by one
// sort of all pairs. Returns match[i] = j.
std::vector<int> greedy_match(const std::vector<int>& score, int n) {
  std::vector<int64_t> order(static_cast<size_t>(n) * n);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return score[x] > score[y]; });
  std::vector<int> match(n, -1);
  std::vector<char> used(n, 0);
  int matched = 0;
  for (const int64_t pair : order) {
    const int i = static_cast<int>(pair / n), j = static_cast<int>(pair % n);
    if (match[i] >= 0 || used[j]) continue;
    match[i] = j;
    used[j] = 1;
    if (++matched == n) break;
  }
  return match;
}

// Size of the multiset intersection of two slot ranges.
int overlap(const int32_t* a, const int32_t* b, int n, std::vector<int>& scratch) {
  for (int i = 0; i < n; ++i) ++scratch[a[i]];
  int common = 0;
  for (int i = 0; i < n; ++i) {
    if (scratch[b[i]] > 0) {
      --scratch[b[i]];
      ++common;
    }
  }
  for (int i = 0; i < n; ++i) scratch[a[i]] = 0;
  return common;
}

// Renames nodes, GPUs inside nodes and slots inside GPUs of `fresh` to overlap `cur`. Balance is unchanged.
// A level whose overlap matrix and matching do not fit in `budget` keeps the fresh order (identity); the slots
// inside a GPU are matched in linear time.
std::vector<int32_t> relabel(const int32_t* fresh, const int32_t* cur, const Layout& lay, RefineBudget& budget) {
  const int spg = lay.slots_per_gpu, gpn = lay.gpus_per_node, ppn = lay.physical_per_node, N = lay.num_nodes;
  std::vector<int> scratch(lay.num_logical, 0);
  std::vector<int> node_match(N);
  std::iota(node_match.begin(), node_match.end(), 0);
  // NOTE: an overlap visits 3 x its slots; N^2 overlaps of a node's slots visit 3 x N x num_physical.
  if (N >= 2 && budget.spend(3 * int64_t{N} * lay.num_physical + match_units(N))) {
    std::vector<int> node_score(static_cast<size_t>(N) * N);
    for (int a = 0; a < N; ++a) {
      for (int b = 0; b < N; ++b) {
        node_score[static_cast<int64_t>(a) * N + b] =
            overlap(fresh + static_cast<int64_t>(a) * ppn, cur + static_cast<int64_t>(b) * ppn, ppn, scratch);
      }
    }
    node_match = greedy_match(node_score, N);
  }
  std::vector<int32_t> out(lay.num_physical, -1);
  std::vector<int> gpu_score, gpu_match(gpn);  // gpu_score [gpn, gpn] only where it fits the budget
  std::vector<int> avail(lay.num_logical, 0), taken(lay.num_logical, 0);
  std::vector<int32_t> spare;
  for (int a = 0; a < N; ++a) {
    const int b = node_match[a];
    std::iota(gpu_match.begin(), gpu_match.end(), 0);
    if (gpn >= 2 && budget.spend(3 * int64_t{gpn} * ppn + match_units(gpn))) {
      gpu_score.resize(static_cast<size_t>(gpn) * gpn);
      for (int i = 0; i < gpn; ++i) {
        for (int j = 0; j < gpn; ++j) {
          gpu_score[static_cast<int64_t>(i) * gpn + j] =
              overlap(fresh + static_cast<int64_t>(a * gpn + i) * spg, cur + static_cast<int64_t>(b * gpn + j) * spg,
                      spg, scratch);
        }
      }
      gpu_match = greedy_match(gpu_score, gpn);
    }
    for (int i = 0; i < gpn; ++i) {
      const int32_t* src = fresh + static_cast<int64_t>(a * gpn + i) * spg;
      const int dst_gpu = b * gpn + gpu_match[i];
      const int32_t* old = cur + static_cast<int64_t>(dst_gpu) * spg;
      int32_t* dst = out.data() + static_cast<int64_t>(dst_gpu) * spg;
      // Keep experts already in place: slot j keeps old[j] while src has copies of it left (the first copies in
      // src order are the ones used); the other slots take src's remaining experts in src order.
      for (int k = 0; k < spg; ++k) ++avail[src[k]];
      for (int j = 0; j < spg; ++j) {
        if (avail[old[j]] > 0) {
          --avail[old[j]];
          ++taken[old[j]];
          dst[j] = old[j];
        }
      }
      spare.clear();
      for (int k = 0; k < spg; ++k) {
        if (taken[src[k]] > 0) {
          --taken[src[k]];
        } else {
          spare.push_back(src[k]);
        }
        avail[src[k]] = 0;
      }
      size_t next = 0;
      for (int j = 0; j < spg; ++j) {
        if (dst[j] < 0) dst[j] = spare[next++];
      }
    }
  }
  return out;
}

// Balancedness of a candidate layer, or -1 when some logical expert has no replica.
double candidate_balancedness(const double* w, const std::vector<int32_t>& phy2log, const Layout& lay,
                              std::vector<int32_t>& cnt) {
  cnt.assign(lay.num_logical, 0);
  for (int32_t e : phy2log) ++cnt[e];
  for (int32_t c : cnt) {
    if (c == 0) return -1.0;
  }
  return detail::layer_balancedness(w, lay.num_logical, phy2log.data(), lay.num_physical, lay.num_gpus);
}

// Local search from the current layer: swaps (2 moves) and replica conversions (1 move) around the most
// loaded GPU, each chosen to lower the layer's max GPU load the most, until `target` balancedness is
// reached. Swaps across nodes only exchange single-replica experts and conversions stay inside the node
// that already hosts the expert, so an expert's replicas never spread over more nodes than in `mix`. Each step costs
// about (slots per GPU + 3) x 2 x (slots + GPUs) units of `budget` (every pair of a max-GPU slot and a slot, and a full
// re-sum per trial conversion); it stops at the first step that does not fit. Returns the balancedness reached.
double local_search(const double* w, const Layout& lay, int num_nodes_real, double target, RefineBudget& budget,
                    std::vector<int32_t>& mix) {
  const int P = lay.num_physical, spg = lay.slots_per_gpu, R = lay.num_gpus;
  const int gpn = R / num_nodes_real;
  std::vector<int32_t> cnt(lay.num_logical, 0);
  for (int32_t e : mix) ++cnt[e];
  std::vector<double> loads(R, 0.0), per_slot(P);  // per_slot[s] = w[mix[s]] / cnt[mix[s]]
  // NOTE: every load below is summed in slot order from the same per-slot quotients, so each comparison sees
  // the doubles a plain re-sum of the layer would give.
  auto recompute = [&] {
    for (int s = 0; s < P; ++s) per_slot[s] = w[mix[s]] / cnt[mix[s]];
    std::fill(loads.begin(), loads.end(), 0.0);
    for (int s = 0; s < P; ++s) loads[s / spg] += per_slot[s];
  };
  recompute();
  auto bal = [&] {
    double sum = 0, mx = 0;
    for (double v : loads) sum += v, mx = std::max(mx, v);
    return mx <= 0 ? 1.0 : (sum / R) / mx;
  };
  std::vector<int> top(R);
  std::vector<double> others_max(R);
  const int64_t step_units = (int64_t{spg} + 3) * 2 * (int64_t{P} + R);
  for (int64_t iter = 0; iter < int64_t{4} * P && bal() < target; ++iter) {
    if (!budget.spend(step_units)) break;
    const int g = static_cast<int>(std::max_element(loads.begin(), loads.end()) - loads.begin());
    // others_max[h]: the max over GPUs other than g and h, from the three largest loads.
    std::iota(top.begin(), top.end(), 0);
    std::partial_sort(top.begin(), top.begin() + std::min(R, 3), top.end(),
                      [&](int a, int b) { return loads[a] > loads[b]; });
    for (int h = 0; h < R; ++h) {
      others_max[h] = 0.0;
      for (int k = 0; k < std::min(R, 3); ++k) {
        if (top[k] != g && top[k] != h) {
          others_max[h] = loads[top[k]];
          break;
        }
      }
    }
    double best_max = loads[g];
    int kind = -1, best_a = -1, best_b = -1;
    // Swaps, in (a, b) order: the first pair with the lowest new max wins.
    for (int a = g * spg; a < (g + 1) * spg; ++a) {
      const double la = per_slot[a];
      const bool a_single = cnt[mix[a]] <= 1;
      for (int h = 0; h < R; ++h) {
        const bool cross = h / gpn != g / gpn;
        // NOTE: a swap with h gives a max >= loads[h] + d >= loads[h] (d > 0; rounding is monotonic) and >=
        // others_max[h], so no slot of h can beat best_max once either reaches it.
        if (h == g || (cross && !a_single) || loads[h] >= best_max || others_max[h] >= best_max) continue;
        for (int b = h * spg; b < (h + 1) * spg; ++b) {
          if (cross && cnt[mix[b]] > 1) continue;
          const double d = la - per_slot[b];
          if (d <= 0) continue;
          const double m = std::max({loads[g] - d, loads[h] + d, others_max[h]});
          if (m < best_max) best_max = m, kind = 0, best_a = a, best_b = b;
        }
      }
    }
    // Conversions: a slot on g whose expert has another replica becomes a replica of the node's most loaded
    // (per replica) expert; or a spare replica in g's node becomes one of g's hottest expert. Only the two
    // experts' per-replica loads change.
    const int n0 = (g / gpn) * gpn * spg, n1 = n0 + gpn * spg;
    auto try_convert = [&](int slot, int32_t to) {
      const int32_t from = mix[slot];
      if (from == to || cnt[from] < 2) return;
      --cnt[from], ++cnt[to], mix[slot] = to;
      const double load_from = w[from] / cnt[from], load_to = w[to] / cnt[to];
      double m = 0.0;
      for (int h = 0; h < R; ++h) {
        double sum = 0.0;
        for (int s = h * spg; s < (h + 1) * spg; ++s) {
          const int32_t e = mix[s];
          sum += e == from ? load_from : e == to ? load_to : per_slot[s];
        }
        m = std::max(m, sum);
      }
      ++cnt[from], --cnt[to], mix[slot] = from;
      if (m < best_max) best_max = m, kind = 1, best_a = slot, best_b = to;
    };
    int32_t needy = -1, hot = mix[g * spg];
    for (int s = n0; s < n1; ++s) {
      if (needy < 0 || per_slot[s] > w[needy] / cnt[needy]) needy = mix[s];
    }
    for (int s = g * spg; s < (g + 1) * spg; ++s) {
      if (per_slot[s] > w[hot] / cnt[hot]) hot = mix[s];
      try_convert(s, needy);
    }
    int spare = -1;
    for (int s = n0; s < n1; ++s) {
      if (s / spg != g && cnt[mix[s]] >= 2 && mix[s] != hot &&
          (spare < 0 || w[mix[s]] / (cnt[mix[s]] - 1) < w[mix[spare]] / (cnt[mix[spare]] - 1))) {
        spare = s;
      }
    }
    if (spare >= 0) try_convert(spare, hot);
    if (kind < 0) break;
    if (kind == 0) {
      std::swap(mix[best_a], mix[best_b]);
    } else {
      --cnt[mix[best_a]], ++cnt[best_b], mix[best_a] = best_b;
    }
    recompute();
  }
  return bal();
}

}  // namespace

namespace detail {

int64_t migration_work_limit(const Layout& lay) {
  return refine_work_limit(lay) - kRefineUnitsFloor + kMigrationUnitsFloor;
}

void migrate_layer(const double* w, const Layout& lay, int num_nodes, const int32_t* fresh, const int32_t* cur,
                   double max_balance_loss, RefineBudget& budget, int32_t* out) {
  const int P = lay.num_physical, spg = lay.slots_per_gpu, num_logical = lay.num_logical;
  std::vector<int32_t> cnt;
  const std::vector<int32_t> target_layer = relabel(fresh, cur, lay, budget);
  const double target = candidate_balancedness(w, target_layer, lay, cnt) - max_balance_loss;

  // NOTE: node locality. With a hierarchical layout the fresh (and renamed) layer keeps each expert's replicas
  // inside one node, since a replica on a second node doubles the expert's inter-node traffic. Mixes of the
  // current and the target layer can split an expert (and so can the current layer itself, e.g. the trivial
  // one), so a candidate is taken only when no expert spans two nodes.
  const bool keep_local = lay.hierarchical && lay.num_nodes > 1;
  const int ppn = lay.physical_per_node;
  std::vector<int> target_node(num_logical, -1), node_of(num_logical, -1);
  for (int s = 0; s < P; ++s) target_node[target_layer[s]] = s / ppn;
  // The first expert (in slot order) whose replicas sit on two nodes, or -1.
  auto split_expert = [&](const std::vector<int32_t>& m) {
    if (!keep_local) return -1;
    std::fill(node_of.begin(), node_of.end(), -1);
    for (int s = 0; s < P; ++s) {
      int& node = node_of[m[s]];
      if (node < 0) {
        node = s / ppn;
      } else if (node != s / ppn) {
        return static_cast<int>(m[s]);
      }
    }
    return -1;
  };
  const int64_t split_units = keep_local ? int64_t{P} + num_logical : 0;

  std::vector<int32_t> mix(cur, cur + P);
  bool mix_split = split_expert(mix) >= 0;
  std::vector<char> switched(lay.num_gpus, 0);
  auto differs = [&](int g) {
    return !std::equal(mix.begin() + static_cast<int64_t>(g) * spg, mix.begin() + static_cast<int64_t>(g + 1) * spg,
                       target_layer.begin() + static_cast<int64_t>(g) * spg);
  };
  auto switch_gpu = [&](std::vector<int32_t>& m, int g) {
    std::copy(target_layer.begin() + static_cast<int64_t>(g) * spg,
              target_layer.begin() + static_cast<int64_t>(g + 1) * spg, m.begin() + static_cast<int64_t>(g) * spg);
  };
  // NOTE: units of the GPU-by-GPU adoption: a trial copies the layer, scores it and counts its moves; each
  // closure step scans the experts and slots once more and rescores.
  const int64_t trial_units = 3 * int64_t{P} + num_logical + lay.num_gpus + split_units;
  const int64_t closure_units = 2 * (int64_t{P} + num_logical) + lay.num_gpus + split_units;
  double cur_bal = candidate_balancedness(w, mix, lay, cnt);
  std::vector<int32_t> trial, best_trial;
  std::vector<char> trial_switched, best_switched;
  bool out_of_budget = false;
  while ((cur_bal < target || mix_split) && !out_of_budget && budget.spend(P)) {
    double best_bal = -std::numeric_limits<double>::infinity();
    int64_t best_moves = 0;
    for (int g = 0; g < lay.num_gpus && !out_of_budget; ++g) {
      if (switched[g] || !differs(g)) continue;
      if (!budget.spend(trial_units)) {
        out_of_budget = true;  // the best trial of this round so far is still taken below
        break;
      }
      trial = mix;
      trial_switched = switched;
      switch_gpu(trial, g);
      trial_switched[g] = 1;
      // Closure: also adopt the GPUs where the target keeps experts that this switch left without a replica,
      // and, for an expert on two nodes, the GPUs that hold it outside its target node (target GPUs hold it
      // only in its target node, so this ends with the expert in one node).
      double b = candidate_balancedness(w, trial, lay, cnt);
      int split = b < 0 ? -1 : split_expert(trial);
      while (b < 0 || split >= 0) {
        if (!budget.spend(closure_units)) {
          out_of_budget = true;
          break;
        }
        int host = -1;
        if (b < 0) {
          int missing = -1;
          for (int e = 0; e < num_logical && missing < 0; ++e) {
            if (cnt[e] == 0) missing = e;
          }
          for (int s = 0; s < P && host < 0; ++s) {
            if (target_layer[s] == missing && !trial_switched[s / spg]) host = s / spg;
          }
        } else {
          for (int s = 0; s < P && host < 0; ++s) {
            if (trial[s] == split && s / ppn != target_node[split] && !trial_switched[s / spg]) host = s / spg;
          }
        }
        if (host < 0) break;
        switch_gpu(trial, host);
        trial_switched[host] = 1;
        b = candidate_balancedness(w, trial, lay, cnt);
        split = b < 0 ? -1 : split_expert(trial);
      }
      if (b < 0 || split >= 0) continue;
      int64_t moves = 0;
      for (int s = 0; s < P; ++s) moves += trial[s] != cur[s];
      if (b > best_bal || (b == best_bal && moves < best_moves)) {
        best_bal = b;
        best_moves = moves;
        best_trial = trial;
        best_switched = trial_switched;
      }
    }
    // A split current layer takes the best node-local trial even when it is less balanced.
    const bool found = best_bal > -std::numeric_limits<double>::infinity();
    if (!found || !(best_bal > cur_bal || mix_split)) break;
    mix = best_trial;
    switched = best_switched;
    cur_bal = best_bal;
    mix_split = false;
  }
  if (cur_bal < target || mix_split) mix = target_layer;
  // The local search often reaches the target with fewer moves than adopting whole GPUs.
  std::vector<int32_t> searched(cur, cur + P);
  if (local_search(w, lay, num_nodes, target, budget, searched) >= target && split_expert(searched) < 0) {
    int64_t moves_mix = 0, moves_searched = 0;
    for (int s = 0; s < P; ++s) moves_mix += mix[s] != cur[s], moves_searched += searched[s] != cur[s];
    if (moves_searched < moves_mix) mix = std::move(searched);
  }
  std::copy(mix.begin(), mix.end(), out);
}

MigrationResult rebalance_migration_aware_unmapped(const std::vector<std::vector<double>>& weight,
                                                   const PlacementShape& shape,
                                                   const std::vector<int32_t>& current_phy2log,
                                                   const MigrationOptions& options) {
  check_weight(weight);
  const int num_layers = static_cast<int>(weight.size());
  const int num_logical = static_cast<int>(weight[0].size());
  const Layout lay = make_layout(num_logical, shape);
  EPX_CHECK_ARG(options.max_balance_loss >= 0 && options.max_balance_loss <= 1,
                "max_balance_loss must be in [0, 1], got {}", options.max_balance_loss);
  EPX_CHECK_ARG(current_phy2log.size() == static_cast<size_t>(num_layers) * lay.num_physical,
                "current phy2log must have num_layers * num_replicas = {} * {} entries, got {}", num_layers,
                lay.num_physical, current_phy2log.size());
  // Validates the current placement (range, every expert present).
  placement_from_phy2log_unmapped(current_phy2log, num_layers, num_logical, lay.num_physical);

  const Placement fresh = rebalance_unmapped(weight, shape, Policy::kDefault).placement;
  MigrationResult result;
  result.fresh_moved_experts = count_moved_experts(current_phy2log, fresh.phy2log);
  result.fresh_balancedness = balancedness(weight, fresh.phy2log, lay.num_physical, lay.num_gpus);

  const int P = lay.num_physical;
  std::vector<int32_t> out(current_phy2log.size());
  for (int l = 0; l < num_layers; ++l) {
    const int64_t first = static_cast<int64_t>(l) * P;
    RefineBudget budget{migration_work_limit(lay)};
    migrate_layer(weight[l].data(), lay, shape.num_nodes, fresh.phy2log.data() + first, current_phy2log.data() + first,
                  options.max_balance_loss, budget, out.data() + first);
  }
  result.placement = placement_from_phy2log_unmapped(out, num_layers, num_logical, P);
  result.placement.hierarchical = fresh.hierarchical;
  result.moved_experts = count_moved_experts(current_phy2log, out);
  return result;
}

}  // namespace detail

MigrationResult rebalance_migration_aware(const std::vector<std::vector<double>>& weight, const PlacementShape& shape,
                                          const std::vector<int32_t>& current_phy2log,
                                          const MigrationOptions& options) {
  MigrationResult result = detail::rebalance_migration_aware_unmapped(weight, shape, current_phy2log, options);
  detail::build_log2phy(result.placement);
  return result;
}

}  // namespace epx::eplb
