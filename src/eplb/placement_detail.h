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

// DeepSeek's balanced_packing for one row: num_items % num_packs == 0.
void balanced_packing(const double* w, int num_items, int num_packs, int* pack, int* rank_in_pack);
// DeepSeek's replicate_experts for one row.
void replicate(const double* w, int num_log, int num_phy, int* phy2log, int* phyrank, int* logcnt);
void deepseek_group_packing(const double* w, const Layout& lay, std::vector<int>& group_node,
                            std::vector<int>& group_rank);
// Steps 2 and 3 of the hierarchical policy for a given group -> node packing.
void place_layer(const double* w, const Layout& lay, const std::vector<int>& group_node,
                 const std::vector<int>& group_rank, LayerPlacement& out);

void gpu_loads(const double* w, const int32_t* phy2log, const int32_t* logcnt, int num_physical, int slots_per_gpu,
               std::vector<double>& loads);
double max_gpu_load(const double* w, const int32_t* phy2log, const int32_t* logcnt, int num_physical,
                    int slots_per_gpu);
// Balancedness of one layer; replica counts are derived from phy2log (an expert without a replica is
// simply absent).
double layer_balancedness(const double* w, int num_logical, const int32_t* phy2log, int num_physical, int num_gpus);

}  // namespace epx::eplb::detail
