// The per-call shape word of the flat normal path (plain C++: encoded and described on the host, compared as a
// whole on the device). Every rank of a normal dispatch or combine must pass arguments of the same kinds: the
// ring rows and the copy-engine staging are laid out from them on the sending side and read with the receiver's
// own layout. The host backend checks this in its rendezvous; the cuda path has no per-call host meeting, so each
// operation writes its shape word beside its handle id into the peers' signal area (advance_epoch_kernel), and
// notify and the receivers compare it with their own (docs/reliability.md, "Per-call shapes").
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "epx/tensor.h"

namespace epx::ep {

enum class NormalCallKind : uint8_t { kFreshDispatch = 1, kCachedDispatch = 2, kCombine = 3 };
// The word's lowest bits hold the kind (the kernels read it: a fresh dispatch's notify waits for its peers' notify).
inline constexpr uint64_t kCallKindMask = 3;

struct NormalCallShape {
  NormalCallKind kind = NormalCallKind::kFreshDispatch;
  DType x_dtype = DType::kBFloat16;
  int64_t hidden = 0;                 // x.shape[1]
  std::optional<DType> scales_dtype;  // dispatch: x_scales given
  int64_t scale_columns = 0;          // dispatch: x_scales.shape[1]
  int num_topk = 0;                   // fresh dispatch: topk_idx.shape[1]; combine: topk_weights.shape[1]
  bool topk_int64 = false;            // fresh dispatch: topk_idx is int64
  bool has_weights = false;           // topk_weights given (fresh dispatch, combine)
  int64_t num_experts = 0;            // fresh dispatch
  bool fixed_rows = false;            // dispatch: num_worst_tokens > 0 (no host synchronization)
  bool captured = false;              // the stream is being captured (the SM path only)
};

// Fields are packed into one word; values above a field's width saturate, so only shapes that differ beyond
// those bounds (hidden, scale columns or num_experts of 2^17, 2^14 or 2^14 and more; top-k widths of 32 and more) can
// compare equal.
uint64_t encode_call_shape(const NormalCallShape& shape);
// "fresh dispatch: x fp8_e4m3 [*, 7168], x_scales fp32 [*, 56], topk_idx int64 [*, 8], topk_weights [*, 8], 256
// experts, num_worst_tokens > 0", from a word encode_call_shape made.
std::string describe_call_shape(uint64_t word);

}  // namespace epx::ep
