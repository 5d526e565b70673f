// What only the GPU benchmarks (tools/cuda/bench_*.cpp; CUDA builds only) need: NCCL error checks, the kernel
// tuning switches from the environment and a warm memory pool. The helpers they share with the GPU tests (error
// checks, event timing, medians, random routing) are src/testing's, brought into epx::cli below.
#pragma once

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <cstdint>
#include <cstdlib>

#include "epx/buffer.h"
#include "epx/error.h"
#include "testing/gpu_util.h"
#include "testing/routing.h"
#include "testing/stats.h"

namespace epx::cli {

// The helpers the GPU tests share (src/testing): error checks, event timing, medians, random routing.
using testing::cuda_ok;
using testing::EventTimer;
using testing::median;
using testing::median_event_ms;
using testing::percentile;
using testing::random_distinct_topk;
using testing::t_last_host_s;
using testing::time_back_to_back;
using testing::time_on_stream;

inline void nccl_ok(ncclResult_t res, const char* what) {
  if (res != ncclSuccess) throw Error(ErrorCode::kNcclError, fmt::format("{}: {}", what, ncclGetErrorString(res)));
}

// The kernel tuning switches of the GPU benchmarks: the library reads no environment; `epx bench` maps these
// variables onto BufferOptions (docs/normal-kernels.md, docs/low-latency.md). Unset: the library default.
//   EPX_NORMAL_COPY_ENGINE=0  normal.copy_engines = false (SM rings only)
//   EPX_COPY_WHOLE=0          normal.whole_copies = false
//   EPX_STREAM_SIGNALS=0      normal.stream_signals = false
//   EPX_COPY_CHUNKS=n         normal.max_copy_chunks = n (1..8)
//   EPX_NORMAL_TIMELINE=1     normal.stage_timeline = true
//   EPX_EARLY_COPIES=n        normal.early_copies = kNever (0), kAuto (1), kAlways (2)
//   EPX_LL_COMBINE_PARTS=n    low_latency.combine_send_parts = n (1, 2, 4, 8)
//   EPX_LL_SOLO_ROWS=n        low_latency.combine_solo_max_rows = n (0: off)
//   EPX_LL_TOKEN_ROWS_MIN=n   low_latency.token_rows_min_tokens = n (>= 0)
//   EPX_LL_PDL=0              low_latency.programmatic_launch = false (plain stream order)
//   EPX_LL_EXPERT_SIDE=1      low_latency.expert_side_reduction = true (the combine sums per expert rank first)
// A value that is not a whole number is kInvalidArgument naming the variable; ranges are Buffer::create's.
inline BufferOptions tuned_from_env(BufferOptions options) {
  auto number = [](const char* name, int fallback) {
    const char* v = std::getenv(name);
    if (v == nullptr) return fallback;
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (*v == '\0' || *end != '\0' || n < -1'000'000 || n > 1'000'000) {
      throw Error(ErrorCode::kInvalidArgument, fmt::format("{} must be a whole number, got '{}'", name, v));
    }
    return static_cast<int>(n);
  };
  auto flag = [&](const char* name, bool fallback) { return number(name, fallback ? 1 : 0) != 0; };
  options.normal.copy_engines = flag("EPX_NORMAL_COPY_ENGINE", options.normal.copy_engines);
  options.normal.whole_copies = flag("EPX_COPY_WHOLE", options.normal.whole_copies);
  options.normal.stream_signals = flag("EPX_STREAM_SIGNALS", options.normal.stream_signals);
  options.normal.max_copy_chunks = number("EPX_COPY_CHUNKS", options.normal.max_copy_chunks);
  options.normal.stage_timeline = flag("EPX_NORMAL_TIMELINE", options.normal.stage_timeline);
  if (std::getenv("EPX_EARLY_COPIES") != nullptr) {
    const int mode = number("EPX_EARLY_COPIES", 1);
    if (mode < 0 || mode > 2) {
      throw Error(ErrorCode::kInvalidArgument, fmt::format("EPX_EARLY_COPIES must be 0, 1 or 2, got {}", mode));
    }
    constexpr EarlyCopies kModes[] = {EarlyCopies::kNever, EarlyCopies::kAuto, EarlyCopies::kAlways};
    options.normal.early_copies = kModes[mode];
  }
  options.low_latency.combine_send_parts = number("EPX_LL_COMBINE_PARTS", options.low_latency.combine_send_parts);
  options.low_latency.combine_solo_max_rows = number("EPX_LL_SOLO_ROWS", options.low_latency.combine_solo_max_rows);
  options.low_latency.token_rows_min_tokens =
      number("EPX_LL_TOKEN_ROWS_MIN", options.low_latency.token_rows_min_tokens);
  options.low_latency.programmatic_launch = flag("EPX_LL_PDL", options.low_latency.programmatic_launch);
  options.low_latency.expert_side_reduction = flag("EPX_LL_EXPERT_SIDE", options.low_latency.expert_side_reduction);
  return options;
}

// The default pool returns freed memory to the driver at every synchronization (threshold 0), so each
// iteration would map its outputs afresh; a serving process keeps its pool warm instead.
inline void keep_mem_pools_warm(int num_gpus) {
  for (int d = 0; d < num_gpus; ++d) {
    cudaMemPool_t pool;
    cuda_ok(cudaDeviceGetDefaultMemPool(&pool, d), "cudaDeviceGetDefaultMemPool");
    uint64_t threshold = UINT64_MAX;
    cuda_ok(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold), "cudaMemPoolSetAttribute");
  }
}

}  // namespace epx::cli
