// GPU tests of the normal dispatch/combine against the host backend (the oracle).
//
// Routing: every case draws fresh random top-k choices (distinct experts per token, a fraction of
// slots -1) for every rank; experts are split evenly over ranks. Each case runs the same inputs through
// host buffers (ranks as threads on the CPU) and cuda buffers (one thread per rank; ranks may share a
// GPU), with every cuda output allocation poisoned first, and compares every element: data movement
// bit-exact, combine sums within fp32-ordering tolerance. The random seed is printed.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <latch>
#include <random>
#include <thread>
#include <utility>

#include "epx/buffer.h"
#include "epx/cuda.h"
#include "epx/error.h"
#include "epx/quant.h"
#include "epx/routing.h"
#include "testing/gpu_util.h"
#include "testing/routing.h"

namespace epx {
namespace {

using testing::download;
using testing::fresh_seed;
using testing::num_gpus;
using testing::upload;

const bool kCrashHandler = (testing::print_stack_on_crash(), true);

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// Short enough that a broken protocol fails the test quickly, long enough for compute-sanitizer.
CudaGroupOptions test_options() {
  CudaGroupOptions o;
  o.timeout_ms = 20'000;
  return o;
}

// Poisons every CUDA allocation (testing::kPoisonByte) so that an element the kernels forget to write shows up; an
// empty one is null, as torch's allocator gives it (a kernel that touches an empty output faults here instead of
// writing into a spare byte).
using testing::PoisonAllocator;

struct Case {
  std::vector<int> devices;     // one entry per rank
  std::vector<int64_t> tokens;  // T per rank
  int64_t hidden = 2048;
  int num_topk = 8;
  int64_t num_experts = 64;
  double p_masked = 0.1;
  bool fp8 = false;
  ScaleFormat scale_format = ScaleFormat::kFloat32;
  bool topk_int32 = false;
  bool weights = true;
  bool biases = false;
  int expert_alignment = 1;
  int64_t num_worst_tokens = 0;
  int num_sms = 24;
  int call_num_sms = 0;              // DispatchArgs/CombineArgs::num_sms
  bool packed_ue8m0 = false;         // with kUE8M0: int32 [T, ceil(H / 512)], four exponents per element
  bool column_major_scales = false;  // x_scales as a [T, S] view of [S, T] storage
  NormalConfig normal;               // BufferOptions::normal of every rank
  int64_t num_normal_bytes = 0;      // BufferOptions::num_normal_bytes (0: the default size)
  int64_t expert_limit = 0;          // > 0: top-k ids drawn from [0, expert_limit) only (skewed routing)
  bool deepep_order = false;         // CombineArgs::order_topk_idx = the dispatch's topk_idx
};

// Two ranks on `devices` with T tokens each, hidden H, top-K of E experts.
Case ep2_case(const std::vector<int>& devices, int64_t T, int64_t H, int64_t K, int64_t E) {
  Case c;
  c.devices = devices;
  c.tokens = {T, T};
  c.hidden = H;
  c.num_topk = K;
  c.num_experts = E;
  return c;
}

struct RankInput {
  std::vector<uint8_t> x;  // bf16 or fp8 bytes [T, H]
  std::vector<uint8_t> scales;
  std::vector<int64_t> topk64;
  std::vector<int32_t> topk32;
  std::vector<float> weights;
  std::vector<uint16_t> bias_0, bias_1;
};

struct RankOutput {
  int64_t num_rows = 0;
  int64_t num_recv = 0;
  std::vector<uint8_t> x, scales;
  std::vector<int64_t> topk;  // widened
  std::vector<float> weights;
  std::vector<int32_t> src_idx;
  std::vector<int32_t> per_expert_host, per_expert_device;
  std::vector<uint16_t> combined;
  std::vector<float> combined_weights;
  std::vector<int32_t> rank_prefix;  // [R, R]
};

std::vector<RankInput> make_inputs(const Case& c, uint64_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::vector<RankInput> in(c.devices.size());
  std::uniform_real_distribution<float> val(-4.f, 4.f);
  std::uniform_real_distribution<float> wdist(0.f, 1.f);
  for (size_t r = 0; r < in.size(); ++r) {
    const int64_t T = c.tokens[r], H = c.hidden, K = c.num_topk;
    std::vector<uint16_t> bf(T * H);
    for (auto& v : bf) v = float_to_bf16(val(rng));
    if (c.fp8) {
      in[r].x.resize(T * H);
      const size_t sbytes = c.scale_format == ScaleFormat::kFloat32 ? 4 : 1;
      in[r].scales.resize(T * (H / 128) * sbytes);
      quantize_fp8_host(
          TensorView::of(bf.data(), DType::kBFloat16, {T, H}),
          TensorView::of(in[r].x.data(), DType::kFloat8E4M3, {T, H}),
          TensorView::of(in[r].scales.data(), c.scale_format == ScaleFormat::kFloat32 ? DType::kFloat32 : DType::kUInt8,
                         {T, H / 128}),
          c.scale_format);
      if (c.packed_ue8m0) {
        // Byte j of int32 i = exponent of block 4 * i + j (little-endian); padding bytes 0x5a.
        const int64_t B = H / 128, S = (B + 3) / 4;
        std::vector<uint8_t> packed(T * S * 4, 0x5a);
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t b = 0; b < B; ++b) packed[(t * S + b / 4) * 4 + b % 4] = in[r].scales[t * B + b];
        }
        in[r].scales = std::move(packed);
      }
    } else {
      in[r].x.resize(T * H * 2);
      std::memcpy(in[r].x.data(), bf.data(), in[r].x.size());
    }
    in[r].topk64 = testing::random_distinct_topk(rng, T, c.num_topk,
                                                 c.expert_limit > 0 ? c.expert_limit : c.num_experts, c.p_masked);
    in[r].topk32.assign(in[r].topk64.begin(), in[r].topk64.end());
    in[r].weights.resize(T * K);
    for (auto& w : in[r].weights) w = wdist(rng);
    if (c.biases) {
      in[r].bias_0.resize(T * H);
      in[r].bias_1.resize(T * H);
      for (auto& v : in[r].bias_0) v = float_to_bf16(val(rng));
      for (auto& v : in[r].bias_1) v = float_to_bf16(val(rng));
    }
  }
  return in;
}

DType x_dtype(const Case& c) { return c.fp8 ? DType::kFloat8E4M3 : DType::kBFloat16; }
DType scale_dtype(const Case& c) {
  if (c.packed_ue8m0) return DType::kInt32;
  return c.scale_format == ScaleFormat::kFloat32 ? DType::kFloat32 : DType::kUInt8;
}
int64_t num_scale_cols(const Case& c) { return c.packed_ue8m0 ? (c.hidden / 128 + 3) / 4 : c.hidden / 128; }

// Holds device copies of one rank's inputs.
struct DeviceInput {
  Tensor x, scales, topk, weights, bias_0, bias_1;
};

std::vector<int64_t> widen_topk(const Tensor& t, const std::vector<uint8_t>& bytes) {
  std::vector<int64_t> out;
  if (!t.defined()) return out;
  const int64_t n = t.numel();
  out.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    out[i] = t.dtype() == DType::kInt64 ? reinterpret_cast<const int64_t*>(bytes.data())[i]
                                        : reinterpret_cast<const int32_t*>(bytes.data())[i];
  }
  return out;
}

// Runs dispatch + combine (identity experts: combine input = recv_x when bf16) on the given groups.
// With `host` the tensors are CPU views of the inputs.
std::vector<RankOutput> run_case(const Case& c, const std::vector<RankInput>& in,
                                 const std::vector<std::shared_ptr<Group>>& groups, bool host) {
  const int R = static_cast<int>(groups.size());
  std::vector<RankOutput> out(R);
  auto allocator = std::make_shared<PoisonAllocator>();
  run_host_ranks(groups, [&](int r, Group& g) {
    const Device dev = g.device();
    Stream stream = nullptr;
    if (!host) {
      cudaSetDevice(dev.index);
      cudaStreamCreateWithFlags(reinterpret_cast<cudaStream_t*>(&stream), cudaStreamNonBlocking);
    }
    BufferOptions options;
    options.num_sms = c.num_sms;
    options.allocator = allocator;
    options.normal = c.normal;
    options.num_normal_bytes = c.num_normal_bytes;
    auto buffer = Buffer::create(groups[r], options);
    const int64_t T = c.tokens[r], H = c.hidden, K = c.num_topk;
    const RankInput& ri = in[r];
    DeviceInput d;
    auto view_or_upload = [&](const void* p, size_t bytes, DType dtype, std::vector<int64_t> shape) -> Tensor {
      if (host) return Tensor::wrap(TensorView::of(const_cast<void*>(p), dtype, shape), nullptr);
      return upload(p, bytes, dtype, shape, dev, stream);
    };
    d.x = view_or_upload(ri.x.data(), ri.x.size(), x_dtype(c), {T, H});
    const int64_t S = num_scale_cols(c);
    std::vector<uint8_t> scales_t;  // [S, T] storage of column-major scales
    if (c.fp8 && !c.column_major_scales)
      d.scales = view_or_upload(ri.scales.data(), ri.scales.size(), scale_dtype(c), {T, S});
    if (c.fp8 && c.column_major_scales) {
      const size_t e = dtype_size(scale_dtype(c));
      scales_t.resize(ri.scales.size());
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t j = 0; j < S; ++j) std::memcpy(&scales_t[(j * T + t) * e], &ri.scales[(t * S + j) * e], e);
      }
      const Tensor storage = view_or_upload(scales_t.data(), scales_t.size(), scale_dtype(c), {S, T});
      TensorView v = storage.view();
      v.shape[0] = T;
      v.shape[1] = S;
      v.strides[0] = 1;
      v.strides[1] = T;
      d.scales = Tensor::wrap(v, std::make_shared<Tensor>(storage));
    }
    if (c.topk_int32) {
      d.topk = view_or_upload(ri.topk32.data(), ri.topk32.size() * 4, DType::kInt32, {T, K});
    } else {
      d.topk = view_or_upload(ri.topk64.data(), ri.topk64.size() * 8, DType::kInt64, {T, K});
    }
    if (c.weights) d.weights = view_or_upload(ri.weights.data(), ri.weights.size() * 4, DType::kFloat32, {T, K});
    if (c.biases) {
      d.bias_0 = view_or_upload(ri.bias_0.data(), ri.bias_0.size() * 2, DType::kBFloat16, {T, H});
      d.bias_1 = view_or_upload(ri.bias_1.data(), ri.bias_1.size() * 2, DType::kBFloat16, {T, H});
    }
    DispatchArgs a;
    a.x = d.x;
    if (c.fp8) a.x_scales = d.scales;
    a.topk_idx = d.topk;
    if (c.weights) a.topk_weights = d.weights;
    a.num_experts = c.num_experts;
    a.expert_alignment = c.expert_alignment;
    a.num_worst_tokens = c.num_worst_tokens;
    a.num_sms = c.call_num_sms;
    a.stream = stream;
    DispatchResult res = buffer->dispatch(a);
    CombineResult comb;
    if (!c.fp8) {
      CombineArgs ca;
      ca.x = res.recv_x;
      if (c.weights) ca.topk_weights = res.recv_topk_weights;
      if (c.biases) {
        ca.bias_0 = d.bias_0;
        ca.bias_1 = d.bias_1;
      }
      if (c.deepep_order) ca.order_topk_idx = d.topk;
      ca.handle = res.handle;
      ca.num_sms = c.call_num_sms;
      ca.stream = stream;
      comb = buffer->combine(ca);
    }
    RankOutput& o = out[r];
    o.num_rows = res.recv_x.size(0);
    o.num_recv = res.handle->num_recv_tokens();
    o.per_expert_host = res.num_recv_tokens_per_expert;
    if (host) {
      auto bytes = [](const Tensor& t) {
        const auto* p = static_cast<const uint8_t*>(t.data());
        return t.defined() ? std::vector<uint8_t>(p, p + t.nbytes()) : std::vector<uint8_t>{};
      };
      o.x = bytes(res.recv_x);
      o.scales = bytes(res.recv_x_scales);
      o.topk = widen_topk(res.recv_topk_idx, bytes(res.recv_topk_idx));
      if (res.recv_topk_weights.defined()) {
        const auto* w = res.recv_topk_weights.data_as<float>();
        o.weights.assign(w, w + res.recv_topk_weights.numel());
      }
      const auto* s = res.recv_src_idx.data_as<int32_t>();
      o.src_idx.assign(s, s + res.recv_src_idx.numel());
      const auto* e = res.recv_expert_counts.data_as<int32_t>();
      o.per_expert_device.assign(e, e + res.recv_expert_counts.numel());
      const auto* m = res.rank_prefix_matrix.data_as<int32_t>();
      o.rank_prefix.assign(m, m + res.rank_prefix_matrix.numel());
      if (comb.x.defined()) {
        const auto* x = comb.x.data_as<uint16_t>();
        o.combined.assign(x, x + comb.x.numel());
      }
      if (comb.topk_weights.defined()) {
        const auto* w = comb.topk_weights.data_as<float>();
        o.combined_weights.assign(w, w + comb.topk_weights.numel());
      }
    } else {
      o.x = download<uint8_t>(res.recv_x, stream);
      o.scales = download<uint8_t>(res.recv_x_scales, stream);
      const auto topk_bytes = download<uint8_t>(res.recv_topk_idx, stream);
      o.weights = download<float>(res.recv_topk_weights, stream);
      o.src_idx = download<int32_t>(res.recv_src_idx, stream);
      o.per_expert_device = download<int32_t>(res.recv_expert_counts, stream);
      o.rank_prefix = download<int32_t>(res.rank_prefix_matrix, stream);
      o.combined = download<uint16_t>(comb.x, stream);
      o.combined_weights = download<float>(comb.topk_weights, stream);
      cudaStreamSynchronize(stream);
      o.topk = widen_topk(res.recv_topk_idx, topk_bytes);
    }
    res = {};
    comb = {};
    d = {};
    buffer.reset();
    if (!host) {
      cudaStreamSynchronize(stream);
      cudaStreamDestroy(stream);
    }
  });
  return out;
}

float bf16f(uint16_t v) { return bf16_to_float(v); }

void compare(const Case& c, const std::vector<RankOutput>& want, const std::vector<RankOutput>& got) {
  for (size_t r = 0; r < want.size(); ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const RankOutput& w = want[r];
    const RankOutput& g = got[r];
    ASSERT_EQ(g.num_rows, w.num_rows);
    if (c.num_worst_tokens == 0) {
      EXPECT_EQ(g.num_recv, w.num_recv);
    }
    EXPECT_EQ(g.per_expert_host, w.per_expert_host);
    EXPECT_EQ(g.per_expert_device, w.per_expert_device);
    EXPECT_EQ(g.rank_prefix, w.rank_prefix) << "rank_prefix_matrix differs";
    // Real rows: those with a source index on the host side.
    int64_t real = 0;
    while (real < static_cast<int64_t>(w.src_idx.size()) && w.src_idx[real] >= 0) ++real;
    const int64_t row_bytes = c.hidden * (c.fp8 ? 1 : 2);
    int64_t bad_x = 0;
    for (int64_t i = 0; i < real * row_bytes; ++i) bad_x += g.x[i] != w.x[i];
    EXPECT_EQ(bad_x, 0) << "recv_x bytes differ";
    if (c.fp8) {
      const int64_t sb = static_cast<int64_t>(w.scales.size()) / std::max<int64_t>(w.num_rows, 1);
      int64_t bad = 0;
      for (int64_t i = 0; i < real * sb; ++i) bad += g.scales[i] != w.scales[i];
      EXPECT_EQ(bad, 0) << "recv_x_scales differ";
    }
    EXPECT_EQ(g.src_idx, w.src_idx);
    EXPECT_EQ(g.topk, w.topk);
    ASSERT_EQ(g.weights.size(), w.weights.size());
    int64_t bad_w = 0;
    for (size_t i = 0; i < w.weights.size(); ++i) bad_w += std::memcmp(&g.weights[i], &w.weights[i], 4) != 0;
    EXPECT_EQ(bad_w, 0) << "recv_topk_weights differ";
    ASSERT_EQ(g.combined.size(), w.combined.size());
    int64_t bad_c = 0;
    for (size_t i = 0; i < w.combined.size(); ++i) {
      const float a = bf16f(g.combined[i]), b = bf16f(w.combined[i]);
      // Sums of <= 10 bf16 terms in fp32, rounded once to bf16: one bf16 ulp of slack for ordering.
      if (std::fabs(a - b) > 1e-2f * std::max(1.f, std::fabs(b))) {
        if (bad_c < 4) {
          const int64_t t = static_cast<int64_t>(i) / c.hidden;
          ADD_FAILURE() << "combined[" << t << "][" << i % c.hidden << "] = " << a << ", host " << b << " (T "
                        << c.tokens[r] << ", channel of 12: " << t * 12 / std::max<int64_t>(c.tokens[r], 1) << ")";
        }
        ++bad_c;
      }
    }
    EXPECT_EQ(bad_c, 0) << "combined x differs";
    ASSERT_EQ(g.combined_weights.size(), w.combined_weights.size());
    int64_t bad_cw = 0;
    for (size_t i = 0; i < w.combined_weights.size(); ++i) {
      bad_cw += std::fabs(g.combined_weights[i] - w.combined_weights[i]) > 1e-5f;
    }
    EXPECT_EQ(bad_cw, 0) << "combined topk_weights differ";
  }
}

void run_and_compare(const Case& c) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const auto in = make_inputs(c, seed);
  const auto want = run_case(c, in, create_host_groups(static_cast<int>(c.devices.size())), true);
  const auto got = run_case(c, in, create_cuda_groups(c.devices, test_options()), false);
  compare(c, want, got);
}

std::vector<int> two_ranks() { return num_gpus() >= 2 ? std::vector<int>{0, 1} : std::vector<int>{0, 0}; }
std::vector<int> four_ranks() { return num_gpus() >= 2 ? std::vector<int>{0, 1, 0, 1} : std::vector<int>{0, 0, 0, 0}; }

class NormalGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (num_gpus() == 0) GTEST_SKIP() << "no GPU";
  }
};

TEST_F(NormalGpuTest, Ep2Bf16DeepSeekShape) {
  Case c;
  c.devices = two_ranks();
  c.tokens = {4096, 4096};
  c.hidden = 7168;
  c.num_topk = 8;
  c.num_experts = 256;
  run_and_compare(c);
}

// A DeepSeek-shaped EP2 case (hidden 7168, top-8 of 256) run with one NormalConfig switch off, so that the
// path it turns off elsewhere stays tested.
void run_with_switch_off(bool NormalConfig::*field, std::vector<int64_t> tokens, bool fp8) {
  Case c;
  c.normal.*field = false;
  c.devices = two_ranks();
  c.tokens = std::move(tokens);
  c.hidden = 7168;
  c.num_topk = 8;
  c.num_experts = 256;
  c.biases = !fp8;
  c.fp8 = fp8;
  c.topk_int32 = fp8;
  run_and_compare(c);
}

// The SM-only path (the default buffer would take the copy-engine path for this shape), with biases.
TEST_F(NormalGpuTest, Ep2SmPathForced) { run_with_switch_off(&NormalConfig::copy_engines, {2048, 1500}, false); }

// The copy-engine path with every destination's rows packed by SMs first (EP2 at this shape would copy
// whole x), fp8 with scales and int32 top-k ids.
TEST_F(NormalGpuTest, Ep2PackedCopiesFp8) { run_with_switch_off(&NormalConfig::whole_copies, {3000, 4096}, true); }

// Early copies (NormalConfig::early_copies): a fresh EP2 dispatch starts its whole-x copy before notify. Skewed
// routing: rank 0's tokens choose only rank 0's experts, so its early copy sends every token to a peer that needs
// none, while rank 1 sends every token to rank 0; bf16 with biases, then fp8 with column-major scales (gathered
// before the early copy). kNever: rank 1 sends whole x after notify, rank 0 sends nothing (no rows for rank 1). kAuto
// on uniform routing: early on both ranks from the uniform share (top-8 of 256).
TEST_F(NormalGpuTest, Ep2EarlyCopiesSkewedRouting) {
  for (const EarlyCopies mode : {EarlyCopies::kAlways, EarlyCopies::kNever, EarlyCopies::kAuto}) {
    for (const bool fp8 : {false, true}) {
      const char* name = mode == EarlyCopies::kAlways ? "always" : mode == EarlyCopies::kNever ? "never" : "auto";
      SCOPED_TRACE(std::string(name) + (fp8 ? " fp8" : " bf16"));
      Case c = ep2_case(two_ranks(), 1024, 7168, 8, 256);
      c.tokens = {1024, 777};
      c.expert_limit = mode == EarlyCopies::kAuto ? 0 : 128;
      c.normal.early_copies = mode;
      c.fp8 = fp8;
      c.column_major_scales = fp8;
      c.biases = !fp8;
      run_and_compare(c);
    }
  }
}

// Early copies whose dispatch then takes the SM rings: the staging holds rank 0's 600 tokens but not rank 1's 1600
// (a dense destination, whole x), so rank 0 copies early and the call falls back to the rings, which share the
// staging's memory and must wait for the early copy to land (launch_wait_early_copies).
TEST_F(NormalGpuTest, Ep2EarlyCopiesFallBackToSmRings) {
  Case c = ep2_case(two_ranks(), 600, 2048, 8, 64);
  c.tokens = {600, 1600};
  c.normal.early_copies = EarlyCopies::kAlways;
  // Signals, then a staging slot of ~1000 rows of 2048 bf16 + int64 top-k, weights and a source id (4196 bytes).
  c.num_normal_bytes = (int64_t{1} << 20) + 1000 * 4196;
  c.biases = true;
  run_and_compare(c);
}

// The copy-engine path with a kernel signalling each chunk (no stream memory writes) and three chunks.
TEST_F(NormalGpuTest, Ep2KernelSignalsThreeChunks) {
  Case c;
  c.devices = two_ranks();
  c.tokens = {4096, 2500};
  c.hidden = 7168;
  c.num_topk = 8;
  c.num_experts = 256;
  c.normal.stream_signals = false;
  c.normal.max_copy_chunks = 3;
  run_and_compare(c);
}

TEST_F(NormalGpuTest, Ep2SmallShapesAndInt32Topk) {
  for (int64_t t : {0, 1, 127}) {
    Case c;
    c.devices = two_ranks();
    c.tokens = {t, t};
    c.hidden = 2048;
    c.num_topk = 1 + static_cast<int>(t % 9);
    c.num_experts = 8;
    c.topk_int32 = true;
    SCOPED_TRACE("tokens " + std::to_string(t));
    run_and_compare(c);
  }
}

TEST_F(NormalGpuTest, Ep2IdleRankBiasesAlignment) {
  Case c;
  c.devices = two_ranks();
  c.tokens = {8192, 0};
  c.hidden = 5120;
  c.num_topk = 9;
  c.num_experts = 288;
  c.biases = true;
  c.expert_alignment = 128;
  c.p_masked = 0.3;
  run_and_compare(c);
}

TEST_F(NormalGpuTest, Ep2WideHiddenNoWeightsFewSms) {
  Case c;
  c.devices = two_ranks();
  c.tokens = {4096, 1000};
  c.hidden = 8192;
  c.num_topk = 4;
  c.num_experts = 64;
  c.weights = false;
  c.num_sms = 8;
  run_and_compare(c);
}

TEST_F(NormalGpuTest, Ep2Fp8Scales) {
  for (ScaleFormat f : {ScaleFormat::kFloat32, ScaleFormat::kUE8M0}) {
    Case c;
    c.devices = two_ranks();
    c.tokens = {4096, 127};
    c.hidden = f == ScaleFormat::kFloat32 ? 7168 : 4096;
    c.num_topk = 8;
    c.num_experts = 256;
    c.fp8 = true;
    c.scale_format = f;
    run_and_compare(c);
  }
}

TEST_F(NormalGpuTest, Ep2WorstTokens) {
  Case c;
  c.devices = two_ranks();
  c.tokens = {300, 200};
  c.hidden = 2048;
  c.num_topk = 6;
  c.num_experts = 64;
  c.num_worst_tokens = 600;
  c.biases = true;
  run_and_compare(c);
}

TEST_F(NormalGpuTest, FourRanksOnTwoGpus) {
  Case c;
  c.devices = four_ranks();
  c.tokens = {512, 0, 300, 1};
  c.hidden = 2048;
  c.num_topk = 8;
  c.num_experts = 64;
  c.biases = true;
  c.expert_alignment = 4;
  run_and_compare(c);
}

// CombineArgs::order_topk_idx (DeepEP V2's summation order: the biases, then the ranks by their last top-k slot) on
// both combine paths, four ranks, biases, int32 ids on one of them; bit for bit against the host backend.
TEST_F(NormalGpuTest, CombineInDeepEpOrder) {
  for (bool copy_engines : {true, false}) {
    SCOPED_TRACE(copy_engines ? "copy-engine path" : "SM rings");
    Case c;
    c.devices = four_ranks();
    c.tokens = {1024, 700, 0, 900};
    c.hidden = 2048;
    c.num_topk = 8;
    c.num_experts = 64;
    c.biases = true;
    c.deepep_order = true;
    c.topk_int32 = !copy_engines;
    c.normal.copy_engines = copy_engines;
    run_and_compare(c);
  }
}

TEST_F(NormalGpuTest, FourRanksBigger) {
  Case c;
  c.devices = four_ranks();
  c.tokens = {4096, 4096, 4096, 4096};
  c.hidden = 7168;
  c.num_topk = 8;
  c.num_experts = 256;
  c.num_sms = 16;
  run_and_compare(c);
}

// fp8 scales in the layouts DeepEP's tests pass: fp32 column-major, packed int32 UE8M0 (contiguous and
// column-major; hidden 2176 = 17 blocks leaves three padding bytes per token, which must arrive unchanged).
TEST_F(NormalGpuTest, Ep2StridedAndPackedScales) {
  struct Variant {
    ScaleFormat format;
    bool packed, column_major;
    int64_t hidden;
  };
  for (const Variant v :
       {Variant{ScaleFormat::kFloat32, false, true, 7168}, Variant{ScaleFormat::kUE8M0, true, false, 7168},
        Variant{ScaleFormat::kUE8M0, true, true, 2176}, Variant{ScaleFormat::kUE8M0, false, true, 4096}}) {
    for (const bool sm_path : {false, true}) {
      SCOPED_TRACE("packed " + std::to_string(v.packed) + " column-major " + std::to_string(v.column_major) +
                   " hidden " + std::to_string(v.hidden) + (sm_path ? " SM path" : ""));
      Case c;
      c.normal.copy_engines = !sm_path;
      c.devices = two_ranks();
      c.tokens = {3000, 1200};
      c.hidden = v.hidden;
      c.num_topk = 8;
      c.num_experts = 256;
      c.fp8 = true;
      c.scale_format = v.format;
      c.packed_ue8m0 = v.packed;
      c.column_major_scales = v.column_major;
      run_and_compare(c);
    }
  }
}

// A per-call num_sms below the buffer's: the SM path runs fewer block pairs than channels (each pair takes
// several channels in turn), the copy-engine kernels fewer blocks. Odd values and 1 included.
TEST_F(NormalGpuTest, PerCallNumSms) {
  for (const int call_num_sms : {6, 5, 1}) {
    for (const bool sm_path : {false, true}) {
      SCOPED_TRACE("num_sms " + std::to_string(call_num_sms) + (sm_path ? " SM path" : ""));
      Case c;
      c.normal.copy_engines = !sm_path;
      c.devices = two_ranks();
      c.tokens = {2048, 1500};
      c.hidden = 7168;
      c.num_topk = 8;
      c.num_experts = 256;
      c.biases = true;
      c.call_num_sms = call_num_sms;
      run_and_compare(c);
    }
  }
  Case c;
  c.devices = four_ranks();
  c.tokens = {512, 0, 300, 700};
  c.hidden = 2048;
  c.num_topk = 8;
  c.num_experts = 64;
  c.call_num_sms = 4;
  c.num_worst_tokens = 2000;
  run_and_compare(c);
}

// Cached dispatch: new data along the routes of an earlier dispatch, no topk, no notify.
TEST_F(NormalGpuTest, CachedDispatchMovesNewData) {
  const auto devices = two_ranks();
  const int64_t T = 1024, H = 4096, K = 8, E = 64;
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Case c = ep2_case(devices, T, H, K, E);
  const auto in = make_inputs(c, seed);
  const auto in2 = make_inputs(c, seed + 7);  // new x; routes from `in`
  auto groups = create_cuda_groups(devices, test_options());
  std::vector<int64_t> bad(2, -1);
  run_host_ranks(groups, [&](int r, Group& g) {
    cudaSetDevice(g.device().index);
    cudaStream_t stream;
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    BufferOptions options;
    options.allocator = std::make_shared<PoisonAllocator>();
    // The fresh dispatch copies x early, so the cached ones repeat a handle whose destination went whole by that.
    options.normal.early_copies = EarlyCopies::kAuto;
    auto buffer = Buffer::create(groups[r], options);
    Tensor x = upload(in[r].x.data(), in[r].x.size(), DType::kBFloat16, {T, H}, g.device(), stream);
    Tensor x2 = upload(in2[r].x.data(), in2[r].x.size(), DType::kBFloat16, {T, H}, g.device(), stream);
    Tensor topk = upload(in[r].topk64.data(), in[r].topk64.size() * 8, DType::kInt64, {T, K}, g.device(), stream);
    DispatchArgs a;
    a.x = x;
    a.topk_idx = topk;
    a.num_experts = E;
    a.stream = stream;
    DispatchResult first = buffer->dispatch(a);
    DispatchArgs b;
    b.x = x2;
    b.handle = first.handle;
    b.stream = stream;
    DispatchResult second = buffer->dispatch(b);
    EXPECT_FALSE(second.recv_topk_idx.defined());
    EXPECT_EQ(second.num_recv_tokens_per_expert, first.num_recv_tokens_per_expert);
    const auto src = download<int32_t>(second.recv_src_idx, stream);
    const auto got = download<uint16_t>(second.recv_x, stream);
    const auto src1 = download<int32_t>(first.recv_src_idx, stream);
    cudaStreamSynchronize(stream);
    EXPECT_EQ(src, src1);
    // The path changes inside one buffer: worst-token mode runs on SMs, then the copy engines again.
    DispatchArgs worst = b;
    worst.num_worst_tokens = 2 * T;
    DispatchResult third = buffer->dispatch(worst);
    DispatchResult fourth = buffer->dispatch(b);
    const auto got3 = download<uint16_t>(third.recv_x, stream);
    const auto src3 = download<int32_t>(third.recv_src_idx, stream);
    const auto got4 = download<uint16_t>(fourth.recv_x, stream);
    cudaStreamSynchronize(stream);
    EXPECT_EQ(got4, got);
    EXPECT_TRUE(std::equal(got.begin(), got.end(), got3.begin()));
    EXPECT_TRUE(std::equal(src.begin(), src.end(), src3.begin()));
    for (size_t i = src.size(); i < src3.size(); ++i) EXPECT_EQ(src3[i], -1) << i;
    third = {};
    fourth = {};
    worst = {};
    // Row i came from rank s = the source block it lies in; check against in2's rows.
    const HostLayout l0 =
        compute_layout_host(TensorView::of(const_cast<int64_t*>(in[0].topk64.data()), DType::kInt64, {T, K}), E, 2);
    int64_t from0 = 0;
    for (int64_t t = 0; t < T; ++t) from0 += l0.is_token_in_rank[t * 2 + r];
    int64_t mismatches = 0;
    for (size_t i = 0; i < src.size(); ++i) {
      const int s = static_cast<int64_t>(i) < from0 ? 0 : 1;
      const auto* want = reinterpret_cast<const uint16_t*>(in2[s].x.data()) + src[i] * H;
      mismatches += std::memcmp(got.data() + i * H, want, H * 2) != 0;
    }
    bad[r] = mismatches;
    first = {};
    second = {};
    a = {};
    b = {};  // holds the handle, whose tensors free on `stream`
    x = {};
    x2 = {};
    topk = {};  // NOTE: tensors free on their allocation stream: release them before destroying it
    buffer.reset();
    cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
  });
  EXPECT_EQ(bad[0], 0);
  EXPECT_EQ(bad[1], 0);
}

// The graph memory of `devices` (docs/reliability.md, "Graph replay across test repetitions (one GPU)"): a device
// keeps the physical memory of destroyed graphs for later ones, and the ranks' graphs share it when they share a GPU.
void print_graph_memory(const std::vector<int>& devices, const char* when) {
  std::vector<int> seen;
  for (int d : devices) {
    if (std::find(seen.begin(), seen.end(), d) != seen.end()) continue;
    seen.push_back(d);
    uint64_t reserved = 0, used = 0;
    cudaDeviceGetGraphMemAttribute(d, cudaGraphMemAttrReservedMemCurrent, &reserved);
    cudaDeviceGetGraphMemAttribute(d, cudaGraphMemAttrUsedMemCurrent, &used);
    std::printf("cuda:%d graph memory %s: %.1f MiB reserved, %.1f MiB in use\n", d, when, reserved / 1048576.0,
                used / 1048576.0);
  }
}

// Instantiates a captured graph (allocations freed by the next launch) and uploads it on `stream` (waited for), so
// that any remapping of reused graph memory happens here, before the first launch, not inside it while the peer
// rank's graph runs. EPX_TEST_GRAPH_UPLOAD=0 leaves the upload out (the experiment's baseline): with both ranks on
// one H200 the second graph test of a process then faulted (illegal address at replay 0) whenever a rank's graph
// got memory the other rank's graph had held; uploaded, or with the pool trimmed between the tests, it passed
// (docs/reliability.md, "Graph replay across test repetitions").
cudaError_t instantiate_graph(cudaGraphExec_t* exec, cudaGraph_t graph, cudaStream_t stream) {
  cudaError_t err = cudaGraphInstantiateWithFlags(exec, graph, cudaGraphInstantiateFlagAutoFreeOnLaunch);
  const char* upload = std::getenv("EPX_TEST_GRAPH_UPLOAD");
  if (err != cudaSuccess || (upload != nullptr && std::strcmp(upload, "0") == 0)) return err;
  err = cudaGraphUpload(*exec, stream);
  return err != cudaSuccess ? err : cudaStreamSynchronize(stream);
}

// The end of a graph test, every rank's graphs destroyed and their allocations freed. With
// EPX_TEST_TRIM_GRAPH_MEMORY=1 (an experiment, scripts/gpu-check.sh --steps graph-repeat) the devices' graph memory
// goes back to the driver (cudaDeviceGraphMemTrim), so that the next graph test starts from an empty pool, as the
// first one in a process does.
void end_graph_test(const std::vector<int>& devices) {
  const char* trim = std::getenv("EPX_TEST_TRIM_GRAPH_MEMORY");
  if (trim != nullptr && std::strcmp(trim, "1") == 0) {
    for (int d : devices) EXPECT_EQ(cudaDeviceGraphMemTrim(d), cudaSuccess);
    print_graph_memory(devices, "after the test, trimmed");
    return;
  }
  print_graph_memory(devices, "after the test");
}

// Worst-token mode captured in a CUDA graph, replayed with new data in the same input buffers.
TEST_F(NormalGpuTest, GraphCaptureReplayWithNewData) {
  const auto devices = two_ranks();
  Case c;
  c.devices = devices;
  c.tokens = {512, 512};
  c.hidden = 2048;
  c.num_topk = 8;
  c.num_experts = 64;
  c.num_worst_tokens = 1024;
  c.biases = true;
  auto groups = create_cuda_groups(devices);
  std::vector<std::unique_ptr<Buffer>> buffers(2);
  std::vector<cudaStream_t> streams(2);
  std::vector<DeviceInput> inputs(2);
  std::vector<DispatchResult> dres(2);
  std::vector<CombineResult> cres(2);
  std::vector<cudaGraphExec_t> execs(2);
  std::vector<cudaGraph_t> graphs(2);
  print_graph_memory(devices, "before the capture");
  run_host_ranks(groups, [&](int r, Group& g) {
    cudaSetDevice(g.device().index);
    cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking);
    BufferOptions options;
    options.allocator = std::make_shared<PoisonAllocator>();
    buffers[r] = Buffer::create(groups[r], options);
    auto& d = inputs[r];
    d.x = Tensor::empty(DType::kBFloat16, {512, 2048}, g.device(), nullptr, streams[r]);
    d.topk = Tensor::empty(DType::kInt64, {512, 8}, g.device(), nullptr, streams[r]);
    d.weights = Tensor::empty(DType::kFloat32, {512, 8}, g.device(), nullptr, streams[r]);
    d.bias_0 = Tensor::empty(DType::kBFloat16, {512, 2048}, g.device(), nullptr, streams[r]);
    d.bias_1 = Tensor::empty(DType::kBFloat16, {512, 2048}, g.device(), nullptr, streams[r]);
    cudaStreamSynchronize(streams[r]);
    ASSERT_EQ(cudaStreamBeginCapture(streams[r], cudaStreamCaptureModeRelaxed), cudaSuccess);
    DispatchArgs a;
    a.x = d.x;
    a.topk_idx = d.topk;
    a.topk_weights = d.weights;
    a.num_experts = 64;
    a.num_worst_tokens = 1024;
    a.stream = streams[r];
    dres[r] = buffers[r]->dispatch(a);
    CombineArgs ca;
    ca.x = dres[r].recv_x;
    ca.topk_weights = dres[r].recv_topk_weights;
    ca.bias_0 = d.bias_0;
    ca.bias_1 = d.bias_1;
    ca.handle = dres[r].handle;
    ca.stream = streams[r];
    cres[r] = buffers[r]->combine(ca);
    // Graph allocations (the addresses show whether a later test's graphs reuse them).
    std::printf("rank %d: graph allocations recv_x %p, combined x %p\n", r, dres[r].recv_x.data(), cres[r].x.data());
    ASSERT_EQ(cudaStreamEndCapture(streams[r], &graphs[r]), cudaSuccess);
    ASSERT_EQ(instantiate_graph(&execs[r], graphs[r], streams[r]), cudaSuccess);
  });
  for (int replay = 0; replay < 3; ++replay) {
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE("replay " + std::to_string(replay) + " seed " + std::to_string(seed));
    const auto in = make_inputs(c, seed);
    const auto want = run_case(c, in, create_host_groups(2), true);
    std::vector<RankOutput> got(2);
    run_host_ranks(groups, [&](int r, Group& g) {
      cudaSetDevice(g.device().index);
      auto& d = inputs[r];
      cudaMemcpyAsync(d.x.data(), in[r].x.data(), in[r].x.size(), cudaMemcpyHostToDevice, streams[r]);
      cudaMemcpyAsync(d.topk.data(), in[r].topk64.data(), in[r].topk64.size() * 8, cudaMemcpyHostToDevice, streams[r]);
      cudaMemcpyAsync(d.weights.data(), in[r].weights.data(), in[r].weights.size() * 4, cudaMemcpyHostToDevice,
                      streams[r]);
      cudaMemcpyAsync(d.bias_0.data(), in[r].bias_0.data(), in[r].bias_0.size() * 2, cudaMemcpyHostToDevice,
                      streams[r]);
      cudaMemcpyAsync(d.bias_1.data(), in[r].bias_1.data(), in[r].bias_1.size() * 2, cudaMemcpyHostToDevice,
                      streams[r]);
      ASSERT_EQ(cudaGraphLaunch(execs[r], streams[r]), cudaSuccess);
      RankOutput& o = got[r];
      o.num_rows = dres[r].recv_x.size(0);
      o.num_recv = -1;
      o.x = download<uint8_t>(dres[r].recv_x, streams[r]);
      const auto topk_bytes = download<uint8_t>(dres[r].recv_topk_idx, streams[r]);
      o.weights = download<float>(dres[r].recv_topk_weights, streams[r]);
      o.src_idx = download<int32_t>(dres[r].recv_src_idx, streams[r]);
      o.per_expert_device = download<int32_t>(dres[r].recv_expert_counts, streams[r]);
      o.rank_prefix = download<int32_t>(dres[r].rank_prefix_matrix, streams[r]);
      o.combined = download<uint16_t>(cres[r].x, streams[r]);
      o.combined_weights = download<float>(cres[r].topk_weights, streams[r]);
      ASSERT_EQ(cudaStreamSynchronize(streams[r]), cudaSuccess);
      o.topk = widen_topk(dres[r].recv_topk_idx, topk_bytes);
    });
    compare(c, want, got);
  }
  run_host_ranks(groups, [&](int r, Group& g) {
    cudaSetDevice(g.device().index);
    dres[r] = {};
    cres[r] = {};
    inputs[r] = {};
    cudaStreamSynchronize(streams[r]);
    cudaGraphExecDestroy(execs[r]);
    cudaGraphDestroy(graphs[r]);
    buffers[r].reset();
    cudaStreamDestroy(streams[r]);
  });
  end_graph_test(devices);
}

// Cached mode does no host sync: a cached dispatch (handle from an eager fresh dispatch) and its combine
// are captured in a CUDA graph (a stream synchronize inside a capture fails it) and replayed; the rows,
// source ids, rank prefix matrix and combined sums match the host backend's fresh dispatch.
TEST_F(NormalGpuTest, CachedDispatchCapturesInGraph) {
  const auto devices = two_ranks();
  Case c;
  c.devices = devices;
  c.tokens = {700, 900};
  c.hidden = 2048;
  c.num_topk = 8;
  c.num_experts = 64;
  c.weights = false;
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const auto in = make_inputs(c, seed);
  const auto want = run_case(c, in, create_host_groups(2), true);
  auto groups = create_cuda_groups(devices, test_options());
  std::vector<RankOutput> got(2);
  print_graph_memory(devices, "before the capture");
  run_host_ranks(groups, [&](int r, Group& g) {
    cudaSetDevice(g.device().index);
    cudaStream_t stream;
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    BufferOptions options;
    options.allocator = std::make_shared<PoisonAllocator>();
    auto buffer = Buffer::create(groups[r], options);
    const int64_t T = c.tokens[r], H = c.hidden, K = c.num_topk;
    Tensor x = upload(in[r].x.data(), in[r].x.size(), DType::kBFloat16, {T, H}, g.device(), stream);
    Tensor topk = upload(in[r].topk64.data(), in[r].topk64.size() * 8, DType::kInt64, {T, K}, g.device(), stream);
    DispatchArgs a;
    a.x = x;
    a.topk_idx = topk;
    a.num_experts = c.num_experts;
    a.stream = stream;
    DispatchResult fresh = buffer->dispatch(a);
    CUDA_OK(cudaStreamSynchronize(stream));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
    DispatchArgs b;
    b.x = x;
    b.handle = fresh.handle;
    b.num_sms = 12;
    b.stream = stream;
    DispatchResult cached = buffer->dispatch(b);
    CombineArgs ca;
    ca.x = cached.recv_x;
    ca.handle = cached.handle;
    ca.stream = stream;
    CombineResult comb = buffer->combine(ca);
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    CUDA_OK(instantiate_graph(&exec, graph, stream));
    for (int replay = 0; replay < 2; ++replay) CUDA_OK(cudaGraphLaunch(exec, stream));
    RankOutput& o = got[r];
    o.num_rows = cached.recv_x.size(0);
    o.x = download<uint8_t>(cached.recv_x, stream);
    o.src_idx = download<int32_t>(cached.recv_src_idx, stream);
    o.rank_prefix = download<int32_t>(cached.rank_prefix_matrix, stream);
    o.combined = download<uint16_t>(comb.x, stream);
    CUDA_OK(cudaStreamSynchronize(stream));
    // A wait that timed out inside the replays is recorded, not raised (a graph has no host side): the next call
    // raises it, so make one, and a timeout fails here by name instead of as unwritten (poisoned) outputs.
    try {
      (void)buffer->get_dispatch_layout(topk, c.num_experts, stream);
    } catch (const Error& e) {
      ADD_FAILURE() << "rank " << r << ": the replays recorded an error: " << e.what();
    }
    EXPECT_FALSE(cached.recv_topk_idx.defined());
    EXPECT_EQ(cached.num_recv_tokens_per_expert, fresh.num_recv_tokens_per_expert);
    fresh = {};
    cached = {};
    comb = {};
    a = {};
    b = {};
    ca = {};
    x = {};
    topk = {};
    CUDA_OK(cudaStreamSynchronize(stream));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    buffer.reset();
    cudaStreamDestroy(stream);
  });
  end_graph_test(devices);
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    ASSERT_EQ(got[r].num_rows, want[r].num_rows);
    EXPECT_EQ(got[r].x, want[r].x);
    EXPECT_EQ(got[r].src_idx, want[r].src_idx);
    EXPECT_EQ(got[r].rank_prefix, want[r].rank_prefix);
    ASSERT_EQ(got[r].combined.size(), want[r].combined.size());
    int64_t bad = 0;
    for (size_t i = 0; i < want[r].combined.size(); ++i) {
      const float a = bf16f(got[r].combined[i]), w = bf16f(want[r].combined[i]);
      bad += std::fabs(a - w) > 1e-2f * std::max(1.f, std::fabs(w));
    }
    EXPECT_EQ(bad, 0) << "combined x differs";
  }
}

// Elements of an EP2 dispatch + combine round with identity experts that differ from the expected result: each
// token comes back times the number of ranks it visited.
template <typename RankIn>
int64_t identity_round_mismatches(const RankIn& in, int64_t T, int64_t H, int64_t K, int64_t E,
                                  const std::vector<uint16_t>& out) {
  const HostLayout l =
      compute_layout_host(TensorView::of(const_cast<int64_t*>(in.topk64.data()), DType::kInt64, {T, K}), E, 2);
  const auto* x0 = reinterpret_cast<const uint16_t*>(in.x.data());
  int64_t wrong = 0;
  for (int64_t t = 0; t < T; ++t) {
    const float visits = static_cast<float>(l.is_token_in_rank[t * 2] + l.is_token_in_rank[t * 2 + 1]);
    for (int64_t h = 0; h < H; ++h) {
      wrong += bf16_to_float(out[t * H + h]) != bf16_to_float(float_to_bf16(bf16_to_float(x0[t * H + h]) * visits));
    }
  }
  return wrong;
}

// One identity-expert round (dispatch `a`, combine its outputs) on `buffer`: the wrong elements.
template <typename RankIn>
int64_t identity_round(Buffer& buffer, const DispatchArgs& a, const RankIn& in, int64_t T, int64_t H, int64_t K,
                       int64_t E) {
  DispatchResult res = buffer.dispatch(a);
  CombineArgs ca;
  ca.x = res.recv_x;
  ca.handle = res.handle;
  ca.stream = a.stream;
  return identity_round_mismatches(in, T, H, K, E, download<uint16_t>(buffer.combine(ca).x, a.stream));
}

// After a failed call: rounds until one matches (each failed attempt is the other rank's reset still pending), at
// most 4; every error must have one of the `allowed` codes. The last round's wrong elements (-1: none completed).
template <typename RankIn>
int64_t recover_round(Buffer& buffer, const DispatchArgs& a, const RankIn& in, int64_t T, int64_t H, int64_t K,
                      int64_t E, std::initializer_list<ErrorCode> allowed) {
  int64_t wrong = -1;
  for (int attempt = 0; attempt < 4 && wrong != 0; ++attempt) {
    try {
      wrong = identity_round(buffer, a, in, T, H, K, E);
    } catch (const Error& e) {
      EXPECT_NE(std::find(allowed.begin(), allowed.end(), e.code()), allowed.end()) << e.what();
    }
  }
  return wrong;
}

// A peer that never arrives: rank 0 gets Error(kTimeout) naming the wait; afterwards both ranks use
// the same buffers again and get correct results.
TEST_F(NormalGpuTest, TimeoutThenRecover) {
  const auto devices = two_ranks();
  CudaGroupOptions options;
  // NOTE: the budget also bounds the host rendezvous inside Buffer::create (allocations, peer access),
  // which can take a few hundred ms on a busy machine; rank 1's lateness comes from the latch below.
  options.timeout_ms = 2000;
  auto groups = create_cuda_groups(devices, options);
  const int64_t T = 256, H = 2048, K = 4, E = 16;
  const Case c = ep2_case(devices, T, H, K, E);
  const auto in = make_inputs(c, fresh_seed());
  std::latch timed_out(2);
  std::vector<int64_t> bad(2, -1);
  std::string message;
  run_host_ranks(groups, [&](int r, Group& g) {
    cudaSetDevice(g.device().index);
    cudaStream_t stream;
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    auto buffer = Buffer::create(groups[r]);
    Tensor x = upload(in[r].x.data(), in[r].x.size(), DType::kBFloat16, {T, H}, g.device(), stream);
    Tensor topk = upload(in[r].topk64.data(), in[r].topk64.size() * 8, DType::kInt64, {T, K}, g.device(), stream);
    DispatchArgs a;
    a.x = x;
    a.topk_idx = topk;
    a.num_experts = E;
    a.stream = stream;
    if (r == 0) {
      try {
        buffer->dispatch(a);
        ADD_FAILURE() << "expected a timeout";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kTimeout);
        message = e.what();
      }
    }
    timed_out.arrive_and_wait();  // rank 1 "arrives" only after rank 0 gave up
    DispatchResult res = buffer->dispatch(a);
    CombineArgs ca;
    ca.x = res.recv_x;
    ca.handle = res.handle;
    ca.stream = stream;
    CombineResult comb = buffer->combine(ca);
    const auto out = download<uint16_t>(comb.x, stream);
    cudaStreamSynchronize(stream);
    bad[r] = identity_round_mismatches(in[r], T, H, K, E, out);
    res = {};
    comb = {};
    ca = {};  // holds the handle, whose tensors free on `stream`
    x = {};
    topk = {};
    buffer.reset();
    cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
  });
  EXPECT_NE(message.find("timed out"), std::string::npos) << message;
  EXPECT_NE(message.find("peer rank 1"), std::string::npos) << message;
  EXPECT_EQ(bad[0], 0);
  EXPECT_EQ(bad[1], 0);
}

// topk_idx out of range on one rank: that rank gets kInvalidArgument, the peer kPeerFailure naming it, in
// the same call (notify carries the flag; issue 13, defects 2 and 8), and the buffers keep working.
TEST_F(NormalGpuTest, InvalidTopkIsReported) {
  const auto devices = two_ranks();
  auto groups = create_cuda_groups(devices);
  const int64_t T = 64, H = 1024, K = 2, E = 16;
  std::vector<int> codes(2, 0);
  run_host_ranks(groups, [&](int r, Group& g) {
    cudaSetDevice(g.device().index);
    cudaStream_t stream;
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    auto buffer = Buffer::create(groups[r]);
    std::vector<uint16_t> xh(T * H, float_to_bf16(1.f));
    std::vector<int64_t> topk(T * K, 3);
    for (int64_t t = 0; t < T; ++t) topk[t * K + 1] = 12;
    if (r == 0) topk[5 * K + 1] = E;  // out of range
    Tensor x = upload(xh.data(), xh.size() * 2, DType::kBFloat16, {T, H}, g.device(), stream);
    Tensor tk = upload(topk.data(), topk.size() * 8, DType::kInt64, {T, K}, g.device(), stream);
    DispatchArgs a;
    a.x = x;
    a.topk_idx = tk;
    a.num_experts = E;
    a.stream = stream;
    try {
      buffer->dispatch(a);
    } catch (const Error& e) {
      codes[r] = static_cast<int>(e.code());
      const char* want = r == 0 ? "topk_idx[5][1] = 16" : "rank 0 passed an invalid topk_idx";
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
    if (r == 0) topk[5 * K + 1] = 12;
    cudaMemcpyAsync(tk.data(), topk.data(), topk.size() * 8, cudaMemcpyHostToDevice, stream);
    DispatchResult res = buffer->dispatch(a);
    EXPECT_EQ(res.handle->num_recv_tokens(), r == 0 ? 2 * T : 2 * T);
    res = {};
    x = {};
    tk = {};
    buffer.reset();
    cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
  });
  EXPECT_EQ(codes[0], static_cast<int>(ErrorCode::kInvalidArgument));
  EXPECT_EQ(codes[1], static_cast<int>(ErrorCode::kPeerFailure));
}

// Invalid arguments on one rank of a call (issue 13): that rank raises kInvalidArgument before enqueuing
// anything and writes its peers' abort words, so the peer's waits of the same call give up at once with
// kPeerFailure naming it (not after the 20 s timeout); the next calls reset the signals and match. Once in a
// dispatch (the peer learns it inside the call: notify's host wait), once in a combine (asynchronous: the peer
// learns it in the call or the next one).
TEST_F(NormalGpuTest, InvalidArgumentsOnOneRankFailThePeerAtOnce) {
  const auto devices = two_ranks();
  CudaGroupOptions options;
  options.timeout_ms = 20'000;
  auto groups = create_cuda_groups(devices, options);
  const int64_t T = 128, H = 1024, K = 2, E = 16;
  const Case c = ep2_case(devices, T, H, K, E);
  const auto in = make_inputs(c, fresh_seed());
  std::vector<int64_t> wait_ms(2, -1), bad(2, -1);
  std::vector<std::string> peer_message(2);
  run_host_ranks(groups, [&](int r, Group& g) {
    cudaSetDevice(g.device().index);
    cudaStream_t stream;
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    auto buffer = Buffer::create(groups[r]);
    Tensor x = upload(in[r].x.data(), in[r].x.size(), DType::kBFloat16, {T, H}, g.device(), stream);
    Tensor topk = upload(in[r].topk64.data(), in[r].topk64.size() * 8, DType::kInt64, {T, K}, g.device(), stream);
    DispatchArgs a;
    a.x = x;
    a.topk_idx = topk;
    a.num_experts = E;
    a.stream = stream;
    auto recover = [&] { return recover_round(*buffer, a, in[r], T, H, K, E, {ErrorCode::kPeerFailure}); };
    const auto start = std::chrono::steady_clock::now();
    auto elapsed_ms = [&] {
      return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
    };
    // 1. Dispatch: rank 1 asks for more SMs than the buffer has.
    if (r == 1) {
      DispatchArgs wrong = a;
      wrong.num_sms = 1000;
      EXPECT_THROW(buffer->dispatch(wrong), Error);
    } else {
      try {
        buffer->dispatch(a);
        ADD_FAILURE() << "expected kPeerFailure";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kPeerFailure) << e.what();
        wait_ms[0] = elapsed_ms();
        peer_message[0] = e.what();
      }
    }
    int64_t wrong = recover();
    // 2. Combine: rank 0 passes fp32 x.
    DispatchResult res = buffer->dispatch(a);
    CombineArgs ca;
    ca.x = res.recv_x;
    ca.handle = res.handle;
    ca.stream = stream;
    Tensor narrow = Tensor::empty(DType::kFloat32, {res.recv_x.sizes()[0], H}, g.device());  // not bf16
    const auto combine_start = std::chrono::steady_clock::now();
    if (r == 0) {
      CombineArgs bad_args = ca;
      bad_args.x = narrow;
      EXPECT_THROW(buffer->combine(bad_args), Error);
    } else {
      try {
        (void)buffer->combine(ca);
        cudaStreamSynchronize(stream);  // the combine's waits give up at the abort word
        (void)buffer->dispatch(a);      // and the recorded failure is raised here at the latest
        ADD_FAILURE() << "expected kPeerFailure";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kPeerFailure) << e.what();
        wait_ms[1] =
            std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - combine_start)
                .count();
        peer_message[1] = e.what();
      }
    }
    res = {};
    ca = {};
    narrow = {};
    const int64_t wrong2 = recover();
    bad[r] = wrong == 0 && wrong2 == 0 ? 0 : 1;
    x = {};
    topk = {};
    buffer.reset();
    cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
  });
  EXPECT_GE(wait_ms[0], 0);
  EXPECT_LT(wait_ms[0], 5'000) << "rank 0 learned of rank 1's invalid dispatch only after " << wait_ms[0] << " ms";
  EXPECT_NE(peer_message[0].find("peer rank 1 left the call"), std::string::npos) << peer_message[0];
  EXPECT_GE(wait_ms[1], 0);
  EXPECT_LT(wait_ms[1], 5'000) << "rank 1 learned of rank 0's invalid combine only after " << wait_ms[1] << " ms";
  EXPECT_NE(peer_message[1].find("peer rank 0 left the call"), std::string::npos) << peer_message[1];
  EXPECT_EQ(bad[0], 0);
  EXPECT_EQ(bad[1], 0);
}

// Two ranks whose calls do not match (different handles, arguments of different kinds): what each rank saw per
// mismatched call, and the identity rounds after it that came out wrong.
struct MismatchRuns {
  std::vector<std::vector<int>> codes;        // [op][rank]: the ErrorCode caught, -1: none
  std::vector<std::vector<int64_t>> wait_ms;  // [op][rank]: from the call to the error
  std::vector<std::vector<std::string>> messages;
  std::vector<int64_t> bad_rounds;  // [rank]
};

// Per rank, the buffer (copy engines or SM rings) and its inputs of the EP2 case `c`; for each of num_ops ops,
// prepare(r, op, ctx) makes what the op needs (dispatches) and returns the mismatched call, which the runner times:
// it must raise on every rank, in the call or at the rank's next call (a plain dispatch) at the latest. After each op
// the buffer must reset and an identity round match (recover_round).
struct MismatchCtx {
  Buffer& buffer;
  Tensor& x;
  Tensor& topk;
  Tensor& weights;
  DispatchArgs& plain;  // x and topk (no weights) on the rank's stream
  cudaStream_t stream;
};
template <typename Prepare>
MismatchRuns run_mismatched_calls(const Case& c, const std::vector<RankInput>& in, bool copy_engines, int num_ops,
                                  Prepare prepare) {
  CudaGroupOptions options;
  options.timeout_ms = 20'000;
  auto groups = create_cuda_groups(c.devices, options);
  const int64_t T = c.tokens[0], H = c.hidden, K = c.num_topk, E = c.num_experts;
  MismatchRuns runs;
  runs.codes.assign(num_ops, std::vector<int>(2, -1));
  runs.wait_ms.assign(num_ops, std::vector<int64_t>(2, -1));
  runs.messages.assign(num_ops, std::vector<std::string>(2));
  runs.bad_rounds.assign(2, -1);
  run_host_ranks(groups, [&](int r, Group& g) {
    cudaSetDevice(g.device().index);
    cudaStream_t stream;
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    BufferOptions bo;
    bo.normal.copy_engines = copy_engines;
    auto buffer = Buffer::create(groups[r], bo);
    Tensor x = upload(in[r].x.data(), in[r].x.size(), DType::kBFloat16, {T, H}, g.device(), stream);
    Tensor topk = upload(in[r].topk64.data(), in[r].topk64.size() * 8, DType::kInt64, {T, K}, g.device(), stream);
    Tensor weights =
        upload(in[r].weights.data(), in[r].weights.size() * 4, DType::kFloat32, {T, K}, g.device(), stream);
    DispatchArgs a;
    a.x = x;
    a.topk_idx = topk;
    a.num_experts = E;
    a.stream = stream;
    MismatchCtx ctx{*buffer, x, topk, weights, a, stream};
    int64_t wrong = 0;
    for (int op = 0; op < num_ops; ++op) {
      {
        std::function<void()> call = prepare(r, op, ctx);
        cudaStreamSynchronize(stream);
        g.barrier();
        const auto start = std::chrono::steady_clock::now();
        try {
          call();
          cudaStreamSynchronize(stream);  // the kernels found it (or gave up at the peer's abort word)
          (void)buffer->dispatch(a);      // and the recorded failure is raised here at the latest
          ADD_FAILURE() << "rank " << r << ", op " << op << ": no error";
        } catch (const Error& e) {
          runs.codes[op][r] = static_cast<int>(e.code());
          runs.messages[op][r] = e.what();
          runs.wait_ms[op][r] =
              std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
        }
      }  // the op's dispatch results are freed here
      // The next calls reset the signals (retries: the other rank's reset may still be pending).
      const int64_t w =
          recover_round(*buffer, a, in[r], T, H, K, E, {ErrorCode::kPeerFailure, ErrorCode::kInvalidArgument});
      wrong += w == 0 ? 0 : 1;
    }
    runs.bad_rounds[r] = wrong;
    x = {};
    topk = {};
    weights = {};
    buffer.reset();
    cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
  });
  return runs;
}

// Op `op` of `runs`: every rank failed within 5 s (of a 20 s timeout) with kInvalidArgument or kPeerFailure, and at
// least min_found ranks' messages hold `needle` (where the mismatch was found).
void expect_reported(const MismatchRuns& runs, int op, const char* needle, int min_found) {
  int found = 0;
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(runs.codes[op][r] == static_cast<int>(ErrorCode::kInvalidArgument) ||
                runs.codes[op][r] == static_cast<int>(ErrorCode::kPeerFailure))
        << "rank " << r << ": " << runs.messages[op][r];
    EXPECT_GE(runs.wait_ms[op][r], 0);
    EXPECT_LT(runs.wait_ms[op][r], 5'000)
        << "rank " << r << " learned of the mismatch after " << runs.wait_ms[op][r] << " ms";
    if (runs.messages[op][r].find(needle) != std::string::npos) ++found;
  }
  EXPECT_GE(found, min_found) << runs.messages[op][0] << " | " << runs.messages[op][1];
}

// Handles of different dispatches (issue 13, defect 3, cuda side): rank 0 reverses or repeats its first dispatch,
// rank 1 its second. The kernels compare the ranks' handle ids when they see a peer's rows, so the mismatch is
// reported on every rank well before the timeout (kInvalidArgument where it was found, kPeerFailure or
// kInvalidArgument on the peer) instead of returning wrong data; afterwards the buffer resets and rounds match
// again. A combine and a cached dispatch, on the copy-engine and on the SM-ring path.
TEST_F(NormalGpuTest, MismatchedHandlesAreReported) {
  const Case c = ep2_case(two_ranks(), 256, 1024, 4, 16);
  const auto in = make_inputs(c, fresh_seed());
  const auto in2 = make_inputs(c, fresh_seed());
  for (const bool copy_engines : {true, false}) {
    // op 0: combine; op 1: cached dispatch.
    const MismatchRuns runs = run_mismatched_calls(c, in, copy_engines, 2, [&](int r, int op, MismatchCtx& ctx) {
      Tensor topk2 = upload(in2[r].topk64.data(), in2[r].topk64.size() * 8, DType::kInt64,
                            {ctx.topk.size(0), ctx.topk.size(1)}, ctx.topk.device(), ctx.stream);
      DispatchArgs a2 = ctx.plain;
      a2.topk_idx = topk2;
      const DispatchResult d1 = ctx.buffer.dispatch(ctx.plain);
      const DispatchResult d2 = ctx.buffer.dispatch(a2);
      const DispatchResult mine = r == 0 ? d1 : d2;
      return std::function<void()>([&ctx, op, mine, topk2] {
        if (op == 0) {
          CombineArgs ca;
          ca.x = mine.recv_x;
          ca.handle = mine.handle;
          ca.stream = ctx.stream;
          (void)ctx.buffer.combine(ca);
        } else {
          DispatchArgs cached;
          cached.x = ctx.x;
          cached.handle = mine.handle;
          cached.stream = ctx.stream;
          (void)ctx.buffer.dispatch(cached);
        }
      });
    });
    for (int op = 0; op < 2; ++op) {
      SCOPED_TRACE(std::string(copy_engines ? "copy engines, " : "SM rings, ") + (op == 0 ? "combine" : "cached"));
      expect_reported(runs, op, "come from different dispatches", 1);
    }
    EXPECT_EQ(runs.bad_rounds[0], 0);
    EXPECT_EQ(runs.bad_rounds[1], 0);
  }
}

// Ranks whose calls take arguments of different kinds (docs/reliability.md, "Per-call shapes"): every rank fails
// that call within a few seconds (the peer's shape word, compared in notify, where its rows arrive or while a wait
// for it runs), at least one naming both shapes, then rounds match again. Both data paths.
TEST_F(NormalGpuTest, MismatchedShapesAreReported) {
  const Case c = ep2_case(two_ranks(), 256, 1024, 4, 16);
  const auto in = make_inputs(c, fresh_seed());
  // op 0: fresh dispatch, topk_weights on rank 0 only; op 1: fresh dispatch, num_worst_tokens on rank 1 only;
  // op 2: combine, topk_weights on rank 0 only; op 3: cached dispatch on rank 0, combine on rank 1 (same handle);
  // op 4: fresh dispatch on rank 0, combine on rank 1 (rank 1 never comes to notify: rank 0's wait finds its words).
  const char* const names[] = {"fresh dispatch, weights on rank 0 only", "fresh dispatch, worst tokens on rank 1 only",
                               "combine, weights on rank 0 only", "cached dispatch against combine",
                               "fresh dispatch against combine"};
  constexpr int kOps = 5;
  for (const bool copy_engines : {true, false}) {
    const MismatchRuns runs = run_mismatched_calls(c, in, copy_engines, kOps, [&](int r, int op, MismatchCtx& ctx) {
      DispatchArgs with_weights = ctx.plain;
      with_weights.topk_weights = ctx.weights;
      const DispatchResult d = ctx.buffer.dispatch(with_weights);  // the handle of ops 2 to 4
      return std::function<void()>([&ctx, r, op, d, with_weights] {
        if (op == 0 || (op == 4 && r == 0)) {
          (void)ctx.buffer.dispatch(r == 0 ? with_weights : ctx.plain);
        } else if (op == 1) {
          DispatchArgs worst = ctx.plain;
          worst.num_worst_tokens = r == 1 ? 2 * ctx.x.size(0) : 0;
          (void)ctx.buffer.dispatch(worst);
        } else if (op == 2 || op == 4 || r == 1) {
          CombineArgs ca;
          ca.x = d.recv_x;
          if (r == 0) ca.topk_weights = d.recv_topk_weights;
          ca.handle = d.handle;
          ca.stream = ctx.stream;
          (void)ctx.buffer.combine(ca);
        } else {
          DispatchArgs cached;
          cached.x = ctx.x;
          cached.handle = d.handle;
          cached.stream = ctx.stream;
          (void)ctx.buffer.dispatch(cached);
        }
      });
    });
    for (int op = 0; op < kOps; ++op) {
      SCOPED_TRACE(std::string(copy_engines ? "copy engines, " : "SM rings, ") + names[op]);
      // A fresh dispatch's notify compares every rank's word with every other's: each rank finds it itself.
      expect_reported(runs, op, "passed arguments of different kinds", op < 2 ? 2 : 1);
    }
    EXPECT_EQ(runs.bad_rounds[0], 0);
    EXPECT_EQ(runs.bad_rounds[1], 0);
  }
}

TEST_F(NormalGpuTest, BadArgumentsThrowBeforeAnyCollective) {
  auto groups = create_cuda_groups({0});
  auto buffer = Buffer::create(groups[0]);
  cudaSetDevice(0);
  Tensor x = Tensor::empty(DType::kBFloat16, {4, 1000}, Device::cuda(0));
  Tensor topk = Tensor::empty(DType::kInt64, {4, 17}, Device::cuda(0));
  DispatchArgs a;
  a.x = x;
  a.topk_idx = topk;
  a.num_experts = 16;
  try {
    buffer->dispatch(a);
    ADD_FAILURE() << "expected kInvalidArgument";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
  }
  Tensor x2 = Tensor::empty(DType::kBFloat16, {4, 1024}, Device::cuda(0));
  Tensor topk2 = Tensor::empty(DType::kInt64, {4, 2}, Device::cuda(0));
  a.x = x2;
  a.topk_idx = topk2;
  a.num_sms = 25;  // the default buffer has 24
  try {
    buffer->dispatch(a);
    ADD_FAILURE() << "expected kInvalidArgument";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find("num_sms must be in [0, 24]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(create_cuda_groups({0, 99}), Error);
  EXPECT_THROW(buffer->low_latency_dispatch({}), Error);
}

}  // namespace
}  // namespace epx
