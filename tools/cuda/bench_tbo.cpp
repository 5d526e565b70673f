// `epx bench --tbo`: two-batch overlap of one MoE step on GPUs (one rank per GPU).
//
// A rank's T tokens are split into micro-batches A and B (compute_tbo_split, decode rule). Each runs
//   dispatch (epx::Buffer normal path, `comm` stream) -> expert GEMMs (cuBLAS, `compute` stream)
//   -> combine (`comm` stream),
// ordered across streams by events. The expert GEMMs are one up projection [N, H] x [H, I] and one down
// projection [N, I] x [I, H] over the N rows the rank received: the FLOPs of N rows through an expert
// of intermediate size I. I is calibrated so that one micro-batch's GEMMs take about as long as its
// dispatch + combine (the case the overlap is for).
//
// SM split: the communication kernels run on --sms SMs (BufferOptions::num_sms); cuBLAS is asked for
// the rest with cublasSetSmCountTarget. Without overlap, the same operations run one after the other
// (the event chain leaves nothing to overlap); that is timed with the same SM split and with cuBLAS on
// every SM (the stronger baseline, the one the speedup is taken against).
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>

#include "cuda/bench_util.h"
#include "bench_dp.h"
#include "epx/buffer.h"
#include "epx/cuda.h"
#include "epx/error.h"
#include "epx/quant.h"
#include "epx/routing.h"
#include "epx/tbo.h"

namespace epx::cli {
namespace {

void cublas_ok(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS) {
    throw Error(ErrorCode::kCudaError, fmt::format("{}: cuBLAS status {}", what, static_cast<int>(st)));
  }
}

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// bf16 values k * scale, k in [-8, 8].
std::vector<uint16_t> random_bf16(uint64_t seed, int64_t n, float scale) {
  std::vector<uint16_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    v[i] = float_to_bf16(static_cast<float>(static_cast<int>(mix(seed + i) % 17) - 8) * scale);
  }
  return v;
}

// Row-major Y[N, n_out] = X[N, k] W[k, n_out] in bf16 with fp32 accumulation (cuBLAS is column-major:
// Y^T = W^T X^T).
void gemm(cublasHandle_t h, const void* x, const void* w, void* y, int64_t rows, int64_t k, int64_t n_out) {
  if (rows == 0) return;
  const float one = 1.f, zero = 0.f;
  cublas_ok(
      cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(n_out), static_cast<int>(rows), static_cast<int>(k),
                   &one, w, CUDA_R_16BF, static_cast<int>(n_out), x, CUDA_R_16BF, static_cast<int>(k), &zero, y,
                   CUDA_R_16BF, static_cast<int>(n_out), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx");
}

struct RankTimes {
  double comm_s = 0;         // dispatch + combine of micro-batch A alone
  double gemm_probe_s = 0;   // A's GEMMs at the probe intermediate size, limited SMs
  double serial_s = 0;       // both micro-batches, no overlap, limited SMs
  double serial_full_s = 0;  // both micro-batches, no overlap, cuBLAS on every SM
  double overlap_s = 0;      // both micro-batches through execute_two_batch_overlap, delta 1
  int64_t rows[2] = {0, 0};
  int64_t mismatches = 0;  // overlap output vs serial output (same handle, same GEMM algorithm)
};

}  // namespace

nlohmann::json run_cuda_tbo_bench(const BenchConfig& config) {
  const int num_gpus = testing::num_gpus();
  if (num_gpus < 2) throw Error(ErrorCode::kUnsupported, "bench --tbo needs at least 2 visible GPUs");
  const int R = config.num_ranks > 0 ? config.num_ranks : num_gpus;
  if (R > num_gpus || R < 2) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("bench --tbo: --ranks must be in [2, {}] (one rank per GPU), got {}", num_gpus, R));
  }
  const int64_t T = config.num_tokens, H = config.hidden, E = config.num_experts;
  const int K = config.num_topk;
  if (T < 2) throw Error(ErrorCode::kInvalidArgument, fmt::format("bench --tbo: --tokens must be >= 2, got {}", T));
  check_expert_split(E, R);
  const int comm_sms = config.num_sms.empty() ? 24 : config.num_sms[0];
  cudaDeviceProp prop{};
  cuda_ok(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  if (comm_sms < 2 || comm_sms >= prop.multiProcessorCount) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("bench --tbo: --sms must be in [2, {}), got {}", prop.multiProcessorCount, comm_sms));
  }
  const int compute_sms = prop.multiProcessorCount - comm_sms;
  const TboSplit split = *compute_tbo_split(ForwardMode::kDecode, T, {}, 1);
  const int64_t Tb[2] = {split.split_token_index, T - split.split_token_index};
  std::vector<int> devices(R);
  for (int r = 0; r < R; ++r) devices[r] = r;
  auto progress = [&](const std::string& what) {
    if (config.progress) std::fprintf(stderr, "[epx bench --tbo] %d ranks: %s\n", R, what.c_str());
  };
  keep_mem_pools_warm(R);

  // Routing: fresh top-k per token (distinct experts), per rank.
  std::mt19937_64 rng(config.seed);
  std::vector<std::vector<int64_t>> topk;
  for (int r = 0; r < R; ++r) topk.push_back(random_distinct_topk(rng, T, K, E));

  constexpr int64_t kProbeI = 2048;
  std::vector<RankTimes> times(R);
  std::vector<int64_t> chosen_i(R, 0);
  auto groups = create_cuda_groups(devices);
  progress(fmt::format("T {} = {} + {}, comm {} SMs, cuBLAS {} SMs", T, Tb[0], Tb[1], comm_sms, compute_sms));
  run_host_ranks(groups, [&](int r, Group& g) {
    cuda_ok(cudaSetDevice(r), "cudaSetDevice");
    cudaStream_t comm, compute;
    cuda_ok(cudaStreamCreateWithFlags(&comm, cudaStreamNonBlocking), "cudaStreamCreate");
    cuda_ok(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking), "cudaStreamCreate");
    cublasHandle_t limited, full;
    cublas_ok(cublasCreate(&limited), "cublasCreate");
    cublas_ok(cublasCreate(&full), "cublasCreate");
    cublas_ok(cublasSetStream(limited, compute), "cublasSetStream");
    cublas_ok(cublasSetStream(full, compute), "cublasSetStream");
    cublas_ok(cublasSetSmCountTarget(limited, compute_sms), "cublasSetSmCountTarget");
    BufferOptions options;
    options.num_sms = comm_sms;
    options.num_normal_bytes = normal_buffer_size_hint(H, R, comm_sms);
    auto buffer = Buffer::create(groups[r], tuned_from_env(options));
    const Device dev = Device::cuda(r);
    auto upload = [&](const void* p, size_t bytes, DType dt, std::vector<int64_t> shape) {
      Tensor t = Tensor::empty(dt, shape, dev, nullptr, comm);
      cuda_ok(cudaMemcpyAsync(t.data(), p, bytes, cudaMemcpyHostToDevice, comm), "upload");
      return t;
    };
    Tensor x[2], idx[2];
    Layout layout[2];
    for (int b = 0; b < 2; ++b) {
      const int64_t first = b == 0 ? 0 : Tb[0];
      const auto xs = random_bf16(config.seed * 1000 + r * 2 + b, Tb[b] * H, 1.f / 8);
      x[b] = upload(xs.data(), xs.size() * 2, DType::kBFloat16, {Tb[b], H});
      idx[b] = upload(topk[r].data() + first * K, static_cast<size_t>(Tb[b] * K) * 8, DType::kInt64, {Tb[b], K});
      layout[b] = buffer->get_dispatch_layout(idx[b], E, comm);
    }
    cuda_ok(cudaStreamSynchronize(comm), "sync");
    const int64_t max_rows = T * R;  // a rank receives at most every token of every rank
    int64_t I = kProbeI;
    void *w_up = nullptr, *w_down = nullptr, *mid[2] = {nullptr, nullptr}, *y[2] = {nullptr, nullptr};
    auto alloc_gemm = [&](int64_t inter) {
      for (void* p : {w_up, w_down, mid[0], mid[1], y[0], y[1]}) cudaFree(p);
      const auto wu = random_bf16(7 + r, H * inter, 1.f / 64);
      const auto wd = random_bf16(11 + r, inter * H, 1.f / 64);
      cuda_ok(cudaMalloc(&w_up, wu.size() * 2), "cudaMalloc");
      cuda_ok(cudaMalloc(&w_down, wd.size() * 2), "cudaMalloc");
      cuda_ok(cudaMemcpy(w_up, wu.data(), wu.size() * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
      cuda_ok(cudaMemcpy(w_down, wd.data(), wd.size() * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
      for (int b = 0; b < 2; ++b) {
        cuda_ok(cudaMalloc(&mid[b], static_cast<size_t>(max_rows * inter) * 2), "cudaMalloc");
        cuda_ok(cudaMalloc(&y[b], static_cast<size_t>(max_rows * H) * 2), "cudaMalloc");
      }
    };
    alloc_gemm(I);

    // Per micro-batch state of one step. Events order the streams: dispatched[b] (comm -> compute),
    // computed[b] (compute -> comm).
    DispatchResult disp[2];
    CombineResult comb[2];
    cudaEvent_t dispatched[2], computed[2], joined;
    for (int b = 0; b < 2; ++b) {
      cuda_ok(cudaEventCreateWithFlags(&dispatched[b], cudaEventDisableTiming), "cudaEventCreate");
      cuda_ok(cudaEventCreateWithFlags(&computed[b], cudaEventDisableTiming), "cudaEventCreate");
    }
    cuda_ok(cudaEventCreateWithFlags(&joined, cudaEventDisableTiming), "cudaEventCreate");
    cublasHandle_t gemm_handle = limited;
    auto dispatch_op = [&](int b) {
      DispatchArgs a;
      a.x = x[b];
      a.topk_idx = idx[b];
      a.num_experts = E;
      a.layout = &layout[b];
      a.stream = comm;
      disp[b] = buffer->dispatch(a);
      cuda_ok(cudaEventRecord(dispatched[b], comm), "cudaEventRecord");
    };
    auto experts_op = [&](int b) {
      cuda_ok(cudaStreamWaitEvent(compute, dispatched[b], 0), "cudaStreamWaitEvent");
      const int64_t n = disp[b].recv_x.size(0);
      gemm(gemm_handle, disp[b].recv_x.data(), w_up, mid[b], n, H, I);
      gemm(gemm_handle, mid[b], w_down, y[b], n, I, H);
      cuda_ok(cudaEventRecord(computed[b], compute), "cudaEventRecord");
    };
    auto combine_op = [&](int b) {
      cuda_ok(cudaStreamWaitEvent(comm, computed[b], 0), "cudaStreamWaitEvent");
      CombineArgs a;
      a.x = TensorView::of(y[b], DType::kBFloat16, {disp[b].recv_x.size(0), H}, dev);
      a.handle = disp[b].handle;
      a.stream = comm;
      comb[b] = buffer->combine(a);
    };
    const std::vector<TboOperation> ops = {{"dispatch", dispatch_op},
                                           TboOperation::yield_point(),
                                           {"experts", experts_op},
                                           TboOperation::yield_point(),
                                           {"combine", combine_op}};
    // Times one step on the GPU: the start event on comm, compute joins it; the end joins compute back.
    EventTimer step_timer;
    auto time_step = [&](auto body) {
      const double ms = median_event_ms(
          step_timer, comm, config.num_warmup, config.num_iters, [&](int) { g.barrier(); },
          [&](int) {
            cuda_ok(cudaStreamWaitEvent(compute, step_timer.event(0), 0), "cudaStreamWaitEvent");
            body();
            cuda_ok(cudaEventRecord(joined, compute), "cudaEventRecord");
            cuda_ok(cudaStreamWaitEvent(comm, joined, 0), "cudaStreamWaitEvent");
          });
      return ms * 1e-3;
    };
    auto serial = [&] {
      for (int b = 0; b < 2; ++b) {
        for (const auto& op : ops) {
          if (!op.is_yield()) op.fn(b);
        }
      }
    };

    // Calibration: A's communication alone, then A's GEMMs at the probe size; I scales the GEMMs to the
    // communication time (multiple of 256). Every rank takes the largest I any rank asked for.
    RankTimes& t = times[r];
    t.comm_s = time_step([&] {
      dispatch_op(0);
      // No GEMMs: combine the received rows as they are.
      CombineArgs a;
      a.x = disp[0].recv_x;
      a.handle = disp[0].handle;
      a.stream = comm;
      comb[0] = buffer->combine(a);
    });
    t.gemm_probe_s = time_step([&] {
      cuda_ok(cudaEventRecord(dispatched[0], comm), "cudaEventRecord");
      experts_op(0);
    });
    const int64_t want = std::clamp<int64_t>(
        static_cast<int64_t>(static_cast<double>(kProbeI) * t.comm_s / t.gemm_probe_s / 256.0 + 0.5) * 256, 256, 32768);
    std::vector<int64_t> all(R);
    g.all_gather_bytes(&want, all.data(), sizeof(int64_t));
    I = *std::max_element(all.begin(), all.end());
    chosen_i[r] = I;
    alloc_gemm(I);

    gemm_handle = limited;
    t.serial_s = time_step(serial);
    std::vector<uint16_t> out_serial[2], out_overlap[2];
    for (int b = 0; b < 2; ++b) {
      out_serial[b].resize(static_cast<size_t>(Tb[b] * H));
      cuda_ok(cudaMemcpyAsync(out_serial[b].data(), comb[b].x.data(), out_serial[b].size() * 2, cudaMemcpyDeviceToHost,
                              comm),
              "download");
    }
    t.overlap_s = time_step([&] { execute_two_batch_overlap(ops, ops, 1); });
    for (int b = 0; b < 2; ++b) {
      out_overlap[b].resize(static_cast<size_t>(Tb[b] * H));
      cuda_ok(cudaMemcpyAsync(out_overlap[b].data(), comb[b].x.data(), out_overlap[b].size() * 2,
                              cudaMemcpyDeviceToHost, comm),
              "download");
    }
    cuda_ok(cudaStreamSynchronize(comm), "sync");
    for (int b = 0; b < 2; ++b) {
      t.rows[b] = disp[b].recv_x.size(0);
      for (size_t i = 0; i < out_serial[b].size(); ++i) t.mismatches += out_serial[b][i] != out_overlap[b][i];
    }
    gemm_handle = full;
    t.serial_full_s = time_step(serial);

    cuda_ok(cudaStreamSynchronize(compute), "sync");
    cuda_ok(cudaStreamSynchronize(comm), "sync");
    for (int b = 0; b < 2; ++b) {
      disp[b] = {};
      comb[b] = {};
      x[b] = idx[b] = Tensor();
      layout[b] = {};
      cudaEventDestroy(dispatched[b]);
      cudaEventDestroy(computed[b]);
    }
    cudaEventDestroy(joined);
    for (void* p : {w_up, w_down, mid[0], mid[1], y[0], y[1]}) cudaFree(p);
    buffer.reset();
    cublasDestroy(limited);
    cublasDestroy(full);
    cuda_ok(cudaStreamSynchronize(comm), "sync");
    cudaStreamDestroy(comm);
    cudaStreamDestroy(compute);
  });

  auto worst = [&](double RankTimes::*field) {
    double m = 0;
    for (const auto& t : times) m = std::max(m, t.*field);
    return m;
  };
  const int64_t I = chosen_i[0];
  const double comm_s = worst(&RankTimes::comm_s);
  const double gemm_s = worst(&RankTimes::gemm_probe_s) * static_cast<double>(I) / kProbeI;
  const double serial_s = worst(&RankTimes::serial_s);
  const double serial_full_s = worst(&RankTimes::serial_full_s);
  const double overlap_s = worst(&RankTimes::overlap_s);
  const double baseline_s = std::min(serial_s, serial_full_s);
  int64_t mismatches = 0;
  for (const auto& t : times) mismatches += t.mismatches;
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& t : times) rows.push_back({t.rows[0], t.rows[1]});

  nlohmann::json phases = nlohmann::json::array();
  phases.push_back({{"name", "micro-batch A: dispatch + combine"}, {"time_us", comm_s * 1e6}});
  phases.push_back({{"name", fmt::format("micro-batch A: GEMMs, I={} (scaled probe)", I)}, {"time_us", gemm_s * 1e6}});
  phases.push_back(
      {{"name", fmt::format("step, no overlap ({} SMs cuBLAS)", compute_sms)}, {"time_us", serial_s * 1e6}});
  phases.push_back({{"name", fmt::format("step, no overlap ({} SMs cuBLAS)", prop.multiProcessorCount)},
                    {"time_us", serial_full_s * 1e6}});
  phases.push_back(
      {{"name", "step, TBO (delta 1)"}, {"time_us", overlap_s * 1e6}, {"speedup", baseline_s / overlap_s}});

  nlohmann::json report;
  report["backend"] = "cuda";
  report["device"] = fmt::format("{} x {} ({} SMs)", R, prop.name, prop.multiProcessorCount);
  report["settings"] = {
      {"num_ranks", R},
      {"num_tokens", T},
      {"micro_batches", {Tb[0], Tb[1]}},
      {"hidden", H},
      {"intermediate", I},
      {"num_topk", K},
      {"num_experts", E},
      {"comm_sms", comm_sms},
      {"compute_sms", compute_sms},
      {"sm_split", "normal kernels on BufferOptions::num_sms; cuBLAS on the rest via cublasSetSmCountTarget"},
      {"received_rows", rows},
      {"warmup", config.num_warmup},
      {"iters", config.num_iters},
      {"timing", "CUDA events spanning both streams per step, median, slowest rank"}};
  report["tbo"] = {{"no_overlap_us", serial_s * 1e6},
                   {"no_overlap_full_gpu_gemm_us", serial_full_s * 1e6},
                   {"overlap_us", overlap_s * 1e6},
                   {"speedup", baseline_s / overlap_s},
                   {"speedup_vs_same_sm_split", serial_s / overlap_s},
                   {"target_speedup", 1.25},
                   {"speedup_baseline", "the faster of the two no-overlap runs"}};
  report["phases"] = phases;
  report["check"] = {
      {"passed", mismatches == 0},
      {"details", nlohmann::json::array({{{"name", "TBO output == no-overlap output, bit for bit (same GEMM handle)"},
                                          {"mismatches", mismatches}}})}};
  return report;
}

}  // namespace epx::cli
