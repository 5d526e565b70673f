// Device helpers shared by the hierarchical low-latency kernels (hierarchical_low_latency_{dispatch,combine}.cu).
// Protocol and memory order: hierarchical_low_latency_kernels.h.
#pragma once

#include "ep/cuda/hierarchical_low_latency_kernels.h"
#include "ep/cuda/low_latency_device.cuh"

namespace epx::cuda::llh_detail {

// The slot of node `other` in the per-node arrays of node `node` (other != node), and back.
__device__ __forceinline__ int slot_of(int other, int node) { return other < node ? other : other - 1; }
__device__ __forceinline__ int node_of_slot(int slot, int node) { return slot < node ? slot : slot + 1; }

__device__ __forceinline__ void add_weighted(float acc[8], uint4 raw, float w) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 f = detail::cvt_bf16x2_to_float2(words[q]);
    // NOTE: explicit rounding (no FMA contraction): the host reference's product, then sum.
    acc[2 * q] = __fadd_rn(acc[2 * q], __fmul_rn(w, f.x));
    acc[2 * q + 1] = __fadd_rn(acc[2 * q + 1], __fmul_rn(w, f.y));
  }
}

// Whether a combine signal came from the same dispatch; records the mismatch otherwise.
__device__ __forceinline__ bool same_dispatch(const LowLatencyPeers& peers, uint64_t v, uint32_t tag_id, int peer,
                                              int expert) {
  const uint32_t theirs = static_cast<uint32_t>(v) & kCombineIdMask;
  if (theirs == (tag_id & kCombineIdMask)) return true;
  record_failure(peers, kErrHandleMismatch, kSiteLowLatencyCombineRecv, peer, expert, tag_id & kCombineIdMask, theirs);
  return false;
}

}  // namespace epx::cuda::llh_detail
