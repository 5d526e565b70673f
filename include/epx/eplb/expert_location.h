// Where each layer's experts live at run time, and which replica a token uses.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "epx/eplb/placement.h"

namespace epx::eplb {

// Per layer: phy2log (physical slot -> logical expert), log2phy (logical expert -> its slots, in slot
// order) and replica counts, plus the GPU/node layout: slot s lives on GPU s / slots_per_gpu(), GPU g on
// node g / (num_gpus / num_nodes). Invariants, checked by every constructor and set_layer(): every
// logical expert has >= 1 replica in every layer, slots per GPU are equal, GPUs per node are equal.
// A value type: copies are independent (the phy2log table is shared copy-on-write).
class ExpertLocation {
 public:
  // phy2log: [num_layers * num_physical]. Throws Error(kInvalidArgument) naming the broken bound.
  ExpertLocation(int num_layers, int num_logical, int num_physical, int num_gpus, int num_nodes,
                 std::vector<int32_t> phy2log);

  // The trivial start: physical slot i holds logical expert i % num_logical in every layer.
  static ExpertLocation trivial(int num_layers, int num_logical, int num_physical, int num_gpus, int num_nodes = 1);
  static ExpertLocation from_placement(const Placement& placement, int num_gpus, int num_nodes);
  // JSON text as written by to_json(): {"num_layers", "num_logical", "num_physical", "num_gpus",
  // "num_nodes", "phy2log": [[...] per layer]}. Throws Error(kInvalidArgument) naming the bad field.
  static ExpertLocation from_json(const std::string& text);
  std::string to_json() const;

  int num_layers() const { return num_layers_; }
  int num_logical() const { return num_logical_; }
  int num_physical() const { return num_physical_; }
  int num_gpus() const { return num_gpus_; }
  int num_nodes() const { return num_nodes_; }
  int slots_per_gpu() const { return num_physical_ / num_gpus_; }
  int gpus_per_node() const { return num_gpus_ / num_nodes_; }
  int gpu_of_slot(int slot) const { return slot / slots_per_gpu(); }
  // The largest replica count over all layers and experts.
  int max_replicas() const;

  // [num_physical]
  std::span<const int32_t> phy2log(int layer) const;
  // The physical slots holding `expert` in `layer`, ascending. [replica_count(layer, expert)]
  std::span<const int32_t> replicas(int layer, int expert) const;
  int replica_count(int layer, int expert) const { return static_cast<int>(replicas(layer, expert).size()); }
  // All layers: [num_layers * num_physical]. The pointer stays valid (and unchanged) while the caller holds it,
  // even if this location is modified later.
  std::shared_ptr<const std::vector<int32_t>> phy2log_table() const { return phy2log_; }

  // Replaces one layer's placement (chunked application of a rebalance). Validates like the constructor.
  void set_layer(int layer, std::span<const int32_t> phy2log);

  bool operator==(const ExpertLocation& other) const;

 private:
  void check_layer_index(int layer) const;
  void rebuild_layer(int layer);

  int num_layers_, num_logical_, num_physical_, num_gpus_, num_nodes_;
  std::shared_ptr<const std::vector<int32_t>> phy2log_;  // [num_layers * num_physical]
  std::vector<int32_t> log2phy_offsets_;                 // [num_layers * (num_logical + 1)] CSR offsets
  std::vector<int32_t> log2phy_slots_;                   // [num_layers * num_physical]
};

// How a token picks one replica of each of its logical experts.
enum class ReplicaChoice : uint8_t {
  // Prefer a replica on the token's own GPU (the lowest slot there); else a replica fixed per (source
  // GPU, expert), spread so that the source GPUs divide evenly over the replicas (the offset is a hash of
  // the seed, layer and expert).
  kStatic,
  // Uniform among the expert's replicas, from a counter-based hash of (seed, layer, token, k, rank).
  kDynamic,
};
const char* to_string(ReplicaChoice choice) noexcept;
// "static" or "dynamic"; throws Error(kInvalidArgument) otherwise.
ReplicaChoice replica_choice_from_string(const std::string& name);

struct ReplicaChoiceOptions {
  ReplicaChoice mode = ReplicaChoice::kStatic;
  uint64_t seed = 0;
  // Without an all-to-all backend every rank reduces the same tokens, so every rank must pick the same
  // replicas: the choice then depends only on (seed, layer, global token index, k), never on the rank.
  // kStatic then spreads tokens round-robin over the replicas instead of preferring the local one.
  bool rank_invariant = false;
};

// Maps logical top-k ids to physical slots for one layer.
//   topk_logical  [num_tokens * num_topk] logical expert ids, -1 = masked (kept -1)
//   topk_physical [num_tokens * num_topk] output
//   gpu           the caller's GPU (rank) in [0, num_gpus)
//   first_token   global index of the first token (rank-invariant and dynamic choices hash it)
// Throws Error(kInvalidArgument) for size mismatches, num_topk < 1, layer or gpu out of range, or an id
// outside [-1, num_logical).
void choose_replicas(const ExpertLocation& location, int layer, std::span<const int64_t> topk_logical, int num_topk,
                     std::span<int64_t> topk_physical, int gpu, const ReplicaChoiceOptions& options,
                     int64_t first_token = 0);

}  // namespace epx::eplb
