// Host backend, low-latency mode, against a brute-force expectation built here.
//
// Routing: each rank draws T <= M tokens (one rank idle) with distinct random top-k experts, ~10% of
// the slots -1; so each (expert, source rank) block holds at most M pairs. Expected rows (packed): for
// local expert e, rows [0, recv_count[e]) hold the pairs (s, t, k) that chose e, by ascending source rank
// s, then t (then k), with no gaps; recv_src_info = t there and -1 past the count; recv_layout_range[e][s]
// = (sum of the counts of sources < s) << 32 | count. Combine of identity experts (x = recv_x,
// dequantized for fp8; rows past the count NaN, so reading one fails) must give x[t] * (sum of the
// weights whose expert's rank is present), within bf16 rounding: |got - exp| <= 2^-8 |exp| + 2e-6 *
// sum_k |w_k x| (bf16 rounds to 2^-9 relative; fp32 products and <= 16 sums add < 17 * 2^-24 of sum |w x|).
#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <thread>

#include "epx/buffer.h"
#include "epx/error.h"
#include "epx/group.h"
#include "epx/quant.h"
#include "test_util.h"

namespace epx {
namespace {

struct Case {
  int num_ranks = 1;
  int64_t max_tokens = 24;
  int64_t hidden = 128;
  int num_topk = 1;
  int64_t num_experts = 8;
  bool int32_topk = false;
  bool use_fp8 = false;
  ScaleFormat scale_format = ScaleFormat::kFloat32;
};

struct RankInput {
  int64_t num_tokens = 0;
  std::vector<uint16_t> x;      // [T, H] bf16
  std::vector<int64_t> topk;    // [T, K]
  std::vector<int32_t> topk32;  // [T, K]
  std::vector<float> weights;   // [T, K]
  std::vector<uint8_t> x8;      // [T, H] fp8 (quantize_fp8_host), when use_fp8
  std::vector<uint8_t> scales;  // [T, H / 128] scale bytes, when use_fp8
};

DType scale_dtype(const Case& c) { return c.scale_format == ScaleFormat::kUE8M0 ? DType::kUInt8 : DType::kFloat32; }

std::vector<RankInput> make_inputs(std::mt19937& rng, const Case& c) {
  std::vector<RankInput> in(c.num_ranks);
  std::uniform_int_distribution<int64_t> tokens(1, c.max_tokens);
  std::uniform_real_distribution<float> weight(-1.f, 1.f);
  const int idle = static_cast<int>(rng() % c.num_ranks);
  for (int r = 0; r < c.num_ranks; ++r) {
    auto& d = in[r];
    d.num_tokens = (r == idle && c.num_ranks > 1) ? 0 : tokens(rng);
    d.x = testing::random_bf16(rng, d.num_tokens * c.hidden, 8.f);
    d.topk = testing::random_topk(rng, d.num_tokens, c.num_topk, c.num_experts, 0.1);
    d.topk32.assign(d.topk.begin(), d.topk.end());
    d.weights.resize(d.topk.size());
    for (auto& w : d.weights) w = weight(rng);
    if (c.use_fp8) {
      const int64_t num_blocks = c.hidden / kFp8BlockSize;
      d.x8.resize(d.num_tokens * c.hidden);
      d.scales.resize(d.num_tokens * num_blocks * dtype_size(scale_dtype(c)));
      quantize_fp8_host(TensorView::of(d.x.data(), DType::kBFloat16, {d.num_tokens, c.hidden}),
                        TensorView::of(d.x8.data(), DType::kFloat8E4M3, {d.num_tokens, c.hidden}),
                        TensorView::of(d.scales.data(), scale_dtype(c), {d.num_tokens, num_blocks}), c.scale_format);
    }
  }
  return in;
}

TensorView topk_view(RankInput& d, const Case& c) {
  return c.int32_topk ? TensorView::of(d.topk32.data(), DType::kInt32, {d.num_tokens, c.num_topk})
                      : TensorView::of(d.topk.data(), DType::kInt64, {d.num_tokens, c.num_topk});
}

LowLatencyDispatchArgs dispatch_args(RankInput& d, const Case& c) {
  LowLatencyDispatchArgs a;
  a.x = TensorView::of(d.x.data(), DType::kBFloat16, {d.num_tokens, c.hidden});
  a.topk_idx = topk_view(d, c);
  a.max_tokens_per_rank = c.max_tokens;
  a.num_experts = c.num_experts;
  a.use_fp8 = c.use_fp8;
  a.scale_format = c.scale_format;
  return a;
}

std::vector<std::unique_ptr<Buffer>> make_buffers(const std::vector<std::shared_ptr<Group>>& groups,
                                                  bool raise_on_timeout = false) {
  BufferOptions options;
  options.num_low_latency_bytes = 1;  // the host backend sizes its own slots
  options.low_latency.raise_on_timeout = raise_on_timeout;
  std::vector<std::unique_ptr<Buffer>> buffers;
  for (const auto& g : groups) buffers.push_back(Buffer::create(g, options));
  return buffers;
}

// Checks rank dst's dispatch outputs; present[s]: whether dst received from s (not masked).
void check_dispatch(const std::vector<RankInput>& in, const Case& c, int dst, const LowLatencyDispatchResult& res,
                    const std::vector<bool>& present) {
  SCOPED_TRACE("receiving rank " + std::to_string(dst));
  const int R = c.num_ranks;
  const int64_t M = c.max_tokens, H = c.hidden, E_local = c.num_experts / R, K = c.num_topk;
  const int64_t num_blocks = H / kFp8BlockSize;
  ASSERT_EQ(res.recv_x.sizes(), (std::vector<int64_t>{E_local, R * M, H}));
  ASSERT_EQ(res.recv_x.dtype(), c.use_fp8 ? DType::kFloat8E4M3 : DType::kBFloat16);
  ASSERT_EQ(res.recv_count.sizes(), (std::vector<int64_t>{E_local}));
  ASSERT_EQ(res.recv_src_info.sizes(), (std::vector<int64_t>{E_local, R * M}));
  ASSERT_EQ(res.recv_layout_range.sizes(), (std::vector<int64_t>{E_local, R}));
  ASSERT_EQ(res.recv_x_scales.defined(), c.use_fp8);
  if (c.use_fp8) {
    ASSERT_EQ(res.recv_x_scales.sizes(), (std::vector<int64_t>{E_local, R * M, num_blocks}));
    ASSERT_EQ(res.recv_x_scales.dtype(), scale_dtype(c));
  }
  const size_t scale_bytes = num_blocks * dtype_size(scale_dtype(c));
  for (int64_t e = 0; e < E_local; ++e) {
    int32_t total = 0;  // rows of sources < s: where source s's block begins
    for (int s = 0; s < R; ++s) {
      int64_t n = 0;
      for (int64_t t = 0; present[s] && t < in[s].num_tokens; ++t) {
        for (int64_t k = 0; k < K; ++k) {
          if (in[s].topk[t * K + k] != dst * E_local + e) continue;
          const int64_t slot = e * R * M + total + n;  // packed: no gap after the previous source
          ASSERT_EQ(res.recv_src_info.data_as<int32_t>()[slot], t) << "expert " << e << " source " << s << " #" << n;
          if (c.use_fp8) {
            ASSERT_EQ(std::memcmp(res.recv_x.data_as<uint8_t>() + slot * H, in[s].x8.data() + t * H, H), 0);
            ASSERT_EQ(std::memcmp(res.recv_x_scales.data_as<uint8_t>() + slot * scale_bytes,
                                  in[s].scales.data() + t * scale_bytes, scale_bytes),
                      0);
          } else {
            ASSERT_EQ(std::memcmp(res.recv_x.data_as<uint16_t>() + slot * H, in[s].x.data() + t * H, H * 2), 0);
          }
          ++n;
        }
      }
      ASSERT_EQ(res.recv_layout_range.data_as<int64_t>()[e * R + s], (int64_t{total} << 32) | n)
          << "expert " << e << " source " << s;
      total += static_cast<int32_t>(n);
    }
    ASSERT_EQ(res.recv_count.data_as<int32_t>()[e], total) << "expert " << e;
    for (int64_t i = total; i < R * M; ++i) {
      ASSERT_EQ(res.recv_src_info.data_as<int32_t>()[e * R * M + i], -1) << "expert " << e << " row " << i;
    }
  }
}

// The identity experts' output for a dispatch result: recv_x itself (bf16) or its dequantization, on rows
// [0, recv_count[e]) of each expert; NaN past the count, so a combine that reads such a row fails.
std::vector<uint16_t> identity_expert(const Case& c, const LowLatencyDispatchResult& res) {
  const int64_t num_experts = res.recv_x.size(0), rows_per_expert = res.recv_x.size(1);
  const int64_t rows = num_experts * rows_per_expert;
  std::vector<uint16_t> out(rows * c.hidden);
  if (!c.use_fp8) {
    std::memcpy(out.data(), res.recv_x.data(), out.size() * 2);
  } else {
    dequantize_fp8_host(TensorView::of(res.recv_x.data(), DType::kFloat8E4M3, {rows, c.hidden}),
                        TensorView::of(res.recv_x_scales.data(), scale_dtype(c), {rows, c.hidden / kFp8BlockSize}),
                        TensorView::of(out.data(), DType::kBFloat16, {rows, c.hidden}));
  }
  constexpr uint16_t kNaN = 0x7fc0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t count = res.recv_count.data_as<int32_t>()[e];
    std::fill(out.begin() + (e * rows_per_expert + count) * c.hidden,
              out.begin() + (e + 1) * rows_per_expert * c.hidden, kNaN);
  }
  return out;
}

// Checks rank r's combine output; present[q]: whether experts on rank q contribute (not masked).
void check_combine(const std::vector<RankInput>& in, const Case& c, int r, const Tensor& out,
                   const std::vector<bool>& present) {
  SCOPED_TRACE("token rank " + std::to_string(r));
  const int64_t H = c.hidden, K = c.num_topk, E_local = c.num_experts / c.num_ranks;
  ASSERT_EQ(out.sizes(), (std::vector<int64_t>{in[r].num_tokens, H}));
  std::vector<float> token(H);
  for (int64_t t = 0; t < in[r].num_tokens; ++t) {
    // What every expert saw of token t: x, or its fp8 round trip.
    for (int64_t h = 0; h < H; ++h) {
      float v = bf16_to_float(in[r].x[t * H + h]);
      if (c.use_fp8) {
        const int64_t b = t * (H / kFp8BlockSize) + h / kFp8BlockSize;
        const float scale = c.scale_format == ScaleFormat::kUE8M0
                                ? ue8m0_to_float(in[r].scales[b])
                                : reinterpret_cast<const float*>(in[r].scales.data())[b];
        v = bf16_to_float(float_to_bf16(fp8_e4m3_to_float(in[r].x8[t * H + h]) * scale));
      }
      token[h] = v;
    }
    double weight_sum = 0, weight_abs = 0;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = in[r].topk[t * K + k];
      if (e < 0 || !present[e / E_local]) continue;
      weight_sum += in[r].weights[t * K + k];
      weight_abs += std::fabs(in[r].weights[t * K + k]);
    }
    for (int64_t h = 0; h < H; ++h) {
      const double expected = token[h] * weight_sum;
      const double tolerance = std::ldexp(std::fabs(expected), -8) + 2e-6 * weight_abs * std::fabs(token[h]);
      ASSERT_LE(std::fabs(bf16_to_float(out.data_as<uint16_t>()[t * H + h]) - expected), tolerance)
          << "token " << t << " h " << h;
    }
  }
}

// One round's results per rank: dispatch, the identity experts' outputs, combine.
struct Step {
  explicit Step(int num_ranks) : dispatched(num_ranks), expert_out(num_ranks), combined(num_ranks) {}
  // Rank r's identity experts on its dispatch result, then its combine (the dispatch already made).
  void combine_identity(Buffer& buffer, RankInput& in, const Case& c, int r);
  // Rank r's plain dispatch, then combine_identity.
  void round(Buffer& buffer, RankInput& in, const Case& c, int r);
  std::vector<LowLatencyDispatchResult> dispatched;
  std::vector<std::vector<uint16_t>> expert_out;
  std::vector<LowLatencyCombineResult> combined;
};

LowLatencyCombineArgs combine_args(RankInput& d, const Case& c, const LowLatencyDispatchResult& res,
                                   std::vector<uint16_t>& expert_out) {
  LowLatencyCombineArgs a;
  const int64_t R = c.num_ranks;
  a.x = TensorView::of(expert_out.data(), DType::kBFloat16, {c.num_experts / R, R * c.max_tokens, c.hidden});
  a.topk_idx = topk_view(d, c);
  a.topk_weights = TensorView::of(d.weights.data(), DType::kFloat32, {d.num_tokens, c.num_topk});
  a.handle = res.handle;
  return a;
}

void Step::combine_identity(Buffer& buffer, RankInput& in, const Case& c, int r) {
  expert_out[r] = identity_expert(c, dispatched[r]);
  combined[r] = buffer.low_latency_combine(combine_args(in, c, dispatched[r], expert_out[r]));
}

void Step::round(Buffer& buffer, RankInput& in, const Case& c, int r) {
  dispatched[r] = buffer.low_latency_dispatch(dispatch_args(in, c));
  combine_identity(buffer, in, c, r);
}

TEST(HostLowLatency, DispatchCombineMatchBruteForce) {
  testing::SeededRng rng;
  for (int num_ranks : {1, 2, 3, 4, 8}) {
    auto groups = create_host_groups(num_ranks, {.timeout_ms = 20'000});
    auto buffers = make_buffers(groups);
    const int64_t max_tokens = std::vector<int64_t>{24, 128}[rng() % 2];  // fixed per buffer
    std::vector<std::vector<int32_t>> cumulative(num_ranks);
    std::vector<std::vector<int32_t>> expected_cumulative(num_ranks);
    for (int64_t num_experts : {8, 24, 64, 288}) {
      if (num_experts % num_ranks != 0) continue;
      Case c;
      c.num_ranks = num_ranks;
      c.num_experts = num_experts;
      c.hidden = 128 * (1 + rng() % 2);
      // Distinct experts per token, so no (expert, source) block can exceed M pairs.
      c.num_topk = static_cast<int>(std::min<int64_t>(1 + rng() % 9, num_experts));
      c.max_tokens = max_tokens;
      c.int32_topk = rng() % 2 == 0;
      SCOPED_TRACE("experts " + std::to_string(num_experts) + " top-" + std::to_string(c.num_topk));
      auto in = make_inputs(rng, c);
      const int64_t E_local = num_experts / num_ranks;
      for (int r = 0; r < num_ranks; ++r) {
        cumulative[r].assign(E_local, 0);
        for (auto& v : cumulative[r]) v = static_cast<int32_t>(rng() % 100);
        expected_cumulative[r] = cumulative[r];
      }
      Step step(num_ranks);
      testing::on_ranks(num_ranks, [&](int r) {
        for (int round = 0; round < 2; ++round) {  // two dispatches: the counts accumulate twice
          auto a = dispatch_args(in[r], c);
          a.cumulative_recv_counts = TensorView::of(cumulative[r].data(), DType::kInt32, {E_local});
          step.dispatched[r] = buffers[r]->low_latency_dispatch(a);
        }
        step.combine_identity(*buffers[r], in[r], c, r);
      });
      const std::vector<bool> all(num_ranks, true);
      for (int r = 0; r < num_ranks; ++r) {
        check_dispatch(in, c, r, step.dispatched[r], all);
        check_combine(in, c, r, step.combined[r].x, all);
        for (int64_t e = 0; e < E_local; ++e) {
          expected_cumulative[r][e] += 2 * step.dispatched[r].recv_count.data_as<int32_t>()[e];
        }
        EXPECT_EQ(cumulative[r], expected_cumulative[r]);
        EXPECT_EQ(buffers[r]->rank_mask(), std::vector<bool>(num_ranks, false));
      }
    }
  }
}

// clean_low_latency_buffer: collective; afterwards another max_tokens_per_rank is accepted and the mask is clear.
TEST(HostLowLatency, CleanAllowsNewShapesAndClearsTheMask) {
  testing::SeededRng rng;
  const int R = 2;
  auto groups = create_host_groups(R, {.timeout_ms = 20'000});
  auto buffers = make_buffers(groups);
  for (int64_t max_tokens : {8, 32}) {
    Case c;
    c.num_ranks = R;
    c.max_tokens = max_tokens;
    c.num_topk = 4;
    c.num_experts = 16;
    auto in = make_inputs(rng, c);
    Step step(R);
    testing::on_ranks(R, [&](int r) {
      if (max_tokens == 32) {
        // Still fixed to 8 before the clean.
        auto a = dispatch_args(in[r], c);
        EXPECT_THROW(buffers[r]->low_latency_dispatch(a), Error);
        buffers[r]->mask_rank(1 - r);
        buffers[r]->clean_low_latency_buffer();
        EXPECT_EQ(buffers[r]->rank_mask(), std::vector<bool>(R, false));
      }
      step.round(*buffers[r], in[r], c, r);
    });
    const std::vector<bool> all(R, true);
    for (int r = 0; r < R; ++r) {
      check_dispatch(in, c, r, step.dispatched[r], all);
      check_combine(in, c, r, step.combined[r].x, all);
    }
  }
}

TEST(HostLowLatency, Fp8Dispatch) {
  testing::SeededRng rng;
  for (const ScaleFormat format : {ScaleFormat::kFloat32, ScaleFormat::kUE8M0}) {
    Case c;
    c.num_ranks = 4;
    c.num_experts = 32;
    c.hidden = 384;
    c.num_topk = 6;
    c.use_fp8 = true;
    c.scale_format = format;
    auto groups = create_host_groups(c.num_ranks, {.timeout_ms = 20'000});
    auto buffers = make_buffers(groups);
    auto in = make_inputs(rng, c);
    Step step(c.num_ranks);
    testing::on_ranks(c.num_ranks, [&](int r) { step.round(*buffers[r], in[r], c, r); });
    const std::vector<bool> all(c.num_ranks, true);
    for (int r = 0; r < c.num_ranks; ++r) {
      check_dispatch(in, c, r, step.dispatched[r], all);
      check_combine(in, c, r, step.combined[r].x, all);
    }
  }
}

using epx::testing::expect_invalid;

// DeepEP/DeepGEMM scale options: round_scale gives the UE8M0 quantization with fp32 powers of two; column-major
// is the transpose of the row-major scales; column-major UE8M0 packs four exponents per int32.
TEST(HostLowLatency, ScaleOptionsGiveTheSameScalesInTheirLayout) {
  testing::SeededRng rng;
  Case c;
  c.num_ranks = 2;
  c.num_experts = 8;
  c.hidden = 1024;  // 8 scale blocks, two words of four exponents
  c.num_topk = 3;
  c.use_fp8 = true;
  auto groups = create_host_groups(c.num_ranks, {.timeout_ms = 20'000});
  auto buffers = make_buffers(groups);
  auto in = make_inputs(rng, c);
  const int64_t E = c.num_experts / c.num_ranks, slots = c.num_ranks * c.max_tokens, S = c.hidden / kFp8BlockSize;
  struct Got {
    std::vector<uint8_t> x, scales;
    std::vector<int32_t> count;
    std::vector<int64_t> scale_shape;
    DType scale_dtype = DType::kFloat32;
  };
  auto run = [&](ScaleFormat format, bool round, ScaleLayout layout) {
    std::vector<Got> got(c.num_ranks);
    testing::on_ranks(c.num_ranks, [&](int r) {
      auto a = dispatch_args(in[r], c);
      a.scale_format = format;
      a.round_scale = round;
      a.scale_layout = layout;
      const auto res = buffers[r]->low_latency_dispatch(a);
      const auto* x = static_cast<const uint8_t*>(res.recv_x.data());
      const auto* sc = static_cast<const uint8_t*>(res.recv_x_scales.data());
      got[r].x.assign(x, x + res.recv_x.nbytes());
      got[r].scales.assign(sc, sc + res.recv_x_scales.nbytes());
      got[r].count.assign(res.recv_count.data_as<int32_t>(), res.recv_count.data_as<int32_t>() + E);
      got[r].scale_shape = res.recv_x_scales.sizes();
      got[r].scale_dtype = res.recv_x_scales.dtype();
    });
    return got;
  };
  const auto fp32 = run(ScaleFormat::kFloat32, false, ScaleLayout::kRowMajor);
  const auto ue8m0 = run(ScaleFormat::kUE8M0, false, ScaleLayout::kRowMajor);
  const auto rounded = run(ScaleFormat::kFloat32, true, ScaleLayout::kRowMajor);
  const auto fp32_cm = run(ScaleFormat::kFloat32, false, ScaleLayout::kColumnMajor);
  const auto rounded_cm = run(ScaleFormat::kFloat32, true, ScaleLayout::kColumnMajor);
  const auto ue8m0_cm = run(ScaleFormat::kUE8M0, false, ScaleLayout::kColumnMajor);
  auto f32 = [](const std::vector<uint8_t>& v, int64_t i) {
    float f;
    std::memcpy(&f, v.data() + i * 4, 4);
    return f;
  };
  for (int r = 0; r < c.num_ranks; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(fp32_cm[r].scale_shape, (std::vector<int64_t>{E, S, slots}));
    EXPECT_EQ(ue8m0_cm[r].scale_shape, (std::vector<int64_t>{E, S / 4, slots}));
    EXPECT_EQ(ue8m0_cm[r].scale_dtype, DType::kInt32);
    EXPECT_EQ(rounded[r].scale_dtype, DType::kFloat32);
    EXPECT_EQ(rounded[r].count, ue8m0[r].count);
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t row = 0; row < ue8m0[r].count[e]; ++row) {
        const int64_t x0 = (e * slots + row) * c.hidden;
        ASSERT_TRUE(
            std::equal(rounded[r].x.begin() + x0, rounded[r].x.begin() + x0 + c.hidden, ue8m0[r].x.begin() + x0))
            << "round_scale quantizes as UE8M0: expert " << e << " row " << row;
        ASSERT_TRUE(
            std::equal(fp32_cm[r].x.begin() + x0, fp32_cm[r].x.begin() + x0 + c.hidden, fp32[r].x.begin() + x0));
        for (int64_t b = 0; b < S; ++b) {
          const int64_t rm = (e * slots + row) * S + b, cm = (e * S + b) * slots + row;
          const uint8_t exponent = ue8m0[r].scales[rm];
          ASSERT_EQ(f32(rounded[r].scales, rm), ue8m0_to_float(exponent)) << "e " << e << " row " << row << " b " << b;
          ASSERT_EQ(f32(rounded_cm[r].scales, cm), ue8m0_to_float(exponent));
          ASSERT_EQ(f32(fp32_cm[r].scales, cm), f32(fp32[r].scales, rm));
          ASSERT_EQ(ue8m0_cm[r].scales[((e * (S / 4) + b / 4) * slots + row) * 4 + b % 4], exponent);
        }
      }
    }
  }
  // Column-major UE8M0 needs whole words of four exponents.
  Case odd = c;
  odd.hidden = 384;
  auto odd_in = make_inputs(rng, odd);
  testing::on_ranks(c.num_ranks, [&](int r) {
    auto a = dispatch_args(odd_in[r], odd);
    a.scale_format = ScaleFormat::kUE8M0;
    a.scale_layout = ScaleLayout::kColumnMajor;
    expect_invalid([&] { buffers[r]->low_latency_dispatch(a); }, "multiple of 512, got 384");
  });
}

TEST(HostLowLatency, HookSplitsSendAndReceive) {
  testing::SeededRng rng;
  Case c;
  c.num_ranks = 4;
  c.num_experts = 16;
  c.num_topk = 4;
  auto groups = create_host_groups(c.num_ranks, {.timeout_ms = 20'000});
  auto buffers = make_buffers(groups);
  auto in = make_inputs(rng, c);
  Step step(c.num_ranks);
  std::vector<std::vector<uint16_t>> out(c.num_ranks);
  // Every rank's send must return before any rank runs its hook: a send that waited for a peer's
  // receive would deadlock here (and fail by timeout).
  std::barrier sync(c.num_ranks);
  testing::on_ranks(c.num_ranks, [&](int r) {
    auto a = dispatch_args(in[r], c);
    a.return_recv_hook = true;
    step.dispatched[r] = buffers[r]->low_latency_dispatch(a);
    EXPECT_TRUE(static_cast<bool>(step.dispatched[r].recv_hook));
    sync.arrive_and_wait();
    step.dispatched[r].recv_hook();
    step.dispatched[r].recv_hook();  // a second call is a no-op
    step.expert_out[r] = identity_expert(c, step.dispatched[r]);
    out[r].assign(in[r].num_tokens * c.hidden, 0xffff);
    auto ca = combine_args(in[r], c, step.dispatched[r], step.expert_out[r]);
    ca.return_recv_hook = true;
    ca.out = TensorView::of(out[r].data(), DType::kBFloat16, {in[r].num_tokens, c.hidden});
    step.combined[r] = buffers[r]->low_latency_combine(ca);
    sync.arrive_and_wait();
    step.combined[r].recv_hook();
  });
  const std::vector<bool> all(c.num_ranks, true);
  for (int r = 0; r < c.num_ranks; ++r) {
    check_dispatch(in, c, r, step.dispatched[r], all);
    EXPECT_EQ(step.combined[r].x.data(), out[r].data());  // written into args.out
    check_combine(in, c, r, step.combined[r].x, all);
  }
}

// The semantics the cuda backend matches with kCombineNoRows (tests/gpu/low_latency_kernels_test.cpp,
// MaskLiftedBeforeCombineLeavesNoStaleRows): a rank contributes to a combine only the rows its dispatch received.
// Rank 1 masks rank 0 between its dispatch's halves (so its receive leaves rank 0's pairs out) and unmasks it before
// the combine: rank 0's tokens get nothing from rank 1's experts, without a wait or an error, and rank 1's tokens
// everything from rank 0's. The next round has everyone again.
TEST(HostLowLatency, MaskLiftedBetweenDispatchAndCombine) {
  testing::SeededRng rng;
  Case c;
  c.num_ranks = 2;
  c.num_experts = 8;
  c.num_topk = 3;
  auto groups = create_host_groups(c.num_ranks, {.timeout_ms = 20'000});
  auto buffers = make_buffers(groups);
  Step step(c.num_ranks);
  auto in = make_inputs(rng, c);
  std::barrier sync(c.num_ranks);
  const auto start = std::chrono::steady_clock::now();
  testing::on_ranks(c.num_ranks, [&](int r) {
    auto a = dispatch_args(in[r], c);
    a.return_recv_hook = true;
    step.dispatched[r] = buffers[r]->low_latency_dispatch(a);
    sync.arrive_and_wait();  // both sends are out
    if (r == 1) buffers[r]->mask_rank(0);
    step.dispatched[r].recv_hook();
    if (r == 1) buffers[r]->unmask_rank(0);
    step.combine_identity(*buffers[r], in[r], c, r);
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10)) << "nobody waits for a timeout";
  check_dispatch(in, c, 0, step.dispatched[0], {true, true});
  check_dispatch(in, c, 1, step.dispatched[1], {false, true});
  check_combine(in, c, 0, step.combined[0].x, {true, false});
  check_combine(in, c, 1, step.combined[1].x, {true, true});
  for (int r = 0; r < c.num_ranks; ++r) EXPECT_EQ(buffers[r]->rank_mask(), std::vector<bool>(2, false)) << "rank " << r;
  in = make_inputs(rng, c);
  testing::on_ranks(c.num_ranks, [&](int r) { step.round(*buffers[r], in[r], c, r); });
  for (int r = 0; r < c.num_ranks; ++r) {
    check_dispatch(in, c, r, step.dispatched[r], {true, true});
    check_combine(in, c, r, step.combined[r].x, {true, true});
  }
}

TEST(HostLowLatency, TwoResultsStayValid) {
  testing::SeededRng rng;
  Case c;
  c.num_ranks = 3;
  c.num_experts = 24;
  c.num_topk = 5;
  auto groups = create_host_groups(c.num_ranks, {.timeout_ms = 20'000});
  auto buffers = make_buffers(groups);
  auto in_a = make_inputs(rng, c);
  auto in_b = make_inputs(rng, c);
  Step a(c.num_ranks), b(c.num_ranks);
  testing::on_ranks(c.num_ranks, [&](int r) {
    a.dispatched[r] = buffers[r]->low_latency_dispatch(dispatch_args(in_a[r], c));
    b.dispatched[r] = buffers[r]->low_latency_dispatch(dispatch_args(in_b[r], c));
    // Combine B first, then A: A's outputs and handle are still valid after B.
    b.combine_identity(*buffers[r], in_b[r], c, r);
    a.combine_identity(*buffers[r], in_a[r], c, r);
  });
  const std::vector<bool> all(c.num_ranks, true);
  for (int r = 0; r < c.num_ranks; ++r) {
    EXPECT_NE(a.dispatched[r].recv_x.data(), b.dispatched[r].recv_x.data());
    check_dispatch(in_a, c, r, a.dispatched[r], all);
    check_dispatch(in_b, c, r, b.dispatched[r], all);
    check_combine(in_a, c, r, a.combined[r].x, all);
    check_combine(in_b, c, r, b.combined[r].x, all);
  }
}

TEST(HostLowLatency, ExplicitMaskSkipsTheRank) {
  testing::SeededRng rng;
  Case c;
  c.num_ranks = 4;
  c.num_experts = 32;
  c.num_topk = 6;
  constexpr int kMasked = 2;
  // A long timeout: nothing may wait for the masked rank.
  auto groups = create_host_groups(c.num_ranks, {.timeout_ms = 20'000});
  auto buffers = make_buffers(groups);
  auto in = make_inputs(rng, c);
  Step step(c.num_ranks);
  const auto start = std::chrono::steady_clock::now();
  testing::on_ranks(c.num_ranks, [&](int r) {
    if (r != kMasked) buffers[r]->mask_rank(kMasked);
    step.round(*buffers[r], in[r], c, r);
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  for (int r = 0; r < c.num_ranks; ++r) {
    // The others skip rank 2; rank 2 sees it was masked by everyone and masks them back.
    std::vector<bool> present(c.num_ranks, r != kMasked);
    present[kMasked] = r == kMasked;
    std::vector<bool> mask(present.size());
    for (size_t i = 0; i < mask.size(); ++i) mask[i] = !present[i];
    EXPECT_EQ(buffers[r]->rank_mask(), mask) << "rank " << r;
    check_dispatch(in, c, r, step.dispatched[r], present);
    check_combine(in, c, r, step.combined[r].x, present);
  }
  // After clearing the masks everyone takes part again.
  auto in2 = make_inputs(rng, c);
  testing::on_ranks(c.num_ranks, [&](int r) {
    buffers[r]->clear_rank_mask();
    step.round(*buffers[r], in2[r], c, r);
  });
  const std::vector<bool> all(c.num_ranks, true);
  for (int r = 0; r < c.num_ranks; ++r) {
    check_dispatch(in2, c, r, step.dispatched[r], all);
    check_combine(in2, c, r, step.combined[r].x, all);
  }
}

TEST(HostLowLatency, SilentRankIsMaskedAfterTimeout) {
  testing::SeededRng rng;
  Case c;
  c.num_ranks = 3;
  c.num_experts = 12;
  c.num_topk = 4;
  constexpr int kSilent = 2;
  auto groups = create_host_groups(c.num_ranks, {.timeout_ms = 200});
  auto buffers = make_buffers(groups);
  auto in = make_inputs(rng, c);
  Step step(c.num_ranks);
  testing::on_ranks(c.num_ranks, [&](int r) {
    if (r == kSilent) return;  // never calls
    step.round(*buffers[r], in[r], c, r);
  });
  const std::vector<bool> present = {true, true, false};
  for (int r = 0; r < c.num_ranks; ++r) {
    if (r == kSilent) continue;
    EXPECT_EQ(buffers[r]->rank_mask(), (std::vector<bool>{false, false, true})) << "rank " << r;
    check_dispatch(in, c, r, step.dispatched[r], present);
    check_combine(in, c, r, step.combined[r].x, present);
  }
}

// LowLatencyConfig::raise_on_timeout: the silent rank is masked as without it, and the round's combine raises
// kTimeout naming it once its output is written (the dispatch returns, so the ranks' calls stay in step); the next
// rounds run without it. A peer's deliberate mask (mask_rank) is no timeout: masked back, no error.
TEST(HostLowLatency, RaiseOnTimeoutRaisesAndKeepsTheMask) {
  testing::SeededRng rng;
  Case c;
  c.num_ranks = 3;
  c.num_experts = 12;
  c.num_topk = 4;
  constexpr int kSilent = 2;
  auto groups = create_host_groups(c.num_ranks, {.timeout_ms = 200});
  auto buffers = make_buffers(groups, /*raise_on_timeout=*/true);
  auto in = make_inputs(rng, c);
  Step step(c.num_ranks);
  std::vector<std::string> messages(c.num_ranks);
  testing::on_ranks(c.num_ranks, [&](int r) {
    if (r == kSilent) return;  // never calls
    step.dispatched[r] = buffers[r]->low_latency_dispatch(dispatch_args(in[r], c));
    try {
      step.combine_identity(*buffers[r], in[r], c, r);
      ADD_FAILURE() << "rank " << r << ": the combine raised nothing";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
      messages[r] = e.what();
    }
  });
  const std::vector<bool> without_silent = {true, true, false};
  for (int r = 0; r < c.num_ranks; ++r) {
    if (r == kSilent) continue;
    EXPECT_NE(messages[r].find("rank 2 did not post within the group timeout"), std::string::npos) << messages[r];
    EXPECT_EQ(buffers[r]->rank_mask(), (std::vector<bool>{false, false, true})) << "rank " << r;
    check_dispatch(in, c, r, step.dispatched[r], without_silent);
  }
  in = make_inputs(rng, c);
  testing::on_ranks(c.num_ranks, [&](int r) {
    if (r != kSilent) step.round(*buffers[r], in[r], c, r);
  });
  const std::vector<bool> present = {true, true, false};
  for (int r = 0; r < c.num_ranks; ++r) {
    if (r == kSilent) continue;
    check_dispatch(in, c, r, step.dispatched[r], present);
    check_combine(in, c, r, step.combined[r].x, present);
  }
  // A deliberate mask: ranks 0 and 1 of a new group mask rank 2, which finds itself masked and masks them back.
  auto groups2 = create_host_groups(c.num_ranks, {.timeout_ms = 20'000});
  auto buffers2 = make_buffers(groups2, /*raise_on_timeout=*/true);
  in = make_inputs(rng, c);
  testing::on_ranks(c.num_ranks, [&](int r) {
    if (r != kSilent) buffers2[r]->mask_rank(kSilent);
    step.round(*buffers2[r], in[r], c, r);
  });
  EXPECT_EQ(buffers2[kSilent]->rank_mask(), (std::vector<bool>{true, true, false}));
}

// unmask_rank clears one bit, locally: traffic resumes once both sides have unmasked each other.
TEST(HostLowLatency, UnmaskRankRestoresOneRank) {
  testing::SeededRng rng;
  Case c;
  c.num_ranks = 3;
  c.num_experts = 12;
  c.num_topk = 4;
  constexpr int kMasked = 0;  // the first source: every other source's rows shift to begin 0
  auto groups = create_host_groups(c.num_ranks, {.timeout_ms = 20'000});
  auto buffers = make_buffers(groups);
  Step step(c.num_ranks);
  auto round = [&](std::vector<RankInput>& in) {
    testing::on_ranks(c.num_ranks, [&](int r) { step.round(*buffers[r], in[r], c, r); });
  };
  for (int r = 1; r < c.num_ranks; ++r) buffers[r]->mask_rank(kMasked);
  auto in = make_inputs(rng, c);
  round(in);
  for (int r = 0; r < c.num_ranks; ++r) {
    std::vector<bool> present(c.num_ranks, r != kMasked);
    present[kMasked] = r == kMasked;
    check_dispatch(in, c, r, step.dispatched[r], present);
    check_combine(in, c, r, step.combined[r].x, present);
  }
  EXPECT_EQ(buffers[kMasked]->rank_mask(), (std::vector<bool>{false, true, true})) << "masked back after one call";
  // Rank 1 and rank 0 unmask each other; rank 2 keeps its mask, so rank 0 and rank 2 stay apart.
  buffers[1]->unmask_rank(kMasked);
  buffers[kMasked]->unmask_rank(1);
  buffers[kMasked]->unmask_rank(kMasked);  // its own bit: already clear, a no-op
  EXPECT_EQ(buffers[1]->rank_mask(), std::vector<bool>(c.num_ranks, false));
  EXPECT_EQ(buffers[kMasked]->rank_mask(), (std::vector<bool>{false, false, true}));
  in = make_inputs(rng, c);
  round(in);
  const std::vector<std::vector<bool>> present = {{true, true, false}, {true, true, true}, {false, true, true}};
  for (int r = 0; r < c.num_ranks; ++r) {
    check_dispatch(in, c, r, step.dispatched[r], present[r]);
    check_combine(in, c, r, step.combined[r].x, present[r]);
  }
  expect_invalid([&] { buffers[0]->unmask_rank(-1); }, "rank");
  expect_invalid([&] { buffers[0]->unmask_rank(c.num_ranks); }, "rank");
}

TEST(HostLowLatency, RejectsBadInput) {
  auto groups = create_host_groups(1, {.timeout_ms = 1'000});
  auto buffers = make_buffers(groups);
  Buffer& buffer = *buffers[0];
  std::mt19937 rng(3);
  Case c;
  c.num_experts = 8;
  c.num_topk = 3;
  c.max_tokens = 8;
  auto in = make_inputs(rng, c);
  auto& d = in[0];
  d.topk[1] = 8;
  expect_invalid([&] { buffer.low_latency_dispatch(dispatch_args(d, c)); }, "topk_idx[0][1] = 8");
  d.topk[1] = (d.topk[0] + 1) % 8 == d.topk[2] ? (d.topk[0] + 2) % 8 : (d.topk[0] + 1) % 8;
  expect_invalid(
      [&] {
        auto a = dispatch_args(d, c);
        a.max_tokens_per_rank = d.num_tokens - 1;
        buffer.low_latency_dispatch(a);
      },
      "max_tokens_per_rank");
  std::vector<uint16_t> x(d.num_tokens * 200);
  expect_invalid(
      [&] {
        auto a = dispatch_args(d, c);
        a.x = TensorView::of(x.data(), DType::kBFloat16, {d.num_tokens, 200});
        buffer.low_latency_dispatch(a);
      },
      "multiple of 128");
  std::vector<uint16_t> big(16512);
  expect_invalid(
      [&] {
        auto a = dispatch_args(d, c);
        a.x = TensorView::of(big.data(), DType::kBFloat16, {1, 16512});
        a.topk_idx = TensorView::of(d.topk.data(), DType::kInt64, {1, 3});
        buffer.low_latency_dispatch(a);
      },
      "16384");
  std::vector<int64_t> wide(17, 0);
  expect_invalid(
      [&] {
        auto a = dispatch_args(d, c);
        a.x = TensorView::of(d.x.data(), DType::kBFloat16, {1, c.hidden});
        a.topk_idx = TensorView::of(wide.data(), DType::kInt64, {1, 17});
        buffer.low_latency_dispatch(a);
      },
      "topk_idx");
  expect_invalid(
      [&] {
        auto a = dispatch_args(d, c);
        a.num_experts = 2048;
        buffer.low_latency_dispatch(a);
      },
      "num_experts");
  expect_invalid(
      [&] {
        auto a = dispatch_args(d, c);
        a.topk_idx.shape[0] -= 1;
        buffer.low_latency_dispatch(a);
      },
      "topk_idx");
  std::vector<int32_t> counts(3);
  expect_invalid(
      [&] {
        auto a = dispatch_args(d, c);
        a.cumulative_recv_counts = TensorView::of(counts.data(), DType::kInt32, {3});
        buffer.low_latency_dispatch(a);
      },
      "cumulative_recv_counts");
  // Without low-latency memory the path is off.
  auto plain = Buffer::create(groups[0]);
  expect_invalid([&] { plain->low_latency_dispatch(dispatch_args(d, c)); }, "num_low_latency_bytes");

  // Combine: before the hook ran, and with mismatched shapes.
  auto ha = dispatch_args(d, c);
  ha.return_recv_hook = true;
  auto pending = buffer.low_latency_dispatch(ha);
  auto expert_out = std::vector<uint16_t>(c.num_experts * c.max_tokens * c.hidden);
  expect_invalid([&] { buffer.low_latency_combine(combine_args(d, c, pending, expert_out)); }, "recv_hook");
  pending.recv_hook();
  expect_invalid(
      [&] {
        auto a = combine_args(d, c, pending, expert_out);
        a.x.shape[1] -= 1;
        buffer.low_latency_combine(a);
      },
      "x dim 1");
  expect_invalid(
      [&] {
        auto a = combine_args(d, c, pending, expert_out);
        a.topk_weights.shape[1] = 2;
        buffer.low_latency_combine(a);
      },
      "topk_weights");
  expect_invalid(
      [&] {
        auto a = combine_args(d, c, pending, expert_out);
        a.handle = nullptr;
        buffer.low_latency_combine(a);
      },
      "handle");
  expect_invalid([&] { buffer.mask_rank(1); }, "rank");
  expect_invalid([&] { buffer.mask_rank(0); }, "itself");
  // Experts not divisible by ranks: each rank throws before posting anything.
  auto groups3 = create_host_groups(3, {.timeout_ms = 1'000});
  auto buffers3 = make_buffers(groups3);
  testing::on_ranks(3, [&](int r) {
    auto a = dispatch_args(d, c);
    expect_invalid([&] { buffers3[r]->low_latency_dispatch(a); }, "divisible by num_ranks");
  });
}

}  // namespace
}  // namespace epx

namespace epx {
namespace {

// Regression: a rank that finished its last combine and destroyed its buffer used to drop its posts
// before a slower peer had read them; the peer then waited out the timeout and masked it.
TEST(HostLowLatency, BufferDestroyedRightAfterLastCombine) {
  for (int iter = 0; iter < 30; ++iter) {
    HostGroupOptions options;
    options.timeout_ms = 2000;
    auto groups = create_host_groups(2, options);
    const int64_t num_tokens = 1, hidden = 256, num_experts = 4;
    std::vector<std::vector<uint16_t>> x(2, std::vector<uint16_t>(num_tokens * hidden, float_to_bf16(1.f)));
    std::vector<std::vector<int64_t>> topk = {{3}, {0}};
    std::vector<std::vector<float>> w(2, std::vector<float>(1, 1.f));
    std::vector<std::vector<uint16_t>> y(2, std::vector<uint16_t>(2 * 2 * 1 * hidden, float_to_bf16(1.f)));
    run_host_ranks(groups, [&](int r, Group&) {
      BufferOptions bo;
      bo.num_low_latency_bytes = 1;
      auto buffer = Buffer::create(groups[r], bo);
      LowLatencyDispatchArgs a;
      a.x = TensorView::of(x[r].data(), DType::kBFloat16, {num_tokens, hidden});
      a.topk_idx = TensorView::of(topk[r].data(), DType::kInt64, {num_tokens, 1});
      a.max_tokens_per_rank = 1;
      a.num_experts = num_experts;
      const auto d = buffer->low_latency_dispatch(a);
      LowLatencyCombineArgs c;
      c.x = TensorView::of(y[r].data(), DType::kBFloat16, {2, 2, hidden});
      c.topk_idx = a.topk_idx;
      c.topk_weights = TensorView::of(w[r].data(), DType::kFloat32, {num_tokens, 1});
      c.handle = d.handle;
      buffer->low_latency_combine(c);
      const auto mask = buffer->rank_mask();
      EXPECT_FALSE(mask[0] || mask[1]) << "iteration " << iter << ", rank " << r;
    });
  }
}

// LowLatencyConfig::expert_side_reduction (flat routing): per expert rank d ascending, p_d = 0 + w * y over d's
// pairs in ascending k (fp32), rounded to bf16; out = bf16(0 + p_0 + p_1 + ...). Checked bit for bit against that
// arithmetic done here from the dispatch results, with random expert outputs (so the two orders differ), an idle
// rank and -1 entries, and with 3 or 4 ranks a second pass where the first and last rank mask each other (their pairs
// and partials for each other contribute zero); the default (one rounding, ascending k) on the same data differs
// somewhere.
TEST(HostLowLatency, ExpertSideReductionSumsPerRankFirst) {
  testing::SeededRng rng;
  for (const auto& [case_ranks, case_masked] : {std::pair{1, false}, std::pair{2, false}, std::pair{3, false},
                                                std::pair{4, false}, std::pair{3, true}, std::pair{4, true}}) {
    const int num_ranks = case_ranks;
    const bool masked = case_masked;  // plain copies: lambdas capture them
    Case c;
    c.num_ranks = num_ranks;
    c.num_experts = 12 * num_ranks;
    c.num_topk = 8;
    c.max_tokens = 16;
    c.hidden = 256;
    SCOPED_TRACE("ranks " + std::to_string(num_ranks) + (masked ? ", 0 and R-1 masked" : ""));
    const auto in = make_inputs(rng, c);
    // Whether rank a's pairs reach rank b and come back (the mask of the second pass is symmetric).
    auto open = [&](int a, int b) {
      return !masked || !((a == 0 && b == num_ranks - 1) || (b == 0 && a == num_ranks - 1));
    };
    const int64_t R = num_ranks, M = c.max_tokens, H = c.hidden, K = c.num_topk, E_local = c.num_experts / R;
    std::vector<std::vector<uint16_t>> y(R);
    for (auto& v : y) v = testing::random_bf16(rng, E_local * R * M * H, 4.f);
    std::vector<std::vector<int32_t>> src_info(R), count(R);
    std::vector<std::vector<int64_t>> range(R);
    std::vector<std::vector<uint16_t>> out[2];  // [expert_side][rank]
    for (const bool expert_side : {false, true}) {
      auto groups = create_host_groups(num_ranks, {.timeout_ms = 20'000});
      out[expert_side].resize(R);
      auto inputs = in;
      run_host_ranks(groups, [&](int r, Group&) {
        BufferOptions options;
        options.num_low_latency_bytes = 1;
        options.low_latency.expert_side_reduction = expert_side;
        auto buffer = Buffer::create(groups[r], options);
        for (int q = 0; q < num_ranks; ++q) {
          if (!open(r, q)) buffer->mask_rank(q);
        }
        const auto d = buffer->low_latency_dispatch(dispatch_args(inputs[r], c));
        src_info[r].assign(d.recv_src_info.data_as<int32_t>(), d.recv_src_info.data_as<int32_t>() + E_local * R * M);
        count[r].assign(d.recv_count.data_as<int32_t>(), d.recv_count.data_as<int32_t>() + E_local);
        range[r].assign(d.recv_layout_range.data_as<int64_t>(), d.recv_layout_range.data_as<int64_t>() + E_local * R);
        const auto o = buffer->low_latency_combine(combine_args(inputs[r], c, d, y[r]));
        out[expert_side][r].assign(o.x.data_as<uint16_t>(), o.x.data_as<uint16_t>() + inputs[r].num_tokens * H);
      });
    }
    bool orders_differ = false;
    for (int r = 0; r < R; ++r) {
      SCOPED_TRACE("token rank " + std::to_string(r));
      const int64_t T = in[r].num_tokens;
      for (int64_t t = 0; t < T; ++t) {
        std::vector<float> acc(H, 0.f);
        for (int d = 0; d < R; ++d) {
          std::vector<float> p(H, 0.f);
          bool any = false;
          for (int64_t k = 0; k < K; ++k) {
            const int64_t e = in[r].topk[t * K + k];
            if (e < 0 || e / E_local != d || !open(r, d)) continue;
            // The pair's packed row on rank d: source r's block of expert e, the entry naming token t.
            const int64_t el = e % E_local, packed = range[d][el * R + r];
            int64_t row = -1;
            for (int64_t i = packed >> 32; i < (packed >> 32) + (packed & 0xffffffff); ++i) {
              if (src_info[d][el * R * M + i] == t) row = i;
            }
            ASSERT_GE(row, 0) << "token " << t << " expert " << e;
            any = true;
            const float w = in[r].weights[t * K + k];
            for (int64_t h = 0; h < H; ++h) {
              const float product = w * bf16_to_float(y[d][(el * R * M + row) * H + h]);
              p[h] += product;
            }
          }
          if (!any) continue;
          for (int64_t h = 0; h < H; ++h) acc[h] += bf16_to_float(float_to_bf16(p[h]));
        }
        for (int64_t h = 0; h < H; ++h) {
          ASSERT_EQ(out[1][r][t * H + h], float_to_bf16(acc[h])) << "token " << t << " h " << h;
          orders_differ |= out[0][r][t * H + h] != out[1][r][t * H + h];
        }
      }
    }
    if (num_ranks > 1) {
      EXPECT_TRUE(orders_differ) << "the option changed nothing";
    }
  }
}

// wait_recv_cost_ns (DeepEP's dispatch/combine_wait_recv_cost_stats): the receive adds per peer the time until the
// peer's data was there; a rank that starts late stands out in everyone else's entry for it, calls accumulate, and a
// masked rank adds nothing.
TEST(HostLowLatency, WaitCostStatsNameTheLateRank) {
  constexpr int R = 3;
  constexpr int64_t kLateMs = 60;
  Case c;
  c.num_ranks = R;
  c.num_experts = 12;
  c.num_topk = 4;
  c.max_tokens = 8;
  c.hidden = 128;
  std::mt19937 rng(5);
  auto in = make_inputs(rng, c);
  auto groups = create_host_groups(R, {.timeout_ms = 20'000});
  std::vector<std::vector<int64_t>> dispatch_ns(R, std::vector<int64_t>(R, 0)), combine_ns = dispatch_ns;
  std::vector<std::vector<uint16_t>> y(R);
  run_host_ranks(groups, [&](int r, Group&) {
    BufferOptions options;
    options.num_low_latency_bytes = 1;
    auto buffer = Buffer::create(groups[r], options);
    for (int round = 0; round < 2; ++round) {  // the late rank is 2, then (round 1) 2 again: entries accumulate
      if (r == 2) std::this_thread::sleep_for(std::chrono::milliseconds(kLateMs));
      auto a = dispatch_args(in[r], c);
      a.wait_recv_cost_ns = TensorView::of(dispatch_ns[r].data(), DType::kInt64, {R});
      const auto d = buffer->low_latency_dispatch(a);
      y[r] = identity_expert(c, d);
      if (r == 2) std::this_thread::sleep_for(std::chrono::milliseconds(kLateMs));
      auto b = combine_args(in[r], c, d, y[r]);
      b.wait_recv_cost_ns = TensorView::of(combine_ns[r].data(), DType::kInt64, {R});
      buffer->low_latency_combine(b);
    }
    // Masked: rank 0 masks rank 2 (and 2 masks 0) for one more round; 0's entries for 2 stay.
    if (r != 1) buffer->mask_rank(r == 0 ? 2 : 0);
    const auto before = dispatch_ns[r];
    auto a = dispatch_args(in[r], c);
    a.wait_recv_cost_ns = TensorView::of(dispatch_ns[r].data(), DType::kInt64, {R});
    buffer->low_latency_dispatch(a);
    if (r == 0) {
      EXPECT_EQ(dispatch_ns[0][2], before[2]) << "a masked rank adds nothing";
    }
  });
  const int64_t late_ns = 2 * kLateMs * 1'000'000;
  for (int r : {0, 1}) {
    SCOPED_TRACE("rank " + std::to_string(r));
    // Two late rounds: at least ~2 x kLateMs waited for rank 2 in each direction, far less for the punctual ones.
    EXPECT_GE(dispatch_ns[r][2], late_ns * 9 / 10);
    EXPECT_GE(combine_ns[r][2], late_ns * 9 / 10);
    EXPECT_LT(dispatch_ns[r][1 - r], late_ns / 2);
    EXPECT_LT(combine_ns[r][1 - r], late_ns / 2);
    EXPECT_GE(dispatch_ns[r][r], 0);
  }
  // Rank 2 itself came last: it waited little for anyone.
  EXPECT_LT(dispatch_ns[2][0], late_ns / 2);
  EXPECT_LT(combine_ns[2][1], late_ns / 2);
}

}  // namespace
}  // namespace epx
