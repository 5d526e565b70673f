// Host backend, multi-node: the group topology and the hierarchical normal routing (docs/internode.md).
//
// Routing: one global routing per case, run twice on fresh buffers: flat (one node, the single-node path) and
// hierarchical (the same ranks grouped into nodes of gpus_per_node; forced on one node). Every rank draws 0-12
// tokens (one rank idle, T = 0) with K distinct experts out of 4 per rank, ~15% of the slots -1. The dispatch
// outputs must be equal bit for bit (rows, scales, metadata, counts, rank prefix matrix). Combine: small-integer
// rows (exact fp32 sums) must give equal bits; random rows must give equal bits with one node or one rank per node
// and agree within fp32 reassociation otherwise (CombineResult). Nodes x GPUs per node from the issue (1/2/4/9 x
// 1/2/4/8), 72 ranks in one case only (the sanitizer build runs these tests too).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "ep/validate.h"
#include "epx/buffer.h"
#include "epx/error.h"
#include "epx/group.h"
#include "epx/quant.h"
#include "test_util.h"

namespace epx {
namespace {

struct Shape {
  int num_nodes = 1;
  int gpus_per_node = 1;
  int64_t hidden = 128;
  int num_topk = 4;
  bool fp8 = false;
  ScaleFormat scale_format = ScaleFormat::kFloat32;
  bool column_major_scales = false;
  bool int32_topk = false;
  bool with_weights = true;
  int expert_alignment = 1;
  int num_ranks() const { return num_nodes * gpus_per_node; }
  int64_t num_experts() const { return int64_t{4} * num_ranks(); }
};

std::string describe(const Shape& s) {
  return fmt::format("{} nodes x {} GPUs, hidden {}, top-{} of {}{}{}{}, alignment {}", s.num_nodes, s.gpus_per_node,
                     s.hidden, s.num_topk, s.num_experts(), s.fp8 ? ", fp8" : "", s.int32_topk ? ", int32" : "",
                     s.with_weights ? ", weights" : "", s.expert_alignment);
}

struct RankInput {
  int64_t num_tokens = 0;
  std::vector<uint16_t> x;       // [T, H] bf16
  std::vector<uint8_t> x8;       // [T, H] fp8
  std::vector<uint8_t> scales;   // [T, H / 128] (column-major when asked)
  std::vector<int64_t> topk;     // [T, K]
  std::vector<int32_t> topk32;   // [T, K]
  std::vector<float> weights;    // [T, K]
  std::vector<uint16_t> bias_0;  // [T, H]
};

std::vector<uint16_t> small_int_bf16(std::mt19937& rng, size_t n) {
  std::uniform_int_distribution<int> value(-8, 8);
  std::vector<uint16_t> out(n);
  for (auto& v : out) v = float_to_bf16(static_cast<float>(value(rng)));
  return out;
}

DType scale_dtype(const Shape& s) { return s.scale_format == ScaleFormat::kUE8M0 ? DType::kUInt8 : DType::kFloat32; }

std::vector<RankInput> make_inputs(std::mt19937& rng, const Shape& s) {
  const int R = s.num_ranks();
  std::vector<RankInput> in(R);
  std::uniform_int_distribution<int64_t> tokens(1, 12);
  std::uniform_real_distribution<float> weight(0.f, 1.f);
  const int idle = static_cast<int>(rng() % R);
  const int64_t num_blocks = s.hidden / kFp8BlockSize;
  for (int r = 0; r < R; ++r) {
    RankInput& d = in[r];
    d.num_tokens = (r == idle && R > 1) ? 0 : tokens(rng);
    d.x = small_int_bf16(rng, d.num_tokens * s.hidden);
    d.bias_0 = small_int_bf16(rng, d.num_tokens * s.hidden);
    d.topk = testing::random_topk(rng, d.num_tokens, s.num_topk, s.num_experts(), 0.15);
    d.topk32.assign(d.topk.begin(), d.topk.end());
    d.weights.resize(d.topk.size());
    for (auto& w : d.weights) w = weight(rng);
    if (s.fp8) {
      const auto values = testing::random_bf16(rng, d.num_tokens * s.hidden, 100.f);
      d.x8.resize(d.num_tokens * s.hidden);
      std::vector<uint8_t> row_major(d.num_tokens * num_blocks * dtype_size(scale_dtype(s)));
      quantize_fp8_host(
          TensorView::of(const_cast<uint16_t*>(values.data()), DType::kBFloat16, {d.num_tokens, s.hidden}),
          TensorView::of(d.x8.data(), DType::kFloat8E4M3, {d.num_tokens, s.hidden}),
          TensorView::of(row_major.data(), scale_dtype(s), {d.num_tokens, num_blocks}), s.scale_format);
      d.scales = row_major;
      if (s.column_major_scales) {
        const size_t size = dtype_size(scale_dtype(s));
        for (int64_t t = 0; t < d.num_tokens; ++t) {
          for (int64_t j = 0; j < num_blocks; ++j) {
            std::memcpy(&d.scales[(j * d.num_tokens + t) * size], &row_major[(t * num_blocks + j) * size], size);
          }
        }
      }
    }
  }
  return in;
}

DispatchArgs fresh_args(RankInput& d, const Shape& s) {
  DispatchArgs a;
  if (s.fp8) {
    const int64_t num_blocks = s.hidden / kFp8BlockSize;
    a.x = TensorView::of(d.x8.data(), DType::kFloat8E4M3, {d.num_tokens, s.hidden});
    a.x_scales = TensorView::of(d.scales.data(), scale_dtype(s), {d.num_tokens, num_blocks});
    if (s.column_major_scales) {
      a.x_scales.strides[0] = 1;
      a.x_scales.strides[1] = d.num_tokens;
    }
  } else {
    a.x = TensorView::of(d.x.data(), DType::kBFloat16, {d.num_tokens, s.hidden});
  }
  a.topk_idx = s.int32_topk ? TensorView::of(d.topk32.data(), DType::kInt32, {d.num_tokens, s.num_topk})
                            : TensorView::of(d.topk.data(), DType::kInt64, {d.num_tokens, s.num_topk});
  if (s.with_weights) a.topk_weights = TensorView::of(d.weights.data(), DType::kFloat32, {d.num_tokens, s.num_topk});
  a.num_experts = s.num_experts();
  a.expert_alignment = s.expert_alignment;
  return a;
}

// The same ranks, flat on one node or hierarchical on s.num_nodes nodes (forced when that is one node).
std::vector<std::unique_ptr<Buffer>> make_buffers(const Shape& s, bool hierarchical,
                                                  NodePartials partials = NodePartials::kFloat32) {
  HostGroupOptions group_options;
  group_options.timeout_ms = 60'000;
  group_options.gpus_per_node = hierarchical ? s.gpus_per_node : 0;
  BufferOptions options;
  options.normal_routing = hierarchical ? NormalRouting::kHierarchical : NormalRouting::kFlat;
  if (hierarchical && s.num_nodes > 1 && s.gpus_per_node % 2 == 0) options.normal_routing = NormalRouting::kAuto;
  options.node_partials = partials;
  std::vector<std::unique_ptr<Buffer>> buffers;
  for (const auto& g : create_host_groups(s.num_ranks(), group_options)) buffers.push_back(Buffer::create(g, options));
  return buffers;
}

std::vector<DispatchResult> run_dispatch(std::vector<std::unique_ptr<Buffer>>& buffers,
                                         const std::function<DispatchArgs(int)>& make_args) {
  std::vector<DispatchResult> results(buffers.size());
  testing::on_ranks(static_cast<int>(buffers.size()), [&](int r) { results[r] = buffers[r]->dispatch(make_args(r)); });
  return results;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  return a.dtype() == b.dtype() && a.sizes() == b.sizes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

void expect_same_dispatch(const std::vector<DispatchResult>& flat, const std::vector<DispatchResult>& hier) {
  for (size_t r = 0; r < flat.size(); ++r) {
    SCOPED_TRACE(fmt::format("receiving rank {}", r));
    EXPECT_TRUE(same_bytes(flat[r].recv_x, hier[r].recv_x));
    EXPECT_TRUE(same_bytes(flat[r].recv_x_scales, hier[r].recv_x_scales));
    EXPECT_TRUE(same_bytes(flat[r].recv_topk_idx, hier[r].recv_topk_idx));
    EXPECT_TRUE(same_bytes(flat[r].recv_topk_weights, hier[r].recv_topk_weights));
    EXPECT_TRUE(same_bytes(flat[r].recv_src_idx, hier[r].recv_src_idx));
    EXPECT_TRUE(same_bytes(flat[r].recv_expert_counts, hier[r].recv_expert_counts));
    EXPECT_TRUE(same_bytes(flat[r].rank_prefix_matrix, hier[r].rank_prefix_matrix));
    EXPECT_EQ(flat[r].num_recv_tokens_per_expert, hier[r].num_recv_tokens_per_expert);
    EXPECT_EQ(flat[r].handle->num_recv_tokens(), hier[r].handle->num_recv_tokens());
    EXPECT_EQ(flat[r].handle->num_tokens(), hier[r].handle->num_tokens());
  }
}

// Expert outputs for combine: one row per received row (small integers, or random values) and the weights.
struct CombineInput {
  std::vector<uint16_t> x;     // [N, H]
  std::vector<float> weights;  // [N, K]
};

std::vector<CombineResult> run_combine(std::vector<std::unique_ptr<Buffer>>& buffers, std::vector<RankInput>& in,
                                       const Shape& s, const std::vector<DispatchResult>& dispatched,
                                       std::vector<CombineInput>& expert_out, bool with_weights) {
  std::vector<CombineResult> results(buffers.size());
  testing::on_ranks(static_cast<int>(buffers.size()), [&](int r) {
    const int64_t num_rows = dispatched[r].recv_x.size(0);
    CombineArgs a;
    a.x = TensorView::of(expert_out[r].x.data(), DType::kBFloat16, {num_rows, s.hidden});
    if (with_weights)
      a.topk_weights = TensorView::of(expert_out[r].weights.data(), DType::kFloat32, {num_rows, s.num_topk});
    a.bias_0 = TensorView::of(in[r].bias_0.data(), DType::kBFloat16, {in[r].num_tokens, s.hidden});
    a.handle = dispatched[r].handle;
    results[r] = buffers[r]->combine(a);
  });
  return results;
}

// Compares combine outputs: equal bits, or (tolerance) within the fp32 reassociation bound of the sum before the
// one bf16 rounding: |a - b| <= 2^-8 |reference| + sum |terms| * 2^-20 (K+2 terms of at most 1 + 8 adds).
void expect_same_combine(const std::vector<CombineResult>& flat, const std::vector<CombineResult>& hier, bool exact) {
  for (size_t r = 0; r < flat.size(); ++r) {
    SCOPED_TRACE(fmt::format("token rank {}", r));
    ASSERT_EQ(flat[r].x.sizes(), hier[r].x.sizes());
    EXPECT_TRUE(same_bytes(flat[r].topk_weights, hier[r].topk_weights));  // one non-zero term each: exact
    const auto* a = flat[r].x.data_as<uint16_t>();
    const auto* b = hier[r].x.data_as<uint16_t>();
    const int64_t n = flat[r].x.numel();
    if (exact) {
      ASSERT_EQ(std::memcmp(a, b, n * 2), 0);
      continue;
    }
    for (int64_t i = 0; i < n; ++i) {
      const float fa = bf16_to_float(a[i]), fb = bf16_to_float(b[i]);
      ASSERT_LE(std::fabs(fa - fb), std::fabs(fa) * 0x1p-7f + 0x1p-12f)
          << "element " << i << ": " << fa << " vs " << fb;
    }
  }
}

// Fresh dispatch on both routings, then combine of small-integer rows and of random rows (bf16 only).
void check_case(std::mt19937& rng, const Shape& s) {
  SCOPED_TRACE(describe(s));
  auto in = make_inputs(rng, s);
  auto flat_buffers = make_buffers(s, false);
  auto hier_buffers = make_buffers(s, true);
  const auto flat = run_dispatch(flat_buffers, [&](int r) { return fresh_args(in[r], s); });
  const auto hier = run_dispatch(hier_buffers, [&](int r) { return fresh_args(in[r], s); });
  expect_same_dispatch(flat, hier);
  if (s.fp8) return;  // combine is bf16 only; fp8 dispatch handles combine like bf16 ones (checked below)
  const int R = s.num_ranks();
  for (const bool integers : {true, false}) {
    std::vector<CombineInput> expert_out(R);
    for (int r = 0; r < R; ++r) {
      const int64_t rows = flat[r].recv_x.size(0);
      expert_out[r].x = integers ? small_int_bf16(rng, rows * s.hidden) : testing::random_bf16(rng, rows * s.hidden);
      if (s.with_weights) {
        const float* w = flat[r].recv_topk_weights.data_as<float>();
        expert_out[r].weights.assign(w, w + rows * s.num_topk);
      }
    }
    const auto flat_out = run_combine(flat_buffers, in, s, flat, expert_out, s.with_weights);
    const auto hier_out = run_combine(hier_buffers, in, s, hier, expert_out, s.with_weights);
    const bool same_order = s.num_nodes == 1 || s.gpus_per_node == 1;
    expect_same_combine(flat_out, hier_out, integers || same_order);
  }
}

// Source rank s's combine output under NodePartials::kBFloat16, from the flat dispatch's routing (rank prefix matrix
// and source indices): per node n ascending p_n = 0 + the rows of n's ranks ascending (fp32), rounded to bf16; then
// acc = 0 + p_0 + p_1 + ..., bias_0, one rounding (CombineResult).
std::vector<uint16_t> bf16_partials_reference(const Shape& s, const std::vector<RankInput>& in,
                                              const std::vector<DispatchResult>& flat,
                                              const std::vector<CombineInput>& expert_out, int src) {
  const int R = s.num_ranks();
  const int64_t H = s.hidden, T = in[src].num_tokens;
  // row_of[r][t]: the row of (src, t) on rank r, -1 if t was not sent there.
  std::vector<std::vector<int64_t>> row_of(R, std::vector<int64_t>(T, -1));
  for (int r = 0; r < R; ++r) {
    const auto* prefix = flat[r].rank_prefix_matrix.data_as<int32_t>();  // [R, R]: rows from sources <= s on r
    const int64_t begin = src == 0 ? 0 : prefix[(src - 1) * R + r], end = prefix[src * R + r];
    for (int64_t i = begin; i < end; ++i) row_of[r][flat[r].recv_src_idx.data_as<int32_t>()[i]] = i;
  }
  std::vector<uint16_t> out(T * H);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      float acc = 0.f;
      for (int n = 0; n < s.num_nodes; ++n) {
        float partial = 0.f;
        bool any = false;
        for (int g = 0; g < s.gpus_per_node; ++g) {
          const int r = n * s.gpus_per_node + g;
          if (row_of[r][t] < 0) continue;
          any = true;
          partial += bf16_to_float(expert_out[r].x[row_of[r][t] * H + h]);
        }
        if (any) acc += bf16_to_float(float_to_bf16(partial));
      }
      acc += bf16_to_float(in[src].bias_0[t * H + h]);
      out[t * H + h] = float_to_bf16(acc);
    }
  }
  return out;
}

TEST(HostTopology, GroupsReportNodesAndLocalRanks) {
  for (const auto& [num_ranks, gpus_per_node] : std::vector<std::pair<int, int>>{{1, 0}, {8, 0}, {8, 2}, {72, 8}}) {
    const auto groups = create_host_groups(num_ranks, {.timeout_ms = 1000, .gpus_per_node = gpus_per_node});
    const int gpus = gpus_per_node == 0 ? num_ranks : gpus_per_node;
    for (int r = 0; r < num_ranks; ++r) {
      const Topology topology = groups[r]->topology();
      EXPECT_EQ(topology.num_nodes, num_ranks / gpus);
      EXPECT_EQ(topology.gpus_per_node, gpus);
      EXPECT_EQ(topology.num_ranks(), num_ranks);
      EXPECT_EQ(topology.node_of(r), r / gpus);
      EXPECT_EQ(topology.local_rank_of(r), r % gpus);
      EXPECT_EQ(topology.rank_of(topology.node_of(r), topology.local_rank_of(r)), r);
    }
  }
}

TEST(HostTopology, RejectsBadGpusPerNode) {
  const auto expect_invalid = [](int num_ranks, int gpus_per_node, const std::vector<std::string>& words) {
    try {
      create_host_groups(num_ranks, {.timeout_ms = 1000, .gpus_per_node = gpus_per_node});
      ADD_FAILURE() << num_ranks << " ranks, gpus_per_node " << gpus_per_node << ": no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      for (const auto& word : words) EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
    }
  };
  expect_invalid(12, 5, {"gpus_per_node = 5", "divide", "num_ranks = 12"});
  expect_invalid(12, -1, {"gpus_per_node", "[0, num_ranks = 12]", "-1"});
  expect_invalid(12, 13, {"gpus_per_node", "[0, num_ranks = 12]", "13"});
  expect_invalid(0, 0, {"num_ranks"});
}

// Buffer::create on host groups with one option set by `set`: kInvalidArgument whose message holds `text`.
void expect_option_rejected(const std::function<void(BufferOptions&)>& set, const std::string& text) {
  const auto groups = create_host_groups(2, {.timeout_ms = 1000, .gpus_per_node = 1});
  BufferOptions options;
  set(options);
  testing::expect_invalid([&] { Buffer::create(groups[0], options); }, text);
}

TEST(HostTopology, BufferRejectsUnknownRouting) {
  expect_option_rejected([](BufferOptions& o) { o.normal_routing = static_cast<NormalRouting>(7); }, "normal_routing");
}

// NormalRouting::kAuto: hierarchical across nodes, and on one node above the backend's flat cap (the cuda backend's 8:
// a one-node buffer of 9-64 cuda ranks then takes the hierarchical routing on one node instead of being refused).
TEST(HostTopology, AutoNormalRoutingFollowsNodesAndTheFlatCap) {
  BufferOptions o;
  const auto hierarchical = [&](NormalRouting routing, int nodes, int gpus, int cap) {
    o.normal_routing = routing;
    return ep::normal_hierarchical(o, Topology{nodes, gpus}, cap);
  };
  EXPECT_FALSE(hierarchical(NormalRouting::kAuto, 1, 8, 8));
  EXPECT_TRUE(hierarchical(NormalRouting::kAuto, 1, 9, 8));
  EXPECT_TRUE(hierarchical(NormalRouting::kAuto, 1, 16, 8));
  EXPECT_TRUE(hierarchical(NormalRouting::kAuto, 2, 1, 8));
  EXPECT_FALSE(hierarchical(NormalRouting::kAuto, 1, 72, 1 << 30));  // the host backend has no flat cap
  EXPECT_FALSE(hierarchical(NormalRouting::kFlat, 1, 16, 8));        // kFlat stays flat (and the cuda buffer refuses)
  EXPECT_FALSE(hierarchical(NormalRouting::kFlat, 2, 4, 8));
  EXPECT_TRUE(hierarchical(NormalRouting::kHierarchical, 1, 2, 8));
}

TEST(HostTopology, BufferRejectsUnknownNodePartials) {
  expect_option_rejected([](BufferOptions& o) { o.node_partials = static_cast<NodePartials>(2); },
                         "node_partials must be kFloat32 or kBFloat16, got 2");
}

TEST(HostTopology, LayoutCountsTokensPerNode) {
  testing::SeededRng rng;
  Shape s{.num_nodes = 4, .gpus_per_node = 2};
  auto in = make_inputs(rng, s);
  auto buffers = make_buffers(s, true);
  for (int r = 0; r < s.num_ranks(); ++r) {
    const auto args = fresh_args(in[r], s);
    const Layout layout = buffers[r]->get_dispatch_layout(args.topk_idx, s.num_experts());
    ASSERT_EQ(layout.num_tokens_per_node.sizes(), (std::vector<int64_t>{s.num_nodes}));
    for (int n = 0; n < s.num_nodes; ++n) {
      int32_t expected = 0;
      for (int64_t t = 0; t < in[r].num_tokens; ++t) {
        bool hit = false;
        for (int k = 0; k < s.num_topk; ++k) {
          const int64_t e = in[r].topk[t * s.num_topk + k];
          hit = hit || (e >= 0 && e / (4 * s.gpus_per_node) == n);
        }
        expected += hit;
      }
      EXPECT_EQ(layout.num_tokens_per_node.data_as<int32_t>()[n], expected) << "rank " << r << " node " << n;
    }
  }
  // A layout with wrong per-node counts is refused on that rank (its peers raise kPeerFailure), and the group
  // stays usable.
  std::vector<Layout> layouts(s.num_ranks());
  for (int r = 0; r < s.num_ranks(); ++r) {
    layouts[r] = buffers[r]->get_dispatch_layout(fresh_args(in[r], s).topk_idx, s.num_experts());
  }
  layouts[1].num_tokens_per_node.data_as<int32_t>()[0] += 1;
  std::vector<int> codes(s.num_ranks(), -1);
  testing::on_ranks(s.num_ranks(), [&](int r) {
    auto a = fresh_args(in[r], s);
    a.layout = &layouts[r];
    try {
      buffers[r]->dispatch(a);
      codes[r] = 0;
    } catch (const Error& e) {
      codes[r] = static_cast<int>(e.code());
    }
  });
  for (int r = 0; r < s.num_ranks(); ++r) {
    EXPECT_EQ(codes[r], static_cast<int>(r == 1 ? ErrorCode::kInvalidArgument : ErrorCode::kPeerFailure)) << r;
  }
  layouts[1].num_tokens_per_node.data_as<int32_t>()[0] -= 1;
  const auto ok = run_dispatch(buffers, [&](int r) {
    auto a = fresh_args(in[r], s);
    a.layout = &layouts[r];
    return a;
  });
  EXPECT_EQ(ok.size(), static_cast<size_t>(s.num_ranks()));
}

TEST(HostHierarchical, MatchesFlatAcrossTopologies) {
  testing::SeededRng rng;
  const std::vector<std::pair<int, int>> topologies = {{1, 4}, {2, 1}, {2, 2}, {2, 4}, {4, 1}, {4, 2},
                                                       {2, 8}, {4, 4}, {9, 1}, {9, 2}, {4, 8}, {9, 8}};
  for (const auto& [num_nodes, gpus_per_node] : topologies) {
    Shape s{.num_nodes = num_nodes, .gpus_per_node = gpus_per_node};
    s.hidden = rng() % 2 == 0 ? 128 : 256;
    s.num_topk = 1 + static_cast<int>(rng() % 8);
    s.int32_topk = rng() % 2 == 0;
    s.with_weights = rng() % 4 != 0;
    s.expert_alignment = std::vector<int>{1, 4, 128}[rng() % 3];
    check_case(rng, s);
  }
}

// NodePartials::kBFloat16: random rows give the reference above bit for bit (the default fp32 partials would not:
// the reference rounds each node's sum), small-integer rows (exact partials) the flat result; weights come back
// exactly.
TEST(HostHierarchical, Bf16NodePartialsRoundEachNodesSum) {
  testing::SeededRng rng;
  for (const auto& [num_nodes, gpus_per_node] :
       std::vector<std::pair<int, int>>{{1, 4}, {2, 1}, {2, 2}, {2, 4}, {4, 2}, {9, 1}, {4, 8}}) {
    Shape s{.num_nodes = num_nodes, .gpus_per_node = gpus_per_node, .hidden = 128};
    s.num_topk = 1 + static_cast<int>(rng() % 8);
    SCOPED_TRACE(describe(s));
    const int R = s.num_ranks();
    auto in = make_inputs(rng, s);
    auto flat_buffers = make_buffers(s, false);
    auto hier_buffers = make_buffers(s, true, NodePartials::kBFloat16);
    const auto flat = run_dispatch(flat_buffers, [&](int r) { return fresh_args(in[r], s); });
    const auto hier = run_dispatch(hier_buffers, [&](int r) { return fresh_args(in[r], s); });
    expect_same_dispatch(flat, hier);
    for (const bool integers : {true, false}) {
      std::vector<CombineInput> expert_out(R);
      for (int r = 0; r < R; ++r) {
        const int64_t rows = flat[r].recv_x.size(0);
        expert_out[r].x = integers ? small_int_bf16(rng, rows * s.hidden) : testing::random_bf16(rng, rows * s.hidden);
        const float* w = flat[r].recv_topk_weights.data_as<float>();
        expert_out[r].weights.assign(w, w + rows * s.num_topk);
      }
      const auto flat_out = run_combine(flat_buffers, in, s, flat, expert_out, true);
      const auto hier_out = run_combine(hier_buffers, in, s, hier, expert_out, true);
      if (integers) {
        expect_same_combine(flat_out, hier_out, true);
        continue;
      }
      for (int r = 0; r < R; ++r) {
        SCOPED_TRACE(fmt::format("token rank {}", r));
        EXPECT_TRUE(same_bytes(flat_out[r].topk_weights, hier_out[r].topk_weights));
        const auto expected = bf16_partials_reference(s, in, flat, expert_out, r);
        ASSERT_EQ(hier_out[r].x.numel(), static_cast<int64_t>(expected.size()));
        for (size_t i = 0; i < expected.size(); ++i) {
          ASSERT_EQ(hier_out[r].x.data_as<uint16_t>()[i], expected[i]) << "element " << i;
        }
      }
    }
  }
}

TEST(HostHierarchical, Fp8MatchesFlat) {
  testing::SeededRng rng;
  for (const auto& [num_nodes, gpus_per_node] : std::vector<std::pair<int, int>>{{2, 2}, {4, 2}, {2, 4}}) {
    for (const ScaleFormat format : {ScaleFormat::kFloat32, ScaleFormat::kUE8M0}) {
      Shape s{.num_nodes = num_nodes, .gpus_per_node = gpus_per_node, .hidden = 256, .fp8 = true};
      s.scale_format = format;
      s.column_major_scales = rng() % 2 == 0;
      check_case(rng, s);
    }
  }
}

// Worst-token and cached dispatches on both routings, each compared with the flat one; then combine of the cached
// handle. One rank's num_worst_tokens too small fails that rank only, as on one node.
TEST(HostHierarchical, CachedAndWorstTokenMatchFlat) {
  testing::SeededRng rng;
  for (const auto& [num_nodes, gpus_per_node] : std::vector<std::pair<int, int>>{{2, 4}, {4, 2}, {9, 1}}) {
    Shape s{.num_nodes = num_nodes, .gpus_per_node = gpus_per_node, .hidden = 128, .num_topk = 6};
    s.expert_alignment = 4;
    SCOPED_TRACE(describe(s));
    const int R = s.num_ranks();
    auto in = make_inputs(rng, s);
    auto flat_buffers = make_buffers(s, false);
    auto hier_buffers = make_buffers(s, true);
    const auto flat = run_dispatch(flat_buffers, [&](int r) { return fresh_args(in[r], s); });
    int64_t max_recv = 0;
    for (int r = 0; r < R; ++r) max_recv = std::max(max_recv, flat[r].handle->num_recv_tokens());
    const int64_t worst = max_recv + 3;
    std::vector<DispatchResult> worst_results[2];
    for (int h = 0; h < 2; ++h) {
      auto& buffers = h == 0 ? flat_buffers : hier_buffers;
      worst_results[h] = run_dispatch(buffers, [&](int r) {
        auto a = fresh_args(in[r], s);
        a.num_worst_tokens = worst;
        return a;
      });
    }
    expect_same_dispatch(worst_results[0], worst_results[1]);
    for (int r = 0; r < R; ++r) EXPECT_EQ(worst_results[1][r].recv_src_idx.size(0), worst);

    // Cached, new data, with and without worst-token mode.
    auto in2 = in;
    for (auto& d : in2) d.x = testing::random_bf16(rng, d.num_tokens * s.hidden);
    for (const int64_t num_worst : {int64_t{0}, worst}) {
      std::vector<DispatchResult> cached[2];
      for (int h = 0; h < 2; ++h) {
        auto& buffers = h == 0 ? flat_buffers : hier_buffers;
        cached[h] = run_dispatch(buffers, [&](int r) {
          DispatchArgs a;
          a.x = TensorView::of(in2[r].x.data(), DType::kBFloat16, {in2[r].num_tokens, s.hidden});
          a.handle = worst_results[h][r].handle;
          a.num_worst_tokens = num_worst;
          return a;
        });
      }
      expect_same_dispatch(cached[0], cached[1]);
      std::vector<CombineInput> expert_out(R);
      for (int r = 0; r < R; ++r)
        expert_out[r].x =
            cached[0][r].recv_x.size(0) > 0
                ? std::vector<uint16_t>(cached[0][r].recv_x.data_as<uint16_t>(),
                                        cached[0][r].recv_x.data_as<uint16_t>() + cached[0][r].recv_x.numel())
                : std::vector<uint16_t>{};
      const auto flat_out = run_combine(flat_buffers, in2, s, cached[0], expert_out, false);
      const auto hier_out = run_combine(hier_buffers, in2, s, cached[1], expert_out, false);
      expect_same_combine(flat_out, hier_out, s.gpus_per_node == 1);
    }

    // Too small on the ranks that receive the most: kInvalidArgument there, the others succeed; the group goes on.
    std::vector<int> codes(R, 0);
    testing::on_ranks(R, [&](int r) {
      auto a = fresh_args(in[r], s);
      a.num_worst_tokens = max_recv - 1;
      try {
        hier_buffers[r]->dispatch(a);
      } catch (const Error& e) {
        codes[r] = static_cast<int>(e.code());
      }
    });
    for (int r = 0; r < R; ++r) {
      const bool overflows = flat[r].handle->num_recv_tokens() > max_recv - 1;
      EXPECT_EQ(codes[r], overflows ? static_cast<int>(ErrorCode::kInvalidArgument) : 0) << "rank " << r;
    }
    const auto again = run_dispatch(hier_buffers, [&](int r) { return fresh_args(in[r], s); });
    expect_same_dispatch(flat, again);
  }
}

// Errors in either leg keep the ranks in step: an invalid expert id on one rank (before the network leg) and
// arguments that differ between ranks (found in it) fail every rank at once, and the next call works.
TEST(HostHierarchical, ErrorsKeepRanksInStep) {
  testing::SeededRng rng;
  Shape s{.num_nodes = 2, .gpus_per_node = 2, .hidden = 128, .num_topk = 2};
  const int R = s.num_ranks();
  auto in = make_inputs(rng, s);
  auto buffers = make_buffers(s, true);
  const auto run_with = [&](const std::function<void(int, DispatchArgs&)>& change) {
    std::vector<int> codes(R, 0);
    testing::on_ranks(R, [&](int r) {
      auto a = fresh_args(in[r], s);
      change(r, a);
      try {
        buffers[r]->dispatch(a);
      } catch (const Error& e) {
        codes[r] = static_cast<int>(e.code());
      }
    });
    return codes;
  };
  // Rank 3 passes a different num_experts: every rank sees the disagreement in the network leg.
  auto codes = run_with([&](int r, DispatchArgs& a) {
    if (r == 3) a.num_experts = s.num_experts() * 2;
  });
  for (int r = 0; r < R; ++r) EXPECT_EQ(codes[r], static_cast<int>(ErrorCode::kInvalidArgument)) << "rank " << r;
  // An out-of-range expert id on rank 1: it raises kInvalidArgument, its peers kPeerFailure.
  std::vector<int64_t> bad_topk(std::max<int64_t>(in[1].num_tokens, 1) * s.num_topk, -1);
  bad_topk[0] = s.num_experts();
  codes = run_with([&](int r, DispatchArgs& a) {
    if (r != 1) return;
    a.topk_idx = TensorView::of(bad_topk.data(), DType::kInt64, {std::max<int64_t>(in[1].num_tokens, 1), s.num_topk});
    a.topk_weights = TensorView();
    a.x = TensorView::of(in[1].x.data(), DType::kBFloat16, {in[1].num_tokens, s.hidden});
  });
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(codes[r], static_cast<int>(r == 1 ? ErrorCode::kInvalidArgument : ErrorCode::kPeerFailure)) << r;
  }
  // Still in step: a good call works and combines.
  auto flat_buffers = make_buffers(s, false);
  const auto flat = run_dispatch(flat_buffers, [&](int r) { return fresh_args(in[r], s); });
  const auto hier = run_dispatch(buffers, [&](int r) { return fresh_args(in[r], s); });
  expect_same_dispatch(flat, hier);
}

}  // namespace
}  // namespace epx
