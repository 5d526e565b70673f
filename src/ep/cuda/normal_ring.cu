// Normal path on SMs only: dispatch and combine through per-(source, channel) rings in the peers' memory.
// Protocol: docs/normal-kernels.md.
#include "core/cuda/cuda_util.h"
#include "ep/cuda/normal_device.cuh"

namespace epx::cuda {
namespace {

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
            !wait_geq(comm, tail, tag + static_cast<uint64_t>(consumed + 1), kSiteDispatchRecvTail, peer, channel) ||
            (consumed == 0 &&
             !same_dispatch(comm, epoch, peer, a.handle_id, a.shape_word, kSiteDispatchRecvTail, channel));
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
    if (leader) {
      (void)staging_kept(comm, kSiteReceiveEnd, channel);
      st_release_sys(sig(comm, peer, comm.off_done, me * C + channel), epoch);
    }

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

// ---- combine ----------------------------------------------------------------------------------

__global__ void __launch_bounds__(kNormalThreads) combine_kernel(CommArgs comm, CombineKernelArgs a) {
  __shared__ bool s_abort[kNormalMaxRanks];
  __shared__ bool s_stall_abort;
  __shared__ int64_t s_tail[kNormalMaxRanks];
  __shared__ int64_t s_consumed[kNormalMaxRanks];
  __shared__ int s_first_missing;
  __shared__ bool s_checked[kNormalMaxRanks];  // the rank's handle id was compared on this channel
  __shared__ bool s_mismatch;
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
    if (threadIdx.x < R) {
      s_consumed[threadIdx.x] = 0;
      s_checked[threadIdx.x] = false;
    }
    if (threadIdx.x == 0) s_stall_abort = s_mismatch = false;
    __syncthreads();
    uint64_t stall_start = global_ns();
    for (int64_t cursor = t_begin; cursor < t_end;) {
      if (threadIdx.x < R) {
        const uint64_t v = ld_acquire_sys(sig(comm, me, comm.off_tail, threadIdx.x * C + channel));
        s_tail[threadIdx.x] = v >= tag ? static_cast<int64_t>(v - tag) : 0;
        // Rows of this operation from the rank: it must reverse the same dispatch (checked once per channel).
        if (v > tag && !s_checked[threadIdx.x]) {
          s_checked[threadIdx.x] = true;
          if (!same_dispatch(comm, epoch, threadIdx.x, a.handle_id, a.shape_word, kSiteCombineRecvTail, channel))
            s_mismatch = true;
        }
      }
      if (threadIdx.x == 0) s_first_missing = kNormalThreads;
      __syncthreads();
      if (s_mismatch) return;
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
          bool other_call = false;
          for (int r = 0; r < R && !other_call; ++r)
            other_call = peer_in_other_call(comm, r, kSiteCombineRecvTail, channel);
          if (other_call || aborted(comm) || peer_left(comm, kSiteCombineRecvTail, channel)) {
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
        int order[kNormalMaxRanks];
        const int num_src = combine_rank_order(a, R, tt, order);
        for (int j = 0; j < num_src; ++j) {
          const int r = order[j];
          const int64_t li = a.excl_pos[r * (T + 1) + tt] - a.chan_start[r * (C + 1) + channel];
          rows[j] = comm.peers[me] + comm.off_ring + (static_cast<int64_t>(r) * C + channel) * comm.ring_slab_bytes +
                    (li % a.ring_rows) * a.row_bytes;
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
    if (threadIdx.x == 0) (void)staging_kept(comm, kSiteReceiveEnd, channel);
    if (threadIdx.x < R) st_release_sys(sig(comm, threadIdx.x, comm.off_done, me * C + channel), epoch);
    __syncthreads();  // the shared state is reset by the next channel
  }
}

}  // namespace

cudaError_t preload_ring_kernels() {
  return preload_kernels(
      {reinterpret_cast<const void*>(&dispatch_kernel), reinterpret_cast<const void*>(&combine_kernel)});
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

}  // namespace epx::cuda
