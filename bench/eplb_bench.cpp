// EPLB benchmarks: placement speed of each policy on the DeepSeek-V3 shape and smaller ones, plus the
// quality numbers of docs/eplb.md as counters (balancedness averaged over seeds, moved experts).
//
//   BM_Rebalance/<policy>/<shape>      time of one rebalance() on a Zipf(1.0) load; counter balancedness
//   BM_Balance/<policy>/<shape>/<s*100> one iteration; counters: balancedness (mean over kSeeds seeds),
//                                      trivial (balancedness of the trivial placement)
//   BM_Migration/<shape>/<s*100>       time of rebalance_migration_aware after drift; counters: moved,
//                                      fresh_moved, balancedness, fresh_balancedness, loss_points
// policy: 0 = deepseek, 1 = default. Shapes are listed in kShapes.
#include <benchmark/benchmark.h>

#include <vector>

#include "epx/eplb/placement.h"
#include "epx/eplb/synthetic.h"

namespace {

using namespace epx::eplb;

struct Shape {
  const char* name;
  int num_layers, num_logical;
  PlacementShape placement;
};

const Shape kShapes[] = {
    {"deepseek-v3", 61, 256, {288, 8, 4, 32}},  // 61 layers, 256 -> 288, 8 groups, 4 nodes, 32 GPUs
    {"128e-2n", 32, 128, {144, 8, 2, 16}},      // 128 -> 144, 8 groups, 2 nodes, 16 GPUs
    {"64e-1n", 16, 64, {72, 4, 1, 8}},          // 64 -> 72, 4 groups, 1 node, 8 GPUs
    {"64e-global", 16, 64, {80, 3, 2, 8}},      // 3 groups do not divide over 2 nodes: global policy
};
constexpr int kSeeds = 8;
constexpr double kTokens = 4096.0 * 8;  // (token, expert) pairs per layer

Policy policy_of(int64_t i) { return i == 0 ? Policy::kDeepSeek : Policy::kDefault; }

void BM_Rebalance(benchmark::State& state) {
  const Shape& shape = kShapes[state.range(1)];
  const auto weight = zipf_loads(shape.num_layers, shape.num_logical, 1.0, kTokens, 7);
  const Policy policy = policy_of(state.range(0));
  std::vector<int32_t> last;
  for (auto _ : state) {
    const Placement p = rebalance(weight, shape.placement, policy);
    benchmark::DoNotOptimize(p.phy2log.data());
    last = p.phy2log;
  }
  state.counters["balancedness"] = balancedness(weight, last, shape.placement.num_physical, shape.placement.num_gpus);
  state.SetLabel(std::string(to_string(policy)) + " " + shape.name);
}

void BM_Balance(benchmark::State& state) {
  const Shape& shape = kShapes[state.range(1)];
  const double exponent = state.range(2) / 100.0;
  const Policy policy = policy_of(state.range(0));
  double sum = 0, trivial_sum = 0;
  for (auto _ : state) {
    sum = trivial_sum = 0;
    for (int seed = 0; seed < kSeeds; ++seed) {
      const auto weight = zipf_loads(shape.num_layers, shape.num_logical, exponent, kTokens, 1000 + seed);
      const Placement p = rebalance(weight, shape.placement, policy);
      sum += balancedness(weight, p.phy2log, shape.placement.num_physical, shape.placement.num_gpus);
      trivial_sum +=
          balancedness(weight, trivial_phy2log(shape.num_layers, shape.num_logical, shape.placement.num_physical),
                       shape.placement.num_physical, shape.placement.num_gpus);
    }
  }
  state.counters["balancedness"] = sum / kSeeds;
  state.counters["trivial"] = trivial_sum / kSeeds;
  state.SetLabel(std::string(to_string(policy)) + " " + shape.name + " s=" + std::to_string(exponent));
}

void BM_Migration(benchmark::State& state) {
  const Shape& shape = kShapes[state.range(0)];
  const double exponent = state.range(1) / 100.0;
  // The current placement fits the load of 200 drift steps ago.
  DriftingZipf load(shape.num_layers, shape.num_logical, exponent, kTokens, 0.02, 11);
  const Placement current = rebalance(load.expected(), shape.placement, Policy::kDefault);
  for (int i = 0; i < 200; ++i) load.advance();
  const auto weight = load.expected();
  MigrationResult r;
  for (auto _ : state) {
    r = rebalance_migration_aware(weight, shape.placement, current.phy2log);
    benchmark::DoNotOptimize(r.placement.phy2log.data());
  }
  const double bal = balancedness(weight, r.placement.phy2log, shape.placement.num_physical, shape.placement.num_gpus);
  state.counters["moved"] = static_cast<double>(r.moved_experts);
  state.counters["fresh_moved"] = static_cast<double>(r.fresh_moved_experts);
  state.counters["balancedness"] = bal;
  state.counters["fresh_balancedness"] = r.fresh_balancedness;
  state.counters["stale_balancedness"] =
      balancedness(weight, current.phy2log, shape.placement.num_physical, shape.placement.num_gpus);
  state.counters["loss_points"] = 100 * (r.fresh_balancedness - bal);
  state.SetLabel(std::string(shape.name) + " s=" + std::to_string(exponent));
}

BENCHMARK(BM_Rebalance)->ArgsProduct({{0, 1}, {0, 1, 2, 3}})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Balance)
    ->ArgsProduct({{0, 1}, {0, 1, 2, 3}, {50, 80, 100, 120, 150}})
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Migration)->ArgsProduct({{0, 1, 2, 3}, {80, 100, 120}})->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
