// `epx bench` on GPUs: the normal dispatch/combine of the cuda backend, timed with CUDA events, next to
// the floor measured in the same run (copy-engine peer copy, local copy) and a baseline a user would
// write (per-destination rows through ncclSend/ncclRecv); then the low-latency phases
// (tools/cuda/bench_low_latency.cpp).
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>

#include "bench.h"
#include "cuda/bench_util.h"
#include "epx/buffer.h"
#include "epx/cuda.h"
#include "epx/error.h"
#include "epx/quant.h"
#include "epx/routing.h"

namespace epx::cli {
namespace {

struct Floor {
  double peer_one_way_gbps = 0, peer_both_ways_gbps = 0, local_gbps = 0;
  // The two ways of measuring peer_both_ways_gbps (each the faster of 256 MiB and the dispatch's size).
  double peer_both_ways_single_gbps = 0, peer_both_ways_batched_gbps = 0;
};

// `bytes` from src to dst as kPieces copies in one cudaMemcpyBatchAsync (a single cudaMemcpyAsync where
// the runtime has no batches).
void batched_copy(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  constexpr int kPieces = 8;
  void* dsts[kPieces];
  const void* srcs[kPieces];
  size_t sizes[kPieces];
  for (int i = 0; i < kPieces; ++i) {
    dsts[i] = static_cast<char*>(dst) + bytes / kPieces * i;
    srcs[i] = static_cast<const char*>(src) + bytes / kPieces * i;
    sizes[i] = bytes / kPieces;
  }
#if CUDART_VERSION >= 12080
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t attr_index = 0;
  cuda_ok(cudaMemcpyBatchAsync(dsts, srcs, sizes, kPieces, &attr, &attr_index, 1, stream), "cudaMemcpyBatchAsync");
#else
  cuda_ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream), "cudaMemcpyAsync");
#endif
}

// Copy-engine rates: local, one way, and both ways at once, the latter also for `size_bytes` (what one
// rank sends in the dispatch: a transfer that fits L2 may move faster than 256 MiB do).
Floor measure_floor(int num_gpus, int warmup, int iters, size_t size_bytes) {
  Floor f;
  const size_t bytes = size_t{256} << 20;
  std::vector<void*> src(num_gpus), dst(num_gpus);
  std::vector<cudaStream_t> streams(num_gpus);
  for (int d = 0; d < num_gpus; ++d) {
    cuda_ok(cudaSetDevice(d), "cudaSetDevice");
    cuda_ok(cudaMalloc(&src[d], bytes), "cudaMalloc");
    cuda_ok(cudaMalloc(&dst[d], bytes), "cudaMalloc");
    cuda_ok(cudaMemset(src[d], 1, bytes), "cudaMemset");
    cuda_ok(cudaStreamCreateWithFlags(&streams[d], cudaStreamNonBlocking), "cudaStreamCreate");
    for (int p = 0; p < num_gpus; ++p) {
      if (p != d && cudaDeviceEnablePeerAccess(p, 0) != cudaSuccess) cudaGetLastError();
    }
  }
  cuda_ok(cudaSetDevice(0), "cudaSetDevice");
  f.local_gbps =
      bytes /
      time_on_stream(streams[0], warmup, iters,
                     [&](int) { cudaMemcpyAsync(dst[0], src[0], bytes, cudaMemcpyDeviceToDevice, streams[0]); }) /
      1e9;
  if (num_gpus >= 2) {
    f.peer_one_way_gbps = bytes /
                          time_on_stream(streams[0], warmup, iters,
                                         [&](int) { cudaMemcpyPeerAsync(dst[1], 1, src[0], 0, bytes, streams[0]); }) /
                          1e9;
    // Both directions at once: GPU1's copy starts when GPU0's stream does (event), both timed on GPU0.
    // Once as one cudaMemcpyPeerAsync each way, once as a batch of pieces (what the dispatch issues;
    // faster here): the floor is the faster of the two.
    cudaEvent_t go, done;
    cudaEventCreateWithFlags(&go, cudaEventDisableTiming);
    cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
    auto both_ways = [&](bool batched, size_t n) {
      return n /
             time_on_stream(streams[0], warmup, iters,
                            [&](int) {
                              cudaEventRecord(go, streams[0]);
                              cudaStreamWaitEvent(streams[1], go, 0);
                              if (batched) {
                                batched_copy(dst[0], src[1], n, streams[1]);
                                batched_copy(dst[1], src[0], n, streams[0]);
                              } else {
                                cudaMemcpyPeerAsync(dst[0], 0, src[1], 1, n, streams[1]);
                                cudaMemcpyPeerAsync(dst[1], 1, src[0], 0, n, streams[0]);
                              }
                              cudaEventRecord(done, streams[1]);
                              cudaStreamWaitEvent(streams[0], done, 0);
                            }) /
             1e9;
    };
    const size_t at_size = std::clamp<size_t>(size_bytes / 4096 * 4096, 4096, bytes);
    f.peer_both_ways_single_gbps = std::max(both_ways(false, bytes), both_ways(false, at_size));
    f.peer_both_ways_batched_gbps = std::max(both_ways(true, bytes), both_ways(true, at_size));
    f.peer_both_ways_gbps = std::max(f.peer_both_ways_single_gbps, f.peer_both_ways_batched_gbps);
    cudaEventDestroy(go);
    cudaEventDestroy(done);
  }
  for (int d = 0; d < num_gpus; ++d) {
    cudaSetDevice(d);
    cudaStreamSynchronize(streams[d]);
    cudaFree(src[d]);
    cudaFree(dst[d]);
    cudaStreamDestroy(streams[d]);
  }
  return f;
}

struct RankData {
  std::vector<uint16_t> x;  // [T, H] small integers: sums are exact
  std::vector<uint8_t> x_fp8;
  std::vector<float> scales;
  std::vector<int64_t> topk;
  std::vector<float> weights;
};

}  // namespace

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

nlohmann::json run_cuda_bench(const BenchConfig& config) {
  const int num_gpus = cuda_device_count();
  if (num_gpus == 0) throw Error(ErrorCode::kUnsupported, "run_cuda_bench: no GPU visible");
  const int R = config.num_ranks > 0 ? config.num_ranks : num_gpus;
  const int64_t T = config.num_tokens, H = config.hidden, E = config.num_experts;
  const int K = config.num_topk;
  check_expert_split(E, R);
  if (H % 128 != 0)
    throw Error(ErrorCode::kInvalidArgument, fmt::format("--hidden must be a multiple of 128, got {}", H));
  std::vector<int> devices(R);
  for (int r = 0; r < R; ++r) devices[r] = r % num_gpus;
  auto progress = [&](const std::string& what) {
    if (config.progress) std::fprintf(stderr, "[epx bench] cuda backend, %d ranks: %s\n", R, what.c_str());
  };

  keep_mem_pools_warm(num_gpus);
  cudaDeviceProp prop{};
  cuda_ok(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  progress("floor (copy engines)");
  const Floor floor =
      measure_floor(std::min(num_gpus, 2), config.num_warmup, config.num_iters, static_cast<size_t>(T * H * 2));

  // Inputs: two copies of x per rank, alternated, so that no iteration reads x from L2.
  std::mt19937_64 rng(config.seed);
  std::vector<RankData> data(R);
  for (int r = 0; r < R; ++r) {
    auto& d = data[r];
    std::uniform_int_distribution<int> value(-8, 8);
    d.x.resize(T * H);
    for (auto& v : d.x) v = float_to_bf16(static_cast<float>(value(rng)));
    d.topk = random_distinct_topk(rng, T, K, E);
    d.weights.assign(T * K, 0.125f);
    d.x_fp8.resize(T * H);
    d.scales.resize(T * (H / 128));
    quantize_fp8_host(TensorView::of(d.x.data(), DType::kBFloat16, {T, H}),
                      TensorView::of(d.x_fp8.data(), DType::kFloat8E4M3, {T, H}),
                      TensorView::of(d.scales.data(), DType::kFloat32, {T, H / 128}), ScaleFormat::kFloat32);
  }

  nlohmann::json phases = nlohmann::json::array();
  nlohmann::json checks = nlohmann::json::array();
  bool passed = true;
  nlohmann::json memory;
  std::vector<int64_t> num_recv(R, 0);

  for (int num_sms : config.num_sms) {
    auto groups = create_cuda_groups(devices);
    std::vector<std::vector<double>> t_layout(R), t_disp(R), t_cached(R), t_fp8(R), t_comb(R);
    std::vector<int64_t> mismatches(R, 0);
    progress(fmt::format("normal kernels, {} SMs", num_sms));
    run_host_ranks(groups, [&](int r, Group& g) {
      cuda_ok(cudaSetDevice(g.device().index), "cudaSetDevice");
      cudaStream_t stream;
      cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
      BufferOptions options;
      options.num_sms = num_sms;
      // Sized for T tokens, so the copy-engine path can hold a whole transfer per peer.
      options.num_normal_bytes = normal_buffer_size_hint(H, R, num_sms, T);
      auto buffer = Buffer::create(groups[r], tuned_from_env(options));
      const auto& d = data[r];
      auto up = [&](const void* p, size_t bytes, DType dt, std::vector<int64_t> shape) {
        Tensor t = Tensor::empty(dt, shape, g.device(), nullptr, stream);
        cuda_ok(cudaMemcpyAsync(t.data(), p, bytes, cudaMemcpyHostToDevice, stream), "upload");
        return t;
      };
      Tensor xs[2] = {up(d.x.data(), d.x.size() * 2, DType::kBFloat16, {T, H}),
                      up(d.x.data(), d.x.size() * 2, DType::kBFloat16, {T, H})};
      Tensor x8 = up(d.x_fp8.data(), d.x_fp8.size(), DType::kFloat8E4M3, {T, H});
      Tensor sc = up(d.scales.data(), d.scales.size() * 4, DType::kFloat32, {T, H / 128});
      Tensor topk = up(d.topk.data(), d.topk.size() * 8, DType::kInt64, {T, K});
      Tensor w = up(d.weights.data(), d.weights.size() * 4, DType::kFloat32, {T, K});
      cuda_ok(cudaStreamSynchronize(stream), "sync");
      const int warm = config.num_warmup, iters = config.num_iters;
      Layout layout;
      g.barrier();
      double host_s[5] = {};  // per phase: median host time of one call (enqueue, plus any host sync)
      const double layout_s =
          time_on_stream(stream, warm, iters, [&](int) { layout = buffer->get_dispatch_layout(topk, E, stream); });
      host_s[0] = t_last_host_s;
      // The layout again, one rank at a time: it is a local kernel, and rank threads calling the CUDA driver at
      // once contend for its locks (a call's host time doubles), which one process per GPU does not.
      double layout_alone_s = 0;
      for (int q = 0; q < R; ++q) {
        g.barrier();
        if (q == r) {
          layout_alone_s =
              time_on_stream(stream, warm, iters, [&] { layout = buffer->get_dispatch_layout(topk, E, stream); });
        }
      }
      auto fresh_call = [&](int i) {
        DispatchArgs a;
        a.x = xs[i & 1];
        a.topk_idx = topk;
        a.topk_weights = w;
        a.num_experts = E;
        a.layout = &layout;
        a.stream = stream;
        return buffer->dispatch(a);
      };
      DispatchResult res;
      g.barrier();
      const double disp_s = time_on_stream(stream, warm, iters, [&](int i) { res = fresh_call(i); });
      host_s[1] = t_last_host_s;
      // Each phase's call, timed twice: synchronized after every call, and back to back.
      auto cached_call = [&](int i) {
        DispatchArgs a;
        a.x = xs[i & 1];
        a.handle = res.handle;
        a.stream = stream;
        DispatchResult again = buffer->dispatch(a);
      };
      auto fp8_call = [&] {
        DispatchArgs a;
        a.x = x8;
        a.x_scales = sc;
        a.handle = res.handle;
        a.stream = stream;
        DispatchResult again = buffer->dispatch(a);
      };
      CombineResult comb;
      auto combine_call = [&] {
        CombineArgs a;
        a.x = res.recv_x;
        a.handle = res.handle;
        a.stream = stream;
        comb = buffer->combine(a);
      };
      g.barrier();
      const double cached_s = time_on_stream(stream, warm, iters, cached_call);
      host_s[2] = t_last_host_s;
      g.barrier();
      const double fp8_s = time_on_stream(stream, warm, iters, fp8_call);
      host_s[3] = t_last_host_s;
      g.barrier();
      const double comb_s = time_on_stream(stream, warm, iters, combine_call);
      host_s[4] = t_last_host_s;
      // The same calls back to back (the host ahead of the GPU, as in a model step): time per call.
      constexpr int kCalls = 10;
      double pipe_s[5] = {};
      g.barrier();
      pipe_s[0] = time_back_to_back(stream, warm, iters, kCalls,
                                    [&] { layout = buffer->get_dispatch_layout(topk, E, stream); });
      g.barrier();
      int pipe_i = 0;
      pipe_s[2] = time_back_to_back(stream, warm, iters, kCalls, [&] { cached_call(pipe_i++); });
      g.barrier();
      pipe_s[3] = time_back_to_back(stream, warm, iters, kCalls, fp8_call);
      g.barrier();
      pipe_s[4] = time_back_to_back(stream, warm, iters, kCalls, combine_call);
      // Fresh dispatches back to back: each still waits on the host for its counts (notify), but the host enqueues
      // the next call's layout copy, scan and notify (and, with early copies, its copies) while the GPU finishes this one.
      g.barrier();
      int fresh_i = 0;
      pipe_s[1] = time_back_to_back(stream, warm, iters, kCalls, [&] { fresh_call(fresh_i++); });
      // Check: identity experts give x * (ranks the token visited), exact for small integers.
      std::vector<uint16_t> out(T * H);
      cuda_ok(cudaMemcpyAsync(out.data(), comb.x.data(), out.size() * 2, cudaMemcpyDeviceToHost, stream), "download");
      cuda_ok(cudaStreamSynchronize(stream), "sync");
      const HostLayout hl =
          compute_layout_host(TensorView::of(const_cast<int64_t*>(d.topk.data()), DType::kInt64, {T, K}), E, R);
      int64_t bad = 0;
      for (int64_t t = 0; t < T; ++t) {
        int visits = 0;
        for (int q = 0; q < R; ++q) visits += hl.is_token_in_rank[t * R + q];
        for (int64_t c = 0; c < H; ++c) bad += bf16_to_float(out[t * H + c]) != bf16_to_float(d.x[t * H + c]) * visits;
      }
      mismatches[r] = bad;
      num_recv[r] = res.handle->num_recv_tokens();
      t_layout[r] = {layout_s, host_s[0], pipe_s[0], layout_alone_s};
      t_disp[r] = {disp_s, host_s[1], pipe_s[1]};
      t_cached[r] = {cached_s, host_s[2], pipe_s[2]};
      t_fp8[r] = {fp8_s, host_s[3], pipe_s[3]};
      t_comb[r] = {comb_s, host_s[4], pipe_s[4]};
      if (r == 0) memory = {{"normal_bytes_per_rank", options.num_normal_bytes}};
      res = {};
      comb = {};
      layout = {};
      xs[0] = xs[1] = x8 = sc = topk = w = Tensor();  // they free on `stream`: before destroying it
      buffer.reset();
      cudaStreamSynchronize(stream);
      cudaStreamDestroy(stream);
    });
    auto worst = [&](const std::vector<std::vector<double>>& v) {
      double m = 0;
      for (const auto& x : v) m = std::max(m, x[0]);
      return m;
    };
    double recv_rows = 0;
    for (int r = 0; r < R; ++r) recv_rows += static_cast<double>(num_recv[r]);
    recv_rows /= R;  // mean rows received per rank
    const double bf16_bytes = recv_rows * H * 2;
    const double fp8_bytes = recv_rows * (H + H / 128 * 4);
    // The NVLink floor of a phase: the bytes a rank receives from peers over the one-way copy-engine rate
    // (its own part moves locally, in parallel).
    const double remote_frac = R > 1 ? static_cast<double>(R - 1) / R : 0.0;
    auto floor_us = [&](double bytes) {
      return floor.peer_both_ways_gbps > 0 ? bytes * remote_frac / (floor.peer_both_ways_gbps * 1e9) * 1e6 : 0.0;
    };
    auto host_us = [&](const std::vector<std::vector<double>>& v) {
      double m = 0;
      for (const auto& x : v) m = std::max(m, x[1]);
      return m * 1e6;
    };
    auto phase = [&](const std::string& name, double sec, double bytes) {
      nlohmann::json j = {
          {"name", fmt::format("{} ({} SMs)", name, num_sms)}, {"num_sms", num_sms}, {"time_us", sec * 1e6}};
      if (bytes > 0) {
        j["logical_gbps"] = bytes / sec / 1e9;
        j["floor_us"] = floor_us(bytes);
        j["fraction_of_floor"] = floor_us(bytes) / (sec * 1e6);
      }
      return j;
    };
    phases.push_back(phase("layout", worst(t_layout), 0));
    {
      double alone = 0;  // slowest rank, timed while the others wait
      for (const auto& x : t_layout) alone = std::max(alone, x[3]);
      phases.back()["alone_us"] = alone * 1e6;
    }
    phases.push_back(phase("dispatch_bf16", worst(t_disp), bf16_bytes));
    phases.push_back(phase("dispatch_bf16_cached", worst(t_cached), bf16_bytes));
    phases.push_back(phase("dispatch_fp8_cached", worst(t_fp8), fp8_bytes));
    phases.push_back(phase("combine_bf16", worst(t_comb), bf16_bytes));
    {
      const std::vector<std::vector<double>>* all[] = {&t_layout, &t_disp, &t_cached, &t_fp8, &t_comb};
      const double bytes[] = {0, bf16_bytes, bf16_bytes, fp8_bytes, bf16_bytes};
      for (int i = 0; i < 5; ++i) {
        auto& ph = phases[phases.size() - 5 + i];
        ph["host_call_us"] = host_us(*all[i]);
        double pipe = 0;  // slowest rank, back to back
        for (const auto& x : *all[i]) pipe = std::max(pipe, x[2]);
        if (pipe <= 0) continue;
        ph["pipelined_us"] = pipe * 1e6;
        if (bytes[i] > 0) ph["pipelined_fraction_of_floor"] = floor_us(bytes[i]) / (pipe * 1e6);
      }
    }
    int64_t bad = 0;
    for (auto m : mismatches) bad += m;
    checks.push_back(
        {{"name", fmt::format("combine(dispatch(x)) == x * ranks visited, {} SMs (every element)", num_sms)},
         {"mismatches", bad}});
    passed = passed && bad == 0;
  }

  // Baseline: per-destination rows through ncclSend/ncclRecv (packing not counted: a lower bound on
  // what a user's version costs). One rank per GPU only.
  nlohmann::json baseline;
  if (R == num_gpus && R >= 2) {
    progress("NCCL send/recv baseline");
    std::vector<ncclComm_t> comms(R);
    nccl_ok(ncclCommInitAll(comms.data(), R, devices.data()), "ncclCommInitAll");
    std::vector<double> secs(R);
    auto groups = create_cuda_groups(devices);
    run_host_ranks(groups, [&](int r, Group& g) {
      cuda_ok(cudaSetDevice(r), "cudaSetDevice");
      cudaStream_t stream;
      cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
      const HostLayout mine = compute_layout_host(TensorView::of(data[r].topk.data(), DType::kInt64, {T, K}), E, R);
      std::vector<int64_t> send_rows(R), recv_rows(R);
      for (int q = 0; q < R; ++q) {
        send_rows[q] = mine.num_tokens_per_rank[q];
        const HostLayout theirs = compute_layout_host(TensorView::of(data[q].topk.data(), DType::kInt64, {T, K}), E, R);
        recv_rows[q] = theirs.num_tokens_per_rank[r];
      }
      const size_t row = H * 2;
      void *send = nullptr, *recv = nullptr;
      cuda_ok(cudaMalloc(&send, row * T * R), "cudaMalloc");
      cuda_ok(cudaMalloc(&recv, row * T * R), "cudaMalloc");
      g.barrier();
      secs[r] = time_on_stream(stream, config.num_warmup, config.num_iters, [&](int) {
        ncclGroupStart();
        int64_t off = 0;
        for (int q = 0; q < R; ++q) {
          ncclSend(static_cast<char*>(send) + q * row * T, send_rows[q] * row, ncclChar, q, comms[r], stream);
          ncclRecv(static_cast<char*>(recv) + off * row, recv_rows[q] * row, ncclChar, q, comms[r], stream);
          off += recv_rows[q];
        }
        ncclGroupEnd();
      });
      cudaStreamSynchronize(stream);
      cudaFree(send);
      cudaFree(recv);
      cudaStreamDestroy(stream);
    });
    for (auto c : comms) ncclCommDestroy(c);
    const double sec = *std::max_element(secs.begin(), secs.end());
    double rows = 0;
    for (int r = 0; r < R; ++r) rows += static_cast<double>(num_recv[r]);
    rows /= R;
    baseline = {
        {"name", "nccl_send_recv_bf16_rows"}, {"time_us", sec * 1e6}, {"logical_gbps", rows * H * 2 / sec / 1e9}};
    for (auto& p : phases) {
      if (p.contains("logical_gbps") && p["name"].get<std::string>().find("fp8") == std::string::npos) {
        p["speedup_vs_nccl"] = sec / (p["time_us"].get<double>() * 1e-6);
      }
    }
  }

  // Low-latency kernels (tools/cuda/bench_low_latency.cpp): their phases join the table, their check the checks.
  nlohmann::json low_latency = run_cuda_ll_bench(config, devices, floor.peer_both_ways_gbps);
  for (const auto& p : low_latency["phases"]) phases.push_back(p);
  checks.push_back(low_latency["check"]);
  passed = passed && low_latency["check"]["mismatches"].get<int64_t>() == 0;

  nlohmann::json report;
  report["backend"] = "cuda";
  report["device"] = fmt::format("{} x {} ({} SMs)", num_gpus, prop.name, prop.multiProcessorCount);
  report["settings"] = {{"num_ranks", R},
                        {"num_tokens", T},
                        {"hidden", H},
                        {"num_topk", K},
                        {"num_experts", E},
                        {"num_sms", config.num_sms},
                        {"warmup", config.num_warmup},
                        {"iters", config.num_iters},
                        {"seed", config.seed},
                        {"timing", "CUDA events per rank, slowest rank, median"},
                        {"x_rotation", "2 copies of x alternate (each larger than L2 at the default shape)"},
                        {"mem_pool_release_threshold", "UINT64_MAX (outputs come from a warm cudaMallocAsync pool)"}};
  report["floor"] = {{"copy_engine_peer_one_way_gbps", floor.peer_one_way_gbps},
                     {"copy_engine_peer_both_ways_gbps_each", floor.peer_both_ways_gbps},
                     {"copy_engine_peer_both_ways_single_copy_gbps", floor.peer_both_ways_single_gbps},
                     {"copy_engine_peer_both_ways_batched_gbps", floor.peer_both_ways_batched_gbps},
                     {"local_copy_gbps", floor.local_gbps}};
  report["baseline"] = baseline;
  report["memory"] = memory;
  report["low_latency_settings"] = low_latency["settings"];
  report["phases"] = phases;
  report["check"] = {{"passed", passed}, {"details", checks}};
  return report;
}

}  // namespace epx::cli
