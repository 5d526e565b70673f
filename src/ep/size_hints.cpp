// Peer-memory size hints of the normal and low-latency paths (declared in epx/buffer.h). Plain host
// code: the formulas follow the cuda backend's layouts (src/ep/normal_region.h, src/ep/low_latency_layout.h), the host backend ignores them.
#include <cstdint>

#include "core/check.h"
#include "core/limits.h"
#include "ep/low_latency_layout.h"
#include "epx/buffer.h"

namespace epx {
namespace {

int64_t ceil_div(int64_t v, int64_t d) { return v / d + (v % d != 0); }

int64_t align_up(int64_t v, int64_t a, const char* what) { return detail::checked_add(v, a - 1, what) / a * a; }

using detail::checked_add;
using detail::checked_mul;

// An upper bound of LowLatencyLayout::make's total (src/ep/low_latency_layout.cpp), computed with checked
// arithmetic, so that make() itself (plain int64 arithmetic, shared with the kernels' launcher) cannot wrap.
// Each of the 2 sets holds 12 parts, each rounded up to 256 bytes, behind a control block.
void check_low_latency_bytes(int64_t max_tokens_per_rank, int64_t hidden, int64_t num_experts) {
  constexpr const char* kWhat = "low-latency buffer bytes";
  // num_local_experts * num_ranks == num_experts (divisible).
  const int64_t slots = checked_mul(num_experts, max_tokens_per_rank, "num_experts * max_tokens_per_rank");
  const int64_t row_bytes = checked_add(checked_mul(hidden, 2, "hidden * 2"), (hidden / 128) * 4 + 8, kWhat);
  int64_t per_set = checked_mul(
      checked_mul(slots, row_bytes, "num_experts * max_tokens_per_rank * (hidden * 2 + scales) bytes"), 2, kWhat);
  per_set = checked_add(per_set, checked_mul(num_experts, 3 * 8 + 4, kWhat), kWhat);
  const int64_t combine =
      checked_mul(checked_mul(max_tokens_per_rank, kLowLatencyMaxTopk * 2, "max_tokens_per_rank * 32"), hidden,
                  "max_tokens_per_rank * 32 * hidden");
  per_set = checked_add(checked_add(per_set, combine, kWhat), 12 * 256, kWhat);
  checked_add(checked_mul(per_set, 2, kWhat), int64_t{1} << 20, kWhat);
}

}  // namespace

int64_t normal_buffer_size_hint(int64_t hidden, int num_ranks, int num_sms, int64_t max_tokens_per_rank) {
  EPX_CHECK_ARG(hidden >= 1, "hidden must be >= 1, got {}", hidden);
  EPX_CHECK_ARG(num_ranks >= 1, "num_ranks must be >= 1, got {}", num_ranks);
  EPX_CHECK_ARG(num_sms >= 1, "num_sms must be >= 1, got {}", num_sms);
  EPX_CHECK_ARG(max_tokens_per_rank >= 0, "max_tokens_per_rank must be >= 0, got {}", max_tokens_per_rank);
  constexpr const char* kRow = "normal row bytes (hidden * 2 + scales + top-k)";
  const int64_t num_channels = num_sms / 2 > 0 ? num_sms / 2 : 1;
  // The largest row: bf16 data, fp32 scales per 128 channels, top-k ids and weights, source index.
  const int64_t data_bytes = checked_mul(hidden, 2, "hidden * 2");
  const int64_t row_bytes =
      align_up(checked_add(data_bytes, ceil_div(hidden, 128) * 4 + 8 * kNormalMaxTopk + 4, kRow), 16, kRow);
  const int64_t rings = checked_mul(
      checked_mul(int64_t{num_ranks} * num_channels, kNormalHintRingRows, "num_ranks * num_sms / 2 * 256 ring rows"),
      row_bytes, "num_ranks * num_sms / 2 * ring rows * row bytes");
  // Copy-engine staging (stage_fields in src/ep/cuda/copy_engine_host.h, DispatchPlan in src/ep/cuda/normal_plan.h): the
  // ring area, rounded down to KiB, split into one 256-byte aligned slot per peer, each holding the fields of up to T
  // rows in separate 256-byte aligned parts: data, scales, int64 top-k ids, weights, source index (the five
  // alignments and the rounding take at most 3 KiB).
  const int64_t staged_row = checked_add(data_bytes, ceil_div(hidden, 128) * 4 + 12 * kNormalMaxTopk + 4, kRow);
  const int64_t slot = checked_add(checked_mul(max_tokens_per_rank, staged_row, "max_tokens_per_rank * row bytes"),
                                   3072, "max_tokens_per_rank * row bytes");
  const int64_t staging = num_ranks > 1 && max_tokens_per_rank > 0
                              ? checked_mul(num_ranks - 1, slot, "(num_ranks - 1) * max_tokens_per_rank * row bytes")
                              : 0;
  return checked_add(kNormalSignalBytes, rings > staging ? rings : staging, "normal buffer bytes");
}

int64_t low_latency_buffer_size_hint(int64_t max_tokens_per_rank, int64_t hidden, int num_ranks, int64_t num_experts) {
  EPX_CHECK_ARG(max_tokens_per_rank >= 1, "max_tokens_per_rank must be >= 1, got {}", max_tokens_per_rank);
  EPX_CHECK_ARG(hidden >= 1, "hidden must be >= 1, got {}", hidden);
  EPX_CHECK_ARG(num_ranks >= 1, "num_ranks must be >= 1, got {}", num_ranks);
  EPX_CHECK_ARG(num_experts >= 1 && num_experts % num_ranks == 0,
                "num_experts must be >= 1 and divisible by num_ranks ({}), got {}", num_ranks, num_experts);
  check_low_latency_bytes(max_tokens_per_rank, hidden, num_experts);
  return cuda::LowLatencyLayout::make(max_tokens_per_rank, hidden, num_ranks, num_experts).total_bytes;
}

}  // namespace epx
