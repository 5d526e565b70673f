// Private building blocks of the placement policies, shared by placement.cpp and migration.cpp.
#pragma once

#include <cstdint>
#include <vector>

#include "epx/eplb/placement.h"

namespace epx::eplb::detail {

// The effective layout: for the global policy num_groups = num_nodes = 1.
struct Layout {
  int num_logical = 0, num_physical = 0, num_gpus = 0, num_groups = 0, num_nodes = 0;
  bool hierarchical = false;
  int gpus_per_node = 0, slots_per_gpu = 0, logical_per_node = 0, physical_per_node = 0, group_size = 0,
      groups_per_node = 0;
};

// One layer's placement. phyrank[s] = creation order of slot s among its expert's replicas.
struct LayerPlacement {
  std::vector<int32_t> phy2log, phyrank, logcnt;
};

Layout make_layout(int num_logical, const PlacementShape& shape);
void check_weight(const std::vector<std::vector<double>>& weight);

// DeepSeek's balanced_packing for one row: num_items % num_packs == 0. O(num_items log num_items).
void balanced_packing(const double* w, int num_items, int num_packs, int* pack, int* rank_in_pack);
// DeepSeek's replicate_experts for one row. O(num_phy log num_log).
void replicate(const double* w, int num_log, int num_phy, int* phy2log, int* phyrank, int* logcnt);
void deepseek_group_packing(const double* w, const Layout& lay, std::vector<int>& group_node,
                            std::vector<int>& group_rank);
// Steps 2 and 3 of the hierarchical policy for a given group -> node packing.
void place_layer(const double* w, const Layout& lay, const std::vector<int>& group_node,
                 const std::vector<int>& group_rank, LayerPlacement& out);

// Work bound of the default policy's refinement of one layer. A unit is about one comparison or slot
// visited: a best-swap probe (an item of the most loaded bin against another bin: three binary searches)
// costs 1 + log2(items per bin), sorting a node's slots 1 + log2(slots per GPU) per slot, re-summing a
// node for a trial replica move 1 per slot, costing a node for a group swap 1 + log2(experts per node)
// per heap step. The refinement stops, keeping every step already taken, at the first step that does not
// fit.
struct RefineBudget {
  int64_t limit = 0, used = 0;
  // Takes `units` if they fit in what is left; otherwise takes nothing and returns false.
  bool spend(int64_t units) {
    if (units > limit - used) return false;
    used += units;
    return true;
  }
};
inline constexpr int64_t kRefineUnitsPerItem = 1;  // per item and per bit of log2(items)
inline constexpr int64_t kRefineUnitsFloor = int64_t{1} << 23;
// kRefineUnitsPerItem * n * ceil(log2(n)) + kRefineUnitsFloor with n = num_physical + num_logical. A unit
// takes ~5-50 ns (more where bins outgrow the caches): at most ~0.1 s per layer up to n ~ 2^16 and ~2 s
// at the largest shape the CLI accepts (n = 2^21: 5.2e7 units). Realistic shapes stay far below it
// (DeepSeek-V3's 256 experts on 288 slots of 32 GPUs: ~2e4 units; 256 experts on 512 slots of 4 GPUs,
// the heaviest case measured: 3.5e6), so there the result is the unbounded search's.
int64_t refine_work_limit(const Layout& lay);
// The default policy for one layer: kDeepSeek's placement, improved (see Policy::kDefault) within
// `budget`; never less balanced than kDeepSeek's. budget.used says how much work it took.
void place_layer_default(const double* w, const Layout& lay, LayerPlacement& out, RefineBudget& budget);

void gpu_loads(const double* w, const int32_t* phy2log, const int32_t* logcnt, int num_physical, int slots_per_gpu,
               std::vector<double>& loads);
double max_gpu_load(const double* w, const int32_t* phy2log, const int32_t* logcnt, int num_physical,
                    int slots_per_gpu);
// Balancedness of one layer; replica counts are derived from phy2log (an expert without a replica is
// simply absent).
double layer_balancedness(const double* w, int num_logical, const int32_t* phy2log, int num_physical, int num_gpus);

}  // namespace epx::eplb::detail
