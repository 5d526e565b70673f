#include "ep/cuda/hierarchical_plan.h"

#include "core/check.h"

namespace epx::cuda {

Legs::Legs(const HierarchicalRoutes& r, const Topology& topo, int rank) {
  const int N = topo.num_nodes, G = topo.gpus_per_node, R = topo.num_ranks();
  const int node = topo.node_of(rank), local = topo.local_rank_of(rank);
  auto P = [&](int s, int d) { return int64_t{r.per_rank[s * R + d]}; };
  auto Q = [&](int s, int n) { return int64_t{r.per_node[s * N + n]}; };
  for (int n = 0; n < N; ++n) {
    net_peers.push_back(topo.rank_of(n, local));
    net_send.push_back(Q(rank, n));
    net_recv.push_back(Q(topo.rank_of(n, local), node));
  }
  for (int g = 0; g < G; ++g) {
    const int d = topo.rank_of(node, g);
    node_peers.push_back(d);
    int64_t out = 0, in = 0;
    for (int m = 0; m < N; ++m) {
      out += P(topo.rank_of(m, local), d);
      in += P(topo.rank_of(m, g), rank);
    }
    fwd_send.push_back(out);
    fwd_recv.push_back(in);
  }
  net_msgs = parts(net_send);
  relay_msgs = parts(net_recv);
  fwd_msgs = parts(fwd_send);
  num_relay = relay_msgs.start[N];
  blocks.num = G * N;
  for (int l = 0; l < G; ++l) {
    for (int m = 0; m < N; ++m) {
      const int s = topo.rank_of(m, l), b = l * N + m;
      int64_t base = 0;
      for (int q = 0; q < s; ++q) base += P(q, rank);
      row_base[b] = base;
      blocks.start[b + 1] = blocks.start[b] + P(s, rank);
    }
  }
}

hier::Parts Legs::parts(const std::vector<int64_t>& counts) {
  hier::Parts p;
  p.num = static_cast<int>(counts.size());
  for (int i = 0; i < p.num; ++i) p.start[i + 1] = p.start[i] + counts[i];
  return p;
}
std::vector<int64_t> Legs::bytes(const std::vector<int64_t>& records, int64_t record_bytes) {
  std::vector<int64_t> out(records);
  for (auto& v : out) v *= record_bytes;
  return out;
}

void check_headers(const std::vector<Header>& all, const Header& mine, int rank, const char* call,
                   const std::exception_ptr& local_error) {
  if (local_error) std::rethrow_exception(local_error);
  for (size_t s = 0; s < all.size(); ++s) {
    EPX_CHECK(ErrorCode::kPeerFailure, !all[s].failed,
              "cuda rank {}: rank {} failed its checks of this {} (its own error says why); no data moved, the buffer "
              "stays usable",
              rank, s, call);
  }
  for (size_t s = 0; s < all.size(); ++s) {
    const Header& p = all[s];
    EPX_CHECK_ARG(p.kind == mine.kind,
                  "{}: rank {} and rank {} make different calls (fresh dispatch, cached dispatch "
                  "or combine)",
                  call, s, rank);
    if (mine.kind == kCombine) {
      EPX_CHECK_ARG(p.hidden == mine.hidden && p.has_weights == mine.has_weights && p.num_topk == mine.num_topk,
                    "combine arguments differ between rank {} and rank {} (x hidden size, topk_weights presence and "
                    "width must agree)",
                    s, rank);
    } else {
      EPX_CHECK_ARG(p.hidden == mine.hidden && p.x_dtype == mine.x_dtype && p.scales_dtype == mine.scales_dtype &&
                        p.num_experts == mine.num_experts && p.num_topk == mine.num_topk &&
                        p.has_weights == mine.has_weights && p.topk_dtype == mine.topk_dtype,
                    "dispatch arguments differ between rank {} and rank {} (cached mode, x hidden/dtype, x_scales "
                    "dtype, num_experts, topk_idx shape/dtype and topk_weights presence must agree)",
                    s, rank);
    }
    EPX_CHECK_ARG(mine.kind == kFreshDispatch || p.handle_id == mine.handle_id,
                  "{}: the handles of rank {} and rank {} come from different dispatches (calls #{} and #{})", call, s,
                  rank, p.handle_id, mine.handle_id);
  }
}

}  // namespace epx::cuda
