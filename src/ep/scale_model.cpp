#include "ep/scale_model.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "core/check.h"
#include "epx/routing.h"

namespace epx::scale_model {
namespace {

double log_choose(int64_t n, int64_t k) {
  return std::lgamma(static_cast<double>(n) + 1) - std::lgamma(static_cast<double>(k) + 1) -
         std::lgamma(static_cast<double>(n - k) + 1);
}

// C(U - a, K) / C(U, K): the chance that K distinct experts drawn from U miss the a of them in a block.
double miss_probability(int64_t num_choices, int64_t num_in_block, int num_topk) {
  double p = 1;
  for (int i = 0; i < num_topk; ++i) {
    const int64_t left = num_choices - num_in_block - i;
    if (left <= 0) return 0;
    p *= static_cast<double>(left) / static_cast<double>(num_choices - i);
  }
  return p;
}

// Groups overlapping the experts [lo, hi): how many lie inside, and the overlaps of the others (at most two: the
// groups holding lo and hi - 1).
struct BlockGroups {
  int64_t num_full = 0;
  std::vector<int64_t> partial;
};

BlockGroups block_groups(int64_t lo, int64_t hi, int64_t group_size) {
  BlockGroups out;
  for (int64_t g = lo / group_size; g <= (hi - 1) / group_size; ++g) {
    const int64_t overlap = std::min(hi, (g + 1) * group_size) - std::max(lo, g * group_size);
    if (overlap == group_size) {
      ++out.num_full;
    } else {
      out.partial.push_back(overlap);
    }
  }
  return out;
}

// P(a token reaches at least one expert of [lo, hi)).
double block_reached(int64_t lo, int64_t hi, const Shape& s) {
  const int64_t group_size = s.num_experts / s.num_groups;
  const int64_t num_choices = group_size * s.num_topk_groups;
  const BlockGroups b = block_groups(lo, hi, group_size);
  const int num_partial = static_cast<int>(b.partial.size());
  const int64_t num_other = s.num_groups - b.num_full - num_partial;
  const double log_all = log_choose(s.num_groups, s.num_topk_groups);
  double p = 0;
  for (int64_t j = 0; j <= b.num_full; ++j) {
    for (int mask = 0; mask < (1 << num_partial); ++mask) {
      int64_t picked = j;
      int64_t in_block = j * group_size;
      for (int q = 0; q < num_partial; ++q) {
        if (mask & (1 << q)) {
          ++picked;
          in_block += b.partial[q];
        }
      }
      const int64_t rest = s.num_topk_groups - picked;
      if (rest < 0 || rest > num_other) continue;
      // NOTE: which groups were picked, by hypergeometric counting: j of the full ones, exactly `mask` of the
      // partial ones, the rest among the others.
      const double weight = std::exp(log_choose(b.num_full, j) + log_choose(num_other, rest) - log_all);
      p += weight * (1 - miss_probability(num_choices, in_block, s.num_topk));
    }
  }
  return std::min(p, 1.0);
}

// Per-rank counts of one leg, turned into rows per token of a rank's batch.
LegRows leg_rows(const std::vector<double>& sent, const std::vector<double>& received, double tokens_per_rank) {
  LegRows out;
  double busiest = 0;
  for (size_t r = 0; r < sent.size(); ++r) busiest = std::max({busiest, sent[r], received[r]});
  out.busiest = busiest / tokens_per_rank;
  out.mean = std::accumulate(sent.begin(), sent.end(), 0.0) / static_cast<double>(sent.size()) / tokens_per_rank;
  return out;
}

}  // namespace

void check_shape(const Shape& s) {
  EPX_CHECK_ARG(s.num_nodes >= 1 && s.gpus_per_node >= 1, "num_nodes ({}) and gpus_per_node ({}) must be >= 1",
                s.num_nodes, s.gpus_per_node);
  const int64_t num_ranks = int64_t{s.num_nodes} * s.gpus_per_node;
  EPX_CHECK_ARG(num_ranks <= (1 << 16), "num_nodes x gpus_per_node = {} exceeds 2^16 ranks", num_ranks);
  EPX_CHECK_ARG(s.num_experts >= 1 && s.num_experts <= (1 << 20), "num_experts must be in [1, 2^20], got {}",
                s.num_experts);
  EPX_CHECK_ARG(s.num_experts % num_ranks == 0, "num_experts ({}) must be divisible by the {} ranks", s.num_experts,
                num_ranks);
  EPX_CHECK_ARG(s.num_groups >= 1 && s.num_experts % s.num_groups == 0,
                "num_groups ({}) must be >= 1 and divide num_experts ({})", s.num_groups, s.num_experts);
  EPX_CHECK_ARG(s.num_topk_groups >= 1 && s.num_topk_groups <= s.num_groups,
                "num_topk_groups must be in [1, num_groups = {}], got {}", s.num_groups, s.num_topk_groups);
  const int64_t num_choices = s.num_experts / s.num_groups * s.num_topk_groups;
  EPX_CHECK_ARG(s.num_topk >= 1 && s.num_topk <= num_choices,
                "num_topk must be in [1, num_topk_groups x num_experts / num_groups = {}], got {}", num_choices,
                s.num_topk);
}

RoutingStats routing_stats_exact(const Shape& s) {
  check_shape(s);
  const int N = s.num_nodes, G = s.gpus_per_node, R = N * G;
  const int64_t per_rank = s.num_experts / R;
  const int64_t group_size = s.num_experts / s.num_groups;
  const double num_choices = static_cast<double>(group_size * s.num_topk_groups);
  const double K = s.num_topk;
  std::vector<double> p_node(N), p_rank(R), slot_share(R);
  for (int n = 0; n < N; ++n) p_node[n] = block_reached(n * G * per_rank, (n + 1) * G * per_rank, s);
  for (int r = 0; r < R; ++r) {
    p_rank[r] = block_reached(r * per_rank, (r + 1) * per_rank, s);
    // P(one slot lands on rank r) = E[experts of r among the choices] / U; each group is picked with probability
    // topk_group / n_group, so this is 1 / R for any split; computed, not assumed.
    slot_share[r] = static_cast<double>(per_rank) * s.num_topk_groups / s.num_groups / num_choices;
  }
  RoutingStats out;
  out.nodes_per_token = std::accumulate(p_node.begin(), p_node.end(), 0.0);
  out.gpus_per_token = std::accumulate(p_rank.begin(), p_rank.end(), 0.0);

  // Counts per token of a rank's batch (tokens_per_rank = 1).
  std::vector<double> net_sent(R), net_recv(R), nvl_sent(R), nvl_recv(R), ll_net_sent(R), ll_net_recv(R),
      ll_nvl_sent(R), ll_nvl_recv(R);
  const double total_nodes = out.nodes_per_token;
  for (int r = 0; r < R; ++r) {
    const int m = r / G, l = r % G;
    net_sent[r] = total_nodes - p_node[m];
    net_recv[r] = (N - 1) * p_node[m];  // as forwarder (m, l): one record per token of each (n, l), n != m
    double others_in_node = 0, node_share = 0;
    for (int g = 0; g < G; ++g) {
      node_share += slot_share[m * G + g];
      if (g != l) others_in_node += p_rank[m * G + g];
    }
    nvl_sent[r] = N * others_in_node;  // forwarder for N sources (m', l)
    nvl_recv[r] = N * (G - 1) * p_rank[r];
    ll_net_sent[r] = K * (1 - node_share);
    ll_net_recv[r] = K * (R - G) * slot_share[r];
    ll_nvl_sent[r] = K * (node_share - slot_share[r]);
    ll_nvl_recv[r] = K * (G - 1) * slot_share[r];
  }
  out.network_rows = leg_rows(net_sent, net_recv, 1);
  out.nvlink_rows = leg_rows(nvl_sent, nvl_recv, 1);
  out.ll_network_pairs = leg_rows(ll_net_sent, ll_net_recv, 1);
  out.ll_nvlink_pairs = leg_rows(ll_nvl_sent, ll_nvl_recv, 1);

  // An upper bound: the topk_group groups touching the most nodes, at most one node per expert.
  std::vector<int> nodes_of_group(s.num_groups);
  const int64_t node_experts = G * per_rank;
  for (int g = 0; g < s.num_groups; ++g) {
    nodes_of_group[g] = static_cast<int>((g + 1) * group_size - 1) / static_cast<int>(node_experts) -
                        static_cast<int>(g * group_size / node_experts) + 1;
  }
  std::sort(nodes_of_group.rbegin(), nodes_of_group.rend());
  const int reach = std::accumulate(nodes_of_group.begin(), nodes_of_group.begin() + s.num_topk_groups, 0);
  out.max_nodes_per_token = std::min({reach, N, s.num_topk});
  return out;
}

RoutingStats routing_stats_monte_carlo(const Shape& s, int64_t num_tokens, uint64_t seed) {
  check_shape(s);
  EPX_CHECK_ARG(num_tokens >= 1 && num_tokens <= (int64_t{1} << 24), "num_tokens must be in [1, 2^24], got {}",
                num_tokens);
  const int N = s.num_nodes, G = s.gpus_per_node, R = N * G, K = s.num_topk;
  const int64_t per_rank = s.num_experts / R;
  const int64_t group_size = s.num_experts / s.num_groups;
  const int64_t num_choices = group_size * s.num_topk_groups;
  const int64_t tokens_per_rank = (num_tokens + R - 1) / R;
  const int64_t T = tokens_per_rank * R;

  // Draw: topk_group groups, then K distinct experts among theirs (partial Fisher-Yates on running permutations:
  // each prefix is a uniform draw whatever the permutation it starts from).
  std::mt19937_64 rng(seed);
  std::vector<int> groups(s.num_groups);
  std::iota(groups.begin(), groups.end(), 0);
  std::vector<int64_t> choices(num_choices);
  std::iota(choices.begin(), choices.end(), 0);
  std::vector<int64_t> topk(T * K);  // [T, K]
  for (int64_t t = 0; t < T; ++t) {
    for (int i = 0; i < s.num_topk_groups; ++i) {
      std::uniform_int_distribution<int> pick(i, s.num_groups - 1);
      std::swap(groups[i], groups[pick(rng)]);
    }
    for (int k = 0; k < K; ++k) {
      std::uniform_int_distribution<int64_t> pick(k, num_choices - 1);
      std::swap(choices[k], choices[pick(rng)]);
      const int64_t c = choices[k];
      topk[t * K + k] = groups[c / group_size] * group_size + c % group_size;
    }
  }
  const HostLayout layout = compute_layout_host(TensorView::of(topk.data(), DType::kInt64, {T, K}), s.num_experts, R);

  std::vector<double> net_sent(R), net_recv(R), nvl_sent(R), nvl_recv(R), ll_net_sent(R), ll_net_recv(R),
      ll_nvl_sent(R), ll_nvl_recv(R);
  RoutingStats out;
  double nodes = 0, gpus = 0;
  for (int64_t t = 0; t < T; ++t) {
    const int src = static_cast<int>(t % R), m = src / G, l = src % G;
    const uint8_t* in_rank = layout.is_token_in_rank.data() + t * R;  // [R]
    int token_nodes = 0;
    for (int n = 0; n < N; ++n) {
      const uint8_t* node = in_rank + n * G;
      if (std::none_of(node, node + G, [](uint8_t v) { return v != 0; })) continue;
      ++token_nodes;
      const int landing = n * G + l;
      if (n != m) {
        ++net_sent[src];
        ++net_recv[landing];
      }
      for (int g = 0; g < G; ++g) {
        if (!node[g]) continue;
        ++gpus;
        if (g == l) continue;
        ++nvl_sent[landing];
        ++nvl_recv[n * G + g];
      }
    }
    nodes += token_nodes;
    out.max_nodes_per_token = std::max(out.max_nodes_per_token, token_nodes);
    for (int k = 0; k < K; ++k) {
      const int dst = static_cast<int>(topk[t * K + k] / per_rank);
      if (dst / G != m) {
        ++ll_net_sent[src];
        ++ll_net_recv[dst];
      } else if (dst != src) {
        ++ll_nvl_sent[src];
        ++ll_nvl_recv[dst];
      }
    }
  }
  out.nodes_per_token = nodes / static_cast<double>(T);
  out.gpus_per_token = gpus / static_cast<double>(T);
  const double tpr = static_cast<double>(tokens_per_rank);
  out.network_rows = leg_rows(net_sent, net_recv, tpr);
  out.nvlink_rows = leg_rows(nvl_sent, nvl_recv, tpr);
  out.ll_network_pairs = leg_rows(ll_net_sent, ll_net_recv, tpr);
  out.ll_nvlink_pairs = leg_rows(ll_nvl_sent, ll_nvl_recv, tpr);
  return out;
}

PhaseTime normal_time(const RoutingStats& stats, int num_nodes, int64_t num_tokens, double row_bytes,
                      const Links& links, double network_row_bytes) {
  const double T = static_cast<double>(num_tokens);
  PhaseTime out;
  out.network_bytes = T * stats.network_rows.busiest * (network_row_bytes > 0 ? network_row_bytes : row_bytes);
  out.nvlink_bytes = T * stats.nvlink_rows.busiest * row_bytes;
  out.network_us = out.network_bytes / (links.network_gbps * 1e3);  // GB/s = 1e3 bytes/us
  out.nvlink_us = out.nvlink_bytes / (links.nvlink_gbps * 1e3);
  if (num_nodes == 1 || out.network_bytes == 0) {
    out.time_us = out.nvlink_us;
    return out;
  }
  const double rows_per_message = T * stats.network_rows.busiest / (num_nodes - 1);
  const double num_chunks = std::max(1.0, std::ceil(rows_per_message / static_cast<double>(links.chunk_tokens)));
  out.time_us =
      links.latency_us + std::max(out.network_us, out.nvlink_us) + std::min(out.network_us, out.nvlink_us) / num_chunks;
  return out;
}

PhaseTime low_latency_time(const RoutingStats& stats, int num_nodes, int64_t num_tokens, double row_bytes,
                           const Links& links) {
  const double T = static_cast<double>(num_tokens);
  PhaseTime out;
  out.network_bytes = T * stats.ll_network_pairs.busiest * row_bytes;
  out.nvlink_bytes = T * stats.ll_nvlink_pairs.busiest * row_bytes;
  out.network_us = out.network_bytes / (links.network_gbps * 1e3);
  out.nvlink_us = out.nvlink_bytes / (links.nvlink_gbps * 1e3);
  const double network = num_nodes > 1 && out.network_bytes > 0 ? links.latency_us + out.network_us : 0;
  out.time_us = std::max(network, out.nvlink_us);
  return out;
}

}  // namespace epx::scale_model
