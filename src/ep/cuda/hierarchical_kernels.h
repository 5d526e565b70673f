// The kernels of the hierarchical normal path (docs/internode.md) and the plain structs they take by value.
// Private to the CUDA backend; the host side is hierarchical_engine.cpp.
//
// N nodes of G ranks; rank (n, l) = n * G + l. A record is one token's trip: the network leg carries records from
// a source rank to the forwarder (n, l) of each destination node, the node leg from the forwarder to the node's
// destination ranks. Records of one message are back to back, in ascending token order (RecordLayout).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/limits.h"

namespace epx::cuda::hier {

// Nodes, local ranks, or (local rank, node) receive blocks: G x N = R of those, so up to kHierarchicalMaxRanks.
inline constexpr int kMaxParts = kHierarchicalMaxRanks;
// GPUs per node: a record's local-rank mask is 32 bits.
inline constexpr int kMaxGpusPerNode = 32;

// One dispatch record: [x row | scales | src_idx int32 | local-rank mask uint32 | top-k int64 [K] | weights [K]],
// 16-byte aligned. num_topk = 0 in cached mode (no top-k, no weights).
struct RecordLayout {
  int64_t x_bytes = 0;
  int64_t scale_bytes = 0;
  int64_t off_src = 0;
  int64_t off_mask = 0;
  int64_t off_topk = 0;
  int64_t off_weights = 0;
  int64_t bytes = 0;
  int num_topk = 0;
  bool has_weights = false;

  static RecordLayout make(int64_t x_bytes, int64_t scale_bytes, int num_topk, bool has_weights) {
    auto align = [](int64_t v, int64_t a) { return (v + a - 1) / a * a; };
    RecordLayout r;
    r.x_bytes = x_bytes;
    r.scale_bytes = scale_bytes;
    r.off_src = align(x_bytes + scale_bytes, 8);
    r.off_mask = r.off_src + 4;
    r.off_topk = r.off_src + 8;
    r.off_weights = r.off_topk + 8 * int64_t{num_topk};
    r.bytes = align(r.off_weights + (has_weights ? 4 * int64_t{num_topk} : 0), 16);
    r.num_topk = num_topk;
    r.has_weights = has_weights && num_topk > 0;
    return r;
  }
};

// Segments of a concatenation: part i holds entries [start[i], start[i + 1]).
struct Parts {
  int num = 0;
  int64_t start[kMaxParts + 1] = {};
};

// Per node n: token t's record index in this rank's message to n (node_slot [T, N], -1 if t has no destination
// on n), the tokens of each message (node_tok [N, T]) and the message sizes (num_tokens_per_node [N]); any of the
// three may be null. One block per node.
void launch_node_scan(const uint8_t* is_token_in_rank, int64_t num_tokens, int num_nodes, int gpus_per_node,
                      int32_t* node_slot, int32_t* node_tok, int32_t* num_tokens_per_node, cudaStream_t stream);

struct PackArgs {
  const char* x;         // [T, x_bytes]
  const char* scales;    // [T, scale_bytes], contiguous; null without fp8
  const void* topk_idx;  // [T, K]; null in cached mode
  bool topk_is_int64;
  const float* weights;             // [T, K] or null
  const uint8_t* is_token_in_rank;  // [T, R]
  const int32_t* node_tok;          // [N, T]
  int64_t num_tokens;
  int num_nodes, gpus_per_node;
  Parts messages;  // records of the message to each node
  RecordLayout rec;
  char* out;  // the messages back to back
};
// The network-leg messages of this rank: one record per (token, node with a destination of it).
void launch_pack(const PackArgs& args, cudaStream_t stream);

// Forwarder: per local rank g (one block each), the position of each received record among those flagged for g
// (fwd_pos [G, M], -1 if not flagged).
void launch_forward_scan(const char* relay, RecordLayout rec, int64_t num_records, int gpus_per_node, int32_t* fwd_pos,
                         cudaStream_t stream);
// Forwarder: every received record into the node-leg message of each flagged local rank g, at fwd_pos (messages
// back to back as in `messages`, one part per g; positions past a part's end are dropped).
void launch_forward_pack(const char* relay, RecordLayout rec, int64_t num_records, int gpus_per_node,
                         const int32_t* fwd_pos, const Parts& messages, char* out, cudaStream_t stream);

struct UnpackArgs {
  const char* in;  // the node-leg messages from forwarders l = 0..G-1, each the blocks of source nodes m = 0..N-1
  RecordLayout rec;
  Parts blocks;                 // records of block (l, m), index l * N + m
  int64_t row_base[kMaxParts];  // the block's first output row: rows of the sources before rank (m, l)
  int64_t num_recv;             // records in all
  int64_t num_rows;             // rows of the outputs (num_recv, or num_worst_tokens)
  int64_t expert_begin;         // this rank's first global expert
  int num_local_experts;
  char* out_x;
  char* out_scales;    // or null
  void* out_topk_idx;  // or null (cached)
  bool topk_is_int64;
  float* out_weights;  // or null
  int32_t* out_src_idx;
};
// Destination: every record into its row, the top-k remapped to local experts (-1 and weight 0 elsewhere); rows
// [num_recv, num_rows) get src_idx -1, top-k -1, weights 0 (worst-token padding).
void launch_unpack(const UnpackArgs& args, cudaStream_t stream);

// ---- combine ----------------------------------------------------------------------------------

// Combine node-leg record: [bf16 x row [H] | fp32 weights [K] from node_weights_offset], 16-byte aligned. Partial
// record (network leg): [x [H], fp32 or bf16 (NodePartials) | fp32 weights [K] from partial_weights_offset],
// 16-byte aligned.
__host__ __device__ inline int64_t node_weights_offset(int64_t hidden) { return (2 * hidden + 15) / 16 * 16; }
__host__ __device__ inline int64_t node_record_bytes(int64_t hidden, int num_topk) {
  return (node_weights_offset(hidden) + 4 * num_topk + 15) / 16 * 16;
}
__host__ __device__ inline int64_t partial_weights_offset(int64_t hidden, bool bf16) {
  return ((bf16 ? 2 : 4) * hidden + 15) / 16 * 16;
}
__host__ __device__ inline int64_t partial_record_bytes(int64_t hidden, int num_topk, bool bf16) {
  return (partial_weights_offset(hidden, bf16) + 4 * num_topk + 15) / 16 * 16;
}

struct CombinePackArgs {
  const uint16_t* x;     // [rows, H] bf16
  const float* weights;  // [rows, K] or null
  int64_t hidden;
  int num_topk;
  Parts blocks;  // as UnpackArgs::blocks: block b's records are rows [row_base[b], ...)
  int64_t row_base[kMaxParts];
  char* out;  // node_record_bytes records, in block order
};
// Destination: its received rows back to the forwarders, in the order they came.
void launch_combine_pack(const CombinePackArgs& args, cudaStream_t stream);

struct CombineReduceArgs {
  const char* in;          // node-leg records from local ranks g = 0..G-1 (the order this rank forwarded them)
  Parts messages;          // one part per g
  const int32_t* fwd_pos;  // [G, M]
  int64_t num_records;     // M: records this rank forwarded
  int gpus_per_node;
  int64_t hidden;
  int num_topk;
  bool bf16;  // NodePartials::kBFloat16: the x partial rounded to bf16
  char* out;  // [M] partial records
};
// Forwarder: per forwarded record, the fp32 sum of its rows over the flagged local ranks g ascending (0 + ...).
void launch_combine_reduce_node(const CombineReduceArgs& args, cudaStream_t stream);

struct CombineFinalArgs {
  const char* in;            // partial records from the forwarders of nodes n = 0..N-1 (this rank's record order)
  Parts messages;            // one part per node
  const int32_t* node_slot;  // [T, N]
  int64_t num_tokens;
  int num_nodes;
  int64_t hidden;
  int num_topk;
  bool bf16;               // the partials' x is bf16 (NodePartials::kBFloat16)
  const uint16_t* bias_0;  // [T, H] or null
  const uint16_t* bias_1;
  uint16_t* out;       // [T, H]
  float* out_weights;  // [T, K] or null
};
// Source: out[t] = bf16(0 + partials over nodes ascending + bias_0 + bias_1), weights likewise without biases.
void launch_combine_final(const CombineFinalArgs& args, cudaStream_t stream);

// Loads this file's kernels into the current device's context (see preload_normal_kernels).
cudaError_t preload_hierarchical_kernels();

}  // namespace epx::cuda::hier
