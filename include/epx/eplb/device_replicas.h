// Replica choice on the GPU: the logical -> physical map of an ExpertLocation copied to a device, and a kernel
// that picks one replica per (token, k) exactly as the host choose_replicas does (one rule, shared), so routing
// never goes through the host (no sync, CUDA-graph capturable).
#pragma once

#include <cstdint>
#include <memory>

#include "epx/eplb/expert_location.h"
#include "epx/tensor.h"

namespace epx::eplb {

// One ExpertLocation's replica lists (every layer) on one CUDA device. Immutable: after a rebalance upload a new
// table; kernels already enqueued with the old one keep it alive through the caller's reference.
class DeviceReplicaTable {
 public:
  // Copies the location's replica lists to `device` (a CUDA device), ordered on `stream`. Throws
  // Error(kInvalidArgument) for a non-CUDA device, Error(kUnsupported) in a build without CUDA.
  static std::shared_ptr<const DeviceReplicaTable> upload(const ExpertLocation& location, Device device,
                                                          Stream stream = nullptr);

  int num_layers() const { return num_layers_; }
  int num_logical() const { return num_logical_; }
  int num_physical() const { return num_physical_; }
  int num_gpus() const { return num_gpus_; }
  Device device() const { return offsets_.device(); }
  const Tensor& offsets() const { return offsets_; }  // int32 [num_layers, num_logical + 1]: CSR offsets per layer
  const Tensor& slots() const { return slots_; }  // int32 [num_layers, num_physical]: each expert's slots, ascending

 private:
  int num_layers_ = 0, num_logical_ = 0, num_physical_ = 0, num_gpus_ = 0;
  Tensor offsets_, slots_;
};

// choose_replicas on the device: topk_logical [T, K] int64 or int32 on the table's device, topk_physical the same
// shape and dtype (may be the same tensor: each entry is read before it is written). Picks what the host
// choose_replicas picks for the same arguments; -1 stays -1, and an id outside [-1, num_logical) gives -1 (the ids
// live on the device, so they are not checked on the host). Enqueued on `stream`, no host sync. Throws
// Error(kInvalidArgument) naming the argument for shapes, dtypes, devices, layer, gpu and first_token.
void choose_replicas(const DeviceReplicaTable& table, int layer, const TensorView& topk_logical,
                     const TensorView& topk_physical, int gpu, const ReplicaChoiceOptions& options,
                     int64_t first_token = 0, Stream stream = nullptr);

}  // namespace epx::eplb
