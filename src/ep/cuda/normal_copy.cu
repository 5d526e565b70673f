// Normal path on copy engines: the SM kernels around the copies (fields into the peers' staging, packing,
// unpacking, release waits, signals) and the combine reduction of copied rows. Host side:
// NormalCopyEngines::send_dispatch / send_combine (src/ep/cuda/normal_copy_engines.cpp); protocol: docs/normal-kernels.md.
#include "core/cuda/cuda_util.h"
#include "ep/cuda/normal_device.cuh"

namespace epx::cuda {
namespace {

// ---- copy-engine dispatch ----------------------------------------------------------------------
// Host side in src/ep/cuda/normal_copy_engines.cpp (NormalCopyEngines::send_dispatch); docs/normal-kernels.md.
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
  // NOTE: the finisher's fences order every block's reads of staging before the last block's release of done.
  if (threadIdx.x == 0) {
    (void)staging_kept(comm, kSiteReceiveEnd, -1);
    s_last = last_block_arrives(reinterpret_cast<unsigned*>(comm.peers[comm.rank] + comm.off_copy_counter));
  }
  __syncthreads();
  if (!s_last) return;
  const int R = comm.num_ranks, C = comm.num_channels;
  for (int i = threadIdx.x; i < R * C; i += blockDim.x) {
    st_release_sys(sig(comm, i / C, comm.off_done, comm.rank * C + i % C), epoch);
  }
}

// Every thread of the block calls it: waits until every remote destination d finished reading every ring of the
// previous operation (done >= epoch - 1 for each source s and channel: the word d writes into s's region); false if a
// wait gave up.
// NOTE: not only the rings from this rank: a staging slot at d spans d's whole ring area (R - 1 slots), the rings of
// d's own tokens and of third ranks included, and after an SM-ring dispatch each ring's reader releases on its own
// (its done goes to the ring's source only). Before early copies a fresh copy-engine dispatch was protected by notify
// (d posts it after its previous kernel), but a cached one or a combine after an SM dispatch was not.
__device__ bool peers_released(const CommArgs& comm, int32_t site) {
  __shared__ bool s_failed;
  const int R = comm.num_ranks, C = comm.num_channels, me = comm.rank;
  const uint64_t epoch = read_epoch(comm);
  if (threadIdx.x == 0) s_failed = false;
  __syncthreads();
  for (int i = threadIdx.x; i < R * R * C; i += blockDim.x) {
    const int d = i / (R * C), s = i / C % R, c = i % C;
    if (d != me && !wait_geq(comm, sig(comm, s, comm.off_done, d * C + c), epoch - 1, site, d, c)) s_failed = true;
  }
  __syncthreads();
  // NOTE: the copy engines behind this wait run anyway (the host enqueued them): tell the peers, whose staging they
  // may now overwrite, so that their waits give up and their calls fail instead of reading it (docs/reliability.md).
  if (s_failed && threadIdx.x == 0) abort_peers(comm);
  return !s_failed;
}

// True once source src's whole-x copy into this rank's staging has landed to its last chunk (ce_tail[src] >= ce_tag +
// its token count; at once when src sends rows, not whole x); false if the wait gave up (recorded at `site`).
__device__ bool whole_copy_landed(const CommArgs& comm, const int32_t* recv_meta, const RecvMetaLayout& m, int src,
                                  uint64_t ce_tag, int32_t site) {
  const int32_t tokens = recv_meta[m.whole_tokens(src)];
  return tokens <= 0 || wait_geq(comm, sig(comm, comm.rank, comm.off_ce_tail, src),
                                 ce_tag + static_cast<uint64_t>(tokens), site, src, 0);
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
      // The source's ids are checked before its fields are read (another call's fields sit elsewhere).
      if (whole) {
        ok = wait_geq(comm, tail, ce_tag, kSiteCopyDispatchRows, src, 0) &&
             same_dispatch(comm, epoch, src, a.handle_id, a.shape_word, kSiteCopyDispatchRows, 0);
        need = ok ? static_cast<int64_t>(*reinterpret_cast<const volatile int32_t*>(src_ids + end - 1)) + 1 : 0;
      }
      s_abort = !ok || !wait_geq(comm, tail, ce_tag + static_cast<uint64_t>(need), kSiteCopyDispatchRows, src, 0) ||
                (!whole && !same_dispatch(comm, epoch, src, a.handle_id, a.shape_word, kSiteCopyDispatchRows, 0));
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
  // NOTE: a whole-x source copies every token, also those after the last one this rank needs (an early copy even
  // when this rank needs none): wait for its last signal before done hands this rank's staging to the next
  // operation, whose SM rings share that memory.
  const bool missed = threadIdx.x < R && static_cast<int>(threadIdx.x) != me &&
                      !whole_copy_landed(comm, a.recv_meta, m, threadIdx.x, ce_tag, kSiteCopyDispatchRows);
  if (__syncthreads_or(missed)) return;
  finish_copy_receive(comm, epoch);
}

__global__ void wait_released_kernel(CommArgs comm, int32_t site) { peers_released(comm, site); }

// NOTE: an early source's copy stream signals its last chunk with ce_tail = ce_tag + its token count after the copy
// (stream order, system-scope barrier first); the acquire here orders this rank's later ring accesses after it.
__global__ void wait_early_copies_kernel(CommArgs comm, const int32_t* recv_meta, RecvMetaLayout m, uint64_t ce_tag) {
  const int s = threadIdx.x;
  if (s >= comm.num_ranks || s == comm.rank || ((recv_meta[m.early_sources()] >> s) & 1) == 0) return;
  whole_copy_landed(comm, recv_meta, m, s, ce_tag, kSiteCopyDispatchEarly);
}

// NOTE: launched after the copies (events), so the rows are in the destination's memory; the release
// at system scope orders this flag after them for the destination's acquire.
__global__ void signal_rows_kernel(CommArgs comm, RowCounts rows, uint64_t ce_tag) {
  const int d = threadIdx.x;
  if (d < comm.num_ranks && d != comm.rank && rows.v[d] >= 0) {
    st_release_sys(sig(comm, d, comm.off_ce_tail, comm.rank), ce_tag + static_cast<uint64_t>(rows.v[d]));
  }
}

// ---- combine ----------------------------------------------------------------------------------

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
      if (need > 0 && (!wait_geq(comm, sig(comm, me, comm.off_ce_tail, r), ce_tag + static_cast<uint64_t>(need),
                                 kSiteCopyCombineRows, r, 0) ||
                       !same_dispatch(comm, epoch, r, a.handle_id, a.shape_word, kSiteCopyCombineRows, 0))) {
        s_abort = true;
      }
    }
    __syncthreads();
    if (s_abort) return;
    for (int64_t tt = t0 + warp; tt < t1; tt += num_warps) {
      const char* rows[kNormalMaxRanks];
      const float* wrows[kNormalMaxRanks];
      int order[kNormalMaxRanks];
      const int num_src = combine_rank_order(a, R, tt, order);
      for (int j = 0; j < num_src; ++j) {
        const int r = order[j];
        const int64_t li = a.excl_pos[r * (T + 1) + tt];
        if (r == me) {
          rows[j] = reinterpret_cast<const char*>(a.x + (own_base + li) * H);
          wrows[j] = a.topk_weights + (own_base + li) * K;
        } else {
          const char* slot = stage_slot_of(comm, me, r, slot_bytes);
          rows[j] = slot + li * H * 2;
          wrows[j] = reinterpret_cast<const float*>(slot + weights_offset) + li * K;
        }
      }
      reduce_token<true>(a, tt, rows, wrows, num_src, lane);
    }
    __syncthreads();
  }
  finish_copy_receive(comm, epoch);
}

}  // namespace

cudaError_t preload_copy_kernels() {
  return preload_kernels(
      {reinterpret_cast<const void*>(&copy_dispatch_begin_kernel), reinterpret_cast<const void*>(&pack_fields_kernel),
       reinterpret_cast<const void*>(&unpack_fields_kernel), reinterpret_cast<const void*>(&wait_released_kernel),
       reinterpret_cast<const void*>(&signal_rows_kernel), reinterpret_cast<const void*>(&combine_reduce_kernel),
       reinterpret_cast<const void*>(&wait_early_copies_kernel)});
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

void launch_wait_early_copies(const CommArgs& comm, const int32_t* recv_meta, int num_local_experts, uint64_t ce_tag,
                              cudaStream_t stream) {
  const RecvMetaLayout m{comm.num_ranks, comm.num_channels, num_local_experts};
  wait_early_copies_kernel<<<1, 32, 0, stream>>>(comm, recv_meta, m, ce_tag);
}

void launch_signal_rows(const CommArgs& comm, const RowCounts& rows, uint64_t ce_tag, cudaStream_t stream) {
  signal_rows_kernel<<<1, 32, 0, stream>>>(comm, rows, ce_tag);
}

void launch_combine_reduce(const CommArgs& comm, const CombineKernelArgs& args, int64_t slot_bytes,
                           int64_t weights_offset, uint64_t ce_tag, int num_blocks, cudaStream_t stream) {
  combine_reduce_kernel<<<num_blocks, kReduceThreads, 0, stream>>>(comm, args, slot_bytes, weights_offset, ce_tag);
}

}  // namespace epx::cuda
