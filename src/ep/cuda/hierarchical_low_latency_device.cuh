// Device helpers shared by the hierarchical low-latency kernels (hierarchical_low_latency_{dispatch,combine}.cu).
// Protocol and memory order: hierarchical_low_latency_kernels.h.
#pragma once

#include "ep/cuda/hierarchical_low_latency_kernels.h"
#include "ep/cuda/low_latency_device.cuh"

namespace epx::cuda::llh_detail {

// The slot of node `other` in the per-node arrays of node `node` (other != node), and back.
__device__ __forceinline__ int slot_of(int other, int node) { return other < node ? other : other - 1; }
__device__ __forceinline__ int node_of_slot(int slot, int node) { return slot < node ? slot : slot + 1; }

}  // namespace epx::cuda::llh_detail
