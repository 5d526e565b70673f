// Kernels of the hierarchical low-latency combine: send_rows, reduce and llh::combine.
// Protocol and memory order: hierarchical_low_latency_kernels.h.
// NOTE: kernel names: only llh::combine contains "combine" and none contains "dispatch", so that profiler-based tools
// find one kernel per direction by name: the dispatch receive is the flat ll::dispatch (kRecv), unchanged.
#include <algorithm>

#include "core/cuda/cuda_util.h"
#include "ep/cuda/hierarchical_low_latency_device.cuh"

namespace epx::cuda {

namespace llh {

using namespace llh_detail;

// `parts` blocks per local expert: each received pair's row back to the source (same node: the flat combine slot) or
// to the source's forwarder on this node (relay rows [slot of the source's node][token][k]); the last part of an
// expert raises the signals: the flat one per same-node source, a relay one per (other-node source, forwarder).
__global__ void __launch_bounds__(kThreads)
    send_rows(LowLatencyPeers peers, LowLatencyLayout layout, RelayView relay, RelayRowsArgs args) {
  __shared__ int row_start[kLowLatencyMaxRanks + 1];  // prefix of the rows to send, by source rank
  __shared__ int row_begin[kLowLatencyMaxRanks];      // packed row of source r's first pair in x
  __shared__ bool open[kLowLatencyMaxRanks];          // source r's path is open (not masked here)
  __shared__ bool lost[kLowLatencyMaxRanks];          // the dispatch receive here missed source r's pairs
  const int parts = args.parts;
  const int64_t e_local = blockIdx.x / parts;
  const int part = static_cast<int>(blockIdx.x % parts);
  const int R = peers.num_ranks, G = relay.gpus_per_node, node = relay.node, K = args.num_topk;
  const int64_t M = layout.max_tokens_per_rank, H = layout.hidden, E_local = layout.num_local_experts;
  char* base = peers.bases[peers.rank];
  LowLatencyControl* ctrl = control_of(peers, layout);
  const uint64_t tag = ctrl->combine_seq[args.set] + 1;
  const LowLatencySet& d = layout.sets[args.dispatch_set];
  const LowLatencySet& c = layout.sets[args.set];
  if (threadIdx.x == 0) {
    const int64_t* ranges = at<int64_t>(base, d.layout_range) + e_local * R;
    int rows = 0;
    for (int r = 0; r < R; ++r) {
      const int via = path_peer(peers.rank, r, G);
      open[r] = ld_volatile_global(&ctrl->mask[r]) == 0 && ld_volatile_global(&ctrl->mask[via]) == 0;
      // A mask lifted since the dispatch: none of r's rows are here to send (its count is 0), and r must hear so
      // (kCombineNoRows, or the relay's cut) instead of reading rows of an earlier call (docs/low-latency.md).
      lost[r] = dispatch_missed(ctrl, args.dispatch_set, r);
      row_start[r] = rows;
      row_begin[r] = static_cast<int>(ranges[r] >> 32);
      if (open[r]) rows += static_cast<int>(ranges[r] & 0xffffffff);
    }
    row_start[R] = rows;
  }
  __syncthreads();
  // Where the row of (source r, token t, slot k) goes.
  auto target = [&](int r, int t, int k) -> char* {
    if (r / G == node)
      return peers.bases[r] + c.combine_data + (static_cast<int64_t>(t) * kLowLatencyMaxTopk + k) * H * 2;
    const int f = path_peer(peers.rank, r, G);
    return relay.bases[f] + relay.off.rows[args.set] +
           ((static_cast<int64_t>(slot_of(r / G, node)) * M + t) * K + k) * H * 2;
  };
  const int* src_info = at<int>(base, d.dispatch_src_info);
  const int* slot_k = at<int>(base, d.dispatch_slot_k);
  const auto* x = static_cast<const int4*>(args.x);
  const int64_t row_vecs = H / 8;
  const int64_t items = static_cast<int64_t>(row_start[R]) * row_vecs;
  const int64_t stride = static_cast<int64_t>(kThreads) * parts;
  for (int64_t first = part * kThreads + threadIdx.x; first < items; first += stride * kUnroll) {
    int4 v[kUnroll];
    int4* to[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t item = first + u * stride;
      if (item < items) {
        const int row = static_cast<int>(item / row_vecs);
        const int64_t vec = item - row * row_vecs;
        const int r = source_of_row(row_start, R, row);
        const int i = row - row_start[r];
        const int64_t slot = (e_local * R + r) * M + i;  // staged row: src_info and slot_k stay there
        v[u] = __ldg(x + (e_local * R * M + row_begin[r] + i) * row_vecs + vec);
        to[u] = reinterpret_cast<int4*>(target(r, src_info[slot], slot_k[slot])) + vec;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (first + u * stride < items) *to[u] = v[u];
    }
  }
  // NOTE: the flat combine's monotonic per-expert counter (the flat kernels never run on this buffer).
  const bool last_part = last_of_parts(&ctrl->combine_parts_done[e_local], parts);
  if (!last_part || threadIdx.x >= R) return;
  const int r = threadIdx.x;
  if (r / G == node) {
    if (!open[r]) return;  // as the flat combine: nothing to a masked source
    st_release_sys(at<uint64_t>(peers.bases[r], c.combine_signals) + peers.rank * E_local + e_local,
                   (tag << kCombineIdBits) | (lost[r] ? kCombineNoRows : 0) | (args.tag_id & kCombineIdMask));
    return;
  }
  // NOTE: the forwarder hears from this expert whenever their link is open, also when this rank masked the source
  // (then with kRelayCut and no rows), so that it never waits for rows that will not come.
  const int f = path_peer(peers.rank, r, G);
  if (ld_volatile_global(&ctrl->mask[f]) != 0) return;
  const int64_t e_in_node = (peers.rank - node * G) * E_local + e_local;
  st_release_sys(
      at<uint64_t>(relay.bases[f], relay.off.row_signals[args.set]) + slot_of(r / G, node) * G * E_local + e_in_node,
      (tag << kRelayTagShift) | (open[r] && !lost[r] ? 0 : kRelayCut) | (args.tag_id & kCombineIdMask));
}

// One block row per other node n (slot blockIdx.x): this source's topk_weights, then the trailer's mask word (bit g:
// this rank masked (n, g) now), into the weights message for n's forwarder. The exchange after it is stream-ordered.
__global__ void __launch_bounds__(kThreads)
    send_weights(LowLatencyPeers peers, LowLatencyLayout layout, RelayView relay, RelayWeightsArgs args) {
  const int j = static_cast<int>(blockIdx.x), n = node_of_slot(j, relay.node), G = relay.gpus_per_node;
  const int64_t M = layout.max_tokens_per_rank, num_words = args.num_tokens * args.num_topk;
  char* msg = relay.bases[peers.rank] + relay.off.weights_send + j * relay_weights_bytes(M, args.num_topk);
  const auto* w = reinterpret_cast<const uint32_t*>(args.topk_weights);
  for (int64_t i = blockIdx.y * kThreads + threadIdx.x; i < num_words; i += static_cast<int64_t>(gridDim.y) * kThreads)
    at<uint32_t>(msg, 0)[i] = __ldg(w + i);
  if (blockIdx.y != 0 || threadIdx.x != 0) return;
  LowLatencyControl* ctrl = control_of(peers, layout);
  uint32_t masked = 0;
  for (int g = 0; g < G; ++g) masked |= ld_volatile_global(&ctrl->mask[n * G + g]) != 0 ? 1u << g : 0u;
  *at<uint32_t>(msg, relay_weights_bytes(M, args.num_topk) - 16) = masked;
}

// The forwarder's partials: units (slot j of a source node, record i, slice of H); per unit one thread per k waits
// for the relay signal of the record's expert, then p = 0 + w * x over the valid k ascending, into partial_send.
__global__ void __launch_bounds__(kThreads)
    reduce(LowLatencyPeers peers, LowLatencyLayout layout, RelayView relay, RelayReduceArgs args) {
  __shared__ float weights[kLowLatencyMaxTopk];
  __shared__ bool valid[kLowLatencyMaxTopk];
  const int N = relay.num_nodes, G = relay.gpus_per_node, node = relay.node, K = args.rec.num_topk;
  const int64_t M = layout.max_tokens_per_rank, H = layout.hidden, E_local = layout.num_local_experts;
  const int64_t row_vecs = H / 8;
  const int parts = combine_recv_parts(M);
  const int64_t part_vecs = (row_vecs + parts - 1) / parts;
  char* own = relay.bases[peers.rank];
  LowLatencyControl* ctrl = control_of(peers, layout);
  const uint64_t tag = ctrl->combine_seq[args.set] + 1;
  const int64_t msg_bytes = args.rec.message_bytes(M);
  const int64_t w_bytes = relay_weights_bytes(M, K);
  for (int64_t unit = blockIdx.x; unit < (N - 1) * M * parts; unit += gridDim.x) {
    const int j = static_cast<int>(unit / (M * parts));
    const int64_t i = unit / parts % M;
    const char* msg = own + relay.off.relay[args.dispatch_set] + j * msg_bytes;
    if (i >= *reinterpret_cast<const int32_t*>(msg)) continue;  // uniform over the block
    const int src = node_of_slot(j, node) * G + relay.local_rank;
    const char* r = msg + kRelayHeaderBytes + i * args.rec.bytes;
    const int64_t t = *reinterpret_cast<const int32_t*>(r + args.rec.src_offset);
    const char* w_msg = own + relay.off.weights_recv + j * w_bytes;  // the source's weights, then its mask word
    const uint32_t src_masked = *reinterpret_cast<const uint32_t*>(w_msg + w_bytes - 16);
    __syncthreads();  // the previous unit's weights are no longer read
    if (threadIdx.x < K) {
      const int k = threadIdx.x;
      const int64_t e = reinterpret_cast<const int32_t*>(r + args.rec.ids_offset)[k];
      bool ok = false;
      if (e >= 0 && ld_volatile_global(&ctrl->mask[src]) == 0) {
        const int d = static_cast<int>(e / E_local);
        uint64_t v = 0;
        // NOTE: a rank the source masked contributes nothing (path rule, s-d at the source's end), without a wait.
        if (((src_masked >> (d - node * G)) & 1u) == 0 && ld_volatile_global(&ctrl->mask[d]) == 0 &&
            wait_tag(peers, ctrl,
                     at<uint64_t>(own, relay.off.row_signals[args.set]) + j * G * E_local + (e - node * G * E_local),
                     tag, kRelayTagShift, d, static_cast<int>(e), kSiteLowLatencyCombineRecv, &v)) {
          ok = (v & kRelayCut) == 0 && same_dispatch(peers, v, args.tag_id, d, static_cast<int>(e));
        }
      }
      valid[k] = ok;
      weights[k] = ok ? reinterpret_cast<const float*>(w_msg)[t * K + k] : 0.f;
    }
    __syncthreads();
    const auto* rows = at<const uint4>(own, relay.off.rows[args.set] + (j * M + t) * K * H * 2);
    char* out = at<char>(own, relay.off.partial_send + (j * M + i) * H * relay.partial_bytes());
    const int64_t v_begin = (unit % parts) * part_vecs, v_end = min(row_vecs, v_begin + part_vecs);
    for (int64_t v = v_begin + threadIdx.x; v < v_end; v += kThreads) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int k = 0; k < K; ++k) {
        if (valid[k]) add_weighted(acc, __ldcg(rows + k * row_vecs + v), weights[k]);
      }
      if (relay.bf16_partials) {
        reinterpret_cast<uint4*>(out)[v] = pack_bf16x8(acc);
      } else {
        reinterpret_cast<float4*>(out)[2 * v] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        reinterpret_cast<float4*>(out)[2 * v + 1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
      }
    }
  }
}

// The source's receive: per (token, slice of H), acc = 0 + p_0 + p_1 + ... by node ascending, p_n the partial of
// forwarder (n, local rank) received over the network, or for this node its own pairs reduced here the same way
// (flat combine rows and signals); one rounding. RelayView::bf16_partials: every p_n arrives (or, for this node, is
// rounded) as bf16 first. The last block advances the combine set's sequence number.
template <typename TopkT>
__global__ void __launch_bounds__(kThreads)
    combine(LowLatencyPeers peers, LowLatencyLayout layout, RelayView relay, RelaySumArgs args) {
  __shared__ float weights[kLowLatencyMaxTopk];
  __shared__ bool valid[kLowLatencyMaxTopk];
  __shared__ int record[kLowLatencyMaxRanks];  // per node: the token's record at its forwarder, -1 if none or cut
  const int N = relay.num_nodes, G = relay.gpus_per_node, node = relay.node, K = args.num_topk;
  const int64_t M = layout.max_tokens_per_rank, H = layout.hidden, E_local = layout.num_local_experts;
  char* base = peers.bases[peers.rank];
  char* own = relay.bases[peers.rank];
  LowLatencyControl* ctrl = control_of(peers, layout);
  const uint64_t tag = ctrl->combine_seq[args.set] + 1;
  const LowLatencySet& c = layout.sets[args.set];
  const int32_t* node_slot = at<const int32_t>(own, relay.off.node_slot[args.dispatch_set]);
  const auto* topk = static_cast<const TopkT*>(args.topk);
  auto* out = static_cast<uint4*>(args.out);
  const int64_t row_vecs = H / 8;
  for_each_recv_unit(
      args.num_tokens, row_vecs, blockIdx.x, gridDim.x,
      [&](int64_t t) {
        if (threadIdx.x < K) {
          const int k = threadIdx.x;
          const int64_t e = static_cast<int64_t>(topk[t * K + k]);
          bool ok = false;
          if (e >= 0 && e < layout.num_experts && e / (G * E_local) == node) {
            const int r = static_cast<int>(e / E_local);
            uint64_t v = 0;
            if (ld_volatile_global(&ctrl->mask[r]) == 0 &&
                wait_tag(peers, ctrl, at<uint64_t>(base, c.combine_signals) + e, tag, kCombineIdBits, r,
                         static_cast<int>(e), kSiteLowLatencyCombineRecv, &v)) {
              ok = signal_counts(peers, v, args.tag_id, r, static_cast<int>(e));
            }
          }
          valid[k] = ok;
          weights[k] = ok ? args.topk_weights[t * K + k] : 0.f;
        }
        if (threadIdx.x >= 32 && threadIdx.x < 32 + N) {
          const int n = threadIdx.x - 32;
          int i = -1;
          if (n != node) {
            i = node_slot[t * N + n];
            if (ld_volatile_global(&ctrl->mask[n * G + relay.local_rank]) != 0) i = -1;
          }
          record[n] = i;
        }
      },
      [&](int64_t t, int64_t v) {
        const auto* rows = at<const uint4>(base, c.combine_data + t * kLowLatencyMaxTopk * H * 2);
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int n = 0; n < N; ++n) {
          if (n == node) {
            float p[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int k = 0; k < K; ++k) {
              if (valid[k]) add_weighted(p, __ldcg(rows + k * row_vecs + v), weights[k]);
            }
#pragma unroll
            for (int q = 0; q < 8; ++q) {
              acc[q] = __fadd_rn(acc[q], relay.bf16_partials ? detail::round_to_bf16(p[q]) : p[q]);
            }
          } else if (record[n] >= 0) {
            const char* partial = at<const char>(
                own, relay.off.partial_recv[args.set] + (slot_of(n, node) * M + record[n]) * H * relay.partial_bytes());
            if (relay.bf16_partials) {
              add_bf16x8(acc, reinterpret_cast<const uint4*>(partial)[v]);
            } else {
              const float4 lo = reinterpret_cast<const float4*>(partial)[2 * v];
              const float4 hi = reinterpret_cast<const float4*>(partial)[2 * v + 1];
              const float p[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
              for (int q = 0; q < 8; ++q) acc[q] = __fadd_rn(acc[q], p[q]);
            }
          }
        }
        out[t * row_vecs + v] = pack_bf16x8(acc);
      });
  // The completion rule over this node's experts (the flat combine's; the other nodes' forwarders meet this rank in
  // the NCCL legs).
  const int64_t node_experts = G * E_local;
  finish_combine_grid(peers, ctrl, at<uint64_t>(base, c.combine_signals), tag, node * node_experts,
                      (node + 1) * node_experts, E_local, &ctrl->combine_ticket[args.set],
                      &ctrl->combine_seq[args.set]);
}

}  // namespace llh

cudaError_t preload_relay_combine_kernels() {
  return preload_kernels(
      {reinterpret_cast<const void*>(&llh::send_rows), reinterpret_cast<const void*>(&llh::send_weights),
       reinterpret_cast<const void*>(&llh::reduce), reinterpret_cast<const void*>(&llh::combine<int64_t>),
       reinterpret_cast<const void*>(&llh::combine<int32_t>)});
}

void launch_relay_rows(const LowLatencyPeers& peers, const LowLatencyLayout& layout, const RelayView& relay,
                       const RelayRowsArgs& args, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(layout.num_local_experts * args.parts);
  llh::send_rows<<<grid, kThreads, 0, stream>>>(peers, layout, relay, args);
  check_launch("low-latency relay rows");
}

void launch_relay_weights(const LowLatencyPeers& peers, const LowLatencyLayout& layout, const RelayView& relay,
                          const RelayWeightsArgs& args, cudaStream_t stream) {
  const int64_t words = args.num_tokens * args.num_topk;
  const unsigned parts = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(16, (words + 4095) / 4096)));
  const dim3 grid(static_cast<unsigned>(relay.num_nodes - 1), parts);
  llh::send_weights<<<grid, kThreads, 0, stream>>>(peers, layout, relay, args);
  check_launch("low-latency relay weights");
}

void launch_relay_reduce(const LowLatencyPeers& peers, const LowLatencyLayout& layout, const RelayView& relay,
                         const RelayReduceArgs& args, cudaStream_t stream) {
  const int64_t units =
      (relay.num_nodes - 1) * layout.max_tokens_per_rank * combine_recv_parts(layout.max_tokens_per_rank);
  if (units == 0) return;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(units, relay.spin_blocks));
  llh::reduce<<<grid, kThreads, 0, stream>>>(peers, layout, relay, args);
  check_launch("low-latency relay reduce");
}

void launch_relay_sum(const LowLatencyPeers& peers, const LowLatencyLayout& layout, const RelayView& relay,
                      const RelaySumArgs& args, cudaStream_t stream) {
  // At least one block, so the set's sequence number advances on an idle rank too.
  const int64_t units = args.num_tokens * combine_recv_parts(args.num_tokens);
  const unsigned grid = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(units, relay.spin_blocks)));
  launch_for_topk_type(args.topk_int64, "low-latency relay combine", [&](auto topk_id) {
    llh::combine<decltype(topk_id)><<<grid, kThreads, 0, stream>>>(peers, layout, relay, args);
  });
}

}  // namespace epx::cuda
