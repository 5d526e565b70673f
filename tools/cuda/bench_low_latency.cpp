// `epx bench` on GPUs, low-latency part: fp8 dispatch and bf16 combine through the public Buffer API, one
// thread per rank, each call timed as a CUDA graph of kInner back-to-back calls (launch skew between the
// ranks amortized), plus the send and receive halves of eager calls with return_recv_hook (events around
// each half), a floor from the copy-engine peer bandwidth measured in the same run, an NCCL send/recv
// baseline of the same bytes, and a check that combine(dispatch(x)) of identity experts gives back x.
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <set>

#include "bench.h"
#include "cuda/bench_util.h"
#include "epx/buffer.h"
#include "epx/cuda.h"
#include "epx/error.h"
#include "epx/quant.h"

namespace epx::cli {
namespace {

constexpr int kInner = 20;  // calls per graph
constexpr int kBlock = 128;

struct LlRankData {
  std::vector<uint16_t> x;    // [T, H] small integers (sums of identity experts are exact)
  std::vector<int64_t> topk;  // [T, K] distinct experts
  std::vector<float> weights;
  int64_t pairs_to_peers = 0;  // (token, expert) pairs whose expert lives on another rank
};

LlRankData make_ll_data(int64_t T, int64_t H, int K, int64_t E, int R, int rank, std::mt19937_64& rng) {
  LlRankData d;
  std::uniform_int_distribution<int> value(-8, 8);
  d.x.resize(T * H);
  for (auto& v : d.x) v = float_to_bf16(static_cast<float>(value(rng)));
  d.topk = random_distinct_topk(rng, T, K, E);
  for (int64_t e : d.topk) d.pairs_to_peers += e / (E / R) != rank;
  d.weights.assign(T * K, 0.125f);
  return d;
}

// Median time per call (us) of `launch`, which enqueues kInner calls; the ranks meet before each repetition
// (outside the events).
template <typename Launch>
double per_call_us(Group& g, cudaStream_t stream, int warmup, int iters, Launch launch) {
  const double ms = median_event_ms(
      stream, warmup, iters, [&](int) { g.barrier(); }, [&](int) { launch(); });
  return ms * 1e3 / kInner;
}

// `body` captured kInner times into one graph per rank and replayed.
template <typename Body>
double graph_time(const char* what, Group& g, cudaStream_t stream, int warmup, int iters, Body body) {
  cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  for (int i = 0; i < kInner; ++i) body();
  cudaGraph_t graph;
  const cudaError_t captured = cudaStreamEndCapture(stream, &graph);
  if (captured != cudaSuccess) {
    throw Error(ErrorCode::kCudaError,
                fmt::format("capturing {} into a CUDA graph failed: {}", what, cudaGetErrorString(captured)));
  }
  cudaGraphExec_t exec;
  cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  cudaGraphDestroy(graph);
  const double us =
      per_call_us(g, stream, warmup, iters, [&] { cuda_ok(cudaGraphLaunch(exec, stream), "cudaGraphLaunch"); });
  cudaGraphExecDestroy(exec);
  return us;
}

// `body` called kInner times eagerly.
template <typename Body>
double eager_time(Group& g, cudaStream_t stream, int warmup, int iters, Body body) {
  return per_call_us(g, stream, warmup, iters, [&] {
    for (int i = 0; i < kInner; ++i) body();
  });
}

// Median times (us) of the two halves of an eager call: send = the call itself, receive = the hook.
template <typename Call>
std::pair<double, double> half_times(Group& g, cudaStream_t stream, int warmup, int iters, Call call) {
  EventTimer timer(3);
  std::vector<double> send, recv;
  for (int rep = 0; rep < warmup + iters; ++rep) {
    g.barrier();
    timer.record(0, stream);
    std::function<void()> hook = call();
    timer.record(1, stream);
    hook();
    timer.record(2, stream);
    const double b = timer.elapsed_ms(1, 2);
    const double a = timer.elapsed_ms(0, 1);
    if (rep >= warmup) {
      send.push_back(a * 1e3);
      recv.push_back(b * 1e3);
    }
  }
  return {median(send), median(recv)};
}

struct LlTimes {
  double dispatch = 0, combine = 0, round_trip = 0;
  double dispatch_send = 0, dispatch_recv = 0, combine_send = 0, combine_recv = 0;
  double nccl = 0;
  int64_t mismatches = 0;
};

}  // namespace

nlohmann::json run_cuda_ll_bench(const BenchConfig& config, const std::vector<int>& devices, double peer_gbps) {
  const int R = static_cast<int>(devices.size());
  const int64_t H = config.hidden, E = config.num_experts;
  const int K = config.num_topk;
  std::set<int64_t> token_set = {1, 32, 64, 128, 256, config.num_ll_tokens};
  const std::vector<int64_t> tokens(token_set.begin(), token_set.end());
  const int64_t M = tokens.back();  // max_tokens_per_rank of the buffer
  const int64_t E_local = E / R;
  const int warm = config.num_warmup, iters = config.num_iters;
  if (config.progress) std::fprintf(stderr, "[epx bench] cuda backend, %d ranks: low-latency kernels\n", R);

  std::vector<std::vector<LlTimes>> times(tokens.size(), std::vector<LlTimes>(R));
  std::vector<std::vector<LlRankData>> data(tokens.size());
  std::mt19937_64 rng(config.seed + 17);
  for (size_t i = 0; i < tokens.size(); ++i) {
    for (int r = 0; r < R; ++r) data[i].push_back(make_ll_data(tokens[i], H, K, E, R, r, rng));
  }

  // NCCL baseline: each rank's fp8 pairs for peer experts (data + fp32 scales) through ncclSend/ncclRecv,
  // packing not counted. One rank per GPU only.
  std::vector<ncclComm_t> comms;
  int num_gpus = 0;
  cuda_ok(cudaGetDeviceCount(&num_gpus), "cudaGetDeviceCount");
  const bool with_nccl = R >= 2 && R == num_gpus;
  if (with_nccl) {
    comms.resize(R);
    if (ncclCommInitAll(comms.data(), R, devices.data()) != ncclSuccess)
      throw Error(ErrorCode::kNcclError, "ncclCommInitAll failed (low-latency baseline)");
  }

  auto groups = create_cuda_groups(devices);
  run_host_ranks(groups, [&](int r, Group& g) {
    cuda_ok(cudaSetDevice(g.device().index), "cudaSetDevice");
    cudaStream_t stream;
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    BufferOptions options;
    options.num_low_latency_bytes = low_latency_buffer_size_hint(M, H, R, E);
    auto buffer = Buffer::create(groups[r], tuned_from_env(options));
    const int64_t pair_bytes = H + H / kBlock * 4;
    for (size_t ti = 0; ti < tokens.size(); ++ti) {
      const int64_t T = tokens[ti];
      const auto& d = data[ti][r];
      auto up = [&](const void* p, size_t bytes, DType dt, std::vector<int64_t> shape) {
        Tensor t = Tensor::empty(dt, shape, g.device(), nullptr, stream);
        if (bytes > 0) cuda_ok(cudaMemcpyAsync(t.data(), p, bytes, cudaMemcpyHostToDevice, stream), "upload");
        return t;
      };
      Tensor x = up(d.x.data(), d.x.size() * 2, DType::kBFloat16, {T, H});
      Tensor topk = up(d.topk.data(), d.topk.size() * 8, DType::kInt64, {T, K});
      Tensor w = up(d.weights.data(), d.weights.size() * 4, DType::kFloat32, {T, K});
      Tensor out = Tensor::empty(DType::kBFloat16, {T, H}, g.device(), nullptr, stream);
      // Expert outputs for the combine timing: any bf16 values of the right shape.
      Tensor y = Tensor::empty(DType::kBFloat16, {E_local, R * M, H}, g.device(), nullptr, stream);
      cuda_ok(cudaMemsetAsync(y.data(), 0x3c, y.nbytes(), stream), "cudaMemsetAsync");
      cuda_ok(cudaStreamSynchronize(stream), "sync");
      auto dispatch = [&](bool fp8, bool hook) {
        LowLatencyDispatchArgs a;
        a.x = x;
        a.topk_idx = topk;
        a.max_tokens_per_rank = M;
        a.num_experts = E;
        a.use_fp8 = fp8;
        a.return_recv_hook = hook;
        a.stream = stream;
        return buffer->low_latency_dispatch(a);
      };
      auto combine = [&](const TensorView& expert_out, const LowLatencyDispatchResult& res, bool hook) {
        LowLatencyCombineArgs a;
        a.x = expert_out;
        a.topk_idx = topk;
        a.topk_weights = w;
        a.handle = res.handle;
        a.out = out;
        a.return_recv_hook = hook;
        a.stream = stream;
        return buffer->low_latency_combine(a);
      };
      LlTimes& tm = times[ti][r];

      // Check: bf16 dispatch, identity experts (recv_x as the expert output), combine: out = x * sum of w.
      {
        g.barrier();
        auto res = dispatch(false, false);
        auto comb = combine(res.recv_x, res, false);
        std::vector<uint16_t> got(T * H);
        if (!got.empty())
          cuda_ok(cudaMemcpyAsync(got.data(), out.data(), got.size() * 2, cudaMemcpyDeviceToHost, stream), "download");
        cuda_ok(cudaStreamSynchronize(stream), "sync");
        for (int64_t t = 0; t < T; ++t) {
          const float scale = 0.125f * static_cast<float>(K);
          for (int64_t c = 0; c < H; ++c) {
            tm.mismatches += bf16_to_float(got[t * H + c]) != bf16_to_float(d.x[t * H + c]) * scale;
          }
        }
      }

      g.barrier();
      tm.dispatch = graph_time("low-latency dispatch", g, stream, warm, iters, [&] { dispatch(true, false); });
      auto res = dispatch(true, false);
      g.barrier();
      tm.combine = graph_time("low-latency combine", g, stream, warm, iters, [&] { combine(y, res, false); });
      g.barrier();
      tm.round_trip = graph_time("low-latency dispatch + combine", g, stream, warm, iters, [&] {
        auto rd = dispatch(true, false);
        combine(y, rd, false);
      });
      std::tie(tm.dispatch_send, tm.dispatch_recv) =
          half_times(g, stream, warm, iters, [&] { return dispatch(true, true).recv_hook; });
      res = dispatch(true, false);
      std::tie(tm.combine_send, tm.combine_recv) =
          half_times(g, stream, warm, iters, [&] { return combine(y, res, true).recv_hook; });

      if (with_nccl) {
        // Per destination: the pairs bound for that rank, as fp8 rows with their scales.
        std::vector<int64_t> send_pairs(R, 0), recv_pairs(R, 0);
        for (int q = 0; q < R; ++q) {
          for (int64_t e : d.topk) send_pairs[q] += e / E_local == q;
          for (int64_t e : data[ti][q].topk) recv_pairs[q] += e / E_local == r;
        }
        Tensor sbuf =
            Tensor::empty(DType::kUInt8, {std::max<int64_t>(1, T * K * pair_bytes)}, g.device(), nullptr, stream);
        Tensor rbuf =
            Tensor::empty(DType::kUInt8, {std::max<int64_t>(1, R * T * K * pair_bytes)}, g.device(), nullptr, stream);
        g.barrier();
        // NOTE: eager (not a graph): kInner send/recv rounds between two events.
        tm.nccl = eager_time(g, stream, warm, iters, [&] {
          ncclGroupStart();
          int64_t off = 0, roff = 0;
          for (int q = 0; q < R; ++q) {
            if (q == r) continue;
            ncclSend(static_cast<char*>(sbuf.data()) + off, send_pairs[q] * pair_bytes, ncclChar, q, comms[r], stream);
            ncclRecv(static_cast<char*>(rbuf.data()) + roff, recv_pairs[q] * pair_bytes, ncclChar, q, comms[r], stream);
            off += send_pairs[q] * pair_bytes;
            roff += recv_pairs[q] * pair_bytes;
          }
          ncclGroupEnd();
        });
      }
      cuda_ok(cudaStreamSynchronize(stream), "sync");
    }
    buffer.reset();
    cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
  });
  for (auto c : comms) ncclCommDestroy(c);

  nlohmann::json phases = nlohmann::json::array();
  int64_t bad = 0;
  for (size_t ti = 0; ti < tokens.size(); ++ti) {
    auto worst = [&](double LlTimes::*field) {
      double m = 0;
      for (const auto& t : times[ti]) m = std::max(m, t.*field);
      return m;
    };
    int64_t pairs = 0;
    for (const auto& d : data[ti]) pairs = std::max(pairs, d.pairs_to_peers);
    // Floor: the most bytes any rank sends to peers, at the copy-engine rate (both directions at once).
    auto floor_us = [&](double bytes) { return peer_gbps > 0 ? bytes / (peer_gbps * 1e9) * 1e6 : 0.0; };
    const double fp8_floor = floor_us(static_cast<double>(pairs) * (H + H / kBlock * 4));
    const double bf16_floor = floor_us(static_cast<double>(pairs) * H * 2);
    auto phase = [&](const std::string& name, double us, double floor) {
      nlohmann::json j = {
          {"name", fmt::format("{} ({} tokens)", name, tokens[ti])}, {"num_tokens", tokens[ti]}, {"time_us", us}};
      if (floor > 0) {
        j["floor_us"] = floor;
        j["fraction_of_floor"] = floor / us;
      }
      return j;
    };
    const double nccl = worst(&LlTimes::nccl);
    auto with_baseline = [&](nlohmann::json j) {
      if (nccl > 0) {
        j["nccl_baseline_us"] = nccl;
        j["speedup_vs_nccl"] = nccl / j["time_us"].get<double>();
      }
      return j;
    };
    phases.push_back(with_baseline(phase("ll_dispatch_fp8", worst(&LlTimes::dispatch), fp8_floor)));
    phases.push_back(phase("ll_combine_bf16", worst(&LlTimes::combine), bf16_floor));
    phases.push_back(phase("ll_dispatch_combine", worst(&LlTimes::round_trip), fp8_floor + bf16_floor));
    phases.push_back(phase("ll_dispatch_send_half (eager)", worst(&LlTimes::dispatch_send), 0));
    phases.push_back(phase("ll_dispatch_recv_half (eager)", worst(&LlTimes::dispatch_recv), 0));
    phases.push_back(phase("ll_combine_send_half (eager)", worst(&LlTimes::combine_send), 0));
    phases.push_back(phase("ll_combine_recv_half (eager)", worst(&LlTimes::combine_recv), 0));
    for (const auto& t : times[ti]) bad += t.mismatches;
  }
  nlohmann::json out;
  out["settings"] = {
      {"max_tokens_per_rank", M},
      {"timing", fmt::format("CUDA graph of {} calls per rank, median per call, slowest rank; halves: "
                             "eager calls with return_recv_hook, events around each half",
                             kInner)},
      {"floor", "pairs sent to peers x bytes per pair / copy-engine peer bandwidth (both ways)"},
      {"nccl_baseline", with_nccl
                            ? "fp8 pairs + fp32 scales per peer via ncclSend/ncclRecv, eager, 20 rounds between events"
                            : "not run (needs one rank per GPU)"}};
  out["phases"] = phases;
  out["check"] = {{"name", "low-latency combine(dispatch(x)) of identity experts == x * sum(w) (bf16, every element)"},
                  {"mismatches", bad}};
  return out;
}

}  // namespace epx::cli
