// Synthetic expert loads for tests, benchmarks and `epx eplb simulate`: Zipf-distributed popularity
// with a random expert order per layer, optionally drifting over time.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace epx::eplb {

// load[l][e] = total_per_layer * (rank+1)^-exponent / sum_k (k+1)^-exponent, where rank is expert e's
// position in a random permutation drawn per layer from `seed`. Throws Error(kInvalidArgument) for
// num_layers < 1, num_logical < 1, exponent < 0 or not finite, total_per_layer < 0 or not finite.
std::vector<std::vector<double>> zipf_loads(int num_layers, int num_logical, double exponent, double total_per_layer,
                                            uint64_t seed);

// A drifting Zipf load: each layer keeps an order of its experts by popularity; every advance() swaps
// each adjacent pair of that order with probability `drift`, so hot experts cool down and cold ones
// heat up slowly. Deterministic for a seed.
class DriftingZipf {
 public:
  // tokens_per_step: routed (token, expert) pairs per layer per step (tokens * top-k). drift in [0, 1].
  DriftingZipf(int num_layers, int num_logical, double exponent, double tokens_per_step, double drift, uint64_t seed);

  // Expected load of each expert at the current step. [num_layers][num_logical]
  std::vector<std::vector<double>> expected() const;
  // Integer counts of one step: expected load plus Gaussian noise of the Poisson's spread, clamped at 0.
  // [num_layers * num_logical]
  std::vector<int64_t> sample();
  void advance();

 private:
  int num_layers_, num_logical_;
  double drift_;
  std::vector<double> share_;   // [num_logical] Zipf share of each popularity rank, times tokens
  std::vector<int32_t> order_;  // [num_layers * num_logical] expert at each popularity rank
  std::mt19937_64 rng_;
};

}  // namespace epx::eplb
