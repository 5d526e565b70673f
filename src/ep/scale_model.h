// The scale model of issue 17 (`epx bench --model`, docs/internode.md "Scale model"): predicted dispatch and
// combine times of N nodes x G GPUs from the routing statistics of group-limited top-k routing. Host-only
// arithmetic; nothing here touches a GPU or a group.
//
// Routing (DeepSeek-V3's group-limited gate, with uniform scores): the E experts are split into n_group
// contiguous groups of E / n_group; a token picks topk_group of the groups uniformly at random, then top_k distinct
// experts uniformly among the experts of those groups. Experts are split over the ranks as everywhere in epx
// (expert e on rank e / (E / R), ranks node-major), so when n_group is a multiple of N each group lies on one node
// and a token reaches at most topk_group nodes; otherwise groups straddle node boundaries (EP72: 8 groups of 36
// over 9 nodes of 32 experts) and a token may reach up to 2 x topk_group nodes.
//
// Traffic, per batch of T tokens on every rank (the rules of the host backend's hierarchical path,
// src/ep/host/host_hierarchical.cpp, and of the low-latency path):
// - normal (hierarchical): a token of rank (m, l) crosses the network once per destination node n != m, to the
//   forwarder (n, l); every forwarder (own node included) sends it over NVLink to each destination GPU of its
//   node other than itself. Combine is the same rows in reverse.
// - low-latency (direct): one message per (token, top-k slot) whose expert lives on another rank: over the network
//   when that rank is on another node, else over NVLink. Combine is the same pairs in reverse.
// A leg's bytes are those of the busiest rank: max over ranks of max(bytes sent, bytes received) (links are full
// duplex; the collective ends with its slowest rank).
#pragma once

#include <cstdint>
#include <vector>

namespace epx::scale_model {

struct Shape {
  int num_nodes = 1;
  int gpus_per_node = 8;
  int64_t num_experts = 256;  // physical experts, a multiple of num_nodes * gpus_per_node and of num_groups
  int num_topk = 8;
  int num_groups = 8;       // n_group
  int num_topk_groups = 4;  // topk_group, in [1, num_groups]; num_topk <= num_topk_groups * num_experts / num_groups
};

// Throws Error(kInvalidArgument) naming the Shape field and its bound. Also bounds the ranks to 2^16 and the
// experts to 2^20 (the exact form iterates over them).
void check_shape(const Shape& shape);

// Rows per token of one rank's batch, for the busiest rank; "mean" is the average over ranks (they differ only
// when groups straddle nodes or GPUs).
struct LegRows {
  double busiest = 0;  // max over ranks of max(sent, received) / T
  double mean = 0;     // mean over ranks of sent / T (= of received / T)
};

struct RoutingStats {
  double nodes_per_token = 0;   // expected distinct destination nodes, the token's own node included when reached
  double gpus_per_token = 0;    // expected distinct destination GPUs, its own GPU included when reached
  LegRows network_rows;         // hierarchical: (token, node) records crossing the network
  LegRows nvlink_rows;          // hierarchical: (token, GPU) forwards from the landing GPU to another of its node
  LegRows ll_network_pairs;     // low-latency: (token, slot) messages to another node
  LegRows ll_nvlink_pairs;      // low-latency: (token, slot) messages to another GPU of the same node
  int max_nodes_per_token = 0;  // the most nodes one token can reach (exact form; the Monte-Carlo's largest draw)
};

// (a) Exact: for each node and each GPU (a contiguous block of experts), P(reached) sums over how many of the
// groups that lie in the block and which of the <= 2 groups it shares with its neighbours a token picked,
// weighted by the hypergeometric choice of groups, times 1 - C(U - a, K) / C(U, K) with U = topk_group *
// E / n_group the experts a token chooses from and a those of them in the block. Everything else is linear in
// these probabilities. Deterministic; O(R * n_group).
RoutingStats routing_stats_exact(const Shape& shape);

// (b) Monte-Carlo: num_tokens tokens drawn with std::mt19937_64(seed) by the rule above, token t on rank t % R
// (num_tokens is rounded up to a multiple of R), routed through compute_layout_host (include/epx/routing.h), and
// counted by the hierarchical and low-latency rules. Throws kInvalidArgument when num_tokens is outside
// [1, 2^24].
RoutingStats routing_stats_monte_carlo(const Shape& shape, int64_t num_tokens, uint64_t seed);

struct Links {
  double network_gbps = 50;    // per GPU, each way (400 Gb/s NIC per GPU)
  double nvlink_gbps = 385;    // per GPU, each way (the copy-engine rate measured on 2x H200, docs/status.md)
  double latency_us = 5;       // per network message; messages of one leg are in flight together: paid once
  int64_t chunk_tokens = 128;  // records per pipeline chunk of the normal path
};

struct PhaseTime {
  double network_bytes = 0;  // busiest rank, per call
  double nvlink_bytes = 0;   // busiest rank, per call
  double network_us = 0;     // network_bytes / network rate (no latency)
  double nvlink_us = 0;      // nvlink_bytes / NVLink rate
  double time_us = 0;        // the prediction (formulas below)
};

// Normal (hierarchical) dispatch or combine of num_tokens per rank, row_bytes per record (hidden * 2 for bf16;
// hidden + hidden / 128 * 4 for fp8 with fp32 scales). The two legs are pipelined in chunks of chunk_tokens
// records of one network message (C = ceil(num_tokens * busiest network rows / (N - 1) / chunk_tokens) chunks):
//   time = latency + max(t_net, t_nvl) + min(t_net, t_nvl) / C          (N > 1)
//   time = t_nvl                                                         (N = 1: no network leg)
// a two-stage pipeline of C equal chunks: the slower leg runs throughout, the faster one adds one chunk.
// network_row_bytes: the network leg's row when it differs (the combine's fp32 node partials, hidden * 4); 0: row_bytes.
PhaseTime normal_time(const RoutingStats& stats, int num_nodes, int64_t num_tokens, double row_bytes,
                      const Links& links, double network_row_bytes = 0);

// Low-latency dispatch or combine: no forwarding, both legs leave the source at once:
//   time = max(latency + t_net, t_nvl)   (the latency only when there is a network leg)
PhaseTime low_latency_time(const RoutingStats& stats, int num_nodes, int64_t num_tokens, double row_bytes,
                           const Links& links);

}  // namespace epx::scale_model
