#include <cuda_fp8.h>

#include <cstdlib>

#include "core/bf16.h"
#include "core/check.h"
#include "cuda/low_latency.h"

namespace epx::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBlock = 128;  // fp8 channels per scale
constexpr int kUnroll = 8;   // loads in flight per thread in the copy loops

__device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Masks change under a running kernel (another block's timeout): read them past the L1.
__device__ __forceinline__ int ld_volatile(const int* p) {
  int v;
  asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

template <typename T>
__device__ __forceinline__ T* at(char* base, int64_t offset) {
  return reinterpret_cast<T*>(base + offset);
}

__device__ __forceinline__ LowLatencyControl* control_of(const LowLatencyPeers& peers, const LowLatencyLayout& layout) {
  return at<LowLatencyControl>(peers.bases[peers.rank], layout.control_offset);
}

__device__ void record_timeout(const LowLatencyPeers& peers, int peer, int expert, int phase, unsigned long long tag,
                               unsigned long long observed) {
  if (peers.diag == nullptr) return;
  peers.diag->peer = peer;
  peers.diag->expert = expert;
  peers.diag->phase = phase;
  peers.diag->expected_tag = static_cast<long long>(tag);
  peers.diag->observed = static_cast<long long>(observed);
  __threadfence_system();
  atomicExch(&peers.diag->flag, 1);
}

// Waits until the tag in the upper 32 bits (or the whole word, tag_shift = 0) equals `tag`. On timeout the peer
// is masked locally and a diagnostic recorded; returns false.
__device__ bool wait_tag(const LowLatencyPeers& peers, LowLatencyControl* ctrl, const unsigned long long* signal,
                         unsigned long long tag, int tag_shift, int peer, int expert, int phase,
                         unsigned long long* value) {
  const long long start = clock64();
  while (true) {
    const unsigned long long v = ld_acquire_sys(signal);
    if ((v >> tag_shift) == tag) {
      *value = v;
      return true;
    }
    if (ld_volatile(&ctrl->mask[peer]) != 0) return false;  // masked meanwhile by another block's timeout
    if (clock64() - start > peers.timeout_cycles) {
      atomicExch(&ctrl->mask[peer], 1);
      record_timeout(peers, peer, expert, phase, tag, v);
      return false;
    }
  }
}

// The last block of a grid to finish advances the set's sequence number (all blocks read it at start).
__device__ void finish_grid(unsigned int* ticket, unsigned long long* seq) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned int prev = atomicAdd(ticket, 1u);
    if (prev == gridDim.x - 1) {
      *ticket = 0;
      *seq += 1;
      __threadfence();
    }
  }
}

// Slices per token in the combine receive: small batches spread each token over several blocks (a token's
// reduction alone is a chain of dependent load rounds), so that T * parts fills up to kCombineRecvBlocks blocks.
constexpr int kCombineRecvBlocks = 264;
__host__ __device__ inline int combine_recv_parts(int64_t num_tokens) {
  return num_tokens <= kCombineRecvBlocks / 8   ? 8
         : num_tokens <= kCombineRecvBlocks / 4 ? 4
         : num_tokens <= kCombineRecvBlocks / 2 ? 2
                                                : 1;
}

// Quantizes the 16 bf16 channels in (lo, hi) as part of a 128-channel block held by 8 consecutive lanes (the
// whole warp must call: the block maximum is a shuffle over the 8 lanes). Writes the 16 fp8 values to *packed
// and returns the scale to store: amax / 448 (fp32 scales) or the biased UE8M0 exponent.
__device__ __forceinline__ float quantize_16(int4 lo, int4 hi, bool ue8m0, uint4* packed) {
  float v[16];
  const uint32_t words[8] = {static_cast<uint32_t>(lo.x), static_cast<uint32_t>(lo.y), static_cast<uint32_t>(lo.z),
                             static_cast<uint32_t>(lo.w), static_cast<uint32_t>(hi.x), static_cast<uint32_t>(hi.y),
                             static_cast<uint32_t>(hi.z), static_cast<uint32_t>(hi.w)};
  float amax = 1e-4f;
#pragma unroll
  for (int w = 0; w < 8; ++w) {
    const float2 f = detail::cvt_bf16x2_to_float2(words[w]);
    v[2 * w] = f.x;
    v[2 * w + 1] = f.y;
    amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
  }
#pragma unroll
  for (int m = 4; m >= 1; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
  float scale_inv, scale;
  if (ue8m0) {
    int e = 0;
    const float m = frexpf(amax / 448.f, &e);
    int exponent = (m == 0.5f) ? e - 1 : e;
    exponent = min(max(exponent + 127, 1), 254);
    scale_inv = 1.f / ldexpf(1.f, exponent - 127);
    scale = static_cast<float>(exponent);
  } else {
    scale_inv = 448.f / amax;
    scale = amax / 448.f;
  }
  uint32_t out[4];
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const __nv_fp8x2_storage_t a = __nv_cvt_float2_to_fp8x2(
        make_float2(__fmul_rn(v[4 * w], scale_inv), __fmul_rn(v[4 * w + 1], scale_inv)), __NV_SATFINITE, __NV_E4M3);
    const __nv_fp8x2_storage_t b = __nv_cvt_float2_to_fp8x2(
        make_float2(__fmul_rn(v[4 * w + 2], scale_inv), __fmul_rn(v[4 * w + 3], scale_inv)), __NV_SATFINITE, __NV_E4M3);
    out[w] = static_cast<uint32_t>(a) | (static_cast<uint32_t>(b) << 16);
  }
  *packed = make_uint4(out[0], out[1], out[2], out[3]);
  return scale;
}

// ---- dispatch -----------------------------------------------------------------------------------------

// One block sends the pairs of one global expert.
template <typename TopkT>
__device__ void dispatch_send_block(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                    const LowLatencyDispatchLaunch& args, int expert) {
  extern __shared__ int pair_list[];  // [M]: entries t * K + k that chose this block's expert, ascending
  __shared__ int warp_counts[kWarps];
  const int64_t num_local = layout.num_local_experts;
  const int dst = static_cast<int>(expert / num_local);
  const int64_t e_local = expert % num_local;
  const int64_t M = layout.max_tokens_per_rank;
  const int64_t H = layout.hidden;
  const int R = peers.num_ranks;
  LowLatencyControl* ctrl = control_of(peers, layout);
  if (ld_volatile(&ctrl->mask[dst]) != 0) return;
  const unsigned long long tag = ctrl->dispatch_seq[set] + 1;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;

  // Positions by ascending entry index (token-major), so slot order is deterministic. Each thread owns a
  // contiguous chunk of entries: it counts its matches (independent loads), a block-wide exclusive scan gives
  // each chunk's first position, and a second pass over the chunk (now in L1) writes the pair list.
  const auto* topk = static_cast<const TopkT*>(args.topk);
  const int64_t num_entries = args.num_tokens * args.num_topk;
  const int64_t chunk = (num_entries + kThreads - 1) / kThreads;
  const int64_t begin = threadIdx.x * chunk;
  const int64_t end = begin + chunk < num_entries ? begin + chunk : num_entries;
  int mine = 0;
#pragma unroll 4
  for (int64_t j = begin; j < end; ++j) mine += static_cast<int64_t>(topk[j]) == expert;
  int inclusive = mine;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += other;
  }
  if (lane == 31) warp_counts[warp] = inclusive;
  __syncthreads();
  int pos = inclusive - mine, total = 0;
  for (int w = 0; w < kWarps; ++w) {
    pos += w < warp ? warp_counts[w] : 0;
    total += warp_counts[w];
  }
  for (int64_t j = begin; j < end && pos < M; ++j) {
    if (static_cast<int64_t>(topk[j]) == expert) pair_list[pos++] = static_cast<int>(j);
  }
  __syncthreads();
  if (total > M && threadIdx.x == 0) record_timeout(peers, dst, expert, /*phase=*/2, M, total);  // overflow
  const int count = total < M ? total : static_cast<int>(M);

  const LowLatencySet& s = layout.sets[set];
  char* dst_base = peers.bases[dst];
  const int64_t slot0 = (e_local * R + peers.rank) * M;
  const auto* x = static_cast<const char*>(args.x);
  for (int i = threadIdx.x; i < count; i += kThreads) {
    at<int>(dst_base, s.dispatch_src_info)[slot0 + i] = pair_list[i] / args.num_topk;
    at<int>(dst_base, s.dispatch_slot_k)[slot0 + i] = pair_list[i] % args.num_topk;
  }
  // The rows are spread over the whole block (not a warp per row) and each thread keeps kUnroll loads in
  // flight: a row is ~900 16-byte vectors, and a warp walking it alone is a chain of dependent round trips.
  if (!args.use_fp8) {
    const int64_t row_vecs = H / 8;
    const int64_t items = count * row_vecs;
    for (int64_t base = threadIdx.x; base < items; base += kThreads * kUnroll) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t item = base + u * kThreads;
        if (item < items) {
          const int64_t i = item / row_vecs;
          const int t = pair_list[i] / args.num_topk;
          v[u] = __ldg(reinterpret_cast<const int4*>(x + static_cast<int64_t>(t) * H * 2) + (item - i * row_vecs));
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t item = base + u * kThreads;
        if (item < items) {
          const int64_t i = item / row_vecs;
          at<int4>(dst_base, s.dispatch_data + (slot0 + i) * H * 2)[item - i * row_vecs] = v[u];
        }
      }
    }
  } else {
    // One item = four consecutive 128-channel blocks of one row, quantized by a warp: 8 lanes per block, 16
    // channels per lane, so each lane stores 16 fp8 bytes and the warp 512 contiguous bytes; lane 0 stores the
    // four scales at once where they are aligned (num_blocks % 4 == 0, e.g. H = 7168), else lanes 0/8/16/24
    // store one each. (Per-block 8-byte stores plus a 4-byte store per scale ran at half the NVLink rate.)
    const int64_t num_blocks = H / kBlock;
    const int64_t num_groups = (num_blocks + 3) / 4;
    const int64_t items = count * num_groups;
    const int sub = lane & 7;  // 16-channel piece within the block
    const int bg = lane >> 3;  // block within the group
    const bool packed_scales = num_blocks % 4 == 0;
    constexpr int kFp8Unroll = kUnroll / 2;  // two 16-byte loads per lane and item
    for (int64_t base = warp; base < items; base += kWarps * kFp8Unroll) {
      int4 raw[kFp8Unroll][2];
#pragma unroll
      for (int u = 0; u < kFp8Unroll; ++u) {
        const int64_t item = base + u * kWarps;
        raw[u][0] = raw[u][1] = make_int4(0, 0, 0, 0);
        if (item < items) {
          const int64_t i = item / num_groups;
          const int64_t b = (item - i * num_groups) * 4 + bg;
          if (b < num_blocks) {
            const int t = pair_list[i] / args.num_topk;
            const auto* src = reinterpret_cast<const int4*>(x + static_cast<int64_t>(t) * H * 2) + b * 16 + sub * 2;
            raw[u][0] = __ldg(src);
            raw[u][1] = __ldg(src + 1);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kFp8Unroll; ++u) {
        const int64_t item = base + u * kWarps;  // the same for the whole warp
        if (item >= items) break;
        const int64_t i = item / num_groups;
        const int64_t g = item - i * num_groups;
        const int64_t b = g * 4 + bg;
        const int64_t slot = slot0 + i;
        uint4 packed;
        const float scale = quantize_16(raw[u][0], raw[u][1], args.ue8m0, &packed);
        if (b < num_blocks) at<uint4>(dst_base, s.dispatch_data + slot * H + b * kBlock)[sub] = packed;
        if (packed_scales) {
          const float s1 = __shfl_sync(0xffffffffu, scale, 8), s2 = __shfl_sync(0xffffffffu, scale, 16),
                      s3 = __shfl_sync(0xffffffffu, scale, 24);
          if (lane == 0) {
            if (args.ue8m0) {
              const uint32_t word = static_cast<uint32_t>(scale) | (static_cast<uint32_t>(s1) << 8) |
                                    (static_cast<uint32_t>(s2) << 16) | (static_cast<uint32_t>(s3) << 24);
              at<uint32_t>(dst_base, s.dispatch_scales)[(slot * num_blocks + g * 4) / 4] = word;
            } else {
              at<float4>(dst_base, s.dispatch_scales)[(slot * num_blocks + g * 4) / 4] = make_float4(scale, s1, s2, s3);
            }
          }
        } else if (sub == 0 && b < num_blocks) {
          if (args.ue8m0) {
            at<uint8_t>(dst_base, s.dispatch_scales)[slot * num_blocks + b] = static_cast<uint8_t>(scale);
          } else {
            at<float>(dst_base, s.dispatch_scales)[slot * num_blocks + b] = scale;
          }
        }
      }
    }
  }
  // The barrier orders every thread's stores before thread 0's release store (cumulativity): no separate
  // fence.sys, which would cost one more NVLink round trip per block.
  __syncthreads();
  if (threadIdx.x == 0) {
    st_release_sys(at<unsigned long long>(dst_base, s.dispatch_signals) + e_local * R + peers.rank,
                   (tag << 32) | static_cast<unsigned long long>(count));
  }
}

// One block receives for one local expert: waits for its R signals, then copies the R staged blocks into the
// packed output (source r's block at rows [begin_r, begin_r + count_r), begin_r = the counts of sources < r)
// and writes counts, ranges and src_info (-1 past the count).
// NOTE: memory order: thread r acquires source r's signal (ld.acquire.sys); the __syncthreads() after the waits
// extends that to every thread of the block, which then reads the staged rows with ld.global.cg (L2, no L1
// line that could predate the peer's stores). The packed outputs are local stores read by later kernels.
__device__ void dispatch_recv_block(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                    const LowLatencyDispatchLaunch& args, int64_t e_local) {
  __shared__ int counts[kLowLatencyMaxRanks];
  __shared__ int begins[kLowLatencyMaxRanks + 1];  // packed row of each source's first pair; [R] = the total
  const int R = peers.num_ranks;
  const int64_t M = layout.max_tokens_per_rank;
  const int64_t H = layout.hidden;
  char* base = peers.bases[peers.rank];
  const LowLatencySet& s = layout.sets[set];
  LowLatencyControl* ctrl = control_of(peers, layout);
  const unsigned long long tag = ctrl->dispatch_seq[set] + 1;
  if (threadIdx.x < R) {
    const int src = threadIdx.x;
    int c = 0;
    unsigned long long v = 0;
    if (ld_volatile(&ctrl->mask[src]) == 0 &&
        wait_tag(peers, ctrl, at<unsigned long long>(base, s.dispatch_signals) + e_local * R + src, tag, 32, src,
                 static_cast<int>(src * layout.num_local_experts + e_local), 0, &v)) {
      c = static_cast<int>(v & 0xffffffffu);
    }
    counts[src] = c;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int sum = 0;
    for (int r = 0; r < R; ++r) {
      begins[r] = sum;
      sum += counts[r];
    }
    begins[R] = sum;
    at<int>(base, s.recv_count)[e_local] = sum;
    if (args.cumulative_recv_counts != nullptr) atomicAdd(args.cumulative_recv_counts + e_local, sum);
  }
  __syncthreads();
  if (threadIdx.x < R) {
    const int r = threadIdx.x;
    at<int64_t>(base, s.layout_range)[e_local * R + r] = (static_cast<int64_t>(begins[r]) << 32) | counts[r];
  }
  const int total = begins[R];
  const int64_t row0 = e_local * R * M;  // the expert's first row, staged and packed
  // Staged row of packed row `row`: source r's block at r * M.
  auto staged_row = [&](int row) {
    int r = 0;
    while (row >= begins[r + 1]) ++r;
    return row0 + r * M + (row - begins[r]);
  };
  // Data: the block's rows spread over all threads, kUnroll loads in flight per thread (as the send side).
  {
    const int64_t row_vecs = (args.use_fp8 ? H : H * 2) / 16;
    const int4* src = at<const int4>(base, s.dispatch_data);
    int4* dst = at<int4>(base, s.recv_x);
    const int64_t items = total * row_vecs;
    for (int64_t first = threadIdx.x; first < items; first += kThreads * kUnroll) {
      int4 v[kUnroll];
      int64_t out[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t item = first + u * kThreads;
        if (item < items) {
          const int row = static_cast<int>(item / row_vecs);
          const int64_t vec = item - row * row_vecs;
          v[u] = __ldcg(src + staged_row(row) * row_vecs + vec);
          out[u] = (row0 + row) * row_vecs + vec;
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (first + u * kThreads < items) dst[out[u]] = v[u];
      }
    }
  }
  if (args.use_fp8) {
    // Scale rows are H / 128 fp32 or uint8 values: copied as 32-bit words when a row is a whole number of
    // words (always for fp32; UE8M0 when H % 512 == 0), else byte by byte.
    const int64_t row_bytes = (H / kBlock) * (args.ue8m0 ? 1 : 4);
    const bool words = row_bytes % 4 == 0;
    const int64_t row_units = words ? row_bytes / 4 : row_bytes;
    const int64_t items = total * row_units;
    for (int64_t item = threadIdx.x; item < items; item += kThreads) {
      const int row = static_cast<int>(item / row_units);
      const int64_t unit = item - row * row_units;
      const int64_t from = staged_row(row) * row_units + unit, to = (row0 + row) * row_units + unit;
      if (words) {
        at<uint32_t>(base, s.recv_x_scales)[to] = __ldcg(at<const unsigned int>(base, s.dispatch_scales) + from);
      } else {
        at<uint8_t>(base, s.recv_x_scales)[to] = __ldcg(at<const unsigned char>(base, s.dispatch_scales) + from);
      }
    }
  }
  const int* staged_src_info = at<const int>(base, s.dispatch_src_info);
  int* src_info = at<int>(base, s.recv_src_info);
  for (int row = threadIdx.x; row < R * M; row += kThreads) {
    src_info[row0 + row] = row < total ? __ldcg(staged_src_info + staged_row(row)) : -1;
  }
}

// ---- combine ------------------------------------------------------------------------------------------

// Grid: `parts` blocks per local expert (a power of two), each taking every parts-th vector of the expert's
// rows; the last block of an expert to finish (a monotonic per-expert counter) raises the expert's signals.
__device__ void combine_send_block(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                   const LowLatencyCombineLaunch& args, int64_t block, int parts) {
  __shared__ int row_start[kLowLatencyMaxRanks + 1];  // prefix of the rows to send, by destination rank
  __shared__ int row_begin[kLowLatencyMaxRanks];      // packed row of rank r's first pair in x (the dispatch's)
  __shared__ bool last_part;
  const int64_t e_local = block / parts;
  const int part = static_cast<int>(block % parts);
  const int R = peers.num_ranks;
  const int64_t M = layout.max_tokens_per_rank;
  const int64_t H = layout.hidden;
  char* base = peers.bases[peers.rank];
  LowLatencyControl* ctrl = control_of(peers, layout);
  const unsigned long long tag = ctrl->combine_seq[set] + 1;
  const LowLatencySet& d = layout.sets[args.dispatch_set];
  const LowLatencySet& c = layout.sets[set];
  if (threadIdx.x == 0) {
    const int64_t* ranges = at<int64_t>(base, d.layout_range) + e_local * R;
    int rows = 0;
    for (int r = 0; r < R; ++r) {
      row_start[r] = rows;
      row_begin[r] = static_cast<int>(ranges[r] >> 32);
      if (ld_volatile(&ctrl->mask[r]) == 0) rows += static_cast<int>(ranges[r] & 0xffffffff);
    }
    row_start[R] = rows;
  }
  __syncthreads();
  const int* src_info = at<int>(base, d.dispatch_src_info);
  const int* slot_k = at<int>(base, d.dispatch_slot_k);
  const auto* x = static_cast<const int4*>(args.x);
  const int64_t row_vecs = H / 8;
  const int64_t items = static_cast<int64_t>(row_start[R]) * row_vecs;
  const int64_t kStride = static_cast<int64_t>(kThreads) * parts;
  for (int64_t first = part * kThreads + threadIdx.x; first < items; first += kStride * kUnroll) {
    int4 v[kUnroll];
    int64_t dst_offset[kUnroll];
    int dst_rank[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t item = first + u * kStride;
      if (item < items) {
        const int row = static_cast<int>(item / row_vecs);
        const int64_t vec = item - row * row_vecs;
        int r = 0;
        while (row >= row_start[r + 1]) ++r;
        const int i = row - row_start[r];                // the pair's index in rank r's block
        const int64_t slot = (e_local * R + r) * M + i;  // staged row: src_info and slot_k stay there
        v[u] = __ldg(x + (e_local * R * M + row_begin[r] + i) * row_vecs + vec);
        dst_rank[u] = r;
        dst_offset[u] = (static_cast<int64_t>(src_info[slot]) * kLowLatencyMaxTopk + slot_k[slot]) * H * 2 + vec * 16;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (first + u * kStride < items) at<int4>(peers.bases[dst_rank[u]], c.combine_data + dst_offset[u])[0] = v[u];
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    // NOTE: monotonic (no reset); parts is a power of two, fixed per buffer, so the wrap at 2^32 keeps the phase.
    const unsigned int done = atomicAdd(&ctrl->combine_parts_done[e_local], 1u) + 1;
    last_part = done % static_cast<unsigned>(parts) == 0;
    if (last_part) __threadfence();  // acquire: the other parts' stores, fenced before their increments
  }
  __syncthreads();
  if (last_part && threadIdx.x < R && ld_volatile(&ctrl->mask[threadIdx.x]) == 0) {
    const int r = threadIdx.x;
    st_release_sys(
        at<unsigned long long>(peers.bases[r], c.combine_signals) + peers.rank * layout.num_local_experts + e_local,
        tag);
  }
}

// Blocks first_block, first_block + num_blocks, ... of the receive: one unit each at a time, where a unit is
// one of combine_recv_parts(T) slices of one token's hidden vector.
template <typename TopkT>
__device__ void combine_recv_blocks(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                    const LowLatencyCombineLaunch& args, int64_t first_block, int64_t num_blocks) {
  __shared__ float weights[kLowLatencyMaxTopk];
  __shared__ bool valid[kLowLatencyMaxTopk];  // the slot contributes: a chosen expert on an unmasked rank
  const int64_t H = layout.hidden;
  const int K = args.num_topk;
  char* base = peers.bases[peers.rank];
  LowLatencyControl* ctrl = control_of(peers, layout);
  const unsigned long long tag = ctrl->combine_seq[set] + 1;
  const LowLatencySet& c = layout.sets[set];
  const auto* topk = static_cast<const TopkT*>(args.topk);
  auto* out = static_cast<uint4*>(args.out);
  const int64_t row_vecs = H / 8;
  const int parts = combine_recv_parts(args.num_tokens);
  const int64_t part_vecs = (row_vecs + parts - 1) / parts;
  for (int64_t unit = first_block; unit < args.num_tokens * parts; unit += num_blocks) {
    const int64_t t = unit / parts;
    const int64_t v_begin = (unit % parts) * part_vecs;
    const int64_t v_end = v_begin + part_vecs < row_vecs ? v_begin + part_vecs : row_vecs;
    __syncthreads();  // weights[] of the previous token are no longer read
    if (threadIdx.x < K) {
      const int k = threadIdx.x;
      const int64_t e = static_cast<int64_t>(topk[t * K + k]);
      bool ok = false;
      // NOTE: an id outside [0, num_experts) was sent to no expert by dispatch: treat it as -1 here too
      // instead of indexing the mask and the signals out of bounds.
      if (e >= 0 && e < layout.num_experts) {
        const int r = static_cast<int>(e / layout.num_local_experts);
        unsigned long long v = 0;
        if (ld_volatile(&ctrl->mask[r]) == 0 &&
            wait_tag(peers, ctrl, at<unsigned long long>(base, c.combine_signals) + e, tag, 0, r, static_cast<int>(e),
                     1, &v)) {
          ok = true;
        }
      }
      valid[k] = ok;
      weights[k] = ok ? args.topk_weights[t * K + k] : 0.f;
    }
    __syncthreads();
    const auto* rows = at<const uint4>(base, c.combine_data + t * kLowLatencyMaxTopk * H * 2);
    for (int64_t v = v_begin + threadIdx.x; v < v_end; v += kThreads) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      // The rows of kChunk slots are loaded before any is added (loads in flight), then added in ascending k.
      constexpr int kChunk = 8;
      for (int k0 = 0; k0 < K; k0 += kChunk) {
        uint4 raw[kChunk] = {};
#pragma unroll
        for (int u = 0; u < kChunk; ++u) {
          const int k = k0 + u;
          if (k < K && valid[k]) raw[u] = rows[k * row_vecs + v];
        }
#pragma unroll
        for (int u = 0; u < kChunk; ++u) {
          const int k = k0 + u;
          if (k >= K || !valid[k]) continue;
          const uint32_t words[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
#pragma unroll
          for (int w = 0; w < 4; ++w) {
            const float2 f = detail::cvt_bf16x2_to_float2(words[w]);
            // NOTE: explicit rounding (no FMA contraction) so the sum matches the host backend bit for bit.
            acc[2 * w] = __fadd_rn(acc[2 * w], __fmul_rn(weights[k], f.x));
            acc[2 * w + 1] = __fadd_rn(acc[2 * w + 1], __fmul_rn(weights[k], f.y));
          }
        }
      }
      out[t * row_vecs + v] =
          make_uint4(detail::cvt_float2_to_bf16x2(acc[0], acc[1]), detail::cvt_float2_to_bf16x2(acc[2], acc[3]),
                     detail::cvt_float2_to_bf16x2(acc[4], acc[5]), detail::cvt_float2_to_bf16x2(acc[6], acc[7]));
    }
  }
}

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) detail::raise(ErrorCode::kCudaError, "{} launch failed: {}", what, cudaGetErrorString(err));
}

// At least one block, so the set's sequence number advances on an idle rank too.
unsigned combine_recv_blocks_for(int64_t num_tokens) {
  const int64_t units = num_tokens * combine_recv_parts(num_tokens);
  return static_cast<unsigned>(units < 1 ? 1 : (units < kCombineRecvBlocks ? units : kCombineRecvBlocks));
}

}  // namespace

// ---- kernels ------------------------------------------------------------------------------------------

// NOTE: one kernel function per direction, the phase a runtime argument. Profiler-based tools (DeepEP's
// bench_kineto in its test_low_latency.py) look kernels up by name: exactly one kernel name may contain
// "dispatch" and one "combine", launched once per call, or twice with a hook (send, then receive). A named
// namespace, so that the demangled name reads epx::cuda::ll::dispatch<...>; no parameter type may contain the
// other direction's word. The phase branch is uniform over the grid; the register count is the larger of the
// two halves' (as the fused kernels' always was).
namespace ll {

enum class Phase : int {
  kSend = 1,  // the hook's first half
  kRecv = 2,  // the hook's second half
  kBoth = 3,  // no hook: both halves in one launch
};

// kSend: one block per global expert. kRecv: one block per local expert. kBoth: every block sends one expert,
// then the last E_local blocks (scheduled last, so no waiting block keeps a sending block off the SMs) receive
// one local expert each, saving a launch on the critical path.
template <typename TopkT>
__global__ void __launch_bounds__(kThreads)
    dispatch(LowLatencyPeers peers, LowLatencyLayout layout, int set, LowLatencyDispatchLaunch args, Phase phase) {
  if (phase != Phase::kRecv) {
    dispatch_send_block<TopkT>(peers, layout, set, args, blockIdx.x);
    if (phase == Phase::kSend) return;
  }
  const int64_t first_recv = phase == Phase::kBoth ? layout.num_experts - layout.num_local_experts : 0;
  if (blockIdx.x >= first_recv) {
    if (phase == Phase::kBoth) __syncthreads();
    dispatch_recv_block(peers, layout, set, args, blockIdx.x - first_recv);
  }
  LowLatencyControl* ctrl = control_of(peers, layout);
  finish_grid(&ctrl->dispatch_ticket[set], &ctrl->dispatch_seq[set]);
}

// kSend: `parts` blocks per local expert. kRecv: the receive blocks. kBoth: the first E_local * parts blocks
// send, the rest receive.
template <typename TopkT>
__global__ void __launch_bounds__(kThreads) combine(LowLatencyPeers peers, LowLatencyLayout layout, int set,
                                                    LowLatencyCombineLaunch args, int parts, Phase phase) {
  const int64_t num_send = phase == Phase::kRecv ? 0 : layout.num_local_experts * parts;
  if (blockIdx.x < num_send) {
    combine_send_block(peers, layout, set, args, blockIdx.x, parts);
    if (phase == Phase::kSend) return;
  } else {
    combine_recv_blocks<TopkT>(peers, layout, set, args, blockIdx.x - num_send, gridDim.x - num_send);
  }
  LowLatencyControl* ctrl = control_of(peers, layout);
  finish_grid(&ctrl->combine_ticket[set], &ctrl->combine_seq[set]);
}

}  // namespace ll

cudaError_t preload_low_latency_kernels() {
  const void* kernels[] = {
      reinterpret_cast<const void*>(&ll::dispatch<int64_t>), reinterpret_cast<const void*>(&ll::dispatch<int32_t>),
      reinterpret_cast<const void*>(&ll::combine<int64_t>), reinterpret_cast<const void*>(&ll::combine<int32_t>)};
  for (const void* k : kernels) {
    cudaFuncAttributes attr{};
    const cudaError_t err = cudaFuncGetAttributes(&attr, k);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

namespace {

// Launch shape per phase (see ll::dispatch): the send blocks keep their pair list in dynamic shared memory.
void launch_dispatch(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                     const LowLatencyDispatchLaunch& args, ll::Phase phase, cudaStream_t stream, const char* what) {
  const bool recv_only = phase == ll::Phase::kRecv;
  const dim3 grid(static_cast<unsigned>(recv_only ? layout.num_local_experts : layout.num_experts));
  const size_t smem = recv_only ? 0 : static_cast<size_t>(layout.max_tokens_per_rank) * sizeof(int);
  // NOTE: both halves of a hook call must pick the same instantiation (one kernel name per call).
  if (args.topk_int64) {
    ll::dispatch<int64_t><<<grid, kThreads, smem, stream>>>(peers, layout, set, args, phase);
  } else {
    ll::dispatch<int32_t><<<grid, kThreads, smem, stream>>>(peers, layout, set, args, phase);
  }
  check_launch(what);
}

// Launch shape per phase (see ll::combine).
void launch_combine(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                    const LowLatencyCombineLaunch& args, ll::Phase phase, cudaStream_t stream, const char* what) {
  const int parts = args.send_parts;
  const unsigned num_send = phase == ll::Phase::kRecv ? 0 : static_cast<unsigned>(layout.num_local_experts * parts);
  const unsigned num_recv = phase == ll::Phase::kSend ? 0 : combine_recv_blocks_for(args.num_tokens);
  const dim3 grid(num_send + num_recv);
  if (args.topk_int64) {
    ll::combine<int64_t><<<grid, kThreads, 0, stream>>>(peers, layout, set, args, parts, phase);
  } else {
    ll::combine<int32_t><<<grid, kThreads, 0, stream>>>(peers, layout, set, args, parts, phase);
  }
  check_launch(what);
}

}  // namespace

void launch_low_latency_dispatch_send(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                      const LowLatencyDispatchLaunch& args, cudaStream_t stream) {
  launch_dispatch(peers, layout, set, args, ll::Phase::kSend, stream, "low-latency dispatch send");
}

void launch_low_latency_dispatch_recv(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                      const LowLatencyDispatchLaunch& args, cudaStream_t stream) {
  launch_dispatch(peers, layout, set, args, ll::Phase::kRecv, stream, "low-latency dispatch receive");
}

void launch_low_latency_dispatch(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                 const LowLatencyDispatchLaunch& args, cudaStream_t stream) {
  launch_dispatch(peers, layout, set, args, ll::Phase::kBoth, stream, "low-latency dispatch");
}

void launch_low_latency_combine_send(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                     const LowLatencyCombineLaunch& args, cudaStream_t stream) {
  launch_combine(peers, layout, set, args, ll::Phase::kSend, stream, "low-latency combine send");
}

void launch_low_latency_combine_recv(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                     const LowLatencyCombineLaunch& args, cudaStream_t stream) {
  launch_combine(peers, layout, set, args, ll::Phase::kRecv, stream, "low-latency combine receive");
}

void launch_low_latency_combine(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                const LowLatencyCombineLaunch& args, cudaStream_t stream) {
  launch_combine(peers, layout, set, args, ll::Phase::kBoth, stream, "low-latency combine");
}

}  // namespace epx::cuda
