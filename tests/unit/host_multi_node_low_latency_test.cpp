// Host backend, multi-node low-latency path: the hierarchical routing (LowLatencyRouting, docs/internode.md
// "Low-latency across nodes") against the flat one and against references built here.
//
// Routing: one global routing per case. Every rank draws 0-12 tokens (one rank idle, T = 0) with K distinct experts
// out of 2 per rank, ~15% of the slots -1 (so an (expert, source) block never exceeds M = 12 pairs). Each rank holds
// two buffers on one group of the case's topology: one forced kFlat, one kAuto (hierarchical on more than one node;
// one-node cases force kHierarchical). Dispatch: every output equal bit for bit between the two (rows and scales of
// the received rows, recv_count, recv_src_info, recv_layout_range, cumulative counts). Combine: the experts return a
// value that names the pair, f(global expert, source rank, source token, h) (rows past recv_count NaN), and each
// routing's output must equal, bit for bit, a reference of its order computed here: flat 0 + w * f over k ascending;
// hierarchical per node n ascending p_n = 0 + w * f over node n's k ascending, then 0 + p_0 + p_1 + ...; both
// rounded once to bf16. Masks and silent ranks: the expected pairs follow the path rule of Buffer::mask_rank
// (source s -> rank d through forwarder f = (node of d, local index of s): the links s-d, s-f, f-d all open).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstring>
#include <functional>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "epx/buffer.h"
#include "epx/error.h"
#include "epx/group.h"
#include "epx/quant.h"
#include "test_util.h"

namespace epx {
namespace {

constexpr int64_t kMaxTokens = 12;
constexpr int64_t kLocalExperts = 2;

struct Case {
  int num_nodes = 1;
  int gpus_per_node = 1;
  int64_t hidden = 128;
  int num_topk = 4;
  bool use_fp8 = false;
  ScaleFormat scale_format = ScaleFormat::kFloat32;
  bool round_scale = false;
  ScaleLayout scale_layout = ScaleLayout::kRowMajor;
  bool hooks = false;
  bool bf16_partials = false;  // NodePartials::kBFloat16 on the hierarchical buffer
  int num_ranks() const { return num_nodes * gpus_per_node; }
  int64_t num_experts() const { return kLocalExperts * num_ranks(); }
  int node_of(int rank) const { return rank / gpus_per_node; }
};

std::string describe(const Case& c) {
  return fmt::format("{} nodes x {} GPUs, hidden {}, top-{} of {}{}{}{}{}{}{}", c.num_nodes, c.gpus_per_node, c.hidden,
                     c.num_topk, c.num_experts(), c.use_fp8 ? ", fp8" : "",
                     c.scale_format == ScaleFormat::kUE8M0 ? " ue8m0" : "", c.round_scale ? " round_scale" : "",
                     c.scale_layout == ScaleLayout::kColumnMajor ? " column-major" : "", c.hooks ? ", hooks" : "",
                     c.bf16_partials ? ", bf16 partials" : "");
}

struct RankInput {
  int64_t num_tokens = 0;
  std::vector<uint16_t> x;     // [T, H] bf16
  std::vector<int64_t> topk;   // [T, K]
  std::vector<float> weights;  // [T, K]
};

std::vector<RankInput> make_inputs(std::mt19937& rng, const Case& c) {
  const int R = c.num_ranks();
  std::vector<RankInput> in(R);
  std::uniform_int_distribution<int64_t> tokens(1, kMaxTokens);
  std::uniform_real_distribution<float> weight(-1.f, 1.f);
  const int idle = static_cast<int>(rng() % R);
  for (int r = 0; r < R; ++r) {
    RankInput& d = in[r];
    d.num_tokens = (r == idle && R > 1) ? 0 : tokens(rng);
    d.x = testing::random_bf16(rng, d.num_tokens * c.hidden, 8.f);
    d.topk = testing::random_topk(rng, d.num_tokens, c.num_topk, c.num_experts(), 0.15);
    d.weights.resize(d.topk.size());
    for (auto& w : d.weights) w = weight(rng);
  }
  return in;
}

LowLatencyDispatchArgs dispatch_args(RankInput& d, const Case& c, const Tensor& cumulative = {}) {
  LowLatencyDispatchArgs a;
  a.x = TensorView::of(d.x.data(), DType::kBFloat16, {d.num_tokens, c.hidden});
  a.topk_idx = TensorView::of(d.topk.data(), DType::kInt64, {d.num_tokens, c.num_topk});
  a.max_tokens_per_rank = kMaxTokens;
  a.num_experts = c.num_experts();
  a.use_fp8 = c.use_fp8;
  a.scale_format = c.scale_format;
  a.round_scale = c.round_scale;
  a.scale_layout = c.scale_layout;
  a.return_recv_hook = c.hooks;
  if (cumulative.defined()) a.cumulative_recv_counts = cumulative.view();
  return a;
}

LowLatencyCombineArgs combine_args(RankInput& d, const Case& c, const LowLatencyDispatchResult& res,
                                   std::vector<uint16_t>& expert_out) {
  LowLatencyCombineArgs a;
  const int64_t R = c.num_ranks();
  a.x = TensorView::of(expert_out.data(), DType::kBFloat16, {kLocalExperts, R * kMaxTokens, c.hidden});
  a.topk_idx = TensorView::of(d.topk.data(), DType::kInt64, {d.num_tokens, c.num_topk});
  a.topk_weights = TensorView::of(d.weights.data(), DType::kFloat32, {d.num_tokens, c.num_topk});
  a.handle = res.handle;
  a.return_recv_hook = c.hooks;
  return a;
}

std::unique_ptr<Buffer> make_buffer(const std::shared_ptr<Group>& group, LowLatencyRouting routing,
                                    NodePartials partials = NodePartials::kFloat32) {
  BufferOptions options;
  options.num_low_latency_bytes = 1;  // the host backend sizes its own slots
  options.low_latency_routing = routing;
  options.node_partials = partials;
  return Buffer::create(group, options);
}

// The expert output for one pair: a bf16 value in [-8, 8] in steps of 1/16 that names (expert, source, token, h).
uint16_t pair_value(int64_t expert, int src, int64_t token, int64_t h) {
  uint64_t z = (static_cast<uint64_t>(expert) << 40) ^ (static_cast<uint64_t>(src) << 28) ^
               (static_cast<uint64_t>(token) << 16) ^ static_cast<uint64_t>(h);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return float_to_bf16(static_cast<float>(static_cast<int>(z % 257) - 128) / 16.f);
}

// Rank r's expert outputs for its dispatch result: pair_value of each received pair, NaN past recv_count.
std::vector<uint16_t> expert_outputs(const Case& c, int r, const LowLatencyDispatchResult& res) {
  const int R = c.num_ranks();
  const int64_t num_slots = R * kMaxTokens, H = c.hidden;
  std::vector<uint16_t> out(kLocalExperts * num_slots * H, uint16_t{0x7fc0});
  for (int64_t e = 0; e < kLocalExperts; ++e) {
    for (int s = 0; s < R; ++s) {
      const int64_t range = res.recv_layout_range.data_as<int64_t>()[e * R + s];
      const int64_t begin = range >> 32, count = range & 0xffffffff;
      for (int64_t row = begin; row < begin + count; ++row) {
        const int64_t t = res.recv_src_info.data_as<int32_t>()[e * num_slots + row];
        for (int64_t h = 0; h < H; ++h) out[(e * num_slots + row) * H + h] = pair_value(r * kLocalExperts + e, s, t, h);
      }
    }
  }
  return out;
}

using Reaches = std::function<bool(int src, int dst)>;

// Source r's combine output by the order of its routing (see the top); `nodes` = 1 for the flat order. bf16_partials:
// each node's partial rounded to bf16 before it is added (NodePartials::kBFloat16).
std::vector<uint16_t> combine_reference(const Case& c, const RankInput& d, int r, int nodes, const Reaches& reaches,
                                        bool bf16_partials = false) {
  const int64_t H = c.hidden, K = c.num_topk;
  const int64_t experts_per_node = c.num_experts() / nodes;
  std::vector<uint16_t> out(d.num_tokens * H);
  for (int64_t t = 0; t < d.num_tokens; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      float acc = 0.f;
      for (int n = 0; n < nodes; ++n) {
        float partial = 0.f;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t e = d.topk[t * K + k];
          if (e < 0 || e / experts_per_node != n || !reaches(r, static_cast<int>(e / kLocalExperts))) continue;
          const float product = d.weights[t * K + k] * bf16_to_float(pair_value(e, r, t, h));
          partial += product;
        }
        acc += bf16_partials ? bf16_to_float(float_to_bf16(partial)) : partial;
      }
      out[t * H + h] = float_to_bf16(acc);
    }
  }
  return out;
}

void expect_combine(const Case& c, const RankInput& d, int r, int nodes, const Reaches& reaches, const Tensor& got,
                    const char* what, bool bf16_partials = false) {
  const auto expected = combine_reference(c, d, r, nodes, reaches, bf16_partials);
  ASSERT_EQ(got.sizes(), (std::vector<int64_t>{d.num_tokens, c.hidden})) << what;
  for (size_t i = 0; i < expected.size(); ++i) {
    ASSERT_EQ(got.data_as<uint16_t>()[i], expected[i])
        << what << " combine, rank " << r << " token " << i / c.hidden << " h " << i % c.hidden;
  }
}

// The received rows' scales of expert e, row i (any layout), as bytes.
std::vector<uint8_t> scale_bytes(const Tensor& scales, ScaleLayout layout, int64_t e, int64_t row) {
  const size_t size = dtype_size(scales.dtype());
  const bool column = layout == ScaleLayout::kColumnMajor;
  const int64_t units = scales.size(column ? 1 : 2), slots = scales.size(column ? 2 : 1);
  std::vector<uint8_t> out;
  for (int64_t u = 0; u < units; ++u) {
    const int64_t i = column ? (e * units + u) * slots + row : (e * slots + row) * units + u;
    const auto* at = static_cast<const uint8_t*>(scales.data()) + i * size;
    out.insert(out.end(), at, at + size);
  }
  return out;
}

void expect_same_dispatch(const Case& c, int r, const LowLatencyDispatchResult& flat,
                          const LowLatencyDispatchResult& hier) {
  SCOPED_TRACE("receiving rank " + std::to_string(r));
  const int R = c.num_ranks();
  const int64_t num_slots = R * kMaxTokens;
  const size_t row_bytes = c.hidden * (c.use_fp8 ? 1 : 2);
  ASSERT_EQ(hier.recv_x.sizes(), flat.recv_x.sizes());
  ASSERT_EQ(hier.recv_x.dtype(), flat.recv_x.dtype());
  ASSERT_EQ(hier.recv_x_scales.defined(), c.use_fp8);
  ASSERT_EQ(std::memcmp(hier.recv_count.data(), flat.recv_count.data(), kLocalExperts * 4), 0);
  ASSERT_EQ(std::memcmp(hier.recv_src_info.data(), flat.recv_src_info.data(), kLocalExperts * num_slots * 4), 0);
  ASSERT_EQ(std::memcmp(hier.recv_layout_range.data(), flat.recv_layout_range.data(), kLocalExperts * R * 8), 0);
  if (c.use_fp8) {
    ASSERT_EQ(hier.recv_x_scales.sizes(), flat.recv_x_scales.sizes());
    ASSERT_EQ(hier.recv_x_scales.dtype(), flat.recv_x_scales.dtype());
  }
  for (int64_t e = 0; e < kLocalExperts; ++e) {
    const int32_t count = flat.recv_count.data_as<int32_t>()[e];
    for (int64_t row = 0; row < count; ++row) {
      const int64_t slot = e * num_slots + row;
      ASSERT_EQ(std::memcmp(static_cast<const uint8_t*>(hier.recv_x.data()) + slot * row_bytes,
                            static_cast<const uint8_t*>(flat.recv_x.data()) + slot * row_bytes, row_bytes),
                0)
          << "expert " << e << " row " << row;
      if (c.use_fp8) {
        ASSERT_EQ(scale_bytes(hier.recv_x_scales, c.scale_layout, e, row),
                  scale_bytes(flat.recv_x_scales, c.scale_layout, e, row))
            << "expert " << e << " row " << row;
      }
    }
  }
}

// Brute force: rank dst's received pairs (bf16) when `reaches` says which sources get through.
void expect_dispatch(const Case& c, const std::vector<RankInput>& in, int dst, const LowLatencyDispatchResult& res,
                     const Reaches& reaches) {
  SCOPED_TRACE("receiving rank " + std::to_string(dst));
  const int R = c.num_ranks();
  const int64_t num_slots = R * kMaxTokens, H = c.hidden, K = c.num_topk;
  for (int64_t e = 0; e < kLocalExperts; ++e) {
    int32_t total = 0;
    for (int s = 0; s < R; ++s) {
      int64_t n = 0;
      for (int64_t t = 0; reaches(s, dst) && t < in[s].num_tokens; ++t) {
        for (int64_t k = 0; k < K; ++k) {
          if (in[s].topk[t * K + k] != dst * kLocalExperts + e) continue;
          const int64_t slot = e * num_slots + total + n;
          ASSERT_EQ(res.recv_src_info.data_as<int32_t>()[slot], t) << "expert " << e << " source " << s;
          ASSERT_EQ(std::memcmp(res.recv_x.data_as<uint16_t>() + slot * H, in[s].x.data() + t * H, H * 2), 0);
          ++n;
        }
      }
      ASSERT_EQ(res.recv_layout_range.data_as<int64_t>()[e * R + s], (int64_t{total} << 32) | n)
          << "expert " << e << " source " << s;
      total += static_cast<int32_t>(n);
    }
    ASSERT_EQ(res.recv_count.data_as<int32_t>()[e], total) << "expert " << e;
  }
}

// The path rule of Buffer::mask_rank, given which links are cut (closed[a][b], symmetric).
Reaches path_rule(const Case& c, const std::vector<std::vector<bool>>& closed) {
  return [&c, closed](int src, int dst) {
    const auto open = [&](int a, int b) { return a == b || !closed[a][b]; };
    const int f = c.node_of(dst) * c.gpus_per_node + src % c.gpus_per_node;
    return open(src, dst) && open(src, f) && open(f, dst);
  };
}

// The outputs of one hierarchical dispatch + combine per rank.
struct Step {
  std::vector<LowLatencyDispatchResult> dispatched;
  std::vector<LowLatencyCombineResult> combined;
  explicit Step(int num_ranks) : dispatched(num_ranks), combined(num_ranks) {}

  void run(Buffer& buffer, const Case& c, RankInput& in, int r) {
    dispatched[r] = buffer.low_latency_dispatch(dispatch_args(in, c));
    auto expert_out = expert_outputs(c, r, dispatched[r]);
    combined[r] = buffer.low_latency_combine(combine_args(in, c, dispatched[r], expert_out));
  }
  // Every rank's outputs (but `skip`'s) against the brute force and the reference, with `reaches`.
  void expect(const Case& c, const std::vector<RankInput>& in, const Reaches& reaches, int skip = -1) const {
    for (int r = 0; r < c.num_ranks(); ++r) {
      if (r == skip) continue;
      expect_dispatch(c, in, r, dispatched[r], reaches);
      expect_combine(c, in[r], r, c.num_nodes, reaches, combined[r].x, "hierarchical");
    }
  }
};

// One dispatch + combine of both routings on every rank, all checked.
void run_case(const Case& c, std::mt19937& rng) {
  SCOPED_TRACE(describe(c));
  const int R = c.num_ranks();
  auto groups = create_host_groups(R, {.timeout_ms = 20'000, .gpus_per_node = c.gpus_per_node});
  auto in = make_inputs(rng, c);
  const LowLatencyRouting routing = c.num_nodes > 1 ? LowLatencyRouting::kAuto : LowLatencyRouting::kHierarchical;
  std::vector<LowLatencyDispatchResult> flat(R), hier(R);
  std::vector<LowLatencyCombineResult> flat_out(R), hier_out(R);
  std::vector<Tensor> flat_counts(R), hier_counts(R);
  std::barrier sync(R);
  testing::on_ranks(R, [&](int r) {
    auto flat_buffer = make_buffer(groups[r], LowLatencyRouting::kFlat);
    auto hier_buffer =
        make_buffer(groups[r], routing, c.bf16_partials ? NodePartials::kBFloat16 : NodePartials::kFloat32);
    for (Tensor* t : {&flat_counts[r], &hier_counts[r]}) {
      *t = Tensor::empty(DType::kInt32, {kLocalExperts}, Device::cpu());
      std::fill(t->data_as<int32_t>(), t->data_as<int32_t>() + kLocalExperts, 5);
    }
    flat[r] = flat_buffer->low_latency_dispatch(dispatch_args(in[r], c, flat_counts[r]));
    hier[r] = hier_buffer->low_latency_dispatch(dispatch_args(in[r], c, hier_counts[r]));
    if (c.hooks) {
      sync.arrive_and_wait();  // every rank has only sent: a receive that needed a peer's hook would hang here
      hier[r].recv_hook();
      flat[r].recv_hook();
    }
    auto expert_out = expert_outputs(c, r, flat[r]);
    flat_out[r] = flat_buffer->low_latency_combine(combine_args(in[r], c, flat[r], expert_out));
    hier_out[r] = hier_buffer->low_latency_combine(combine_args(in[r], c, hier[r], expert_out));
    if (c.hooks) {
      sync.arrive_and_wait();
      hier_out[r].recv_hook();
      flat_out[r].recv_hook();
    }
    sync.arrive_and_wait();  // the buffers (and their results' storage) live until every rank has read them
  });
  const Reaches all = [](int, int) { return true; };
  for (int r = 0; r < R; ++r) {
    if (!c.use_fp8) expect_dispatch(c, in, r, flat[r], all);  // kFlat on a multi-node group: still the flat rows
    expect_same_dispatch(c, r, flat[r], hier[r]);
    EXPECT_EQ(std::vector<int32_t>(hier_counts[r].data_as<int32_t>(), hier_counts[r].data_as<int32_t>() + 2),
              std::vector<int32_t>(flat_counts[r].data_as<int32_t>(), flat_counts[r].data_as<int32_t>() + 2));
    EXPECT_EQ(hier_counts[r].data_as<int32_t>()[0], 5 + flat[r].recv_count.data_as<int32_t>()[0]);
    expect_combine(c, in[r], r, 1, all, flat_out[r].x, "flat");
    expect_combine(c, in[r], r, c.num_nodes, all, hier_out[r].x, "hierarchical", c.bf16_partials);
    if (c.num_nodes == 1) {
      ASSERT_EQ(std::memcmp(hier_out[r].x.data(), flat_out[r].x.data(), in[r].num_tokens * c.hidden * 2), 0);
    }
  }
}

// Fresh random inputs in every test, its seed in every failure message.
class HostMultiNodeLowLatency : public ::testing::Test {
 protected:
  const unsigned seed_ = std::random_device{}();
  std::mt19937 rng_{seed_};
  ::testing::ScopedTrace trace_{__FILE__, __LINE__, "seed " + std::to_string(seed_)};
};

TEST_F(HostMultiNodeLowLatency, HierarchicalEqualsFlatOnEveryTopology) {
  struct Fp8 {
    ScaleFormat format;
    bool round_scale;
    ScaleLayout layout;
  };
  const Fp8 fp8[] = {{ScaleFormat::kFloat32, false, ScaleLayout::kRowMajor},
                     {ScaleFormat::kUE8M0, false, ScaleLayout::kRowMajor},
                     {ScaleFormat::kFloat32, true, ScaleLayout::kColumnMajor},
                     {ScaleFormat::kUE8M0, false, ScaleLayout::kColumnMajor},
                     {ScaleFormat::kFloat32, false, ScaleLayout::kColumnMajor}};
  int i = 0;
  for (int nodes : {1, 2, 4, 9}) {
    for (int gpus : {1, 2, 4, 8}) {
      for (bool use_fp8 : {false, true}) {
        Case c;
        c.num_nodes = nodes;
        c.gpus_per_node = gpus;
        c.hidden = (i % 2 == 0) ? 128 : 256;
        c.num_topk = static_cast<int>(std::min<int64_t>(8, c.num_experts()));
        c.use_fp8 = use_fp8;
        const Fp8& f = fp8[i % std::size(fp8)];
        c.scale_format = f.format;
        c.round_scale = f.round_scale;
        c.scale_layout = f.layout;
        // Column-major UE8M0 packs four blocks per int32 word: H % 512 == 0.
        if (use_fp8 && c.scale_layout == ScaleLayout::kColumnMajor && c.scale_format == ScaleFormat::kUE8M0) {
          c.hidden = 512;
        }
        c.hooks = i % 3 == 1;
        ++i;
        run_case(c, rng_);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
}

// NodePartials::kBFloat16: each node's partial rounded to bf16 (the reference's order; with one node equal to flat).
TEST_F(HostMultiNodeLowLatency, Bf16NodePartialsRoundEachNodesSum) {
  for (const auto& [nodes, gpus] : std::vector<std::pair<int, int>>{{1, 4}, {2, 1}, {2, 2}, {4, 2}, {9, 1}}) {
    Case c;
    c.num_nodes = nodes;
    c.gpus_per_node = gpus;
    c.num_topk = static_cast<int>(std::min<int64_t>(8, c.num_experts()));
    c.use_fp8 = nodes % 2 == 0;
    c.hooks = gpus == 2;
    c.bf16_partials = true;
    run_case(c, rng_);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// Masks on 3 nodes x 2 GPUs (rank (n, l) = 2n + l); each entry: which rank masks which, before the calls.
TEST_F(HostMultiNodeLowLatency, MaskCutsThePathsThroughTheForwarder) {
  Case c{.num_nodes = 3, .gpus_per_node = 2, .num_topk = 6};
  const int R = c.num_ranks();
  const std::vector<std::vector<std::pair<int, int>>> scenarios = {
      {{0, 2}},                          // a source masks its forwarder on node 1: its tokens miss node 1
      {{2, 3}},                          // a forwarder and a destination of one node
      {{0, 3}, {1, 3}, {2, 3}, {4, 3}},  // everyone but rank 5 masks rank 3; rank 3 masks them back
      {{3, 0}},                          // a destination masks a source of another node (no forwarder involved)
  };
  for (const auto& scenario : scenarios) {
    SCOPED_TRACE(fmt::format("scenario: first mask {} -> {}", scenario[0].first, scenario[0].second));
    auto groups = create_host_groups(R, {.timeout_ms = 20'000, .gpus_per_node = c.gpus_per_node});
    auto in = make_inputs(rng_, c);
    std::vector<std::vector<bool>> closed(R, std::vector<bool>(R, false));
    for (auto [a, b] : scenario) closed[a][b] = closed[b][a] = true;
    const Reaches reaches = path_rule(c, closed);
    Step step(R);
    std::vector<std::vector<bool>> masks(R);
    std::barrier sync(R);
    const auto start = std::chrono::steady_clock::now();
    testing::on_ranks(R, [&](int r) {
      auto buffer = make_buffer(groups[r], LowLatencyRouting::kAuto);
      for (auto [a, b] : scenario) {
        if (a == r) buffer->mask_rank(b);
      }
      step.run(*buffer, c, in[r], r);
      masks[r] = buffer->rank_mask();
      sync.arrive_and_wait();
    });
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));  // nothing waited for a timeout
    for (int r = 0; r < R; ++r) EXPECT_EQ(masks[r], closed[r]) << "rank " << r;    // masks became symmetric
    step.expect(c, in, reaches);
  }
}

// A rank that never calls is masked after the timeout; as a forwarder it cuts its node off from the sources with
// its local index.
TEST_F(HostMultiNodeLowLatency, SilentRankIsMaskedAfterTimeout) {
  Case c{.num_nodes = 2, .gpus_per_node = 2};
  constexpr int kSilent = 3;
  const int R = c.num_ranks();
  auto groups = create_host_groups(R, {.timeout_ms = 200, .gpus_per_node = c.gpus_per_node});
  auto in = make_inputs(rng_, c);
  std::vector<std::vector<bool>> closed(R, std::vector<bool>(R, false));
  for (int r = 0; r < R; ++r) closed[r][kSilent] = closed[kSilent][r] = r != kSilent;
  const Reaches reaches = path_rule(c, closed);
  Step step(R);
  std::vector<std::unique_ptr<Buffer>> buffers(R);
  for (int r = 0; r < R; ++r) buffers[r] = make_buffer(groups[r], LowLatencyRouting::kAuto);
  std::barrier sync(R - 1);
  testing::on_ranks(R, [&](int r) {
    if (r == kSilent) return;
    step.run(*buffers[r], c, in[r], r);
    sync.arrive_and_wait();
  });
  for (int r = 0; r < R; ++r) {
    if (r == kSilent) continue;
    EXPECT_EQ(buffers[r]->rank_mask(), closed[r]) << "rank " << r;
  }
  step.expect(c, in, reaches, kSilent);
}

// An invalid top-k entry on one rank: it raises kInvalidArgument, its peers kPeerFailure, nobody waits out the
// timeout, and the next calls work on every rank.
TEST_F(HostMultiNodeLowLatency, InvalidTopkFailsPeersAndTheGroupStaysUsable) {
  Case c{.num_nodes = 2, .gpus_per_node = 2};
  constexpr int kBad = 1;
  const int R = c.num_ranks();
  auto groups = create_host_groups(R, {.timeout_ms = 20'000, .gpus_per_node = c.gpus_per_node});
  auto bad = make_inputs(rng_, c);
  if (bad[kBad].num_tokens == 0) {
    bad[kBad].num_tokens = 1;
    bad[kBad].x.assign(c.hidden, 0);
    bad[kBad].topk.assign(c.num_topk, -1);
    bad[kBad].weights.assign(c.num_topk, 0.f);
  }
  bad[kBad].topk[0] = c.num_experts();  // out of range
  auto in = make_inputs(rng_, c);
  std::vector<ErrorCode> codes(R, ErrorCode::kInternal);
  Step step(R);
  std::barrier sync(R);
  const auto start = std::chrono::steady_clock::now();
  testing::on_ranks(R, [&](int r) {
    auto buffer = make_buffer(groups[r], LowLatencyRouting::kAuto);
    try {
      buffer->low_latency_dispatch(dispatch_args(bad[r], c));
    } catch (const Error& e) {
      codes[r] = e.code();
    }
    step.run(*buffer, c, in[r], r);
    sync.arrive_and_wait();
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(codes[r], r == kBad ? ErrorCode::kInvalidArgument : ErrorCode::kPeerFailure) << "rank " << r;
  }
  step.expect(c, in, [](int, int) { return true; });
}

TEST_F(HostMultiNodeLowLatency, RoutingOptionIsChecked) {
  auto groups = create_host_groups(1);
  BufferOptions options;
  options.low_latency_routing = static_cast<LowLatencyRouting>(7);
  testing::expect_invalid([&] { Buffer::create(groups[0], options); }, "low_latency_routing");
}

}  // namespace
}  // namespace epx
