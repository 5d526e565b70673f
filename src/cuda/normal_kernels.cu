// Normal-mode kernels: layout, scan, notify, dispatch, combine. Protocol: docs/normal-kernels.md.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/bf16.h"
#include "cuda/normal_kernels.h"

namespace epx::cuda {

const char* wait_site_name(int32_t site) {
  switch (site) {
    case kSiteNotify:
      return "notify (counts from the peer)";
    case kSiteDispatchSendDone:
      return "dispatch send (peer finishing its previous receive)";
    case kSiteDispatchSendHead:
      return "dispatch send (ring space at the peer)";
    case kSiteDispatchRecvTail:
      return "dispatch receive (rows from the peer)";
    case kSiteCombineSendDone:
      return "combine send (peer finishing its previous receive)";
    case kSiteCombineSendHead:
      return "combine send (ring space at the peer)";
    case kSiteCombineRecvTail:
      return "combine receive (rows from the peer)";
    case kSiteCopyDispatchReleased:
      return "dispatch copy (peer finishing its previous receive)";
    case kSiteCopyDispatchRows:
      return "dispatch receive (copy-engine rows from the peer)";
    case kSiteCopyCombineReleased:
      return "combine copy (peer finishing its previous receive)";
    case kSiteCopyCombineRows:
      return "combine receive (copy-engine rows from the peer)";
    default:
      return "unknown";
  }
}

namespace {

// ---- memory-ordering primitives --------------------------------------------------------------
// Signals cross GPUs over NVLink (or stay on one GPU when ranks share it): system scope throughout.

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// NOTE: the caller reached this store after a (named) barrier with the threads whose writes it
// publishes; the release at system scope is cumulative over what the barrier ordered before it.
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("fence.acq_rel.sys;\n\tst.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void named_barrier(int id, int num_threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}

__device__ __forceinline__ bool aborted(const CommArgs& comm) {
  return *reinterpret_cast<volatile int32_t*>(&comm.error[0].code) != kErrNone;
}

__device__ void record_error(const CommArgs& comm, int32_t code, int32_t where, int32_t peer, int32_t channel,
                             int64_t expected, int64_t observed) {
  volatile ErrorRecord* e = comm.error + (code == kErrTimeout ? 0 : 1);
  if (e->code != kErrNone) return;  // first failure wins (a benign race between simultaneous failures)
  e->where = where;
  e->rank = comm.rank;
  e->peer = peer;
  e->channel = channel;
  e->expected = expected;
  e->observed = observed;
  __threadfence_system();
  e->code = code;
  __threadfence_system();
}

// Spins until *p >= target (acquire). On budget expiry or a recorded failure elsewhere it records (if
// first) and returns false. One thread calls it.
__device__ bool wait_geq(const CommArgs& comm, const uint64_t* p, uint64_t target, int32_t site, int32_t peer,
                         int32_t channel) {
  const uint64_t start = global_ns();
  uint64_t v = 0;
  for (uint32_t i = 0;; ++i) {
    v = ld_acquire_sys(p);
    if (v >= target) return true;
    if ((i & 255) == 255) {
      if (aborted(comm)) return false;
      if (global_ns() - start > comm.timeout_ns) {
        record_error(comm, kErrTimeout, site, peer, channel, static_cast<int64_t>(target), static_cast<int64_t>(v));
        return false;
      }
    }
  }
}

__device__ __forceinline__ uint64_t* sig(const CommArgs& comm, int rank, int64_t off, int idx) {
  return reinterpret_cast<uint64_t*>(comm.peers[rank] + off) + idx;
}

__device__ __forceinline__ uint64_t read_epoch(const CommArgs& comm) {
  return *reinterpret_cast<volatile uint64_t*>(comm.peers[comm.rank] + comm.off_epoch);
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

// ---- layout ----------------------------------------------------------------------------------

// One token per thread (its K loads in flight together); counts go to shared memory. Many blocks:
// one global atomic per non-zero count into outputs zeroed on the stream before. One cluster
// (kCluster, kLayoutClusterBlocks blocks): block 0 sums the blocks' shared counts (distributed shared
// memory) and stores them, so the call needs no memset.
template <bool kCluster>
__device__ __forceinline__ void layout_body(const void* topk_idx, bool is_int64, int64_t num_tokens, int num_topk,
                                            int64_t num_experts, int num_ranks, int32_t* per_rank, int32_t* per_expert,
                                            uint8_t* in_rank, ErrorRecord* error, int rank) {
  extern __shared__ int32_t s_expert[];  // [num_experts]
  __shared__ int32_t s_rank[kNormalMaxRanks];
  for (int64_t i = threadIdx.x; i < num_experts; i += blockDim.x) s_expert[i] = 0;
  if (threadIdx.x < kNormalMaxRanks) s_rank[threadIdx.x] = 0;
  __syncthreads();
  const int64_t per = num_experts / num_ranks;
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
    uint32_t mask = 0;
#pragma unroll
    for (int k = 0; k < kNormalMaxTopk; ++k) {
      if (e[k] < -1 || e[k] >= num_experts) {
        volatile ErrorRecord* rec = error;
        if (rec->code == kErrNone) {
          rec->rank = rank;
          rec->peer = static_cast<int32_t>(t);
          rec->channel = k;
          rec->observed = e[k];
          rec->expected = num_experts;
          __threadfence_system();
          rec->code = kErrInvalidTopk;
        }
        continue;
      }
      if (e[k] < 0) continue;
      atomicAdd(&s_expert[e[k]], 1);
      mask |= 1u << static_cast<int>(e[k] / per);
    }
    for (int r = 0; r < num_ranks; ++r) {
      const bool in = (mask >> r) & 1u;
      in_rank[t * num_ranks + r] = in;
      if (in) atomicAdd(&s_rank[r], 1);
    }
  }
  __syncthreads();
  if constexpr (kCluster) {
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every block's shared counts are final
    if (cluster.block_rank() == 0) {
      const unsigned num_blocks = cluster.num_blocks();
      for (int64_t i = threadIdx.x; i < num_experts + num_ranks; i += blockDim.x) {
        int32_t sum = 0;
        for (unsigned b = 0; b < num_blocks; ++b) {
          sum += i < num_experts ? cluster.map_shared_rank(s_expert, b)[i]
                                 : cluster.map_shared_rank(s_rank, b)[i - num_experts];
        }
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

__global__ void advance_epoch_kernel(CommArgs comm) {
  auto* p = reinterpret_cast<volatile uint64_t*>(comm.peers[comm.rank] + comm.off_epoch);
  *p = *p + 1;
}

// ---- notify: one block -----------------------------------------------------------------------

__global__ void __launch_bounds__(256)
    notify_kernel(CommArgs comm, const int32_t* chan_start, const int32_t* per_expert, int num_local_experts,
                  int expert_alignment, int64_t num_tokens, bool whole, int32_t* recv_meta, int32_t* recv_expert_counts,
                  int32_t* rank_prefix_matrix) {
  __shared__ bool s_abort;
  const uint64_t epoch = read_epoch(comm);
  const int parity = static_cast<int>(epoch & 1);
  const int R = comm.num_ranks, C = comm.num_channels, me = comm.rank;
  // NOTE: slot [parity][me] at each destination was last read in operation epoch - 2, which every
  // destination finished before it released our rings in epoch - 1 (we waited on that), so it is free.
  int32_t max_rows = 0;  // staging rows at one remote destination
  for (int r = 0; r < R; ++r) {
    const int32_t n = chan_start[r * (C + 1) + C] - chan_start[r * (C + 1)];
    const int32_t need = whole_copy(n, num_tokens, whole) ? static_cast<int32_t>(num_tokens) : n;
    if (r != me && need > max_rows) max_rows = need;
  }
  const int64_t ring_kib = comm.ring_bytes >> 10;
  // NOTE: the layout kernel ran before us on this stream; its record is in comm.error[1].
  const bool input_invalid = reinterpret_cast<volatile const ErrorRecord*>(comm.error)[1].code == kErrInvalidTopk;
  for (int r = 0; r < R; ++r) {
    int32_t* slot = reinterpret_cast<int32_t*>(comm.peers[r] + comm.off_notify) + (parity * R + me) * kNotifyInts;
    if (threadIdx.x == 0) {
      slot[0] = input_invalid ? -1 - max_rows : max_rows;  // sign bit: this rank's topk_idx was invalid
      slot[C + 2 + num_local_experts] = static_cast<int32_t>(ring_kib < 0x7fffffff ? ring_kib : 0x7fffffff);
      const int32_t n = chan_start[r * (C + 1) + C] - chan_start[r * (C + 1)];
      slot[C + 3 + num_local_experts] = whole_copy(n, num_tokens, whole) ? static_cast<int32_t>(num_tokens) : 0;
    }
    for (int i = threadIdx.x; i < C + 1; i += blockDim.x) slot[1 + i] = chan_start[r * (C + 1) + i];
    for (int d = threadIdx.x; d < R; d += blockDim.x) {
      slot[C + 4 + num_local_experts + d] = chan_start[d * (C + 1) + C] - chan_start[d * (C + 1)];
    }
    for (int j = threadIdx.x; j < num_local_experts; j += blockDim.x) {
      slot[C + 2 + j] = per_expert[r * num_local_experts + j];
    }
  }
  if (threadIdx.x == 0) s_abort = false;
  __syncthreads();
  if (threadIdx.x < R) {
    const int r = threadIdx.x;
    st_release_sys(sig(comm, r, comm.off_notify_flag, parity * R + me), epoch);
    if (!wait_geq(comm, sig(comm, me, comm.off_notify_flag, parity * R + r), epoch, kSiteNotify, r, -1)) {
      s_abort = true;
    }
  }
  __syncthreads();
  if (s_abort) return;
  const RecvMetaLayout m{R, C, num_local_experts};
  const int32_t* mine = reinterpret_cast<const int32_t*>(comm.peers[me] + comm.off_notify) + parity * R * kNotifyInts;
  if (threadIdx.x == 0) {
    int32_t prefix = 0;
    for (int s = 0; s < R; ++s) {
      recv_meta[m.rank_prefix(s)] = prefix;
      prefix += mine[s * kNotifyInts + 1 + C];
    }
    recv_meta[m.num_recv()] = prefix;
    int32_t pair_rows = 0, ring = 0x7fffffff, failed = -1;
    for (int s = 0; s < R; ++s) {
      const int32_t rows = mine[s * kNotifyInts];
      if (rows < 0 && failed < 0) failed = s;
      pair_rows = max(pair_rows, rows < 0 ? -1 - rows : rows);
      ring = min(ring, mine[s * kNotifyInts + C + 2 + num_local_experts]);
    }
    recv_meta[m.max_pair_rows()] = pair_rows;
    recv_meta[m.min_ring_kib()] = ring;
    recv_meta[m.failed_source()] = failed;
  }
  for (int s = threadIdx.x; s < R; s += blockDim.x) {
    recv_meta[m.whole_tokens(s)] = mine[s * kNotifyInts + C + 3 + num_local_experts];
  }
  for (int r = threadIdx.x; r < R; r += blockDim.x) {
    recv_meta[m.send_count(r)] = chan_start[r * (C + 1) + C] - chan_start[r * (C + 1)];
  }
  for (int j = threadIdx.x; j < R; j += blockDim.x) {
    int32_t prefix = 0;
    for (int i = 0; i < R; ++i) {
      prefix += mine[i * kNotifyInts + C + 4 + num_local_experts + j];
      rank_prefix_matrix[i * R + j] = prefix;
    }
  }
  for (int i = threadIdx.x; i < R * (C + 1); i += blockDim.x) {
    const int s = i / (C + 1), c = i % (C + 1);
    recv_meta[m.chan_start(s, c)] = mine[s * kNotifyInts + 1 + c];
  }
  for (int j = threadIdx.x; j < num_local_experts; j += blockDim.x) {
    int32_t sum = 0;
    for (int s = 0; s < R; ++s) sum += mine[s * kNotifyInts + C + 2 + j];
    sum = (sum + expert_alignment - 1) / expert_alignment * expert_alignment;
    recv_meta[m.expert_count(j)] = sum;
    recv_expert_counts[j] = sum;
  }
}

// ---- the ring protocol, shared by dispatch and combine ------------------------------------------
// Sender group (channel c, destination r): rows [0, n) of its list go into ring (me -> r, c) at r,
// batch by batch; per batch the leader waits for space (head), the warps copy rows, then the leader
// publishes tail. Receiver group (channel c, source s) waits for tail, copies rows out, publishes head.
// The last operation's receiver publishes done = epoch so the next operation's sender knows the ring
// (and our notify slot) is free.

// Returns false if a wait gave up. Ends with a group barrier, so the group may call it again at once
// (s_abort is rewritten only after every thread of the group read it).
template <typename WriteRow>
__device__ bool send_rows(const CommArgs& comm, int dst, int channel, int64_t num_rows, int64_t ring_rows,
                          int64_t row_bytes, int site_done, int site_head, int group_id, int group_threads,
                          int warp_in_group, int warps_per_group, int lane, bool* s_abort, WriteRow write_row) {
  const uint64_t epoch = read_epoch(comm);
  const uint64_t tag = epoch << 32;
  const int R = comm.num_ranks, C = comm.num_channels, me = comm.rank;
  const bool leader = warp_in_group == 0 && lane == 0;
  if (leader) {
    s_abort[group_id] =
        !wait_geq(comm, sig(comm, me, comm.off_done, dst * C + channel), epoch - 1, site_done, dst, channel);
  }
  named_barrier(1 + group_id, group_threads);
  if (s_abort[group_id]) return false;
  char* ring = comm.peers[dst] + comm.off_ring + (static_cast<int64_t>(me) * C + channel) * comm.ring_slab_bytes;
  const int64_t batch = ring_rows / 4 < 64 ? (ring_rows / 4 > 0 ? ring_rows / 4 : 1) : 64;
  for (int64_t sent = 0; sent < num_rows; sent += batch) {
    const int64_t n = num_rows - sent < batch ? num_rows - sent : batch;
    if (leader) {
      const int64_t need = sent + n - ring_rows;
      if (need > 0) {
        s_abort[group_id] = !wait_geq(comm, sig(comm, me, comm.off_head, dst * C + channel),
                                      tag + static_cast<uint64_t>(need), site_head, dst, channel);
      }
    }
    named_barrier(1 + group_id, group_threads);
    if (s_abort[group_id]) return false;
    for (int64_t i = sent + warp_in_group; i < sent + n; i += warps_per_group) {
      write_row(i, ring + (i % ring_rows) * row_bytes, lane);
    }
    named_barrier(1 + group_id, group_threads);
    if (leader) st_release_sys(sig(comm, dst, comm.off_tail, me * C + channel), tag + static_cast<uint64_t>(sent + n));
  }
  named_barrier(1 + group_id, group_threads);
  (void)R;
  return true;
}

// ---- dispatch ---------------------------------------------------------------------------------

// Where the fields of a dispatch row sit in a ring (or staging) row.
struct RowFormat {
  int64_t off_scales, off_topk, off_weights, off_src;
  __device__ explicit RowFormat(const DispatchKernelArgs& a) {
    off_scales = a.x_row_bytes;
    off_topk = (off_scales + a.scale_row_bytes + 3) / 4 * 4;
    off_weights = off_topk + 4 * a.num_topk;
    off_src = off_weights + 4 * a.num_topk;
  }
};

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

// One warp: token t as a ring row for destination `dst` (top-k ids remapped to its local experts).
__device__ __forceinline__ void write_dispatch_row(const DispatchKernelArgs& a, const RowFormat& f, int64_t t, int dst,
                                                   char* row, int lane) {
  warp_copy16(row, a.x + t * a.x_row_bytes, a.x_row_bytes, lane);
  if (a.scale_row_bytes > 0) {
    const char* src = a.x_scales + t * a.scale_row_bytes;
    for (int64_t b = lane; b < a.scale_row_bytes; b += 32) row[f.off_scales + b] = src[b];
  }
  if (lane < a.num_topk && a.topk_idx != nullptr) {
    const LocalTopk v = local_topk(a, t, lane, dst);
    reinterpret_cast<int32_t*>(row + f.off_topk)[lane] = v.id;
    reinterpret_cast<float*>(row + f.off_weights)[lane] = v.weight;
  }
  if (lane == 0) *reinterpret_cast<int32_t*>(row + f.off_src) = static_cast<int32_t>(t);
}

__device__ __forceinline__ void store_topk_out(const DispatchKernelArgs& a, int64_t p, int lane, int32_t e, float w) {
  if (a.topk_is_int64) {
    static_cast<int64_t*>(a.out_topk_idx)[p * a.num_topk + lane] = e;
  } else {
    static_cast<int32_t*>(a.out_topk_idx)[p * a.num_topk + lane] = e;
  }
  if (a.out_topk_weights != nullptr) a.out_topk_weights[p * a.num_topk + lane] = w;
}

// One warp: a ring row that another GPU (or a copy engine) wrote into our memory, into output row p.
__device__ __forceinline__ void read_dispatch_row(const DispatchKernelArgs& a, const RowFormat& f, const char* row,
                                                  int64_t p, int lane) {
  warp_copy16_coherent(a.out_x + p * a.x_row_bytes, row, a.x_row_bytes, lane);
  if (a.scale_row_bytes > 0) {
    warp_copy_bytes(a.out_scales + p * a.scale_row_bytes, row + f.off_scales, a.scale_row_bytes, lane);
  }
  if (lane < a.num_topk && a.out_topk_idx != nullptr) {
    store_topk_out(a, p, lane, reinterpret_cast<const volatile int32_t*>(row + f.off_topk)[lane],
                   reinterpret_cast<const volatile float*>(row + f.off_weights)[lane]);
  }
  if (lane == 0) a.out_src_idx[p] = *reinterpret_cast<const volatile int32_t*>(row + f.off_src);
}

// NOTE: the grid may be smaller than 2 * C (a per-call num_sms): block pair b then handles channels b,
// b + G, b + 2G, ... (G = gridDim.x / 2) in this order on every rank. A channel's senders and receivers
// sit at the same position of their pairs' sequences on all ranks, so every wait is for work that runs
// (all blocks are resident) or is done; a channel never waits for a later one.
__global__ void __launch_bounds__(kNormalThreads) dispatch_kernel(CommArgs comm, DispatchKernelArgs a) {
  __shared__ bool s_abort[kNormalMaxRanks];
  __shared__ int64_t s_avail[kNormalMaxRanks];
  const int R = comm.num_ranks, C = comm.num_channels, me = comm.rank;
  const bool is_sender = (blockIdx.x & 1) == 0;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps_per_group = (kNormalThreads / 32) / R;
  const int group_id = warp / warps_per_group;
  if (group_id >= R) return;  // spare warps when R does not divide the warp count
  const int warp_in_group = warp % warps_per_group;
  const int group_threads = warps_per_group * 32;
  const int peer = group_id;
  const uint64_t epoch = read_epoch(comm);
  const uint64_t tag = epoch << 32;
  const int64_t T = a.num_tokens;
  const int K = a.num_topk;
  const RowFormat f(a);
  const RecvMetaLayout m{R, C, a.num_local_experts};
  const bool leader = warp_in_group == 0 && lane == 0;

  for (int channel = blockIdx.x >> 1; channel < C; channel += gridDim.x >> 1) {
    if (is_sender) {
      const int32_t* starts = a.chan_start + peer * (C + 1);
      const int64_t first = starts[channel];
      const int64_t num_rows = starts[channel + 1] - first;
      const int32_t* list = a.list_tok + peer * T + first;
      if (!send_rows(comm, peer, channel, num_rows, a.ring_rows, a.row_bytes, kSiteDispatchSendDone,
                     kSiteDispatchSendHead, group_id, group_threads, warp_in_group, warps_per_group, lane, s_abort,
                     [&](int64_t i, char* row, int l) { write_dispatch_row(a, f, list[i], peer, row, l); })) {
        return;
      }
      continue;
    }

    // Receiver group for source `peer`.
    const int64_t first = a.recv_meta[m.chan_start(peer, channel)];
    const int64_t num_rows = a.recv_meta[m.chan_start(peer, channel + 1)] - first;
    const int64_t out_base = a.recv_meta[m.rank_prefix(peer)] + first;
    const char* ring =
        comm.peers[me] + comm.off_ring + (static_cast<int64_t>(peer) * C + channel) * comm.ring_slab_bytes;
    int64_t consumed = 0;
    while (consumed < num_rows) {
      if (leader) {
        const uint64_t* tail = sig(comm, me, comm.off_tail, peer * C + channel);
        s_abort[group_id] =
            !wait_geq(comm, tail, tag + static_cast<uint64_t>(consumed + 1), kSiteDispatchRecvTail, peer, channel);
        const int64_t avail = static_cast<int64_t>(ld_acquire_sys(tail) - tag);
        s_avail[group_id] = avail < num_rows ? avail : num_rows;
      }
      named_barrier(1 + group_id, group_threads);
      if (s_abort[group_id]) return;
      const int64_t avail = s_avail[group_id];
      for (int64_t i = consumed + warp_in_group; i < avail; i += warps_per_group) {
        const char* row = ring + (i % a.ring_rows) * a.row_bytes;
        const int64_t p = out_base + i;
        if (p >= a.num_out_rows) continue;  // worst-token overflow: recorded below, rows dropped
        read_dispatch_row(a, f, row, p, lane);
      }
      named_barrier(1 + group_id, group_threads);
      if (leader) st_release_sys(sig(comm, peer, comm.off_head, me * C + channel), tag + static_cast<uint64_t>(avail));
      consumed = avail;
    }
    if (leader) st_release_sys(sig(comm, peer, comm.off_done, me * C + channel), epoch);

    // Worst-token mode: mark the rows past the received count (receiver blocks share the work by channel).
    if (a.worst_mode && peer == 0) {
      const int64_t received = a.recv_meta[m.num_recv()];
      if (received > a.num_out_rows && channel == 0 && leader) {
        record_error(comm, kErrWorstOverflow, 0, -1, -1, a.num_out_rows, received);
      }
      const int stride = C * group_threads;
      for (int64_t p = received + channel * group_threads + warp_in_group * 32 + lane; p < a.num_out_rows;
           p += stride) {
        a.out_src_idx[p] = -1;
        for (int k = 0; k < K && a.out_topk_idx != nullptr; ++k) {
          if (a.topk_is_int64) {
            static_cast<int64_t*>(a.out_topk_idx)[p * K + k] = -1;
          } else {
            static_cast<int32_t*>(a.out_topk_idx)[p * K + k] = -1;
          }
          if (a.out_topk_weights != nullptr) a.out_topk_weights[p * K + k] = 0.f;
        }
      }
    }
    // s_avail / s_abort are rewritten by the next channel's leader only after the group read them.
    named_barrier(1 + group_id, group_threads);
  }
}

// ---- copy-engine dispatch ----------------------------------------------------------------------
// Host side in cuda_buffer_cuda.cpp (CudaBuffer::send_with_copy_engines); docs/normal-kernels.md.
// Copy engines carry every NVLink byte: a source's whole x (token-indexed) to a destination that gets
// at least 15/16 of its tokens, else SM-packed chunks (row-indexed); each field has its own part of the
// slot. Kernels here wait, write the small per-row fields, pack, and move rows out of the staging. No
// flow control inside an operation: the host picks this path only when the largest transfer fits a
// slot, on every rank alike (from notify's numbers).

// Every block of a copy-engine receive kernel calls this last. The last block to finish publishes
// done = epoch to every rank (own rank too: the SM path's self-ring waits on it), so senders of the
// next operation may overwrite our staging/rings.
__device__ void finish_copy_receive(const CommArgs& comm, uint64_t epoch) {
  __shared__ bool s_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    auto* counter = reinterpret_cast<unsigned*>(comm.peers[comm.rank] + comm.off_copy_counter);
    __threadfence();  // NOTE: this block's reads of staging are complete before the count
    const unsigned prev = atomicAdd(counter, 1u);
    s_last = prev == gridDim.x - 1;
    if (s_last) *reinterpret_cast<volatile unsigned*>(counter) = 0;  // the next launch follows in stream order
  }
  __syncthreads();
  if (!s_last) return;
  const int R = comm.num_ranks, C = comm.num_channels;
  for (int i = threadIdx.x; i < R * C; i += blockDim.x) {
    st_release_sys(sig(comm, i / C, comm.off_done, comm.rank * C + i % C), epoch);
  }
}

// Every thread of the block calls it: waits until every remote destination released the previous
// operation (done >= epoch - 1 on every channel); false if a wait gave up.
__device__ bool peers_released(const CommArgs& comm, int32_t site) {
  __shared__ bool s_failed;
  const int R = comm.num_ranks, C = comm.num_channels, me = comm.rank;
  const uint64_t epoch = read_epoch(comm);
  if (threadIdx.x == 0) s_failed = false;
  __syncthreads();
  for (int i = threadIdx.x; i < R * C; i += blockDim.x) {
    const int d = i / C, c = i % C;
    if (d != me && !wait_geq(comm, sig(comm, me, comm.off_done, d * C + c), epoch - 1, site, d, c)) s_failed = true;
  }
  __syncthreads();
  return !s_failed;
}

__device__ __forceinline__ char* stage_slot_of(const CommArgs& comm, int owner, int src, int64_t slot_bytes) {
  return comm.peers[owner] + comm.off_ring + stage_slot(src, owner, comm.num_ranks) * slot_bytes;
}

__global__ void __launch_bounds__(256)
    copy_dispatch_begin_kernel(CommArgs comm, DispatchKernelArgs a, StageFields f, int64_t slot_bytes) {
  const int R = comm.num_ranks, C = comm.num_channels, me = comm.rank;
  if (!peers_released(comm, kSiteCopyDispatchReleased)) return;
  const int64_t T = a.num_tokens;
  const int K = a.num_topk;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  // One element per thread, consecutive threads at consecutive addresses (the remote stores coalesce).
  for (int d = 0; d < R; ++d) {
    if (d == me) continue;
    const int64_t n = a.chan_start[d * (C + 1) + C];
    const int32_t* list = a.list_tok + d * T;
    char* slot = stage_slot_of(comm, d, me, slot_bytes);
    for (int64_t i = first; i < n; i += stride) reinterpret_cast<int32_t*>(slot + f.src)[i] = list[i];
    if (K == 0) continue;
    for (int64_t e = first; e < n * K; e += stride) {
      const int64_t i = e / K;
      const LocalTopk v = local_topk(a, list[i], static_cast<int>(e - i * K), d);
      if (a.topk_is_int64) {
        reinterpret_cast<int64_t*>(slot + f.topk)[e] = v.id;
      } else {
        reinterpret_cast<int32_t*>(slot + f.topk)[e] = v.id;
      }
      if (a.has_weights) reinterpret_cast<float*>(slot + f.weights)[e] = v.weight;
    }
  }
}

__global__ void __launch_bounds__(kNormalThreads)
    pack_fields_kernel(CommArgs comm, DispatchKernelArgs a, char* stage_x, char* stage_scales, RowCounts send_offset,
                       unsigned pack_mask, int chunk, int num_chunks) {
  const int R = comm.num_ranks, C = comm.num_channels, me = comm.rank;
  const int lane = threadIdx.x & 31;
  const int64_t warp_id = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t num_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int64_t T = a.num_tokens, xb = a.x_row_bytes, sb = a.scale_row_bytes;
  int64_t begin[kNormalMaxRanks], count[kNormalMaxRanks], total = 0;
  for (int d = 0; d < R; ++d) {
    const int64_t n = d != me && ((pack_mask >> d) & 1u) ? a.chan_start[d * (C + 1) + C] : 0;
    begin[d] = chunk_begin(n, num_chunks, chunk);
    count[d] = chunk_begin(n, num_chunks, chunk + 1) - begin[d];
    total += count[d];
  }
  for (int64_t i = warp_id; i < total; i += num_warps) {
    int d = 0;
    int64_t j = i;
    while (j >= count[d]) j -= count[d++];
    const int64_t row = begin[d] + j;
    const int64_t t = a.list_tok[d * T + row];
    const int64_t p = send_offset.v[d] + row;
    warp_copy16(stage_x + p * xb, a.x + t * xb, xb, lane);
    if (sb > 0) warp_copy_bytes(stage_scales + p * sb, a.x_scales + t * sb, sb, lane);
  }
}

// Items of kItemRows rows: this rank's own rows first (nothing to wait for), then every remote source's
// rows, interleaved over sources so that early rows go first.
__global__ void __launch_bounds__(kNormalThreads)
    unpack_fields_kernel(CommArgs comm, DispatchKernelArgs a, StageFields f, int64_t slot_bytes, uint64_t ce_tag) {
  constexpr int64_t kItemRows = 32;
  __shared__ bool s_abort;
  const int R = comm.num_ranks, C = comm.num_channels, me = comm.rank;
  const RecvMetaLayout m{R, C, a.num_local_experts};
  const uint64_t epoch = read_epoch(comm);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  const int64_t T = a.num_tokens, xb = a.x_row_bytes, sb = a.scale_row_bytes;
  int64_t max_rows = 0;
  for (int s = 0; s < R; ++s) {
    const int64_t n = a.recv_meta[m.chan_start(s, C)] - a.recv_meta[m.chan_start(s, 0)];
    if (s != me && n > max_rows) max_rows = n;
  }
  const int64_t num_own = a.chan_start[me * (C + 1) + C];
  const int64_t num_own_items = (num_own + kItemRows - 1) / kItemRows;
  const int64_t num_items = num_own_items + (max_rows + kItemRows - 1) / kItemRows * (R - 1);
  for (int64_t id = blockIdx.x; id < num_items; id += gridDim.x) {
    if (id < num_own_items) {
      const int64_t own_base = a.recv_meta[m.rank_prefix(me)];
      const int64_t end = (id + 1) * kItemRows < num_own ? (id + 1) * kItemRows : num_own;
      for (int64_t i = id * kItemRows + warp; i < end; i += num_warps) {
        const int64_t t = a.list_tok[me * T + i], p = own_base + i;
        warp_copy16(a.out_x + p * xb, a.x + t * xb, xb, lane);
        if (sb > 0) warp_copy_bytes(a.out_scales + p * sb, a.x_scales + t * sb, sb, lane);
        if (lane < a.num_topk && a.topk_idx != nullptr && a.out_topk_idx != nullptr) {
          const LocalTopk v = local_topk(a, t, lane, me);
          store_topk_out(a, p, lane, v.id, v.weight);
        }
        if (lane == 0) a.out_src_idx[p] = static_cast<int32_t>(t);
      }
      continue;
    }
    const int64_t item = id - num_own_items;
    const int slot_id = static_cast<int>(item % (R - 1));
    const int src = (slot_id + me + 1) % R;  // stage_slot(src, me) == slot_id
    const int64_t n = a.recv_meta[m.chan_start(src, C)] - a.recv_meta[m.chan_start(src, 0)];
    const int64_t begin = item / (R - 1) * kItemRows;
    if (begin >= n) continue;
    const int64_t end = begin + kItemRows < n ? begin + kItemRows : n;
    const char* slot = stage_slot_of(comm, me, src, slot_bytes);
    const auto* src_ids = reinterpret_cast<const int32_t*>(slot + f.src);
    const bool whole = a.recv_meta[m.whole_tokens(src)] > 0;
    if (threadIdx.x == 0) {
      // Acquire: the copy engine's rows (and the begin kernel's fields, written before the first copy)
      // landed before the signal (stream order). Whole x: the signal counts tokens, so wait for the
      // first signal of this operation, then for the token of the item's last row.
      const uint64_t* tail = sig(comm, me, comm.off_ce_tail, src);
      bool ok = true;
      int64_t need = end;
      if (whole) {
        ok = wait_geq(comm, tail, ce_tag, kSiteCopyDispatchRows, src, 0);
        need = ok ? static_cast<int64_t>(*reinterpret_cast<const volatile int32_t*>(src_ids + end - 1)) + 1 : 0;
      }
      s_abort = !ok || !wait_geq(comm, tail, ce_tag + static_cast<uint64_t>(need), kSiteCopyDispatchRows, src, 0);
    }
    __syncthreads();
    if (s_abort) return;
    const int64_t out_base = a.recv_meta[m.rank_prefix(src)];
    for (int64_t i = begin + warp; i < end; i += num_warps) {
      const int64_t p = out_base + i;
      const int32_t token = __ldcg(src_ids + i);
      const int64_t row = whole ? token : i;
      warp_copy16_coherent(a.out_x + p * xb, slot + f.x + row * xb, xb, lane);
      if (sb > 0) warp_copy_bytes(a.out_scales + p * sb, slot + f.scales + row * sb, sb, lane);
      if (lane < a.num_topk && a.out_topk_idx != nullptr) {
        const int64_t e = i * a.num_topk + lane;
        const int32_t id = a.topk_is_int64
                               ? static_cast<int32_t>(__ldcg(reinterpret_cast<const long long*>(slot + f.topk) + e))
                               : __ldcg(reinterpret_cast<const int32_t*>(slot + f.topk) + e);
        const float w =
            a.out_topk_weights != nullptr ? __ldcg(reinterpret_cast<const float*>(slot + f.weights) + e) : 0.f;
        store_topk_out(a, p, lane, id, w);
      }
      if (lane == 0) a.out_src_idx[p] = token;
    }
    __syncthreads();
  }
  finish_copy_receive(comm, epoch);
}

__global__ void wait_released_kernel(CommArgs comm, int32_t site) { peers_released(comm, site); }

// NOTE: launched after the copies (events), so the rows are in the destination's memory; the release
// at system scope orders this flag after them for the destination's acquire.
__global__ void signal_rows_kernel(CommArgs comm, RowCounts rows, uint64_t ce_tag) {
  const int d = threadIdx.x;
  if (d < comm.num_ranks && d != comm.rank && rows.v[d] >= 0) {
    st_release_sys(sig(comm, d, comm.off_ce_tail, comm.rank), ce_tag + static_cast<uint64_t>(rows.v[d]));
  }
}

// ---- combine ----------------------------------------------------------------------------------

// One warp: out[tt] = bf16(sum of the rows (fp32, in the given order) + bias_0 + bias_1), and the same
// sum of the top-k weights rows. Rows may be written by other GPUs or copy engines: loads skip L1.
// kPairs: two source rows' loads in flight before either is added (more registers: blocks of at most
// kReduceThreads threads).
template <bool kPairs>
__device__ __forceinline__ void reduce_token(const CombineKernelArgs& a, int64_t tt, const char* const* rows,
                                             const float* const* wrows, int num_src, int lane) {
  const int64_t H = a.hidden;
  const int K = a.num_topk;
  // kUnroll chunks per lane per step, so each source row has kUnroll loads in flight.
  constexpr int kUnroll = 4;
  const int64_t num_chunks = H / 8;
  const uint16_t* biases[2] = {a.bias_0, a.bias_1};
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
    // The sum order stays j = 0, 1, 2, ... either way.
    for (int j = 0; j < num_src; j += kPairs ? 2 : 1) {
      int4 in0[kUnroll], in1[kUnroll];
      load(reinterpret_cast<const int4*>(rows[j]), true, in0);
      if (kPairs && j + 1 < num_src) load(reinterpret_cast<const int4*>(rows[j + 1]), true, in1);
      add(in0);
      if (kPairs && j + 1 < num_src) add(in1);
    }
    for (const uint16_t* bias : biases) {
      if (bias == nullptr) continue;
      int4 in[kUnroll];
      load(reinterpret_cast<const int4*>(bias + tt * H), false, in);
      add(in);
    }
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

__global__ void __launch_bounds__(kNormalThreads) combine_kernel(CommArgs comm, CombineKernelArgs a) {
  __shared__ bool s_abort[kNormalMaxRanks];
  __shared__ bool s_stall_abort;
  __shared__ int64_t s_tail[kNormalMaxRanks];
  __shared__ int64_t s_consumed[kNormalMaxRanks];
  __shared__ int s_first_missing;
  const int R = comm.num_ranks, C = comm.num_channels, me = comm.rank;
  const bool is_sender = (blockIdx.x & 1) == 0;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint64_t epoch = read_epoch(comm);
  const uint64_t tag = epoch << 32;
  const int K = a.num_topk;
  const int64_t H = a.hidden;
  const int64_t x_bytes = H * 2;
  const RecvMetaLayout m{R, C, 0};

  if (is_sender) {
    const int warps_per_group = (kNormalThreads / 32) / R;
    const int group_id = warp / warps_per_group;
    if (group_id >= R) return;
    const int peer = group_id;
    // Channels in turn as in dispatch_kernel (a grid smaller than 2 * C).
    for (int channel = blockIdx.x >> 1; channel < C; channel += gridDim.x >> 1) {
      const int64_t first = a.recv_meta[m.chan_start(peer, channel)];
      const int64_t num_rows = a.recv_meta[m.chan_start(peer, channel + 1)] - first;
      const int64_t base = a.recv_meta[m.rank_prefix(peer)] + first;
      if (!send_rows(comm, peer, channel, num_rows, a.ring_rows, a.row_bytes, kSiteCombineSendDone,
                     kSiteCombineSendHead, group_id, warps_per_group * 32, warp % warps_per_group, warps_per_group,
                     lane, s_abort, [&](int64_t i, char* row, int l) {
                       const int64_t p = base + i;
                       warp_copy16(row, reinterpret_cast<const char*>(a.x + p * H), x_bytes, l);
                       if (a.topk_weights != nullptr && l < K) {
                         reinterpret_cast<float*>(row + x_bytes)[l] = a.topk_weights[p * K + l];
                       }
                     })) {
        return;
      }
    }
    return;
  }

  // Receiver: tokens of this channel in order; a token is ready once every rank it went to delivered
  // its row. Only the prefix before the first token that is not ready is processed (a later token may
  // be ready while an earlier one still waits for another rank).
  const int64_t T = a.num_tokens;
  const int num_warps = kNormalThreads / 32;
  for (int channel = blockIdx.x >> 1; channel < C; channel += gridDim.x >> 1) {
    const int64_t t_begin = T * channel / C, t_end = T * (channel + 1) / C;
    if (threadIdx.x < R) s_consumed[threadIdx.x] = 0;
    if (threadIdx.x == 0) s_stall_abort = false;
    uint64_t stall_start = global_ns();
    for (int64_t cursor = t_begin; cursor < t_end;) {
      if (threadIdx.x < R) {
        const uint64_t v = ld_acquire_sys(sig(comm, me, comm.off_tail, threadIdx.x * C + channel));
        s_tail[threadIdx.x] = v >= tag ? static_cast<int64_t>(v - tag) : 0;
      }
      if (threadIdx.x == 0) s_first_missing = kNormalThreads;
      __syncthreads();
      const int64_t t = cursor + threadIdx.x;
      bool ready = t < t_end;
      for (int r = 0; r < R && ready; ++r) {
        if (a.is_token_in_rank[t * R + r]) {
          const int64_t li = a.excl_pos[r * (T + 1) + t] - a.chan_start[r * (C + 1) + channel];
          if (li >= s_tail[r]) ready = false;
        }
      }
      if (!ready) atomicMin(&s_first_missing, static_cast<int>(threadIdx.x));
      __syncthreads();
      const int num_ready = s_first_missing;
      if (num_ready == 0) {
        if (threadIdx.x == 0) {
          if (aborted(comm)) {
            s_stall_abort = true;
          } else if (global_ns() - stall_start > comm.timeout_ns) {
            // Name the first rank whose row is missing.
            int who = -1;
            int64_t want = 0;
            for (int r = 0; r < R && who < 0; ++r) {
              if (a.is_token_in_rank[cursor * R + r]) {
                const int64_t li = a.excl_pos[r * (T + 1) + cursor] - a.chan_start[r * (C + 1) + channel];
                if (li >= s_tail[r]) {
                  who = r;
                  want = li + 1;
                }
              }
            }
            record_error(comm, kErrTimeout, kSiteCombineRecvTail, who, channel, static_cast<int64_t>(tag) + want,
                         static_cast<int64_t>(tag) + (who >= 0 ? s_tail[who] : 0));
            s_stall_abort = true;
          }
        }
        __syncthreads();
        if (s_stall_abort) return;
        continue;
      }
      stall_start = global_ns();
      for (int64_t tt = cursor + warp; tt < cursor + num_ready; tt += num_warps) {
        const char* rows[kNormalMaxRanks];
        int num_src = 0;
        for (int r = 0; r < R; ++r) {
          if (a.is_token_in_rank[tt * R + r]) {
            const int64_t li = a.excl_pos[r * (T + 1) + tt] - a.chan_start[r * (C + 1) + channel];
            rows[num_src++] = comm.peers[me] + comm.off_ring +
                              (static_cast<int64_t>(r) * C + channel) * comm.ring_slab_bytes +
                              (li % a.ring_rows) * a.row_bytes;
          }
        }
        const float* wrows[kNormalMaxRanks];
        for (int j = 0; j < num_src; ++j) wrows[j] = reinterpret_cast<const float*>(rows[j] + x_bytes);
        reduce_token<false>(a, tt, rows, wrows, num_src, lane);
      }
      // Rows consumed per source rank: one count per rank over the processed tokens.
      const bool mine = threadIdx.x < num_ready;
      for (int r = 0; r < R; ++r) {
        const int cnt = __syncthreads_count(mine && a.is_token_in_rank[t * R + r]);
        if (threadIdx.x == 0) s_consumed[r] += cnt;
      }
      __syncthreads();
      if (threadIdx.x < R) {
        st_release_sys(sig(comm, threadIdx.x, comm.off_head, me * C + channel),
                       tag + static_cast<uint64_t>(s_consumed[threadIdx.x]));
      }
      cursor += num_ready;
    }
    __syncthreads();
    if (threadIdx.x < R) st_release_sys(sig(comm, threadIdx.x, comm.off_done, me * C + channel), epoch);
    __syncthreads();  // the shared state is reset by the next channel
  }
}

// Copy-engine combine, receive side (see the dispatch notes above): windows of tokens, each block
// waits until every remote rank's rows up to its window's end arrived, then reduces it. Own rows are
// read from the combine input.
__global__ void __launch_bounds__(kReduceThreads)
    combine_reduce_kernel(CommArgs comm, CombineKernelArgs a, int64_t slot_bytes, int64_t weights_offset,
                          uint64_t ce_tag) {
  __shared__ bool s_abort;
  const int R = comm.num_ranks, C = comm.num_channels, me = comm.rank;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  const int64_t kWindow = num_warps;  // one token per warp
  const uint64_t epoch = read_epoch(comm);
  const int64_t T = a.num_tokens, H = a.hidden;
  const int K = a.num_topk;
  const int64_t own_base = a.recv_meta[RecvMetaLayout{R, C, 0}.rank_prefix(me)];
  const int64_t num_windows = (T + kWindow - 1) / kWindow;
  for (int64_t w = blockIdx.x; w < num_windows; w += gridDim.x) {
    const int64_t t0 = w * kWindow, t1 = t0 + kWindow < T ? t0 + kWindow : T;
    if (threadIdx.x == 0) s_abort = false;
    __syncthreads();
    if (threadIdx.x < R && static_cast<int>(threadIdx.x) != me) {
      const int r = threadIdx.x;
      const int64_t need = a.excl_pos[r * (T + 1) + t1];  // rows of tokens < t1 that went to r
      if (need > 0 && !wait_geq(comm, sig(comm, me, comm.off_ce_tail, r), ce_tag + static_cast<uint64_t>(need),
                                kSiteCopyCombineRows, r, 0)) {
        s_abort = true;
      }
    }
    __syncthreads();
    if (s_abort) return;
    for (int64_t tt = t0 + warp; tt < t1; tt += num_warps) {
      const char* rows[kNormalMaxRanks];
      const float* wrows[kNormalMaxRanks];
      int num_src = 0;
      for (int r = 0; r < R; ++r) {
        if (!a.is_token_in_rank[tt * R + r]) continue;
        const int64_t li = a.excl_pos[r * (T + 1) + tt];
        if (r == me) {
          rows[num_src] = reinterpret_cast<const char*>(a.x + (own_base + li) * H);
          wrows[num_src] = a.topk_weights + (own_base + li) * K;
        } else {
          const char* slot = stage_slot_of(comm, me, r, slot_bytes);
          rows[num_src] = slot + li * H * 2;
          wrows[num_src] = reinterpret_cast<const float*>(slot + weights_offset) + li * K;
        }
        ++num_src;
      }
      reduce_token<true>(a, tt, rows, wrows, num_src, lane);
    }
    __syncthreads();
  }
  finish_copy_receive(comm, epoch);
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

cudaError_t preload_normal_kernels() {
  const void* kernels[] = {
      reinterpret_cast<const void*>(&layout_kernel),
      reinterpret_cast<const void*>(&layout_cluster_kernel),
      reinterpret_cast<const void*>(&scan_kernel),
      reinterpret_cast<const void*>(&advance_epoch_kernel),
      reinterpret_cast<const void*>(&notify_kernel),
      reinterpret_cast<const void*>(&dispatch_kernel),
      reinterpret_cast<const void*>(&copy_dispatch_begin_kernel),
      reinterpret_cast<const void*>(&pack_fields_kernel),
      reinterpret_cast<const void*>(&unpack_fields_kernel),
      reinterpret_cast<const void*>(&wait_released_kernel),
      reinterpret_cast<const void*>(&signal_rows_kernel),
      reinterpret_cast<const void*>(&combine_kernel),
      reinterpret_cast<const void*>(&combine_reduce_kernel),
      reinterpret_cast<const void*>(&gather_scales_kernel),
  };
  for (const void* k : kernels) {
    cudaFuncAttributes attr{};
    const cudaError_t err = cudaFuncGetAttributes(&attr, k);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

void launch_layout(const void* topk_idx, bool is_int64, int64_t num_tokens, int num_topk, int64_t num_experts,
                   int num_ranks, int32_t* num_tokens_per_rank, int32_t* num_tokens_per_expert,
                   uint8_t* is_token_in_rank, ErrorRecord* value_error, int rank, cudaStream_t stream) {
  if (num_tokens * num_topk <= kLayoutClusterEntries) {
    layout_cluster_kernel<<<kLayoutClusterBlocks, kLayoutClusterThreads, num_experts * sizeof(int32_t), stream>>>(
        topk_idx, is_int64, num_tokens, num_topk, num_experts, num_ranks, num_tokens_per_rank, num_tokens_per_expert,
        is_token_in_rank, value_error, rank);
    return;
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

void launch_advance_epoch(const CommArgs& comm, cudaStream_t stream) {
  advance_epoch_kernel<<<1, 1, 0, stream>>>(comm);
}

void launch_notify(const CommArgs& comm, const int32_t* chan_start, const int32_t* num_tokens_per_expert,
                   int num_local_experts, int expert_alignment, int64_t num_tokens, bool whole, int32_t* recv_meta,
                   int32_t* recv_expert_counts, int32_t* rank_prefix_matrix, cudaStream_t stream) {
  notify_kernel<<<1, 256, 0, stream>>>(comm, chan_start, num_tokens_per_expert, num_local_experts, expert_alignment,
                                       num_tokens, whole, recv_meta, recv_expert_counts, rank_prefix_matrix);
}

namespace {
unsigned ring_blocks(const CommArgs& comm, int num_sms) {
  const int pairs = num_sms / 2 < 1 ? 1 : num_sms / 2;
  return 2u * static_cast<unsigned>(pairs < comm.num_channels ? pairs : comm.num_channels);
}
}  // namespace

void launch_dispatch(const CommArgs& comm, const DispatchKernelArgs& args, int num_sms, cudaStream_t stream) {
  dispatch_kernel<<<ring_blocks(comm, num_sms), kNormalThreads, 0, stream>>>(comm, args);
}

void launch_combine(const CommArgs& comm, const CombineKernelArgs& args, int num_sms, cudaStream_t stream) {
  combine_kernel<<<ring_blocks(comm, num_sms), kNormalThreads, 0, stream>>>(comm, args);
}

void launch_gather_scales(const void* src, int64_t stride0, int64_t stride1, int elem_bytes, int64_t num_tokens,
                          int64_t num_scales, void* dst, cudaStream_t stream) {
  const int64_t n = num_tokens * num_scales;
  if (n == 0) return;
  const int64_t blocks = (n + 255) / 256 < 1024 ? (n + 255) / 256 : 1024;
  gather_scales_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(src, stride0, stride1, elem_bytes, num_tokens,
                                                                          num_scales, dst);
}

void launch_copy_dispatch_begin(const CommArgs& comm, const DispatchKernelArgs& args, const StageFields& fields,
                                int64_t slot_bytes, cudaStream_t stream) {
  copy_dispatch_begin_kernel<<<16, 256, 0, stream>>>(comm, args, fields, slot_bytes);
}

void launch_pack_fields(const CommArgs& comm, const DispatchKernelArgs& args, char* stage_x, char* stage_scales,
                        const RowCounts& send_offset, unsigned pack_mask, int chunk, int num_chunks, int num_blocks,
                        cudaStream_t stream) {
  pack_fields_kernel<<<num_blocks, kNormalThreads, 0, stream>>>(comm, args, stage_x, stage_scales, send_offset,
                                                                pack_mask, chunk, num_chunks);
}

void launch_unpack_fields(const CommArgs& comm, const DispatchKernelArgs& args, const StageFields& fields,
                          int64_t slot_bytes, uint64_t ce_tag, int num_blocks, cudaStream_t stream) {
  unpack_fields_kernel<<<num_blocks, kNormalThreads, 0, stream>>>(comm, args, fields, slot_bytes, ce_tag);
}

void launch_wait_released(const CommArgs& comm, int32_t site, cudaStream_t stream) {
  wait_released_kernel<<<1, 512, 0, stream>>>(comm, site);
}

void launch_signal_rows(const CommArgs& comm, const RowCounts& rows, uint64_t ce_tag, cudaStream_t stream) {
  signal_rows_kernel<<<1, 32, 0, stream>>>(comm, rows, ce_tag);
}

void launch_combine_reduce(const CommArgs& comm, const CombineKernelArgs& args, int64_t slot_bytes,
                           int64_t weights_offset, uint64_t ce_tag, int num_blocks, cudaStream_t stream) {
  combine_reduce_kernel<<<num_blocks, kReduceThreads, 0, stream>>>(comm, args, slot_bytes, weights_offset, ce_tag);
}

}  // namespace epx::cuda
