#include "epx/eplb/placement.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>

#include "core/check.h"
#include "eplb/placement_detail.h"

namespace epx::eplb {

const char* to_string(Policy policy) noexcept { return policy == Policy::kDeepSeek ? "deepseek" : "default"; }

Policy policy_from_string(const std::string& name) {
  if (name == "deepseek") return Policy::kDeepSeek;
  if (name == "default") return Policy::kDefault;
  epx::detail::raise(ErrorCode::kInvalidArgument, "policy must be 'deepseek' or 'default', got '{}'", name);
}

namespace detail {

Layout make_layout(int num_logical, const PlacementShape& shape) {
  EPX_CHECK_ARG(num_logical >= 1, "weight must have >= 1 logical expert per layer, got {}", num_logical);
  EPX_CHECK_ARG(shape.num_gpus >= 1, "num_gpus must be >= 1, got {}", shape.num_gpus);
  EPX_CHECK_ARG(shape.num_nodes >= 1, "num_nodes must be >= 1, got {}", shape.num_nodes);
  EPX_CHECK_ARG(shape.num_groups >= 1, "num_groups must be >= 1, got {}", shape.num_groups);
  EPX_CHECK_ARG(shape.num_physical >= num_logical,
                "num_replicas (physical experts) must be >= the {} logical experts, got {}", num_logical,
                shape.num_physical);
  EPX_CHECK_ARG(shape.num_physical % shape.num_gpus == 0,
                "num_replicas ({}) must be divisible by num_gpus ({}) for equal slots per GPU", shape.num_physical,
                shape.num_gpus);
  EPX_CHECK_ARG(shape.num_gpus % shape.num_nodes == 0, "num_gpus ({}) must be divisible by num_nodes ({})",
                shape.num_gpus, shape.num_nodes);
  Layout lay;
  lay.num_logical = num_logical;
  lay.num_physical = shape.num_physical;
  lay.num_gpus = shape.num_gpus;
  lay.hierarchical = shape.num_groups % shape.num_nodes == 0;
  lay.num_groups = lay.hierarchical ? shape.num_groups : 1;
  lay.num_nodes = lay.hierarchical ? shape.num_nodes : 1;
  if (lay.hierarchical) {
    EPX_CHECK_ARG(num_logical % shape.num_groups == 0,
                  "the {} logical experts must be divisible by num_groups ({}) for the hierarchical policy",
                  num_logical, shape.num_groups);
  }
  lay.gpus_per_node = lay.num_gpus / lay.num_nodes;
  lay.slots_per_gpu = lay.num_physical / lay.num_gpus;
  lay.logical_per_node = num_logical / lay.num_nodes;
  lay.physical_per_node = lay.num_physical / lay.num_nodes;
  lay.group_size = num_logical / lay.num_groups;
  lay.groups_per_node = lay.num_groups / lay.num_nodes;
  EPX_CHECK_ARG(lay.physical_per_node >= lay.logical_per_node,
                "each node needs >= {} physical slots for its logical experts, got {} (num_replicas {} / {} nodes)",
                lay.logical_per_node, lay.physical_per_node, lay.num_physical, lay.num_nodes);
  return lay;
}

void check_weight(const std::vector<std::vector<double>>& weight) {
  EPX_CHECK_ARG(!weight.empty(), "weight must have >= 1 layer, got 0");
  const size_t num_logical = weight[0].size();
  EPX_CHECK_ARG(num_logical >= 1, "weight rows must have >= 1 logical expert, got 0");
  EPX_CHECK_ARG(num_logical <= static_cast<size_t>(std::numeric_limits<int32_t>::max() / 2),
                "weight rows must have <= {} experts, got {}", std::numeric_limits<int32_t>::max() / 2, num_logical);
  for (size_t l = 0; l < weight.size(); ++l) {
    EPX_CHECK_ARG(weight[l].size() == num_logical, "weight is ragged: row {} has {} experts, row 0 has {}", l,
                  weight[l].size(), num_logical);
    for (size_t e = 0; e < num_logical; ++e) {
      const double v = weight[l][e];
      EPX_CHECK_ARG(std::isfinite(v) && v >= 0, "weight[{}][{}] must be finite and >= 0, got {}", l, e, v);
    }
  }
}

void balanced_packing(const double* w, int num_items, int num_packs, int* pack, int* rank_in_pack) {
  const int per_pack = num_items / num_packs;
  if (per_pack == 1) {
    // NOTE: DeepSeek maps item i to pack i at this level; reproduced for exactness.
    for (int i = 0; i < num_items; ++i) {
      pack[i] = i;
      rank_in_pack[i] = 0;
    }
    return;
  }
  std::vector<int> order(num_items);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return w[a] > w[b]; });
  std::vector<double> pack_load(num_packs, 0.0);
  std::vector<int> pack_items(num_packs, 0);
  for (int item : order) {
    int best = -1;
    for (int p = 0; p < num_packs; ++p) {
      if (pack_items[p] < per_pack && (best < 0 || pack_load[p] < pack_load[best])) best = p;
    }
    pack[item] = best;
    rank_in_pack[item] = pack_items[best]++;
    pack_load[best] += w[item];
  }
}

void replicate(const double* w, int num_log, int num_phy, int* phy2log, int* phyrank, int* logcnt) {
  for (int i = 0; i < num_log; ++i) {
    phy2log[i] = i;
    phyrank[i] = 0;
    logcnt[i] = 1;
  }
  for (int i = num_log; i < num_phy; ++i) {
    int best = 0;
    double best_load = w[0] / logcnt[0];
    for (int e = 1; e < num_log; ++e) {
      const double load = w[e] / logcnt[e];
      if (load > best_load) {
        best = e;
        best_load = load;
      }
    }
    phy2log[i] = best;
    phyrank[i] = logcnt[best]++;
  }
}

void deepseek_group_packing(const double* w, const Layout& lay, std::vector<int>& group_node,
                            std::vector<int>& group_rank) {
  std::vector<double> group_load(lay.num_groups, 0.0);
  for (int g = 0; g < lay.num_groups; ++g) {
    for (int j = 0; j < lay.group_size; ++j) group_load[g] += w[g * lay.group_size + j];
  }
  group_node.assign(lay.num_groups, 0);
  group_rank.assign(lay.num_groups, 0);
  balanced_packing(group_load.data(), lay.num_groups, lay.num_nodes, group_node.data(), group_rank.data());
}

void place_layer(const double* w, const Layout& lay, const std::vector<int>& group_node,
                 const std::vector<int>& group_rank, LayerPlacement& out) {
  const int num_log = lay.num_logical;
  std::vector<int> log2mlog(num_log), mlog2log(num_log);
  for (int e = 0; e < num_log; ++e) {
    const int g = e / lay.group_size;
    log2mlog[e] = (group_node[g] * lay.groups_per_node + group_rank[g]) * lay.group_size + e % lay.group_size;
    mlog2log[log2mlog[e]] = e;
  }
  out.phy2log.assign(lay.num_physical, -1);
  out.phyrank.assign(lay.num_physical, 0);
  out.logcnt.assign(num_log, 0);
  const int lpn = lay.logical_per_node, ppn = lay.physical_per_node;
  std::vector<double> node_w(lpn), phy_w(ppn);
  std::vector<int> phy2mlog(ppn), phyrank(ppn), mlogcnt(lpn), pack(ppn), rank(ppn), pphy2phy(ppn);
  for (int n = 0; n < lay.num_nodes; ++n) {
    for (int j = 0; j < lpn; ++j) node_w[j] = w[mlog2log[n * lpn + j]];
    replicate(node_w.data(), lpn, ppn, phy2mlog.data(), phyrank.data(), mlogcnt.data());
    for (int i = 0; i < ppn; ++i) phy_w[i] = node_w[phy2mlog[i]] / mlogcnt[phy2mlog[i]];
    balanced_packing(phy_w.data(), ppn, lay.gpus_per_node, pack.data(), rank.data());
    for (int i = 0; i < ppn; ++i) pphy2phy[pack[i] * lay.slots_per_gpu + rank[i]] = i;
    for (int pp = 0; pp < ppn; ++pp) {
      const int i = pphy2phy[pp];
      out.phy2log[n * ppn + pp] = mlog2log[n * lpn + phy2mlog[i]];
      out.phyrank[n * ppn + pp] = phyrank[i];
    }
    for (int j = 0; j < lpn; ++j) out.logcnt[mlog2log[n * lpn + j]] = mlogcnt[j];
  }
}

void gpu_loads(const double* w, const int32_t* phy2log, const int32_t* logcnt, int num_physical, int slots_per_gpu,
               std::vector<double>& loads) {
  const int num_gpus = num_physical / slots_per_gpu;
  loads.assign(num_gpus, 0.0);
  for (int s = 0; s < num_physical; ++s) loads[s / slots_per_gpu] += w[phy2log[s]] / logcnt[phy2log[s]];
}

double max_gpu_load(const double* w, const int32_t* phy2log, const int32_t* logcnt, int num_physical,
                    int slots_per_gpu) {
  std::vector<double> loads;
  gpu_loads(w, phy2log, logcnt, num_physical, slots_per_gpu, loads);
  return *std::max_element(loads.begin(), loads.end());
}

double layer_balancedness(const double* w, int num_logical, const int32_t* phy2log, int num_physical, int num_gpus) {
  std::vector<int32_t> cnt(num_logical, 0);
  for (int s = 0; s < num_physical; ++s) ++cnt[phy2log[s]];
  std::vector<double> loads(num_gpus, 0.0);
  const int spg = num_physical / num_gpus;
  double total = 0;
  for (int s = 0; s < num_physical; ++s) loads[s / spg] += w[phy2log[s]] / cnt[phy2log[s]];
  double max_load = 0;
  for (double v : loads) {
    total += v;
    max_load = std::max(max_load, v);
  }
  if (max_load <= 0) return 1.0;
  return (total / num_gpus) / max_load;
}

}  // namespace detail

namespace {

using detail::LayerPlacement;
using detail::Layout;

// Pairwise group swaps between the most loaded node and the others, while the pair's max drops.
bool refine_group_packing(const double* w, const Layout& lay, std::vector<int>& group_node,
                          std::vector<int>& group_rank) {
  if (lay.num_nodes < 2 || lay.groups_per_node < 1) return false;
  std::vector<double> group_load(lay.num_groups, 0.0), node_load(lay.num_nodes, 0.0);
  for (int g = 0; g < lay.num_groups; ++g) {
    for (int j = 0; j < lay.group_size; ++j) group_load[g] += w[g * lay.group_size + j];
    node_load[group_node[g]] += group_load[g];
  }
  bool changed = false;
  for (int iter = 0; iter < 4 * lay.num_groups; ++iter) {
    const int a = static_cast<int>(std::max_element(node_load.begin(), node_load.end()) - node_load.begin());
    double best_max = node_load[a];
    int best_ga = -1, best_gb = -1;
    for (int ga = 0; ga < lay.num_groups; ++ga) {
      if (group_node[ga] != a) continue;
      for (int gb = 0; gb < lay.num_groups; ++gb) {
        const int b = group_node[gb];
        if (b == a) continue;
        const double d = group_load[ga] - group_load[gb];
        if (d <= 0) continue;
        const double new_max = std::max(node_load[a] - d, node_load[b] + d);
        if (new_max < best_max) {
          best_max = new_max;
          best_ga = ga;
          best_gb = gb;
        }
      }
    }
    if (best_ga < 0) break;
    const int b = group_node[best_gb];
    const double d = group_load[best_ga] - group_load[best_gb];
    node_load[a] -= d;
    node_load[b] += d;
    std::swap(group_node[best_ga], group_node[best_gb]);
    std::swap(group_rank[best_ga], group_rank[best_gb]);
    changed = true;
  }
  return changed;
}

// A lower bound on a node's max GPU load for a set of groups: its load spread over its GPUs, and the
// largest load per replica after greedy replication inside the node.
double node_cost(const double* w, const Layout& lay, const std::vector<int>& groups, std::vector<double>& scratch,
                 std::vector<int>& cnt) {
  scratch.clear();
  double sum = 0;
  for (int g : groups) {
    for (int j = 0; j < lay.group_size; ++j) {
      scratch.push_back(w[g * lay.group_size + j]);
      sum += scratch.back();
    }
  }
  const int n = static_cast<int>(scratch.size());
  cnt.assign(n, 1);
  // Max-heap replication: the same greedy as replicate(), only the final max matters here.
  std::vector<std::pair<double, int>> heap;
  heap.reserve(n);
  for (int i = 0; i < n; ++i) heap.emplace_back(scratch[i], i);
  std::make_heap(heap.begin(), heap.end());
  for (int k = n; k < lay.physical_per_node; ++k) {
    std::pop_heap(heap.begin(), heap.end());
    auto& top = heap.back();
    ++cnt[top.second];
    top.first = scratch[top.second] / cnt[top.second];
    std::push_heap(heap.begin(), heap.end());
  }
  return std::max(sum / lay.gpus_per_node, heap.front().first);
}

// Group swaps between nodes that lower the largest node_cost (replica pressure included), starting from
// the given packing. Returns true if the packing changed.
bool refine_group_packing_by_cost(const double* w, const Layout& lay, std::vector<int>& group_node,
                                  std::vector<int>& group_rank) {
  if (lay.num_nodes < 2) return false;
  std::vector<std::vector<int>> members(lay.num_nodes);
  for (int g = 0; g < lay.num_groups; ++g) members[group_node[g]].push_back(g);
  std::vector<double> scratch;
  std::vector<int> cnt;
  std::vector<double> cost(lay.num_nodes);
  for (int n = 0; n < lay.num_nodes; ++n) cost[n] = node_cost(w, lay, members[n], scratch, cnt);
  bool changed = false;
  for (int iter = 0; iter < 2 * lay.num_groups; ++iter) {
    const int a = static_cast<int>(std::max_element(cost.begin(), cost.end()) - cost.begin());
    double best = cost[a], best_ca = 0, best_cb = 0;
    int best_i = -1, best_j = -1, best_b = -1;
    for (int b = 0; b < lay.num_nodes; ++b) {
      if (b == a) continue;
      for (size_t i = 0; i < members[a].size(); ++i) {
        for (size_t j = 0; j < members[b].size(); ++j) {
          std::swap(members[a][i], members[b][j]);
          const double ca = node_cost(w, lay, members[a], scratch, cnt);
          const double cb = node_cost(w, lay, members[b], scratch, cnt);
          std::swap(members[a][i], members[b][j]);
          if (std::max(ca, cb) < best) {
            best = std::max(ca, cb);
            best_ca = ca;
            best_cb = cb;
            best_i = static_cast<int>(i);
            best_j = static_cast<int>(j);
            best_b = b;
          }
        }
      }
    }
    if (best_i < 0) break;
    std::swap(members[a][best_i], members[best_b][best_j]);
    cost[a] = best_ca;
    cost[best_b] = best_cb;
    changed = true;
  }
  if (!changed) return false;
  for (int n = 0; n < lay.num_nodes; ++n) {
    for (size_t k = 0; k < members[n].size(); ++k) {
      group_node[members[n][k]] = n;
      group_rank[members[n][k]] = static_cast<int>(k);
    }
  }
  return true;
}

// Swaps replicas between the node's most loaded GPU and its other GPUs while that lowers the pair's max.
void refine_node_swaps(const double* w, const Layout& lay, int node, LayerPlacement& p, std::vector<double>& loads) {
  const int spg = lay.slots_per_gpu;
  const int g0 = node * lay.gpus_per_node, g1 = g0 + lay.gpus_per_node;
  auto replica_load = [&](int s) { return w[p.phy2log[s]] / p.logcnt[p.phy2log[s]]; };
  for (int iter = 0; iter < 16 * lay.physical_per_node; ++iter) {
    int g = g0;
    for (int h = g0 + 1; h < g1; ++h) {
      if (loads[h] > loads[g]) g = h;
    }
    double best_max = loads[g];
    int best_a = -1, best_b = -1;
    for (int a = g * spg; a < (g + 1) * spg; ++a) {
      const double la = replica_load(a);
      for (int h = g0; h < g1; ++h) {
        if (h == g) continue;
        for (int b = h * spg; b < (h + 1) * spg; ++b) {
          const double d = la - replica_load(b);
          if (d <= 0) continue;
          const double new_max = std::max(loads[g] - d, loads[h] + d);
          if (new_max < best_max) {
            best_max = new_max;
            best_a = a;
            best_b = b;
          }
        }
      }
    }
    if (best_a < 0) break;
    const double d = replica_load(best_a) - replica_load(best_b);
    loads[g] -= d;
    loads[best_b / spg] += d;
    std::swap(p.phy2log[best_a], p.phy2log[best_b]);
    std::swap(p.phyrank[best_a], p.phyrank[best_b]);
  }
}

// Replica-count moves inside a node, each followed by swaps; applies the best one if it lowers the node's
// max GPU load. Candidates: (a) the heaviest replica's expert on the max GPU gains a replica from the
// expert that can best spare one; (b) an expert with several replicas on the max GPU gives that slot to
// the node's expert with the largest load per replica (e.g. 9 replicas of a hot expert on 8 GPUs put two
// on one GPU; 8 spread evenly). Replica counts change; slots per GPU and node locality do not.
bool refine_node_moves(const double* w, const Layout& lay, int node, LayerPlacement& p, std::vector<double>& loads) {
  const int spg = lay.slots_per_gpu;
  const int g0 = node * lay.gpus_per_node, g1 = g0 + lay.gpus_per_node;
  const int s0 = node * lay.physical_per_node, s1 = s0 + lay.physical_per_node;
  auto node_max = [&](const std::vector<double>& l) { return *std::max_element(l.begin() + g0, l.begin() + g1); };
  auto per_replica = [&](const LayerPlacement& q, int e) { return w[e] / q.logcnt[e]; };
  int g = g0;
  for (int h = g0 + 1; h < g1; ++h) {
    if (loads[h] > loads[g]) g = h;
  }
  // (slot to convert, expert it becomes)
  std::vector<std::pair<int, int>> moves;
  int hot = p.phy2log[g * spg];
  for (int s = g * spg; s < (g + 1) * spg; ++s) {
    if (per_replica(p, p.phy2log[s]) > per_replica(p, hot)) hot = p.phy2log[s];
  }
  int donor_slot = -1;
  double donor_load = std::numeric_limits<double>::infinity();
  for (int s = s0; s < s1; ++s) {
    const int e = p.phy2log[s];
    if (e == hot || p.logcnt[e] < 2) continue;
    const double after = w[e] / (p.logcnt[e] - 1);
    if (after < donor_load || (after == donor_load && loads[s / spg] < loads[donor_slot / spg])) {
      donor_load = after;
      donor_slot = s;
    }
  }
  if (donor_slot >= 0 && donor_load < per_replica(p, hot)) moves.emplace_back(donor_slot, hot);
  for (int s = g * spg; s < (g + 1) * spg; ++s) {
    const int e = p.phy2log[s];
    int on_gpu = 0;
    for (int t = g * spg; t < (g + 1) * spg; ++t) on_gpu += p.phy2log[t] == e;
    if (on_gpu < 2 || p.logcnt[e] < 2) continue;
    int needy = -1;
    for (int t = s0; t < s1; ++t) {
      const int f = p.phy2log[t];
      if (f != e && (needy < 0 || per_replica(p, f) > per_replica(p, needy))) needy = f;
    }
    if (needy >= 0) moves.emplace_back(s, needy);
  }
  const double before = node_max(loads);
  double best = before;
  LayerPlacement best_p;
  std::vector<double> best_loads;
  for (const auto& [slot, expert] : moves) {
    LayerPlacement trial = p;
    --trial.logcnt[trial.phy2log[slot]];
    ++trial.logcnt[expert];
    trial.phy2log[slot] = expert;
    std::vector<double> trial_loads(loads);
    for (int h = g0; h < g1; ++h) trial_loads[h] = 0;
    for (int t = s0; t < s1; ++t) trial_loads[t / spg] += per_replica(trial, trial.phy2log[t]);
    refine_node_swaps(w, lay, node, trial, trial_loads);
    const double m = node_max(trial_loads);
    if (m < best) {
      best = m;
      best_p = std::move(trial);
      best_loads = std::move(trial_loads);
    }
  }
  if (!(best < before)) return false;
  p = std::move(best_p);
  loads = std::move(best_loads);
  return true;
}

void improve_layer(const double* w, const Layout& lay, LayerPlacement& p) {
  std::vector<double> loads;
  detail::gpu_loads(w, p.phy2log.data(), p.logcnt.data(), lay.num_physical, lay.slots_per_gpu, loads);
  for (int n = 0; n < lay.num_nodes; ++n) refine_node_swaps(w, lay, n, p, loads);
  // Only the node holding the max GPU decides balancedness.
  for (int iter = 0; iter < 4 * lay.slots_per_gpu; ++iter) {
    const int g = static_cast<int>(std::max_element(loads.begin(), loads.end()) - loads.begin());
    if (!refine_node_moves(w, lay, g / lay.gpus_per_node, p, loads)) break;
  }
}

void write_layer(const LayerPlacement& p, int layer, int num_logical, int num_physical, Placement& out) {
  std::copy(p.phy2log.begin(), p.phy2log.end(), out.phy2log.begin() + static_cast<int64_t>(layer) * num_physical);
  std::copy(p.logcnt.begin(), p.logcnt.end(), out.logcnt.begin() + static_cast<int64_t>(layer) * num_logical);
}

}  // namespace

Placement rebalance(const std::vector<std::vector<double>>& weight, const PlacementShape& shape, Policy policy) {
  detail::check_weight(weight);
  const int num_logical = static_cast<int>(weight[0].size());
  const Layout lay = detail::make_layout(num_logical, shape);
  const int num_layers = static_cast<int>(weight.size());

  Placement out;
  out.num_layers = num_layers;
  out.num_logical = num_logical;
  out.num_physical = lay.num_physical;
  out.hierarchical = lay.hierarchical;
  out.phy2log.assign(static_cast<size_t>(num_layers) * lay.num_physical, -1);
  out.logcnt.assign(static_cast<size_t>(num_layers) * num_logical, 0);
  std::vector<int32_t> phyrank(out.phy2log.size(), 0);

  std::vector<int> group_node, group_rank;
  LayerPlacement ds, cand;
  for (int l = 0; l < num_layers; ++l) {
    const double* w = weight[l].data();
    detail::deepseek_group_packing(w, lay, group_node, group_rank);
    detail::place_layer(w, lay, group_node, group_rank, ds);
    const LayerPlacement* chosen = &ds;
    if (policy == Policy::kDefault) {
      const double ds_max =
          detail::max_gpu_load(w, ds.phy2log.data(), ds.logcnt.data(), lay.num_physical, lay.slots_per_gpu);
      double best_max = ds_max;
      LayerPlacement best;
      cand = ds;
      improve_layer(w, lay, cand);
      double m = detail::max_gpu_load(w, cand.phy2log.data(), cand.logcnt.data(), lay.num_physical, lay.slots_per_gpu);
      if (m < best_max) {
        best_max = m;
        best = cand;
      }
      // Other group -> node packings: by node sums, and by node cost (sums and replica pressure).
      std::vector<int> cost_node = group_node, cost_rank = group_rank;
      for (int variant = 0; variant < 2; ++variant) {
        const bool changed = variant == 0 ? refine_group_packing(w, lay, group_node, group_rank)
                                          : refine_group_packing_by_cost(w, lay, cost_node, cost_rank);
        if (!changed) continue;
        detail::place_layer(w, lay, variant == 0 ? group_node : cost_node, variant == 0 ? group_rank : cost_rank, cand);
        improve_layer(w, lay, cand);
        m = detail::max_gpu_load(w, cand.phy2log.data(), cand.logcnt.data(), lay.num_physical, lay.slots_per_gpu);
        if (m < best_max) {
          best_max = m;
          best = cand;
        }
      }
      if (best_max < ds_max) {
        ds = std::move(best);
        chosen = &ds;
      }
    }
    write_layer(*chosen, l, num_logical, lay.num_physical, out);
    std::copy(chosen->phyrank.begin(), chosen->phyrank.end(),
              phyrank.begin() + static_cast<int64_t>(l) * lay.num_physical);
  }

  if (policy == Policy::kDefault) {
    Placement derived = placement_from_phy2log(out.phy2log, num_layers, num_logical, lay.num_physical);
    derived.hierarchical = lay.hierarchical;
    return derived;
  }
  out.max_replicas = *std::max_element(out.logcnt.begin(), out.logcnt.end());
  out.log2phy.assign(static_cast<size_t>(num_layers) * num_logical * out.max_replicas, -1);
  for (int l = 0; l < num_layers; ++l) {
    for (int s = 0; s < lay.num_physical; ++s) {
      const int64_t i = static_cast<int64_t>(l) * lay.num_physical + s;
      out.log2phy[(static_cast<int64_t>(l) * num_logical + out.phy2log[i]) * out.max_replicas + phyrank[i]] = s;
    }
  }
  return out;
}

Placement placement_from_phy2log(const std::vector<int32_t>& phy2log, int num_layers, int num_logical,
                                 int num_physical) {
  EPX_CHECK_ARG(num_layers >= 1 && num_logical >= 1 && num_physical >= 1,
                "num_layers, num_logical and num_physical must be >= 1, got {}, {}, {}", num_layers, num_logical,
                num_physical);
  EPX_CHECK_ARG(phy2log.size() == static_cast<size_t>(num_layers) * num_physical,
                "phy2log must have num_layers * num_physical = {} entries, got {}",
                static_cast<int64_t>(num_layers) * num_physical, phy2log.size());
  Placement out;
  out.num_layers = num_layers;
  out.num_logical = num_logical;
  out.num_physical = num_physical;
  out.phy2log = phy2log;
  out.logcnt.assign(static_cast<size_t>(num_layers) * num_logical, 0);
  for (int l = 0; l < num_layers; ++l) {
    for (int s = 0; s < num_physical; ++s) {
      const int32_t e = phy2log[static_cast<int64_t>(l) * num_physical + s];
      EPX_CHECK_ARG(e >= 0 && e < num_logical, "phy2log[{}][{}] must be in [0, {}), got {}", l, s, num_logical, e);
      ++out.logcnt[static_cast<int64_t>(l) * num_logical + e];
    }
    for (int e = 0; e < num_logical; ++e) {
      EPX_CHECK_ARG(out.logcnt[static_cast<int64_t>(l) * num_logical + e] >= 1,
                    "logical expert {} has no replica in layer {} (every expert needs >= 1)", e, l);
    }
  }
  out.max_replicas = *std::max_element(out.logcnt.begin(), out.logcnt.end());
  out.log2phy.assign(static_cast<size_t>(num_layers) * num_logical * out.max_replicas, -1);
  std::vector<int32_t> filled(num_logical);
  for (int l = 0; l < num_layers; ++l) {
    std::fill(filled.begin(), filled.end(), 0);
    for (int s = 0; s < num_physical; ++s) {
      const int32_t e = phy2log[static_cast<int64_t>(l) * num_physical + s];
      out.log2phy[(static_cast<int64_t>(l) * num_logical + e) * out.max_replicas + filled[e]++] = s;
    }
  }
  return out;
}

std::vector<double> balancedness_per_layer(const std::vector<std::vector<double>>& weight,
                                           const std::vector<int32_t>& phy2log, int num_physical, int num_gpus) {
  detail::check_weight(weight);
  const int num_layers = static_cast<int>(weight.size());
  const int num_logical = static_cast<int>(weight[0].size());
  EPX_CHECK_ARG(num_gpus >= 1 && num_physical >= 1 && num_physical % num_gpus == 0,
                "num_physical ({}) must be a positive multiple of num_gpus ({})", num_physical, num_gpus);
  const Placement p = placement_from_phy2log(phy2log, num_layers, num_logical, num_physical);
  std::vector<double> out(num_layers);
  for (int l = 0; l < num_layers; ++l) {
    out[l] =
        detail::layer_balancedness(weight[l].data(), num_logical,
                                   p.phy2log.data() + static_cast<int64_t>(l) * num_physical, num_physical, num_gpus);
  }
  return out;
}

double balancedness(const std::vector<std::vector<double>>& weight, const std::vector<int32_t>& phy2log,
                    int num_physical, int num_gpus) {
  const auto per_layer = balancedness_per_layer(weight, phy2log, num_physical, num_gpus);
  return std::accumulate(per_layer.begin(), per_layer.end(), 0.0) / per_layer.size();
}

int64_t count_moved_experts(const std::vector<int32_t>& old_phy2log, const std::vector<int32_t>& new_phy2log) {
  EPX_CHECK_ARG(old_phy2log.size() == new_phy2log.size(), "old and new phy2log must have the same size, got {} and {}",
                old_phy2log.size(), new_phy2log.size());
  int64_t moved = 0;
  for (size_t i = 0; i < old_phy2log.size(); ++i) moved += old_phy2log[i] != new_phy2log[i];
  return moved;
}

std::vector<int32_t> trivial_phy2log(int num_layers, int num_logical, int num_physical) {
  EPX_CHECK_ARG(num_layers >= 1 && num_logical >= 1 && num_physical >= num_logical,
                "need num_layers >= 1, num_logical >= 1 and num_physical >= num_logical, got {}, {}, {}", num_layers,
                num_logical, num_physical);
  std::vector<int32_t> out(static_cast<size_t>(num_layers) * num_physical);
  for (int l = 0; l < num_layers; ++l) {
    for (int s = 0; s < num_physical; ++s) out[static_cast<int64_t>(l) * num_physical + s] = s % num_logical;
  }
  return out;
}

}  // namespace epx::eplb
