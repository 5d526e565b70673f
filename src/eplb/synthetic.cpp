#include "epx/eplb/synthetic.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/check.h"

namespace epx::eplb {

namespace {

void check_zipf(int num_layers, int num_logical, double exponent, double total) {
  EPX_CHECK_ARG(num_layers >= 1, "num_layers must be >= 1, got {}", num_layers);
  EPX_CHECK_ARG(num_logical >= 1, "num_logical must be >= 1, got {}", num_logical);
  EPX_CHECK_ARG(std::isfinite(exponent) && exponent >= 0, "exponent must be finite and >= 0, got {}", exponent);
  EPX_CHECK_ARG(std::isfinite(total) && total >= 0, "total load must be finite and >= 0, got {}", total);
}

std::vector<double> zipf_shares(int n, double exponent, double total) {
  std::vector<double> share(n);
  for (int k = 0; k < n; ++k) share[k] = std::pow(k + 1.0, -exponent);
  const double sum = std::accumulate(share.begin(), share.end(), 0.0);
  for (double& v : share) v *= total / sum;
  return share;
}

}  // namespace

std::vector<std::vector<double>> zipf_loads(int num_layers, int num_logical, double exponent, double total_per_layer,
                                            uint64_t seed) {
  check_zipf(num_layers, num_logical, exponent, total_per_layer);
  const auto share = zipf_shares(num_logical, exponent, total_per_layer);
  std::mt19937_64 rng(seed);
  std::vector<std::vector<double>> out(num_layers, std::vector<double>(num_logical));
  std::vector<int> order(num_logical);
  for (auto& row : out) {
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    for (int k = 0; k < num_logical; ++k) row[order[k]] = share[k];
  }
  return out;
}

DriftingZipf::DriftingZipf(int num_layers, int num_logical, double exponent, double tokens_per_step, double drift,
                           uint64_t seed)
    : num_layers_(num_layers), num_logical_(num_logical), drift_(drift), rng_(seed) {
  check_zipf(num_layers, num_logical, exponent, tokens_per_step);
  EPX_CHECK_ARG(drift >= 0 && drift <= 1, "drift must be in [0, 1], got {}", drift);
  share_ = zipf_shares(num_logical, exponent, tokens_per_step);
  order_.resize(static_cast<size_t>(num_layers) * num_logical);
  for (int l = 0; l < num_layers; ++l) {
    auto first = order_.begin() + static_cast<int64_t>(l) * num_logical;
    std::iota(first, first + num_logical, 0);
    std::shuffle(first, first + num_logical, rng_);
  }
}

std::vector<std::vector<double>> DriftingZipf::expected() const {
  std::vector<std::vector<double>> out(num_layers_, std::vector<double>(num_logical_));
  for (int l = 0; l < num_layers_; ++l) {
    for (int k = 0; k < num_logical_; ++k) out[l][order_[static_cast<int64_t>(l) * num_logical_ + k]] = share_[k];
  }
  return out;
}

std::vector<int64_t> DriftingZipf::sample() {
  std::normal_distribution<double> noise(0.0, 1.0);
  std::vector<int64_t> out(order_.size());
  for (int l = 0; l < num_layers_; ++l) {
    for (int k = 0; k < num_logical_; ++k) {
      const double mean = share_[k];
      const double v = std::round(mean + std::sqrt(mean) * noise(rng_));
      out[static_cast<int64_t>(l) * num_logical_ + order_[static_cast<int64_t>(l) * num_logical_ + k]] =
          static_cast<int64_t>(std::max(0.0, v));
    }
  }
  return out;
}

void DriftingZipf::advance() {
  if (drift_ <= 0) return;
  std::bernoulli_distribution flip(drift_);
  for (int l = 0; l < num_layers_; ++l) {
    int32_t* row = order_.data() + static_cast<int64_t>(l) * num_logical_;
    for (int k = 0; k + 1 < num_logical_; ++k) {
      if (flip(rng_)) std::swap(row[k], row[k + 1]);
    }
  }
}

}  // namespace epx::eplb
