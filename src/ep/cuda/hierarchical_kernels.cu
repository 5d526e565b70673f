// Kernels of the hierarchical normal path: scans, packing and unpacking of records, and the combine's reductions.
// None waits on a peer: the exchanges between them (net_leg.h) order the ranks' streams. Every reduction adds in
// the host reference's order (src/ep/host/host_hierarchical.cpp), so the results match it bit for bit.
#include <cub/block/block_scan.cuh>

#include "core/bf16.h"
#include "core/cuda/cuda_util.h"
#include "ep/cuda/hierarchical_kernels.h"

namespace epx::cuda::hier {
namespace {

constexpr int kScanThreads = 1024;
constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = 32 * kWarpsPerBlock;
constexpr int64_t kMaxBlocks = 1024;

int grid_for(int64_t items) {
  const int64_t blocks = (items + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
}

__device__ __forceinline__ int part_of(const Parts& parts, int64_t i) {
  int p = 0;
  while (p + 1 < parts.num && i >= parts.start[p + 1]) ++p;
  return p;
}

// Copies `bytes` with one warp: 16-byte words when both ends and the size allow, else 4-byte or single bytes.
__device__ __forceinline__ void warp_copy(char* dst, const char* src, int64_t bytes, int lane) {
  const auto a = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(bytes);
  if ((a & 15) == 0) {
    for (int64_t i = lane; i < bytes / 16; i += 32)
      reinterpret_cast<int4*>(dst)[i] = reinterpret_cast<const int4*>(src)[i];
  } else if ((a & 3) == 0) {
    for (int64_t i = lane; i < bytes / 4; i += 32)
      reinterpret_cast<int32_t*>(dst)[i] = reinterpret_cast<const int32_t*>(src)[i];
  } else {
    for (int64_t i = lane; i < bytes; i += 32) dst[i] = src[i];
  }
}

// Exclusive scan of flag(s, i) over i in [0, n) for segment s = blockIdx.x, in chunks of the block.
template <typename Flag, typename Emit>
__device__ void scan_segment(int64_t n, Flag flag, Emit emit, int32_t* total) {
  using Scan = cub::BlockScan<int32_t, kScanThreads>;
  __shared__ typename Scan::TempStorage storage;
  __shared__ int32_t carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int64_t base = 0; base < n; base += kScanThreads) {
    const int64_t i = base + threadIdx.x;
    const int32_t f = i < n && flag(i) ? 1 : 0;
    int32_t pos = 0, sum = 0;
    Scan(storage).ExclusiveSum(f, pos, sum);
    if (i < n) emit(i, f ? carry + pos : -1);
    __syncthreads();
    if (threadIdx.x == 0) carry += sum;
    __syncthreads();
  }
  if (threadIdx.x == 0 && total != nullptr) *total = carry;
}

__global__ void __launch_bounds__(kScanThreads)
    node_scan_kernel(const uint8_t* in_rank, int64_t num_tokens, int num_nodes, int gpus, int32_t* node_slot,
                     int32_t* node_tok, int32_t* per_node) {
  const int n = blockIdx.x;
  const int num_ranks = num_nodes * gpus;
  scan_segment(
      num_tokens,
      [&](int64_t t) {
        bool any = false;
        for (int g = 0; g < gpus; ++g) any = any || in_rank[t * num_ranks + n * gpus + g] != 0;
        return any;
      },
      [&](int64_t t, int32_t pos) {
        if (node_slot != nullptr) node_slot[t * num_nodes + n] = pos;
        if (pos >= 0 && node_tok != nullptr) node_tok[n * num_tokens + pos] = static_cast<int32_t>(t);
      },
      per_node != nullptr ? per_node + n : nullptr);
}

__global__ void __launch_bounds__(kScanThreads)
    forward_scan_kernel(const char* relay, RecordLayout rec, int64_t num_records, int32_t* fwd_pos) {
  const int g = blockIdx.x;
  scan_segment(
      num_records,
      [&](int64_t i) { return ((*reinterpret_cast<const uint32_t*>(relay + i * rec.bytes + rec.off_mask)) >> g) & 1u; },
      [&](int64_t i, int32_t pos) { fwd_pos[g * num_records + i] = pos; }, nullptr);
}

__global__ void __launch_bounds__(kThreads) pack_kernel(PackArgs a) {
  const int lane = threadIdx.x % 32;
  const int64_t total = a.messages.start[a.messages.num];
  const int num_ranks = a.num_nodes * a.gpus_per_node;
  const RecordLayout& rec = a.rec;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; j < total;
       j += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const int n = part_of(a.messages, j);
    const int64_t t = a.node_tok[n * a.num_tokens + (j - a.messages.start[n])];
    char* out = a.out + j * rec.bytes;
    warp_copy(out, a.x + t * rec.x_bytes, rec.x_bytes, lane);
    if (rec.scale_bytes > 0) warp_copy(out + rec.x_bytes, a.scales + t * rec.scale_bytes, rec.scale_bytes, lane);
    if (lane == 0) {
      uint32_t mask = 0;
      for (int g = 0; g < a.gpus_per_node; ++g) {
        if (a.is_token_in_rank[t * num_ranks + n * a.gpus_per_node + g]) mask |= 1u << g;
      }
      *reinterpret_cast<int32_t*>(out + rec.off_src) = static_cast<int32_t>(t);
      *reinterpret_cast<uint32_t*>(out + rec.off_mask) = mask;
    }
    if (lane < rec.num_topk) {
      const int64_t i = t * rec.num_topk + lane;
      const int64_t e = a.topk_is_int64 ? static_cast<const int64_t*>(a.topk_idx)[i]
                                        : static_cast<int64_t>(static_cast<const int32_t*>(a.topk_idx)[i]);
      reinterpret_cast<int64_t*>(out + rec.off_topk)[lane] = e;
      if (rec.has_weights) reinterpret_cast<float*>(out + rec.off_weights)[lane] = a.weights[i];
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    forward_pack_kernel(const char* relay, RecordLayout rec, int64_t num_records, int gpus, const int32_t* fwd_pos,
                        Parts messages, char* out) {
  const int lane = threadIdx.x % 32;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; i < num_records;
       i += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    for (int g = 0; g < gpus; ++g) {
      const int32_t pos = fwd_pos[g * num_records + i];
      if (pos < 0 || messages.start[g] + pos >= messages.start[g + 1]) continue;
      warp_copy(out + (messages.start[g] + pos) * rec.bytes, relay + i * rec.bytes, rec.bytes, lane);
    }
  }
}

__global__ void __launch_bounds__(kThreads) unpack_kernel(UnpackArgs a) {
  const int lane = threadIdx.x % 32;
  const RecordLayout& rec = a.rec;
  const int K = rec.num_topk;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; j < a.num_rows;
       j += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    int64_t row = j;  // padding rows (j >= num_recv) are written in place
    const char* in = nullptr;
    if (j < a.num_recv) {
      const int b = part_of(a.blocks, j);
      row = a.row_base[b] + (j - a.blocks.start[b]);
      if (row >= a.num_rows) continue;  // cannot happen with consistent counts
      in = a.in + j * rec.bytes;
    } else if (a.num_recv > a.num_rows) {
      continue;
    }
    if (in != nullptr) {
      warp_copy(a.out_x + row * rec.x_bytes, in, rec.x_bytes, lane);
      if (rec.scale_bytes > 0) warp_copy(a.out_scales + row * rec.scale_bytes, in + rec.x_bytes, rec.scale_bytes, lane);
    }
    if (lane == 0) a.out_src_idx[row] = in != nullptr ? *reinterpret_cast<const int32_t*>(in + rec.off_src) : -1;
    if (lane < K && a.out_topk_idx != nullptr) {
      int64_t local = -1;
      float w = 0.f;
      if (in != nullptr) {
        const int64_t e = reinterpret_cast<const int64_t*>(in + rec.off_topk)[lane];
        if (e >= a.expert_begin && e < a.expert_begin + a.num_local_experts) {
          local = e - a.expert_begin;
          if (rec.has_weights) w = reinterpret_cast<const float*>(in + rec.off_weights)[lane];
        }
      }
      if (a.topk_is_int64) {
        static_cast<int64_t*>(a.out_topk_idx)[row * K + lane] = local;
      } else {
        static_cast<int32_t*>(a.out_topk_idx)[row * K + lane] = static_cast<int32_t>(local);
      }
      if (a.out_weights != nullptr) a.out_weights[row * K + lane] = w;
    }
  }
}

__global__ void __launch_bounds__(kThreads) combine_pack_kernel(CombinePackArgs a) {
  const int lane = threadIdx.x % 32;
  const int64_t total = a.blocks.start[a.blocks.num];
  const int64_t rec_bytes = node_record_bytes(a.hidden, a.num_topk);
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; j < total;
       j += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const int b = part_of(a.blocks, j);
    const int64_t row = a.row_base[b] + (j - a.blocks.start[b]);
    char* out = a.out + j * rec_bytes;
    warp_copy(out, reinterpret_cast<const char*>(a.x + row * a.hidden), 2 * a.hidden, lane);
    if (lane < a.num_topk && a.weights != nullptr) {
      reinterpret_cast<float*>(out + node_weights_offset(a.hidden))[lane] = a.weights[row * a.num_topk + lane];
    }
  }
}

__global__ void __launch_bounds__(kThreads) combine_reduce_node_kernel(CombineReduceArgs a) {
  const int lane = threadIdx.x % 32;
  const int64_t in_bytes = node_record_bytes(a.hidden, a.num_topk);
  const int64_t out_bytes = partial_record_bytes(a.hidden, a.num_topk, a.bf16);
  const int64_t out_weights = partial_weights_offset(a.hidden, a.bf16);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; i < a.num_records;
       i += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const char* rows[kMaxParts];
    int num_rows = 0;
    for (int g = 0; g < a.gpus_per_node; ++g) {  // NOTE: local rank ascending, as the host reference
      const int32_t pos = a.fwd_pos[g * a.num_records + i];
      if (pos < 0 || a.messages.start[g] + pos >= a.messages.start[g + 1]) continue;
      rows[num_rows++] = a.in + (a.messages.start[g] + pos) * in_bytes;
    }
    char* out = a.out + i * out_bytes;
    for (int64_t h = lane; h < a.hidden; h += 32) {
      float acc = 0.f;
      for (int r = 0; r < num_rows; ++r) acc += detail::bf16_to_float(reinterpret_cast<const uint16_t*>(rows[r])[h]);
      if (a.bf16) {
        reinterpret_cast<uint16_t*>(out)[h] = detail::float_to_bf16(acc);
      } else {
        reinterpret_cast<float*>(out)[h] = acc;
      }
    }
    if (lane < a.num_topk) {
      float acc = 0.f;
      for (int r = 0; r < num_rows; ++r)
        acc += reinterpret_cast<const float*>(rows[r] + node_weights_offset(a.hidden))[lane];
      reinterpret_cast<float*>(out + out_weights)[lane] = acc;
    }
  }
}

__global__ void __launch_bounds__(kThreads) combine_final_kernel(CombineFinalArgs a) {
  const int lane = threadIdx.x % 32;
  const int64_t in_bytes = partial_record_bytes(a.hidden, a.num_topk, a.bf16);
  const int64_t in_weights = partial_weights_offset(a.hidden, a.bf16);
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; t < a.num_tokens;
       t += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const char* parts[kMaxParts];
    int num_parts = 0;
    for (int n = 0; n < a.num_nodes; ++n) {  // NOTE: nodes ascending, as the host reference
      const int32_t slot = a.node_slot[t * a.num_nodes + n];
      if (slot < 0 || a.messages.start[n] + slot >= a.messages.start[n + 1]) continue;
      parts[num_parts++] = a.in + (a.messages.start[n] + slot) * in_bytes;
    }
    for (int64_t h = lane; h < a.hidden; h += 32) {
      float acc = 0.f;
      for (int p = 0; p < num_parts; ++p) {
        acc += a.bf16 ? detail::bf16_to_float(reinterpret_cast<const uint16_t*>(parts[p])[h])
                      : reinterpret_cast<const float*>(parts[p])[h];
      }
      if (a.bias_0 != nullptr) acc += detail::bf16_to_float(a.bias_0[t * a.hidden + h]);
      if (a.bias_1 != nullptr) acc += detail::bf16_to_float(a.bias_1[t * a.hidden + h]);
      a.out[t * a.hidden + h] = detail::float_to_bf16(acc);
    }
    if (lane < a.num_topk && a.out_weights != nullptr) {
      float acc = 0.f;
      for (int p = 0; p < num_parts; ++p) acc += reinterpret_cast<const float*>(parts[p] + in_weights)[lane];
      a.out_weights[t * a.num_topk + lane] = acc;
    }
  }
}

}  // namespace

void launch_node_scan(const uint8_t* is_token_in_rank, int64_t num_tokens, int num_nodes, int gpus_per_node,
                      int32_t* node_slot, int32_t* node_tok, int32_t* num_tokens_per_node, cudaStream_t stream) {
  node_scan_kernel<<<num_nodes, kScanThreads, 0, stream>>>(is_token_in_rank, num_tokens, num_nodes, gpus_per_node,
                                                           node_slot, node_tok, num_tokens_per_node);
}

void launch_pack(const PackArgs& args, cudaStream_t stream) {
  const int64_t total = args.messages.start[args.messages.num];
  if (total == 0) return;
  pack_kernel<<<grid_for(total), kThreads, 0, stream>>>(args);
}

void launch_forward_scan(const char* relay, RecordLayout rec, int64_t num_records, int gpus_per_node, int32_t* fwd_pos,
                         cudaStream_t stream) {
  if (num_records == 0) return;
  forward_scan_kernel<<<gpus_per_node, kScanThreads, 0, stream>>>(relay, rec, num_records, fwd_pos);
}

void launch_forward_pack(const char* relay, RecordLayout rec, int64_t num_records, int gpus_per_node,
                         const int32_t* fwd_pos, const Parts& messages, char* out, cudaStream_t stream) {
  if (num_records == 0) return;
  forward_pack_kernel<<<grid_for(num_records), kThreads, 0, stream>>>(relay, rec, num_records, gpus_per_node, fwd_pos,
                                                                      messages, out);
}

void launch_unpack(const UnpackArgs& args, cudaStream_t stream) {
  if (args.num_rows == 0) return;
  unpack_kernel<<<grid_for(args.num_rows), kThreads, 0, stream>>>(args);
}

void launch_combine_pack(const CombinePackArgs& args, cudaStream_t stream) {
  const int64_t total = args.blocks.start[args.blocks.num];
  if (total == 0) return;
  combine_pack_kernel<<<grid_for(total), kThreads, 0, stream>>>(args);
}

void launch_combine_reduce_node(const CombineReduceArgs& args, cudaStream_t stream) {
  if (args.num_records == 0) return;
  combine_reduce_node_kernel<<<grid_for(args.num_records), kThreads, 0, stream>>>(args);
}

void launch_combine_final(const CombineFinalArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0) return;
  combine_final_kernel<<<grid_for(args.num_tokens), kThreads, 0, stream>>>(args);
}

cudaError_t preload_hierarchical_kernels() {
  return preload_kernels(
      {reinterpret_cast<const void*>(&node_scan_kernel), reinterpret_cast<const void*>(&forward_scan_kernel),
       reinterpret_cast<const void*>(&pack_kernel), reinterpret_cast<const void*>(&forward_pack_kernel),
       reinterpret_cast<const void*>(&unpack_kernel), reinterpret_cast<const void*>(&combine_pack_kernel),
       reinterpret_cast<const void*>(&combine_reduce_node_kernel),
       reinterpret_cast<const void*>(&combine_final_kernel)});
}

}  // namespace epx::cuda::hier
