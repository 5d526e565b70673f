// GPU tests of the hierarchical normal dispatch/combine (NormalRouting::kHierarchical, docs/multi-node.md) against
// the host backend's hierarchical path (the oracle), on ONE GPU: the ranks are threads sharing device 0, and cuda
// groups declare the nodes (CudaGroupOptions::gpus_per_node) as host groups do.
//
// Routing: every case draws fresh random top-k choices per rank (K distinct experts of E, a fraction of the slots
// -1; experts split evenly over the global ranks, so node n holds experts [n * G * E / R, (n + 1) * G * E / R)).
// The same inputs go through host buffers and cuda buffers with every cuda allocation poisoned first; every element
// is compared: dispatch outputs bit for bit (real rows of recv_x / scales, all rows of the metadata), combine
// bit for bit too (the GPU adds in the host reference's order: fp32 partials per node by local rank ascending, then
// nodes ascending, bias_0, bias_1, one rounding). The seed is printed.
//
// HierarchicalNccl.TwoNodes runs the same comparison with one process per GPU on NCCL groups (2 nodes of 1 GPU, or
// of 2 with 4 GPUs); it skips with a message when fewer than 2 GPUs are visible.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>

#include "hierarchical_cases.h"
#include "testing/processes.h"

namespace epx::hierarchical_test {
namespace {

using testing::num_gpus;

const bool kCrashHandler = (testing::print_stack_on_crash(), true);

class HierarchicalGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (num_gpus() == 0) GTEST_SKIP() << "no GPU";
  }
};

TEST_F(HierarchicalGpuTest, TwoNodesOneGpuBf16) { run_and_compare(make_case(2, 1, {300, 200})); }

TEST_F(HierarchicalGpuTest, TwoNodesTwoGpusIdleRankAlignment) {
  Case c = make_case(4, 2, {512, 0, 300, 77});
  c.expert_alignment = 4;
  c.pass_layout = true;
  run_and_compare(c);
}

TEST_F(HierarchicalGpuTest, FourNodesOneGpu) {
  Case c = make_case(4, 1, {256, 1, 400, 130});
  c.hidden = 2048;
  c.topk_int32 = true;
  c.pass_layout = true;
  run_and_compare(c);
}

TEST_F(HierarchicalGpuTest, Fp8Scales) {
  for (const int gpn : {1, 2}) {
    for (const ScaleFormat f : {ScaleFormat::kFloat32, ScaleFormat::kUE8M0}) {
      for (const bool column_major : {false, true}) {
        SCOPED_TRACE("gpus_per_node " + std::to_string(gpn) + " ue8m0 " + std::to_string(f == ScaleFormat::kUE8M0) +
                     " column-major " + std::to_string(column_major));
        Case c = make_case(4, gpn, {300, 128, 0, 257});
        c.hidden = 2048;
        c.fp8 = true;
        c.scale_format = f;
        c.column_major_scales = column_major;
        c.cached = true;
        run_and_compare(c);
      }
    }
  }
}

TEST_F(HierarchicalGpuTest, WorstTokensFreshAndCached) {
  for (const int gpn : {1, 2}) {
    SCOPED_TRACE("gpus_per_node " + std::to_string(gpn));
    Case c = make_case(4, gpn, {200, 150, 0, 99});
    c.num_worst_tokens = 800;
    c.cached = true;
    run_and_compare(c);
  }
}

TEST_F(HierarchicalGpuTest, CachedNoWeightsNoBiases) {
  Case c = make_case(4, 2, {333, 222, 111, 64});
  c.weights = false;
  c.biases = false;
  c.cached = true;
  c.num_topk = 6;
  c.num_experts = 32;
  run_and_compare(c);
}

TEST_F(HierarchicalGpuTest, AllSlotsMaskedAndEmptyBatches) {
  Case c = make_case(4, 2, {64, 0, 0, 5});
  c.p_masked = 0.9;
  run_and_compare(c);
  run_and_compare(make_case(2, 1, {0, 0}));
}

// kHierarchical forced on one node: the network leg is a copy to itself, the node leg carries everything.
TEST_F(HierarchicalGpuTest, ForcedOnOneNode) {
  run_and_compare(make_case(2, 0, {300, 250}));
  Case c = make_case(4, 0, {100, 0, 200, 300});
  c.cached = true;
  run_and_compare(c);
}

// An invalid top-k entry on rank 1: kInvalidArgument there, kPeerFailure on the others; the buffers stay usable.
TEST_F(HierarchicalGpuTest, InvalidTopkFailsEveryRankAlike) {
  Case c = make_case(4, 2, {64, 64, 64, 64});
  auto groups = create_cuda_groups(std::vector<int>(4, 0), cuda_options(c));
  std::vector<ErrorCode> codes(4, ErrorCode::kInternal);
  std::vector<int64_t> rows(4, -1);
  run_host_ranks(groups, [&](int r, Group& g) {
    cudaSetDevice(0);
    cudaStream_t stream;
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    {
      BufferOptions options;
      options.normal_routing = NormalRouting::kHierarchical;
      auto buffer = Buffer::create(groups[r], options);
      std::mt19937 rng(r);
      auto topk = testing::random_distinct_topk(rng, 64, 4, 64);
      if (r == 1) topk[10 * 4 + 2] = 64;
      std::vector<uint16_t> x(64 * 256, 0);
      const Tensor xd = testing::upload(x, DType::kBFloat16, {64, 256}, g.device(), stream);
      Tensor td = testing::upload(topk, DType::kInt64, {64, 4}, g.device(), stream);
      DispatchArgs a;
      a.x = xd;
      a.topk_idx = td;
      a.num_experts = 64;
      a.stream = stream;
      try {
        buffer->dispatch(a);
      } catch (const Error& e) {
        codes[r] = e.code();
      }
      if (r == 1) topk[10 * 4 + 2] = 3;
      td = testing::upload(topk, DType::kInt64, {64, 4}, g.device(), stream);
      a.topk_idx = td;
      rows[r] = buffer->dispatch(a).recv_x.size(0);
      cudaStreamSynchronize(stream);
    }
    cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
  });
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(codes[r], r == 1 ? ErrorCode::kInvalidArgument : ErrorCode::kPeerFailure) << "rank " << r;
    EXPECT_GE(rows[r], 0) << "rank " << r;
  }
}

// ---- one process per GPU on NCCL groups ----------------------------------------------------------------------
// The parent re-executes this binary once per rank (a fork of a process that already used CUDA cannot use it):
// HierarchicalNcclChild.Rank runs only with EPX_HIER_RANK set. Rank 0 writes the NCCL id to a file the others read.

Case nccl_case(int num_ranks) {
  Case c = make_case(num_ranks, num_ranks / 2, std::vector<int64_t>(num_ranks, 0));
  for (int r = 0; r < num_ranks; ++r) c.tokens[r] = r == 1 ? 0 : 200 + 37 * r;  // rank 1 idle
  c.cached = true;
  return c;
}

TEST(HierarchicalNcclChild, Rank) {
  const char* rank_env = std::getenv("EPX_HIER_RANK");
  if (rank_env == nullptr) GTEST_SKIP() << "runs as a child of HierarchicalNccl.TwoNodes";
  const int rank = std::atoi(rank_env), num_ranks = std::atoi(std::getenv("EPX_HIER_RANKS"));
  const uint64_t seed = std::strtoull(std::getenv("EPX_HIER_SEED"), nullptr, 10);
  const std::string id_file = std::getenv("EPX_HIER_ID_FILE");
  std::vector<uint8_t> id;
  if (rank == 0) {
    id = nccl_unique_id();
    std::ofstream(id_file + ".tmp", std::ios::binary).write(reinterpret_cast<const char*>(id.data()), id.size());
    std::rename((id_file + ".tmp").c_str(), id_file.c_str());
  } else {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (true) {
      std::ifstream f(id_file, std::ios::binary);
      if (f) {
        id.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
        break;
      }
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "no NCCL id from rank 0";
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  const Case c = nccl_case(num_ranks);
  const auto in = make_inputs(c, seed);
  const auto want = run_case(c, in, host_groups(c), true);
  CudaGroupOptions options = cuda_options(c);
  std::shared_ptr<Group> group = create_cuda_group(id, rank, num_ranks, rank, options);
  ASSERT_EQ(group->topology().num_nodes, 2);
  const RankOutput got = run_rank(c, in[rank], group, false);
  compare_rank(c, want[rank], got);
  group->barrier();
}

TEST(HierarchicalNccl, TwoNodes) {
  const int gpus = num_gpus();
  if (gpus < 2) GTEST_SKIP() << "needs 2 GPUs (one process per GPU on NCCL groups), " << gpus << " visible";
  const int num_ranks = gpus >= 4 ? 4 : 2;
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + ", " + std::to_string(num_ranks) + " ranks as 2 nodes");
  const std::string id_file = "/tmp/epx_hier_nccl_id_" + std::to_string(getpid());
  std::remove(id_file.c_str());
  std::vector<pid_t> children;
  for (int r = 0; r < num_ranks; ++r) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      setenv("EPX_HIER_RANK", std::to_string(r).c_str(), 1);
      setenv("EPX_HIER_RANKS", std::to_string(num_ranks).c_str(), 1);
      setenv("EPX_HIER_SEED", std::to_string(seed).c_str(), 1);
      setenv("EPX_HIER_ID_FILE", id_file.c_str(), 1);
      execl("/proc/self/exe", "hierarchical_test", "--gtest_filter=HierarchicalNcclChild.Rank", nullptr);
      _exit(3);
    }
    children.push_back(pid);
  }
  const std::vector<int> statuses =
      testing::wait_children(children, std::chrono::steady_clock::now() + std::chrono::seconds(240));
  for (int r = 0; r < num_ranks; ++r) {
    const int status = statuses[r];
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "rank " << r << " failed (its output is above)";
  }
  std::remove(id_file.c_str());
}

}  // namespace
}  // namespace epx::hierarchical_test
