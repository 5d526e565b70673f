#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "core/check.h"
#include "cuda/low_latency.h"

namespace epx::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBlock = 128;  // fp8 channels per scale

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

__device__ __forceinline__ float2 bf16x2_to_float2(uint32_t bits) {
  __nv_bfloat162 h;
  memcpy(&h, &bits, 4);
  return __bfloat1622float2(h);
}

__device__ __forceinline__ uint32_t float2_to_bf16x2(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  uint32_t bits;
  memcpy(&bits, &h, 4);
  return bits;
}

// ---- dispatch -----------------------------------------------------------------------------------------

template <typename TopkT>
__global__ void __launch_bounds__(kThreads)
    dispatch_send_kernel(LowLatencyPeers peers, LowLatencyLayout layout, int set, LowLatencyDispatchLaunch args) {
  extern __shared__ int pair_list[];  // [M]: entries t * K + k that chose this block's expert, ascending
  __shared__ int warp_counts[kWarps];
  const int expert = blockIdx.x;
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

  // Positions by ascending entry index (token-major), so slot order is deterministic.
  const auto* topk = static_cast<const TopkT*>(args.topk);
  const int64_t num_entries = args.num_tokens * args.num_topk;
  int total = 0;
  for (int64_t base = 0; base < num_entries; base += kThreads) {
    const int64_t j = base + threadIdx.x;
    const bool match = j < num_entries && static_cast<int64_t>(topk[j]) == expert;
    const unsigned ballot = __ballot_sync(0xffffffffu, match);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int before = total, chunk = 0;
    for (int w = 0; w < kWarps; ++w) {
      before += w < warp ? warp_counts[w] : 0;
      chunk += warp_counts[w];
    }
    if (match) {
      const int pos = before + __popc(ballot & ((1u << lane) - 1u));
      if (pos < M) pair_list[pos] = static_cast<int>(j);
    }
    __syncthreads();
    total += chunk;
  }
  if (total > M && threadIdx.x == 0) record_timeout(peers, dst, expert, /*phase=*/2, M, total);  // overflow
  const int count = total < M ? total : static_cast<int>(M);

  const LowLatencySet& s = layout.sets[set];
  char* dst_base = peers.bases[dst];
  const int64_t slot0 = (e_local * R + peers.rank) * M;
  const auto* x = static_cast<const char*>(args.x);
  for (int i = warp; i < count; i += kWarps) {
    const int j = pair_list[i];
    const int t = j / args.num_topk;
    const int64_t slot = slot0 + i;
    const auto* src = reinterpret_cast<const int4*>(x + static_cast<int64_t>(t) * H * 2);
    if (!args.use_fp8) {
      auto* out = at<int4>(dst_base, s.dispatch_data + slot * H * 2);
      const int64_t n = H * 2 / 16;
#pragma unroll 4
      for (int64_t c = lane; c < n; c += 32) out[c] = __ldg(src + c);
    } else {
      // 16 lanes per 128-channel block (8 channels each), two blocks per warp step.
      const int half = lane >> 4;
      const int hl = lane & 15;
      const int64_t num_blocks = H / kBlock;
      auto* out = at<uint2>(dst_base, s.dispatch_data + slot * H);
      for (int64_t b0 = 0; b0 < num_blocks; b0 += 2) {
        const int64_t b = b0 + half;
        const bool active = b < num_blocks;
        int4 raw = make_int4(0, 0, 0, 0);
        if (active) raw = __ldg(src + b * 16 + hl);
        float v[8];
        const uint32_t words[4] = {static_cast<uint32_t>(raw.x), static_cast<uint32_t>(raw.y),
                                   static_cast<uint32_t>(raw.z), static_cast<uint32_t>(raw.w)};
        float amax = 1e-4f;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const float2 f = bf16x2_to_float2(words[w]);
          v[2 * w] = f.x;
          v[2 * w + 1] = f.y;
          amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
        }
#pragma unroll
        for (int m = 8; m >= 1; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
        float scale_inv;
        if (args.ue8m0) {
          int e = 0;
          const float m = frexpf(amax / 448.f, &e);
          int exponent = (m == 0.5f) ? e - 1 : e;
          exponent = min(max(exponent + 127, 1), 254);
          scale_inv = 1.f / ldexpf(1.f, exponent - 127);
          if (active && hl == 0) at<uint8_t>(dst_base, s.dispatch_scales)[slot * num_blocks + b] = exponent;
        } else {
          scale_inv = 448.f / amax;
          if (active && hl == 0) at<float>(dst_base, s.dispatch_scales)[slot * num_blocks + b] = amax / 448.f;
        }
        uint32_t packed[2];
#pragma unroll
        for (int w = 0; w < 2; ++w) {
          const __nv_fp8x2_storage_t lo =
              __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(v[4 * w], scale_inv), __fmul_rn(v[4 * w + 1], scale_inv)),
                                       __NV_SATFINITE, __NV_E4M3);
          const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(
              make_float2(__fmul_rn(v[4 * w + 2], scale_inv), __fmul_rn(v[4 * w + 3], scale_inv)), __NV_SATFINITE,
              __NV_E4M3);
          packed[w] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
        }
        if (active) out[b * 16 + hl] = make_uint2(packed[0], packed[1]);
      }
    }
    if (lane == 0) {
      at<int>(dst_base, s.dispatch_src_info)[slot] = t;
      at<int>(dst_base, s.dispatch_slot_k)[slot] = j % args.num_topk;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    st_release_sys(at<unsigned long long>(dst_base, s.dispatch_signals) + e_local * R + peers.rank,
                   (tag << 32) | static_cast<unsigned long long>(count));
  }
}

__global__ void __launch_bounds__(kThreads)
    dispatch_recv_kernel(LowLatencyPeers peers, LowLatencyLayout layout, int set, LowLatencyDispatchLaunch args) {
  __shared__ int counts[kLowLatencyMaxRanks];
  const int64_t e_local = blockIdx.x;
  const int R = peers.num_ranks;
  const int64_t M = layout.max_tokens_per_rank;
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
    at<int64_t>(base, s.layout_range)[e_local * R + src] = (static_cast<int64_t>(src * M) << 32) | c;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int sum = 0;
    for (int r = 0; r < R; ++r) sum += counts[r];
    at<int>(base, s.recv_count)[e_local] = sum;
    if (args.cumulative_recv_counts != nullptr) atomicAdd(args.cumulative_recv_counts + e_local, sum);
  }
  int* src_info = at<int>(base, s.dispatch_src_info) + e_local * R * M;
  for (int r = 0; r < R; ++r) {
    for (int64_t i = counts[r] + threadIdx.x; i < M; i += kThreads) src_info[r * M + i] = -1;
  }
  finish_grid(&ctrl->dispatch_ticket[set], &ctrl->dispatch_seq[set]);
}

// ---- combine ------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads)
    combine_send_kernel(LowLatencyPeers peers, LowLatencyLayout layout, int set, LowLatencyCombineLaunch args) {
  const int64_t e_local = blockIdx.x;
  const int R = peers.num_ranks;
  const int64_t M = layout.max_tokens_per_rank;
  const int64_t H = layout.hidden;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  char* base = peers.bases[peers.rank];
  LowLatencyControl* ctrl = control_of(peers, layout);
  const unsigned long long tag = ctrl->combine_seq[set] + 1;
  const LowLatencySet& d = layout.sets[args.dispatch_set];
  const LowLatencySet& c = layout.sets[set];
  const int64_t* ranges = at<int64_t>(base, d.layout_range) + e_local * R;
  const int* src_info = at<int>(base, d.dispatch_src_info);
  const int* slot_k = at<int>(base, d.dispatch_slot_k);
  const auto* x = static_cast<const int4*>(args.x);
  const int64_t row_vecs = H * 2 / 16;
  for (int r = 0; r < R; ++r) {
    if (ld_volatile(&ctrl->mask[r]) != 0) continue;
    const int count = static_cast<int>(ranges[r] & 0xffffffff);
    for (int i = warp; i < count; i += kWarps) {
      const int64_t slot = e_local * R * M + r * M + i;
      const int t = src_info[slot];
      const int k = slot_k[slot];
      auto* out = at<int4>(peers.bases[r], c.combine_data + (static_cast<int64_t>(t) * kLowLatencyMaxTopk + k) * H * 2);
      const int4* src = x + slot * row_vecs;
#pragma unroll 4
      for (int64_t v = lane; v < row_vecs; v += 32) out[v] = __ldg(src + v);
    }
  }
  __syncthreads();
  if (threadIdx.x < R && ld_volatile(&ctrl->mask[threadIdx.x]) == 0) {
    const int r = threadIdx.x;
    __threadfence_system();
    st_release_sys(
        at<unsigned long long>(peers.bases[r], c.combine_signals) + peers.rank * layout.num_local_experts + e_local,
        tag);
  }
}

template <typename TopkT>
__global__ void __launch_bounds__(kThreads)
    combine_recv_kernel(LowLatencyPeers peers, LowLatencyLayout layout, int set, LowLatencyCombineLaunch args) {
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
  for (int64_t t = blockIdx.x; t < args.num_tokens; t += gridDim.x) {
    __syncthreads();  // weights[] of the previous token are no longer read
    if (threadIdx.x < K) {
      const int k = threadIdx.x;
      const int64_t e = static_cast<int64_t>(topk[t * K + k]);
      bool ok = false;
      if (e >= 0) {
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
    const int64_t row_vecs = H / 8;
    for (int64_t v = threadIdx.x; v < row_vecs; v += kThreads) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int k = 0; k < K; ++k) {
        if (!valid[k]) continue;
        const uint4 raw = rows[k * row_vecs + v];
        const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const float2 f = bf16x2_to_float2(words[w]);
          // NOTE: explicit rounding (no FMA contraction) so the sum matches the host backend bit for bit.
          acc[2 * w] = __fadd_rn(acc[2 * w], __fmul_rn(weights[k], f.x));
          acc[2 * w + 1] = __fadd_rn(acc[2 * w + 1], __fmul_rn(weights[k], f.y));
        }
      }
      out[t * row_vecs + v] = make_uint4(float2_to_bf16x2(acc[0], acc[1]), float2_to_bf16x2(acc[2], acc[3]),
                                         float2_to_bf16x2(acc[4], acc[5]), float2_to_bf16x2(acc[6], acc[7]));
    }
  }
  finish_grid(&ctrl->combine_ticket[set], &ctrl->combine_seq[set]);
}

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) detail::raise(ErrorCode::kCudaError, "{} launch failed: {}", what, cudaGetErrorString(err));
}

}  // namespace

void launch_low_latency_dispatch_send(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                      const LowLatencyDispatchLaunch& args, cudaStream_t stream) {
  const size_t smem = static_cast<size_t>(layout.max_tokens_per_rank) * sizeof(int);
  const dim3 grid(static_cast<unsigned>(layout.num_experts));
  if (args.topk_int64) {
    dispatch_send_kernel<int64_t><<<grid, kThreads, smem, stream>>>(peers, layout, set, args);
  } else {
    dispatch_send_kernel<int32_t><<<grid, kThreads, smem, stream>>>(peers, layout, set, args);
  }
  check_launch("low-latency dispatch send");
}

void launch_low_latency_dispatch_recv(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                      const LowLatencyDispatchLaunch& args, cudaStream_t stream) {
  dispatch_recv_kernel<<<static_cast<unsigned>(layout.num_local_experts), kThreads, 0, stream>>>(peers, layout, set,
                                                                                                 args);
  check_launch("low-latency dispatch receive");
}

void launch_low_latency_combine_send(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                     const LowLatencyCombineLaunch& args, cudaStream_t stream) {
  combine_send_kernel<<<static_cast<unsigned>(layout.num_local_experts), kThreads, 0, stream>>>(peers, layout, set,
                                                                                                args);
  check_launch("low-latency combine send");
}

void launch_low_latency_combine_recv(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                     const LowLatencyCombineLaunch& args, cudaStream_t stream) {
  // At least one block, so the set's sequence number advances on an idle rank too.
  const int64_t blocks = args.num_tokens < 1 ? 1 : (args.num_tokens < 264 ? args.num_tokens : 264);
  if (args.topk_int64) {
    combine_recv_kernel<int64_t><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(peers, layout, set, args);
  } else {
    combine_recv_kernel<int32_t><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(peers, layout, set, args);
  }
  check_launch("low-latency combine receive");
}

}  // namespace epx::cuda
