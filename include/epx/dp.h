// DP attention: attention runs data-parallel (each DP rank has its own batch), the MoE runs
// expert-parallel over the same ranks. Between the two the hidden states are gathered into one global
// batch and scattered back, and every step the DP ranks agree on a small batch-metadata record.
//
// Rank arithmetic (the same ranks seen two ways, world = tp):
//   attention: world = attn_tp * attn_cp * attn_dp,  rank = (attn_dp_rank * attn_cp + attn_cp_rank) * attn_tp
//                                                           + attn_tp_rank
//   MoE:       world = moe_tp * moe_ep * moe_dp,     rank = (moe_dp_rank * moe_ep + moe_ep_rank) * moe_tp
//                                                           + moe_tp_rank
// e.g. 8 ranks, attn_cp 2, attn_tp 4, moe_dp 2, moe_ep 4: attention-CP groups [0,4] [1,5] [2,6] [3,7],
// attention-TP groups [0..3] [4..7], MoE-EP groups [0..3] [4..7], MoE-DP groups [0,4] [1,5] [2,6] [3,7].
//
// Every collective below runs over a Group holding all `world` ranks (the TP group) and is called by
// every rank of it with the same plan. The ranks of one DP rank (its attention-TP and -CP ranks) hold
// the same batch; only its "leader" (attn_tp_rank 0, attn_cp_rank 0) contributes data, unless its CP ranks hold
// shards of it (cp_shard_counts, below).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "epx/forward_mode.h"
#include "epx/group.h"
#include "epx/tensor.h"

namespace epx {

// ---- rank arithmetic -------------------------------------------------------------------------------

struct ParallelSizes {
  int world_size = 1;    // ranks in the group (tp)
  int attn_dp_size = 1;  // attention data-parallel ranks
  int attn_cp_size = 1;  // attention context-parallel ranks
  int attn_tp_size = 0;  // 0: world / (attn_dp * attn_cp)
  int moe_ep_size = 0;   // 0: world / (moe_dp * moe_tp)
  int moe_dp_size = 1;
  int moe_tp_size = 0;  // 0: world / (moe_ep * moe_dp); 1 when moe_ep_size is 0 too
};

struct RankCoords {
  int attn_tp_rank = 0;
  int attn_cp_rank = 0;
  int attn_dp_rank = 0;
  int moe_tp_rank = 0;
  int moe_ep_rank = 0;
  int moe_dp_rank = 0;
};

enum class ParallelGroupKind : uint8_t { kAttnTp, kAttnCp, kAttnDp, kMoeTp, kMoeEp, kMoeDp };
const char* to_string(ParallelGroupKind kind) noexcept;

class ParallelLayout {
 public:
  // Derives the 0 sizes and checks every product equals world_size (1 <= world_size <= 1024, every size
  // >= 1). Throws kInvalidArgument naming the size and the product it broke.
  static ParallelLayout create(const ParallelSizes& sizes);
  // Every rank its own DP rank: attn_dp = world, attn_tp = attn_cp = 1, moe_ep = world.
  static ParallelLayout pure_dp(int world_size);

  const ParallelSizes& sizes() const { return sizes_; }
  int world_size() const { return sizes_.world_size; }
  int attn_dp_size() const { return sizes_.attn_dp_size; }
  int attn_tp_size() const { return sizes_.attn_tp_size; }
  int attn_cp_size() const { return sizes_.attn_cp_size; }

  // Throws kInvalidArgument unless 0 <= rank < world_size.
  RankCoords coords(int rank) const;
  // The rank with these attention coordinates.
  int attn_rank(int attn_dp_rank, int attn_cp_rank, int attn_tp_rank) const;
  // The rank that contributes DP rank `attn_dp_rank`'s data (its attn_tp_rank 0, attn_cp_rank 0).
  int dp_leader(int attn_dp_rank) const { return attn_rank(attn_dp_rank, 0, 0); }
  bool is_dp_leader(int rank) const;

  // All groups of one kind, each an ascending list of ranks; groups ordered by their first rank.
  std::vector<std::vector<int>> groups(ParallelGroupKind kind) const;
  // The group of `kind` that holds `rank`.
  std::vector<int> group_of(ParallelGroupKind kind, int rank) const;

 private:
  ParallelSizes sizes_;
};

// ---- padding mode and gather plan -------------------------------------------------------------------

enum class DpPaddingMode : uint8_t {
  kMaxLen,  // each DP rank padded to the max count; all-gather
  kSumLen,  // zeroed buffer of the total count, each DP rank writes at its prefix offset; all-reduce
};
const char* to_string(DpPaddingMode mode) noexcept;  // "MAX_LEN" / "SUM_LEN"

struct PaddingModeOptions {
  bool is_extend_in_batch = false;  // some DP rank runs an extend (prefill) batch
  bool in_cuda_graph = false;       // the step replays a CUDA graph (fixed shapes)
  bool symmetric_a2a = false;       // the all-to-all backend needs the same shape on every rank
};

// The mode of one step from the per-DP-rank token counts (every count >= 0, 1 to 1024 DP ranks).
// Rules, first match wins: symmetric_a2a -> MAX_LEN; in_cuda_graph -> MAX_LEN; extend with more than
// one DP rank -> SUM_LEN; MAX_LEN iff 2 * sum >= max * num_dp_ranks; else SUM_LEN.
DpPaddingMode choose_padding_mode(std::span<const int64_t> num_tokens_per_dp_rank,
                                  const PaddingModeOptions& options = {});

// Where every DP rank's tokens sit in the global buffer [buffer_len, hidden].
struct DpGatherPlan {
  DpPaddingMode mode = DpPaddingMode::kMaxLen;
  int64_t buffer_len = 0;           // rows of the global buffer
  int64_t slot_len = 0;             // MAX_LEN: rows per DP rank (max count, rounded up to attn_tp); SUM_LEN: 0
  std::vector<int64_t> num_tokens;  // [num_dp_ranks] rows each DP rank contributes
  std::vector<int64_t> offsets;     // [num_dp_ranks] first row of each DP rank's tokens
};

// MAX_LEN: slot_len = max count rounded up to a multiple of attn_tp_size (the NCCL path splits a slot
// over the attention-TP ranks), offsets[d] = d * slot_len, buffer_len = slot_len * num_dp_ranks.
// SUM_LEN: offsets are the exclusive prefix sums, buffer_len = the sum. Rows not covered by any DP
// rank (MAX_LEN padding) are zero after a gather. Throws kInvalidArgument for negative counts, not 1 to
// 1024 DP ranks, attn_tp_size outside [1, 1024] or a buffer over 2^40 rows.
DpGatherPlan plan_dp_gather(std::span<const int64_t> num_tokens_per_dp_rank, DpPaddingMode mode, int attn_tp_size = 1);

// ---- gather / scatter (collective over the whole group) ----------------------------------------------
// Tensors: bf16, fp32, int32 or int64 (input ids, positions), contiguous, on group.device(); either
// [rows, hidden] or 1-D [rows] (one element per row, as [rows, 1]); local and global of the same dtype and
// rank; the same dtype and hidden size on every rank. Both backends take the four dtypes (cuda: ncclBfloat16,
// ncclFloat32, ncclInt32, ncclInt64); any other dtype is kInvalidArgument naming it and the four.
// `local` may have more rows than the rank's count (CUDA-graph padding); only the first count rows are
// read, and scatter zeroes the rest. An idle DP rank (count 0) still calls, with local [>= 0, hidden].
// Streams: the cuda backend enqueues NCCL collectives on `stream` (no host sync; the first call on a
// group creates the group's DP communicator, collectively, and blocks until it exists; one GPU per
// rank); the host backend ignores `stream` and returns when done.
// Preconditions: layout.world_size() == group.num_ranks(), plan.num_tokens.size() == attn_dp_size,
// the same plan on every rank (the host backend checks and throws kInvalidArgument on every rank; the
// cuda backend does not check: a mismatch gives NCCL calls of different sizes, which is undefined).
// Arguments rejected on one rank only (a wrong dtype, too few local rows, a plan for another layout): that rank
// raises kInvalidArgument naming the argument, but first still takes part in the call's collective, so no
// collective gets out of step and the next call works on every rank (docs/reliability.md, "Invalid arguments of
// dp_gather / dp_scatter on one rank"). Host backend: it takes part with an error flag, and every peer raises
// kPeerFailure naming it in the same call. Cuda backend (no host round trip per call): when layout, plan, global and
// source / kind pass the checks it enqueues the same NCCL collective(s) with zero rows of its own (gather) or its
// rows of global and nothing received (kReduceScatter); the peers are not told and their outputs of that call lack
// its rows (gather). Otherwise it cannot know the peers' collective and marks the group's DP communicator failed on
// this rank: its later DP calls raise kPeerFailure; recreate the group on every rank. kSlice has no collective.
//
// Attention context parallelism (attn_cp_size > 1; SGLang's dp_attention.py `_dp_gather` / `dp_scatter` with
// `cp_shard_counts`). Without cp_shard_counts the CP ranks of a DP rank hold the same rows and CP rank 0's are
// gathered (its leader's, or for kPartialSums the sum over CP rank 0's attention-TP ranks). With cp_shard_counts
// ([attn_cp_size], this rank's DP rank's, e.g. ZigzagSplit::num_tokens or InterleaveSplit::num_tokens; >= 0,
// summing to plan.num_tokens of the DP rank; the same on every rank of the DP rank) each CP rank holds a different
// shard of the DP rank's tokens: its first cp_shard_counts[c] local rows land at offsets[d] + cp_shard_counts[0] +
// ... + cp_shard_counts[c - 1], the shards back to back in CP rank order (rows past a shard's count, e.g. its
// padding to padded_rank_len, are skipped); local then needs >= cp_shard_counts[attn_cp_rank] rows. DP ranks may differ
// in whether they pass shards (one may run a split extend batch, another a decode batch). With attn_cp_size > 1 both
// padding modes run as the SUM_LEN all-reduce (SGLang: "an all-gather takes a block from every rank of the TP group, CP
// ranks included"), so MAX_LEN rows are 0 + x too (-0 reads back as +0); the buffer layout is the plan's either way.

// global [plan.buffer_len, hidden] (or [plan.buffer_len]) on every rank receives every DP rank's first num_tokens[d]
// rows of its leader's `local` at offsets[d]; all other rows are zero. SUM_LEN rows are 0 + x in the dtype (an
// all-reduce in which only the leader contributes non-zero rows): bit-exact except that -0 reads back as
// +0 and a signaling NaN is quieted (cuda: a NaN stays NaN, its payload may change); integers are exact.
// MAX_LEN rows are
// copied bit-exactly; with attn_tp_size > 1 the cuda backend takes slot row i from attention-TP rank
// i / (slot_len / attn_tp_size), the same row as the leader's since those ranks hold the same batch.
// `local` and `global` must not overlap.
//
// source kPartialSums (attention-TP partial sums, e.g. a row-parallel o_proj before its all-reduce): every rank of a
// DP rank's attention-TP group holds a partial sum of the same rows, and global receives their sum: the TP
// reduction and the DP gather in one collective, with either padding mode (MAX_LEN: the sums land in the padded
// slots, the padding is zero; the cuda backend all-reduces the padded buffer, where SGLang reduce-scatters inside
// attention TP and then all-gathers: the same rows, about twice the bytes). Floats summed in fp32 in attention-TP rank
// order, then rounded once (host); the cuda backend sums in NCCL's order and may round bf16 partial sums with more than
// 2 ranks; integers sum exactly (wrapping).
enum class DpGatherSource : uint8_t {
  kLeader,       // the DP rank's rows as its leader holds them (every attention-TP rank holds the same batch)
  kPartialSums,  // the sum over the DP rank's attention-TP ranks
};
void dp_gather(Group& group, const ParallelLayout& layout, const DpGatherPlan& plan, const TensorView& local,
               const TensorView& global, Stream stream = nullptr, DpGatherSource source = DpGatherSource::kLeader,
               std::span<const int64_t> cp_shard_counts = {});

enum class DpScatterKind : uint8_t {
  kSlice,          // every rank holds the same global buffer: local = its DP rank's rows (no communication)
  kReduceScatter,  // each rank holds a partial global buffer: local = the sum over all ranks of those rows
};

// local [>= num_tokens[my DP rank], hidden] receives the rows [offsets[d], offsets[d] + num_tokens[d]) of
// `global` [plan.buffer_len, hidden] (kSlice) or of the sum of every rank's `global` (kReduceScatter,
// floats summed in fp32 in rank order, then rounded once to the dtype; the cuda backend sums in NCCL's order
// and may round bf16 partial sums with more than 2 ranks; int32/int64 summed exactly in their own width,
// wrapping modulo 2^32 / 2^64 on overflow, which is order-independent, so both backends agree bit-exactly).
// 1-D tensors as for dp_gather. Rows past the count are zeroed.
// attn_cp_size > 1: every CP rank of a DP rank receives the DP rank's rows (kReduceScatter: as SGLang's
// dp_reduce_scatter_tensor, which gives every CP rank the full DP slot). kSlice with cp_shard_counts (as for
// dp_gather) takes back only this CP rank's shard: local[0, cp_shard_counts[c]) = global rows
// [offsets[d] + prefix(c), + cp_shard_counts[c]), the rest of local zero (SGLang's dp_scatter). kReduceScatter
// takes no shards (kInvalidArgument; SGLang's reduce-scatter has no shard form): pick the shard's rows out of the
// DP rank's rows with zigzag_local_rows or interleave_local_rows.
void dp_scatter(Group& group, const ParallelLayout& layout, const DpGatherPlan& plan, const TensorView& global,
                const TensorView& local, DpScatterKind kind = DpScatterKind::kSlice, Stream stream = nullptr,
                std::span<const int64_t> cp_shard_counts = {});

// What a rank that cannot make its dp_gather / dp_scatter call at all (a binding that could not convert an argument)
// knows of the call: null, undefined or empty where unknown.
struct DpFailedCall {
  const ParallelLayout* layout = nullptr;
  const DpGatherPlan* plan = nullptr;
  TensorView global;  // [plan.buffer_len, hidden] or [plan.buffer_len]
  Stream stream = nullptr;
  std::optional<DpGatherSource> source;  // dp_gather_fail
  std::optional<DpScatterKind> kind;     // dp_scatter_fail
};
// Instead of dp_gather / dp_scatter: this rank takes part in the call its peers make as it does for arguments those
// reject (see "Arguments rejected on one rank only" above); the host backend's peers raise kPeerFailure naming this
// rank and `reason`. The cuda backend joins the peers' collective only if `call` names a valid layout, plan, global
// and source (gather) or kind (scatter), else it marks the group's DP communicator failed on this rank. A scatter
// whose kind is unknown or invalid joins nothing on any backend (the peers' kSlice has no collective, their
// kReduceScatter has one: they wait out the timeout). Never throws; the caller raises its own error afterwards.
void dp_gather_fail(Group& group, const std::string& reason, const DpFailedCall& call = {}) noexcept;
void dp_scatter_fail(Group& group, const std::string& reason, const DpFailedCall& call = {}) noexcept;

// ---- attention context parallelism: SGLang's zigzag split ------------------------------------------
// SGLang (python/sglang/srt/layers/cp/zigzag.py, ZigzagCPStrategy) cuts every sequence of a prefill batch into
// 2 * cp blocks; CP rank c holds block c and block 2 * cp - 1 - c of each sequence, so the causal-attention work
// (which grows with the position) is balanced: early and late blocks pair up. Host-only, no allocation beyond
// the returned vectors; throws Error(kInvalidArgument) naming the argument.

// Whether SGLang splits the batch (ZigzagCPStrategy.can_apply): cp_size > 1, mode EXTEND or MIXED (SGLang's
// ForwardMode.is_context_parallel_extend), num_tokens >= 2 * cp_size and every extend length >= 2 * cp_size.
// When false every CP rank of the DP rank holds the whole batch (no shards). extend_seq_lens: each >= 0;
// num_tokens >= 0; cp_size in [1, 1024].
bool can_zigzag_split(std::span<const int64_t> extend_seq_lens, int cp_size, ForwardMode mode, int64_t num_tokens);

struct ZigzagSplit {
  int cp_size = 1;
  // [num_seqs] the extend lengths as split: rows past their sum (num_tokens - sum, e.g. CUDA-graph padding) are
  // added to the last sequence, as SGLang's build_metadata does.
  std::vector<int64_t> seq_lens;
  std::vector<int64_t> seq_offsets;  // [num_seqs] first batch row of each sequence (exclusive prefix sums)
  // [num_seqs * 2 * cp_size] block b of sequence s at s * 2 * cp_size + b: length L = q * 2cp + r gives the first r
  // blocks q + 1 rows and the others q (SGLang: base + 1 if block_id < rem else base).
  std::vector<int64_t> block_lens;
  std::vector<int64_t> num_tokens;  // [cp_size] rows CP rank c holds: sum over sequences of blocks c and 2cp-1-c
  int64_t max_rank_len = 0;         // max of num_tokens
  int64_t padded_rank_len = 0;      // max_rank_len rounded up to a multiple of 2 * cp_size (SGLang's
                                    // pad_logical_token_to_physical: each rank's rows padded to it for CP collectives)
};
// num_tokens: the batch's rows, >= the sum of extend_seq_lens (-1: the sum). extend_seq_lens: 1 to 2^24 sequences,
// each >= 0, the total at most 2^40.
ZigzagSplit plan_zigzag_split(std::span<const int64_t> extend_seq_lens, int cp_size, int64_t num_tokens = -1);
// [split.num_tokens[cp_rank]] the batch row of each of CP rank cp_rank's rows, in SGLang's local order: block
// cp_rank of every sequence (in batch order), then block 2 * cp - 1 - cp_rank of every sequence.
std::vector<int64_t> zigzag_local_rows(const ZigzagSplit& split, int cp_rank);
// [total rows] for batch row i, its row once the CP ranks' rows lie back to back in CP rank order (each
// num_tokens[c] rows, no padding): SGLang's all-gather + cp_reverse_index inverse, and where dp_gather with
// cp_shard_counts = split.num_tokens puts it relative to the DP rank's offset. So batch row i of DP rank d is
// global row plan.offsets[d] + zigzag_gathered_rows(split)[i].
std::vector<int64_t> zigzag_gathered_rows(const ZigzagSplit& split);

// ---- attention context parallelism: SGLang's interleave split --------------------------------------
// SGLang (python/sglang/srt/layers/cp/interleave.py, InterleaveCPStrategy) deals the batch's rows out round-robin,
// ignoring sequence boundaries: batch row i goes to CP rank i % cp as its local row i / cp. Every rank so holds about
// 1 / cp of every stretch of positions, which balances the causal work without blocks. The shards are used with
// dp_gather / dp_scatter exactly as the zigzag ones (cp_shard_counts = InterleaveSplit::num_tokens; batch row i of DP
// rank d is then global row plan.offsets[d] + interleave_gathered_rows(split)[i]). Host-only, no allocation beyond
// the returned vectors; throws Error(kInvalidArgument) naming the argument.

// SGLang's --cp-strategy (ContextParallelStrategyKind): which split the attention-CP ranks use.
enum class CpStrategy : uint8_t {
  kZigzag,      // "zigzag": 2 * cp blocks per sequence, rank c holds blocks c and 2cp - 1 - c (plan_zigzag_split)
  kInterleave,  // "interleave": batch row i on rank i % cp (plan_interleave_split)
};
const char* to_string(CpStrategy strategy) noexcept;  // "zigzag" / "interleave"
// SGLang's ContextParallelStrategyKind.from_string: exactly "zigzag" or "interleave"; anything else throws
// kInvalidArgument naming cp_strategy, the value and the two names.
CpStrategy parse_cp_strategy(std::string_view cp_strategy);

// Whether SGLang shards the batch (InterleaveCPStrategy.can_apply): cp_size > 1, mode EXTEND or MIXED (as for
// can_zigzag_split) and num_tokens >= cp_size. The sequence lengths do not matter: a sequence shorter than cp is
// spread over fewer ranks. When false every CP rank of the DP rank holds the whole batch. num_tokens >= 0; cp_size in
// [1, 1024].
bool can_interleave_split(int cp_size, ForwardMode mode, int64_t num_tokens);
// The rule of `strategy`: can_zigzag_split, or can_interleave_split (extend_seq_lens checked as there, then unused).
bool can_cp_split(CpStrategy strategy, std::span<const int64_t> extend_seq_lens, int cp_size, ForwardMode mode,
                  int64_t num_tokens);

struct InterleaveSplit {
  int cp_size = 1;
  std::vector<int64_t> seq_lens;      // [num_seqs] the extend lengths; padding rows belong to no sequence
  std::vector<int64_t> seq_offsets;   // [num_seqs] first batch row of each sequence (exclusive prefix sums)
  int64_t num_batch_tokens = 0;       // rows dealt out, padding included (SGLang's num_tokens / total_padded_tokens)
  int64_t num_real_batch_tokens = 0;  // sum of seq_lens (SGLang's total_seq_lens); rows from here on are padding
  // [cp_size] rows CP rank c holds: batch rows c, c + cp, ... below num_batch_tokens, i.e.
  // ceil((num_batch_tokens - c) / cp) (SGLang's per_rank_actual_token). These are the cp_shard_counts.
  std::vector<int64_t> num_tokens;
  // [cp_size] how many of them are real rows (below num_real_batch_tokens; SGLang's per_rank_real_token). Local rows
  // ascend, so they are the first num_real_tokens[c] local rows.
  std::vector<int64_t> num_real_tokens;
  int64_t max_rank_len = 0;     // max of num_tokens = ceil(num_batch_tokens / cp)
  int64_t padded_rank_len = 0;  // max_rank_len rounded up to a multiple of cp_size (SGLang's
                                // pad_logical_token_to_physical, whose alignment is cp for interleave)
};
// SGLang's InterleaveCPStrategy.build_metadata. num_tokens: the batch's rows, >= the sum of extend_seq_lens (-1: the
// sum); the rows past the sum are padding, dealt out like the others. extend_seq_lens: 1 to 2^24 sequences, each >= 0,
// the total at most 2^40 (SGLang, given no lengths, takes one sequence of num_tokens rows: pass {num_tokens}).
InterleaveSplit plan_interleave_split(std::span<const int64_t> extend_seq_lens, int cp_size, int64_t num_tokens = -1);
// [split.num_tokens[cp_rank]] the batch row of each of CP rank cp_rank's rows, ascending: cp_rank, cp_rank + cp, ...
// (SGLang's local_token_indices, what shard_hidden_states / shard_position_ids select).
std::vector<int64_t> interleave_local_rows(const InterleaveSplit& split, int cp_rank);
// [num_batch_tokens] for batch row i, its row once the CP ranks' rows lie back to back in CP rank order (each
// num_tokens[c] rows, no padding to padded_rank_len): num_tokens[0] + ... + num_tokens[i % cp - 1] + i / cp. This is
// SGLang's restore_indices (the argsort of the rank-major row list; gather_hidden_states selects it after the
// all-gather) and where dp_gather with cp_shard_counts = split.num_tokens puts the row relative to the DP rank's
// offset. real_rows_only: [num_real_batch_tokens], the same for the real rows when each rank contributes its first
// num_real_tokens[c] rows (SGLang's restore_real_indices, used by gather_kv_cache).
std::vector<int64_t> interleave_gathered_rows(const InterleaveSplit& split, bool real_rows_only = false);

// The attention metadata of CP rank cp_rank's real rows (SGLang's query_request_indices / query_cache_lengths): one
// query per real local row, in local order, each a causal query of its own sequence. SGLang's attention runs on these
// num_real_tokens[cp_rank] rows only and gives the rank's padding rows zero output.
struct InterleaveQueries {
  std::vector<int64_t> seq_idx;  // [num_real_tokens[cp_rank]] the sequence of each real local row
  // [num_real_tokens[cp_rank]] the KV length it attends to: prefix_lens[s] + (row - seq_offsets[s]) + 1
  std::vector<int64_t> kv_lens;
};
// prefix_lens: [num_seqs] the cached prefix of each sequence (SGLang: seq_len - extend_len, floored at 0), each in
// [0, 2^40]; empty: all 0 (SGLang when it has no full lengths).
InterleaveQueries interleave_local_queries(const InterleaveSplit& split, int cp_rank,
                                           std::span<const int64_t> prefix_lens = {});

// ---- batch-metadata sync ---------------------------------------------------------------------------

// ForwardMode (IDLE, EXTEND, DECODE, MIXED, TARGET_VERIFY, DRAFT_EXTEND, PREBUILT): epx/forward_mode.h.

// One DP rank's record for a step: 11 fields, exchanged as 11 int64 (88 bytes) per rank.
struct BatchMetadata {
  int64_t num_tokens = 0;
  int64_t num_tokens_for_logprob = 0;
  bool can_run_decode_graph = true;
  bool is_extend_in_batch = false;
  bool can_run_tbo = true;
  ForwardMode forward_mode = ForwardMode::kIdle;
  bool can_run_prefill_graph = true;
  int64_t prefill_graph_max_prefix_len = 0;
  bool can_run_draft_graph = true;
  bool is_health_check = false;
  int64_t attention_pairs = 0;

  // The record of a rank with no batch (SGLang's fallback record): IDLE, 0 tokens, decode-graph, draft-graph
  // and TBO votes 1, prefill-graph vote 0, so one idle DP rank turns the prefill graph off for the step.
  static BatchMetadata idle() {
    BatchMetadata m;
    m.can_run_prefill_graph = false;
    return m;
  }
  // The record of a rank whose batch is PREBUILT (disaggregated decode: the KV cache came from the prefill
  // side and no forward pass runs for it this step): the fallback record's fields with forward_mode
  // PREBUILT. As SGLang: 0 tokens, decode-graph vote 1, not extend, TBO vote 1 (its TBO split is {0, 0}).
  static BatchMetadata prebuilt() {
    BatchMetadata m = idle();
    m.forward_mode = ForwardMode::kPrebuilt;
    return m;
  }
};
inline constexpr int kBatchMetadataFields = 11;

// The agreed view of one step, identical on every rank.
struct GlobalBatchInfo {
  std::vector<int64_t> num_tokens;              // [num_dp_ranks]
  std::vector<int64_t> num_tokens_for_logprob;  // [num_dp_ranks]
  std::vector<int64_t> attention_pairs;         // [num_dp_ranks]
  bool can_run_decode_graph = true;             // min over DP ranks (one rank vetoes)
  bool can_run_prefill_graph = true;            // min
  bool can_run_draft_graph = true;              // min
  bool is_extend_in_batch = false;              // max
  bool is_health_check = false;                 // max
  int64_t prefill_graph_max_prefix_len = 0;     // max
  // The common forward mode of the non-idle DP ranks; kIdle when every rank is idle; nullopt when the
  // non-idle ranks disagree. PREBUILT counts as a mode of its own (not idle): PREBUILT beside DECODE
  // disagrees, as in SGLang, so TBO is off for that step.
  std::optional<ForwardMode> forward_mode;
  // min of the votes, and the non-idle ranks agree on a mode, and some rank is not idle.
  bool can_run_tbo = false;
  // True when some DP rank has tokens: every rank runs a batch this step (an idle one if it has none).
  bool any_tokens = false;
};

// The local result of one sync.
struct BatchSyncResult {
  GlobalBatchInfo global;
  // This rank runs no forward pass of its own (no batch, an IDLE record, or a PREBUILT batch) but must run an
  // idle one because some DP rank has tokens (global.any_tokens). A PREBUILT rank runs it beside its batch
  // (SGLang's inner_idle_batch).
  bool run_idle_batch = false;
  bool runs_batch = false;   // this rank runs a batch (its own or an idle one)
  double step_wait_s = 0.0;  // seconds this sync waited for the slowest rank
  // Waiting time attributed to this step: this sync's wait plus the waits of earlier syncs in which this
  // rank ran no batch (carried forward). 0 when this rank runs no batch (the wait is carried instead).
  double wait_s = 0.0;
};

// Per-rank, stateful (carries waiting time between steps). One all-gather of the records per step over
// the whole group; records of non-leader ranks are ignored. Skipped (no communication) when
// attn_dp_size == 1. Not thread-safe; one object per rank.
class BatchMetadataSync {
 public:
  // Throws kInvalidArgument unless layout.world_size() == group.num_ranks(). Keeps a reference to group.
  BatchMetadataSync(Group& group, const ParallelLayout& layout);

  // local: this rank's record, or nullopt for a rank with no batch (the fallback record is sent).
  // Throws kInvalidArgument for a bad record (negative counts, an IDLE or PREBUILT record with tokens) on this rank
  // before communicating; kTimeout from the group.
  BatchSyncResult sync(const std::optional<BatchMetadata>& local);
  // The same with the ranks in `inactive_ranks` (group ranks, dead or absent this step, e.g. after a
  // failure was detected) left out, as SGLang's MLPSyncBatchInfo.all_gather does with its active-ranks mask:
  // each DP rank whose leader is listed counts as the fallback record BatchMetadata::idle(), instead of the
  // step failing. Listed ranks do not call this sync and are not waited for (host backend: the group's
  // collective skips them, with the usual bounded wait on the others; no new wait). Every calling rank passes
  // the same list (host: a mismatch raises kInvalidArgument on the ranks that see it; a rank waiting for a
  // rank others left out raises kTimeout). A listed rank misses this collective, so it stays out of the
  // group's later collectives too (host: its collective numbering is behind), as a dead rank does.
  // Throws kInvalidArgument for a rank outside [0, num_ranks) or this rank itself in the list; kUnsupported
  // for a non-empty list on the cuda backend (an NCCL all-gather needs every rank). An empty list is sync(local).
  BatchSyncResult sync(const std::optional<BatchMetadata>& local, std::span<const int> inactive_ranks);
  // Instead of sync(): this rank cannot make this step's sync (e.g. the Python binding could not convert its
  // arguments), but keeps the group in step. Host backend with attn_dp_size > 1: takes part in the collective
  // with an error flag, so every peer's sync raises Error(kPeerFailure) naming this rank and `reason` at once;
  // it waits (bounded by the group's timeout) until every peer outside `inactive_ranks` has seen the flag, so
  // pass the step's list when it is known (entries outside [0, num_ranks) and this rank are ignored). Cuda
  // backend: takes part in the all-gather with an idle record whose status word flags the failure, so every peer's
  // sync raises Error(kPeerFailure) naming this rank (without `reason`: the record has no room for text); with
  // attn_dp_size 1 there is no collective and nothing is done. Never throws; the caller raises its own error.
  // Cuda backend, also: a rank's dp_gather / dp_scatter calls that were rejected on it and joined their peers'
  // collective (the peers' outputs lack its rows, see dp_gather) are counted, and the group's next sync carries the
  // count in its record: every peer's sync raises kPeerFailure naming it.
  void fail(const std::string& reason, std::span<const int> inactive_ranks = {}) noexcept;

  double carried_wait_s() const { return carried_wait_s_; }

 private:
  Group& group_;
  ParallelLayout layout_;
  double carried_wait_s_ = 0.0;
};

// Reductions alone (used by sync; exposed for tests and callers with their own transport).
// records: one per DP rank. Throws kInvalidArgument for an empty list.
GlobalBatchInfo reduce_batch_metadata(std::span<const BatchMetadata> records);

}  // namespace epx
