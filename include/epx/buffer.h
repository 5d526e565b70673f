// Expert-parallel dispatch and combine: the contract every backend (host, cuda) implements.
//
// One Buffer per rank. Every call below is collective: each rank of the group makes the same sequence
// of calls (an idle rank passes T = 0 tokens). Experts are split evenly over ranks: rank r holds the
// num_local_experts = num_experts / num_ranks experts [r * num_local_experts, (r + 1) * num_local_experts).
//
// Tensors: inputs are TensorViews on group.device() (the CPU for the host backend); outputs are
// Tensors allocated with BufferOptions::allocator on the same device, unless stated otherwise.
// Streams: the cuda backend enqueues on `stream` (host backend: ignored); when a call returns, its
// device work is enqueued but may not have run, except where a host sync is stated.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "epx/group.h"
#include "epx/quant.h"
#include "epx/tensor.h"

namespace epx {

// When a fresh dispatch on two ranks starts copying its whole x to the peer (cuda backend, copy-engine path with
// whole_copies; docs/normal-kernels.md, "Early copies"). Results are the same in every mode; only the time differs.
// The default stays kNever until the early copies have run on a GPU (built without one; docs/status.md).
enum class EarlyCopies : uint8_t {
  // Before notify when x fits the staging and the peer is expected to need >= 15/16 of the tokens: as many as in this
  // buffer's previous fresh dispatch, or, before the first, as many as uniform routing of top-k over the experts gives.
  kAuto,
  kAlways,  // before notify whenever x fits the staging, however few tokens the peer needs
  kNever,   // after notify, from the counts (one host synchronization before the first byte moves)
};

// Tuning of the cuda backend's normal kernels (docs/normal-kernels.md). The host backend checks the ranges
// and ignores the rest. Every rank must pass the same values (Buffer::create checks it), except
// stage_timeline and early_copies.
struct NormalConfig {
  bool copy_engines = true;     // copy engines carry the NVLink bytes when the staging fits (false: SM rings)
  bool whole_copies = true;     // a destination that gets >= 15/16 of the tokens receives the whole x
  bool stream_signals = true;   // copy completions are signalled by stream memory writes (false: a kernel)
  int max_copy_chunks = 8;      // copies per destination and call, in [1, 8]
  bool stage_timeline = false;  // prints each copy-engine call's stage times to stderr (a debug aid)
  EarlyCopies early_copies = EarlyCopies::kNever;  // fresh two-rank dispatches: whole x copied before notify
};

// Tuning of the cuda backend's low-latency kernels (docs/low-latency.md). Same on every rank.
struct LowLatencyConfig {
  int combine_send_parts = 2;  // blocks per local expert in the combine send: 1, 2, 4 or 8
  // Flat combine send: a local expert whose dispatch received at most this many rows (all sources) is sent by one
  // block without the parts' completion counter and its fences (the other parts return at once): the small batches'
  // fixed cost. >= 0; 0: every expert uses combine_send_parts blocks. See docs/low-latency.md.
  int combine_solo_max_rows = 1;
  // Flat dispatch from this max_tokens_per_rank on: a token's row crosses to a rank once (token-staged), below it
  // once per (token, expert) pair (fewer steps per call). >= 0; 0: always token-staged. See docs/low-latency.md.
  int token_rows_min_tokens = 64;
  // The flat routing's kernels are programmatic dependent launches (sm_90+): a kernel's launch and start overlap the
  // end of the kernel before it on the stream, eager or in a CUDA graph. Results, stream order and graph capture are
  // unchanged: the kernel waits for that kernel's completion before it touches memory. false: plain launches.
  // See docs/low-latency.md.
  bool programmatic_launch = true;
  // Flat routing: the combine sums each token's expert outputs on the experts' rank first, so one bf16 row per
  // (token, expert rank) crosses instead of one per (token, expert) (top-8 of 256 on 2 ranks: ~1 row per token and
  // peer instead of ~4). The sum changes: per expert rank q (ascending), p_q = 0 + w_k * y_k over that rank's
  // experts in ascending k in fp32, rounded to bf16; then out = bf16(0 + p_0 + p_1 + ...) in fp32. Off: the sum of
  // every w_k * y_k in ascending k, one rounding (the default, as DeepEP). The hierarchical
  // routing always reduces per node (docs/internode.md) and ignores it. Same on every rank. docs/low-latency.md.
  bool expert_side_reduction = false;
  // A rank that does not come to a low-latency call within the group's timeout is masked (mask_rank) and the call
  // completes without it (DeepEP's shrink semantics): its experts contribute nothing to the combine. false (default):
  // a warning is logged. true: the rank is masked the same way, and once this rank's round is complete (the end of a
  // combine, after its receive; with a hook, the hook raises after it enqueued the receive) the call raises kTimeout
  // naming it: on the host backend the combine of the round with the timeout, on the cuda backend (whose kernels
  // record it) that combine or, when the record comes later, the next round's. Raising only at a combine keeps this
  // rank's calls in step with its peers'. For callers that must not return a silent zero contribution (the DeepEP
  // shim without enable_shrink). The cuda backend cannot tell a peer that masked this rank on purpose (mask_rank
  // there) from a late one: this rank waits out the timeout for it and raises too; the host backend raises only for
  // timeouts and ranks out of step. The mask stays: unmask_rank / clear_rank_mask once the peer is back;
  // clean_low_latency_buffer drops a pending raise. Per rank (not compared across ranks).
  bool raise_on_timeout = false;
};

// Which way normal dispatch/combine move tokens (docs/internode.md). The same on every rank.
enum class NormalRouting : uint8_t {
  // kHierarchical when group.topology().num_nodes > 1 or the ranks exceed the backend's flat cap (cuda:
  // kCudaFlatNormalMaxRanks; one node then takes the hierarchical routing forced on one node), else kFlat
  kAuto,
  kFlat,  // each token goes from its rank straight to every destination rank (one node)
  // A token crosses the network once per destination node, to the rank with its source's local index there, which
  // forwards it to its destination ranks in that node; combine reduces inside the node before the network leg.
  // Same results as kFlat (receive order, metadata, counts, data bytes); combine sums match within fp32
  // reassociation (see CombineResult). Both backends; the cuda backend's results equal the host backend's
  // hierarchical ones bit for bit, combine included. cuda backend, this first version: a fresh dispatch synchronizes
  // its stream once also in worst-token mode, and no hierarchical call can be captured in a CUDA graph (each starts
  // with a host rendezvous of the ranks); see docs/internode.md.
  kHierarchical,
};

// Which way low-latency dispatch/combine move (token, expert) pairs (docs/internode.md, "Low-latency across
// nodes"). The same on every rank.
enum class LowLatencyRouting : uint8_t {
  kAuto,  // kHierarchical when group.topology().num_nodes > 1, else kFlat
  kFlat,  // each (token, expert) pair goes from its rank straight to the expert's rank (one node)
  // A token crosses the network at most once per destination node: rank (m, l) sends token t once to rank (n, l) of
  // each other node n holding one of t's experts, with t's expert ids on n; (n, l) forwards it to the ranks of n
  // holding them. Ranks of node m get it directly. Dispatch results equal kFlat's bit for bit; combine reduces inside
  // each node first (LowLatencyCombineResult); the rank mask also cuts the forwarder's paths (Buffer::mask_rank).
  // Both backends; the cuda backend's results equal the host backend's bit for bit, combine included. cuda backend,
  // this first version: the sends of the network leg have a fixed size (max_tokens_per_rank records per other node) and
  // need no host sync, but with ranks as threads of one process (create_cuda_groups) each exchange meets the other
  // ranks on the host, so such calls cannot be captured in a CUDA graph; see docs/internode.md.
  kHierarchical,
};

// How the hierarchical routings' combine (normal and low-latency) carries a node's partial sum of a token over the
// network leg (docs/internode.md, "Combine partials"). The same on every rank.
enum class NodePartials : uint8_t {
  kFloat32,   // fp32 partials: the only rounding is the final one (the default)
  kBFloat16,  // each node's partial rounded to bf16 first: half the combine's network bytes (DeepEP's internode choice)
};

struct BufferOptions {
  // Bytes of peer-visible memory for the normal kernels (0: a size that fits the default workloads;
  // see normal_buffer_size_hint).
  int64_t num_normal_bytes = 0;
  // Bytes of peer-visible memory for the low-latency kernels (0: none; low_latency_* then throw).
  // See low_latency_buffer_size_hint.
  int64_t num_low_latency_bytes = 0;
  // SMs the normal kernels may occupy (cuda backend).
  int num_sms = 24;
  std::shared_ptr<Allocator> allocator;  // null: default_allocator()
  NormalConfig normal;
  LowLatencyConfig low_latency;
  NormalRouting normal_routing = NormalRouting::kAuto;
  LowLatencyRouting low_latency_routing = LowLatencyRouting::kAuto;
  NodePartials node_partials = NodePartials::kFloat32;  // the hierarchical routings only; kFlat ignores it
  // Ranks the cuda backend takes: see kCudaNormalMaxRanks and the constants after this struct.
};

// Ranks of a cuda buffer (kUnsupported naming the routing and its cap otherwise; the host backend has no such caps).
// Normal path: flat routing <= kCudaFlatNormalMaxRanks, hierarchical <= kCudaNormalMaxRanks (<= 32 GPUs per node).
// Low-latency path: flat <= kCudaFlatLowLatencyMaxRanks, hierarchical <= kCudaLowLatencyMaxRanks (<= 16 GPUs per
// node). Above kCudaNormalMaxRanks a buffer is low-latency only: num_normal_bytes must be 0 (there is no normal
// memory then) and the normal calls raise kUnsupported.
inline constexpr int kCudaFlatNormalMaxRanks = 8;
inline constexpr int kCudaNormalMaxRanks = 64;
inline constexpr int kCudaFlatLowLatencyMaxRanks = 16;
inline constexpr int kCudaLowLatencyMaxRanks = 128;

// Peer memory the low-latency path needs for two buffer sets with these limits.
int64_t low_latency_buffer_size_hint(int64_t max_tokens_per_rank, int64_t hidden, int num_ranks, int64_t num_experts);
// Peer memory the normal path needs: a ring buffer per channel and peer (independent of T) and, when
// max_tokens_per_rank > 0, enough for the copy-engine path at up to that many tokens per rank (one staging
// slot per peer that holds a whole transfer; with less, the cuda backend keeps to the SM path).
int64_t normal_buffer_size_hint(int64_t hidden, int num_ranks, int num_sms, int64_t max_tokens_per_rank = 0);

// The routing layout of one batch, as get_dispatch_layout computes it. Tensors on the group's device.
struct Layout {
  Tensor num_tokens_per_rank;    // int32 [num_ranks]
  Tensor num_tokens_per_expert;  // int32 [num_experts]
  Tensor is_token_in_rank;       // bool  [T, num_ranks]
  // Tokens with at least one expert on a rank of each node of group.topology() (DeepEP's num_tokens_per_rdma_rank),
  // the count the hierarchical path sends over the network per node. Optional: the host backend always fills it
  // (one entry on one node); the cuda backend fills it when the buffer routes hierarchically (NormalRouting) and
  // leaves it undefined otherwise. dispatch ignores it when undefined and checks it against topk_idx when given
  // (cuda backend: in the hierarchical routing only).
  Tensor num_tokens_per_node;  // int32 [num_nodes]
};

// Opaque record of one normal dispatch: where every token went. Pass it to combine, or to dispatch
// again (cached mode) to move new data along the same routes without recomputing the layout.
// Streams (cuda backend): the handle's device memory was allocated on the stream of the fresh dispatch that made it
// and is freed there when the last reference goes. A cached dispatch or combine on another stream reads it: keep a
// reference until that stream has passed the call (or order the streams), as for any tensor used across streams.
class DispatchHandle {
 public:
  virtual ~DispatchHandle() = default;
  virtual int64_t num_tokens() const = 0;  // T of the dispatching rank
  // Rows received (exact). -1 in worst-token mode on the cuda backend, where the host never learns it.
  virtual int64_t num_recv_tokens() const = 0;
  // int32 [num_ranks, num_ranks] on the group's device: entry [i][j] = tokens that ranks 0..i send to rank j
  // (cumulative over source ranks; DeepEP's rank_prefix_matrix, `handle[0]`). The same on every rank, so rank
  // j's rows from source s are [m[s-1][j], m[s][j]) (m[-1] = 0). Written by the fresh dispatch that made the
  // handle, on its stream (cuda backend: valid once that stream reached it; no host sync); cached dispatches
  // share it. Treat it as read-only.
  virtual const Tensor& rank_prefix_matrix() const = 0;
};

struct DispatchArgs {
  TensorView x;  // [T, H]; bf16, or fp8 e4m3 with x_scales
  // Only with fp8 x, required then. Any strides (e.g. column-major, as DeepGEMM writes them). One of:
  //   fp32  [T, H / 128]: one scale per 128 channels;
  //   uint8 [T, H / 128]: UE8M0 exponents (ScaleFormat::kUE8M0);
  //   int32 [T, ceil(H / 512)]: packed UE8M0, four exponents per element: byte j (little-endian) of element i
  //         holds channel block 4 * i + j; the bytes past block H / 128 - 1 are padding, moved unchanged.
  // The cuda backend moves non-contiguous scales through a contiguous copy (one small kernel, T * S elements).
  TensorView x_scales;
  TensorView topk_idx;      // [T, K]; int64 or int32; -1 = no expert. Absent in cached mode.
  TensorView topk_weights;  // [T, K] fp32; optional. Absent in cached mode.
  int64_t num_experts = 0;  // ignored in cached mode
  // Optional: the layout of this topk_idx from get_dispatch_layout (computed when absent).
  const Layout* layout = nullptr;
  // Cached mode: reuse a previous dispatch's routes (same T); topk_idx/topk_weights/layout must be absent.
  std::shared_ptr<const DispatchHandle> handle;
  // Round each per-local-expert receive count up to a multiple of this (>= 1). Ignored in cached mode,
  // which reports the counts of the dispatch that made the handle.
  int expert_alignment = 1;
  // > 0: outputs have exactly this many rows and the call does no host sync (CUDA-graph capturable on
  // the cuda backend). Must be >= the rows actually received, else kInvalidArgument (host) or a
  // recorded overflow error raised on the next call (cuda).
  int64_t num_worst_tokens = 0;
  // SMs this call may occupy (DeepEP's Config.num_sms): 0 = BufferOptions::num_sms; else in [1, that value]
  // (the cuda backend sizes its channels and rings by the buffer's value; more is kInvalidArgument). Ranks
  // may pass different values, and a handle works with any value. cuda: the SM path launches
  // 2 * max(1, num_sms / 2) blocks, the copy-engine path's kernels num_sms blocks. host: checked, no effect.
  int num_sms = 0;
  Stream stream = nullptr;
};

struct DispatchResult {
  // Rows are ordered by source rank, then by source token index. Rows past the received count (worst-
  // token mode) have recv_src_idx = -1 and recv_topk_idx = -1; their data is unspecified (the host
  // backend writes zeros there, and 0 weights). Cached mode: recv_topk_idx / recv_topk_weights are
  // absent. recv_topk_weights is absent when topk_weights is.
  Tensor recv_x;             // [N, H], the dtype of x
  Tensor recv_x_scales;      // [N, x_scales.shape[1]], contiguous, the dtype (and packing) of x_scales; fp8 only
  Tensor recv_topk_idx;      // [N, K], the dtype of topk_idx: local expert id, or -1 if not local
  Tensor recv_topk_weights;  // [N, K] fp32: the weight where recv_topk_idx >= 0, else 0
  Tensor recv_src_idx;       // int32 [N]: the token's index on its source rank
  // Received (token, local expert) pairs per local expert, each rounded up to expert_alignment.
  // Host-visible except in worst-token mode, where it is empty (see recv_expert_counts).
  std::vector<int32_t> num_recv_tokens_per_expert;
  Tensor recv_expert_counts;  // int32 [num_local_experts] on the device: same numbers, always filled
  Tensor rank_prefix_matrix;  // int32 [R, R] on the device: handle->rank_prefix_matrix() (the same tensor)
  std::shared_ptr<const DispatchHandle> handle;
};

struct CombineArgs {
  TensorView x;             // [N, H] bf16: one row per received row, in dispatch's receive order
  TensorView topk_weights;  // [N, K] fp32; optional (summed back like x)
  TensorView bias_0;        // [T, H] bf16; optional, added once per token
  TensorView bias_1;        // [T, H] bf16; optional
  // Optional: the topk_idx [T, K] (int64 or int32) of the dispatch that made `handle`. Given, the sum follows
  // DeepEP V2's order (its combine reference) instead of the one CombineResult states: 0 + bias_0 + bias_1 first,
  // then each rank's row in the order of the last top-k slot whose expert is on that rank (expert e is on rank
  // e / (num_experts / R); entries outside [0, num_experts) name no rank); a rank the handle sent the token to that
  // no slot names comes last, by ascending r. Then one rounding. Weights are summed as without it. Flat routing
  // only: with the hierarchical one it is kUnsupported. Each rank chooses for itself (only its own sum changes).
  TensorView order_topk_idx;
  std::shared_ptr<const DispatchHandle> handle;
  int num_sms = 0;  // as DispatchArgs::num_sms (need not match the dispatch's)
  Stream stream = nullptr;
};

struct CombineResult {
  // out[t] = bf16( sum over the ranks r that token t was sent to of x_r[row of t on r]
  //                + bias_0[t] + bias_1[t] ), accumulated in fp32. A token sent nowhere gets the biases.
  // Host order (exact reference; other backends match it within fp32 reordering): start at 0, add the
  // rows by ascending r, then bias_0, then bias_1, then round once to bf16. topk_weights: the same
  // ascending-r fp32 sum, so each weight comes back exactly (it is non-zero on one rank only).
  // Hierarchical routing (NormalRouting) on the host: per destination node n ascending, an fp32 partial
  // p_n = 0 + the rows of n's ranks by ascending r; then acc = 0 + p_0 + p_1 + ..., the biases, one rounding.
  // It equals the order above bit for bit with one node or one rank per node, and whenever the fp32 sums are
  // exact; otherwise only by fp32 reassociation (the rounding errors of the fp32 adds, bounded as between
  // backends), which can move the bf16 result where the sum lies near a rounding boundary. Weights still come
  // back exactly. NodePartials::kBFloat16: each p_n is rounded to bf16 before it is added (acc = 0 + bf16(p_0) +
  // bf16(p_1) + ..., then the biases, one more rounding); the weights' partials stay fp32, so they still come back
  // exactly. With one node and no biases that equals the fp32 result bit for bit. CombineArgs::order_topk_idx
  // changes the order (flat routing), on every backend alike.
  Tensor x;             // [T, H] bf16
  Tensor topk_weights;  // [T, K] fp32, the same sum of topk_weights rows; only if given
};

// ---- low-latency ---------------------------------------------------------------------------------

// Memory layout of the low-latency fp8 scales (recv_x_scales). S = H / 128 scales per row (fp32, or uint8
// UE8M0 exponents), except column-major UE8M0: S = H / 512 int32 words, byte j of word i the exponent of
// block 4i + j (DeepGEMM's packed UE8M0).
enum class ScaleLayout : uint8_t {
  kRowMajor,     // [E_local, R * M, S]
  kColumnMajor,  // [E_local, S, R * M]: one scale column per row block, as DeepGEMM's grouped GEMMs read them
                 // (DeepEP returns this memory as a [E_local, R * M, S] view with strides (S * R * M, 1, R * M))
};

class LowLatencyHandle {
 public:
  virtual ~LowLatencyHandle() = default;
};

struct LowLatencyDispatchArgs {
  TensorView x;                     // [T, H] bf16, T <= max_tokens_per_rank, H % 128 == 0, H <= 16384
  TensorView topk_idx;              // [T, K] int64 or int32, K <= 16; -1 = no expert
  int64_t max_tokens_per_rank = 0;  // the same on every rank and every call of this buffer
  int64_t num_experts = 0;          // <= 1024, divisible by num_ranks
  bool use_fp8 = false;
  ScaleFormat scale_format = ScaleFormat::kFloat32;
  // With kFloat32: power-of-two scales (the data quantized as with kUE8M0), returned as fp32 (DeepEP's
  // round_scale). Implied by kUE8M0.
  bool round_scale = false;
  ScaleLayout scale_layout = ScaleLayout::kRowMajor;  // column-major UE8M0 needs H % 512 == 0
  // True: the call only sends; the result's recv_hook() completes the receive. The caller may run
  // other work in between (and must call the hook before reading the outputs).
  bool return_recv_hook = false;
  // Optional int32 [num_local_experts]: incremented by the pairs received per local expert (EPLB).
  TensorView cumulative_recv_counts;
  // Optional int64 [num_ranks]: entry s grows by the nanoseconds this call's receive waited for source rank s
  // (DeepEP's dispatch_wait_recv_cost_stats, which counts clock cycles): a slow or absent rank stands out. cuda:
  // summed over the receive's waiting threads (one per local expert and source; the flat routing only), host: the
  // wall time until s's message was there. Masked ranks add nothing.
  TensorView wait_recv_cost_ns;
  Stream stream = nullptr;
};

struct LowLatencyDispatchResult {
  // Outputs live in the buffer (no allocation): valid until the second-next low-latency call of the
  // same kind, since two buffer sets alternate. Packed rows: local expert e's pairs are rows
  // [0, recv_count[e]) of recv_x[e], ordered by source rank, then source token index (then ascending k,
  // should a token choose e twice); no gaps, so a masked grouped GEMM reading rows [0, masked_m) with
  // masked_m = recv_count (DeepGEMM, DeepEP's layout) sees exactly the received pairs. Source s's pairs
  // are rows [begin, begin + count) with (begin, count) from recv_layout_range[e][s]; begin is the sum of
  // the counts of sources < s. Each (expert, source rank) block holds at most M pairs (host: more is
  // kInvalidArgument). A masked source has count 0 (hierarchical routing: also a source whose path through
  // the forwarder is cut, see Buffer::mask_rank). Rows past recv_count[e] are unspecified (recv_x,
  // scales). Shapes are fixed, so the cuda backend needs no host sync (CUDA-graph capturable). With
  // return_recv_hook, call the hook before the second-next dispatch of this buffer, from the thread that
  // drives it, and before destroying the buffer; calling it again does nothing. The same for a combine's hook:
  // before the second-next combine (which reuses its buffer set and sequence number) and before the second-next
  // dispatch. A hook that is never called leaves this rank one call behind its peers until
  // clean_low_latency_buffer().
  Tensor recv_x;             // [E_local, R * M, H]: bf16, or fp8 e4m3 with use_fp8
  Tensor recv_x_scales;      // fp32 or uint8 (UE8M0) [E_local, R * M, H / 128], or in scale_layout (ScaleLayout)
  Tensor recv_count;         // int32 [E_local]: pairs received per local expert
  Tensor recv_src_info;      // int32 [E_local, R * M]: the row's source token index; -1 past recv_count[e]
  Tensor recv_layout_range;  // int64 [E_local, R]: (begin << 32) | count, begin = prefix of counts over s
  std::shared_ptr<const LowLatencyHandle> handle;
  std::function<void()> recv_hook;  // set iff return_recv_hook
};

struct LowLatencyCombineArgs {
  // [E_local, R * M, H] bf16 (H of the dispatch): expert e's output for the pair in recv_x row i at row i;
  // only rows [0, recv_count[e]) are read.
  TensorView x;
  TensorView topk_idx;      // [T, K], the same as the dispatch's (host: a difference is kInvalidArgument)
  TensorView topk_weights;  // [T, K] fp32
  std::shared_ptr<const LowLatencyHandle> handle;
  bool return_recv_hook = false;
  // Optional int64 [num_ranks]: entry q grows by the nanoseconds this call's receive waited for expert rank q
  // (DeepEP's combine_wait_recv_cost_stats), as LowLatencyDispatchArgs::wait_recv_cost_ns.
  TensorView wait_recv_cost_ns;
  TensorView out;  // optional [T, H] bf16 to write into; else allocated
  Stream stream = nullptr;
};

struct LowLatencyCombineResult {
  // out[t] = bf16( sum over k with topk_idx[t][k] >= 0 and its rank not masked of
  //                topk_weights[t][k] * x[expert][row of (t, k)] ), accumulated in fp32.
  // Host order: start at 0, for k ascending add the fp32 product w * x (no fused multiply-add), round
  // once to bf16. A token with no unmasked expert gets zeros.
  // Hierarchical routing (LowLatencyRouting) on the host: the forwarder (n, l) of each node n reduces its node's
  // pairs into an fp32 partial p_n = 0 + (w * x for k ascending whose expert is on node n, products as above); the
  // source adds out[t] = bf16(0 + p_0 + p_1 + ...) by node ascending. It equals the order above bit for bit with one
  // node, when all of t's contributing experts sit on one node, and whenever the fp32 sums are exact; otherwise only
  // by fp32 reassociation (as CombineResult's hierarchical order). A pair whose path is cut (Buffer::mask_rank)
  // contributes zero, like a masked rank's. NodePartials::kBFloat16: out[t] = bf16(0 + bf16(p_0) + bf16(p_1) + ...),
  // this rank's own node included (with one node: the fp32 result bit for bit).
  Tensor x;                         // [T, H] bf16
  std::function<void()> recv_hook;  // set iff return_recv_hook
};

class Buffer {
 public:
  // Throws kInvalidArgument for bad options, kUnsupported for a backend this build lacks.
  static std::unique_ptr<Buffer> create(std::shared_ptr<Group> group, const BufferOptions& options = {});
  // cuda backend: collective (every rank destroys its buffer). Synchronizes the stream of the last normal call (for
  // the low-latency memory, the whole device), then waits for the other ranks, whose kernels write into this rank's
  // memory until their last call ends. Replays of captured normal calls on another stream must be synchronized first.
  virtual ~Buffer() = default;

  virtual Group& group() = 0;
  int rank() { return group().rank(); }
  int num_ranks() { return group().num_ranks(); }

  // Not collective. topk_idx: [T, K] int64 or int32 on the group's device.
  virtual Layout get_dispatch_layout(const TensorView& topk_idx, int64_t num_experts, Stream stream = nullptr) = 0;

  // Normal (high-throughput) dispatch. Host syncs on the cuda backend (the host backend always runs to
  // completion): a fresh dispatch (no handle) without num_worst_tokens waits on the host for the receive
  // counts (one device-to-host copy and a stream synchronize) before allocating outputs. Worst-token mode
  // (fresh or cached) and cached mode do not wait, except a cached dispatch without num_worst_tokens whose
  // handle came from a worst-token dispatch: it learns the counts once (the same wait), and so does every
  // such call with that handle. Also: the first call after a timeout synchronizes to reset the signals.
  virtual DispatchResult dispatch(const DispatchArgs& args) = 0;
  // Normal combine: the reverse of the dispatch that made args.handle. No host sync on the cuda backend
  // (except the reset after a timeout, as dispatch).
  virtual CombineResult combine(const CombineArgs& args) = 0;

  // Low-latency dispatch/combine: fixed shapes, no host sync on the cuda backend.
  virtual LowLatencyDispatchResult low_latency_dispatch(const LowLatencyDispatchArgs& args) = 0;
  virtual LowLatencyCombineResult low_latency_combine(const LowLatencyCombineArgs& args) = 0;

  // Rank mask (low-latency path). A masked rank is skipped: nothing is sent to it or awaited from it,
  // and its tokens come back as zeros. A rank that does not answer within the group's timeout is
  // masked automatically. mask_rank/clear_rank_mask are local to this rank's buffer; a rank that
  // learns a peer has masked it masks that peer in return (the peer sends it nothing), so masks
  // become symmetric after one call. mask_rank(own rank) or a rank outside [0, R) is kInvalidArgument.
  // unmask_rank(r) clears r's bit (a no-op if it is clear; r outside [0, R) is kInvalidArgument), also
  // locally: traffic with r resumes once r has unmasked this rank too, else the next low-latency call masks
  // r again (host: at once; cuda: after a timeout). Normal dispatch/combine ignore the mask: a missing rank
  // there is Error(kTimeout).
  // cuda backend: the three calls write the mask at once, not in stream order: make them while no low-latency call
  // of this buffer is in flight on any stream (a combine that sees the mask change midway can signal rows it sent
  // only in part). After a timeout masked a rank that may still be running, lifting the mask needs
  // clean_low_latency_buffer() on every rank, not clear_rank_mask() alone: the masked rank's late combine rows can
  // land in the combine buffer a later call reads (the default combine indexes those rows by (token, k), not by
  // their writer).
  // Hierarchical low-latency routing (LowLatencyRouting): the pairs of source s = (m, l) for rank d = (n, g) of
  // another node travel through the forwarder f = (n, l) only, both ways. They travel iff none of the three links
  // s-d, s-f and f-d is masked (by either end, in that call; f = d: the link s-d alone). Otherwise d receives count 0
  // from s and s's combine gets nothing back from d's experts: a masked or silent forwarder cuts its node off from
  // the sources with its local index (the price of one network path per (node, local index)). Ranks of one node
  // reach each other directly, as flat.
  virtual void mask_rank(int rank) = 0;
  virtual void unmask_rank(int rank) = 0;
  virtual std::vector<bool> rank_mask() const = 0;  // [num_ranks], true = masked
  virtual void clear_rank_mask() = 0;

  // The routings this buffer's calls take: BufferOptions::normal_routing and low_latency_routing with kAuto resolved
  // (kFlat or kHierarchical) by the group's topology and the backend's limits. Not collective.
  virtual NormalRouting normal_routing() const = 0;
  virtual LowLatencyRouting low_latency_routing() const = 0;

  // Collective: every rank of the group calls it. Waits for this rank's low-latency work to finish (a device
  // synchronize on the cuda backend), zeroes the low-latency buffer (signals, sequence numbers, the rank mask)
  // and forgets the shapes fixed by the first low_latency_dispatch, so the next one may use another
  // max_tokens_per_rank, hidden size or expert count (within the buffer's size). Outputs of earlier low-latency
  // calls are invalid afterwards. Without low-latency memory it only synchronizes the ranks.
  virtual void clean_low_latency_buffer() = 0;
};

}  // namespace epx
