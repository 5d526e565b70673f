// EPLB placement: which logical expert each physical expert slot holds, per MoE layer.
//
// Vocabulary (shapes in trailing comments):
//   weight   [num_layers][num_logical]   load of each logical expert (tokens routed to it), >= 0, finite
//   phy2log  [num_layers * num_physical] logical expert held by each physical slot; slot s lives on GPU
//                                        s / (num_physical / num_gpus), GPU g on node g / (num_gpus / num_nodes)
//   log2phy  [num_layers * num_logical * max_replicas] physical slots of each logical expert, -1 padded
//   logcnt   [num_layers * num_logical]  replica count of each logical expert (>= 1)
//
// Balancedness of a layer = mean GPU load / max GPU load, where a GPU's load is the sum over its slots of
// weight[expert] / logcnt[expert] (replicas share their expert's load evenly); 1 when the layer has no
// load. balancedness() averages it over layers. Because replicas split load exactly, the mean GPU load
// is the same for every placement of a layer, so higher balancedness == lower max GPU load.
//
// Every call here is pure host code, deterministic, and thread-safe (no shared state).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace epx::eplb {

enum class Policy : uint8_t {
  // DeepSeek's published EPLB, reproduced exactly: float64 loads; packing visits items by descending
  // load (stable: ties keep the lower index first) and puts each into the lightest pack with room (the
  // first on ties); replication adds one replica at a time to the expert with the largest load per
  // replica (the first on ties). A pack level with one item per pack maps item i to pack i.
  kDeepSeek,
  // Starts from kDeepSeek's result and improves it (group swaps between nodes, replica swaps between
  // GPUs of a node, replica moves between experts of a node), keeping node locality and equal slots per
  // GPU. Never less balanced than kDeepSeek: the better of the two is returned. Its search is bounded per
  // layer by (num_physical + num_logical) x ceil(log2(num_physical + num_logical)) + 2^23 units of work (a
  // unit ~ one comparison), about 2 s at 2^20 slots; realistic shapes (hundreds of experts) finish far
  // below it, with the result of the unbounded search. Both policies are O(n log n) outside that search.
  kDefault,
};
const char* to_string(Policy policy) noexcept;
// "deepseek" or "default"; throws Error(kInvalidArgument) naming the value otherwise.
Policy policy_from_string(const std::string& name);

// The machine and model shape a placement is computed for.
struct PlacementShape {
  int num_physical = 0;  // physical expert slots per layer (>= num_logical, divisible by num_gpus)
  int num_groups = 1;    // expert groups (num_logical divisible by it when the hierarchical policy applies)
  int num_nodes = 1;     // nodes (num_gpus divisible by it)
  int num_gpus = 1;      // GPUs in expert parallelism (>= 1)
};

struct Placement {
  int num_layers = 0;
  int num_logical = 0;
  int num_physical = 0;
  int max_replicas = 0;          // the largest replica count over all layers and experts
  bool hierarchical = false;     // true when groups were packed onto nodes (num_groups % num_nodes == 0)
  std::vector<int32_t> phy2log;  // [num_layers * num_physical]
  // [num_layers * num_logical * max_replicas], -1 padded. NOTE: far larger than phy2log when one expert holds
  // many slots (one hot expert on most of 2^20 slots among 8192 experts: 32 GiB).
  std::vector<int32_t> log2phy;
  std::vector<int32_t> logcnt;  // [num_layers * num_logical]
};

// Computes a placement. Hierarchical when num_groups % num_nodes == 0 (groups -> nodes by load; replicas
// inside each node; replicas -> the node's GPUs), else global (one node, one group).
// kDeepSeek orders each expert's log2phy row by replica creation; kDefault by slot index.
// Throws Error(kInvalidArgument) naming the bound for: empty weight or rows, ragged rows, negative / NaN /
// infinite loads, num_physical < num_logical, num_physical % num_gpus, num_gpus % num_nodes,
// num_logical % num_groups (hierarchical), fewer physical slots per node than logical experts per node,
// any count < 1.
Placement rebalance(const std::vector<std::vector<double>>& weight, const PlacementShape& shape,
                    Policy policy = Policy::kDefault);

// Options of the migration-aware mode.
struct MigrationOptions {
  // The result may be less balanced than a fresh kDefault placement by at most this much (absolute
  // balancedness, per layer). In [0, 1].
  double max_balance_loss = 0.01;
};

struct MigrationResult {
  Placement placement;
  int64_t moved_experts = 0;        // slots whose expert changes w.r.t. `current`, all layers
  int64_t fresh_moved_experts = 0;  // the same count for the fresh kDefault placement as computed
  double fresh_balancedness = 0;    // balancedness of that fresh placement under `weight`
};

// Migration-aware rebalancing: computes a fresh kDefault placement and renames its nodes, GPUs and slots
// to overlap `current` as much as possible (free: balance is unchanged). Per layer it then keeps the
// result with the fewest moved slots among two searches from `current` that stay within
// max_balance_loss of the fresh layer: local swaps / replica conversions around the most loaded GPU, and
// adopting the fresh layer one GPU at a time. If none reaches the bound, the renamed fresh
// layer is used. Layers already within the bound keep `current` unchanged. The searches of a layer are
// bounded by (num_physical + num_logical) x ceil(log2(num_physical + num_logical)) + 2^28 units of work (a
// unit ~ one slot visited or one pair of slots compared; at most ~1 s per layer). 256 experts on up to ~576
// slots stay below it; where it binds (e.g. 256 experts on 1024 slots of 8 GPUs, or 10^4+ slots) the result may
// move more slots than an unbounded search would, never with more balance loss.
// `current_phy2log` is [num_layers * num_physical] with every logical expert present in each layer. Throws
// Error(kInvalidArgument) for shape mismatches and the errors of rebalance().
MigrationResult rebalance_migration_aware(const std::vector<std::vector<double>>& weight, const PlacementShape& shape,
                                          const std::vector<int32_t>& current_phy2log,
                                          const MigrationOptions& options = {});

// Derives log2phy (slot order), logcnt and max_replicas from phy2log. Throws Error(kInvalidArgument) if
// phy2log.size() != num_layers * num_physical, an entry is outside [0, num_logical), or a logical expert
// has no replica in some layer.
Placement placement_from_phy2log(const std::vector<int32_t>& phy2log, int num_layers, int num_logical,
                                 int num_physical);

// Per-layer balancedness of phy2log under weight (see the top of this file). [num_layers]
std::vector<double> balancedness_per_layer(const std::vector<std::vector<double>>& weight,
                                           const std::vector<int32_t>& phy2log, int num_physical, int num_gpus);
// The mean of balancedness_per_layer.
double balancedness(const std::vector<std::vector<double>>& weight, const std::vector<int32_t>& phy2log,
                    int num_physical, int num_gpus);

// Slots whose logical expert differs between two placements of equal shape, all layers.
int64_t count_moved_experts(const std::vector<int32_t>& old_phy2log, const std::vector<int32_t>& new_phy2log);

// The trivial placement: physical slot i holds logical expert i % num_logical, in every layer.
std::vector<int32_t> trivial_phy2log(int num_layers, int num_logical, int num_physical);

}  // namespace epx::eplb
