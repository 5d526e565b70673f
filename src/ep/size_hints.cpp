// Peer-memory size hints of the normal and low-latency paths (declared in epx/buffer.h). Plain host
// code: the formulas follow the cuda backend's layouts (src/cuda/), the host backend ignores them.
#include <cstdint>

#include "core/check.h"
#include "cuda/low_latency_layout.h"
#include "epx/buffer.h"

namespace epx {
namespace {

// Keep in step with src/cuda/cuda_buffer_cuda.cpp (signal area) and normal_kernels.h (limits).
constexpr int64_t kSignalBytes = int64_t{1} << 20;
constexpr int64_t kDefaultRingRows = 256;  // rows per (source rank, channel) ring
constexpr int64_t kMaxTopk = 16;

int64_t align16(int64_t v) { return (v + 15) / 16 * 16; }

}  // namespace

int64_t normal_buffer_size_hint(int64_t hidden, int num_ranks, int num_sms, int64_t max_tokens_per_rank) {
  EPX_CHECK_ARG(hidden >= 1, "hidden must be >= 1, got {}", hidden);
  EPX_CHECK_ARG(num_ranks >= 1, "num_ranks must be >= 1, got {}", num_ranks);
  EPX_CHECK_ARG(num_sms >= 1, "num_sms must be >= 1, got {}", num_sms);
  EPX_CHECK_ARG(max_tokens_per_rank >= 0, "max_tokens_per_rank must be >= 0, got {}", max_tokens_per_rank);
  const int64_t num_channels = num_sms / 2 > 0 ? num_sms / 2 : 1;
  // The largest row: bf16 data, fp32 scales per 128 channels, top-k ids and weights, source index.
  const int64_t row_bytes = align16(hidden * 2 + (hidden + 127) / 128 * 4 + 8 * kMaxTopk + 4);
  const int64_t rings = int64_t{num_ranks} * num_channels * kDefaultRingRows * row_bytes;
  // Copy-engine staging (src/cuda/cuda_buffer_cuda.cpp, stage_fields and copy_slot_bytes): the ring area,
  // rounded down to KiB, split into one 256-byte aligned slot per peer, each holding the fields of up to T
  // rows in separate 256-byte aligned parts: data, scales, int64 top-k ids, weights, source index (the five
  // alignments and the rounding take at most 3 KiB).
  const int64_t staged_row = hidden * 2 + (hidden + 127) / 128 * 4 + 12 * kMaxTopk + 4;
  const int64_t slot = max_tokens_per_rank * staged_row + 3072;
  const int64_t staging = num_ranks > 1 && max_tokens_per_rank > 0 ? int64_t{num_ranks - 1} * slot : 0;
  return kSignalBytes + (rings > staging ? rings : staging);
}

int64_t low_latency_buffer_size_hint(int64_t max_tokens_per_rank, int64_t hidden, int num_ranks, int64_t num_experts) {
  EPX_CHECK_ARG(max_tokens_per_rank >= 1, "max_tokens_per_rank must be >= 1, got {}", max_tokens_per_rank);
  EPX_CHECK_ARG(hidden >= 1, "hidden must be >= 1, got {}", hidden);
  EPX_CHECK_ARG(num_ranks >= 1, "num_ranks must be >= 1, got {}", num_ranks);
  EPX_CHECK_ARG(num_experts >= 1 && num_experts % num_ranks == 0,
                "num_experts must be >= 1 and divisible by num_ranks ({}), got {}", num_ranks, num_experts);
  return cuda::LowLatencyLayout::make(max_tokens_per_rank, hidden, num_ranks, num_experts).total_bytes;
}

}  // namespace epx
