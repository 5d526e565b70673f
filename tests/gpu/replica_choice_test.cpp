// Replica choice on the GPU (issue 16): DeviceReplicaTable + the device choose_replicas pick exactly the slots
// the host choose_replicas picks, for every mode, int32 and int64 ids, -1 entries, several GPUs and token
// offsets, on random placements with redundant experts; ids outside [-1, num_logical) give -1.
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "epx/eplb/device_replicas.h"
#include "epx/eplb/expert_location.h"
#include "epx/error.h"
#include "testing/gpu_util.h"
#include "testing/routing.h"

namespace epx::eplb {
namespace {

using testing::num_gpus;


// Every layer a random placement (testing::random_phy2log).
ExpertLocation random_location(std::mt19937& rng, int layers, int logical, int physical, int gpus) {
  ExpertLocation loc = ExpertLocation::trivial(layers, logical, physical, gpus);
  for (int l = 0; l < layers; ++l) loc.set_layer(l, testing::random_phy2log(rng, logical, physical));
  return loc;
}

template <typename T>
std::vector<T> run_device(const DeviceReplicaTable& table, int layer, const std::vector<T>& ids, int num_topk, int gpu,
                          const ReplicaChoiceOptions& options, int64_t first_token, bool in_place) {
  const DType dtype = sizeof(T) == 8 ? DType::kInt64 : DType::kInt32;
  const int64_t rows = static_cast<int64_t>(ids.size()) / num_topk;
  const Device dev = table.device();
  Tensor in = Tensor::empty(dtype, {rows, num_topk}, dev);
  Tensor out = in_place ? in : Tensor::empty(dtype, {rows, num_topk}, dev);
  cudaMemcpy(in.data(), ids.data(), ids.size() * sizeof(T), cudaMemcpyHostToDevice);
  choose_replicas(table, layer, in, out, gpu, options, first_token);
  std::vector<T> got(ids.size());
  EXPECT_EQ(cudaMemcpy(got.data(), out.data(), got.size() * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return got;
}

TEST(DeviceReplicas, MatchTheHostChoiceInEveryMode) {
  if (num_gpus() == 0) GTEST_SKIP() << "no GPU";
  std::mt19937 rng(20261201);
  struct Shape {
    int layers, logical, physical, gpus;
  };
  for (const Shape s : {Shape{3, 16, 32, 4}, Shape{2, 256, 288, 8}, Shape{2, 64, 64, 2}, Shape{1, 8, 72, 9}}) {
    const ExpertLocation loc = random_location(rng, s.layers, s.logical, s.physical, s.gpus);
    const auto table = DeviceReplicaTable::upload(loc, Device::cuda(0));
    ASSERT_EQ(table->num_physical(), s.physical);
    for (const ReplicaChoice mode : {ReplicaChoice::kStatic, ReplicaChoice::kDynamic}) {
      for (const bool invariant : {false, true}) {
        for (int gpu = 0; gpu < s.gpus; gpu += std::max(1, s.gpus / 3)) {
          SCOPED_TRACE(fmt::format("E={} P={} gpus={} {} rank_invariant={} gpu={}", s.logical, s.physical, s.gpus,
                                   to_string(mode), invariant, gpu));
          const int K = 8, T = 333, layer = static_cast<int>(rng() % s.layers);
          const int64_t first_token = rng() % 5000;
          std::vector<int64_t> ids(static_cast<size_t>(T) * K);
          std::uniform_int_distribution<int64_t> any(0, s.logical - 1);
          for (auto& v : ids) v = rng() % 10 == 0 ? -1 : any(rng);
          ReplicaChoiceOptions o;
          o.mode = mode;
          o.rank_invariant = invariant;
          o.seed = rng();
          std::vector<int64_t> want(ids.size());
          choose_replicas(loc, layer, ids, K, want, gpu, o, first_token);
          EXPECT_EQ(run_device<int64_t>(*table, layer, ids, K, gpu, o, first_token, false), want);
          const std::vector<int32_t> ids32(ids.begin(), ids.end());
          const auto got32 = run_device<int32_t>(*table, layer, ids32, K, gpu, o, first_token, /*in_place=*/true);
          EXPECT_TRUE(std::equal(got32.begin(), got32.end(), want.begin())) << "int32 ids, in place";
        }
      }
    }
  }
}

TEST(DeviceReplicas, OutOfRangeIdsGiveMinusOneAndArgumentsAreChecked) {
  if (num_gpus() == 0) GTEST_SKIP() << "no GPU";
  std::mt19937 rng(7);
  const ExpertLocation loc = random_location(rng, 2, 8, 16, 2);
  const auto table = DeviceReplicaTable::upload(loc, Device::cuda(0));
  const std::vector<int64_t> ids = {3, 8, -1, -2, 1000, 0};
  const auto got = run_device<int64_t>(*table, 1, ids, 2, 1, {}, 0, false);
  EXPECT_GE(got[0], 0);
  EXPECT_EQ(got[1], -1);
  EXPECT_EQ(got[2], -1);
  EXPECT_EQ(got[3], -1);
  EXPECT_EQ(got[4], -1);
  EXPECT_GE(got[5], 0);
  Tensor in = Tensor::empty(DType::kInt64, {3, 2}, Device::cuda(0));
  Tensor out32 = Tensor::empty(DType::kInt32, {3, 2}, Device::cuda(0));
  auto code_of = [](auto&& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return e.code();
    }
    return static_cast<ErrorCode>(0);
  };
  EXPECT_EQ(code_of([&] { choose_replicas(*table, 2, in, in, 0, {}); }), ErrorCode::kInvalidArgument);  // layer
  EXPECT_EQ(code_of([&] { choose_replicas(*table, 0, in, in, 2, {}); }), ErrorCode::kInvalidArgument);  // gpu
  EXPECT_EQ(code_of([&] { choose_replicas(*table, 0, in, out32, 0, {}); }), ErrorCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] { choose_replicas(*table, 0, in, in, 0, {}, -1); }), ErrorCode::kInvalidArgument);
  std::vector<int64_t> host(6);
  EXPECT_EQ(code_of([&] {
              choose_replicas(*table, 0, TensorView::of(host.data(), DType::kInt64, {3, 2}), in, 0, {});
            }),
            ErrorCode::kInvalidArgument);  // topk_logical on the CPU
  EXPECT_EQ(code_of([&] { DeviceReplicaTable::upload(loc, Device::cpu()); }), ErrorCode::kInvalidArgument);
  cudaDeviceSynchronize();
}

}  // namespace
}  // namespace epx::eplb
