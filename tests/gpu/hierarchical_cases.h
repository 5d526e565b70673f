// Helpers of tests/gpu/hierarchical_test.cpp: the cases, their random inputs, one rank's calls on a host or cuda
// buffer with hierarchical routing, and the element-by-element comparison with the host backend. Included by that
// file only (headers of tests/gpu are not test binaries).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "epx/buffer.h"
#include "epx/cuda.h"
#include "epx/error.h"
#include "epx/quant.h"
#include "testing/gpu_util.h"
#include "testing/routing.h"

namespace epx::hierarchical_test {

using testing::download;

using testing::PoisonAllocator;

struct Case {
  int num_ranks = 4;
  int gpus_per_node = 2;  // 0: one node (kHierarchical forced there)
  std::vector<int64_t> tokens;
  int64_t hidden = 1024;
  int num_topk = 8;
  int64_t num_experts = 64;
  double p_masked = 0.15;
  bool fp8 = false;
  ScaleFormat scale_format = ScaleFormat::kFloat32;
  bool column_major_scales = false;
  bool topk_int32 = false;
  bool weights = true;
  bool biases = true;
  bool pass_layout = false;  // DispatchArgs::layout from get_dispatch_layout (and compare num_tokens_per_node)
  int expert_alignment = 1;
  int64_t num_worst_tokens = 0;
  bool cached = false;         // a cached dispatch of new data follows, and the combine reverses it
  bool bf16_partials = false;  // NodePartials::kBFloat16 (on both backends)
};

struct RankInput {
  std::vector<uint8_t> x, x2, scales;  // x2: the cached dispatch's data
  std::vector<int64_t> topk;
  std::vector<float> weights;
  std::vector<uint16_t> bias_0, bias_1;
};

struct RankOutput {
  int64_t num_rows = 0;
  std::vector<uint8_t> x, scales, cached_x;
  std::vector<int64_t> topk;
  std::vector<float> weights, combined_weights;
  std::vector<int32_t> src_idx, cached_src_idx, per_expert_host, per_expert_device, rank_prefix, per_node;
  std::vector<uint16_t> combined;
};

inline DType scale_dtype(const Case& c) {
  return c.scale_format == ScaleFormat::kFloat32 ? DType::kFloat32 : DType::kUInt8;
}

inline std::vector<uint8_t> random_x(const Case& c, std::mt19937& rng, int64_t T, std::vector<uint8_t>* scales) {
  std::uniform_real_distribution<float> val(-4.f, 4.f);
  const int64_t H = c.hidden;
  std::vector<uint16_t> bf(T * H);
  for (auto& v : bf) v = float_to_bf16(val(rng));
  if (!c.fp8)
    return std::vector<uint8_t>(reinterpret_cast<uint8_t*>(bf.data()),
                                reinterpret_cast<uint8_t*>(bf.data()) + bf.size() * 2);
  std::vector<uint8_t> x(T * H);
  std::vector<uint8_t> s(T * (H / 128) * dtype_size(scale_dtype(c)));
  quantize_fp8_host(TensorView::of(bf.data(), DType::kBFloat16, {T, H}),
                    TensorView::of(x.data(), DType::kFloat8E4M3, {T, H}),
                    TensorView::of(s.data(), scale_dtype(c), {T, H / 128}), c.scale_format);
  if (scales != nullptr) *scales = std::move(s);
  return x;
}

inline std::vector<RankInput> make_inputs(const Case& c, uint64_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::uniform_real_distribution<float> val(-4.f, 4.f), wdist(0.f, 1.f);
  std::vector<RankInput> in(c.num_ranks);
  for (int r = 0; r < c.num_ranks; ++r) {
    const int64_t T = c.tokens[r];
    in[r].x = random_x(c, rng, T, &in[r].scales);
    in[r].x2 = random_x(c, rng, T, nullptr);  // cached dispatch: new data, the first dispatch's scales
    in[r].topk = testing::random_distinct_topk(rng, T, c.num_topk, c.num_experts, c.p_masked);
    in[r].weights.resize(T * c.num_topk);
    for (auto& w : in[r].weights) w = wdist(rng);
    in[r].bias_0.resize(T * c.hidden);
    in[r].bias_1.resize(T * c.hidden);
    for (auto& v : in[r].bias_0) v = float_to_bf16(val(rng));
    for (auto& v : in[r].bias_1) v = float_to_bf16(val(rng));
  }
  return in;
}

// A tensor of the rank's input: a CPU view (host) or a device copy on `stream`.
inline Tensor input(bool host, const void* p, size_t bytes, DType dtype, std::vector<int64_t> shape, Device dev,
                    Stream stream) {
  if (host) return Tensor::wrap(TensorView::of(const_cast<void*>(p), dtype, shape), nullptr);
  return testing::upload(p, bytes, dtype, std::move(shape), dev, stream);
}

template <typename T>
inline std::vector<T> fetch(bool host, const Tensor& t, Stream stream) {
  if (!host) return download<T>(t, stream);
  if (!t.defined()) return {};
  return std::vector<T>(t.data_as<const T>(), t.data_as<const T>() + t.nbytes() / sizeof(T));
}

inline std::vector<int64_t> widen(bool host, const Tensor& t, Stream stream) {
  if (!t.defined()) return {};
  if (t.dtype() == DType::kInt64) return fetch<int64_t>(host, t, stream);
  const auto v = fetch<int32_t>(host, t, stream);
  return std::vector<int64_t>(v.begin(), v.end());
}

// One rank's calls: [get_dispatch_layout], dispatch, [cached dispatch of x2], combine (bf16: identity experts).
inline RankOutput run_rank(const Case& c, const RankInput& in, const std::shared_ptr<Group>& group, bool host) {
  const Device dev = group->device();
  Stream stream = nullptr;
  if (!host) {
    cudaSetDevice(dev.index);
    cudaStreamCreateWithFlags(reinterpret_cast<cudaStream_t*>(&stream), cudaStreamNonBlocking);
  }
  RankOutput o;
  {
    BufferOptions options;
    options.allocator = std::make_shared<PoisonAllocator>();
    options.normal_routing = NormalRouting::kHierarchical;
    options.node_partials = c.bf16_partials ? NodePartials::kBFloat16 : NodePartials::kFloat32;
    auto buffer = Buffer::create(group, options);
    const int64_t T = static_cast<int64_t>(in.topk.size()) / c.num_topk, H = c.hidden, K = c.num_topk;
    const DType xt = c.fp8 ? DType::kFloat8E4M3 : DType::kBFloat16;
    const Tensor x = input(host, in.x.data(), in.x.size(), xt, {T, H}, dev, stream);
    const Tensor x2 = input(host, in.x2.data(), in.x2.size(), xt, {T, H}, dev, stream);
    Tensor scales;
    std::vector<uint8_t> scales_t;  // [S, T] storage of column-major scales
    const int64_t S = H / 128;
    if (c.fp8 && !c.column_major_scales) {
      scales = input(host, in.scales.data(), in.scales.size(), scale_dtype(c), {T, S}, dev, stream);
    } else if (c.fp8) {
      const size_t e = dtype_size(scale_dtype(c));
      scales_t.resize(in.scales.size());
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t j = 0; j < S; ++j) std::memcpy(&scales_t[(j * T + t) * e], &in.scales[(t * S + j) * e], e);
      }
      const Tensor storage = input(host, scales_t.data(), scales_t.size(), scale_dtype(c), {S, T}, dev, stream);
      TensorView v = storage.view();
      v.shape[0] = T;
      v.shape[1] = S;
      v.strides[0] = 1;
      v.strides[1] = T;
      scales = Tensor::wrap(v, std::make_shared<Tensor>(storage));
    }
    std::vector<int32_t> topk32(in.topk.begin(), in.topk.end());
    const Tensor topk = c.topk_int32
                            ? input(host, topk32.data(), topk32.size() * 4, DType::kInt32, {T, K}, dev, stream)
                            : input(host, in.topk.data(), in.topk.size() * 8, DType::kInt64, {T, K}, dev, stream);
    const Tensor weights = input(host, in.weights.data(), in.weights.size() * 4, DType::kFloat32, {T, K}, dev, stream);
    const Tensor bias_0 = input(host, in.bias_0.data(), in.bias_0.size() * 2, DType::kBFloat16, {T, H}, dev, stream);
    const Tensor bias_1 = input(host, in.bias_1.data(), in.bias_1.size() * 2, DType::kBFloat16, {T, H}, dev, stream);
    Layout layout;
    if (c.pass_layout) {
      layout = buffer->get_dispatch_layout(topk, c.num_experts, stream);
      o.per_node = fetch<int32_t>(host, layout.num_tokens_per_node, stream);
    }
    DispatchArgs a;
    a.x = x;
    if (c.fp8) a.x_scales = scales;
    a.topk_idx = topk;
    if (c.weights) a.topk_weights = weights;
    a.num_experts = c.num_experts;
    a.layout = c.pass_layout ? &layout : nullptr;
    a.expert_alignment = c.expert_alignment;
    a.num_worst_tokens = c.num_worst_tokens;
    a.stream = stream;
    DispatchResult res = buffer->dispatch(a);
    o.num_rows = res.recv_x.size(0);
    o.x = fetch<uint8_t>(host, res.recv_x, stream);
    o.scales = fetch<uint8_t>(host, res.recv_x_scales, stream);
    o.topk = widen(host, res.recv_topk_idx, stream);
    o.weights = fetch<float>(host, res.recv_topk_weights, stream);
    o.src_idx = fetch<int32_t>(host, res.recv_src_idx, stream);
    o.per_expert_host = res.num_recv_tokens_per_expert;
    o.per_expert_device = fetch<int32_t>(host, res.recv_expert_counts, stream);
    o.rank_prefix = fetch<int32_t>(host, res.rank_prefix_matrix, stream);
    std::shared_ptr<const DispatchHandle> handle = res.handle;
    Tensor combine_x = res.recv_x;
    if (c.cached) {
      DispatchArgs b;
      b.x = x2;
      if (c.fp8) b.x_scales = scales;
      b.handle = res.handle;
      b.num_worst_tokens = c.num_worst_tokens;
      b.stream = stream;
      DispatchResult again = buffer->dispatch(b);
      EXPECT_FALSE(again.recv_topk_idx.defined());
      o.cached_x = fetch<uint8_t>(host, again.recv_x, stream);
      o.cached_src_idx = fetch<int32_t>(host, again.recv_src_idx, stream);
      handle = again.handle;
      combine_x = again.recv_x;
    }
    if (!c.fp8) {
      CombineArgs ca;
      ca.x = combine_x;
      if (c.weights) ca.topk_weights = res.recv_topk_weights;
      if (c.biases) {
        ca.bias_0 = bias_0;
        ca.bias_1 = bias_1;
      }
      ca.handle = handle;
      ca.stream = stream;
      CombineResult comb = buffer->combine(ca);
      o.combined = fetch<uint16_t>(host, comb.x, stream);
      o.combined_weights = fetch<float>(host, comb.topk_weights, stream);
    }
    if (!host) cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
  }  // NOTE: tensors free on `stream`: release them before destroying it
  if (!host) {
    cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
    cudaStreamDestroy(static_cast<cudaStream_t>(stream));
  }
  return o;
}

inline std::vector<RankOutput> run_case(const Case& c, const std::vector<RankInput>& in,
                                        const std::vector<std::shared_ptr<Group>>& groups, bool host) {
  std::vector<RankOutput> out(groups.size());
  run_host_ranks(groups, [&](int r, Group&) { out[r] = run_rank(c, in[r], groups[r], host); });
  return out;
}

inline std::vector<std::shared_ptr<Group>> host_groups(const Case& c) {
  HostGroupOptions o;
  o.gpus_per_node = c.gpus_per_node;
  return create_host_groups(c.num_ranks, o);
}

inline void compare_rank(const Case& c, const RankOutput& w, const RankOutput& g) {
  ASSERT_EQ(g.num_rows, w.num_rows);
  EXPECT_EQ(g.per_expert_host, w.per_expert_host);
  EXPECT_EQ(g.per_expert_device, w.per_expert_device);
  EXPECT_EQ(g.rank_prefix, w.rank_prefix) << "rank_prefix_matrix differs";
  EXPECT_EQ(g.per_node, w.per_node) << "num_tokens_per_node differs";
  int64_t real = 0;  // real rows: those with a source index on the host side
  while (real < static_cast<int64_t>(w.src_idx.size()) && w.src_idx[real] >= 0) ++real;
  const int64_t row_bytes = c.hidden * (c.fp8 ? 1 : 2);
  ASSERT_GE(static_cast<int64_t>(g.x.size()), real * row_bytes);
  EXPECT_EQ(std::memcmp(g.x.data(), w.x.data(), real * row_bytes), 0) << "recv_x differs";
  if (c.fp8) {
    const int64_t sb = static_cast<int64_t>(w.scales.size()) / std::max<int64_t>(w.num_rows, 1);
    ASSERT_EQ(g.scales.size(), w.scales.size());
    EXPECT_EQ(std::memcmp(g.scales.data(), w.scales.data(), real * sb), 0) << "recv_x_scales differ";
  }
  EXPECT_EQ(g.src_idx, w.src_idx);
  EXPECT_EQ(g.topk, w.topk);
  ASSERT_EQ(g.weights.size(), w.weights.size());
  EXPECT_EQ(std::memcmp(g.weights.data(), w.weights.data(), w.weights.size() * 4), 0) << "recv_topk_weights differ";
  if (c.cached) {
    ASSERT_EQ(g.cached_x.size(), w.cached_x.size());
    EXPECT_EQ(std::memcmp(g.cached_x.data(), w.cached_x.data(), real * row_bytes), 0) << "cached recv_x differs";
    EXPECT_EQ(g.cached_src_idx, w.cached_src_idx);
  }
  ASSERT_EQ(g.combined.size(), w.combined.size());
  int64_t bad = 0;
  for (size_t i = 0; i < w.combined.size(); ++i) {
    if (g.combined[i] != w.combined[i] && bad++ < 4) {
      ADD_FAILURE() << "combined[" << i / c.hidden << "][" << i % c.hidden << "] = " << bf16_to_float(g.combined[i])
                    << ", host " << bf16_to_float(w.combined[i]);
    }
  }
  EXPECT_EQ(bad, 0) << "combined x differs (bits)";
  ASSERT_EQ(g.combined_weights.size(), w.combined_weights.size());
  EXPECT_EQ(std::memcmp(g.combined_weights.data(), w.combined_weights.data(), w.combined_weights.size() * 4), 0)
      << "combined topk_weights differ";
}

inline CudaGroupOptions cuda_options(const Case& c) {
  CudaGroupOptions o;
  o.timeout_ms = 20'000;
  o.gpus_per_node = c.gpus_per_node;
  return o;
}

inline void run_and_compare(const Case& c) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const auto in = make_inputs(c, seed);
  const auto want = run_case(c, in, host_groups(c), true);
  const auto got = run_case(c, in, create_cuda_groups(std::vector<int>(c.num_ranks, 0), cuda_options(c)), false);
  for (int r = 0; r < c.num_ranks; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    compare_rank(c, want[r], got[r]);
  }
}

inline Case make_case(int num_ranks, int gpus_per_node, std::vector<int64_t> tokens) {
  Case c;
  c.num_ranks = num_ranks;
  c.gpus_per_node = gpus_per_node;
  c.tokens = std::move(tokens);
  return c;
}

}  // namespace epx::hierarchical_test
