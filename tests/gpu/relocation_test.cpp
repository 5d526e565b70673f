// EPLB weight relocation on GPUs over the cuda transport (issue 16): expert weights encoded with their logical
// id move to random new placements (including 256 -> 288 physical experts and 4 ranks on the GPUs there are),
// checked slot by slot against a poisoned destination; staging smaller than one slot (and not a multiple of 4)
// forces windows that cut messages anywhere; a larger case prints the bytes moved per second.
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "epx/cuda.h"
#include "epx/eplb/relocation.h"
#include "epx/error.h"
#include "testing/gpu_util.h"
#include "testing/routing.h"

namespace epx::eplb {
namespace {

using testing::num_gpus;
using testing::random_phy2log;


// Word i of tensor t of logical expert e: distinct for every (e, t) as long as e < 2^16.
uint32_t word(int32_t expert, int tensor, size_t i) {
  return (static_cast<uint32_t>(expert) << 16) ^ (static_cast<uint32_t>(tensor) << 12) ^ static_cast<uint32_t>(i & 0xfff);
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
      RankResult& out = results[r];
      cudaSetDevice(devices[r]);
      std::vector<void*> old_bufs, new_bufs;
      try {
        ExpertWeights w;
        for (size_t t = 0; t < c.bytes.size(); ++t) {
          const size_t words = c.bytes[t] / 4;
          std::vector<uint32_t> host(words * c.old_per_rank);
          for (int s = 0; s < c.old_per_rank; ++s) {
            for (size_t i = 0; i < words; ++i) host[s * words + i] = word(old_p2l[r * c.old_per_rank + s], int(t), i);
          }
          void *o = nullptr, *n = nullptr;
          EXPECT_EQ(cudaMalloc(&o, host.size() * 4), cudaSuccess);
          EXPECT_EQ(cudaMalloc(&n, c.bytes[t] * c.new_per_rank), cudaSuccess);
          cudaMemcpy(o, host.data(), host.size() * 4, cudaMemcpyHostToDevice);
          testing::poison(n, c.bytes[t] * c.new_per_rank, nullptr);
          old_bufs.push_back(o);
          new_bufs.push_back(n);
          w.old_slots.push_back(o);
          w.new_slots.push_back(n);
          w.bytes_per_slot.push_back(c.bytes[t]);
        }
        cudaDeviceSynchronize();
        auto transport = make_cuda_transport(*groups[r], c.staging);
        groups[r]->barrier();
        const auto start = std::chrono::steady_clock::now();
        const RelocationStats stats = relocate_weights(plan, w, *transport, {c.max_slots_per_round});
        groups[r]->barrier();
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
      for (void* p : old_bufs) cudaFree(p);
      for (void* p : new_bufs) cudaFree(p);
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

TEST(CudaRelocation, RandomRemapsLandSlotBySlot) {
  if (num_gpus() == 0) GTEST_SKIP() << "no GPU";
  std::mt19937 rng(20261201);
  const std::vector<Case> cases = {
      {2, 256, 128, 144, {4096, 1024}, 64 << 20, 8},   // 256 -> 288 physical experts
      {2, 16, 8, 8, {4000, 12}, 4093, 3},              // windows smaller than a slot, cut anywhere
      {4, 64, 16, 18, {2048, 512, 4}, 1 << 20, 4},     // 4 ranks on the GPUs there are
      {4, 32, 8, 8, {1024}, 1 << 16, 1},               // one slot per round
      {1, 8, 8, 10, {256}, 4096, 8},                   // one rank: local copies only
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
  std::printf("[relocation] %d ranks on %d GPU(s): %.1f MB received in %.1f ms = %.1f GB/s (all ranks, slowest rank's "
              "time)\n",
              c.ranks, std::min(num_gpus(), c.ranks), received / 1e6, slowest * 1e3, received / slowest / 1e9);
}

}  // namespace
}  // namespace epx::eplb
