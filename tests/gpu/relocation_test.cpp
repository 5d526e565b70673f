// EPLB weight relocation on GPUs (issue 16): expert weights encoded with their logical id move to random new
// placements (including 256 -> 288 physical experts and 4 ranks on the GPUs there are), checked slot by slot
// against a poisoned destination.
// - cuda transport, ranks as threads: staging smaller than one slot (and not a multiple of 4) forces windows that
//   cut messages anywhere; a larger case prints the bytes moved per second.
// - nccl transport, one process per GPU (2 GPUs; on one, both ranks share it as NCCL hosts of their own): the parent
//   re-executes this binary once per rank (nccl_children.h, as the hierarchical NCCL-group tests do); each process
//   relocates the same random cases (same seed, so the same plans) over make_nccl_transport, in place and not,
//   checks a mismatched round fails on both ranks before any data moves, and runs one case over the transport
//   choose_transport picks.
#include "epx/eplb/relocation.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "epx/cuda.h"
#include "epx/error.h"
#include "nccl_children.h"
#include "testing/gpu_util.h"
#include "testing/routing.h"

namespace epx::eplb {
namespace {

using testing::num_gpus;
using testing::random_phy2log;

// Word i of tensor t of logical expert e: distinct for every (e, t) as long as e < 2^16.
uint32_t word(int32_t expert, int tensor, size_t i) {
  return (static_cast<uint32_t>(expert) << 16) ^ (static_cast<uint32_t>(tensor) << 12) ^
         static_cast<uint32_t>(i & 0xfff);
}

struct Case {
  int ranks, logical, old_per_rank, new_per_rank;
  std::vector<size_t> bytes;  // per tensor, per slot (multiples of 4)
  size_t staging;
  int max_slots_per_round;
};

struct RankResult {
  int64_t bad_words = 0;
  int64_t bytes_received = 0;
  double seconds = 0;
  std::string error;
};

using TransportFactory = std::function<std::unique_ptr<WeightTransport>()>;

// Rank r's part of case c on the current device: its old slots hold the words of their experts, the new ones are
// poisoned (in place: the old buffers are relocated onto themselves, which needs equal slot counts); relocates over
// the transport make_transport returns and checks every word of every new slot.
RankResult relocate_rank(const Case& c, const RelocationPlan& plan, const std::vector<int32_t>& old_p2l,
                         const std::vector<int32_t>& new_p2l, int r, Group& group, bool in_place,
                         const TransportFactory& make_transport) {
  RankResult out;
  std::vector<void*> allocations;
  std::vector<void*> new_bufs;
  try {
    ExpertWeights w;
    for (size_t t = 0; t < c.bytes.size(); ++t) {
      const size_t words = c.bytes[t] / 4;
      std::vector<uint32_t> host(words * c.old_per_rank);
      for (int s = 0; s < c.old_per_rank; ++s) {
        for (size_t i = 0; i < words; ++i) host[s * words + i] = word(old_p2l[r * c.old_per_rank + s], int(t), i);
      }
      void* o = nullptr;
      EXPECT_EQ(cudaMalloc(&o, host.size() * 4), cudaSuccess);
      allocations.push_back(o);
      cudaMemcpy(o, host.data(), host.size() * 4, cudaMemcpyHostToDevice);
      void* n = o;
      if (!in_place) {
        EXPECT_EQ(cudaMalloc(&n, c.bytes[t] * c.new_per_rank), cudaSuccess);
        allocations.push_back(n);
        testing::poison(n, c.bytes[t] * c.new_per_rank, nullptr);
      }
      new_bufs.push_back(n);
      w.old_slots.push_back(o);
      w.new_slots.push_back(n);
      w.bytes_per_slot.push_back(c.bytes[t]);
    }
    cudaDeviceSynchronize();
    auto transport = make_transport();
    group.barrier();
    const auto start = std::chrono::steady_clock::now();
    const RelocationStats stats = relocate_weights(plan, w, *transport, {c.max_slots_per_round});
    group.barrier();
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    out.bytes_received = stats.bytes_received;
    for (size_t t = 0; t < c.bytes.size(); ++t) {
      const size_t words = c.bytes[t] / 4;
      std::vector<uint32_t> got(words * c.new_per_rank);
      cudaMemcpy(got.data(), new_bufs[t], got.size() * 4, cudaMemcpyDeviceToHost);
      for (int s = 0; s < c.new_per_rank; ++s) {
        const int32_t e = new_p2l[r * c.new_per_rank + s];
        for (size_t i = 0; i < words; ++i) out.bad_words += got[s * words + i] != word(e, int(t), i);
      }
    }
  } catch (const std::exception& e) {
    out.error = e.what();
  }
  for (void* p : allocations) cudaFree(p);
  return out;
}

std::vector<RankResult> run_case(const Case& c, std::mt19937& rng) {
  const int gpus = num_gpus();
  std::vector<int> devices(c.ranks);
  for (int r = 0; r < c.ranks; ++r) devices[r] = r % gpus;
  const auto old_p2l = random_phy2log(rng, c.logical, c.ranks * c.old_per_rank);
  const auto new_p2l = random_phy2log(rng, c.logical, c.ranks * c.new_per_rank);
  const RelocationPlan plan = plan_relocation(old_p2l, new_p2l, c.ranks, 1);
  auto groups = create_cuda_groups(devices);
  std::vector<RankResult> results(c.ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < c.ranks; ++r) {
    threads.emplace_back([&, r] {
      cudaSetDevice(devices[r]);
      results[r] = relocate_rank(c, plan, old_p2l, new_p2l, r, *groups[r], /*in_place=*/false,
                                 [&] { return make_cuda_transport(*groups[r], c.staging); });
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

TEST(CudaRelocation, RandomRemapsLandSlotBySlot) {
  if (num_gpus() == 0) GTEST_SKIP() << "no GPU";
  std::mt19937 rng(20261201);
  const std::vector<Case> cases = {
      {2, 256, 128, 144, {4096, 1024}, 64 << 20, 8},  // 256 -> 288 physical experts
      {2, 16, 8, 8, {4000, 12}, 4093, 3},             // windows smaller than a slot, cut anywhere
      {4, 64, 16, 18, {2048, 512, 4}, 1 << 20, 4},    // 4 ranks on the GPUs there are
      {4, 32, 8, 8, {1024}, 1 << 16, 1},              // one slot per round
      {1, 8, 8, 10, {256}, 4096, 8},                  // one rank: local copies only
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("R={} logical={} slots {} -> {} staging {}", c.ranks, c.logical, c.old_per_rank,
                             c.new_per_rank, c.staging));
    const auto results = run_case(c, rng);
    for (int r = 0; r < c.ranks; ++r) {
      EXPECT_EQ(results[r].error, "") << "rank " << r;
      EXPECT_EQ(results[r].bad_words, 0) << "rank " << r;
    }
  }
}

TEST(CudaRelocation, BadArgumentsNameTheBound) {
  if (num_gpus() == 0) GTEST_SKIP() << "no GPU";
  auto groups = create_cuda_groups({0});
  try {
    make_cuda_transport(*groups[0], 0);
    ADD_FAILURE() << "staging_bytes 0 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("staging_bytes"), std::string::npos) << e.what();
  }
}

// DeepSeek-V3-like layer: 256 -> 288 experts on 2 ranks, 3 tensors of ~14.7 MB per expert in total scaled down to
// 4 MB per slot so the case fits any GPU; prints what moved and how fast (peer copies through the staging).
TEST(CudaRelocation, Throughput) {
  if (num_gpus() == 0) GTEST_SKIP() << "no GPU";
  std::mt19937 rng(7);
  const Case c{2, 256, 128, 144, {size_t{3} << 20, size_t{1} << 20}, size_t{256} << 20, 16};
  const auto results = run_case(c, rng);
  double slowest = 0;
  int64_t received = 0;
  for (const RankResult& r : results) {
    EXPECT_EQ(r.error, "");
    EXPECT_EQ(r.bad_words, 0);
    slowest = std::max(slowest, r.seconds);
    received += r.bytes_received;
  }
  std::printf(
      "[relocation] %d ranks on %d GPU(s): %.1f MB received in %.1f ms = %.1f GB/s (all ranks, slowest rank's "
      "time)\n",
      c.ranks, std::min(num_gpus(), c.ranks), received / 1e6, slowest * 1e3, received / slowest / 1e9);
}

// ---- the nccl transport, one process per GPU ----------------------------------------------------------------

constexpr int kProcessRanks = 2;
constexpr const char* kEnvPrefix = "EPX_RELOCATION_TEST";  // the children's environment (nccl_children.h)
constexpr uint64_t kProcessSeed = 20261202;

// One rank's process (started by NcclRelocation.OneProcessPerGpu below through nccl_children.h).
TEST(NcclRelocationChild, Rank) {
  const std::optional<testing::NcclChild> child = testing::nccl_child(kEnvPrefix);
  if (!child) GTEST_SKIP() << "runs as a child of NcclRelocation.OneProcessPerGpu";
  const testing::NcclChildPass pass(*child);
  const int rank = child->rank;
  ASSERT_EQ(child->num_ranks, kProcessRanks);
  ASSERT_EQ(cudaSetDevice(child->device), cudaSuccess);
  const std::vector<uint8_t> id = testing::shared_nccl_id(rank, child->id_file);
  ASSERT_FALSE(id.empty()) << "no NCCL id from rank 0";
  CudaGroupOptions options;
  options.timeout_ms = 30'000;
  auto group = create_cuda_group(id, rank, kProcessRanks, child->device, options);

  // The same seed in every process: the same placements and plans.
  std::mt19937 rng(child->seed);
  struct ProcessCase {
    Case c;
    bool in_place;
  };
  const std::vector<ProcessCase> cases = {
      {{2, 256, 128, 144, {4096, 1024}, 0, 8}, false},  // 256 -> 288 physical experts
      {{2, 16, 8, 8, {4000, 12}, 0, 3}, false},         // odd sizes, 3 slots per round
      {{2, 16, 8, 8, {1024}, 0, 1}, false},             // one slot per round
      {{2, 32, 16, 16, {2048, 4}, 0, 8}, true},         // in place: every changed slot in one round
  };
  for (const ProcessCase& pc : cases) {
    const Case& c = pc.c;
    SCOPED_TRACE(fmt::format("rank {}: logical={} slots {} -> {} in_place={}", rank, c.logical, c.old_per_rank,
                             c.new_per_rank, pc.in_place));
    std::printf("[relocation] rank %d: logical=%d slots %d -> %d in_place=%d\n", rank, c.logical, c.old_per_rank,
                c.new_per_rank, pc.in_place ? 1 : 0);
    std::fflush(stdout);
    const auto old_p2l = random_phy2log(rng, c.logical, c.ranks * c.old_per_rank);
    const auto new_p2l = random_phy2log(rng, c.logical, c.ranks * c.new_per_rank);
    const RelocationPlan plan = plan_relocation(old_p2l, new_p2l, c.ranks, /*num_nodes=*/2);
    const RankResult result = relocate_rank(c, plan, old_p2l, new_p2l, rank, *group, pc.in_place,
                                            [&] { return make_nccl_transport(*group); });
    EXPECT_EQ(result.error, "");
    EXPECT_EQ(result.bad_words, 0);
  }

  // A mismatched round (rank 0 sends two messages of 8 bytes, rank 1 expects one of 16; the totals agree): the
  // same kInternal on both ranks before any data moves, and the transport still works afterwards.
  auto transport = make_nccl_transport(*group);
  void* buf = transport->allocate_temp(16);
  std::vector<SendOp> sends;
  std::vector<RecvOp> recvs;
  if (rank == 0) {
    sends = {{1, buf, 8}, {1, static_cast<char*>(buf) + 8, 8}};
  } else {
    recvs = {{0, buf, 16}};
  }
  try {
    transport->exchange(sends, recvs);
    ADD_FAILURE() << "rank " << rank << ": a mismatched round was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInternal) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 0 sends rank 1 2 messages of 16 bytes in all, which expects 1"),
              std::string::npos)
        << e.what();
  }
  const std::vector<uint32_t> sent = {11, 22, 33, 44};
  std::vector<uint32_t> got(4, 0);
  sends.clear();
  recvs.clear();
  if (rank == 0) {
    cudaMemcpy(buf, sent.data(), 16, cudaMemcpyHostToDevice);
    sends = {{1, buf, 16}};
  } else {
    testing::poison(buf, 16, nullptr);
    cudaDeviceSynchronize();
    recvs = {{0, buf, 16}};
  }
  transport->exchange(sends, recvs);
  if (rank == 1) {
    cudaMemcpy(got.data(), buf, 16, cudaMemcpyDeviceToHost);
    EXPECT_EQ(got, sent);
  }
  transport->free_temp(buf);
  transport.reset();

  // The automatic choice: both ranks get the same answer (cuda on one host with peer access, else nccl) and it
  // relocates.
  const TransportKind kind = choose_transport(*group);
  EXPECT_TRUE(kind == TransportKind::kCuda || kind == TransportKind::kNccl) << to_string(kind);
  std::vector<uint8_t> kinds(kProcessRanks);
  const uint8_t mine = static_cast<uint8_t>(kind);
  group->all_gather_bytes(&mine, kinds.data(), 1);
  EXPECT_EQ(kinds[0], kinds[1]);
  std::printf("[relocation] rank %d: choose_transport picks %s\n", rank, to_string(kind));
  const Case c{2, 32, 16, 18, {2048, 512}, 0, 4};  // 32 -> 36 physical experts
  const auto old_p2l = random_phy2log(rng, c.logical, c.ranks * c.old_per_rank);
  const auto new_p2l = random_phy2log(rng, c.logical, c.ranks * c.new_per_rank);
  const RelocationPlan plan = plan_relocation(old_p2l, new_p2l, c.ranks, 1);
  const RankResult result = relocate_rank(c, plan, old_p2l, new_p2l, rank, *group, false,
                                          [&] { return make_transport_for(*group, TransportKind::kAuto, 1 << 20); });
  EXPECT_EQ(result.error, "");
  EXPECT_EQ(result.bad_words, 0);
  group->barrier();
}

TEST(NcclRelocation, OneProcessPerGpu) {
  if (num_gpus() == 0) GTEST_SKIP() << "no GPU";
  testing::run_nccl_children(kProcessRanks, kProcessSeed, "NcclRelocationChild", "Rank", kEnvPrefix);
}

}  // namespace
}  // namespace epx::eplb
