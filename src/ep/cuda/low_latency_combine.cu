// Low-latency combine: expert outputs back to each token's rank, then the weighted reduction per token.
// Protocol: docs/low-latency.md.
#include <algorithm>

#include "comm/cuda/device/pdl.cuh"
#include "core/cuda/cuda_util.h"
#include "ep/cuda/low_latency_device.cuh"
#include "ep/cuda/low_latency_partials.cuh"

namespace epx::cuda {
namespace {

// ---- combine ------------------------------------------------------------------------------------------

// Grid: `parts` blocks per local expert (a power of two), each taking every parts-th vector of the expert's
// rows; the last block of an expert to finish (a monotonic per-expert counter) raises the expert's signals. An
// expert with at most args.solo_max_rows received rows (every source counted, masked or not, so every part decides
// alike) is sent by part 0 alone, which raises the signals after a barrier without the counter; the other parts return
// at once. The counter then stays a multiple of `parts`.
__device__ void combine_send_block(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                   const LowLatencyCombineLaunch& args, int64_t block, int grid_parts) {
  __shared__ int row_start[kLowLatencyMaxRanks + 1];  // prefix of the rows to send, by destination rank
  __shared__ int row_begin[kLowLatencyMaxRanks];      // packed row of rank r's first pair in x (the dispatch's)
  __shared__ bool solo;
  const int64_t e_local = block / grid_parts;
  const int part = static_cast<int>(block % grid_parts);
  const int R = peers.num_ranks;
  const int64_t M = layout.max_tokens_per_rank;
  const int64_t H = layout.hidden;
  char* base = peers.bases[peers.rank];
  LowLatencyControl* ctrl = control_of(peers, layout);
  const uint64_t tag = ctrl->combine_seq[set] + 1;
  const LowLatencySet& d = layout.sets[args.dispatch_set];
  const LowLatencySet& c = layout.sets[set];
  if (threadIdx.x == 0) {
    const int64_t* ranges = at<int64_t>(base, d.layout_range) + e_local * R;
    int rows = 0, received = 0;
    for (int r = 0; r < R; ++r) {
      row_start[r] = rows;
      row_begin[r] = static_cast<int>(ranges[r] >> 32);
      received += static_cast<int>(ranges[r] & 0xffffffff);
      if (ld_volatile_global(&ctrl->mask[r]) == 0) rows += static_cast<int>(ranges[r] & 0xffffffff);
    }
    row_start[R] = rows;
    solo = grid_parts == 1 || received <= args.solo_max_rows;
  }
  __syncthreads();
  if (solo && part != 0) return;
  const int parts = solo ? 1 : grid_parts;
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
        const int r = source_of_row(row_start, R, row);
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
  // NOTE: solo: the barrier orders the block's row stores before the release of each signal (as the normal path's
  // groups do, device/ordering.cuh); no other block took part, so no counter and no fence.
  bool last_part = true;
  if (solo) {
    __syncthreads();
  } else {
    last_part = last_of_parts(&ctrl->combine_parts_done[e_local], parts);
  }
  if (last_part && threadIdx.x < R && ld_volatile_global(&ctrl->mask[threadIdx.x]) == 0) {
    const int r = threadIdx.x;
    // kCombineNoRows: this rank's dispatch receive missed r's pairs (r masked then, or a wait timed out), so none of
    // r's rows was sent above; r counts this expert as zero instead of reading rows of an earlier call.
    const uint64_t no_rows = dispatch_missed(ctrl, args.dispatch_set, r) ? kCombineNoRows : 0;
    st_release_sys(at<uint64_t>(peers.bases[r], c.combine_signals) + peers.rank * layout.num_local_experts + e_local,
                   (tag << kCombineIdBits) | no_rows | (args.dispatch_id & kCombineIdMask));
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
  const uint64_t tag = ctrl->combine_seq[set] + 1;
  const LowLatencySet& c = layout.sets[set];
  const auto* topk = static_cast<const TopkT*>(args.topk);
  auto* out = static_cast<uint4*>(args.out);
  const int64_t row_vecs = H / 8;
  for_each_recv_unit(
      args.num_tokens, row_vecs, first_block, num_blocks,
      [&](int64_t t) {
        if (threadIdx.x >= K) return;
        const int k = threadIdx.x;
        const int64_t e = static_cast<int64_t>(topk[t * K + k]);
        bool ok = false;
        // NOTE: an id outside [0, num_experts) was sent to no expert by dispatch: treat it as -1 here too
        // instead of indexing the mask and the signals out of bounds.
        if (e >= 0 && e < layout.num_experts) {
          const int r = static_cast<int>(e / layout.num_local_experts);
          uint64_t v = 0;
          if (ld_volatile_global(&ctrl->mask[r]) == 0 &&
              wait_tag(peers, ctrl, at<uint64_t>(base, c.combine_signals) + e, tag, kCombineIdBits, r,
                       static_cast<int>(e), kSiteLowLatencyCombineRecv, &v,
                       args.wait_cost != nullptr ? args.wait_cost + r : nullptr)) {
            // The expert's rank must reverse the same dispatch; otherwise its rows are left out (reported).
            // kCombineNoRows: it sent none of this rank's rows this call (its dispatch receive missed them).
            ok = signal_counts(peers, v, args.dispatch_id, r, static_cast<int>(e));
          }
        }
        valid[k] = ok;
        weights[k] = ok ? args.topk_weights[t * K + k] : 0.f;
      },
      [&](int64_t t, int64_t v) {
        const auto* rows = at<const uint4>(base, c.combine_data + t * kLowLatencyMaxTopk * H * 2);
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        sum_slots<8>(
            acc, K, [&](int k) { return valid[k]; }, [&](int k) { return rows[k * row_vecs + v]; },
            [&](float* a, int k, uint4 raw) { add_weighted(a, raw, weights[k]); });
        out[t * row_vecs + v] = pack_bf16x8(acc);
      });
}

// At least one block, so the set's sequence number advances on an idle rank too.
unsigned combine_recv_blocks_for(int64_t num_tokens) {
  const int64_t units = num_tokens * combine_recv_parts(num_tokens);
  return static_cast<unsigned>(units < 1 ? 1 : (units < kCombineRecvBlocks ? units : kCombineRecvBlocks));
}

}  // namespace

namespace ll {

// kSend: `parts` blocks per local expert. kRecv: the receive blocks. kBoth: the first E_local * parts blocks
// send, the rest receive. Programmatic launches: the NOTE at ll::dispatch.
template <typename TopkT>
__global__ void __launch_bounds__(kThreads) combine(LowLatencyPeers peers, LowLatencyLayout layout, int set,
                                                    LowLatencyCombineLaunch args, int parts, Phase phase) {
  // LowLatencyCombineLaunch::expert_side: the halves of low_latency_partials.cuh (its send blocks wait for the
  // peers' weights, so a send-only grid of them triggers by exiting too).
  const bool expert_side = args.expert_side;
  const int64_t num_send =
      phase == Phase::kRecv ? 0 : (expert_side ? args.partial_send_blocks : layout.num_local_experts * parts);
  griddepcontrol_wait();
  if (blockIdx.x < num_send) {
    if (phase == Phase::kSend && !expert_side) griddepcontrol_launch_dependents();  // waits for no other grid
    if (expert_side) {
      partial_send_block(peers, layout, set, args, static_cast<int>(blockIdx.x), static_cast<int>(num_send));
    } else {
      combine_send_block(peers, layout, set, args, blockIdx.x, parts);
    }
    if (phase == Phase::kSend) return;
  } else if (expert_side) {
    partial_recv_blocks<TopkT>(peers, layout, set, args, blockIdx.x - num_send, gridDim.x - num_send);
  } else {
    combine_recv_blocks<TopkT>(peers, layout, set, args, blockIdx.x - num_send, gridDim.x - num_send);
  }
  // NOTE: a receiving grid lets the next kernel in only as its blocks exit: its last block waits in the completion
  // rule, and a dependent grid holding SMs meanwhile could keep a peer sharing the GPU from sending (the NOTE at
  // ll::dispatch). With the expert-side reduction the rule covers every open rank's signal (one per rank).
  LowLatencyControl* ctrl = control_of(peers, layout);
  const uint64_t* signals = at<uint64_t>(peers.bases[peers.rank], layout.sets[set].combine_signals);
  if (expert_side) {
    finish_combine_grid(peers, ctrl, signals, ctrl->combine_seq[set] + 1, 0, peers.num_ranks, 1,
                        &ctrl->combine_ticket[set], &ctrl->combine_seq[set], args.wait_cost);
  } else {
    finish_combine_grid(peers, ctrl, signals, ctrl->combine_seq[set] + 1, 0, layout.num_experts,
                        layout.num_local_experts, &ctrl->combine_ticket[set], &ctrl->combine_seq[set], args.wait_cost);
  }
}

}  // namespace ll

cudaError_t preload_low_latency_combine_kernels() {
  return preload_kernels(
      {reinterpret_cast<const void*>(&ll::combine<int64_t>), reinterpret_cast<const void*>(&ll::combine<int32_t>)});
}

namespace {

// Launch shape per phase (see ll::combine).
void launch_combine(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                    const LowLatencyCombineLaunch& args, ll::Phase phase, cudaStream_t stream, const char* what) {
  const int parts = args.send_parts;
  LowLatencyCombineLaunch a = args;
  if (a.expert_side && a.partial_send_blocks <= 0) a.partial_send_blocks = partial_send_blocks(layout);
  const unsigned num_send = phase == ll::Phase::kRecv ? 0
                            : a.expert_side           ? static_cast<unsigned>(a.partial_send_blocks)
                                                      : static_cast<unsigned>(layout.num_local_experts * parts);
  unsigned num_recv = phase == ll::Phase::kSend ? 0 : combine_recv_blocks_for(args.num_tokens);
  if (a.recv_blocks > 0) num_recv = std::min(num_recv, static_cast<unsigned>(a.recv_blocks));
  const dim3 grid(num_send + num_recv);
  launch_for_topk_type(args.topk_int64, what, [&](auto topk_id) {
    check_cuda(launch_kernel(&ll::combine<decltype(topk_id)>, grid, dim3(kThreads), 0, stream, args.programmatic_launch,
                             peers, layout, set, a, parts, phase),
               what);
  });
}

}  // namespace

SharedGpuCombineGrid shared_gpu_combine_grid(int sharing) {
  if (sharing <= 1) return {};
  int device = 0, per_sm = 0, sms = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, &ll::combine<int64_t>, kThreads, 0),
             "cudaOccupancyMaxActiveBlocksPerMultiprocessor (low-latency combine)");
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  // A quarter of each rank's share of resident blocks receives and (expert-side) a quarter sends: half the GPU is left
  // for the default combine's sends, other kernels beside these and any block that does not leave at once.
  const int quarter = std::max(1, per_sm * sms / sharing / 4);
  SharedGpuCombineGrid grid;
  grid.send_blocks = 1;
  while (grid.send_blocks * 2 <= quarter && grid.send_blocks < 128) grid.send_blocks *= 2;
  grid.recv_blocks = quarter;
  return grid;
}

void launch_low_latency_combine(ll::Phase phase, const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                const LowLatencyCombineLaunch& args, cudaStream_t stream) {
  launch_combine(peers, layout, set, args, phase, stream,
                 phase == ll::Phase::kSend   ? "low-latency combine send"
                 : phase == ll::Phase::kRecv ? "low-latency combine receive"
                                             : "low-latency combine");
}

}  // namespace epx::cuda
