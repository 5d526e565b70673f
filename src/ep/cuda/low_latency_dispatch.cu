// Low-latency dispatch: each (token, expert) pair into its slot at the expert's rank (fp8 or bf16), then the
// packed receive rows, counts and source info. Protocol: docs/low-latency.md.
#include "comm/cuda/device/pdl.cuh"
#include "core/cuda/cuda_util.h"
#include "ep/cuda/low_latency_device.cuh"

namespace epx::cuda {
namespace {

// ---- dispatch -----------------------------------------------------------------------------------------

// One block sends the pairs of one global expert: their (src_info, slot_k) entries, and the rows: per pair into the
// expert's staging block, or (token_staged) the rows of the tokens whose first expert on the rank is this one.
template <typename TopkT>
__device__ void dispatch_send_block(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                    const LowLatencyDispatchLaunch& args, int expert) {
  extern __shared__ int pair_list[];  // [M]: entries t * K + k that chose this block's expert, ascending; then
                                      // [M]: those of them whose token row this block writes (token_staged)
  const int64_t num_local = layout.num_local_experts;
  const int dst = static_cast<int>(expert / num_local);
  const int64_t e_local = expert % num_local;
  const int64_t M = layout.max_tokens_per_rank;
  const int64_t H = layout.hidden;
  const int R = peers.num_ranks;
  LowLatencyControl* ctrl = control_of(peers, layout);
  if (ld_volatile_global(&ctrl->mask[dst]) != 0) return;
  const uint64_t tag = dispatch_tag(ctrl->dispatch_seq[set] + 1);
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
  int total = 0;
  int pos = block_exclusive_scan(mine, &total);
  for (int64_t j = begin; j < end && pos < M; ++j) {
    if (static_cast<int64_t>(topk[j]) == expert) pair_list[pos++] = static_cast<int>(j);
  }
  __syncthreads();
  if (total > M && threadIdx.x == 0) record_failure(peers, kErrExpertOverflow, 0, dst, expert, M, total);
  const int count = total < M ? total : static_cast<int>(M);

  const LowLatencySet& s = layout.sets[set];
  char* dst_base = peers.bases[dst];
  const int64_t slot0 = (e_local * R + peers.rank) * M;
  const auto* x = static_cast<const char*>(args.x);
  // Token-staged: the local expert (on dst) of the pair's token's first pair there, whose block writes the row.
  const int64_t e_begin = dst * num_local, e_end = e_begin + num_local;
  auto owner_of = [&](int j) -> int {
    const int64_t t = j / args.num_topk, k = j % args.num_topk;
    for (int64_t q = 0; q < k; ++q) {
      const int64_t id = static_cast<int64_t>(topk[t * args.num_topk + q]);
      if (id >= e_begin && id < e_end) return static_cast<int>(id - e_begin);
    }
    return static_cast<int>(e_local);
  };
  auto first_on_dst = [&](int j) { return owner_of(j) == e_local; };
  for (int i = threadIdx.x; i < count; i += kThreads) {
    at<int>(dst_base, s.dispatch_src_info)[slot0 + i] = pair_list[i] / args.num_topk;
    at<int>(dst_base, s.dispatch_slot_k)[slot0 + i] = pair_list[i] % args.num_topk;
    if (args.token_staged) at<int>(dst_base, s.dispatch_owner)[slot0 + i] = owner_of(pair_list[i]);
  }
  // The rows this block writes: every pair's (expert staging), or those of the pairs that are their token's first
  // on dst (token staging; a chunk of pairs per thread, then a scan keeps them in ascending order).
  const int* rows = pair_list;
  int num_rows = count;
  if (args.token_staged) {
    int* owned = pair_list + M;
    const int pchunk = (count + kThreads - 1) / kThreads;
    const int pbegin = min(count, static_cast<int>(threadIdx.x) * pchunk), pend = min(count, pbegin + pchunk);
    int owned_mine = 0;
    for (int i = pbegin; i < pend; ++i) owned_mine += first_on_dst(pair_list[i]);
    int at_pos = block_exclusive_scan(owned_mine, &num_rows);
    for (int i = pbegin; i < pend; ++i) {
      if (first_on_dst(pair_list[i])) owned[at_pos++] = pair_list[i];
    }
    __syncthreads();
    rows = owned;
  }
  // The staging row of written row i: the pair's slot in the expert's block, or the token's row of this source.
  auto dst_slot = [&](int64_t i) -> int64_t {
    return args.token_staged ? peers.rank * M + rows[i] / args.num_topk : slot0 + i;
  };
  // The rows are spread over the whole block (not a warp per row) and each thread keeps kUnroll loads in
  // flight: a row is ~900 16-byte vectors, and a warp walking it alone is a chain of dependent round trips.
  if (!args.use_fp8) {
    const int64_t row_vecs = H / 8;
    const int64_t items = num_rows * row_vecs;
    copy_items(
        items,
        [&](int64_t item, int4& v) {
          if (item >= items) return;
          const int64_t i = item / row_vecs;
          const int t = rows[i] / args.num_topk;
          v = __ldg(reinterpret_cast<const int4*>(x + static_cast<int64_t>(t) * H * 2) + (item - i * row_vecs));
        },
        [&](int64_t item, const int4& v) {
          if (item >= items) return;
          const int64_t i = item / row_vecs;
          at<int4>(dst_base, s.dispatch_data + dst_slot(i) * H * 2)[item - i * row_vecs] = v;
        });
  } else {
    // One item = four consecutive 128-channel blocks of one row, quantized by a warp: 8 lanes per block, 16
    // channels per lane, so each lane stores 16 fp8 bytes and the warp 512 contiguous bytes; lane 0 stores the
    // four scales at once where they are aligned (num_blocks % 4 == 0, e.g. H = 7168), else lanes 0/8/16/24
    // store one each. (Per-block 8-byte stores plus a 4-byte store per scale ran at half the NVLink rate.)
    const int64_t num_blocks = H / kBlock;
    const int64_t num_groups = (num_blocks + 3) / 4;
    const int64_t items = num_rows * num_groups;
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
            const int t = rows[i] / args.num_topk;
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
        const int64_t slot = dst_slot(i);
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
    st_release_sys(at<uint64_t>(dst_base, s.dispatch_signals) + e_local * R + peers.rank,
                   (tag << 32) | static_cast<uint64_t>(count));
  }
}

// One block receives for one local expert: waits for its R signals, then copies the R staged blocks into the
// packed output (source r's block at rows [begin_r, begin_r + count_r), begin_r = the counts of sources < r)
// and writes counts, ranges and src_info (-1 past the count). Scales go out in the caller's layout
// (LowLatencyDispatchLaunch: row- or column-major, fp32 or UE8M0, exponents widened to fp32 for round_scale).
// NOTE: memory order: thread r acquires source r's signal (ld.acquire.sys); the __syncthreads() after the waits
// extends that to every thread of the block, which then reads the staged rows with ld.global.cg (L2, no L1
// line that could predate the peer's stores). The packed outputs are local stores read by later kernels.
// NOTE: speed: data, scales and src_info are one item space walked by one loop with kUnroll loads in flight per
// thread, so a batch costs about one load round trip per kThreads * kUnroll items instead of one per loop and
// per pass (three loops cost 18.8 us against 7.7 us before the packed layout at 128 tokens, 2x H200).
__device__ void dispatch_recv_block(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                    const LowLatencyDispatchLaunch& args, int64_t e_local) {
  __shared__ int counts[kLowLatencyMaxRanks];
  __shared__ bool lost[kLowLatencyMaxRanks];       // token-staged: an owner's signal of the source never came
  __shared__ int begins[kLowLatencyMaxRanks + 1];  // packed row of each source's first pair; [R] = the total
  const int R = peers.num_ranks;
  const int64_t M = layout.max_tokens_per_rank;
  const int64_t H = layout.hidden;
  char* base = peers.bases[peers.rank];
  const LowLatencySet& s = layout.sets[set];
  LowLatencyControl* ctrl = control_of(peers, layout);
  const uint64_t tag = dispatch_tag(ctrl->dispatch_seq[set] + 1);
  if (threadIdx.x < R) {
    const int src = threadIdx.x;
    // NOTE: hierarchical routing: a source of another node signals through its forwarder `via` on this node; the
    // path is cut when either is masked, and a timeout masks the forwarder (it owed the signal). Flat: via == src.
    const int via = path_peer(peers.rank, src, peers.gpus_per_node);
    int c = 0;
    uint64_t v = 0;
    if (ld_volatile_global(&ctrl->mask[src]) == 0 && ld_volatile_global(&ctrl->mask[via]) == 0 &&
        wait_tag(peers, ctrl, at<uint64_t>(base, s.dispatch_signals) + e_local * R + src, tag, 32, via,
                 static_cast<int>(src * layout.num_local_experts + e_local), kSiteLowLatencyDispatchRecv, &v,
                 args.wait_cost != nullptr ? args.wait_cost + src : nullptr)) {
      c = static_cast<int>(v & 0xffffffffu);
    } else {
      ctrl->recv_lost[set][src] = static_cast<uint32_t>(tag);  // the combine then tells src it got no rows
    }
    counts[src] = c;
    lost[src] = false;
  }
  __syncthreads();
  if (args.token_staged) {
    // A pair's token row that another expert's block wrote is there once that block's signal is (acquire; usually
    // raised already): wait for it. A source whose owner signal this block missed counts 0 here, as a missed count.
    for (int src = 0; src < R; ++src) {
      const int64_t pairs0 = (e_local * R + src) * M;
      for (int i = threadIdx.x; i < counts[src]; i += kThreads) {
        const int owner = __ldcg(at<const int>(base, s.dispatch_owner) + pairs0 + i);
        uint64_t v = 0;
        if (owner != e_local &&
            !wait_tag(peers, ctrl, at<uint64_t>(base, s.dispatch_signals) + static_cast<int64_t>(owner) * R + src, tag,
                      32, src, static_cast<int>(src * layout.num_local_experts + owner), kSiteLowLatencyDispatchRecv,
                      &v)) {
          lost[src] = true;
        }
      }
    }
    __syncthreads();
    if (threadIdx.x < R && lost[threadIdx.x]) {
      counts[threadIdx.x] = 0;
      ctrl->recv_lost[set][threadIdx.x] = static_cast<uint32_t>(tag);
    }
    __syncthreads();
  }
  griddepcontrol_launch_dependents();  // the block's last wait is behind it (the NOTE at ll::dispatch)
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
  const int slots = static_cast<int>(R * M);
  const int64_t row0 = e_local * slots;  // the expert's first row, staged and packed
  // The pair's entry (within the expert) of packed row `row`: source r's block at r * M.
  auto staged_row = [&](int row) {
    const int r = source_of_row(begins, R, row);
    return static_cast<int>(r * M) + (row - begins[r]);
  };
  int* src_info = at<int>(base, s.recv_src_info) + row0;
  for (int row = total + static_cast<int>(threadIdx.x); row < slots; row += kThreads) src_info[row] = -1;
  const int* staged_src_info = at<const int>(base, s.dispatch_src_info) + row0;
  if (args.pair_map) {
    // Source r's pair (t, k) -> this expert's packed row, stamped with the tag (entries of older calls stay and
    // never match). The combine send reads it after this grid (stream order).
    const int* staged_slot_k = at<const int>(base, s.dispatch_slot_k) + row0;
    int64_t* map = at<int64_t>(base, s.pair_map);
    for (int row = threadIdx.x; row < total; row += kThreads) {
      const int r = source_of_row(begins, R, row);
      const int staged = staged_row(row);
      const int64_t t = __ldcg(staged_src_info + staged), k = __ldcg(staged_slot_k + staged);
      map[(r * M + t) * kLowLatencyMaxTopk + k] = static_cast<int64_t>((tag & 0xffffffffu) << 32) | (row0 + row);
    }
  }
  if (args.token_staged) {
    // src_info first: a token-staged row is found by its token (read back below after the barrier).
    for (int row = threadIdx.x; row < total; row += kThreads) src_info[row] = __ldcg(staged_src_info + staged_row(row));
    __syncthreads();
  }
  // The staged data/scale row (from the set's first staging row) of packed row `row`.
  auto staged_data_row = [&](int row) -> int64_t {
    if (!args.token_staged) return row0 + staged_row(row);
    const int r = source_of_row(begins, R, row);
    return static_cast<int64_t>(r) * M + src_info[row];
  };

  // Item space: [0, data_items) 16-byte pieces of rows; then scale units; then the src_info of each row.
  const int row_vecs = static_cast<int>((args.use_fp8 ? H : H * 2) / 16);
  const int num_blocks = static_cast<int>(H / kBlock);
  // Scale units: one scale (fp32 out; staged fp32 or an exponent byte), or a word of four exponents (UE8M0 out:
  // row-major when num_blocks % 4 == 0, always column-major), or one exponent byte (row-major otherwise).
  const bool scale_words = args.use_fp8 && !args.scales_fp32 && (num_blocks % 4 == 0);
  const int scale_units = args.use_fp8 ? (scale_words ? num_blocks / 4 : num_blocks) : 0;
  const int data_items = total * row_vecs;
  const int scale_items = total * scale_units;
  const int items = data_items + scale_items + (args.token_staged ? 0 : total);
  const int4* data_in = at<const int4>(base, s.dispatch_data);
  int4* data_out = at<int4>(base, s.recv_x) + row0 * row_vecs;
  const char* scales_in = at<const char>(base, s.dispatch_scales);
  char* scales_out = at<char>(base, s.recv_x_scales);
  // (row, unit) of scale item j: unit-major when column-major (consecutive threads write consecutive rows).
  auto scale_item = [&](int j, int* row, int* unit) {
    if (args.scales_column_major) {
      *unit = j / total;
      *row = j - *unit * total;
    } else {
      *row = j / scale_units;
      *unit = j - *row * scale_units;
    }
  };
  const bool staged_bytes = args.ue8m0;  // staged scales: exponent bytes, else fp32
  copy_items(
      items,
      [&](int item, int4& v) {
        if (item < data_items) {
          const int row = item / row_vecs;
          v = __ldcg(data_in + staged_data_row(row) * row_vecs + (item - row * row_vecs));
        } else if (item < data_items + scale_items) {
          int row, unit;
          scale_item(item - data_items, &row, &unit);
          const int64_t staged = staged_data_row(row);
          if (scale_words) {
            v.x = static_cast<int>(
                __ldcg(reinterpret_cast<const unsigned int*>(scales_in) + staged * scale_units + unit));
          } else if (staged_bytes) {
            v.x = __ldcg(reinterpret_cast<const unsigned char*>(scales_in) + staged * num_blocks + unit);
            if (args.scales_fp32) v.x = v.x << 23;  // 2^(e - 127) as fp32 bits
          } else {
            v.x =
                static_cast<int>(__ldcg(reinterpret_cast<const unsigned int*>(scales_in) + staged * num_blocks + unit));
          }
        } else if (item < items) {
          v.x = __ldcg(staged_src_info + staged_row(item - data_items - scale_items));
        }
      },
      [&](int item, const int4& v) {
        if (item < data_items) {
          data_out[item] = v;
        } else if (item < data_items + scale_items) {
          int row, unit;
          scale_item(item - data_items, &row, &unit);
          const int64_t out = args.scales_column_major ? (e_local * scale_units + unit) * slots + row
                                                       : (row0 + row) * scale_units + unit;
          if (scale_words || args.scales_fp32) {
            reinterpret_cast<int*>(scales_out)[out] = v.x;
          } else {
            reinterpret_cast<unsigned char*>(scales_out)[out] = static_cast<unsigned char>(v.x);
          }
        } else if (item < items) {
          src_info[item - data_items - scale_items] = v.x;
        }
      });
}

}  // namespace

namespace ll {

// kSend: one block per global expert. kRecv: one block per local expert. kBoth: every block sends one expert,
// then the last E_local blocks (scheduled last, so no waiting block keeps a sending block off the SMs) receive
// one local expert each, saving a launch on the critical path.
// NOTE: programmatic launches (comm/cuda/device/pdl.cuh; this kernel and ll::combine alike). Wait: every block
// calls griddepcontrol_wait before its first global access (x, topk, weights, the control block's mask, sequence
// numbers, tickets and counters, the staging and the outputs, all of which earlier kernels on the stream write or
// read); before it only kernel parameters are read. Trigger: a block lets the next kernel in once it will spin-wait
// for no other grid: a block that only sends at once (it waits for nothing; the combine send's per-expert counter
// is an atomic, not a wait), a receiving block right after its last signal wait, so the next kernel's launch
// overlaps the receive's copy and the grid's finisher (a combine grid that receives triggers as its blocks exit:
// its last block waits at the end, in the completion rule). Why not earlier: the next kernel is scheduled
// once every block of this grid has triggered or exited, and its blocks then hold SM slots while they wait for this
// grid. If this grid still spun on a grid that needs slots on this GPU (a peer rank sharing the GPU: the kernel
// tests run two ranks on one GPU), those idle blocks could keep it off the SMs, and the spin would end only at the
// timeout. With the trigger after the last wait, a dependent block holds a slot only while every block of this
// grid is resident or done and needs nothing from any other grid, so this grid completes and the dependent's wait
// ends; from then on the slots are held as plain stream order could hold them. (A kernel before this one that let
// it in early and then spun on another grid would break the same rule; ours do not.) Memory needs no care: the
// dependent's griddepcontrol_wait returns only after this grid has completed and its writes are visible.
template <typename TopkT>
__global__ void __launch_bounds__(kThreads)
    dispatch(LowLatencyPeers peers, LowLatencyLayout layout, int set, LowLatencyDispatchLaunch args, Phase phase) {
  const int64_t first_recv = phase == Phase::kBoth ? layout.num_experts - layout.num_local_experts : 0;
  const bool receives = phase != Phase::kSend && blockIdx.x >= first_recv;
  griddepcontrol_wait();
  if (!receives) griddepcontrol_launch_dependents();  // a sending block waits for no other grid
  if (phase != Phase::kRecv) {
    dispatch_send_block<TopkT>(peers, layout, set, args, blockIdx.x);
    if (phase == Phase::kSend) return;
  }
  if (receives) {
    if (phase == Phase::kBoth) __syncthreads();
    dispatch_recv_block(peers, layout, set, args, blockIdx.x - first_recv);
  }
  LowLatencyControl* ctrl = control_of(peers, layout);
  finish_grid(&ctrl->dispatch_ticket[set], &ctrl->dispatch_seq[set]);
}

}  // namespace ll

cudaError_t preload_low_latency_dispatch_kernels() {
  return preload_kernels(
      {reinterpret_cast<const void*>(&ll::dispatch<int64_t>), reinterpret_cast<const void*>(&ll::dispatch<int32_t>)});
}

namespace {

// Launch shape per phase (see ll::dispatch): the send blocks keep their pair list in dynamic shared memory.
void launch_dispatch(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                     const LowLatencyDispatchLaunch& args, ll::Phase phase, cudaStream_t stream, const char* what) {
  const bool recv_only = phase == ll::Phase::kRecv;
  const dim3 grid(static_cast<unsigned>(recv_only ? layout.num_local_experts : layout.num_experts));
  const size_t smem =
      recv_only ? 0 : static_cast<size_t>(layout.max_tokens_per_rank) * sizeof(int) * (args.token_staged ? 2 : 1);
  launch_for_topk_type(args.topk_int64, what, [&](auto topk_id) {
    check_cuda(launch_kernel(&ll::dispatch<decltype(topk_id)>, grid, dim3(kThreads), smem, stream,
                             args.programmatic_launch, peers, layout, set, args, phase),
               what);
  });
}

}  // namespace

void launch_low_latency_dispatch(ll::Phase phase, const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                 const LowLatencyDispatchLaunch& args, cudaStream_t stream) {
  launch_dispatch(peers, layout, set, args, phase, stream,
                  phase == ll::Phase::kSend   ? "low-latency dispatch send"
                  : phase == ll::Phase::kRecv ? "low-latency dispatch receive"
                                              : "low-latency dispatch");
}

}  // namespace epx::cuda
