// Helpers of tests/gpu/hierarchical_low_latency_test.cpp: the cases, their random inputs, one rank's rounds on a host
// or cuda buffer with hierarchical low-latency routing, and the element-by-element comparison with the host backend.
// Included by that file only (headers of tests/gpu are not test binaries).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "epx/buffer.h"
#include "epx/cuda.h"
#include "epx/error.h"
#include "epx/quant.h"
#include "testing/gpu_util.h"
#include "testing/routing.h"

namespace epx::hierarchical_low_latency_test {

using testing::download;
using testing::num_gpus;

struct Case {
  int num_ranks = 4;
  int gpus_per_node = 2;  // 0: one node, kHierarchical forced
  int64_t max_tokens = 24;
  int64_t hidden = 1024;
  int num_topk = 4;
  int64_t num_experts = 16;
  bool fp8 = false;
  ScaleFormat scale_format = ScaleFormat::kFloat32;
  bool round_scale = false;
  ScaleLayout scale_layout = ScaleLayout::kRowMajor;
  bool hooks = false;
  int hook_round = -1;  // >= 0: that round uses the hooks too (the others do not unless `hooks`)
  bool topk_int32 = false;
  std::vector<std::pair<int, int>> masked;  // rank pairs that mask each other before the first call
  int rounds = 3;
  bool bf16_partials = false;  // NodePartials::kBFloat16 (on both backends)
  // [round][rank] tokens per rank; empty: drawn per round (T in [0, M], one rank idle). The graph test fixes them: a
  // captured call keeps its shapes.
  std::vector<std::vector<int64_t>> tokens;
  int64_t local_experts() const { return num_experts / num_ranks; }
  int64_t slots() const { return num_ranks * max_tokens; }
};

struct RoundInput {
  int64_t num_tokens = 0;
  std::vector<uint16_t> x;     // [T, H]
  std::vector<int64_t> topk;   // [T, K]
  std::vector<float> weights;  // [T, K]
  std::vector<uint16_t> y;     // [E_local, R * M, H]: the expert outputs the combine returns
};

struct RoundOutput {
  std::vector<int32_t> count, src_info;
  std::vector<int64_t> ranges;
  std::vector<uint8_t> x, scales;
  std::vector<uint16_t> combined;
};

struct RankOutput {
  std::vector<RoundOutput> rounds;
  std::vector<int32_t> cumulative;
};

// [rank][round]
inline std::vector<std::vector<RoundInput>> make_inputs(const Case& c, uint64_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::uniform_int_distribution<int64_t> tokens(0, c.max_tokens);
  std::uniform_real_distribution<float> val(-4.f, 4.f), wdist(-1.f, 1.f);
  std::vector<std::vector<RoundInput>> in(c.num_ranks, std::vector<RoundInput>(c.rounds));
  for (int round = 0; round < c.rounds; ++round) {
    const int idle = static_cast<int>(rng() % c.num_ranks);
    for (int r = 0; r < c.num_ranks; ++r) {
      RoundInput& d = in[r][round];
      d.num_tokens = r == idle ? 0 : tokens(rng);
      if (!c.tokens.empty()) d.num_tokens = c.tokens[round][r];
      d.x.resize(d.num_tokens * c.hidden);
      for (auto& v : d.x) v = float_to_bf16(val(rng));
      // NOTE: K distinct experts, so no (expert, source) block exceeds M pairs.
      d.topk = testing::random_distinct_topk(rng, d.num_tokens, c.num_topk, c.num_experts, 0.15);
      d.weights.resize(d.topk.size());
      for (auto& w : d.weights) w = wdist(rng);
      d.y.resize(c.local_experts() * c.slots() * c.hidden);
      for (auto& v : d.y) v = float_to_bf16(val(rng));
    }
  }
  return in;
}

inline Tensor input(bool host, const void* p, size_t bytes, DType dtype, std::vector<int64_t> shape, Device dev,
                    Stream stream) {
  if (host) return Tensor::wrap(TensorView::of(const_cast<void*>(p), dtype, std::move(shape)), nullptr);
  return testing::upload(p, bytes, dtype, std::move(shape), dev, stream);
}

template <typename T>
inline std::vector<T> fetch(bool host, const Tensor& t, Stream stream) {
  if (!t.defined()) return {};
  if (!host) return download<T>(t, stream);
  return std::vector<T>(t.data_as<const T>(), t.data_as<const T>() + t.nbytes() / sizeof(T));
}

// One round's tensors: inputs x, topk, weights, the expert outputs y and the combine's out.
struct RoundTensors {
  Tensor x, topk, weights, y, out;
};

// The dispatch and combine arguments of one round of case c (hooks or not) on `stream`.
inline LowLatencyDispatchArgs round_dispatch_args(const Case& c, const RoundTensors& t, bool hooks,
                                                  const Tensor& cumulative, Stream stream) {
  LowLatencyDispatchArgs a;
  a.x = t.x;
  a.topk_idx = t.topk;
  a.max_tokens_per_rank = c.max_tokens;
  a.num_experts = c.num_experts;
  a.use_fp8 = c.fp8;
  a.scale_format = c.scale_format;
  a.round_scale = c.round_scale;
  a.scale_layout = c.scale_layout;
  a.return_recv_hook = hooks;
  a.cumulative_recv_counts = cumulative;
  a.stream = stream;
  return a;
}
inline LowLatencyCombineArgs round_combine_args(const RoundTensors& t, const LowLatencyDispatchResult& res, bool hooks,
                                                Stream stream) {
  LowLatencyCombineArgs b;
  b.x = t.y;
  b.topk_idx = t.topk;
  b.topk_weights = t.weights;
  b.handle = res.handle;
  b.return_recv_hook = hooks;
  b.out = t.out;  // NOTE: given, so the combine allocates nothing (also under capture)
  b.stream = stream;
  return b;
}

// Device copies of one round's results, made on the stream and downloaded after the last round (see run_rank).
struct DeviceRound {
  Tensor count, ranges, src_info, x, scales, combined;
};

// A device copy of `t` enqueued on `stream` (the dispatch outputs live in the buffer, which a later call overwrites).
inline Tensor device_copy(const Tensor& t, Device dev, Stream stream) {
  if (!t.defined() || t.nbytes() == 0) return {};
  Tensor c = Tensor::empty(DType::kUInt8, {static_cast<int64_t>(t.nbytes())}, dev, nullptr, stream);
  cudaMemcpyAsync(c.data(), t.data(), t.nbytes(), cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream));
  return c;
}

// NOTE: on the GPU the rounds only enqueue work: every input is uploaded before the first call and every result is
// downloaded after the last round. With ranks as threads on one GPU a host wait between the calls (a download of the
// dispatch results before the combine, as this test did first) can stall a rank while its peer's kernel spins for
// this rank's next send (1x H200, 2026-12-03: the idle rank entered its combine only after the peer's combine timed
// out); docs/status.md.
inline RankOutput run_rank(const Case& c, const std::vector<RoundInput>& in, const std::shared_ptr<Group>& group,
                           bool host) {
  const Device dev = group->device();
  Stream stream = nullptr;
  if (!host) {
    cudaSetDevice(dev.index);
    cudaStreamCreateWithFlags(reinterpret_cast<cudaStream_t*>(&stream), cudaStreamNonBlocking);
  }
  RankOutput o;
  {
    const int64_t H = c.hidden, K = c.num_topk, E_local = c.local_experts();
    using Inputs = RoundTensors;
    std::vector<Inputs> inputs(c.rounds);
    std::vector<std::vector<int32_t>> topk32(c.rounds);
    std::vector<std::vector<uint16_t>> poison(c.rounds);  // host: written in place
    for (int round = 0; round < c.rounds; ++round) {
      const RoundInput& d = in[round];
      const int64_t T = d.num_tokens;
      Inputs& t = inputs[round];
      t.x = input(host, d.x.data(), d.x.size() * 2, DType::kBFloat16, {T, H}, dev, stream);
      topk32[round].assign(d.topk.begin(), d.topk.end());
      t.topk = c.topk_int32
                   ? input(host, topk32[round].data(), topk32[round].size() * 4, DType::kInt32, {T, K}, dev, stream)
                   : input(host, d.topk.data(), d.topk.size() * 8, DType::kInt64, {T, K}, dev, stream);
      t.weights = input(host, d.weights.data(), d.weights.size() * 4, DType::kFloat32, {T, K}, dev, stream);
      t.y = input(host, d.y.data(), d.y.size() * 2, DType::kBFloat16, {E_local, c.slots(), H}, dev, stream);
      poison[round].assign(T * H, 0xABAB);
      t.out = input(host, poison[round].data(), poison[round].size() * 2, DType::kBFloat16, {T, H}, dev, stream);
    }
    std::vector<int32_t> zeros(E_local, 0);  // host: written in place
    const Tensor cumulative = input(host, zeros.data(), zeros.size() * 4, DType::kInt32, {E_local}, dev, stream);
    if (!host) cudaStreamSynchronize(static_cast<cudaStream_t>(stream));

    BufferOptions options;
    options.allocator = host ? nullptr : std::make_shared<testing::PoisonAllocator>();
    options.num_low_latency_bytes = low_latency_buffer_size_hint(c.max_tokens, c.hidden, c.num_ranks, c.num_experts);
    options.low_latency_routing = c.gpus_per_node == 0 ? LowLatencyRouting::kHierarchical : LowLatencyRouting::kAuto;
    options.node_partials = c.bf16_partials ? NodePartials::kBFloat16 : NodePartials::kFloat32;
    auto buffer = Buffer::create(group, options);
    const int rank = group->rank();
    for (const auto& [a, b] : c.masked) {
      if (rank == a) buffer->mask_rank(b);
      if (rank == b) buffer->mask_rank(a);
    }
    std::vector<DeviceRound> kept(c.rounds);
    for (int round = 0; round < c.rounds; ++round) {
      const bool hooks = c.hooks || round == c.hook_round;
      const Inputs& t = inputs[round];
      LowLatencyDispatchResult res = buffer->low_latency_dispatch(round_dispatch_args(c, t, hooks, cumulative, stream));
      EXPECT_EQ(static_cast<bool>(res.recv_hook), hooks);
      if (hooks) res.recv_hook();
      RoundOutput ro;
      DeviceRound& k = kept[round];
      if (host) {
        ro.count = fetch<int32_t>(host, res.recv_count, stream);
        ro.ranges = fetch<int64_t>(host, res.recv_layout_range, stream);
        ro.src_info = fetch<int32_t>(host, res.recv_src_info, stream);
        ro.x = fetch<uint8_t>(host, res.recv_x, stream);
        ro.scales = fetch<uint8_t>(host, res.recv_x_scales, stream);
      } else {
        k.count = device_copy(res.recv_count, dev, stream);
        k.ranges = device_copy(res.recv_layout_range, dev, stream);
        k.src_info = device_copy(res.recv_src_info, dev, stream);
        k.x = device_copy(res.recv_x, dev, stream);
        k.scales = device_copy(res.recv_x_scales, dev, stream);
      }
      LowLatencyCombineResult comb = buffer->low_latency_combine(round_combine_args(t, res, hooks, stream));
      if (hooks) comb.recv_hook();
      if (host) {
        ro.combined = fetch<uint16_t>(host, comb.x, stream);
      } else {
        k.combined = comb.x;  // t.out: this rank's tensor, kept until the download below
      }
      o.rounds.push_back(std::move(ro));
    }
    if (!host) {
      for (int round = 0; round < c.rounds; ++round) {
        const DeviceRound& k = kept[round];
        RoundOutput& ro = o.rounds[round];
        auto bytes_as = [&](const Tensor& t, auto tag) {
          using T = decltype(tag);
          const std::vector<uint8_t> raw = download<uint8_t>(t, stream);
          std::vector<T> v(raw.size() / sizeof(T));
          if (!raw.empty()) std::memcpy(v.data(), raw.data(), raw.size());
          return v;
        };
        ro.count = bytes_as(k.count, int32_t{});
        ro.ranges = bytes_as(k.ranges, int64_t{});
        ro.src_info = bytes_as(k.src_info, int32_t{});
        ro.x = bytes_as(k.x, uint8_t{});
        ro.scales = bytes_as(k.scales, uint8_t{});
        ro.combined = fetch<uint16_t>(host, k.combined, stream);
      }
    }
    o.cumulative = fetch<int32_t>(host, cumulative, stream);
    if (!host) cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
  }  // NOTE: tensors free on `stream`: release them before destroying it
  if (!host) cudaStreamDestroy(static_cast<cudaStream_t>(stream));
  return o;
}

inline std::vector<RankOutput> run_case(const Case& c, const std::vector<std::vector<RoundInput>>& in,
                                        const std::vector<std::shared_ptr<Group>>& groups, bool host) {
  std::vector<RankOutput> out(groups.size());
  run_host_ranks(groups, [&](int r, Group&) { out[r] = run_rank(c, in[r], groups[r], host); });
  return out;
}

// Scale units per row of recv_x_scales and their bytes (ScaleLayout): fp32 scales (also round_scale), UE8M0
// exponent bytes row-major, int32 words of four exponents column-major.
inline std::pair<int64_t, int64_t> scale_units(const Case& c) {
  if (c.scale_format == ScaleFormat::kFloat32) return {c.hidden / 128, 4};
  if (c.scale_layout == ScaleLayout::kColumnMajor) return {c.hidden / 512, 4};
  return {c.hidden / 128, 1};
}

inline void compare_round(const Case& c, const RoundOutput& w, const RoundOutput& g) {
  ASSERT_EQ(g.count, w.count) << "recv_count";
  EXPECT_EQ(g.ranges, w.ranges) << "recv_layout_range";
  EXPECT_EQ(g.src_info, w.src_info) << "recv_src_info";
  const int64_t RM = c.slots(), row_bytes = c.hidden * (c.fp8 ? 1 : 2);
  ASSERT_EQ(g.x.size(), w.x.size());
  const auto [units, unit_bytes] = scale_units(c);
  if (c.fp8) {
    ASSERT_EQ(g.scales.size(), w.scales.size());
  }
  int64_t bad_rows = 0, bad_scales = 0;
  for (int64_t e = 0; e < c.local_experts(); ++e) {
    for (int64_t row = 0; row < w.count[e]; ++row) {
      const int64_t at = (e * RM + row) * row_bytes;
      if (std::memcmp(g.x.data() + at, w.x.data() + at, row_bytes) != 0 && bad_rows++ < 4) {
        ADD_FAILURE() << "recv_x[" << e << "][" << row << "] differs";
      }
      for (int64_t u = 0; c.fp8 && u < units; ++u) {
        const int64_t i =
            c.scale_layout == ScaleLayout::kColumnMajor ? (e * units + u) * RM + row : (e * RM + row) * units + u;
        if (std::memcmp(g.scales.data() + i * unit_bytes, w.scales.data() + i * unit_bytes, unit_bytes) != 0 &&
            bad_scales++ < 4) {
          ADD_FAILURE() << "recv_x_scales of expert " << e << " row " << row << " unit " << u << " differ";
        }
      }
    }
  }
  EXPECT_EQ(bad_rows, 0);
  EXPECT_EQ(bad_scales, 0);
  ASSERT_EQ(g.combined.size(), w.combined.size());
  int64_t bad = 0;
  for (size_t i = 0; i < w.combined.size(); ++i) {
    if (g.combined[i] != w.combined[i] && bad++ < 4) {
      ADD_FAILURE() << "combined[" << i / c.hidden << "][" << i % c.hidden << "] = " << bf16_to_float(g.combined[i])
                    << ", host " << bf16_to_float(w.combined[i]);
    }
  }
  EXPECT_EQ(bad, 0) << "combine output differs (bits)";
}

// Every round of rank r and its cumulative counts.
inline void compare_rank(const Case& c, int r, const RankOutput& want, const RankOutput& got) {
  ASSERT_EQ(got.rounds.size(), want.rounds.size()) << "rank " << r;
  for (int round = 0; round < c.rounds; ++round) {
    SCOPED_TRACE("rank " + std::to_string(r) + " round " + std::to_string(round));
    compare_round(c, want.rounds[round], got.rounds[round]);
  }
  EXPECT_EQ(got.cumulative, want.cumulative) << "cumulative_recv_counts, rank " << r;
}

// The host backend's results of every rank (the oracle), on host groups of the case's topology.
inline std::vector<RankOutput> host_results(const Case& c, const std::vector<std::vector<RoundInput>>& in) {
  HostGroupOptions ho;
  ho.gpus_per_node = c.gpus_per_node;
  return run_case(c, in, create_host_groups(c.num_ranks, ho), true);
}

inline CudaGroupOptions cuda_options(const Case& c) {
  CudaGroupOptions co;
  co.timeout_ms = 20'000;
  // Shorter for repeated runs that hunt a hang (a failing repetition then costs seconds, not 20 s).
  if (const char* ms = std::getenv("EPX_TEST_TIMEOUT_MS")) co.timeout_ms = std::atoi(ms);
  co.gpus_per_node = c.gpus_per_node;
  return co;
}

inline void run_and_compare(const Case& c) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const auto in = make_inputs(c, seed);
  const auto want = host_results(c, in);
  std::vector<int> devices(c.num_ranks);
  for (int r = 0; r < c.num_ranks; ++r) devices[r] = r % num_gpus();
  const auto got = run_case(c, in, create_cuda_groups(devices, cuda_options(c)), false);
  for (int r = 0; r < c.num_ranks; ++r) compare_rank(c, r, want[r], got[r]);
}

inline Case make_case(int num_ranks, int gpus_per_node) {
  Case c;
  c.num_ranks = num_ranks;
  c.gpus_per_node = gpus_per_node;
  return c;
}

}  // namespace epx::hierarchical_low_latency_test
