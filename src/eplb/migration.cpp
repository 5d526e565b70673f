// Migration-aware rebalancing (see rebalance_migration_aware in epx/eplb/placement.h).
#include <algorithm>
#include <limits>
#include <numeric>

#include "core/check.h"
#include "eplb/placement_detail.h"
#include "epx/eplb/placement.h"

namespace epx::eplb {

namespace {

// Greedy maximum-overlap matching of n items to n items: repeatedly pairs the unmatched pair with the
// largest score (ties: lowest indices). Returns match[i] = j.
std::vector<int> greedy_match(const std::vector<int>& score, int n) {
  std::vector<int> match(n, -1);
  std::vector<char> used(n, 0);
  for (int round = 0; round < n; ++round) {
    int bi = -1, bj = -1, best = -1;
    for (int i = 0; i < n; ++i) {
      if (match[i] >= 0) continue;
      for (int j = 0; j < n; ++j) {
        if (!used[j] && score[i * n + j] > best) {
          best = score[i * n + j];
          bi = i;
          bj = j;
        }
      }
    }
    match[bi] = bj;
    used[bj] = 1;
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
std::vector<int32_t> relabel(const int32_t* fresh, const int32_t* cur, const detail::Layout& lay) {
  const int spg = lay.slots_per_gpu, gpn = lay.gpus_per_node, ppn = lay.physical_per_node;
  std::vector<int> scratch(lay.num_logical, 0);
  std::vector<int> node_score(lay.num_nodes * lay.num_nodes);
  for (int a = 0; a < lay.num_nodes; ++a) {
    for (int b = 0; b < lay.num_nodes; ++b) {
      node_score[a * lay.num_nodes + b] = overlap(fresh + a * ppn, cur + b * ppn, ppn, scratch);
    }
  }
  const auto node_match = greedy_match(node_score, lay.num_nodes);
  std::vector<int32_t> out(lay.num_physical, -1);
  std::vector<int> gpu_score(gpn * gpn);
  std::vector<char> used(spg);
  for (int a = 0; a < lay.num_nodes; ++a) {
    const int b = node_match[a];
    for (int i = 0; i < gpn; ++i) {
      for (int j = 0; j < gpn; ++j) {
        gpu_score[i * gpn + j] = overlap(fresh + (a * gpn + i) * spg, cur + (b * gpn + j) * spg, spg, scratch);
      }
    }
    const auto gpu_match = greedy_match(gpu_score, gpn);
    for (int i = 0; i < gpn; ++i) {
      const int32_t* src = fresh + (a * gpn + i) * spg;
      const int dst_gpu = b * gpn + gpu_match[i];
      const int32_t* old = cur + dst_gpu * spg;
      int32_t* dst = out.data() + dst_gpu * spg;
      std::fill(used.begin(), used.end(), 0);
      for (int j = 0; j < spg; ++j) {  // keep experts already in place
        for (int k = 0; k < spg; ++k) {
          if (!used[k] && src[k] == old[j]) {
            dst[j] = src[k];
            used[k] = 1;
            break;
          }
        }
      }
      int k = 0;
      for (int j = 0; j < spg; ++j) {
        if (dst[j] >= 0) continue;
        while (used[k]) ++k;
        dst[j] = src[k];
        used[k] = 1;
      }
    }
  }
  return out;
}

// Balancedness of a candidate layer, or -1 when some logical expert has no replica.
double candidate_balancedness(const double* w, const std::vector<int32_t>& phy2log, const detail::Layout& lay,
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
// that already hosts the expert, so an expert's replicas never spread over nodes. Returns the
// balancedness reached.
double local_search(const double* w, const detail::Layout& lay, int num_nodes_real, double target,
                    std::vector<int32_t>& mix) {
  const int P = lay.num_physical, spg = lay.slots_per_gpu, R = lay.num_gpus;
  const int gpn = R / num_nodes_real;
  std::vector<int32_t> cnt(lay.num_logical, 0);
  for (int32_t e : mix) ++cnt[e];
  std::vector<double> loads(R, 0.0);
  auto recompute = [&] {
    std::fill(loads.begin(), loads.end(), 0.0);
    for (int s = 0; s < P; ++s) loads[s / spg] += w[mix[s]] / cnt[mix[s]];
  };
  recompute();
  auto bal = [&] {
    double sum = 0, mx = 0;
    for (double v : loads) sum += v, mx = std::max(mx, v);
    return mx <= 0 ? 1.0 : (sum / R) / mx;
  };
  std::vector<double> trial_loads(R);
  for (int iter = 0; iter < 4 * P && bal() < target; ++iter) {
    const int g = static_cast<int>(std::max_element(loads.begin(), loads.end()) - loads.begin());
    // Max over GPUs other than g and h, from the three largest loads.
    std::vector<int> top(R);
    std::iota(top.begin(), top.end(), 0);
    std::partial_sort(top.begin(), top.begin() + std::min(R, 3), top.end(),
                      [&](int a, int b) { return loads[a] > loads[b]; });
    auto max_without = [&](int a, int b) {
      for (int k = 0; k < std::min(R, 3); ++k) {
        if (top[k] != a && top[k] != b) return loads[top[k]];
      }
      return 0.0;
    };
    double best_max = loads[g];
    int kind = -1, best_a = -1, best_b = -1;
    for (int a = g * spg; a < (g + 1) * spg; ++a) {
      const double la = w[mix[a]] / cnt[mix[a]];
      for (int b = 0; b < P; ++b) {
        const int h = b / spg;
        if (h == g) continue;
        if (h / gpn != g / gpn && (cnt[mix[a]] > 1 || cnt[mix[b]] > 1)) continue;
        const double d = la - w[mix[b]] / cnt[mix[b]];
        if (d <= 0) continue;
        const double m = std::max({loads[g] - d, loads[h] + d, max_without(g, h)});
        if (m < best_max) best_max = m, kind = 0, best_a = a, best_b = b;
      }
    }
    // Conversions: a slot on g whose expert has another replica becomes a replica of the node's most loaded
    // (per replica) expert; or a spare replica in g's node becomes one of g's hottest expert.
    const int n0 = (g / gpn) * gpn * spg, n1 = n0 + gpn * spg;
    auto try_convert = [&](int slot, int32_t to) {
      const int32_t from = mix[slot];
      if (from == to || cnt[from] < 2) return;
      --cnt[from], ++cnt[to], mix[slot] = to;
      std::fill(trial_loads.begin(), trial_loads.end(), 0.0);
      for (int s = 0; s < P; ++s) trial_loads[s / spg] += w[mix[s]] / cnt[mix[s]];
      ++cnt[from], --cnt[to], mix[slot] = from;
      const double m = *std::max_element(trial_loads.begin(), trial_loads.end());
      if (m < best_max) best_max = m, kind = 1, best_a = slot, best_b = to;
    };
    int32_t needy = -1, hot = mix[g * spg];
    for (int s = n0; s < n1; ++s) {
      if (needy < 0 || w[mix[s]] / cnt[mix[s]] > w[needy] / cnt[needy]) needy = mix[s];
    }
    for (int s = g * spg; s < (g + 1) * spg; ++s) {
      if (w[mix[s]] / cnt[mix[s]] > w[hot] / cnt[hot]) hot = mix[s];
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

MigrationResult rebalance_migration_aware(const std::vector<std::vector<double>>& weight, const PlacementShape& shape,
                                          const std::vector<int32_t>& current_phy2log,
                                          const MigrationOptions& options) {
  detail::check_weight(weight);
  const int num_layers = static_cast<int>(weight.size());
  const int num_logical = static_cast<int>(weight[0].size());
  const detail::Layout lay = detail::make_layout(num_logical, shape);
  EPX_CHECK_ARG(options.max_balance_loss >= 0 && options.max_balance_loss <= 1,
                "max_balance_loss must be in [0, 1], got {}", options.max_balance_loss);
  EPX_CHECK_ARG(current_phy2log.size() == static_cast<size_t>(num_layers) * lay.num_physical,
                "current phy2log must have num_layers * num_replicas = {} * {} entries, got {}", num_layers,
                lay.num_physical, current_phy2log.size());
  // Validates the current placement (range, every expert present).
  placement_from_phy2log(current_phy2log, num_layers, num_logical, lay.num_physical);

  const Placement fresh = rebalance(weight, shape, Policy::kDefault);
  MigrationResult result;
  result.fresh_moved_experts = count_moved_experts(current_phy2log, fresh.phy2log);
  result.fresh_balancedness = balancedness(weight, fresh.phy2log, lay.num_physical, lay.num_gpus);

  const int P = lay.num_physical, spg = lay.slots_per_gpu;
  std::vector<int32_t> out(current_phy2log.size());
  std::vector<int32_t> cnt;
  for (int l = 0; l < num_layers; ++l) {
    const double* w = weight[l].data();
    const int32_t* cur = current_phy2log.data() + static_cast<int64_t>(l) * P;
    const std::vector<int32_t> target_layer = relabel(fresh.phy2log.data() + static_cast<int64_t>(l) * P, cur, lay);
    const double target = candidate_balancedness(w, target_layer, lay, cnt) - options.max_balance_loss;

    std::vector<int32_t> mix(cur, cur + P);
    std::vector<char> switched(lay.num_gpus, 0);
    auto differs = [&](int g) {
      return !std::equal(mix.begin() + g * spg, mix.begin() + (g + 1) * spg, target_layer.begin() + g * spg);
    };
    auto switch_gpu = [&](std::vector<int32_t>& m, int g) {
      std::copy(target_layer.begin() + g * spg, target_layer.begin() + (g + 1) * spg, m.begin() + g * spg);
    };
    double cur_bal = candidate_balancedness(w, mix, lay, cnt);
    std::vector<int32_t> trial, best_trial;
    std::vector<char> trial_switched, best_switched;
    while (cur_bal < target) {
      double best_bal = -std::numeric_limits<double>::infinity();
      int64_t best_moves = 0;
      for (int g = 0; g < lay.num_gpus; ++g) {
        if (switched[g] || !differs(g)) continue;
        trial = mix;
        trial_switched = switched;
        switch_gpu(trial, g);
        trial_switched[g] = 1;
        // Closure: also adopt the GPUs where the target keeps experts that this switch left without a replica.
        double b = candidate_balancedness(w, trial, lay, cnt);
        while (b < 0) {
          int missing = -1;
          for (int e = 0; e < num_logical && missing < 0; ++e) {
            if (cnt[e] == 0) missing = e;
          }
          int host = -1;
          for (int s = 0; s < P && host < 0; ++s) {
            if (target_layer[s] == missing && !trial_switched[s / spg]) host = s / spg;
          }
          if (host < 0) break;
          switch_gpu(trial, host);
          trial_switched[host] = 1;
          b = candidate_balancedness(w, trial, lay, cnt);
        }
        if (b < 0) continue;
        int64_t moves = 0;
        for (int s = 0; s < P; ++s) moves += trial[s] != cur[s];
        if (b > best_bal || (b == best_bal && moves < best_moves)) {
          best_bal = b;
          best_moves = moves;
          best_trial = trial;
          best_switched = trial_switched;
        }
      }
      if (!(best_bal > cur_bal)) break;
      mix = best_trial;
      switched = best_switched;
      cur_bal = best_bal;
    }
    if (cur_bal < target) mix = target_layer;
    // The local search often reaches the target with fewer moves than adopting whole GPUs.
    std::vector<int32_t> searched(cur, cur + P);
    if (local_search(w, lay, shape.num_nodes, target, searched) >= target) {
      int64_t moves_mix = 0, moves_searched = 0;
      for (int s = 0; s < P; ++s) moves_mix += mix[s] != cur[s], moves_searched += searched[s] != cur[s];
      if (moves_searched < moves_mix) mix = std::move(searched);
    }
    std::copy(mix.begin(), mix.end(), out.begin() + static_cast<int64_t>(l) * P);
  }
  result.placement = placement_from_phy2log(out, num_layers, num_logical, P);
  result.placement.hierarchical = fresh.hierarchical;
  result.moved_experts = count_moved_experts(current_phy2log, out);
  return result;
}

}  // namespace epx::eplb
