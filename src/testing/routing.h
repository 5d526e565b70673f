// Random inputs shared by the GPU tests (tests/gpu) and the benchmark drivers (tools/cuda, tools/cmd_bench.cpp):
// seeds, top-k routing and expert placements. Host only; headers only (src/testing is not compiled into the
// library). Every function draws from the caller's engine in a fixed order, so a seed replays the same inputs.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace epx::testing {

// A new seed per call (printed by the tests that use it, so a failure can be replayed).
inline uint64_t fresh_seed() {
  static std::atomic<uint64_t> counter{0};
  return std::random_device{}() * 1000003ull + counter++;
}

// [num_tokens, num_topk] expert ids: per token, num_topk distinct experts uniform over [0, num_experts) (repeats
// allowed only when num_topk > num_experts), drawn by rejection in slot order; then, when p_masked > 0, each slot
// of that token is set to -1 with probability p_masked before the next token is drawn. p_masked = 0 draws nothing
// for the mask (the benchmarks' routing).
template <typename Rng>
std::vector<int64_t> random_distinct_topk(Rng& rng, int64_t num_tokens, int num_topk, int64_t num_experts,
                                          double p_masked = 0.0) {
  std::uniform_int_distribution<int64_t> expert(0, num_experts - 1);
  std::bernoulli_distribution masked(p_masked);
  const int64_t K = num_topk;
  std::vector<int64_t> topk(num_tokens * K);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const auto row = topk.begin() + t * K;
    for (int64_t k = 0; k < K; ++k) {
      int64_t e;
      bool fresh;
      do {
        e = expert(rng);
        fresh = std::find(row, row + k, e) == row + k;
      } while (!fresh && K <= num_experts);
      row[k] = e;
    }
    if (p_masked > 0) {
      for (int64_t k = 0; k < K; ++k) {
        if (masked(rng)) row[k] = -1;
      }
    }
  }
  return topk;
}

// [num_physical] logical expert of each physical slot: every logical expert at least once, the other slots
// uniform random replicas, then the whole placement shuffled. num_physical >= num_logical >= 1, else throws (a test case
// with fewer slots than experts once wrote past the vector: NcclRelocation's heap corruption, nineteenth session).
template <typename Rng>
std::vector<int32_t> random_phy2log(Rng& rng, int num_logical, int num_physical) {
  if (num_logical < 1 || num_physical < num_logical) {
    throw std::invalid_argument("random_phy2log: needs num_physical >= num_logical >= 1, got " +
                                std::to_string(num_physical) + " physical for " + std::to_string(num_logical) +
                                " logical experts");
  }
  std::vector<int32_t> p2l(num_physical);
  std::iota(p2l.begin(), p2l.begin() + num_logical, 0);
  std::uniform_int_distribution<int32_t> any(0, num_logical - 1);
  for (int s = num_logical; s < num_physical; ++s) p2l[s] = any(rng);
  std::shuffle(p2l.begin(), p2l.end(), rng);
  return p2l;
}

}  // namespace epx::testing
