// Host backend, normal mode: dispatch/combine against a brute-force expectation built here.
//
// Routing: every rank draws its own tokens (one rank is idle with T = 0) with random distinct top-k
// experts, ~10% of the slots -1. x holds small integers (|x| <= 8) so bf16 sums over <= 16 ranks plus
// two biases are exact. For every receiving rank r the test derives which rows it must get (source
// rank ascending, then token index), with which data / remapped topk / weights / src_idx, and the
// per-local-expert counts rounded up to expert_alignment; combine of identity experts must return
// x * (number of distinct ranks the token visited) + bias_0 + bias_1 exactly, and the weights back.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>

#include "epx/buffer.h"
#include "epx/error.h"
#include "epx/group.h"
#include "epx/quant.h"
#include "epx/routing.h"
#include "test_util.h"

namespace epx {
namespace {

struct RankInput {
  int64_t num_tokens = 0;
  std::vector<uint16_t> x;      // [T, H] bf16
  std::vector<int64_t> topk;    // [T, K]
  std::vector<int32_t> topk32;  // [T, K]
  std::vector<float> weights;   // [T, K]
};

struct Case {
  int num_ranks = 1;
  int64_t hidden = 128;
  int num_topk = 1;
  int64_t num_experts = 8;
  int expert_alignment = 1;
  bool int32_topk = false;
  bool with_weights = true;
};

std::vector<uint16_t> small_int_bf16(std::mt19937& rng, size_t n) {
  std::uniform_int_distribution<int> value(-8, 8);
  std::vector<uint16_t> out(n);
  for (auto& v : out) v = float_to_bf16(static_cast<float>(value(rng)));
  return out;
}

std::vector<RankInput> make_inputs(std::mt19937& rng, const Case& c, int64_t max_tokens) {
  std::vector<RankInput> in(c.num_ranks);
  std::uniform_int_distribution<int64_t> tokens(1, max_tokens);
  const int idle = static_cast<int>(rng() % c.num_ranks);
  std::uniform_real_distribution<float> weight(0.f, 1.f);
  for (int r = 0; r < c.num_ranks; ++r) {
    auto& d = in[r];
    d.num_tokens = (r == idle && c.num_ranks > 1) ? 0 : tokens(rng);
    d.x = small_int_bf16(rng, d.num_tokens * c.hidden);
    d.topk = testing::random_topk(rng, d.num_tokens, c.num_topk, c.num_experts, 0.1);
    d.topk32.assign(d.topk.begin(), d.topk.end());
    d.weights.resize(d.topk.size());
    for (auto& w : d.weights) w = weight(rng);
  }
  return in;
}

TensorView topk_view(const RankInput& d, const Case& c) {
  return c.int32_topk ? TensorView::of(const_cast<int32_t*>(d.topk32.data()), DType::kInt32, {d.num_tokens, c.num_topk})
                      : TensorView::of(const_cast<int64_t*>(d.topk.data()), DType::kInt64, {d.num_tokens, c.num_topk});
}

DispatchArgs dispatch_args(const RankInput& d, const Case& c) {
  DispatchArgs a;
  a.x = TensorView::of(const_cast<uint16_t*>(d.x.data()), DType::kBFloat16, {d.num_tokens, c.hidden});
  a.topk_idx = topk_view(d, c);
  if (c.with_weights) {
    a.topk_weights = TensorView::of(const_cast<float*>(d.weights.data()), DType::kFloat32, {d.num_tokens, c.num_topk});
  }
  a.num_experts = c.num_experts;
  a.expert_alignment = c.expert_alignment;
  return a;
}

// The rows rank `dst` must receive: (source rank, token) by source rank, then token.
std::vector<std::pair<int, int64_t>> expected_rows(const std::vector<RankInput>& in, const Case& c, int dst) {
  const int64_t per_rank = c.num_experts / c.num_ranks;
  std::vector<std::pair<int, int64_t>> rows;
  for (int s = 0; s < c.num_ranks; ++s) {
    for (int64_t t = 0; t < in[s].num_tokens; ++t) {
      bool sent = false;
      for (int k = 0; k < c.num_topk; ++k) {
        const int64_t e = in[s].topk[t * c.num_topk + k];
        sent = sent || (e >= 0 && e / per_rank == dst);
      }
      if (sent) rows.emplace_back(s, t);
    }
  }
  return rows;
}

int64_t recv_topk(const DispatchResult& res, int64_t i) {
  return res.recv_topk_idx.dtype() == DType::kInt64 ? res.recv_topk_idx.data_as<int64_t>()[i]
                                                    : res.recv_topk_idx.data_as<int32_t>()[i];
}

std::string describe(const Case& c) {
  return "ranks " + std::to_string(c.num_ranks) + ", hidden " + std::to_string(c.hidden) + ", top-" +
         std::to_string(c.num_topk) + " of " + std::to_string(c.num_experts) + ", alignment " +
         std::to_string(c.expert_alignment) + (c.int32_topk ? ", int32" : ", int64") +
         (c.with_weights ? ", weights" : "");
}

std::vector<std::unique_ptr<Buffer>> make_buffers(const std::vector<std::shared_ptr<Group>>& groups) {
  std::vector<std::unique_ptr<Buffer>> buffers;
  for (const auto& g : groups) buffers.push_back(Buffer::create(g));
  return buffers;
}

// Checks rank dst's dispatch result row by row against the brute force (rows past the received count
// are checked as worst-token padding).
void check_dispatch(const std::vector<RankInput>& in, const Case& c, int dst, const DispatchResult& res,
                    int64_t num_worst_tokens) {
  SCOPED_TRACE("receiving rank " + std::to_string(dst));
  const auto rows = expected_rows(in, c, dst);
  const int64_t n = static_cast<int64_t>(rows.size());
  const int64_t num_rows = num_worst_tokens > 0 ? num_worst_tokens : n;
  const int64_t per_rank = c.num_experts / c.num_ranks;
  const int K = c.num_topk;
  ASSERT_EQ(res.recv_x.sizes(), (std::vector<int64_t>{num_rows, c.hidden}));
  ASSERT_EQ(res.recv_src_idx.sizes(), (std::vector<int64_t>{num_rows}));
  ASSERT_EQ(res.recv_topk_idx.sizes(), (std::vector<int64_t>{num_rows, K}));
  EXPECT_EQ(res.recv_topk_idx.dtype(), c.int32_topk ? DType::kInt32 : DType::kInt64);
  EXPECT_EQ(res.recv_topk_weights.defined(), c.with_weights);
  EXPECT_EQ(res.handle->num_recv_tokens(), n);
  EXPECT_EQ(res.handle->num_tokens(), in[dst].num_tokens);
  std::vector<int64_t> pairs(per_rank, 0);
  for (int64_t i = 0; i < n; ++i) {
    const auto [s, t] = rows[i];
    ASSERT_EQ(res.recv_src_idx.data_as<int32_t>()[i], t) << "row " << i;
    ASSERT_EQ(std::memcmp(res.recv_x.data_as<uint16_t>() + i * c.hidden, in[s].x.data() + t * c.hidden, c.hidden * 2),
              0)
        << "row " << i << " from rank " << s << " token " << t;
    for (int k = 0; k < K; ++k) {
      const int64_t e = in[s].topk[t * K + k];
      const bool local = e >= 0 && e / per_rank == dst;
      ASSERT_EQ(recv_topk(res, i * K + k), local ? e - dst * per_rank : -1) << "row " << i << " k " << k;
      if (local) ++pairs[e - dst * per_rank];
      if (c.with_weights) {
        ASSERT_EQ(res.recv_topk_weights.data_as<float>()[i * K + k], local ? in[s].weights[t * K + k] : 0.f);
      }
    }
  }
  for (int64_t i = n; i < num_rows; ++i) {
    ASSERT_EQ(res.recv_src_idx.data_as<int32_t>()[i], -1) << "padded row " << i;
    for (int k = 0; k < K; ++k) ASSERT_EQ(recv_topk(res, i * K + k), -1) << "padded row " << i;
  }
  std::vector<int32_t> counts(per_rank);
  for (int64_t e = 0; e < per_rank; ++e) {
    counts[e] = static_cast<int32_t>((pairs[e] + c.expert_alignment - 1) / c.expert_alignment * c.expert_alignment);
  }
  if (num_worst_tokens > 0) {
    EXPECT_TRUE(res.num_recv_tokens_per_expert.empty());
  } else {
    EXPECT_EQ(res.num_recv_tokens_per_expert, counts);
  }
  ASSERT_EQ(res.recv_expert_counts.sizes(), (std::vector<int64_t>{per_rank}));
  EXPECT_EQ(std::vector<int32_t>(res.recv_expert_counts.data_as<int32_t>(),
                                 res.recv_expert_counts.data_as<int32_t>() + per_rank),
            counts);
}

// Combine of identity experts (x = recv_x, weights = recv_topk_weights) with biases.
void check_identity_combine(const std::vector<RankInput>& in, const Case& c,
                            std::vector<std::unique_ptr<Buffer>>& buffers,
                            const std::vector<DispatchResult>& dispatched, std::mt19937& rng, bool with_bias) {
  const int R = c.num_ranks;
  std::vector<std::vector<uint16_t>> bias_0(R), bias_1(R);
  for (int r = 0; r < R; ++r) {
    bias_0[r] = small_int_bf16(rng, in[r].num_tokens * c.hidden);
    bias_1[r] = small_int_bf16(rng, in[r].num_tokens * c.hidden);
  }
  std::vector<CombineResult> combined(R);
  testing::on_ranks(R, [&](int r) {
    CombineArgs a;
    a.x = dispatched[r].recv_x;
    if (c.with_weights) a.topk_weights = dispatched[r].recv_topk_weights;
    if (with_bias) {
      a.bias_0 = TensorView::of(bias_0[r].data(), DType::kBFloat16, {in[r].num_tokens, c.hidden});
      a.bias_1 = TensorView::of(bias_1[r].data(), DType::kBFloat16, {in[r].num_tokens, c.hidden});
    }
    a.handle = dispatched[r].handle;
    combined[r] = buffers[r]->combine(a);
  });
  const int64_t per_rank = c.num_experts / R;
  const int K = c.num_topk;
  for (int r = 0; r < R; ++r) {
    SCOPED_TRACE("token rank " + std::to_string(r));
    const auto& out = combined[r];
    ASSERT_EQ(out.x.sizes(), (std::vector<int64_t>{in[r].num_tokens, c.hidden}));
    EXPECT_EQ(out.topk_weights.defined(), c.with_weights);
    for (int64_t t = 0; t < in[r].num_tokens; ++t) {
      std::vector<bool> visited(R, false);
      for (int k = 0; k < K; ++k) {
        const int64_t e = in[r].topk[t * K + k];
        if (e >= 0) visited[e / per_rank] = true;
      }
      const int64_t num_visited = std::count(visited.begin(), visited.end(), true);
      for (int64_t h = 0; h < c.hidden; ++h) {
        const int64_t i = t * c.hidden + h;
        float expected = bf16_to_float(in[r].x[i]) * static_cast<float>(num_visited);
        if (with_bias) expected += bf16_to_float(bias_0[r][i]) + bf16_to_float(bias_1[r][i]);
        ASSERT_EQ(bf16_to_float(out.x.data_as<uint16_t>()[i]), expected) << "token " << t << " h " << h;
      }
      for (int k = 0; k < K && c.with_weights; ++k) {
        const float expected = in[r].topk[t * K + k] >= 0 ? in[r].weights[t * K + k] : 0.f;
        ASSERT_EQ(out.topk_weights.data_as<float>()[t * K + k], expected) << "token " << t << " k " << k;
      }
    }
  }
}

std::vector<DispatchResult> run_dispatch(std::vector<std::unique_ptr<Buffer>>& buffers,
                                         const std::function<DispatchArgs(int)>& make_args) {
  std::vector<DispatchResult> results(buffers.size());
  testing::on_ranks(static_cast<int>(buffers.size()), [&](int r) { results[r] = buffers[r]->dispatch(make_args(r)); });
  return results;
}

unsigned fresh_seed() {
  std::random_device source;
  return source();
}

TEST(HostBuffer, DispatchCombineMatchBruteForce) {
  const unsigned seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  for (int num_ranks : {1, 2, 3, 4, 8, 16}) {
    auto groups = create_host_groups(num_ranks, {.timeout_ms = 20'000});
    auto buffers = make_buffers(groups);
    for (int64_t num_experts : {8, 24, 64, 96, 256, 288}) {
      if (num_experts % num_ranks != 0) continue;
      Case c;
      c.num_ranks = num_ranks;
      c.num_experts = num_experts;
      c.hidden = std::vector<int64_t>{64, 128, 200}[rng() % 3];
      c.num_topk = 1 + static_cast<int>(rng() % 9);
      c.expert_alignment = std::vector<int>{1, 4, 128}[rng() % 3];
      c.int32_topk = rng() % 2 == 0;
      c.with_weights = rng() % 4 != 0;
      const bool with_bias = rng() % 2 == 0;
      SCOPED_TRACE(describe(c));
      const auto in = make_inputs(rng, c, std::vector<int64_t>{1, 7, 100, 400}[rng() % 4]);
      const auto results = run_dispatch(buffers, [&](int r) { return dispatch_args(in[r], c); });
      for (int r = 0; r < num_ranks; ++r) check_dispatch(in, c, r, results[r], 0);
      check_identity_combine(in, c, buffers, results, rng, with_bias);
    }
  }
}

TEST(HostBuffer, CachedDispatchEqualsFresh) {
  const unsigned seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  for (int num_ranks : {1, 4, 8}) {
    auto groups = create_host_groups(num_ranks, {.timeout_ms = 20'000});
    auto buffers = make_buffers(groups);
    Case c;
    c.num_ranks = num_ranks;
    c.num_experts = 32;
    c.hidden = 128;
    c.num_topk = 4;
    c.expert_alignment = 8;
    const auto in = make_inputs(rng, c, 50);
    const auto first = run_dispatch(buffers, [&](int r) { return dispatch_args(in[r], c); });
    // New data along the same routes: cached must equal a fresh dispatch of the new data.
    auto in2 = in;
    for (auto& d : in2) d.x = small_int_bf16(rng, d.num_tokens * c.hidden);
    const auto fresh = run_dispatch(buffers, [&](int r) { return dispatch_args(in2[r], c); });
    const auto cached = run_dispatch(buffers, [&](int r) {
      DispatchArgs a;
      a.x = TensorView::of(in2[r].x.data(), DType::kBFloat16, {in2[r].num_tokens, c.hidden});
      a.handle = first[r].handle;
      return a;
    });
    for (int r = 0; r < num_ranks; ++r) {
      check_dispatch(in2, c, r, fresh[r], 0);
      ASSERT_EQ(cached[r].recv_x.sizes(), fresh[r].recv_x.sizes());
      EXPECT_EQ(std::memcmp(cached[r].recv_x.data(), fresh[r].recv_x.data(), fresh[r].recv_x.nbytes()), 0);
      EXPECT_EQ(
          std::memcmp(cached[r].recv_src_idx.data(), fresh[r].recv_src_idx.data(), fresh[r].recv_src_idx.nbytes()), 0);
      EXPECT_FALSE(cached[r].recv_topk_idx.defined());
      EXPECT_FALSE(cached[r].recv_topk_weights.defined());
      EXPECT_EQ(cached[r].num_recv_tokens_per_expert, fresh[r].num_recv_tokens_per_expert);
      EXPECT_EQ(cached[r].handle->num_recv_tokens(), fresh[r].handle->num_recv_tokens());
    }
    // The cached handle combines like the fresh one.
    auto c2 = c;
    c2.with_weights = false;
    check_identity_combine(in2, c2, buffers, cached, rng, true);
  }
}

TEST(HostBuffer, WorstTokenModePadsAndRejectsTooSmall) {
  const unsigned seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const int num_ranks = 4;
  auto groups = create_host_groups(num_ranks, {.timeout_ms = 20'000});
  auto buffers = make_buffers(groups);
  Case c;
  c.num_ranks = num_ranks;
  c.num_experts = 16;
  c.hidden = 128;
  c.num_topk = 3;
  c.expert_alignment = 2;
  const auto in = make_inputs(rng, c, 40);
  int64_t max_recv = 0;
  for (int r = 0; r < num_ranks; ++r) max_recv = std::max<int64_t>(max_recv, expected_rows(in, c, r).size());
  const int64_t worst = max_recv + 5;
  const auto res = run_dispatch(buffers, [&](int r) {
    auto a = dispatch_args(in[r], c);
    a.num_worst_tokens = worst;
    return a;
  });
  for (int r = 0; r < num_ranks; ++r) check_dispatch(in, c, r, res[r], worst);
  check_identity_combine(in, c, buffers, res, rng, false);
  // Cached worst-token dispatch pads the same way.
  const auto cached = run_dispatch(buffers, [&](int r) {
    DispatchArgs a;
    a.x = TensorView::of(const_cast<uint16_t*>(in[r].x.data()), DType::kBFloat16, {in[r].num_tokens, c.hidden});
    a.handle = res[r].handle;
    a.num_worst_tokens = worst;
    return a;
  });
  for (int r = 0; r < num_ranks; ++r) {
    ASSERT_EQ(cached[r].recv_x.size(0), worst);
    EXPECT_EQ(std::memcmp(cached[r].recv_src_idx.data(), res[r].recv_src_idx.data(), worst * 4), 0);
  }

  // Too small on the ranks that receive more rows than that: kInvalidArgument there, the others succeed.
  const int64_t too_small = max_recv - 1;
  std::vector<int> codes(num_ranks, 0);
  std::vector<std::string> messages(num_ranks);
  testing::on_ranks(num_ranks, [&](int r) {
    auto a = dispatch_args(in[r], c);
    a.num_worst_tokens = too_small;
    try {
      buffers[r]->dispatch(a);
    } catch (const Error& e) {
      codes[r] = static_cast<int>(e.code());
      messages[r] = e.what();
    }
  });
  for (int r = 0; r < num_ranks; ++r) {
    const bool overflows = static_cast<int64_t>(expected_rows(in, c, r).size()) > too_small;
    EXPECT_EQ(codes[r], overflows ? static_cast<int>(ErrorCode::kInvalidArgument) : 0) << messages[r];
    if (overflows) {
      EXPECT_NE(messages[r].find("num_worst_tokens"), std::string::npos) << messages[r];
    }
  }
}

TEST(HostBuffer, Fp8DispatchMovesDataAndScalesExactly) {
  const unsigned seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  for (const ScaleFormat format : {ScaleFormat::kFloat32, ScaleFormat::kUE8M0}) {
    const int num_ranks = 4;
    auto groups = create_host_groups(num_ranks, {.timeout_ms = 20'000});
    auto buffers = make_buffers(groups);
    Case c;
    c.num_ranks = num_ranks;
    c.num_experts = 32;
    c.hidden = 256;
    c.num_topk = 5;
    auto in = make_inputs(rng, c, 30);
    const int64_t num_blocks = c.hidden / kFp8BlockSize;
    const DType scale_dtype = format == ScaleFormat::kUE8M0 ? DType::kUInt8 : DType::kFloat32;
    const size_t scale_size = dtype_size(scale_dtype);
    std::vector<std::vector<uint8_t>> x8(num_ranks), scales(num_ranks);
    for (int r = 0; r < num_ranks; ++r) {
      in[r].x = testing::random_bf16(rng, in[r].num_tokens * c.hidden, 100.f);
      x8[r].resize(in[r].num_tokens * c.hidden);
      scales[r].resize(in[r].num_tokens * num_blocks * scale_size);
      quantize_fp8_host(TensorView::of(in[r].x.data(), DType::kBFloat16, {in[r].num_tokens, c.hidden}),
                        TensorView::of(x8[r].data(), DType::kFloat8E4M3, {in[r].num_tokens, c.hidden}),
                        TensorView::of(scales[r].data(), scale_dtype, {in[r].num_tokens, num_blocks}), format);
    }
    const auto res = run_dispatch(buffers, [&](int r) {
      auto a = dispatch_args(in[r], c);
      a.x = TensorView::of(x8[r].data(), DType::kFloat8E4M3, {in[r].num_tokens, c.hidden});
      a.x_scales = TensorView::of(scales[r].data(), scale_dtype, {in[r].num_tokens, num_blocks});
      return a;
    });
    for (int r = 0; r < num_ranks; ++r) {
      const auto rows = expected_rows(in, c, r);
      const int64_t n = static_cast<int64_t>(rows.size());
      ASSERT_EQ(res[r].recv_x.dtype(), DType::kFloat8E4M3);
      ASSERT_EQ(res[r].recv_x.sizes(), (std::vector<int64_t>{n, c.hidden}));
      ASSERT_EQ(res[r].recv_x_scales.dtype(), scale_dtype);
      ASSERT_EQ(res[r].recv_x_scales.sizes(), (std::vector<int64_t>{n, num_blocks}));
      std::vector<float> back(n * c.hidden);
      dequantize_fp8_host(res[r].recv_x, res[r].recv_x_scales,
                          TensorView::of(back.data(), DType::kFloat32, {n, c.hidden}));
      for (int64_t i = 0; i < n; ++i) {
        const auto [s, t] = rows[i];
        ASSERT_EQ(std::memcmp(res[r].recv_x.data_as<uint8_t>() + i * c.hidden, x8[s].data() + t * c.hidden, c.hidden),
                  0)
            << "row " << i;
        ASSERT_EQ(std::memcmp(res[r].recv_x_scales.data_as<uint8_t>() + i * num_blocks * scale_size,
                              scales[s].data() + t * num_blocks * scale_size, num_blocks * scale_size),
                  0)
            << "row " << i;
        ASSERT_EQ(res[r].recv_src_idx.data_as<int32_t>()[i], t);
        // Round trip against the original bf16 row, relative to each block's amax.
        for (int64_t b = 0; b < num_blocks; ++b) {
          float amax = 0.f;
          for (int j = 0; j < kFp8BlockSize; ++j) {
            amax = std::max(amax, std::fabs(bf16_to_float(in[s].x[t * c.hidden + b * kFp8BlockSize + j])));
          }
          for (int j = 0; j < kFp8BlockSize; ++j) {
            const int64_t h = b * kFp8BlockSize + j;
            ASSERT_LE(std::fabs(back[i * c.hidden + h] - bf16_to_float(in[s].x[t * c.hidden + h])),
                      kFp8RoundTripRelError * amax)
                << "row " << i << " h " << h;
          }
        }
      }
    }
  }
}

// Expects fn to throw Error(kInvalidArgument) whose message contains `needle`.
using epx::testing::expect_invalid;

TEST(HostBuffer, RejectsBadInput) {
  auto groups = create_host_groups(1, {.timeout_ms = 1'000});
  auto buffer = Buffer::create(groups[0]);
  std::mt19937 rng(7);
  Case c;
  c.num_experts = 8;
  c.num_topk = 2;
  auto in = make_inputs(rng, c, 4);
  auto& d = in[0];
  ASSERT_GT(d.num_tokens, 0);

  d.topk[0] = 8;  // == num_experts
  expect_invalid([&] { buffer->dispatch(dispatch_args(d, c)); }, "topk_idx[0][0] = 8");
  d.topk[0] = -2;
  expect_invalid([&] { buffer->dispatch(dispatch_args(d, c)); }, "topk_idx[0][0] = -2");
  d.topk[0] = 1;
  expect_invalid(
      [&] {
        auto a = dispatch_args(d, c);
        a.num_experts = 0;
        buffer->dispatch(a);
      },
      "num_experts");
  expect_invalid(
      [&] {
        auto a = dispatch_args(d, c);
        a.topk_idx.shape[0] += 1;
        buffer->dispatch(a);
      },
      "topk_idx");
  expect_invalid(
      [&] {
        auto a = dispatch_args(d, c);
        a.topk_weights = TensorView::of(d.weights.data(), DType::kFloat32, {d.num_tokens, 1});
        buffer->dispatch(a);
      },
      "topk_weights");
  expect_invalid(
      [&] {
        auto a = dispatch_args(d, c);
        a.expert_alignment = 0;
        buffer->dispatch(a);
      },
      "expert_alignment");
  expect_invalid(
      [&] {
        auto a = dispatch_args(d, c);
        a.num_worst_tokens = -1;
        buffer->dispatch(a);
      },
      "num_worst_tokens");
  // fp8 with a hidden size that is not a multiple of 128.
  std::vector<uint8_t> x8(d.num_tokens * 100);
  std::vector<float> s8(d.num_tokens);
  expect_invalid(
      [&] {
        auto a = dispatch_args(d, c);
        a.x = TensorView::of(x8.data(), DType::kFloat8E4M3, {d.num_tokens, 100});
        a.x_scales = TensorView::of(s8.data(), DType::kFloat32, {d.num_tokens, 1});
        buffer->dispatch(a);
      },
      "multiple of 128");
  expect_invalid(
      [&] {
        auto a = dispatch_args(d, c);
        a.x = TensorView::of(x8.data(), DType::kFloat8E4M3, {d.num_tokens, 128});
        buffer->dispatch(a);
      },
      "x_scales");
  // Data on a GPU is refused by the host backend.
  expect_invalid(
      [&] {
        auto a = dispatch_args(d, c);
        a.x.device = Device::cuda(0);
        buffer->dispatch(a);
      },
      "x must be on cpu");
  // Cached mode with topk given, or the wrong T.
  const auto ok = buffer->dispatch(dispatch_args(d, c));
  expect_invalid(
      [&] {
        auto a = dispatch_args(d, c);
        a.handle = ok.handle;
        buffer->dispatch(a);
      },
      "cached mode");
  expect_invalid(
      [&] {
        DispatchArgs a;
        a.x = TensorView::of(d.x.data(), DType::kBFloat16, {d.num_tokens - 1, c.hidden});
        a.handle = ok.handle;
        buffer->dispatch(a);
      },
      "cached handle");
  // Combine shape mismatches.
  expect_invalid(
      [&] {
        CombineArgs a;
        a.x = TensorView::of(ok.recv_x.data(), DType::kBFloat16, {ok.recv_x.size(0) + 1, c.hidden});
        a.handle = ok.handle;
        buffer->combine(a);
      },
      "x dim 0");
  expect_invalid(
      [&] {
        CombineArgs a;
        a.x = ok.recv_x;
        a.bias_0 = TensorView::of(d.x.data(), DType::kBFloat16, {d.num_tokens, c.hidden / 2});
        a.handle = ok.handle;
        buffer->combine(a);
      },
      "bias_0");
  expect_invalid(
      [&] {
        CombineArgs a;
        a.x = ok.recv_x;
        buffer->combine(a);
      },
      "handle");
  expect_invalid([&] { buffer->get_dispatch_layout(dispatch_args(d, c).topk_idx, 0); }, "num_experts");

  // Experts not divisible by ranks: every rank throws before waiting for the others.
  auto groups2 = create_host_groups(2, {.timeout_ms = 1'000});
  auto buffers2 = make_buffers(groups2);
  testing::on_ranks(2, [&](int r) {
    auto a = dispatch_args(d, c);
    a.num_experts = 9;
    expect_invalid([&] { buffers2[r]->dispatch(a); }, "divisible by num_ranks");
  });
}

// rank_prefix_matrix[i][j] = tokens ranks 0..i send to rank j, counted here from the routing; the same
// tensor on every rank, shared by the handle and by cached dispatches; worst-token mode fills it too.
TEST(HostBuffer, RankPrefixMatrixMatchesRouting) {
  const unsigned seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  for (int num_ranks : {1, 2, 3, 8}) {
    auto groups = create_host_groups(num_ranks, {.timeout_ms = 20'000});
    auto buffers = make_buffers(groups);
    Case c;
    c.num_ranks = num_ranks;
    c.num_experts = 8 * num_ranks;
    c.num_topk = 3;
    SCOPED_TRACE(describe(c));
    const auto in = make_inputs(rng, c, 50);
    std::vector<int32_t> expected(num_ranks * num_ranks, 0);
    for (int i = 0; i < num_ranks; ++i) {
      for (int j = 0; j < num_ranks; ++j) {
        int32_t sent = 0;
        for (const auto& [s, t] : expected_rows(in, c, j)) sent += s == i ? 1 : 0;
        expected[i * num_ranks + j] = (i > 0 ? expected[(i - 1) * num_ranks + j] : 0) + sent;
      }
    }
    for (const int64_t worst : {int64_t{0}, int64_t{500}}) {
      const auto res = run_dispatch(buffers, [&](int r) {
        auto a = dispatch_args(in[r], c);
        a.num_worst_tokens = worst;
        return a;
      });
      const auto cached = run_dispatch(buffers, [&](int r) {
        DispatchArgs a;
        a.x = TensorView::of(const_cast<uint16_t*>(in[r].x.data()), DType::kBFloat16, {in[r].num_tokens, c.hidden});
        a.handle = res[r].handle;
        return a;
      });
      for (int r = 0; r < num_ranks; ++r) {
        const Tensor& m = res[r].rank_prefix_matrix;
        ASSERT_EQ(m.dtype(), DType::kInt32);
        ASSERT_EQ(m.sizes(), (std::vector<int64_t>{num_ranks, num_ranks}));
        EXPECT_EQ(std::vector<int32_t>(m.data_as<int32_t>(), m.data_as<int32_t>() + m.numel()), expected)
            << "rank " << r << " worst " << worst;
        EXPECT_EQ(res[r].handle->rank_prefix_matrix().data(), m.data());
        EXPECT_EQ(cached[r].rank_prefix_matrix.data(), m.data());
        EXPECT_EQ(cached[r].handle->rank_prefix_matrix().data(), m.data());
        // Column r: where each source's rows start in recv_x (rows by source rank).
        const auto rows = expected_rows(in, c, r);
        for (size_t i = 0; i < rows.size(); ++i) {
          const int s = rows[i].first;
          const int64_t begin = s > 0 ? m.data_as<int32_t>()[(s - 1) * num_ranks + r] : 0;
          ASSERT_GE(static_cast<int64_t>(i), begin);
          ASSERT_LT(static_cast<int64_t>(i), m.data_as<int32_t>()[s * num_ranks + r]);
        }
      }
    }
  }
}

TEST(HostBuffer, PerCallNumSmsIsBounded) {
  auto groups = create_host_groups(2, {.timeout_ms = 20'000});
  std::vector<std::unique_ptr<Buffer>> buffers;
  BufferOptions options;
  options.num_sms = 20;
  for (const auto& g : groups) buffers.push_back(Buffer::create(g, options));
  std::mt19937 rng(fresh_seed());
  Case c;
  c.num_ranks = 2;
  c.num_experts = 8;
  c.num_topk = 2;
  const auto in = make_inputs(rng, c, 20);
  // Accepted: 0 (the buffer's), 1, the buffer's value; ranks may differ.
  for (const int num_sms : {0, 1, 20}) {
    const auto res = run_dispatch(buffers, [&](int r) {
      auto a = dispatch_args(in[r], c);
      a.num_sms = r == 0 ? num_sms : 7;
      return a;
    });
    for (int r = 0; r < 2; ++r) check_dispatch(in, c, r, res[r], 0);
    testing::on_ranks(2, [&](int r) {
      CombineArgs a;
      a.x = res[r].recv_x;
      a.handle = res[r].handle;
      a.num_sms = num_sms;
      buffers[r]->combine(a);
    });
  }
  // Rejected before any rank waits: below 0 or above the buffer's num_sms, naming the bound.
  for (const int num_sms : {-1, 21}) {
    testing::on_ranks(2, [&](int r) {
      auto a = dispatch_args(in[r], c);
      a.num_sms = num_sms;
      expect_invalid([&] { buffers[r]->dispatch(a); }, "num_sms must be in [0, 20]");
    });
  }
  const auto ok = run_dispatch(buffers, [&](int r) { return dispatch_args(in[r], c); });
  testing::on_ranks(2, [&](int r) {
    CombineArgs a;
    a.x = ok[r].recv_x;
    a.handle = ok[r].handle;
    a.num_sms = 21;
    expect_invalid([&] { buffers[r]->combine(a); }, "num_sms must be in [0, 20]");
  });
}

// Packed UE8M0: byte j (little-endian) of int32 i = exponent of block 4 * i + j; padding bytes as given.
std::vector<int32_t> pack_ue8m0(const std::vector<uint8_t>& exponents, int64_t num_tokens, int64_t num_blocks,
                                uint8_t padding) {
  const int64_t num_packed = (num_blocks + 3) / 4;
  std::vector<int32_t> out(num_tokens * num_packed);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t i = 0; i < num_packed; ++i) {
      uint32_t v = 0;
      for (int j = 0; j < 4; ++j) {
        const int64_t b = 4 * i + j;
        v |= static_cast<uint32_t>(b < num_blocks ? exponents[t * num_blocks + b] : padding) << (8 * j);
      }
      out[t * num_packed + i] = static_cast<int32_t>(v);
    }
  }
  return out;
}

// Column-major (any strides) scales of fp32, uint8 and packed int32 UE8M0 arrive as the contiguous input
// would: recv_x_scales is contiguous [N, S] in the input's dtype, with the source row's values; the packed
// format unpacks to the quantizer's exponents and dequantizes within the round-trip bound.
TEST(HostBuffer, StridedAndPackedScales) {
  const unsigned seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const int num_ranks = 3;
  auto groups = create_host_groups(num_ranks, {.timeout_ms = 20'000});
  auto buffers = make_buffers(groups);
  Case c;
  c.num_ranks = num_ranks;
  c.num_experts = 12;
  c.hidden = 640;  // 5 blocks: the packed format has three padding bytes per token
  c.num_topk = 3;
  auto in = make_inputs(rng, c, 40);
  const int64_t num_blocks = c.hidden / kFp8BlockSize;
  std::vector<std::vector<uint8_t>> x8(num_ranks), e8(num_ranks);
  std::vector<std::vector<float>> f32(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    const int64_t T = in[r].num_tokens;
    in[r].x = testing::random_bf16(rng, T * c.hidden, 100.f);
    x8[r].resize(T * c.hidden);
    e8[r].resize(T * num_blocks);
    f32[r].resize(T * num_blocks);
    const auto xv = TensorView::of(in[r].x.data(), DType::kBFloat16, {T, c.hidden});
    quantize_fp8_host(xv, TensorView::of(x8[r].data(), DType::kFloat8E4M3, {T, c.hidden}),
                      TensorView::of(e8[r].data(), DType::kUInt8, {T, num_blocks}), ScaleFormat::kUE8M0);
    std::vector<uint8_t> unused(T * c.hidden);
    quantize_fp8_host(xv, TensorView::of(unused.data(), DType::kFloat8E4M3, {T, c.hidden}),
                      TensorView::of(f32[r].data(), DType::kFloat32, {T, num_blocks}), ScaleFormat::kFloat32);
  }
  for (const DType dtype : {DType::kFloat32, DType::kUInt8, DType::kInt32}) {
    SCOPED_TRACE(to_string(dtype));
    const int64_t S = dtype == DType::kInt32 ? (num_blocks + 3) / 4 : num_blocks;
    const size_t size = dtype_size(dtype);
    // Row-major values per rank, and the same values stored column-major ([S, T] storage).
    std::vector<std::vector<uint8_t>> rows(num_ranks), cols(num_ranks);
    for (int r = 0; r < num_ranks; ++r) {
      const int64_t T = in[r].num_tokens;
      rows[r].resize(T * S * size);
      if (T == 0) continue;  // a rank with no tokens: empty vectors, and memcpy may not take null
      if (dtype == DType::kFloat32) std::memcpy(rows[r].data(), f32[r].data(), rows[r].size());
      if (dtype == DType::kUInt8) std::memcpy(rows[r].data(), e8[r].data(), rows[r].size());
      if (dtype == DType::kInt32) {
        const auto packed = pack_ue8m0(e8[r], T, num_blocks, 0xa5);
        std::memcpy(rows[r].data(), packed.data(), rows[r].size());
      }
      cols[r].resize(rows[r].size());
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t j = 0; j < S; ++j) std::memcpy(&cols[r][(j * T + t) * size], &rows[r][(t * S + j) * size], size);
      }
    }
    auto run = [&](bool column_major) {
      return run_dispatch(buffers, [&](int r) {
        const int64_t T = in[r].num_tokens;
        auto a = dispatch_args(in[r], c);
        a.x = TensorView::of(x8[r].data(), DType::kFloat8E4M3, {T, c.hidden});
        if (column_major) {
          a.x_scales = TensorView::of(cols[r].data(), dtype, {T, S});
          a.x_scales.strides[0] = 1;
          a.x_scales.strides[1] = T;
        } else {
          a.x_scales = TensorView::of(rows[r].data(), dtype, {T, S});
        }
        return a;
      });
    };
    const auto contiguous = run(false);
    const auto strided = run(true);
    for (int r = 0; r < num_ranks; ++r) {
      const auto expected = expected_rows(in, c, r);
      const int64_t n = static_cast<int64_t>(expected.size());
      for (const auto* res : {&contiguous[r], &strided[r]}) {
        ASSERT_EQ(res->recv_x_scales.dtype(), dtype);
        ASSERT_EQ(res->recv_x_scales.sizes(), (std::vector<int64_t>{n, S}));
        for (int64_t i = 0; i < n; ++i) {
          const auto [s, t] = expected[i];
          ASSERT_EQ(std::memcmp(res->recv_x_scales.data_as<uint8_t>() + i * S * size, rows[s].data() + t * S * size,
                                S * size),
                    0)
              << "row " << i;
          ASSERT_EQ(std::memcmp(res->recv_x.data_as<uint8_t>() + i * c.hidden, x8[s].data() + t * c.hidden, c.hidden),
                    0);
        }
      }
      if (dtype != DType::kInt32) continue;
      // Unpack the received int32 scales and dequantize: the round trip holds against the bf16 source.
      std::vector<uint8_t> exponents(n * num_blocks);
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t b = 0; b < num_blocks; ++b) {
          const auto v = static_cast<uint32_t>(strided[r].recv_x_scales.data_as<int32_t>()[i * S + b / 4]);
          exponents[i * num_blocks + b] = static_cast<uint8_t>(v >> (8 * (b % 4)));
        }
        EXPECT_EQ(static_cast<uint32_t>(strided[r].recv_x_scales.data_as<int32_t>()[i * S + S - 1]) >> 8, 0xa5a5a5u)
            << "padding byte of row " << i;
      }
      std::vector<float> back(n * c.hidden);
      dequantize_fp8_host(strided[r].recv_x, TensorView::of(exponents.data(), DType::kUInt8, {n, num_blocks}),
                          TensorView::of(back.data(), DType::kFloat32, {n, c.hidden}));
      for (int64_t i = 0; i < n; ++i) {
        const auto [s, t] = expected[i];
        for (int64_t b = 0; b < num_blocks; ++b) {
          float amax = 0.f;
          for (int j = 0; j < kFp8BlockSize; ++j) {
            amax = std::max(amax, std::fabs(bf16_to_float(in[s].x[t * c.hidden + b * kFp8BlockSize + j])));
          }
          for (int j = 0; j < kFp8BlockSize; ++j) {
            const int64_t h = b * kFp8BlockSize + j;
            ASSERT_LE(std::fabs(back[i * c.hidden + h] - bf16_to_float(in[s].x[t * c.hidden + h])),
                      kFp8RoundTripRelError * amax)
                << "row " << i << " h " << h;
          }
        }
      }
    }
  }
  // Packed scales of the wrong width, and int32 scales with bf16 x, are refused.
  auto groups1 = create_host_groups(1, {.timeout_ms = 1'000});
  auto buffer = Buffer::create(groups1[0]);
  std::vector<int32_t> packed(4 * 8);
  std::vector<uint8_t> x(4 * c.hidden);
  DispatchArgs a;
  a.x = TensorView::of(x.data(), DType::kFloat8E4M3, {4, c.hidden});
  a.x_scales = TensorView::of(packed.data(), DType::kInt32, {4, 5});
  std::vector<int64_t> topk(4, 0);
  a.topk_idx = TensorView::of(topk.data(), DType::kInt64, {4, 1});
  a.num_experts = 2;
  expect_invalid([&] { buffer->dispatch(a); }, "x_scales must be [4, 2]");
  a.x_scales = TensorView::of(packed.data(), DType::kInt64, {4, 2});
  expect_invalid([&] { buffer->dispatch(a); }, "x_scales must be fp32, uint8 (UE8M0) or int32");
}

TEST(HostBuffer, NormalModeTimesOut) {
  auto groups = create_host_groups(2, {.timeout_ms = 100});
  auto buffer = Buffer::create(groups[0]);
  std::vector<uint16_t> x(128, 0);
  std::vector<int64_t> topk = {0};
  DispatchArgs a;
  a.x = TensorView::of(x.data(), DType::kBFloat16, {1, 128});
  a.topk_idx = TensorView::of(topk.data(), DType::kInt64, {1, 1});
  a.num_experts = 2;
  try {
    buffer->dispatch(a);  // rank 1 never calls
    FAIL() << "expected a timeout";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
    EXPECT_NE(std::string(e.what()).find("[1]"), std::string::npos) << e.what();
  }
}

TEST(HostBuffer, LayoutMatchesRouting) {
  auto groups = create_host_groups(4);
  auto buffer = Buffer::create(groups[1]);
  std::mt19937 rng(fresh_seed());
  auto topk = testing::random_topk(rng, 33, 6, 64, 0.1);
  const auto view = TensorView::of(topk.data(), DType::kInt64, {33, 6});
  const Layout layout = buffer->get_dispatch_layout(view, 64);
  const HostLayout expected = compute_layout_host(view, 64, 4);
  EXPECT_EQ(std::memcmp(layout.num_tokens_per_rank.data(), expected.num_tokens_per_rank.data(), 16), 0);
  EXPECT_EQ(std::memcmp(layout.num_tokens_per_expert.data(), expected.num_tokens_per_expert.data(), 64 * 4), 0);
  EXPECT_EQ(std::memcmp(layout.is_token_in_rank.data(), expected.is_token_in_rank.data(), 33 * 4), 0);
}

TEST(HostBuffer, DispatchWithPrecomputedLayout) {
  const unsigned seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  Case c;
  c.num_ranks = 3;
  c.num_experts = 24;
  c.num_topk = 4;
  auto groups = create_host_groups(c.num_ranks, {.timeout_ms = 20'000});
  auto buffers = make_buffers(groups);
  const auto in = make_inputs(rng, c, 60);
  std::vector<Layout> layouts(c.num_ranks);
  for (int r = 0; r < c.num_ranks; ++r)
    layouts[r] = buffers[r]->get_dispatch_layout(topk_view(in[r], c), c.num_experts);
  const auto res = run_dispatch(buffers, [&](int r) {
    auto a = dispatch_args(in[r], c);
    a.layout = &layouts[r];
    return a;
  });
  for (int r = 0; r < c.num_ranks; ++r) check_dispatch(in, c, r, res[r], 0);
  // A layout that does not belong to topk_idx is refused on every rank before they meet.
  for (auto& l : layouts) l.num_tokens_per_expert.data_as<int32_t>()[0] += 1;
  testing::on_ranks(c.num_ranks, [&](int r) {
    auto a = dispatch_args(in[r], c);
    a.layout = &layouts[r];
    expect_invalid([&] { buffers[r]->dispatch(a); }, "layout does not match");
  });
}

}  // namespace
}  // namespace epx
