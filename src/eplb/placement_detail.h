// Private building blocks of the placement policies, shared by placement.cpp, placement_default.cpp and
// migration.cpp.
#pragma once

#include <cstdint>
#include <vector>

#include "epx/eplb/placement.h"

namespace epx::eplb::detail {

// The smallest b with 2^b >= n (0 for n <= 1): the log factor of the placement searches' work bounds.
inline int ceil_log2(int64_t n) {
  int bits = 0;
  while ((int64_t{1} << bits) < n) ++bits;
  return bits;
}

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

// ---- log2phy, built last -----------------------------------------------------------------------------
// log2phy is [num_layers * num_logical * max_replicas]: far more entries than slots when one expert holds many
// of them (a hot expert on ~2^20 slots among 8192 experts: 2^33 entries, 32 GiB). rebalance(),
// rebalance_migration_aware() and placement_from_phy2log() are the *_unmapped step plus build_log2phy; the
// epx CLI calls the two apart to check that size first, and callers that need only phy2log (the rebalance
// manager, the balancedness of a given phy2log) never build it.

// The placement without log2phy (left empty; max_replicas set) and the order log2phy lists each expert's slots
// in: phyrank[s] = slot s's rank among its expert's replicas, [num_layers * num_physical]; empty = slot order.
struct UnmappedPlacement {
  Placement placement;
  std::vector<int32_t> phyrank;
};
UnmappedPlacement rebalance_unmapped(const std::vector<std::vector<double>>& weight, const PlacementShape& shape,
                                     Policy policy);
// rebalance_migration_aware without result.placement.log2phy (slot order).
MigrationResult rebalance_migration_aware_unmapped(const std::vector<std::vector<double>>& weight,
                                                   const PlacementShape& shape,
                                                   const std::vector<int32_t>& current_phy2log,
                                                   const MigrationOptions& options);
// placement_from_phy2log's checks, logcnt and max_replicas; no log2phy (slot order).
Placement placement_from_phy2log_unmapped(const std::vector<int32_t>& phy2log, int num_layers, int num_logical,
                                          int num_physical);
// Fills placement.log2phy in `phyrank` order (empty: slot order). Throws Error(kInvalidArgument) if its entry
// count overflows int64.
void build_log2phy(Placement& placement, const std::vector<int32_t>& phyrank = {});

// ---- migration-aware search ---------------------------------------------------------------------------
// Work bound of the migration-aware search of one layer, in units of about one slot visited or one pair of
// slots compared: renaming the fresh layer's nodes and GPUs (overlap matrices and a greedy matching, skipped
// where they do not fit: the renaming is free either way), adopting the fresh layer GPU by GPU (each trial
// costs a layer's slots, experts and GPUs), and the local search (each step costs ~2 x (slots per GPU + 3) x
// (slots + GPUs)). The search stops at the first step that does not fit; the layer is then the best found that
// stays within max_balance_loss, else the renamed fresh layer, which always does.
// kRefineUnitsPerItem * n * ceil(log2(n)) + kMigrationUnitsFloor with n = num_physical + num_logical. A unit takes
// ~0.6-4 ns (more where the layer outgrows the caches): at most ~0.2-1.2 s per layer at any shape the CLI accepts,
// on top of the fresh placement. The floor is 32x the default policy's because the local search is cubic: from a
// shuffled or an older placement, DeepSeek-V3's shape (256 experts on 288 slots of 32 GPUs) takes up to ~7e6 units
// and 256 experts on 512 or 576 slots of 4 or 8 GPUs up to ~2e8, so there the result is the unbounded search's;
// 256 experts on 1024 slots of 8 GPUs took up to 1.1e9 and is bounded.
inline constexpr int64_t kMigrationUnitsFloor = int64_t{1} << 28;
int64_t migration_work_limit(const Layout& lay);
// One layer of rebalance_migration_aware: from the current layer `cur` and the fresh layer `fresh` (both
// [num_physical]), writes the result to `out` [num_physical] within `budget`. `num_nodes` is the shape's (the
// local search keeps replicas inside them even when the layout is global).
void migrate_layer(const double* w, const Layout& lay, int num_nodes, const int32_t* fresh, const int32_t* cur,
                   double max_balance_loss, RefineBudget& budget, int32_t* out);

void gpu_loads(const double* w, const int32_t* phy2log, const int32_t* logcnt, int num_physical, int slots_per_gpu,
               std::vector<double>& loads);
double max_gpu_load(const double* w, const int32_t* phy2log, const int32_t* logcnt, int num_physical,
                    int slots_per_gpu);
// Balancedness of one layer; replica counts are derived from phy2log (an expert without a replica is
// simply absent).
double layer_balancedness(const double* w, int num_logical, const int32_t* phy2log, int num_physical, int num_gpus);

}  // namespace epx::eplb::detail
