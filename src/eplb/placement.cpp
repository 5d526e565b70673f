// The placement entry points (placement.h): the layout, the hierarchical (kDeepSeek) policy's steps, the
// balancedness and log2phy. The default policy's refinement is in placement_default.cpp.
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
  // Packs with room, lightest on top, the lowest index on ties: DeepSeek's linear scan, in O(log packs).
  std::vector<std::pair<double, int>> heap(num_packs);
  for (int p = 0; p < num_packs; ++p) heap[p] = {0.0, p};
  const auto heavier = [](const std::pair<double, int>& x, const std::pair<double, int>& y) {
    return x.first > y.first || (x.first == y.first && x.second > y.second);
  };
  for (int item : order) {
    std::pop_heap(heap.begin(), heap.end(), heavier);
    const int best = heap.back().second;
    pack[item] = best;
    rank_in_pack[item] = pack_items[best]++;
    pack_load[best] += w[item];
    if (pack_items[best] < per_pack) {
      heap.back().first = pack_load[best];
      std::push_heap(heap.begin(), heap.end(), heavier);
    } else {
      heap.pop_back();
    }
  }
}

void replicate(const double* w, int num_log, int num_phy, int* phy2log, int* phyrank, int* logcnt) {
  for (int i = 0; i < num_log; ++i) {
    phy2log[i] = i;
    phyrank[i] = 0;
    logcnt[i] = 1;
  }
  if (num_phy == num_log) return;
  // The expert with the largest load per replica on top, the lowest index on ties: DeepSeek's linear scan.
  std::vector<std::pair<double, int>> heap(num_log);
  for (int e = 0; e < num_log; ++e) heap[e] = {w[e], e};
  const auto lighter = [](const std::pair<double, int>& x, const std::pair<double, int>& y) {
    return x.first < y.first || (x.first == y.first && x.second > y.second);
  };
  std::make_heap(heap.begin(), heap.end(), lighter);
  for (int i = num_log; i < num_phy; ++i) {
    std::pop_heap(heap.begin(), heap.end(), lighter);
    const int best = heap.back().second;
    phy2log[i] = best;
    phyrank[i] = logcnt[best]++;
    heap.back().first = w[best] / logcnt[best];
    std::push_heap(heap.begin(), heap.end(), lighter);
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

void write_layer(const detail::LayerPlacement& p, int layer, int num_logical, int num_physical, Placement& out) {
  std::copy(p.phy2log.begin(), p.phy2log.end(), out.phy2log.begin() + static_cast<int64_t>(layer) * num_physical);
  std::copy(p.logcnt.begin(), p.logcnt.end(), out.logcnt.begin() + static_cast<int64_t>(layer) * num_logical);
}

}  // namespace

namespace detail {

UnmappedPlacement rebalance_unmapped(const std::vector<std::vector<double>>& weight, const PlacementShape& shape,
                                     Policy policy) {
  check_weight(weight);
  const int num_logical = static_cast<int>(weight[0].size());
  const Layout lay = make_layout(num_logical, shape);
  const int num_layers = static_cast<int>(weight.size());

  UnmappedPlacement out;
  Placement& p = out.placement;
  p.num_layers = num_layers;
  p.num_logical = num_logical;
  p.num_physical = lay.num_physical;
  p.hierarchical = lay.hierarchical;
  p.phy2log.assign(epx::detail::checked_mul(num_layers, lay.num_physical, "num_layers * num_physical (phy2log)"), -1);
  p.logcnt.assign(epx::detail::checked_mul(num_layers, num_logical, "num_layers * num_logical (logcnt)"), 0);
  // kDefault lists replicas in slot order (out.phyrank stays empty), kDeepSeek in creation order.
  if (policy == Policy::kDeepSeek) out.phyrank.assign(p.phy2log.size(), 0);

  std::vector<int> group_node, group_rank;
  LayerPlacement layer;
  for (int l = 0; l < num_layers; ++l) {
    const double* w = weight[l].data();
    if (policy == Policy::kDefault) {
      RefineBudget budget{refine_work_limit(lay)};
      place_layer_default(w, lay, layer, budget);
    } else {
      deepseek_group_packing(w, lay, group_node, group_rank);
      place_layer(w, lay, group_node, group_rank, layer);
      std::copy(layer.phyrank.begin(), layer.phyrank.end(),
                out.phyrank.begin() + static_cast<int64_t>(l) * lay.num_physical);
    }
    write_layer(layer, l, num_logical, lay.num_physical, p);
  }
  p.max_replicas = *std::max_element(p.logcnt.begin(), p.logcnt.end());
  return out;
}

Placement placement_from_phy2log_unmapped(const std::vector<int32_t>& phy2log, int num_layers, int num_logical,
                                          int num_physical) {
  EPX_CHECK_ARG(num_layers >= 1 && num_logical >= 1 && num_physical >= 1,
                "num_layers, num_logical and num_physical must be >= 1, got {}, {}, {}", num_layers, num_logical,
                num_physical);
  const int64_t num_slots = epx::detail::checked_mul(num_layers, num_physical, "num_layers * num_physical");
  EPX_CHECK_ARG(phy2log.size() == static_cast<size_t>(num_slots),
                "phy2log must have num_layers * num_physical = {} entries, got {}", num_slots, phy2log.size());
  Placement out;
  out.num_layers = num_layers;
  out.num_logical = num_logical;
  out.num_physical = num_physical;
  out.phy2log = phy2log;
  out.logcnt.assign(epx::detail::checked_mul(num_layers, num_logical, "num_layers * num_logical (logcnt)"), 0);
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
  return out;
}

void build_log2phy(Placement& p, const std::vector<int32_t>& phyrank) {
  const int num_logical = p.num_logical, num_physical = p.num_physical;
  p.log2phy.assign(epx::detail::checked_mul(static_cast<int64_t>(p.logcnt.size()), p.max_replicas,
                                            "num_layers * num_logical * max_replicas (log2phy)"),
                   -1);
  std::vector<int32_t> filled(phyrank.empty() ? num_logical : 0);
  for (int l = 0; l < p.num_layers; ++l) {
    std::fill(filled.begin(), filled.end(), 0);
    for (int s = 0; s < num_physical; ++s) {
      const int64_t i = static_cast<int64_t>(l) * num_physical + s;
      const int32_t e = p.phy2log[i];
      const int32_t rank = phyrank.empty() ? filled[e]++ : phyrank[i];
      p.log2phy[(static_cast<int64_t>(l) * num_logical + e) * p.max_replicas + rank] = s;
    }
  }
}

}  // namespace detail

Placement rebalance(const std::vector<std::vector<double>>& weight, const PlacementShape& shape, Policy policy) {
  detail::UnmappedPlacement out = detail::rebalance_unmapped(weight, shape, policy);
  detail::build_log2phy(out.placement, out.phyrank);
  return std::move(out.placement);
}

Placement placement_from_phy2log(const std::vector<int32_t>& phy2log, int num_layers, int num_logical,
                                 int num_physical) {
  Placement out = detail::placement_from_phy2log_unmapped(phy2log, num_layers, num_logical, num_physical);
  detail::build_log2phy(out);
  return out;
}

std::vector<double> balancedness_per_layer(const std::vector<std::vector<double>>& weight,
                                           const std::vector<int32_t>& phy2log, int num_physical, int num_gpus) {
  detail::check_weight(weight);
  const int num_layers = static_cast<int>(weight.size());
  const int num_logical = static_cast<int>(weight[0].size());
  EPX_CHECK_ARG(num_gpus >= 1 && num_physical >= 1 && num_physical % num_gpus == 0,
                "num_physical ({}) must be a positive multiple of num_gpus ({})", num_physical, num_gpus);
  const Placement p = detail::placement_from_phy2log_unmapped(phy2log, num_layers, num_logical, num_physical);
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
  std::vector<int32_t> out(epx::detail::checked_mul(num_layers, num_physical, "num_layers * num_physical (phy2log)"));
  for (int l = 0; l < num_layers; ++l) {
    for (int s = 0; s < num_physical; ++s) out[static_cast<int64_t>(l) * num_physical + s] = s % num_logical;
  }
  return out;
}

}  // namespace epx::eplb
