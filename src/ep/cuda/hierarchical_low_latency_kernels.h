// Kernels of the hierarchical low-latency routing across nodes (LowLatencyRouting::kHierarchical; protocol in
// docs/internode.md, "Low-latency across nodes"). Private to the CUDA backend; the host side is
// hierarchical_low_latency_engine.h.
//
// N nodes of G ranks, rank (n, l) = n * G + l. A source sends each token once per other node n holding one of its
// experts, to the forwarder (n, l); its own node's records stay local. Every message has a fixed size (M records),
// so the network leg needs no counts first and no host sync. Per call, on the engine's communication stream:
//   dispatch  pack     the source writes one message per node: a 16-byte header (the record count), then its
//                      records by ascending token: the row (bf16, or fp8 quantized here), its wire scales, the token
//                      index, the K expert ids on that node (-1 elsewhere, and -1 on a rank this source masked).
//                      node_slot [M][N] keeps each token's record per node for the combine.
//            exchange  grouped send/recv of the N - 1 messages with the ranks of this local index (net_leg.h).
//            forward   the forwarder writes each (record, expert) pair into the flat low-latency staging slot of
//                      (expert, ORIGINAL source) on the expert's rank of its node, with the flat path's count signal,
//                      so the flat receive kernel (ll::dispatch, kRecv) completes the call unchanged.
//   combine  send_rows the expert's rank returns each received pair's row: to the source itself on its own node (the
//                      flat combine slot and signal), else into the relay rows of the source's forwarder on this node
//                      (indexed by source node, token, k) with a relay signal per (source node, expert).
//            weights   the source writes one weights message per other node: its topk_weights [M][K], then the
//                      mask word (bit g: this source masked local rank g of that node, read now).
//            exchange  the weights messages to the forwarders.
//            reduce    the forwarder sums, per received record, its node's pairs in fp32 by k ascending (w * x, no FMA)
//                      into one partial row [M][H] fp32 per source node.
//            exchange  the partials back to the sources.
//   then, on the caller's stream after it joined the communication stream: llh::combine, the source's sum of the
//   partials by node ascending (its own node's pairs reduced the same way), one rounding to bf16: the host reference's
//   order bit for bit.
//
// Memory ordering: as the flat kernels (low_latency.h): data with plain stores, __syncthreads(), one st_release_sys of
// the signal; readers poll with ld_acquire_sys (bounded, wait_tag) and read past L1. What the exchanges move is ordered
// by the stream. Paths and masks (Buffer::mask_rank): a forwarder forwards nothing of a source it masked (count 0) and
// nothing to a rank it masked; a source packs a zero-count message for a forwarder it masked and sends the ids of
// ranks it masked as -1 (so their forwarder signals count 0: the s-d link at the source's end); a receiver waits for
// neither a masked source nor a source whose forwarder it masked, and on a timeout masks the forwarder (the rank that
// owed the signal). In the combine an expert's rank signals the forwarder whenever their link is open, with kRelayCut
// and no rows when it masked the source, so a forwarder waits only across a link that one end alone masked (then it
// times out and masks the expert's rank, as the flat path does with one-sided masks); the source's mask word in its
// weights message leaves out, without a wait, the ranks the source masked by the time of the combine.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ep/cuda/low_latency.h"

namespace epx::cuda {

inline constexpr int64_t kRelayHeaderBytes = 16;  // a message's record count (int32), padded
// A relay row signal: (tag << kRelayTagShift) | kRelayCut if the expert's rank sent no rows (it masked the source) |
// the dispatch id (low kCombineIdBits bits).
inline constexpr int kRelayTagShift = 32;
inline constexpr uint64_t kRelayCut = uint64_t{1} << 31;

// A combine weights message: [M][K] fp32 (padded to 16 bytes), then a 16-byte trailer whose first uint32 has bit g set
// when the source masked local rank g of the forwarder's node at the combine (the path rule's s-d link at the
// source's end, which the forwarder cannot see otherwise).
__host__ __device__ inline int64_t relay_weights_bytes(int64_t max_tokens, int num_topk) {
  return (max_tokens * num_topk * 4 + 15) / 16 * 16 + 16;
}

// One record of a node message; the same on every rank for one call (row kind, scale format and K agree).
struct RelayRecord {
  int32_t row_bytes = 0;    // H * 2 (bf16) or H (fp8)
  int32_t scale_bytes = 0;  // fp8: H / 128 wire scales, 4 bytes each (fp32) or 1 (UE8M0 exponents); else 0
  int32_t src_offset = 0;   // int32 token index
  int32_t ids_offset = 0;   // int32 [K] expert ids on the message's node, -1 elsewhere
  int32_t num_topk = 0;
  int32_t bytes = 0;  // 16-byte aligned

  __host__ __device__ static RelayRecord make(int64_t hidden, bool fp8, bool ue8m0, int num_topk) {
    RelayRecord r;
    r.row_bytes = static_cast<int32_t>(fp8 ? hidden : hidden * 2);
    r.scale_bytes = static_cast<int32_t>(fp8 ? hidden / 128 * (ue8m0 ? 1 : 4) : 0);
    r.src_offset = (r.row_bytes + r.scale_bytes + 3) / 4 * 4;
    r.ids_offset = r.src_offset + 4;
    r.num_topk = num_topk;
    r.bytes = (r.ids_offset + 4 * num_topk + 15) / 16 * 16;
    return r;
  }
  // A whole message: the header and M records.
  __host__ __device__ int64_t message_bytes(int64_t max_tokens) const { return kRelayHeaderBytes + max_tokens * bytes; }
};

// Byte offsets in each rank's relay region (the same layout on every rank; hierarchical_low_latency_engine.cpp makes
// it). S = N - 1 slots, one per other node: the slot of node m seen from node n is m < n ? m : m - 1.
struct RelayOffsets {
  int64_t rows[2];          // [S][M][K][H] bf16: expert outputs for the sources of other nodes (written by node peers)
  int64_t row_signals[2];   // [S][G * E_local] u64: relay row signals (kRelayTagShift), per (source node, expert)
  int64_t pack;             // [N][message]: slots 0..S-1 to the other nodes (sent), slot S this node's own records
  int64_t relay[2];         // [S][message]: the messages received, per dispatch set
  int64_t node_slot[2];     // [M][N] int32: the token's record in each node message, -1 if none (per dispatch set)
  int64_t weights_send;     // [S][relay_weights_bytes(M, K)]
  int64_t weights_recv;     // [S][relay_weights_bytes(M, K)]
  int64_t partial_send;     // [S][M][H] fp32, or bf16 (RelayView::bf16_partials)
  int64_t partial_recv[2];  // [S][M][H] as partial_send, per combine set
  int64_t total_bytes;
};

// What the relay kernels know about the node (trivially copyable; passed by value).
struct RelayView {
  char* bases[kLowLatencyMaxRanks];  // by global rank: the relay regions of this node's ranks (null elsewhere)
  RelayOffsets off;
  int num_nodes = 1;
  int gpus_per_node = 1;
  int node = 0;
  int local_rank = 0;
  int spin_blocks = 1;         // grid cap of the kernels that wait on peers (reduce, llh::combine)
  bool bf16_partials = false;  // NodePartials::kBFloat16: the partials are rounded to bf16 (this node's too)
  __host__ __device__ int partial_bytes() const { return bf16_partials ? 2 : 4; }
};

struct RelayPackArgs {
  const void* x;     // [T, H] bf16
  const void* topk;  // [T, K]
  bool topk_int64;
  int64_t num_tokens;
  bool fp8;
  bool ue8m0;
  RelayRecord rec;
  int set;  // the call's dispatch set
};

struct RelayRowsArgs {
  const void* x;  // [E_local, R * M, H] bf16 expert outputs, in the packed rows of the dispatch
  int num_topk;
  int dispatch_set;  // the layout ranges and staging of the dispatch
  int set;           // the combine set
  int parts;         // blocks per local expert (LowLatencyConfig::combine_send_parts)
  uint32_t tag_id;   // the dispatch id (low kCombineIdBits bits), as the flat combine's signals
};

struct RelayWeightsArgs {
  const float* topk_weights;  // [T, K]
  int64_t num_tokens;
  int num_topk;
};

struct RelayReduceArgs {
  RelayRecord rec;  // of the dispatch being reversed
  int dispatch_set;
  int set;
  uint32_t tag_id;
};

struct RelaySumArgs {
  const void* topk;  // [T, K]
  bool topk_int64;
  const float* topk_weights;  // [T, K]
  int64_t num_tokens;
  int num_topk;
  void* out;  // [T, H] bf16
  int dispatch_set;
  int set;
  uint32_t tag_id;
};

// Loads the relay kernels into the current context (see preload_normal_kernels: lazy loading would wait for a
// peer's spinning kernel when ranks share a GPU). Every relay kernel; the combine's alone (defined beside them).
cudaError_t preload_relay_kernels();
cudaError_t preload_relay_combine_kernels();

// Dispatch: pack (this rank's messages), then, once the exchange has run, forward.
void launch_relay_pack(const LowLatencyPeers& peers, const LowLatencyLayout& layout, const RelayView& relay,
                       const RelayPackArgs& args, cudaStream_t stream);
void launch_relay_forward(const LowLatencyPeers& peers, const LowLatencyLayout& layout, const RelayView& relay,
                          const RelayRecord& rec, int set, cudaStream_t stream);
// Combine: the expert rows out, the weights messages, the forwarder's partials, the source's sum (advances the combine
// set's sequence).
void launch_relay_rows(const LowLatencyPeers& peers, const LowLatencyLayout& layout, const RelayView& relay,
                       const RelayRowsArgs& args, cudaStream_t stream);
void launch_relay_weights(const LowLatencyPeers& peers, const LowLatencyLayout& layout, const RelayView& relay,
                          const RelayWeightsArgs& args, cudaStream_t stream);
void launch_relay_reduce(const LowLatencyPeers& peers, const LowLatencyLayout& layout, const RelayView& relay,
                         const RelayReduceArgs& args, cudaStream_t stream);
void launch_relay_sum(const LowLatencyPeers& peers, const LowLatencyLayout& layout, const RelayView& relay,
                      const RelaySumArgs& args, cudaStream_t stream);

}  // namespace epx::cuda
