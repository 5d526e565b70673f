// Normal path, before any communication: the routing layout (per-rank/per-expert counts, is_token_in_rank),
// the per-destination scan (token lists and channel starts) and the gather of strided scales.
// Protocol: docs/normal-kernels.md.
#include <cooperative_groups.h>

#include <algorithm>

#include "core/cuda/cuda_util.h"
#include "ep/cuda/normal_device.cuh"

namespace epx::cuda {
namespace {

// ---- layout ----------------------------------------------------------------------------------

// One token per thread (its K loads in flight together); counts go to shared memory. Many blocks:
// one global atomic per non-zero count into outputs zeroed on the stream before. One cluster
// (kCluster, kLayoutClusterBlocks blocks): block 0 sums the blocks' shared counts (distributed shared
// memory) and stores them, so the call needs no memset.
template <bool kCluster>
__device__ __forceinline__ void layout_body(const void* topk_idx, bool is_int64, int64_t num_tokens, int num_topk,
                                            int64_t num_experts, int num_ranks, int32_t* per_rank, int32_t* per_expert,
                                            uint8_t* in_rank, ErrorRecord* error, int rank) {
  extern __shared__ int32_t s_expert[];              // [num_experts]
  __shared__ int32_t s_rank[kHierarchicalMaxRanks];  // the flat routing's kNormalMaxRanks, or the hierarchical's
  for (int64_t i = threadIdx.x; i < num_experts; i += blockDim.x) s_expert[i] = 0;
  for (int i = threadIdx.x; i < kHierarchicalMaxRanks; i += blockDim.x) s_rank[i] = 0;
  __syncthreads();
  const int per = static_cast<int>(num_experts / num_ranks);  // experts <= kNormalMaxExperts: 32-bit division
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < num_tokens;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t e[kNormalMaxTopk];
#pragma unroll
    for (int k = 0; k < kNormalMaxTopk; ++k) {
      e[k] = -1;
      if (k < num_topk) {
        const int64_t i = t * num_topk + k;
        e[k] = is_int64 ? static_cast<const int64_t*>(topk_idx)[i]
                        : static_cast<int64_t>(static_cast<const int32_t*>(topk_idx)[i]);
      }
    }
    uint64_t mask = 0;
#pragma unroll
    for (int k = 0; k < kNormalMaxTopk; ++k) {
      if (e[k] < -1 || e[k] >= num_experts) {
        record_error(error, kErrInvalidTopk, 0, rank, static_cast<int32_t>(t), k, num_experts, e[k]);
        continue;
      }
      if (e[k] < 0) continue;
      atomicAdd(&s_expert[e[k]], 1);
      mask |= uint64_t{1} << (static_cast<int>(e[k]) / per);
    }
    // Most tokens go to every rank at small R: one atomic per warp and rank, not one per token (all the warp's
    // lanes on one shared address serialize).
    const unsigned active = __activemask();
    const int leader = __ffs(active) - 1;
    for (int r = 0; r < num_ranks; ++r) {
      const bool in = (mask >> r) & 1u;  // r < num_ranks <= kHierarchicalMaxRanks = 64
      in_rank[t * num_ranks + r] = in;
      const int count = __popc(__ballot_sync(active, in));
      if ((threadIdx.x & 31) == leader && count != 0) atomicAdd(&s_rank[r], count);
    }
  }
  __syncthreads();
  if constexpr (kCluster) {
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every block's shared counts are final
    if (cluster.block_rank() == 0) {
      // All the cluster's loads of an entry in flight at once: a loop over a runtime block count issued them
      // one distributed-shared-memory round trip after the other (perf-notes L2).
      const int32_t* remote_expert[kLayoutClusterBlocks];
      const int32_t* remote_rank[kLayoutClusterBlocks];
#pragma unroll
      for (int b = 0; b < kLayoutClusterBlocks; ++b) {
        remote_expert[b] = cluster.map_shared_rank(s_expert, b);
        remote_rank[b] = cluster.map_shared_rank(s_rank, b);
      }
      for (int64_t i = threadIdx.x; i < num_experts + num_ranks; i += blockDim.x) {
        int32_t v[kLayoutClusterBlocks];
#pragma unroll
        for (int b = 0; b < kLayoutClusterBlocks; ++b) {
          v[b] = i < num_experts ? remote_expert[b][i] : remote_rank[b][i - num_experts];
        }
        int32_t sum = 0;
#pragma unroll
        for (int b = 0; b < kLayoutClusterBlocks; ++b) sum += v[b];
        if (i < num_experts) {
          per_expert[i] = sum;
        } else {
          per_rank[i - num_experts] = sum;
        }
      }
    }
    cluster.sync();  // NOTE: keeps every block's shared memory alive until block 0 read it
  } else {
    for (int64_t i = threadIdx.x; i < num_experts; i += blockDim.x) {
      if (s_expert[i] != 0) atomicAdd(&per_expert[i], s_expert[i]);
    }
    if (threadIdx.x < num_ranks && s_rank[threadIdx.x] != 0) atomicAdd(&per_rank[threadIdx.x], s_rank[threadIdx.x]);
  }
}

__global__ void __launch_bounds__(kLayoutThreads)
    layout_kernel(const void* topk_idx, bool is_int64, int64_t num_tokens, int num_topk, int64_t num_experts,
                  int num_ranks, int32_t* per_rank, int32_t* per_expert, uint8_t* in_rank, ErrorRecord* error,
                  int rank) {
  layout_body<false>(topk_idx, is_int64, num_tokens, num_topk, num_experts, num_ranks, per_rank, per_expert, in_rank,
                     error, rank);
}

__global__ void __cluster_dims__(kLayoutClusterBlocks, 1, 1) __launch_bounds__(kLayoutClusterThreads)
    layout_cluster_kernel(const void* topk_idx, bool is_int64, int64_t num_tokens, int num_topk, int64_t num_experts,
                          int num_ranks, int32_t* per_rank, int32_t* per_expert, uint8_t* in_rank, ErrorRecord* error,
                          int rank) {
  layout_body<true>(topk_idx, is_int64, num_tokens, num_topk, num_experts, num_ranks, per_rank, per_expert, in_rank,
                    error, rank);
}

// ---- scan: one block per destination ----------------------------------------------------------

// The exclusive count of set `flag`s among the threads before this one (thread order), and the block's
// total in *total. Every thread of the block calls it; s_warp holds 32 ints of shared memory.
__device__ __forceinline__ int block_exclusive_count(int flag, int32_t* s_warp, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  const unsigned ballot = __ballot_sync(0xffffffffu, flag);
  if (lane == 0) s_warp[warp] = __popc(ballot);
  __syncthreads();
  if (warp == 0) {
    int v = lane < num_warps ? s_warp[lane] : 0;
    for (int d = 1; d < 32; d <<= 1) {
      const int o = __shfl_up_sync(0xffffffffu, v, d);
      if (lane >= d) v += o;
    }
    if (lane < num_warps) s_warp[lane] = v;  // inclusive
  }
  __syncthreads();
  const int excl = (warp > 0 ? s_warp[warp - 1] : 0) + __popc(ballot & ((1u << lane) - 1));
  *total = s_warp[num_warps - 1];
  __syncthreads();  // s_warp is reused by the next call
  return excl;
}

__global__ void __launch_bounds__(1024)
    scan_kernel(const uint8_t* in_rank, int64_t num_tokens, int num_ranks, int num_channels, int32_t* excl_pos,
                int32_t* list_tok, int32_t* chan_start) {
  __shared__ int32_t s_warp[32];
  const int r = blockIdx.x;
  int32_t* pos = excl_pos + r * (num_tokens + 1);
  int base = 0;
  for (int64_t tile = 0; tile < num_tokens; tile += blockDim.x) {
    const int64_t t = tile + threadIdx.x;
    const int flag = t < num_tokens ? in_rank[t * num_ranks + r] : 0;
    int total = 0;
    const int excl = base + block_exclusive_count(flag, s_warp, &total);
    if (t < num_tokens) {
      pos[t] = excl;
      if (flag) list_tok[r * num_tokens + excl] = static_cast<int32_t>(t);
    }
    base += total;
  }
  if (threadIdx.x == 0) pos[num_tokens] = base;
  __syncthreads();
  for (int c = threadIdx.x; c <= num_channels; c += blockDim.x) {
    const int64_t begin = num_tokens * c / num_channels;
    chan_start[r * (num_channels + 1) + c] = begin < num_tokens ? pos[begin] : base;
  }
}

// ---- strided scales ---------------------------------------------------------------------------

__global__ void __launch_bounds__(256)
    gather_scales_kernel(const void* src, int64_t stride0, int64_t stride1, int elem_bytes, int64_t num_tokens,
                         int64_t num_scales, void* dst) {
  const int64_t n = num_tokens * num_scales;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / num_scales, j = i - t * num_scales;
    const int64_t at = t * stride0 + j * stride1;
    if (elem_bytes == 4) {
      static_cast<int32_t*>(dst)[i] = static_cast<const int32_t*>(src)[at];
    } else {
      static_cast<uint8_t*>(dst)[i] = static_cast<const uint8_t*>(src)[at];
    }
  }
}

}  // namespace

cudaError_t preload_layout_kernels() {
  return preload_kernels(
      {reinterpret_cast<const void*>(&layout_kernel), reinterpret_cast<const void*>(&layout_cluster_kernel),
       reinterpret_cast<const void*>(&scan_kernel), reinterpret_cast<const void*>(&gather_scales_kernel)});
}

void launch_layout(const void* topk_idx, bool is_int64, int64_t num_tokens, int num_topk, int64_t num_experts,
                   int num_ranks, int32_t* num_tokens_per_rank, int32_t* num_tokens_per_expert,
                   uint8_t* is_token_in_rank, ErrorRecord* value_error, int rank, cudaStream_t stream,
                   int cluster_threads) {
  if (num_tokens * num_topk <= kLayoutClusterEntries) {
    // One token per thread where the tokens allow: a block of 1024 threads for 4096 tokens left half the
    // cluster idle and doubled the shared-memory atomics per busy block (docs/perf-notes.md, L1).
    // At least one thread per count, so block 0 gathers every count in one distributed-shared-memory round.
    if (cluster_threads <= 0) {
      const int64_t per_block = (num_tokens + kLayoutClusterBlocks - 1) / kLayoutClusterBlocks;
      const int64_t threads = std::max(per_block, num_experts + num_ranks);
      cluster_threads = static_cast<int>(std::clamp<int64_t>((threads + 31) / 32 * 32, 128, kLayoutClusterThreads));
    }
    layout_cluster_kernel<<<kLayoutClusterBlocks, cluster_threads, num_experts * sizeof(int32_t), stream>>>(
        topk_idx, is_int64, num_tokens, num_topk, num_experts, num_ranks, num_tokens_per_rank, num_tokens_per_expert,
        is_token_in_rank, value_error, rank);
    return;
  }
  // Many blocks add their counts into zeroed outputs (one memset where the two arrays are back to back).
  if (num_tokens_per_expert == num_tokens_per_rank + num_ranks) {
    check_cuda(cudaMemsetAsync(num_tokens_per_rank, 0, 4 * (num_ranks + num_experts), stream),
               "cudaMemsetAsync (layout)");
  } else {
    check_cuda(cudaMemsetAsync(num_tokens_per_rank, 0, 4 * num_ranks, stream), "cudaMemsetAsync (layout)");
    check_cuda(cudaMemsetAsync(num_tokens_per_expert, 0, 4 * num_experts, stream), "cudaMemsetAsync (layout)");
  }
  const int64_t blocks = (num_tokens + kLayoutThreads - 1) / kLayoutThreads;
  layout_kernel<<<static_cast<unsigned>(blocks), kLayoutThreads, num_experts * sizeof(int32_t), stream>>>(
      topk_idx, is_int64, num_tokens, num_topk, num_experts, num_ranks, num_tokens_per_rank, num_tokens_per_expert,
      is_token_in_rank, value_error, rank);
}

void launch_scan(const uint8_t* is_token_in_rank, int64_t num_tokens, int num_ranks, int num_channels,
                 int32_t* excl_pos, int32_t* list_tok, int32_t* chan_start, cudaStream_t stream) {
  scan_kernel<<<num_ranks, 1024, 0, stream>>>(is_token_in_rank, num_tokens, num_ranks, num_channels, excl_pos, list_tok,
                                              chan_start);
}

void launch_gather_scales(const void* src, int64_t stride0, int64_t stride1, int elem_bytes, int64_t num_tokens,
                          int64_t num_scales, void* dst, cudaStream_t stream) {
  const int64_t n = num_tokens * num_scales;
  if (n == 0) return;
  const int64_t blocks = (n + 255) / 256 < 1024 ? (n + 255) / 256 : 1024;
  gather_scales_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(src, stride0, stride1, elem_bytes, num_tokens,
                                                                          num_scales, dst);
}

}  // namespace epx::cuda
