// The default policy (Policy::kDefault): kDeepSeek's placement of a layer, then a refinement within a work
// budget (RefineBudget): pairwise swaps of groups between nodes (by node load, and by node cost), and swaps and
// replica moves of slots between the GPUs of a node. The hierarchical (kDeepSeek) building blocks it starts
// from, the layout and the public entry points are in placement.cpp.
#include <algorithm>
#include <limits>
#include <set>
#include <utility>
#include <vector>

#include "core/check.h"
#include "eplb/placement_detail.h"

namespace epx::eplb {
namespace {

using detail::ceil_log2;
using detail::LayerPlacement;
using detail::Layout;
using detail::RefineBudget;

// The best-swap search between the most loaded bin and the others: items (slots of a node's GPUs, or
// groups of nodes) in equal bins, each bin sorted by (value, id), the bins ordered by load. Bin b holds
// entries [b * per_bin, (b + 1) * per_bin); its load is load[b], owned by the caller and updated here.
class SwapSearch {
 public:
  struct Entry {
    double value;
    int id;
    bool operator<(const Entry& o) const { return value < o.value || (value == o.value && id < o.id); }
  };
  struct Swap {
    double new_max = 0;
    int a = -1, b = -1;  // item ids: a from the loaded bin, b from the other
  };

  // Units to build it: the sorts of the bins and of their loads.
  static int64_t build_units(int num_bins, int per_bin) {
    return static_cast<int64_t>(num_bins) * (int64_t{per_bin} * (1 + ceil_log2(per_bin)) + 1 + ceil_log2(num_bins));
  }
  // entries: [num_bins * per_bin], bin by bin, in any order inside a bin.
  SwapSearch(std::vector<Entry> entries, int num_bins, int per_bin, double* load)
      : entries_(std::move(entries)), per_bin_(per_bin), load_(load) {
    for (int b = 0; b < num_bins; ++b) {
      std::sort(entries_.begin() + static_cast<int64_t>(b) * per_bin,
                entries_.begin() + static_cast<int64_t>(b + 1) * per_bin);
      by_load_.emplace(load[b], b);
    }
    probe_units_ = 1 + ceil_log2(per_bin);
  }

  // The most loaded bin, the lowest index on ties.
  int max_bin() const { return by_load_.lower_bound({by_load_.rbegin()->first, -1})->second; }

  // The swap of an item of bin g with an item of another bin that lowers their max the most: minimizes
  // max(load[g] - d, load[h] + d) over d = value(a) - value(b) > 0, keeping it below load[g]; ties go to
  // the lowest (a, b) ids, the pair a scan of all pairs in id order picks. Bins are visited lightest
  // first and the visit stops where (load[g] + load[h]) / 2, a lower bound of the new max, exceeds the
  // best found. Per bin, the best b is next to the point where load[g] - d meets load[h] + d, found by
  // binary search: both sides are monotone in value(b), also in floating point. Items of g with equal
  // values are probed once (the lowest id wins their ties). Each probe (an item of g against a bin) costs
  // 1 + log2(per_bin) units; returns false, with no swap, when the budget runs out.
  // NOTE: of a run of distinct values whose new max rounds to the same double, only the run's end next
  // to the crossing point is taken (a scan would take the lowest id of the run); the max is the same.
  bool best_swap(int g, RefineBudget& budget, Swap& best) const {
    const double lg = load_[g];
    best = {lg, -1, -1};
    auto better = [&](double new_max, int a, int b) {
      if (new_max != best.new_max) return new_max < best.new_max;
      return best.a >= 0 && (a < best.a || (a == best.a && b < best.b));
    };
    for (const auto& bin : by_load_) {
      const double lh = bin.first;
      const int h = bin.second;
      if (lh >= lg) break;  // no d > 0 lowers the max of g and a bin as loaded
      if ((lg + lh) * 0.5 * (1 - 1e-15) > best.new_max) break;
      if (h == g) continue;
      const Entry* first = begin(h);
      for (const Entry* ea = begin(g); ea != end(g); ++ea) {
        if (ea != begin(g) && ea[-1].value == ea->value) continue;
        if (!budget.spend(probe_units_)) {
          best = {lg, -1, -1};
          return false;
        }
        const double la = ea->value;
        // Only value(b) < la gives d > 0.
        const Entry* last = std::lower_bound(first, end(h), Entry{la, -1});
        if (first == last) continue;
        const auto new_max = [&](double lb) {
          const double d = la - lb;
          return std::max(lg - d, lh + d);
        };
        const Entry* k = std::partition_point(
            first, last, [&](const Entry& e) { return lg - (la - e.value) < lh + (la - e.value); });
        if (k != last) {
          const double m = new_max(k->value);  // k starts its run of equal values: the lowest id of them
          if (better(m, ea->id, k->id)) best = {m, ea->id, k->id};
        }
        if (k != first) {
          const Entry* run = std::lower_bound(first, k, Entry{(k - 1)->value, -1});
          const double m = new_max(run->value);
          if (better(m, ea->id, run->id)) best = {m, ea->id, run->id};
        }
      }
    }
    return true;
  }

  // Applies a swap: bin g's entry a_from becomes a_to, bin h's b_from becomes b_to, d moves from g to h.
  void apply(int g, int h, Entry a_from, Entry a_to, Entry b_from, Entry b_to, double d) {
    replace(g, a_from, a_to);
    replace(h, b_from, b_to);
    by_load_.erase({load_[g], g});
    by_load_.erase({load_[h], h});
    load_[g] -= d;
    load_[h] += d;
    by_load_.emplace(load_[g], g);
    by_load_.emplace(load_[h], h);
  }

 private:
  const Entry* begin(int b) const { return entries_.data() + static_cast<int64_t>(b) * per_bin_; }
  const Entry* end(int b) const { return begin(b) + per_bin_; }
  // Replaces the entry `from` of bin b by `to`, keeping the bin sorted. O(per_bin) moves.
  void replace(int b, Entry from, Entry to) {
    Entry* first = entries_.data() + static_cast<int64_t>(b) * per_bin_;
    Entry* last = first + per_bin_;
    Entry* pos = std::lower_bound(first, last, from);
    if (to < from) {
      Entry* dst = std::lower_bound(first, pos, to);
      std::move_backward(dst, pos, pos + 1);
      *dst = to;
    } else {
      Entry* dst = std::lower_bound(pos + 1, last, to);
      std::move(pos + 1, dst, pos);
      *(dst - 1) = to;
    }
  }

  std::vector<Entry> entries_;
  int per_bin_;
  double* load_;
  std::set<std::pair<double, int>> by_load_;
  int64_t probe_units_ = 1;
};

// Pairwise group swaps between the most loaded node and the others, while the pair's max drops.
bool refine_group_packing(const double* w, const Layout& lay, std::vector<int>& group_node,
                          std::vector<int>& group_rank, RefineBudget& budget) {
  if (lay.num_nodes < 2 || lay.groups_per_node < 1) return false;
  std::vector<double> group_load(lay.num_groups, 0.0), node_load(lay.num_nodes, 0.0);
  for (int g = 0; g < lay.num_groups; ++g) {
    for (int j = 0; j < lay.group_size; ++j) group_load[g] += w[g * lay.group_size + j];
    node_load[group_node[g]] += group_load[g];
  }
  if (!budget.spend(SwapSearch::build_units(lay.num_nodes, lay.groups_per_node))) return false;
  std::vector<SwapSearch::Entry> entries(lay.num_groups);
  for (int g = 0; g < lay.num_groups; ++g) {
    entries[group_node[g] * lay.groups_per_node + group_rank[g]] = {group_load[g], g};
  }
  SwapSearch search(std::move(entries), lay.num_nodes, lay.groups_per_node, node_load.data());
  bool changed = false;
  SwapSearch::Swap best;
  for (int64_t iter = 0; iter < int64_t{4} * lay.num_groups; ++iter) {
    const int a = search.max_bin();
    if (!search.best_swap(a, budget, best) || best.a < 0) break;
    const int b = group_node[best.b];
    const double la = group_load[best.a], lb = group_load[best.b];
    search.apply(a, b, {la, best.a}, {lb, best.b}, {lb, best.b}, {la, best.a}, la - lb);
    std::swap(group_node[best.a], group_node[best.b]);
    std::swap(group_rank[best.a], group_rank[best.b]);
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
// the given packing. A node_cost costs logical_per_node + (physical_per_node - logical_per_node) x
// (1 + log2(logical_per_node)) units (its heap), a pair two of them. Returns true if the packing changed.
bool refine_group_packing_by_cost(const double* w, const Layout& lay, std::vector<int>& group_node,
                                  std::vector<int>& group_rank, RefineBudget& budget) {
  if (lay.num_nodes < 2) return false;
  const int64_t cost_units = lay.logical_per_node + static_cast<int64_t>(lay.physical_per_node - lay.logical_per_node) *
                                                        (1 + ceil_log2(lay.logical_per_node));
  const int64_t pair_units = 2 * cost_units;
  if (!budget.spend(lay.num_nodes * cost_units)) return false;
  std::vector<std::vector<int>> members(lay.num_nodes);
  for (int g = 0; g < lay.num_groups; ++g) members[group_node[g]].push_back(g);
  std::vector<double> scratch;
  std::vector<int> cnt;
  std::vector<double> cost(lay.num_nodes);
  for (int n = 0; n < lay.num_nodes; ++n) cost[n] = node_cost(w, lay, members[n], scratch, cnt);
  bool changed = false, out_of_budget = false;
  for (int64_t iter = 0; iter < int64_t{2} * lay.num_groups && !out_of_budget; ++iter) {
    const int a = static_cast<int>(std::max_element(cost.begin(), cost.end()) - cost.begin());
    double best = cost[a], best_ca = 0, best_cb = 0;
    int best_i = -1, best_j = -1, best_b = -1;
    for (int b = 0; b < lay.num_nodes && !out_of_budget; ++b) {
      if (b == a) continue;
      for (size_t i = 0; i < members[a].size() && !out_of_budget; ++i) {
        for (size_t j = 0; j < members[b].size(); ++j) {
          if (!budget.spend(pair_units)) {
            out_of_budget = true;  // the best swap seen so far still lowers the max: taken below
            break;
          }
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

// One layer's refinement state: the placement, its GPU loads, the budget and scratch space.
struct Refiner {
  const double* w;
  const Layout& lay;
  RefineBudget& budget;
  LayerPlacement& p;
  std::vector<double> loads;                     // [num_gpus]
  std::vector<int> on_gpu;                       // [num_logical], zero between uses
  std::vector<std::pair<int, int>> swaps, best;  // slot pairs swapped by a trial, in order

  double replica_load(int s) const { return w[p.phy2log[s]] / p.logcnt[p.phy2log[s]]; }
  double node_max(int node) const {
    const auto first = loads.begin() + static_cast<int64_t>(node) * lay.gpus_per_node;
    return *std::max_element(first, first + lay.gpus_per_node);
  }
  int max_gpu(int node) const {
    int g = node * lay.gpus_per_node;
    for (int h = g + 1; h < (node + 1) * lay.gpus_per_node; ++h) {
      if (loads[h] > loads[g]) g = h;
    }
    return g;
  }
  void swap_slots(int a, int b) {
    std::swap(p.phy2log[a], p.phy2log[b]);
    std::swap(p.phyrank[a], p.phyrank[b]);
  }

  // Swaps replicas between the node's most loaded GPU and its other GPUs while that lowers the pair's max
  // (best_swap), at most 16 x slots per node times; appends the swaps to `log` when given.
  void refine_node_swaps(int node, std::vector<std::pair<int, int>>* log) {
    const int spg = lay.slots_per_gpu, gpn = lay.gpus_per_node, ppn = lay.physical_per_node;
    if (gpn < 2 || !budget.spend(SwapSearch::build_units(gpn, spg))) return;
    const int g0 = node * gpn, s0 = node * ppn;
    std::vector<SwapSearch::Entry> entries(ppn);
    for (int i = 0; i < ppn; ++i) entries[i] = {replica_load(s0 + i), s0 + i};
    SwapSearch search(std::move(entries), gpn, spg, loads.data() + g0);
    SwapSearch::Swap s;
    for (int64_t iter = 0; iter < int64_t{16} * ppn; ++iter) {
      const int g = search.max_bin();
      if (!search.best_swap(g, budget, s) || s.a < 0) break;
      const double la = replica_load(s.a), lb = replica_load(s.b);
      search.apply(g, s.b / spg - g0, {la, s.a}, {lb, s.a}, {lb, s.b}, {la, s.b}, la - lb);
      swap_slots(s.a, s.b);
      if (log != nullptr) log->emplace_back(s.a, s.b);
    }
  }

  // Re-sums the node's GPU loads, in slot order.
  void sum_node_loads(int node) {
    const int spg = lay.slots_per_gpu, g0 = node * lay.gpus_per_node, s0 = node * lay.physical_per_node;
    std::fill(loads.begin() + g0, loads.begin() + g0 + lay.gpus_per_node, 0.0);
    for (int t = s0; t < s0 + lay.physical_per_node; ++t) loads[t / spg] += replica_load(t);
  }

  // Replica-count moves inside a node, each followed by swaps; applies the best one if it lowers the node's
  // max GPU load. Candidates: (a) the heaviest replica's expert on the max GPU gains a replica from the
  // expert that can best spare one; (b) an expert with several replicas on the max GPU gives one of those
  // slots to the node's expert with the largest load per replica (e.g. 9 replicas of a hot expert on 8 GPUs
  // put two on one GPU; 8 spread evenly). Replica counts change; slots per GPU and node locality do not.
  // Trials run in place and are undone from their swap log.
  bool refine_node_moves(int node) {
    const int spg = lay.slots_per_gpu, gpn = lay.gpus_per_node, ppn = lay.physical_per_node;
    // NOTE: one GPU per node: moves cannot change its load (the node's experts' total).
    if (gpn < 2 || !budget.spend(ppn)) return false;
    const int g0 = node * gpn, s0 = node * ppn, s1 = s0 + ppn;
    const int g = max_gpu(node);
    auto per_replica = [&](int e) { return w[e] / p.logcnt[e]; };
    // (slot to convert, expert it becomes)
    std::vector<std::pair<int, int>> moves;
    int hot = p.phy2log[g * spg];
    for (int s = g * spg; s < (g + 1) * spg; ++s) {
      if (per_replica(p.phy2log[s]) > per_replica(hot)) hot = p.phy2log[s];
    }
    int donor_slot = -1;
    double donor_load = std::numeric_limits<double>::infinity();
    // The node's two experts with the largest load per replica, the first in slot order on ties.
    int needy1 = -1, needy2 = -1;
    for (int s = s0; s < s1; ++s) {
      const int e = p.phy2log[s];
      if (needy1 < 0 || per_replica(e) > per_replica(needy1)) {
        if (e != needy1) needy2 = needy1;
        needy1 = e;
      } else if (e != needy1 && (needy2 < 0 || per_replica(e) > per_replica(needy2))) {
        needy2 = e;
      }
      if (e == hot || p.logcnt[e] < 2) continue;
      const double after = w[e] / (p.logcnt[e] - 1);
      if (after < donor_load || (after == donor_load && loads[s / spg] < loads[donor_slot / spg])) {
        donor_load = after;
        donor_slot = s;
      }
    }
    if (donor_slot >= 0 && donor_load < per_replica(hot)) moves.emplace_back(donor_slot, hot);
    for (int s = g * spg; s < (g + 1) * spg; ++s) ++on_gpu[p.phy2log[s]];
    for (int s = g * spg; s < (g + 1) * spg; ++s) {
      const int e = p.phy2log[s];
      // NOTE: every slot of such an expert is a candidate, as in the exhaustive version: trials from its
      // other slots give the same loads but their swaps can break ties differently.
      if (on_gpu[e] >= 2 && p.logcnt[e] >= 2) {
        const int needy = e != needy1 ? needy1 : needy2;
        if (needy >= 0) moves.emplace_back(s, needy);
      }
    }
    for (int s = g * spg; s < (g + 1) * spg; ++s) on_gpu[p.phy2log[s]] = 0;

    const double before = node_max(node);
    double best_max = before;
    int best_move = -1;
    std::vector<double> saved(loads.begin() + g0, loads.begin() + g0 + gpn), best_loads;
    for (size_t k = 0; k < moves.size(); ++k) {
      if (!budget.spend(ppn)) break;
      const auto [slot, expert] = moves[k];
      const int from = p.phy2log[slot];
      --p.logcnt[from];
      ++p.logcnt[expert];
      p.phy2log[slot] = expert;
      sum_node_loads(node);
      swaps.clear();
      refine_node_swaps(node, &swaps);
      const double m = node_max(node);
      if (m < best_max) {
        best_max = m;
        best_move = static_cast<int>(k);
        best = swaps;
        best_loads.assign(loads.begin() + g0, loads.begin() + g0 + gpn);
      }
      // Undo: swaps in reverse, then the move.
      for (auto it = swaps.rbegin(); it != swaps.rend(); ++it) swap_slots(it->first, it->second);
      p.phy2log[slot] = from;
      --p.logcnt[expert];
      ++p.logcnt[from];
      std::copy(saved.begin(), saved.end(), loads.begin() + g0);
    }
    if (best_move < 0) return false;
    const auto [slot, expert] = moves[best_move];
    --p.logcnt[p.phy2log[slot]];
    ++p.logcnt[expert];
    p.phy2log[slot] = expert;
    for (const auto& [a, b] : best) swap_slots(a, b);
    std::copy(best_loads.begin(), best_loads.end(), loads.begin() + g0);
    return true;
  }

  void improve() {
    detail::gpu_loads(w, p.phy2log.data(), p.logcnt.data(), lay.num_physical, lay.slots_per_gpu, loads);
    on_gpu.assign(lay.num_logical, 0);
    for (int n = 0; n < lay.num_nodes; ++n) refine_node_swaps(n, nullptr);
    // Only the node holding the max GPU decides balancedness.
    for (int64_t iter = 0; iter < int64_t{4} * lay.slots_per_gpu; ++iter) {
      const int g = static_cast<int>(std::max_element(loads.begin(), loads.end()) - loads.begin());
      if (!refine_node_moves(g / lay.gpus_per_node)) break;
    }
  }
};

void improve_layer(const double* w, const Layout& lay, LayerPlacement& p, RefineBudget& budget) {
  Refiner r{w, lay, budget, p, {}, {}, {}, {}};
  r.improve();
}

}  // namespace

namespace detail {

int64_t refine_work_limit(const Layout& lay) {
  const int64_t n = static_cast<int64_t>(lay.num_physical) + lay.num_logical;
  const int64_t per_item = kRefineUnitsPerItem * ceil_log2(n);
  return epx::detail::checked_add(
      epx::detail::checked_mul(n, per_item, "refine work limit: (num_physical + num_logical) * units per item"),
      kRefineUnitsFloor, "refine work limit");
}

void place_layer_default(const double* w, const Layout& lay, LayerPlacement& out, RefineBudget& budget) {
  std::vector<int> group_node, group_rank;
  deepseek_group_packing(w, lay, group_node, group_rank);
  place_layer(w, lay, group_node, group_rank, out);
  const double ds_max = max_gpu_load(w, out.phy2log.data(), out.logcnt.data(), lay.num_physical, lay.slots_per_gpu);
  double best_max = ds_max;
  LayerPlacement best, cand = out;
  improve_layer(w, lay, cand, budget);
  double m = max_gpu_load(w, cand.phy2log.data(), cand.logcnt.data(), lay.num_physical, lay.slots_per_gpu);
  if (m < best_max) {
    best_max = m;
    best = cand;
  }
  // Other group -> node packings: by node sums, and by node cost (sums and replica pressure).
  std::vector<int> cost_node = group_node, cost_rank = group_rank;
  for (int variant = 0; variant < 2; ++variant) {
    const bool changed = variant == 0 ? refine_group_packing(w, lay, group_node, group_rank, budget)
                                      : refine_group_packing_by_cost(w, lay, cost_node, cost_rank, budget);
    if (!changed) continue;
    place_layer(w, lay, variant == 0 ? group_node : cost_node, variant == 0 ? group_rank : cost_rank, cand);
    improve_layer(w, lay, cand, budget);
    m = max_gpu_load(w, cand.phy2log.data(), cand.logcnt.data(), lay.num_physical, lay.slots_per_gpu);
    if (m < best_max) {
      best_max = m;
      best = cand;
    }
  }
  if (best_max < ds_max) out = std::move(best);
}

}  // namespace detail

}  // namespace epx::eplb
