// The kind of batch a step runs (SGLang's ForwardMode) and the expert-parallel dispatch mode chosen from it
// (SGLang's --deepep-mode normal | low_latency | auto). Host-only, no allocation, nothing throws.
#pragma once

#include <cstdint>

namespace epx {

// NOTE: the values are the wire format of the batch-metadata record (BatchMetadata, epx/dp.h): new modes are
// appended, never renumbered.
enum class ForwardMode : uint8_t {
  kIdle,          // no sequence: a DP rank with no batch that still takes part in the step's collectives
  kExtend,        // prefill: new tokens of each sequence after a cached prefix
  kDecode,        // one new token per sequence
  kMixed,         // chunked prefill and decode sequences in one batch
  kTargetVerify,  // speculative decoding: the target model verifies draft tokens
  kDraftExtend,   // speculative decoding: the draft model extends
  kPrebuilt,      // prefill/decode disaggregation, decode side: the KV cache arrived from the prefill side;
                  // the step runs no forward pass for this batch (SGLang sends 0 tokens for it)
};
const char* to_string(ForwardMode mode) noexcept;  // "IDLE", "EXTEND", ..., "PREBUILT"

// SGLang's ForwardMode.is_extend(): EXTEND, MIXED, TARGET_VERIFY, DRAFT_EXTEND. Not PREBUILT, IDLE, DECODE.
bool is_extend(ForwardMode mode) noexcept;

// Which dispatch/combine protocol of the EP buffer a step uses (epx::Buffer's normal and low-latency
// paths). kAuto is resolved per step by resolve_deepep_mode.
enum class DeepEPMode : uint8_t {
  kNormal,      // high-throughput protocol (prefill)
  kLowLatency,  // fixed-shape, graph-capturable protocol (decode)
  kAuto,        // normal when some DP rank runs an extend batch, else low-latency
};
const char* to_string(DeepEPMode mode) noexcept;  // "normal", "low_latency", "auto"

// SGLang's DeepEPMode.resolve(is_extend_in_batch): kNormal and kLowLatency resolve to themselves; kAuto to
// kNormal when is_extend_in_batch, else kLowLatency. Under DP attention pass the agreed
// GlobalBatchInfo::is_extend_in_batch (max over the DP ranks): every rank of the EP group must pick the same
// protocol, including idle ranks and ranks whose own batch is a decode batch.
DeepEPMode resolve_deepep_mode(DeepEPMode mode, bool is_extend_in_batch) noexcept;

// The same for a step whose batch mode is known on every rank (one DP rank, or the agreed
// GlobalBatchInfo::forward_mode): is_extend_in_batch = is_extend(step_mode). kAuto gives kNormal for EXTEND,
// MIXED, TARGET_VERIFY, DRAFT_EXTEND and kLowLatency for DECODE, PREBUILT, IDLE.
DeepEPMode resolve_deepep_mode(DeepEPMode mode, ForwardMode step_mode) noexcept;

}  // namespace epx
