// Two-batch overlap (TBO): a batch is split into two micro-batches ("children" A and B) whose
// operations interleave, so one child's communication hides under the other's compute.
//
// Three pieces, all host-side and independent of any backend:
//   1. where to split (compute_tbo_split): a sequence index and a token index;
//   2. the children's per-sequence fields (split_tbo_children);
//   3. the stage executor (execute_two_batch_overlap): two operation lists cut at yield points into
//      stages, run A-ahead-by-delta, then alternately, then B's tail;
//   4. strategy presets (make_tbo_strategy): SGLang's DeepSeek prefill and decode operation lists.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "epx/dp.h"

namespace epx {

// ---- split rules ------------------------------------------------------------------------------------

inline constexpr double kDefaultTboThreshold = 0.48;

struct TboSplit {
  int64_t split_seq_index = 0;    // child A holds sequences [0, split_seq_index) (and the cut one if two_chunk)
  int64_t split_token_index = 0;  // child A holds tokens [0, split_token_index)
  bool two_chunk = false;         // sequence split_seq_index is cut in two at split_token_index
};

// Extend (prefill) batch, extend_lens[i] >= 0 tokens of sequence i (at least one sequence).
// 1. Balanced split: scan the sequence boundaries 1, 2, ... while |left - right| does not grow (ties move
//    right); the last boundary kept is the split, 0 when there is one sequence.
// 2. If its left part is < threshold * total or > (1 - threshold) * total, cut one sequence ("two-chunk"):
//    split_seq_index = the first sequence whose running sum exceeds total / 2 (integer division),
//    split_token_index = total / 2 — unless child A would then hold more sequences (split_seq_index + 1)
//    than tokens (total / 2), in which case the balanced split stands.
// threshold in [0, 0.5] (0 disables two-chunk). Throws kInvalidArgument naming the bad length or threshold.
TboSplit compute_tbo_split_extend(std::span<const int64_t> extend_lens, double threshold = kDefaultTboThreshold);

// Decode / target-verify batch: num_tokens = num_seqs * tokens_per_seq. Splits at num_seqs / 2 sequences.
// Throws kInvalidArgument for num_tokens < 0, tokens_per_seq < 1, or num_tokens not a multiple of it.
TboSplit compute_tbo_split_decode(int64_t num_tokens, int64_t tokens_per_seq);

// By forward mode: EXTEND and MIXED (chunked prefill + decode, as SGLang) -> the extend rule (num_tokens must
// equal the sum of extend_lens); DECODE / TARGET_VERIFY -> the decode rule (tokens_per_seq); IDLE and PREBUILT
// -> {0, 0} (num_tokens must be 0). DRAFT_EXTEND cannot be split: nullopt (TBO off).
std::optional<TboSplit> compute_tbo_split(ForwardMode mode, int64_t num_tokens, std::span<const int64_t> extend_lens,
                                          int64_t tokens_per_seq, double threshold = kDefaultTboThreshold);

// ---- child batches ----------------------------------------------------------------------------------

// Per-sequence fields of a batch: seq_lens[i] = prefix_lens[i] + extend_lens[i].
struct TboSeqFields {
  std::vector<int64_t> extend_lens;  // new tokens of each sequence in this batch
  std::vector<int64_t> prefix_lens;  // tokens already in the KV cache before this batch
  std::vector<int64_t> seq_lens;     // total length after this batch

  int64_t num_seqs() const { return static_cast<int64_t>(extend_lens.size()); }
};

struct TboChildren {
  TboSeqFields a;
  TboSeqFields b;
  int64_t num_tokens_a = 0;
  int64_t num_tokens_b = 0;
  int64_t seq_begin_b = 0;  // parent index of B's first sequence (the cut sequence when two_chunk)
};

// Without two_chunk, A = sequences [0, split_seq_index), B = the rest; split_token_index must equal
// sum(extend_lens[0, split_seq_index)). With two_chunk, sequence s = split_seq_index is cut: A gets its
// first k = split_token_index - sum(extend_lens[0, s)) tokens (extend k, prefix unchanged, seq_len
// prefix + k); B starts with its remaining extend_lens[s] - k tokens with prefix_len grown by k and the
// parent's seq_len. Throws kInvalidArgument when the fields are inconsistent (sizes, negative lengths,
// seq_len != prefix + extend) or the split does not fit the batch.
TboChildren split_tbo_children(const TboSeqFields& parent, const TboSplit& split);

// ---- stage executor ---------------------------------------------------------------------------------

// One step of a micro-batch's forward pass, or a yield point (no function) that ends a stage.
// The function receives the micro-batch index (0 = A, 1 = B), so one list can serve both children.
struct TboOperation {
  std::string name;
  std::function<void(int batch_idx)> fn;

  static TboOperation yield_point() { return {"yield", nullptr}; }
  bool is_yield() const { return !fn; }
};

// Cuts a list at its yield points into stages. A trailing yield adds no empty stage; consecutive
// yields give an empty stage.
std::vector<std::vector<TboOperation>> split_tbo_stages(const std::vector<TboOperation>& ops);

// Runs stages of A and B on the calling thread: A's first `delta_stages` stages, then (A stage i +
// delta, B stage i) alternately, then B's last `delta_stages` stages. Both lists must have the same
// number of stages S, and 0 <= delta_stages <= S (kInvalidArgument otherwise, before running anything).
// An exception from an operation propagates at once; later operations do not run.
void execute_two_batch_overlap(const std::vector<TboOperation>& ops_a, const std::vector<TboOperation>& ops_b,
                               int delta_stages);

// ---- strategy presets -------------------------------------------------------------------------------
// SGLang's operation lists for a DeepSeek MoE layer (operations_strategy.py, "deepseek blog" strategies),
// runnable by the executor above. Both children run the same list; child B trails by delta_stages.

// The operations of one MoE decoder layer, in SGLang's names. The "_a" / "_b" halves of dispatch and
// combine are the send (launch) and receive (wait) of the all-to-all; a yield between them lets the other
// child compute while the data is in flight.
enum class TboLayerOp : uint8_t {
  kCommPrepareAttn,       // layer communicator before attention (norm, DP gather/scatter as the layer needs)
  kAttnPrepare,           // attention before the kernel: projections, rotary, KV-cache write
  kAttnCore,              // the attention kernel and output projection
  kCommPrepareMlp,        // layer communicator before the MoE (residual, norm)
  kGate,                  // router logits
  kSelectExperts,         // top-k expert choice
  kDispatchA,             // dispatch: launch
  kDispatchB,             // dispatch: wait for the received tokens
  kExperts,               // routed experts' GEMMs
  kCombineA,              // combine: launch
  kCombineB,              // combine: wait
  kSharedExperts,         // the shared expert
  kOutput,                // routed + shared output
  kCommPostprocessLayer,  // layer communicator after the MoE
};
const char* to_string(TboLayerOp op) noexcept;  // "comm_prepare_attn", "attn_prepare", ..., "comm_postprocess_layer"

enum class TboPreset : uint8_t {
  // delta 0, 3 stages per layer:
  //   comm_prepare_attn attn_prepare attn_core comm_prepare_mlp gate select_experts dispatch_a | dispatch_b
  //   experts combine_a | shared_experts combine_b output comm_postprocess_layer
  kDeepSeekPrefill,
  // delta 2, 6 stages per layer:
  //   comm_prepare_attn attn_prepare | attn_core comm_prepare_mlp gate select_experts | dispatch_a
  //   shared_experts | dispatch_b experts combine_a | combine_b | output comm_postprocess_layer
  kDeepSeekDecode,
};
const char* to_string(TboPreset preset) noexcept;  // "deepseek-prefill", "deepseek-decode"

// One layer's list as written above; nullopt marks a yield point. Throws kInvalidArgument for a bad preset.
std::vector<std::optional<TboLayerOp>> tbo_preset_layer_ops(TboPreset preset);
// 0 for kDeepSeekPrefill, 2 for kDeepSeekDecode. Throws kInvalidArgument for a bad preset.
int tbo_preset_delta_stages(TboPreset preset);

// The preset for the step's agreed forward mode (GlobalBatchInfo::forward_mode): EXTEND, MIXED -> prefill;
// DECODE, TARGET_VERIFY, PREBUILT -> decode; IDLE, DRAFT_EXTEND -> nullopt (no TBO).
std::optional<TboPreset> tbo_preset_for(ForwardMode global_mode) noexcept;

inline constexpr int kMaxTboLayers = 4096;

struct TboStrategy {
  std::vector<TboOperation> operations;  // run by both children: execute_two_batch_overlap(ops, ops, delta)
  int delta_stages = 0;
  // True for the prefill preset: SGLang runs its GEMMs on the SMs the communication kernels leave
  // (deep_gemm_num_sms = SMs - the EP buffer's num_sms); the decode preset leaves the GEMMs unrestricted.
  bool reserve_comm_sms = false;
};

using TboLayerOpFn = std::function<void(TboLayerOp op, int layer_idx, int batch_idx)>;

// The preset's layer list repeated for layers 0 .. num_layers - 1 and concatenated without a yield between
// layers (SGLang's OperationsStrategy.concat), so a layer's last stage and the next layer's first stage run
// as one stage: kDeepSeekPrefill has 2 * num_layers + 1 stages, kDeepSeekDecode 5 * num_layers + 1.
// Operation names are "L<layer>.<op>", e.g. "L0.dispatch_a"; each calls fn(op, layer, batch_idx).
// Throws kInvalidArgument for a bad preset, num_layers outside [1, kMaxTboLayers] or an empty fn.
TboStrategy make_tbo_strategy(TboPreset preset, int num_layers, const TboLayerOpFn& fn);

}  // namespace epx
