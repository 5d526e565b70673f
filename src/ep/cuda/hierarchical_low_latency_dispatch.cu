// Kernels of the hierarchical low-latency dispatch: pack and forward (the receive is the flat ll::dispatch, kRecv).
// Protocol and memory order: hierarchical_low_latency_kernels.h.
// NOTE: kernel names: only llh::combine contains "combine" and none contains "dispatch", so that profiler-based tools
// find one kernel per direction by name: the dispatch receive is the flat ll::dispatch (kRecv), unchanged.
#include <algorithm>

#include "core/cuda/cuda_util.h"
#include "ep/cuda/hierarchical_low_latency_device.cuh"

namespace epx::cuda {

namespace llh {

using namespace llh_detail;

// tokens (those with an expert on n, ascending); part 0 writes the count and node_slot; the parts split the records,
// one warp per record: ids and token index, then the row (bf16 copied, fp8 quantized 4 blocks of 128 per warp step as
// the flat send, the same bits).
template <typename TopkT>
__global__ void __launch_bounds__(kThreads)
    pack(LowLatencyPeers peers, LowLatencyLayout layout, RelayView relay, RelayPackArgs args) {
  extern __shared__ int rec_tok[];  // [M]: the token of each record
  const int n = blockIdx.x, N = relay.num_nodes, G = relay.gpus_per_node;
  const int64_t M = layout.max_tokens_per_rank, H = layout.hidden, T = args.num_tokens;
  const int64_t e_node = G * layout.num_local_experts, e_begin = n * e_node, e_end = e_begin + e_node;
  const RelayRecord& rec = args.rec;
  const int K = rec.num_topk;
  char* base = relay.bases[peers.rank];
  const int slot = n == relay.node ? N - 1 : slot_of(n, relay.node);
  char* msg = base + relay.off.pack + slot * rec.message_bytes(M);
  int32_t* node_slot = at<int32_t>(base, relay.off.node_slot[args.set]);
  LowLatencyControl* ctrl = control_of(peers, layout);
  // A forwarder this rank masked gets a zero-count message (the exchange's sizes are fixed).
  const bool cut = n != relay.node && ld_volatile_global(&ctrl->mask[n * G + relay.local_rank]) != 0;
  // NOTE: the path rule's s-d link at the source's end: an expert on a rank this rank masked is sent as -1 (the
  // forwarder cannot know this rank's mask), so the forwarder signals count 0 and the pair never travels.
  uint32_t masked_ranks = 0;  // bit g: local rank g of node n
  for (int g = 0; g < G; ++g) masked_ranks |= ld_volatile_global(&ctrl->mask[n * G + g]) != 0 ? 1u << g : 0u;
  const auto* topk = static_cast<const TopkT*>(args.topk);
  auto open_id = [&](int64_t e) {
    return e >= e_begin && e < e_end && ((masked_ranks >> ((e - e_begin) / layout.num_local_experts)) & 1u) == 0;
  };
  auto goes = [&](int64_t t) {
    if (cut) return false;
    for (int k = 0; k < K; ++k) {
      if (open_id(static_cast<int64_t>(topk[t * K + k]))) return true;
    }
    return false;
  };
  const int64_t chunk = (T + kThreads - 1) / kThreads;
  const int64_t t_begin = min(T, static_cast<int64_t>(threadIdx.x) * chunk), t_end = min(T, t_begin + chunk);
  int mine = 0;
  for (int64_t t = t_begin; t < t_end; ++t) mine += goes(t);
  int total = 0;
  int pos = block_exclusive_scan(mine, &total);
  for (int64_t t = t_begin; t < t_end; ++t) {
    const bool g = goes(t);
    if (blockIdx.y == 0) node_slot[t * N + n] = g ? pos : -1;
    if (g) rec_tok[pos++] = static_cast<int>(t);
  }
  if (blockIdx.y == 0 && threadIdx.x == 0) *reinterpret_cast<int32_t*>(msg) = total;
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const auto* x = static_cast<const char*>(args.x);
  for (int i = blockIdx.y * kWarps + warp; i < total; i += gridDim.y * kWarps) {
    const int t = rec_tok[i];
    char* r = msg + kRelayHeaderBytes + static_cast<int64_t>(i) * rec.bytes;
    if (lane < K) {
      const int64_t e = static_cast<int64_t>(topk[static_cast<int64_t>(t) * K + lane]);
      at<int32_t>(r, rec.ids_offset)[lane] = open_id(e) ? static_cast<int32_t>(e) : -1;
    }
    if (lane == 0) *at<int32_t>(r, rec.src_offset) = t;
    const auto* row = reinterpret_cast<const int4*>(x + static_cast<int64_t>(t) * H * 2);
    if (!args.fp8) {
      for (int64_t v = lane; v < H / 8; v += 32) reinterpret_cast<int4*>(r)[v] = __ldg(row + v);
      continue;
    }
    const int64_t num_blocks = H / kBlock;
    const int sub = lane & 7;  // 16-channel piece of the block
    for (int64_t g = 0; g < (num_blocks + 3) / 4; ++g) {
      const int64_t b = g * 4 + (lane >> 3);
      int4 lo = make_int4(0, 0, 0, 0), hi = lo;
      if (b < num_blocks) {
        lo = __ldg(row + b * 16 + sub * 2);
        hi = __ldg(row + b * 16 + sub * 2 + 1);
      }
      uint4 packed;
      const float scale = quantize_16(lo, hi, args.ue8m0, &packed);  // the whole warp
      if (b >= num_blocks) continue;
      reinterpret_cast<uint4*>(r + b * kBlock)[sub] = packed;
      if (sub != 0) continue;
      if (args.ue8m0) {
        at<uint8_t>(r, rec.row_bytes)[b] = static_cast<uint8_t>(scale);
      } else {
        at<float>(r, rec.row_bytes)[b] = scale;
      }
    }
  }
}

// One block per (source node m, expert of this node): the pairs of source (m, local rank) for that expert, found in
// the message (ascending record, then k: the flat slot order), into the expert's rank's staging slots of that source,
// then the flat count signal. Own node: this rank's own pack slot. No waits.
__global__ void __launch_bounds__(kThreads)
    forward(LowLatencyPeers peers, LowLatencyLayout layout, RelayView relay, RelayRecord rec, int set) {
  extern __shared__ int pair_list[];  // [M]: entries i * K + k of the message that chose this block's expert
  const int N = relay.num_nodes, G = relay.gpus_per_node, R = peers.num_ranks, K = rec.num_topk;
  const int64_t M = layout.max_tokens_per_rank, E_local = layout.num_local_experts, e_node = G * E_local;
  const int m = static_cast<int>(blockIdx.x / e_node);
  const int64_t expert = relay.node * e_node + blockIdx.x % e_node;
  const int dst = static_cast<int>(expert / E_local);
  const int64_t e_local = expert % E_local;
  const int src = m * G + relay.local_rank;
  LowLatencyControl* ctrl = control_of(peers, layout);
  if (ld_volatile_global(&ctrl->mask[dst]) != 0) return;  // nothing to a rank this forwarder masked
  const uint64_t tag = dispatch_tag(ctrl->dispatch_seq[set] + 1);
  char* own = relay.bases[peers.rank];
  const int64_t msg_bytes = rec.message_bytes(M);
  const char* msg = m == relay.node ? own + relay.off.pack + (N - 1) * msg_bytes
                                    : own + relay.off.relay[set] + slot_of(m, relay.node) * msg_bytes;
  int num_records = *reinterpret_cast<const int32_t*>(msg);  // stream-ordered: the pack or the exchange wrote it
  if (m != relay.node && ld_volatile_global(&ctrl->mask[src]) != 0) num_records = 0;  // a source it masked: count 0
  const char* records = msg + kRelayHeaderBytes;
  auto id_of = [&](int64_t j) {
    return *reinterpret_cast<const int32_t*>(records + (j / K) * rec.bytes + rec.ids_offset + 4 * (j % K));
  };
  const int64_t num_entries = static_cast<int64_t>(num_records) * K;
  const int64_t chunk = (num_entries + kThreads - 1) / kThreads;
  const int64_t begin = min(num_entries, static_cast<int64_t>(threadIdx.x) * chunk),
                end = min(num_entries, begin + chunk);
  int mine = 0;
  for (int64_t j = begin; j < end; ++j) mine += id_of(j) == expert;
  int total = 0;
  int pos = block_exclusive_scan(mine, &total);
  for (int64_t j = begin; j < end && pos < M; ++j) {
    if (id_of(j) == expert) pair_list[pos++] = static_cast<int>(j);
  }
  __syncthreads();
  if (total > M && threadIdx.x == 0)
    record_failure(peers, kErrExpertOverflow, 0, dst, static_cast<int>(expert), M, total);
  const int count = total < M ? total : static_cast<int>(M);

  const LowLatencySet& s = layout.sets[set];
  char* dst_base = peers.bases[dst];
  const int64_t slot0 = (e_local * R + src) * M;
  for (int i = threadIdx.x; i < count; i += kThreads) {
    const int j = pair_list[i];
    at<int>(dst_base, s.dispatch_src_info)[slot0 + i] =
        *reinterpret_cast<const int32_t*>(records + static_cast<int64_t>(j / K) * rec.bytes + rec.src_offset);
    at<int>(dst_base, s.dispatch_slot_k)[slot0 + i] = j % K;
  }
  // Rows (16-byte pieces) then scales (4-byte words, or bytes for UE8M0 exponents) as one item space.
  const int64_t row_vecs = rec.row_bytes / 16;
  const bool scale_words = rec.scale_bytes % 4 == 0;
  const int64_t scale_units = scale_words ? rec.scale_bytes / 4 : rec.scale_bytes;
  const int64_t data_items = count * row_vecs, items = data_items + count * scale_units;
  copy_items(
      items,
      [&](int64_t item, int4& v) {
        if (item < data_items) {
          const int64_t i = item / row_vecs;
          const char* r = records + static_cast<int64_t>(pair_list[i] / K) * rec.bytes;
          v = __ldcg(reinterpret_cast<const int4*>(r) + (item - i * row_vecs));
        } else if (item < items) {
          const int64_t i = (item - data_items) / scale_units, u = (item - data_items) - i * scale_units;
          const char* sc = records + static_cast<int64_t>(pair_list[i] / K) * rec.bytes + rec.row_bytes;
          v.x = scale_words ? __ldcg(reinterpret_cast<const int*>(sc) + u)
                            : static_cast<int>(reinterpret_cast<const unsigned char*>(sc)[u]);
        }
      },
      [&](int64_t item, const int4& v) {
        if (item < data_items) {
          const int64_t i = item / row_vecs;
          at<int4>(dst_base, s.dispatch_data + (slot0 + i) * rec.row_bytes)[item - i * row_vecs] = v;
        } else if (item < items) {
          const int64_t i = (item - data_items) / scale_units, u = (item - data_items) - i * scale_units;
          char* sc = dst_base + s.dispatch_scales + (slot0 + i) * rec.scale_bytes;
          if (scale_words) {
            reinterpret_cast<int*>(sc)[u] = v.x;
          } else {
            reinterpret_cast<unsigned char*>(sc)[u] = static_cast<unsigned char>(v.x);
          }
        }
      });
  // The barrier puts every thread's stores before thread 0's release (cumulativity), as the flat send.
  __syncthreads();
  if (threadIdx.x == 0) {
    st_release_sys(at<uint64_t>(dst_base, s.dispatch_signals) + e_local * R + src,
                   (tag << 32) | static_cast<uint64_t>(count));
  }
}

}  // namespace llh

cudaError_t preload_relay_kernels() {
  const cudaError_t err = preload_kernels({reinterpret_cast<const void*>(&llh::pack<int64_t>),
                                           reinterpret_cast<const void*>(&llh::pack<int32_t>),
                                           reinterpret_cast<const void*>(&llh::forward)});
  return err != cudaSuccess ? err : preload_relay_combine_kernels();
}

void launch_relay_pack(const LowLatencyPeers& peers, const LowLatencyLayout& layout, const RelayView& relay,
                       const RelayPackArgs& args, cudaStream_t stream) {
  const int64_t per_part = 4 * kWarps;  // records per block and round
  const unsigned parts =
      static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(16, (args.num_tokens + per_part - 1) / per_part)));
  const dim3 grid(static_cast<unsigned>(relay.num_nodes), parts);
  const size_t smem = static_cast<size_t>(layout.max_tokens_per_rank) * sizeof(int);
  launch_for_topk_type(args.topk_int64, "low-latency relay pack", [&](auto topk_id) {
    llh::pack<decltype(topk_id)><<<grid, kThreads, smem, stream>>>(peers, layout, relay, args);
  });
}

void launch_relay_forward(const LowLatencyPeers& peers, const LowLatencyLayout& layout, const RelayView& relay,
                          const RelayRecord& rec, int set, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(relay.num_nodes * relay.gpus_per_node * layout.num_local_experts);
  const size_t smem = static_cast<size_t>(layout.max_tokens_per_rank) * sizeof(int);
  llh::forward<<<grid, kThreads, smem, stream>>>(peers, layout, relay, rec, set);
  check_launch("low-latency relay forward");
}

}  // namespace epx::cuda
