// Device helpers of the normal path's kernel files (normal_layout.cu, normal_notify.cu, normal_ring.cu,
// normal_copy.cu) over the device layer (src/comm/cuda/device/: memory ordering, the bounded wait, the error record,
// the last-block finisher): the path's abort checks and its wait, signal addressing, warp copies, the top-k fields
// of a dispatch row and the combine reduction of one token. Protocol: docs/normal-kernels.md.
// NOTE: everything here is in an anonymous namespace and inline: each kernel file gets its own copy, so the
// kernels compile exactly as they did in one file.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "comm/cuda/device/error.cuh"
#include "comm/cuda/device/grid.cuh"
#include "comm/cuda/device/ordering.cuh"
#include "comm/cuda/device/wait.cuh"
#include "core/bf16.h"
#include "ep/call_shape.h"
#include "ep/combine_order.h"
#include "ep/cuda/normal_kernels.h"

namespace epx::cuda {

// Each kernel file's kernels, loaded into the current context (cudaFuncGetAttributes); preload_normal_kernels
// calls them all.
cudaError_t preload_layout_kernels();
cudaError_t preload_notify_kernels();
cudaError_t preload_ring_kernels();
cudaError_t preload_copy_kernels();

namespace {

__device__ __forceinline__ bool aborted(const CommArgs& comm) {
  return *reinterpret_cast<volatile int32_t*>(&comm.error[0].code) != kErrNone;
}

// Record [0] for the failures that abort every other wait of this rank, [1] for the others (normal_kernels.h).
__device__ void record_error(const CommArgs& comm, int32_t code, int32_t where, int32_t peer, int32_t channel,
                             int64_t expected, int64_t observed) {
  const bool aborts_waits =
      code == kErrTimeout || code == kErrPeerAborted || code == kErrHandleMismatch || code == kErrShapeMismatch;
  record_error(comm.error + (aborts_waits ? 0 : 1), code, where, comm.rank, peer, channel, expected, observed);
}

// True (and recorded) when a peer left the current call before it started, writing its rank into this rank's
// abort word (CudaBuffer::abort_call): nothing it owes will come. Polled with the timeout checks.
__device__ bool peer_left(const CommArgs& comm, int32_t site, int32_t channel) {
  const uint64_t abort = *reinterpret_cast<volatile uint64_t*>(comm.peers[comm.rank] + comm.off_abort);
  if (abort == 0) return false;
  record_error(comm, kErrPeerAborted, site, static_cast<int32_t>(abort - 1), channel, 0, 0);
  return true;
}

// Source r's (handle id, shape word, epoch) of operation `epoch` (or `epoch - 2`, same parity) in this rank's region
// (advance_epoch_kernel wrote them, the epoch last with a release; r == this rank: its own, written locally).
__device__ __forceinline__ const volatile uint64_t* call_words(const CommArgs& comm, uint64_t epoch, int r) {
  const int slot = static_cast<int>(epoch & 1) * comm.num_ranks + r;
  return reinterpret_cast<const volatile uint64_t*>(
      reinterpret_cast<uint64_t*>(comm.peers[comm.rank] + comm.off_handle_id) + kCallWords * slot);
}

// Records kErrShapeMismatch when source r's operation `epoch` has another shape word than `shape_word`; returns
// whether they agree.
__device__ bool same_shape(const CommArgs& comm, uint64_t epoch, int r, uint64_t shape_word, int32_t site,
                           int32_t channel) {
  const uint64_t theirs = call_words(comm, epoch, r)[1];
  if (theirs == shape_word) return true;
  record_error(comm, kErrShapeMismatch, site, r, channel, static_cast<int64_t>(shape_word),
               static_cast<int64_t>(theirs));
  return false;
}

// While a wait of this rank's current operation is for `peer`: true (recorded as kErrShapeMismatch) when the peer has
// started the same operation (its epoch word says so) with another shape word, i.e. another call kind or arguments
// of other kinds: then what this rank waits for may never come (a fresh dispatch's notify flag from a peer in a
// combine, a copy-engine signal from a peer that took the SM rings). No abort of the peers: each rank's waits find it
// the same way. Polled with the timeout checks.
__device__ bool peer_in_other_call(const CommArgs& comm, int peer, int32_t site, int32_t channel) {
  if (peer < 0 || peer >= comm.num_ranks || peer == comm.rank) return false;
  const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(comm.peers[comm.rank] + comm.off_epoch);
  const volatile uint64_t* words = call_words(comm, epoch, peer);
  if (ld_acquire_sys(const_cast<const uint64_t*>(words + 2)) != epoch) return false;
  return !same_shape(comm, epoch, peer, call_words(comm, epoch, comm.rank)[1], site, channel);
}

// Spins until *p >= target (acquire). On budget expiry or a recorded failure elsewhere it records (if
// first) and returns false. One thread calls it.
__device__ bool wait_geq(const CommArgs& comm, const uint64_t* p, uint64_t target, int32_t site, int32_t peer,
                         int32_t channel) {
  return bounded_wait<256>(
      p, comm.timeout_ns, [&](uint64_t v) { return v >= target; },
      [&] { return aborted(comm) || peer_left(comm, site, channel) || peer_in_other_call(comm, peer, site, channel); },
      [&](uint64_t v) {
        record_error(comm, kErrTimeout, site, peer, channel, static_cast<int64_t>(target), static_cast<int64_t>(v));
      });
}

__device__ __forceinline__ uint64_t* sig(const CommArgs& comm, int rank, int64_t off, int idx) {
  return reinterpret_cast<uint64_t*>(comm.peers[rank] + off) + idx;
}

__device__ __forceinline__ uint64_t read_epoch(const CommArgs& comm) {
  return *reinterpret_cast<volatile uint64_t*>(comm.peers[comm.rank] + comm.off_epoch);
}

// A receiver's check before it releases what it read (done): false (recorded as kErrPeerAborted at `site`) when a
// peer wrote this rank's abort word while it read. A peer whose release wait gave up writes the abort words before
// its copy engines, which the host enqueued and nothing stops, overwrite this rank's staging (peers_released): rows
// read after such a copy landed come with the abort word visible here, so the call fails instead of returning them.
// One thread calls it, after a barrier that follows the reads.
__device__ bool staging_kept(const CommArgs& comm, int32_t site, int32_t channel) {
  __threadfence();
  return aborted(comm) || !peer_left(comm, site, channel);
}

// Writes every peer's abort word (their waits give up at once and name this rank). One thread calls it.
__device__ void abort_peers(const CommArgs& comm) {
  for (int d = 0; d < comm.num_ranks; ++d) {
    if (d != comm.rank) {
      *reinterpret_cast<volatile uint64_t*>(comm.peers[d] + comm.off_abort) = static_cast<uint64_t>(comm.rank) + 1;
    }
  }
  __threadfence_system();
}

// True when source r's operation `epoch` belongs to the same dispatch as this rank's (the handle ids agree) and has
// the same shape word. Call after an acquire that saw rows of r's operation `epoch` (r wrote both words before
// them, advance_epoch_kernel). Otherwise records kErrHandleMismatch or kErrShapeMismatch (record [0]: every wait
// of this rank gives up), writes every peer's abort word (their waits give up at once and name this rank) and
// returns false. One thread calls it.
__device__ bool same_dispatch(const CommArgs& comm, uint64_t epoch, int r, uint64_t handle_id, uint64_t shape_word,
                              int32_t site, int32_t channel) {
  if (r == comm.rank) return true;
  // NOTE: the shape first: a call of another kind (e.g. a fresh dispatch whose early copy arrived) has another id too,
  // and the kind names the cause.
  if (same_shape(comm, epoch, r, shape_word, site, channel)) {
    const uint64_t theirs = call_words(comm, epoch, r)[0];
    if (theirs == handle_id) return true;
    record_error(comm, kErrHandleMismatch, site, r, channel, static_cast<int64_t>(handle_id),
                 static_cast<int64_t>(theirs));
  }
  abort_peers(comm);
  return false;
}

// Copies `bytes` (multiple of 16, both 16-byte aligned) with one warp; up to 8 loads in flight per lane.
template <bool kCoherent>
__device__ __forceinline__ int4 load16(const int4* p) {
  if constexpr (kCoherent) {
    return __ldcg(p);
  } else {
    return __ldg(p);
  }
}

template <bool kCoherent>
__device__ __forceinline__ void warp_copy16_impl(char* dst, const char* src, int64_t bytes, int lane) {
  constexpr int kUnroll = 8;
  const int64_t n = bytes / 16;
  auto* d = reinterpret_cast<int4*>(dst);
  const auto* s = reinterpret_cast<const int4*>(src);
  // NOTE: the last round is predicated, not a loop of single loads: a 14 KB row is 4 rounds of loads
  // per lane, not 3 plus 4 dependent ones.
  for (int64_t i = lane; i < n; i += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (i + 32 * u < n) v[u] = load16<kCoherent>(s + i + 32 * u);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (i + 32 * u < n) d[i + 32 * u] = v[u];
    }
  }
}

__device__ __forceinline__ void warp_copy16(char* dst, const char* src, int64_t bytes, int lane) {
  warp_copy16_impl<false>(dst, src, bytes, lane);
}

// Same, but the source is a ring that another GPU writes into our memory: loads bypass L1 (.cg), which
// could hold a stale copy of a reused slot; L2 is the point of coherence for our own memory.
__device__ __forceinline__ void warp_copy16_coherent(char* dst, const char* src, int64_t bytes, int lane) {
  warp_copy16_impl<true>(dst, src, bytes, lane);
}

__device__ __forceinline__ void warp_copy_bytes(char* dst, const char* src, int64_t bytes, int lane) {
  if ((bytes & 3) == 0 && (reinterpret_cast<uintptr_t>(dst) & 3) == 0 && (reinterpret_cast<uintptr_t>(src) & 3) == 0) {
    for (int64_t i = lane; i < bytes / 4; i += 32)
      reinterpret_cast<int32_t*>(dst)[i] = reinterpret_cast<const volatile int32_t*>(src)[i];
  } else {
    for (int64_t i = lane; i < bytes; i += 32) dst[i] = reinterpret_cast<const volatile char*>(src)[i];
  }
}

// ---- the top-k fields of a dispatch row (ring and copy-engine paths) ----------------------------------

__device__ __forceinline__ int64_t topk_at(const DispatchKernelArgs& a, int64_t i) {
  return a.topk_is_int64 ? static_cast<const int64_t*>(a.topk_idx)[i]
                         : static_cast<int64_t>(static_cast<const int32_t*>(a.topk_idx)[i]);
}

// Column j of token t's top-k as destination `dst` sees it: its local expert id (-1 elsewhere) and weight.
struct LocalTopk {
  int32_t id;
  float weight;
};
__device__ __forceinline__ LocalTopk local_topk(const DispatchKernelArgs& a, int64_t t, int j, int dst) {
  const int64_t expert_begin = static_cast<int64_t>(dst) * a.num_local_experts;
  const int64_t e = topk_at(a, t * a.num_topk + j);
  if (e < expert_begin || e >= expert_begin + a.num_local_experts) return {-1, 0.f};
  return {static_cast<int32_t>(e - expert_begin), a.topk_weights != nullptr ? a.topk_weights[t * a.num_topk + j] : 0.f};
}

__device__ __forceinline__ void store_topk_out(const DispatchKernelArgs& a, int64_t p, int lane, int32_t e, float w) {
  if (a.topk_is_int64) {
    static_cast<int64_t*>(a.out_topk_idx)[p * a.num_topk + lane] = e;
  } else {
    static_cast<int32_t*>(a.out_topk_idx)[p * a.num_topk + lane] = e;
  }
  if (a.out_topk_weights != nullptr) a.out_topk_weights[p * a.num_topk + lane] = w;
}

// ---- combine ----------------------------------------------------------------------------------

// The ranks token tt's rows come from, in summation order: ascending, or DeepEP V2's with a.order_topk
// (ep::deepep_v2_rank_order). Every lane computes the same list. Returns their number.
__device__ __forceinline__ int combine_rank_order(const CombineKernelArgs& a, int num_ranks, int64_t tt, int* order) {
  const uint8_t* in_rank = a.is_token_in_rank + tt * num_ranks;
  if (a.order_topk == nullptr) {
    int n = 0;
    for (int r = 0; r < num_ranks; ++r) {
      if (in_rank[r]) order[n++] = r;
    }
    return n;
  }
  int last[kNormalMaxRanks];
  const int64_t base = tt * a.order_stride_t;
  return ep::deepep_v2_rank_order(
      num_ranks, a.order_num_topk, a.experts_per_rank, [&](int r) { return in_rank[r] != 0; },
      [&](int k) {
        const int64_t i = base + k * a.order_stride_k;
        return a.order_is_int64 ? static_cast<const int64_t*>(a.order_topk)[i]
                                : static_cast<int64_t>(static_cast<const int32_t*>(a.order_topk)[i]);
      },
      last, order);
}

// One warp: out[tt] = bf16(sum of the rows (fp32, in the given order) + bias_0 + bias_1), and the same
// sum of the top-k weights rows. Rows may be written by other GPUs or copy engines: loads skip L1.
// kPairs: two source rows' loads in flight before either is added (more registers: blocks of at most
// kReduceThreads threads).
template <bool kPairs>
__device__ __forceinline__ void reduce_token(const CombineKernelArgs& a, int64_t tt, const char* const* rows,
                                             const float* const* wrows, int num_src, int lane) {
  const int64_t H = a.hidden;
  const int K = a.num_topk;
  // kUnroll chunks per lane per step, so each source row has kUnroll loads in flight: 6 with pairs (6 KB per warp in
  // flight, 128 registers without spills at 512 threads; bench/micro/reduce_engine.cu: 50 -> 68 GB/s per SM at
  // 24 SMs, 8 spills here; docs/perf-notes.md R2), 4 in the 768-thread ring kernel, whose register budget is smaller.
  constexpr int kUnroll = kPairs ? 6 : 4;
  const int64_t num_chunks = H / 8;
  const uint16_t* biases[2] = {a.bias_0, a.bias_1};
  const bool bias_first = a.order_topk != nullptr;  // DeepEP V2's order: 0 + bias_0 + bias_1, then the rows
  for (int64_t v0 = lane; v0 < num_chunks; v0 += 32 * kUnroll) {
    float acc[kUnroll][8];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[u][q] = 0.f;
    }
    auto load = [&](const int4* base, bool coherent, int4* in) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + 32 * u;
        in[u] = v < num_chunks ? (coherent ? __ldcg(base + v) : __ldg(base + v)) : make_int4(0, 0, 0, 0);
      }
    };
    auto add = [&](const int4* in) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const uint32_t w[4] = {static_cast<uint32_t>(in[u].x), static_cast<uint32_t>(in[u].y),
                               static_cast<uint32_t>(in[u].z), static_cast<uint32_t>(in[u].w)};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          acc[u][2 * q] += detail::bf16x2_lo(w[q]);
          acc[u][2 * q + 1] += detail::bf16x2_hi(w[q]);
        }
      }
    };
    auto add_biases = [&] {
      for (const uint16_t* bias : biases) {
        if (bias == nullptr) continue;
        int4 in[kUnroll];
        load(reinterpret_cast<const int4*>(bias + tt * H), false, in);
        add(in);
      }
    };
    if (bias_first) add_biases();
    // The sum order stays j = 0, 1, 2, ... either way.
    for (int j = 0; j < num_src; j += kPairs ? 2 : 1) {
      int4 in0[kUnroll], in1[kUnroll];
      load(reinterpret_cast<const int4*>(rows[j]), true, in0);
      if (kPairs && j + 1 < num_src) load(reinterpret_cast<const int4*>(rows[j + 1]), true, in1);
      add(in0);
      if (kPairs && j + 1 < num_src) add(in1);
    }
    if (!bias_first) add_biases();
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + 32 * u;
      if (v >= num_chunks) continue;
      int4 o;
      // NOTE: rounds exactly as epx::float_to_bf16 (NaN included), so the host reference matches bit for bit.
      o.x = static_cast<int>(detail::float2_to_bf16x2(acc[u][0], acc[u][1]));
      o.y = static_cast<int>(detail::float2_to_bf16x2(acc[u][2], acc[u][3]));
      o.z = static_cast<int>(detail::float2_to_bf16x2(acc[u][4], acc[u][5]));
      o.w = static_cast<int>(detail::float2_to_bf16x2(acc[u][6], acc[u][7]));
      reinterpret_cast<int4*>(a.out + tt * H)[v] = o;
    }
  }
  if (a.out_topk_weights != nullptr && lane < K) {
    float sum = 0.f;
    for (int j = 0; j < num_src; ++j) sum += reinterpret_cast<const volatile float*>(wrows[j])[lane];
    a.out_topk_weights[tt * K + lane] = sum;
  }
}

}  // namespace
}  // namespace epx::cuda
