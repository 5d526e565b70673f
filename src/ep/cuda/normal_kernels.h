// The normal (high-throughput) kernels of the cuda backend and the plain structs they take by value.
// See docs/normal-kernels.md for the protocol.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "comm/cuda/device/error_record.h"
#include "core/limits.h"
#include "ep/normal_region.h"

namespace epx::cuda {

inline constexpr int kLayoutThreads = 256;
inline constexpr int kLayoutClusterBlocks = 8;  // portable cluster size
inline constexpr int kLayoutClusterThreads = 1024;
inline constexpr int64_t kLayoutClusterEntries = int64_t{1} << 18;  // T * K up to this: one cluster
inline constexpr int kMaxCopyChunks = kNormalMaxCopyChunks;         // copy-engine path: chunks per destination
inline constexpr int64_t kCopyChunkRows = 1024;                     // target rows per chunk
inline constexpr int kNormalThreads = 768;                          // 24 warps: split evenly over 2, 4 or 8 peers
inline constexpr int kReduceThreads = 512;  // copy-engine combine's reduction: registers for two rows in flight

// The error record (ErrorRecord, ErrorKind, WaitSite) is the device layer's: cuda/device/error_record.h. The
// normal path keeps two per rank (CommArgs::error).

// Byte offsets inside every rank's peer-visible region (NormalRegionLayout, identical on all ranks), and what
// each rank needs to reach its peers. Signals are uint64: (epoch << 32) | rows for ring counters, epoch for
// flags.
struct CommArgs {
  char* peers[kNormalMaxRanks];  // each rank's region, this rank's included
  int rank;
  int num_ranks;
  int num_channels;
  int64_t off_epoch;         // uint64: this rank's operation counter (local only)
  int64_t off_tail;          // uint64 [R src][C]: rows the source wrote into my ring (written by the source)
  int64_t off_head;          // uint64 [R dst][C]: rows the destination consumed from its ring (written by it)
  int64_t off_done;          // uint64 [R dst][C]: last epoch the destination finished reading its ring
  int64_t off_notify_flag;   // uint64 [2][R src]
  int64_t off_notify;        // int32 [2][R src][kNotifyInts]
  int64_t off_copy_counter;  // uint32: blocks of the copy-engine receive kernel that finished (local only)
  // uint64 [R src]: rows (or tokens) the source's copy engine delivered into my staging, tagged with the
  // copy-engine operation count (ce_tag: a host counter, so a stream can write it without a kernel).
  int64_t off_ce_tail;
  int64_t off_abort;  // uint64: 1 + a rank that left the call before it started (it writes every peer's word)
  // uint64 [2][R src][kCallWords]: the id of the dispatch the source's operation belongs to (its handle's, or the
  // new handle's), the operation's shape word (ep/call_shape.h) and its epoch (released last), in slot [epoch & 1]:
  // written by the source at the operation's start (launch_advance_epoch), compared by receivers with their own when
  // they see the source's rows (same_dispatch), and the shape words by notify, also while it waits (a peer in
  // another kind of call never comes to notify). Two slots as for notify: a source is one operation ahead at most.
  int64_t off_handle_id;
  int64_t off_ring;    // rings [R src][C][ring_slab_bytes] of ring_rows x row_bytes; or the copy-engine staging slots
  int64_t ring_bytes;  // bytes available for rings
  // NOTE: each (source, channel) ring owns a fixed slab of the ring area, whatever the row size of the
  // operation: a sender that only waited for its own channel's `done` must not write into bytes that
  // another channel or source of the previous operation (with other row sizes) may still be reading.
  int64_t ring_slab_bytes;
  int64_t signal_bytes;  // bytes [0, off_ring) zeroed by a reset
  uint64_t timeout_ns;
  // Device aliases of mapped host records: [0] timeouts (also the abort signal of every wait of this
  // rank), [1] bad values (topk_idx out of range, worst-token overflow), which abort nothing.
  ErrorRecord* error;
};

// recv_meta int32 layout, written by notify (this rank as receiver).
struct RecvMetaLayout {
  int num_ranks, num_channels, num_local_experts;
  __host__ __device__ int rank_prefix(int s) const { return s; }
  __host__ __device__ int chan_start(int s, int c) const { return num_ranks + s * (num_channels + 1) + c; }
  __host__ __device__ int num_recv() const { return num_ranks + num_ranks * (num_channels + 1); }
  __host__ __device__ int expert_count(int j) const { return num_recv() + 1 + j; }
  // Rows this rank sends to each destination (its own lists).
  __host__ __device__ int send_count(int r) const { return expert_count(num_local_experts) + r; }
  // Largest staging need (rows) from one rank to another rank (the same on every rank): sizes the staging.
  __host__ __device__ int max_pair_rows() const { return send_count(num_ranks); }
  // Smallest ring area of all ranks, KiB (the same on every rank).
  __host__ __device__ int min_ring_kib() const { return max_pair_rows() + 1; }
  // Source s's token count when it sends its whole x to this rank (whole_copy), else 0.
  __host__ __device__ int whole_tokens(int s) const { return min_ring_kib() + 1 + s; }
  // The lowest rank whose layout kernel found an invalid topk_idx entry in this dispatch, or -1 (the same
  // on every rank): notify carries the flag, so that every rank raises in the same call.
  __host__ __device__ int failed_source() const { return whole_tokens(num_ranks); }
  // Bit s: source s started its whole-x copy to this rank before notify (EarlyCopies; the same rule on both sides).
  __host__ __device__ int early_sources() const { return failed_source() + 1; }
  __host__ __device__ int size() const { return early_sources() + 1; }
};

// ---- copy-engine path (docs/normal-kernels.md) -----------------------------------------------------
// The ring area of every rank is cut into R - 1 staging slots of slot_bytes, one per remote source.
__host__ __device__ inline int stage_slot(int src, int dst, int num_ranks) {
  return (src - dst - 1 + num_ranks) % num_ranks;
}
// Rows [chunk_begin(j), chunk_begin(j + 1)) of n form chunk j of num_chunks. The first and the last
// chunk are half as long as the others: the copy engine starts sooner and the receiver's tail after
// the last copy is shorter.
__host__ __device__ inline int64_t chunk_begin(int64_t n, int num_chunks, int j) {
  if (j <= 0) return 0;
  if (j >= num_chunks) return n;
  return n * (2 * j - 1) / (2 * (num_chunks - 1));
}

struct RowCounts {
  int64_t v[kNormalMaxRanks];
};

// Copy-engine dispatch: a source sends its whole x (every token, one copy per chunk, the receiver picks
// its rows) to a destination that gets at least 15/16 of its tokens, else SM-packed rows. Both sides
// decide with this rule (`enabled` comes from the sender through notify).
__host__ __device__ inline bool whole_copy(int64_t rows, int64_t num_tokens, bool enabled) {
  return enabled && rows > 0 && rows * 16 >= num_tokens * 15;
}

// Where the copy-engine dispatch keeps each field of `cap` rows in a staging slot (byte offsets from
// the slot; absent fields take no bytes): x rows, scale rows, top-k ids (the output's integer type),
// top-k weights, source token ids. x and scale rows are indexed by token when the source sends whole x,
// else by row; the other fields always by row.
struct StageFields {
  int64_t x, scales, topk, weights, src, end;
};

struct DispatchKernelArgs {
  const char* x;         // [T, x_row_bytes]
  const char* x_scales;  // [T, scale_row_bytes] or null
  const void* topk_idx;  // [T, K] or null (cached; also an empty tensor may be null, as torch gives it)
  bool topk_is_int64;
  const float* topk_weights;  // [T, K] or null
  // NOTE: what the rows carry comes from these two, never from the pointers above: the staging layout must
  // be the same on every rank, and an idle rank's empty tensors may be null (torch's are) while its peers'
  // are not.
  bool has_weights;  // topk_weights given (not cached)
  int num_topk;      // 0 when cached
  int num_local_experts;
  int64_t num_tokens;
  int64_t x_row_bytes;
  int64_t scale_row_bytes;
  const int32_t* list_tok;    // [R][T]: tokens sent to each destination, in order
  const int32_t* chan_start;  // [R][C + 1]: prefix of each channel in those lists
  const int32_t* recv_meta;   // RecvMetaLayout
  // outputs
  char* out_x;
  char* out_scales;
  void* out_topk_idx;  // null when absent
  float* out_topk_weights;
  int32_t* out_src_idx;
  int64_t num_out_rows;  // capacity of the outputs
  bool worst_mode;       // rows past the received count get src_idx/topk_idx -1
  int64_t ring_rows;
  int64_t row_bytes;
  uint64_t handle_id;   // the dispatch this one repeats (cached) or makes: every rank's must agree
  uint64_t shape_word;  // ep::encode_call_shape of this call: every rank's must agree
};

struct CombineKernelArgs {
  const uint16_t* x;          // bf16 [N, H]
  const float* topk_weights;  // [N, K] or null
  const uint16_t* bias_0;     // [T, H] or null
  const uint16_t* bias_1;
  int num_topk;
  int64_t hidden;
  int64_t num_tokens;
  const uint8_t* is_token_in_rank;  // [T, R]
  const int32_t* excl_pos;          // [R][T + 1]
  const int32_t* chan_start;        // [R][C + 1]
  const int32_t* recv_meta;
  uint16_t* out;            // [T, H]
  float* out_topk_weights;  // [T, K] or null
  int64_t ring_rows;
  int64_t row_bytes;
  uint64_t handle_id;   // the dispatch this combine reverses: every rank's must agree
  uint64_t shape_word;  // ep::encode_call_shape of this call: every rank's must agree
  // CombineArgs::order_topk_idx (DeepEP V2's order: the biases first, then the ranks by their last top-k slot), or
  // null for the default order. [T, order_num_topk] with these element strides, int64 or int32.
  const void* order_topk;
  bool order_is_int64;
  int order_num_topk;
  int64_t order_stride_t;
  int64_t order_stride_k;
  int64_t experts_per_rank;  // expert e is on rank e / experts_per_rank
};

// Layout: counts and is_token_in_rank; an entry outside [-1, num_experts) is recorded in `error` and
// treated as -1.
// With num_tokens * num_topk <= kLayoutClusterEntries one thread-block cluster does it all and stores
// the counts; otherwise many blocks add into counts this call zeroes on the stream first. cluster_threads: the threads
// per block of the cluster kernel; 0 sizes them to the tokens (one token per thread, at least 128), which
// bench/micro/layout_cost.cu compares with a fixed 1024.
void launch_layout(const void* topk_idx, bool is_int64, int64_t num_tokens, int num_topk, int64_t num_experts,
                   int num_ranks, int32_t* num_tokens_per_rank, int32_t* num_tokens_per_expert,
                   uint8_t* is_token_in_rank, ErrorRecord* value_error, int rank, cudaStream_t stream,
                   int cluster_threads = 0);
// Per destination: the exclusive prefix of is_token_in_rank, the token lists, the channel prefixes.
void launch_scan(const uint8_t* is_token_in_rank, int64_t num_tokens, int num_ranks, int num_channels,
                 int32_t* excl_pos, int32_t* list_tok, int32_t* chan_start, cudaStream_t stream);
// Loads every kernel of this file into the current device's context (cudaFuncGetAttributes).
// NOTE (invariant): every kernel that may run while a peer's kernel spins on it must already be loaded.
// With lazy module loading (the CUDA 12.2+ default) the first launch of a kernel loads it under the
// context lock and waits for the whole device to drain. Ranks that share a process and a GPU (thread
// groups) share that context: rank 0's first combine_kernel launch then waits for its own dispatch_kernel,
// which spins until rank 1's dispatch_kernel runs, which rank 1 cannot launch behind the lock -> both
// time out. The NormalEngine calls this (CudaBuffer calls preload_low_latency_kernels) before the buffer's
// creation barrier.
cudaError_t preload_normal_kernels();
// Starts an operation: advances this rank's epoch and writes `handle_id` (the dispatch the operation belongs to)
// and `shape_word` (ep::encode_call_shape of the call) into every peer's off_handle_id slot for the new epoch.
void launch_advance_epoch(const CommArgs& comm, uint64_t handle_id, uint64_t shape_word, cudaStream_t stream);
// Notify also tells each destination whether this rank sends it whole x (whole_copy with `whole`, or a bit of
// early_mask: the destinations whose whole-x copy this rank started before notify), and whether this rank's
// layout kernel recorded an invalid topk_idx entry (comm.error[1]); the lowest such rank lands in
// recv_meta[failed_source()] on every rank (its bad entries are dropped, the protocol runs on). It compares every
// source's shape word (launch_advance_epoch) with `shape_word`: a difference records kErrShapeMismatch in
// comm.error[0] (every later wait of the rank gives up); every rank finds it, since each compares with all.
// rank_prefix_matrix: int32 [R, R], [i][j] = tokens that ranks 0..i send to rank j (the same on every rank).
void launch_notify(const CommArgs& comm, const int32_t* chan_start, const int32_t* num_tokens_per_expert,
                   int num_local_experts, int expert_alignment, int64_t num_tokens, bool whole, unsigned early_mask,
                   uint64_t shape_word, int32_t* recv_meta, int32_t* recv_expert_counts, int32_t* rank_prefix_matrix,
                   cudaStream_t stream);
// SM path: 2 * min(C, max(1, num_sms / 2)) blocks, a sender and a receiver block per channel; with fewer
// blocks than 2 * C each pair handles several channels in turn (the same order on every rank).
void launch_dispatch(const CommArgs& comm, const DispatchKernelArgs& args, int num_sms, cudaStream_t stream);

// Copy-engine dispatch with field-separated staging (StageFields). begin: waits until every peer released
// the previous operation, then writes the source ids, top-k ids and weights of the rows for each remote
// destination into its slot. pack_fields: chunk `chunk` of the destinations in pack_mask (bit per rank)
// by SMs into `stage` (x at stage_x, scales at stage_scales, row send_offset[dst] + i). unpack_fields:
// this rank's own rows into the outputs, then every remote source's rows from its slot as they arrive
// (ce_tail[src] >= ce_tag + rows, or tokens when the source sends whole x); the last block publishes done.
void launch_copy_dispatch_begin(const CommArgs& comm, const DispatchKernelArgs& args, const StageFields& fields,
                                int64_t slot_bytes, cudaStream_t stream);
void launch_pack_fields(const CommArgs& comm, const DispatchKernelArgs& args, char* stage_x, char* stage_scales,
                        const RowCounts& send_offset, unsigned pack_mask, int chunk, int num_chunks, int num_blocks,
                        cudaStream_t stream);
void launch_unpack_fields(const CommArgs& comm, const DispatchKernelArgs& args, const StageFields& fields,
                          int64_t slot_bytes, uint64_t ce_tag, int num_blocks, cudaStream_t stream);
// Before a copy engine writes into peers' staging: wait until every remote destination released the
// previous operation (done >= epoch - 1 on every channel). One block.
void launch_wait_released(const CommArgs& comm, int32_t site, cudaStream_t stream);
// After a copy into peers' staging completed: ce_tail[me] at destination d = ce_tag + rows.v[d] for every
// remote d with rows.v[d] >= 0.
void launch_signal_rows(const CommArgs& comm, const RowCounts& rows, uint64_t ce_tag, cudaStream_t stream);
// Before the SM rings of a dispatch whose sources started whole-x copies into this rank's staging before notify
// (recv_meta's early_sources, with num_local_experts for its layout) and then had to take the SM path: waits until
// each such copy landed (ce_tail[src] >= ce_tag + its token count), since the rings share the staging's memory.
// One block.
void launch_wait_early_copies(const CommArgs& comm, const int32_t* recv_meta, int num_local_experts, uint64_t ce_tag,
                              cudaStream_t stream);
void launch_combine(const CommArgs& comm, const CombineKernelArgs& args, int num_sms, cudaStream_t stream);
// Non-contiguous scales into a contiguous copy: dst[t][j] = src[t * stride0 + j * stride1] (strides in
// elements of elem_bytes = 1 or 4 bytes).
void launch_gather_scales(const void* src, int64_t stride0, int64_t stride1, int elem_bytes, int64_t num_tokens,
                          int64_t num_scales, void* dst, cudaStream_t stream);
// Copy-engine combine, receive side: the rows of every remote rank arrive in its staging slot (x rows
// from 0, top-k weights rows from weights_offset); own rows are read from args.x. Tokens are reduced in
// windows once every rank's rows up to the window's end arrived; the last block publishes done.
void launch_combine_reduce(const CommArgs& comm, const CombineKernelArgs& args, int64_t slot_bytes,
                           int64_t weights_offset, uint64_t ce_tag, int num_blocks, cudaStream_t stream);

}  // namespace epx::cuda
