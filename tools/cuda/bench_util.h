// Helpers shared by the GPU benchmarks (tools/cuda/bench_*.cpp; CUDA builds only): error checks, medians,
// event timing on a stream, a warm memory pool and random routing.
#pragma once

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <random>
#include <type_traits>
#include <vector>

#include "epx/buffer.h"
#include "epx/error.h"

namespace epx::cli {

inline void cuda_ok(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw Error(ErrorCode::kCudaError, fmt::format("{}: {}", what, cudaGetErrorString(err)));
}
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
//   EPX_LL_COMBINE_PARTS=n    low_latency.combine_send_parts = n (1, 2, 4, 8)
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
  options.low_latency.combine_send_parts = number("EPX_LL_COMBINE_PARTS", options.low_latency.combine_send_parts);
  return options;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}
inline double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

// Back to back: `calls` calls of `body` between two events, no synchronization in between (the host runs
// ahead, as in a model step), `iters` times after `warmup` rounds; returns the median time per call in
// seconds.
template <typename Body>
double time_back_to_back(cudaStream_t stream, int warmup, int iters, int calls, Body body) {
  cudaEvent_t start, stop;
  cuda_ok(cudaEventCreate(&start), "cudaEventCreate");
  cuda_ok(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<double> times;
  for (int i = 0; i < warmup + iters; ++i) {
    cuda_ok(cudaEventRecord(start, stream), "cudaEventRecord");
    for (int c = 0; c < calls; ++c) body();
    cuda_ok(cudaEventRecord(stop, stream), "cudaEventRecord");
    cuda_ok(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    cuda_ok(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    if (i >= warmup) times.push_back(ms * 1e-3 / calls);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return median(times);
}

// Median host time of the last time_on_stream call on this thread: how long `body` took to enqueue.
inline thread_local double t_last_host_s = 0;

// Times `body` (called with the iteration index, or with nothing) on `stream` with CUDA events: warm-up,
// then iterations; returns the median in seconds and leaves the median enqueue time in t_last_host_s.
template <typename Body>
double time_on_stream(cudaStream_t stream, int warmup, int iters, Body body) {
  cudaEvent_t start, stop;
  cuda_ok(cudaEventCreate(&start), "cudaEventCreate");
  cuda_ok(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<double> times, host;
  for (int i = 0; i < warmup + iters; ++i) {
    cuda_ok(cudaEventRecord(start, stream), "cudaEventRecord");
    const auto h0 = std::chrono::steady_clock::now();
    if constexpr (std::is_invocable_v<Body, int>) {
      body(i);
    } else {
      body();
    }
    if (i >= warmup) host.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - h0).count());
    cuda_ok(cudaEventRecord(stop, stream), "cudaEventRecord");
    cuda_ok(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    cuda_ok(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    if (i >= warmup) times.push_back(ms * 1e-3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  t_last_host_s = median(host);
  return median(times);
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

// [T, K] expert ids, each token's K experts distinct (when K <= E), uniform over [0, E).
template <typename Rng>
std::vector<int64_t> random_distinct_topk(Rng& rng, int64_t T, int K, int64_t E) {
  std::uniform_int_distribution<int64_t> expert(0, E - 1);
  std::vector<int64_t> topk(T * K);
  for (int64_t t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      int64_t e;
      bool fresh;
      do {
        e = expert(rng);
        fresh = std::find(topk.begin() + t * K, topk.begin() + t * K + k, e) == topk.begin() + t * K + k;
      } while (!fresh && K <= E);
      topk[t * K + k] = e;
    }
  }
  return topk;
}

}  // namespace epx::cli
