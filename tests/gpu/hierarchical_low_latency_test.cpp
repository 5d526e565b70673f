// GPU tests of the hierarchical low-latency routing across nodes (LowLatencyRouting, docs/internode.md "Low-latency
// across nodes") against the host backend (the oracle) on the same topology: ranks are threads of this process on the
// visible GPUs (rank r on GPU r % GPUs, so on one GPU all share device 0), cuda groups declare the nodes
// (CudaGroupOptions::gpus_per_node) as host groups do. The network leg is then the ranks-as-threads exchange
// (net_leg.h: event-ordered peer copies), not NCCL.
//
// Routing: fresh random inputs per round and rank (seed printed): T in [0, M] tokens (one rank idle), K distinct
// experts of E (experts split evenly over the ranks, node n holds [n * G * E / R, (n + 1) * G * E / R)), ~15% of the
// slots -1, weights in [-1, 1], expert outputs y random bf16. Three rounds per case through one buffer per rank, so
// the two buffer sets alternate and round 2 reuses round 0's set: a row the GPU fails to write still holds round 0's
// different data (the outputs live in the buffer; this is their poisoning), and the combine's `out` is poisoned before
// each call. Compared on every rank, every element, bit for bit: recv_count, recv_layout_range, recv_src_info (-1 past
// the count), recv_x and recv_x_scales of the received rows (rows past recv_count are unspecified), the combine output
// (the host's hierarchical order: per node an fp32 partial by k ascending, nodes ascending, one rounding) and the
// cumulative counts. Masks: symmetric (both ends mask), so the path rule of Buffer::mask_rank applies without timeouts.
//
// HierarchicalLowLatencyNccl.TwoNodes (not run yet): the same comparison with one process per GPU on an NCCL group
// (nccl_children.h), 2 nodes of 1 GPU (2 GPUs) or of 2 (4 or more GPUs; the first 4 used), so the network leg is
// NCCL send/recv and the node leg CUDA IPC: a bf16 case with hooks in round 1 and an fp8 case (UE8M0 column-major
// scales) with hooks in round 2, three rounds each, one rank idle per round. Each child computes the host backend's
// results for every rank from the shared seed and compares its own rank's outputs; it skips below 2 GPUs.
//
// HierarchicalLowLatencyNccl.TwoNodesGraph (compiled only, not run yet): the same processes, topologies and cases,
// captured. Per case each child runs one eager round (it allocates the relay region; compared too), then captures two
// rounds (dispatch + combine each, so both buffer sets alternate inside the graph; the bf16 case's second round with
// hooks, in cudaStreamCaptureModeThreadLocal; the fp8 case's first round with hooks, in cudaStreamCaptureModeGlobal)
// into one graph, uploads it, and replays it four times: before each replay it copies fresh inputs (a new seed per
// replay, the same on every rank; the token counts per (round, rank) stay those captured, one rank idle per round) into
// the captured input tensors and poisons the outputs (the combine's `out`, the dispatch results in the buffer and the
// cumulative counts), then launches, synchronizes and compares its own rank's results bit for bit with the host
// backend's on the same inputs. A failure of the Global case alone points at the capture mode (NCCL's own threads
// enqueue a non-blocking communicator's transfers beside the capture), not at the data path.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "epx/buffer.h"
#include "epx/cuda.h"
#include "epx/error.h"
#include "hierarchical_low_latency_cases.h"
#include "nccl_children.h"
#include "testing/gpu_util.h"

namespace epx::hierarchical_low_latency_test {
namespace {

const bool kCrashHandler = (testing::print_stack_on_crash(), true);

class HierarchicalLowLatencyGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (num_gpus() == 0) GTEST_SKIP() << "no GPU";
  }
};

TEST_F(HierarchicalLowLatencyGpuTest, TwoNodesOneGpuBf16) { run_and_compare(make_case(2, 1)); }

TEST_F(HierarchicalLowLatencyGpuTest, TwoNodesTwoGpusBf16) {
  Case c = make_case(4, 2);
  c.num_topk = 6;
  c.num_experts = 32;
  run_and_compare(c);
}

// NodePartials::kBFloat16: each node's partial (this node's too) rounded to bf16, as on the host backend.
TEST_F(HierarchicalLowLatencyGpuTest, Bf16NodePartials) {
  for (const int gpus_per_node : {1, 2}) {
    SCOPED_TRACE("gpus_per_node " + std::to_string(gpus_per_node));
    Case c = make_case(4, gpus_per_node);
    c.bf16_partials = true;
    c.hooks = gpus_per_node == 2;
    run_and_compare(c);
  }
}

// Above the flat routing's 16 ranks (kLowLatencyFlatMaxRanks; the hierarchical routing takes kLowLatencyMaxRanks):
// 24 and 72 nodes of one GPU (EP72 decode's rank count; 288 experts as DeepSeek-V3 with redundant experts at 72),
// every rank a thread on the GPUs here. One GPU per node keeps every wait inside a rank's own stream (its node leg is
// itself; the network leg is the ranks-as-threads exchange), so many ranks can share one GPU. The 72-rank case is
// fp8 with UE8M0 column-major scales (DeepGEMM's layout) and hooks; both receive from up to 71 other nodes, so the
// packed rows' source search above 16 sources (source_of_row's binary search) is what decides their order.
TEST_F(HierarchicalLowLatencyGpuTest, TwentyFourAndSeventyTwoRanks) {
  for (const int num_ranks : {24, 72}) {
    SCOPED_TRACE(std::to_string(num_ranks) + " nodes x 1");
    Case c = make_case(num_ranks, 1);
    c.max_tokens = 8;
    c.hidden = 512;
    c.num_topk = 8;
    c.num_experts = num_ranks == 72 ? 288 : 48;
    c.rounds = 2;
    if (num_ranks == 72) {
      c.fp8 = true;
      c.scale_format = ScaleFormat::kUE8M0;
      c.round_scale = true;
      c.scale_layout = ScaleLayout::kColumnMajor;
      c.hooks = true;
    }
    run_and_compare(c);
  }
}

// ... and a buffer on more than 16 ranks with the flat low-latency routing is refused on every rank, naming both caps.
TEST_F(HierarchicalLowLatencyGpuTest, FlatRoutingAboveSixteenRanksIsRefused) {
  auto groups = create_cuda_groups(std::vector<int>(17, 0), {.timeout_ms = 20'000});
  std::vector<std::string> errors(groups.size());
  run_host_ranks(groups, [&](int r, Group&) {
    BufferOptions options;
    options.normal_routing = NormalRouting::kHierarchical;  // the flat normal routing stops at 8 ranks first
    options.num_normal_bytes = 0;
    options.num_low_latency_bytes = low_latency_buffer_size_hint(8, 512, 17, 34);
    try {
      Buffer::create(groups[r], options);
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kUnsupported) errors[r] = e.what();
    }
  });
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_NE(errors[r].find("flat low-latency routing supports up to 16 ranks, got 17"), std::string::npos)
        << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("up to 128 ranks"), std::string::npos) << "rank " << r << ": " << errors[r];
  }
}

TEST_F(HierarchicalLowLatencyGpuTest, FourNodesOneGpuHooksInt32) {
  Case c = make_case(4, 1);
  c.hooks = true;
  c.topk_int32 = true;
  run_and_compare(c);
}

TEST_F(HierarchicalLowLatencyGpuTest, Fp8Scales) {
  struct Fp8 {
    int gpus_per_node;
    ScaleFormat format;
    bool round_scale;
    ScaleLayout layout;
    bool hooks;
  };
  for (const Fp8& f : {Fp8{1, ScaleFormat::kFloat32, false, ScaleLayout::kRowMajor, false},
                       Fp8{2, ScaleFormat::kFloat32, false, ScaleLayout::kColumnMajor, true},
                       Fp8{2, ScaleFormat::kUE8M0, false, ScaleLayout::kRowMajor, false},
                       Fp8{1, ScaleFormat::kUE8M0, false, ScaleLayout::kColumnMajor, true},
                       Fp8{2, ScaleFormat::kFloat32, true, ScaleLayout::kRowMajor, false}}) {
    SCOPED_TRACE("gpus_per_node " + std::to_string(f.gpus_per_node) + " ue8m0 " +
                 std::to_string(f.format == ScaleFormat::kUE8M0) + " round_scale " + std::to_string(f.round_scale) +
                 " column-major " + std::to_string(f.layout == ScaleLayout::kColumnMajor) + " hooks " +
                 std::to_string(f.hooks));
    Case c = make_case(4, f.gpus_per_node);
    c.hidden = 2048;  // column-major UE8M0 needs H % 512 == 0
    c.fp8 = true;
    c.scale_format = f.format;
    c.round_scale = f.round_scale;
    c.scale_layout = f.layout;
    c.hooks = f.hooks;
    run_and_compare(c);
  }
}

// Masks on 2 x 2: rank 1 (node 0, local 1) isolated (it masks everyone, everyone masks it): it is the forwarder of the
// sources with local index 1 on node 0, so rank 3's pairs for rank 0 are cut too; then ranks 0 and 3 masking each
// other: 0's pairs for 3 (through forwarder 2) and 3's for 0 (through 1) are cut, the rest travel.
TEST_F(HierarchicalLowLatencyGpuTest, MaskedRanksFollowThePathRule) {
  Case c = make_case(4, 2);
  c.masked = {{1, 0}, {1, 2}, {1, 3}};
  run_and_compare(c);
  c.masked = {{0, 3}};
  c.hooks = true;
  run_and_compare(c);
}

// kHierarchical forced on one node: everything is the own node's (no network leg); equal to the host's (= flat).
// NOTE: the 4-rank case needs 2 GPUs, as the flat low-latency test's cases with more than two ranks per GPU: with no
// network leg nothing meets on the host between the pack/forward and the receive, so four spinning receive grids can
// hold one GPU while a peer's forward waits for SMs (1x H200, 2026-12-03: ranks 2 and 3 timed out after 20 s waiting
// for rank 0's forward). The cases across nodes meet on the host in the exchange and run on one GPU.
TEST_F(HierarchicalLowLatencyGpuTest, ForcedOnOneNode) {
  run_and_compare(make_case(2, 0));
  if (num_gpus() < 2) GTEST_SKIP() << "4 ranks forced on one node need 2 GPUs (more than two spinning grids per GPU)";
  Case c = make_case(4, 0);
  c.fp8 = true;
  run_and_compare(c);
}

// ---- one process per GPU on NCCL groups ----------------------------------------------------------------------
// The parent re-executes this binary once per rank (nccl_children.h): HierarchicalLowLatencyNcclChild.Rank runs
// only with EPX_HIER_LL_RANK set; rank r uses GPU r.

constexpr const char* kEnvPrefix = "EPX_HIER_LL";

// 2 nodes of num_ranks / 2: bf16 with hooks in round 1, fp8 (UE8M0, column-major) with hooks in round 2, bf16 node
// partials, and a masked pair of ranks on different nodes.
std::vector<Case> nccl_cases(int num_ranks) {
  Case bf16 = make_case(num_ranks, num_ranks / 2);
  bf16.hook_round = 1;
  Case fp8 = bf16;
  fp8.hidden = 2048;  // column-major UE8M0 needs H % 512 == 0
  fp8.fp8 = true;
  fp8.scale_format = ScaleFormat::kUE8M0;
  fp8.scale_layout = ScaleLayout::kColumnMajor;
  fp8.hook_round = 2;
  Case partials = bf16;
  partials.hook_round = -1;
  partials.bf16_partials = true;
  // Rank 0 and the last rank (of the other node) mask each other before the first call.
  Case masked = partials;
  masked.bf16_partials = false;
  masked.masked = {{0, num_ranks - 1}};
  return {bf16, fp8, partials, masked};
}

TEST(HierarchicalLowLatencyNcclChild, Rank) {
  const std::optional<testing::NcclChild> child = testing::nccl_child(kEnvPrefix);
  if (!child) GTEST_SKIP() << "runs as a child of HierarchicalLowLatencyNccl.TwoNodes";
  const testing::NcclChildPass pass(*child);
  const int rank = child->rank, num_ranks = child->num_ranks;
  const std::vector<uint8_t> id = testing::shared_nccl_id(rank, child->id_file);
  ASSERT_FALSE(id.empty()) << "no NCCL id from rank 0";
  const std::vector<Case> cases = nccl_cases(num_ranks);
  std::shared_ptr<Group> group = create_cuda_group(id, rank, num_ranks, child->device, cuda_options(cases[0]));
  ASSERT_EQ(group->topology().num_nodes, 2);
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const uint64_t seed = child->seed + i;  // the same on every rank
    SCOPED_TRACE("rank " + std::to_string(rank) + (c.fp8 ? ", fp8" : ", bf16") + ", seed " + std::to_string(seed));
    const auto in = make_inputs(c, seed);
    const auto want = host_results(c, in);
    const RankOutput got = run_rank(c, in[rank], group, false);
    compare_rank(c, rank, want[rank], got);
  }
  group->barrier();
}

TEST(HierarchicalLowLatencyNccl, TwoNodes) {
  const int gpus = num_gpus();
  if (gpus == 0) GTEST_SKIP() << "no GPU";
  const int num_ranks = gpus >= 4 ? 4 : 2;
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + ", " + std::to_string(num_ranks) + " ranks as 2 nodes" +
               testing::sharing_note(num_ranks, gpus));
  testing::run_nccl_children(num_ranks, seed, "HierarchicalLowLatencyNcclChild", "Rank", kEnvPrefix);
}

// ---- captured into a CUDA graph, on NCCL groups ------------------------------------------------------------------
// HierarchicalLowLatencyNcclGraphChild.Rank runs only with EPX_HIER_LL_GRAPH_RANK set (nccl_children.h).

constexpr const char* kGraphEnvPrefix = "EPX_HIER_LL_GRAPH";
constexpr int kReplays = 4;

struct GraphCase {
  Case c;
  cudaStreamCaptureMode mode;
};

// nccl_cases' shapes with two rounds and token counts fixed per (round, rank) from `seed` (the same on every rank): one
// rank idle per round, the others in [M / 2, M]. bf16: round 1 with hooks, ThreadLocal; the others (fp8, bf16
// node partials, the masked pair): round 0, Global. run_graph_case honours each case's partials and masks.
std::vector<GraphCase> graph_cases(int num_ranks, uint64_t seed) {
  std::vector<Case> cases = nccl_cases(num_ranks);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::vector<GraphCase> out;
  for (size_t i = 0; i < cases.size(); ++i) {
    Case c = cases[i];
    c.rounds = 2;
    c.hook_round = i == 0 ? 1 : 0;
    c.tokens.assign(c.rounds, std::vector<int64_t>(num_ranks));
    for (int round = 0; round < c.rounds; ++round) {
      const int idle = static_cast<int>((round + i) % num_ranks);
      for (int r = 0; r < num_ranks; ++r) {
        c.tokens[round][r] = r == idle ? 0 : c.max_tokens / 2 + static_cast<int64_t>(rng() % (c.max_tokens / 2 + 1));
      }
    }
    out.push_back({c, i == 0 ? cudaStreamCaptureModeThreadLocal : cudaStreamCaptureModeGlobal});
  }
  return out;
}

// One round's device tensors: the inputs the graph reads and the combine's output, shapes fixed at the capture.
struct GraphRound : RoundTensors {
  LowLatencyDispatchResult res;  // views of the dispatch results in the buffer (set fixed at the capture)
};

// Copies round `round` of `in` into g's tensors (same shapes) and poisons the outputs; on `stream`, waited for.
void load_round(const Case& c, const RoundInput& in, GraphRound& g, cudaStream_t stream) {
  std::vector<int32_t> topk32(in.topk.begin(), in.topk.end());
  auto copy = [&](const Tensor& t, const void* src, size_t bytes) {
    ASSERT_EQ(t.nbytes(), bytes);
    if (bytes > 0) {
      ASSERT_EQ(cudaMemcpyAsync(t.data(), src, bytes, cudaMemcpyHostToDevice, stream), cudaSuccess);
    }
  };
  copy(g.x, in.x.data(), in.x.size() * 2);
  if (c.topk_int32) {
    copy(g.topk, topk32.data(), topk32.size() * 4);
  } else {
    copy(g.topk, in.topk.data(), in.topk.size() * 8);
  }
  copy(g.weights, in.weights.data(), in.weights.size() * 4);
  copy(g.y, in.y.data(), in.y.size() * 2);
  for (const Tensor* t : {&g.out, &g.res.recv_x, &g.res.recv_x_scales, &g.res.recv_count, &g.res.recv_src_info,
                          &g.res.recv_layout_range}) {
    if (t->defined() && t->nbytes() > 0) {
      ASSERT_EQ(testing::poison(t->data(), t->nbytes(), stream), cudaSuccess);
    }
  }
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);  // the host vectors above go now
}

// Dispatch + combine of one round on `stream` (hooks run at once); keeps the dispatch result in g.
void enqueue_round(const Case& c, int round, Buffer& buffer, GraphRound& g, const Tensor& cumulative, Stream stream) {
  const bool hooks = c.hooks || round == c.hook_round;
  g.res = buffer.low_latency_dispatch(round_dispatch_args(c, g, hooks, cumulative, stream));
  EXPECT_EQ(static_cast<bool>(g.res.recv_hook), hooks);
  if (hooks) g.res.recv_hook();
  LowLatencyCombineResult comb = buffer.low_latency_combine(round_combine_args(g, g.res, hooks, stream));
  if (hooks) comb.recv_hook();
}

// This rank's results of rounds [0, num_rounds) and the cumulative counts, downloaded (the stream synchronized).
RankOutput download_rounds(const std::vector<GraphRound>& rounds, int num_rounds, const Tensor& cumulative,
                           Stream stream) {
  RankOutput o;
  for (int round = 0; round < num_rounds; ++round) {
    const GraphRound& g = rounds[round];
    RoundOutput ro;
    ro.count = download<int32_t>(g.res.recv_count, stream);
    ro.ranges = download<int64_t>(g.res.recv_layout_range, stream);
    ro.src_info = download<int32_t>(g.res.recv_src_info, stream);
    ro.x = download<uint8_t>(g.res.recv_x, stream);
    ro.scales = download<uint8_t>(g.res.recv_x_scales, stream);
    ro.combined = download<uint16_t>(g.out, stream);
    o.rounds.push_back(std::move(ro));
  }
  o.cumulative = download<int32_t>(cumulative, stream);
  return o;
}

// Round 0 of `in`, alone: the eager round's case and inputs (its host reference has one round).
std::pair<Case, std::vector<std::vector<RoundInput>>> first_round(const Case& c,
                                                                  const std::vector<std::vector<RoundInput>>& in) {
  Case one = c;
  one.rounds = 1;
  one.tokens.resize(1);
  std::vector<std::vector<RoundInput>> first;
  for (const auto& rank_in : in) first.push_back({rank_in[0]});
  return {one, first};
}

void run_graph_case(const GraphCase& gc, const std::shared_ptr<Group>& group, uint64_t seed) {
  const Case& c = gc.c;
  const int rank = group->rank();
  const Device dev = group->device();
  ASSERT_EQ(cudaSetDevice(dev.index), cudaSuccess);
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  const Stream stream = s;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  {
    const int64_t H = c.hidden, K = c.num_topk;
    const DType topk_dtype = c.topk_int32 ? DType::kInt32 : DType::kInt64;
    std::vector<GraphRound> rounds(c.rounds);
    for (int round = 0; round < c.rounds; ++round) {
      const int64_t T = c.tokens[round][rank];
      GraphRound& g = rounds[round];
      auto make = [&](DType dtype, std::vector<int64_t> shape) {
        return Tensor::empty(dtype, std::move(shape), dev, nullptr, stream);
      };
      g.x = make(DType::kBFloat16, {T, H});
      g.topk = make(topk_dtype, {T, K});
      g.weights = make(DType::kFloat32, {T, K});
      g.y = make(DType::kBFloat16, {c.local_experts(), c.slots(), H});
      g.out = make(DType::kBFloat16, {T, H});
    }
    const Tensor cumulative = Tensor::empty(DType::kInt32, {c.local_experts()}, dev, nullptr, stream);
    BufferOptions options;
    options.allocator = std::make_shared<testing::PoisonAllocator>();
    options.num_low_latency_bytes = low_latency_buffer_size_hint(c.max_tokens, c.hidden, c.num_ranks, c.num_experts);
    options.low_latency_routing = LowLatencyRouting::kAuto;
    options.node_partials = c.bf16_partials ? NodePartials::kBFloat16 : NodePartials::kFloat32;
    auto buffer = Buffer::create(group, options);
    for (const auto& [a, b] : c.masked) {
      if (rank == a) buffer->mask_rank(b);
      if (rank == b) buffer->mask_rank(a);
    }

    {  // The eager round (round 0's tensors): the first dispatch allocates and maps the relay region.
      SCOPED_TRACE("eager round, seed " + std::to_string(seed));
      const auto in = make_inputs(c, seed);
      const auto [one, first] = first_round(c, in);
      const auto want = host_results(one, first);
      ASSERT_NO_FATAL_FAILURE(load_round(c, in[rank][0], rounds[0], s));
      ASSERT_EQ(cudaMemsetAsync(cumulative.data(), 0, cumulative.nbytes(), s), cudaSuccess);
      enqueue_round(one, 0, *buffer, rounds[0], cumulative, stream);
      ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
      compare_rank(one, rank, want[rank], download_rounds(rounds, 1, cumulative, stream));
    }

    ASSERT_EQ(cudaStreamBeginCapture(s, gc.mode), cudaSuccess);
    try {
      for (int round = 0; round < c.rounds; ++round) {
        enqueue_round(c, round, *buffer, rounds[round], cumulative, stream);
      }
    } catch (const std::exception& e) {
      cudaStreamEndCapture(s, &graph);  // so the buffer's destructor does not run inside the capture
      if (graph != nullptr) cudaGraphDestroy(graph);
      FAIL() << "a call under capture threw: " << e.what();
    }
    ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess) << "the capture was invalidated";
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    ASSERT_EQ(cudaGraphUpload(exec, s), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);

    for (int replay = 0; replay < kReplays; ++replay) {
      const uint64_t replay_seed = seed + 1 + replay;  // the same on every rank
      SCOPED_TRACE("replay " + std::to_string(replay) + ", seed " + std::to_string(replay_seed));
      const auto in = make_inputs(c, replay_seed);
      const auto want = host_results(c, in);
      for (int round = 0; round < c.rounds; ++round) {
        ASSERT_NO_FATAL_FAILURE(load_round(c, in[rank][round], rounds[round], s));
      }
      ASSERT_EQ(cudaMemsetAsync(cumulative.data(), 0, cumulative.nbytes(), s), cudaSuccess);
      ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
      compare_rank(c, rank, want[rank], download_rounds(rounds, c.rounds, cumulative, stream));
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    exec = nullptr;
    graph = nullptr;
  }  // NOTE: tensors free on `stream`: release them before destroying it
  cudaStreamDestroy(s);
}

TEST(HierarchicalLowLatencyNcclGraphChild, Rank) {
  const std::optional<testing::NcclChild> child = testing::nccl_child(kGraphEnvPrefix);
  if (!child) GTEST_SKIP() << "runs as a child of HierarchicalLowLatencyNccl.TwoNodesGraph";
  const testing::NcclChildPass pass(*child);
  const int rank = child->rank, num_ranks = child->num_ranks;
  const std::vector<uint8_t> id = testing::shared_nccl_id(rank, child->id_file);
  ASSERT_FALSE(id.empty()) << "no NCCL id from rank 0";
  const std::vector<GraphCase> cases = graph_cases(num_ranks, child->seed);
  std::shared_ptr<Group> group = create_cuda_group(id, rank, num_ranks, child->device, cuda_options(cases[0].c));
  ASSERT_EQ(group->topology().num_nodes, 2);
  for (size_t i = 0; i < cases.size(); ++i) {
    const uint64_t seed = child->seed + 100 * i;  // the same on every rank
    SCOPED_TRACE("rank " + std::to_string(rank) + (cases[i].c.fp8 ? ", fp8" : ", bf16"));
    run_graph_case(cases[i], group, seed);
  }
  group->barrier();
}

TEST(HierarchicalLowLatencyNccl, TwoNodesGraph) {
  const int gpus = num_gpus();
  if (gpus == 0) GTEST_SKIP() << "no GPU";
  const int num_ranks = gpus >= 4 ? 4 : 2;
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + ", " + std::to_string(num_ranks) + " ranks as 2 nodes, captured" +
               testing::sharing_note(num_ranks, gpus));
  testing::run_nccl_children(num_ranks, seed, "HierarchicalLowLatencyNcclGraphChild", "Rank", kGraphEnvPrefix);
}

}  // namespace
}  // namespace epx::hierarchical_low_latency_test
