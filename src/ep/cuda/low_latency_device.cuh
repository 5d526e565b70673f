// Device helpers of the low-latency kernel files (low_latency_dispatch.cu, low_latency_combine.cu) over the device
// layer (src/comm/cuda/device/: memory ordering, the bounded wait, the error record, the last-block finisher): launch
// constants, the unrolled copy loop, the tag wait and the grid finisher of this path, fp8 quantization and the
// combine's receive split; the launch by topk id type; the kernels' phase. Protocol: docs/low-latency.md.
// NOTE: inline, in an anonymous namespace, so that each kernel compiles as it did in one file.
#pragma once

#include <cuda_fp8.h>

#include <cstdlib>

#include "comm/cuda/device/error.cuh"
#include "comm/cuda/device/grid.cuh"
#include "comm/cuda/device/ordering.cuh"
#include "comm/cuda/device/wait.cuh"
#include "core/bf16.h"
#include "core/check.h"
#include "ep/cuda/low_latency.h"

namespace epx::cuda {

// Each kernel file's kernels, loaded into the current context; preload_low_latency_kernels calls both.
cudaError_t preload_low_latency_dispatch_kernels();
cudaError_t preload_low_latency_combine_kernels();

namespace {

constexpr int kThreads = 256;
static_assert(kLowLatencyMaxRanks <= kThreads, "the receive blocks give each source rank one thread");

// The source of row `row` < begins[R] of a list grouped by source rank (begins: the [R + 1] prefix of the sources'
// counts): the first r with row < begins[r + 1], so empty sources are skipped. A linear scan of shared memory up to the
// flat routing's ranks, a binary search above (the hierarchical routing's up to kLowLatencyMaxRanks sources; every
// 16-byte item asks).
__device__ __forceinline__ int source_of_row(const int* begins, int R, int row) {
  if (R <= kLowLatencyFlatMaxRanks) {
    int r = 0;
    while (row >= begins[r + 1]) ++r;
    return r;
  }
  int lo = 0, hi = R - 1;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (begins[mid + 1] > row) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

constexpr int kWarps = kThreads / 32;
constexpr int kBlock = 128;  // fp8 channels per scale
constexpr int kUnroll = 8;   // loads in flight per thread in the copy loops

template <typename T>
__device__ __forceinline__ T* at(char* base, int64_t offset) {
  return reinterpret_cast<T*>(base + offset);
}

// Walks the item space [0, num_items) over the block in rounds of kThreads * kUnroll items: each thread calls
// load(item, v) for its kUnroll items of the round, then store(item, v) for each, so that kUnroll loads are in
// flight per thread. NOTE: the loads are issued before the stores by hand: the compiler may not hoist a load
// above a store that could alias it. The last round passes items past num_items too: the callbacks skip them,
// so that a caller whose items span several ranges tests each bound once (as its own if-else chain).
template <typename Index, typename Load, typename Store>
__device__ __forceinline__ void copy_items(Index num_items, Load&& load, Store&& store) {
  for (Index first = threadIdx.x; first < num_items; first += kThreads * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) load(first + u * kThreads, v[u]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) store(first + u * kThreads, v[u]);
  }
}

__device__ __forceinline__ LowLatencyControl* control_of(const LowLatencyPeers& peers, const LowLatencyLayout& layout) {
  return at<LowLatencyControl>(peers.bases[peers.rank], layout.control_offset);
}

// Records a failure in the buffer's error record (host-mapped; null in tests that pass none). `expert` goes to
// ErrorRecord::channel.
__device__ __forceinline__ void record_failure(const LowLatencyPeers& peers, int32_t code, int32_t site, int peer,
                                               int expert, int64_t expected, int64_t observed) {
  if (peers.error != nullptr) record_error(peers.error, code, site, peers.rank, peer, expert, expected, observed);
}

// The 32-bit tag of the dispatch whose set's sequence number is `seq` (>= 1; the tag of the next dispatch is
// dispatch_tag(dispatch_seq + 1)): in [1, 2^32 - 1], never 0, which zeroed signal words and stamps read. The signal
// word keeps only 32 bits of it (`tag << 32 | count`), so a plain count would stop matching after 2^32 dispatches on
// one set (~5 days of graph replays at 10 kHz), and its low 32 bits would match zeroed stamps at every 2^32-th.
__device__ __forceinline__ uint32_t dispatch_tag(uint64_t seq) {
  return static_cast<uint32_t>((seq - 1) % 0xffffffffull) + 1;
}

// Waits until the bits above tag_shift (the whole word with tag_shift = 0) equal `tag` (acquire: the sender's
// rows, written before its release of the signal, are visible after a true return). Gives up when another block
// masked the peer meanwhile (its timeout); on its own timeout it masks the peer locally and records the wait;
// returns false either way.
__device__ bool wait_tag(const LowLatencyPeers& peers, LowLatencyControl* ctrl, const uint64_t* signal, uint64_t tag,
                         int tag_shift, int peer, int expert, int32_t site, uint64_t* value,
                         unsigned long long* cost = nullptr) {
  // With `cost` (the wait_recv_cost_ns entry of the rank waited for): the wait's nanoseconds are added to it.
  const uint64_t start = cost != nullptr ? global_ns() : 0;
  const bool ok = bounded_wait<1>(
      signal, peers.timeout_ns,
      [&](uint64_t v) {
        if ((v >> tag_shift) != tag) return false;
        *value = v;
        return true;
      },
      [&] { return ld_volatile_global(&ctrl->mask[peer]) != 0; },
      [&](uint64_t v) {
        atomicExch(&ctrl->mask[peer], 1);
        record_failure(peers, kErrTimeout, site, peer, expert, static_cast<int64_t>(tag), static_cast<int64_t>(v));
      });
  if (cost != nullptr) atomicAdd(cost, static_cast<unsigned long long>(global_ns() - start));
  return ok;
}

// The combine's completion rule, run by the last block of a combine grid to finish (every thread calls it): that
// block waits, bounded, for this call's combine signal of every expert in [e_begin, e_end) whose rank is open, whether
// or not a token of this rank chose it (a timeout masks the rank as any wait does), then advances the set's sequence
// number. So a combine completes only after every open rank's combine send of this call ended, and with it that
// rank's dispatch receive: the staging set a peer's next dispatch writes is consumed by then, also when two calls in a
// row use the same set (a CUDA graph holding an odd number of dispatches, hooks of two micro-batches). One block
// waits, at the end: the other blocks leave their SMs as soon as their units are reduced (waiting in every block
// before its last unit cost 13% of a 128-token combine on one H200). docs/low-latency.md.
__device__ void finish_combine_grid(const LowLatencyPeers& peers, LowLatencyControl* ctrl, const uint64_t* signals,
                                    uint64_t tag, int64_t e_begin, int64_t e_end, int64_t experts_per_rank,
                                    unsigned int* ticket, uint64_t* seq, unsigned long long* cost = nullptr) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) last = last_block_arrives(ticket);
  __syncthreads();
  if (!last) return;
  for (int64_t e = e_begin + static_cast<int64_t>(threadIdx.x); e < e_end; e += kThreads) {
    const int r = static_cast<int>(e / experts_per_rank);
    if (ld_volatile_global(&ctrl->mask[r]) != 0) continue;
    uint64_t v = 0;
    wait_tag(peers, ctrl, signals + e, tag, kCombineIdBits, r, static_cast<int>(e), kSiteLowLatencyCombineRecv, &v,
             cost != nullptr ? cost + r : nullptr);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    *seq += 1;
    __threadfence();
  }
}

// acc[0..8) += w * the 8 bf16 values in raw, with explicit rounding (no FMA contraction): the host reference's
// product, then sum.
__device__ __forceinline__ void add_weighted(float acc[8], uint4 raw, float w) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 f = detail::cvt_bf16x2_to_float2(words[q]);
    acc[2 * q] = __fadd_rn(acc[2 * q], __fmul_rn(w, f.x));
    acc[2 * q + 1] = __fadd_rn(acc[2 * q + 1], __fmul_rn(w, f.y));
  }
}

// acc[0..8) += the 8 bf16 values in raw (fp32, rounded per add).
__device__ __forceinline__ void add_bf16x8(float acc[8], uint4 raw) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 f = detail::cvt_bf16x2_to_float2(words[q]);
    acc[2 * q] = __fadd_rn(acc[2 * q], f.x);
    acc[2 * q + 1] = __fadd_rn(acc[2 * q + 1], f.y);
  }
}

// acc[0..8) += the 16-byte vectors of the slots i in [0, n) that count (counts(i)), in ascending i: the loads of
// kChunk slots are issued before any of them is added (loads in flight), add(acc, i, raw) adds one.
template <int kChunk, typename Counts, typename Load, typename Add>
__device__ __forceinline__ void sum_slots(float acc[8], int n, Counts&& counts, Load&& load, Add&& add) {
  for (int i0 = 0; i0 < n; i0 += kChunk) {
    uint4 raw[kChunk] = {};
#pragma unroll
    for (int u = 0; u < kChunk; ++u) {
      if (i0 + u < n && counts(i0 + u)) raw[u] = load(i0 + u);
    }
#pragma unroll
    for (int u = 0; u < kChunk; ++u) {
      if (i0 + u < n && counts(i0 + u)) add(acc, i0 + u, raw[u]);
    }
  }
}

// The 8 sums as bf16 (round to nearest even).
__device__ __forceinline__ uint4 pack_bf16x8(const float acc[8]) {
  return make_uint4(detail::cvt_float2_to_bf16x2(acc[0], acc[1]), detail::cvt_float2_to_bf16x2(acc[2], acc[3]),
                    detail::cvt_float2_to_bf16x2(acc[4], acc[5]), detail::cvt_float2_to_bf16x2(acc[6], acc[7]));
}

// Whether a combine signal came from the same dispatch; records the mismatch otherwise.
__device__ __forceinline__ bool same_dispatch(const LowLatencyPeers& peers, uint64_t v, uint32_t tag_id, int peer,
                                              int expert) {
  const uint32_t theirs = static_cast<uint32_t>(v) & kCombineIdMask;
  if (theirs == (tag_id & kCombineIdMask)) return true;
  record_failure(peers, kErrHandleMismatch, kSiteLowLatencyCombineRecv, peer, expert, tag_id & kCombineIdMask, theirs);
  return false;
}

// Whether this rank's receive of the dispatch on `dispatch_set` (completed: its sequence number is the dispatch's tag)
// missed some or all of source r's pairs (LowLatencyControl::recv_lost): the combine reversing it then sends r no rows
// and signals kCombineNoRows.
__device__ __forceinline__ bool dispatch_missed(const LowLatencyControl* ctrl, int dispatch_set, int r) {
  return ctrl->recv_lost[dispatch_set][r] == dispatch_tag(ctrl->dispatch_seq[dispatch_set]);
}

// Whether a combine signal's rows count for this rank: from the same dispatch (a mismatch is recorded) and not
// kCombineNoRows.
__device__ __forceinline__ bool signal_counts(const LowLatencyPeers& peers, uint64_t v, uint32_t tag_id, int peer,
                                              int expert) {
  return same_dispatch(peers, v, tag_id, peer, expert) && (v & kCombineNoRows) == 0;
}

// Block-wide exclusive scan of one count per thread (every thread calls it): this thread's offset; *total the sum.
__device__ __forceinline__ int block_exclusive_scan(int mine, int* total) {
  __shared__ int warp_counts[kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int inclusive = mine;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += other;
  }
  if (lane == 31) warp_counts[warp] = inclusive;
  __syncthreads();
  int pos = inclusive - mine, sum = 0;
  for (int w = 0; w < kWarps; ++w) {
    pos += w < warp ? warp_counts[w] : 0;
    sum += warp_counts[w];
  }
  *total = sum;
  __syncthreads();  // warp_counts may be reused
  return pos;
}

// One of `parts` blocks that share a monotonic counter (no reset; parts a power of two fixed per buffer, so the
// wrap at 2^32 keeps the phase) has finished its stores: true in every thread of the block that arrived last, which
// then sees the other parts' stores (each fenced before its increment). Every thread calls it.
__device__ __forceinline__ bool last_of_parts(unsigned int* counter, int parts) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    const unsigned int done = atomicAdd(counter, 1u) + 1;
    last = done % static_cast<unsigned>(parts) == 0;
    if (last) __threadfence();  // acquire: the other parts' stores, fenced before their increments
  }
  __syncthreads();
  return last;
}

// The last block of a grid to finish advances the set's sequence number (all blocks read it at start).
__device__ void finish_grid(unsigned int* ticket, uint64_t* seq) {
  __syncthreads();
  if (threadIdx.x == 0 && last_block_arrives(ticket)) {
    *seq += 1;
    __threadfence();
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

// The combine receive's units: combine_recv_parts(T) slices of each token's hidden vector, one unit per block at a
// time (blocks first_block, first_block + num_blocks, ...). Per unit: prepare(t) between two barriers (threads fill
// the block's shared state for token t: which rows count, their weights), then slice(t, v) for each 16-byte vector v of
// the unit's slice, one per thread. Every thread calls it.
template <typename Prepare, typename Slice>
__device__ __forceinline__ void for_each_recv_unit(int64_t num_tokens, int64_t row_vecs, int64_t first_block,
                                                   int64_t num_blocks, Prepare&& prepare, Slice&& slice) {
  const int parts = combine_recv_parts(num_tokens);
  const int64_t part_vecs = (row_vecs + parts - 1) / parts;
  for (int64_t unit = first_block; unit < num_tokens * parts; unit += num_blocks) {
    const int64_t t = unit / parts;
    const int64_t v_begin = (unit % parts) * part_vecs;
    const int64_t v_end = v_begin + part_vecs < row_vecs ? v_begin + part_vecs : row_vecs;
    __syncthreads();  // the previous unit's shared state is no longer read
    prepare(t);
    __syncthreads();
    for (int64_t v = v_begin + threadIdx.x; v < v_end; v += kThreads) slice(t, v);
  }
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

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) detail::raise(ErrorCode::kCudaError, "{} launch failed: {}", what, cudaGetErrorString(err));
}

// Launches the kernel instantiation for the call's topk id type: launch(topk_id) with topk_id an int64_t or an
// int32_t (only its type matters); then reports a failed launch as `what`.
// NOTE: both halves of a hook call must pick the same instantiation (one kernel name per call).
template <typename Launch>
void launch_for_topk_type(bool topk_int64, const char* what, Launch&& launch) {
  if (topk_int64) {
    launch(int64_t{});
  } else {
    launch(int32_t{});
  }
  check_launch(what);
}

}  // namespace

// ---- kernels ------------------------------------------------------------------------------------------

// NOTE: one kernel function per direction, the phase a runtime argument. Profiler-based tools (DeepEP's
// bench_kineto in its test_low_latency.py) look kernels up by name: exactly one kernel name may contain
// "dispatch" and one "combine", launched once per call, or twice with a hook (send, then receive). A named
// namespace, so that the demangled name reads epx::cuda::ll::dispatch<...>; no parameter type may contain the
// other direction's word. The phase branch is uniform over the grid; the register count is the larger of the
// two halves' (as the fused kernels' always was).
// (ll::Phase, the launch's half, is in low_latency.h.)
}  // namespace epx::cuda
