// Host backend, normal mode, hierarchical routing (docs/internode.md): the reference of the multi-node path.
//
// N nodes of G ranks; rank (n, l) = n * G + l. Dispatch is two legs, each one HostGroup collective in which a rank
// reads only from the peers that leg connects it to:
//   network leg   rank (m, l) sends each token once per destination node n, as one message of records in token
//                 order, to the forwarder (n, l), the rank with its local index there. The forwarder copies the
//                 messages of its N sources (m, l) into its own receive storage.
//   node leg      rank (n, g) pulls, from each forwarder (n, l) of its node, the records that go to it and writes
//                 them at the rows the forwarder computed from the rank prefix matrix, so the rows come out in the
//                 flat order (source rank, then token index).
// Combine reverses it: in the node leg each forwarder sums, per record, the rows of its node's ranks (fp32, local
// rank ascending); in the network leg each source sums its tokens' partials over the nodes ascending, then adds
// the biases and rounds once (the order CombineResult states).
// A rank that fails in the first leg (e.g. peers disagree) joins the second with HostGroup::fail, so the ranks
// stay in step; a rank whose num_worst_tokens is too small still forwards in the second leg and raises after it,
// as in the flat routing, where its peers succeed.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <string>

#include "core/bf16.h"
#include "core/check.h"
#include "ep/host/host_buffer.h"

namespace epx::host {

namespace {

// The second collective of a call whose first one threw on this rank: take part with an error flag, so the
// peers raise kPeerFailure at once instead of timing out, then rethrow.
[[noreturn]] void fail_second_leg(HostGroup& group, const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    group.fail(e.what());
  } catch (...) {
    group.fail("unknown error");
  }
  std::rethrow_exception(error);
}

// What a forwarder publishes for the node leg of a dispatch.
struct RelayPost {
  const std::vector<NodeMessage>* relay = nullptr;                  // [source node]
  const std::vector<std::vector<int32_t>>* forward_rows = nullptr;  // Routes::forward_rows
};

// What a forwarder publishes for the network leg of a combine: fp32 partial sums per record it forwarded.
struct PartialPost {
  const std::vector<std::vector<float>>* x = nullptr;        // [source node] -> [records, H]
  const std::vector<std::vector<float>>* weights = nullptr;  // [source node] -> [records, K]; with weights only
};

// This rank's messages to every node (network leg), and its tokens' record index in each ([T, N], -1 if none).
std::vector<NodeMessage> pack_node_messages(const DispatchArgs& args, const DispatchPost& mine,
                                            const Topology& topology, std::vector<int32_t>& node_slot) {
  const int num_nodes = topology.num_nodes;
  const int gpus = topology.gpus_per_node;
  const int num_ranks = topology.num_ranks();
  const int64_t num_tokens = mine.shape.num_tokens;
  const int64_t num_topk = mine.shape.is_cached ? 0 : mine.shape.num_topk;
  const size_t row_bytes = static_cast<size_t>(mine.shape.hidden) * dtype_size(mine.x_dtype);
  const int64_t num_scales = mine.shape.is_fp8 ? args.x_scales.shape[1] : 0;
  const size_t scale_size = dtype_size(mine.scales_dtype);
  node_slot.assign(detail::checked_mul(num_tokens, num_nodes, "num_tokens * num_nodes"), -1);
  std::vector<NodeMessage> messages(num_nodes);
  for (int n = 0; n < num_nodes; ++n) {
    NodeMessage& m = messages[n];
    for (int64_t t = 0; t < num_tokens; ++t) {
      const uint8_t* in_rank = mine.is_token_in_rank + t * num_ranks + topology.rank_of(n, 0);
      if (std::none_of(in_rank, in_rank + gpus, [](uint8_t b) { return b != 0; })) continue;
      node_slot[t * num_nodes + n] = static_cast<int32_t>(m.num_records++);
      m.src_idx.push_back(static_cast<int32_t>(t));
      m.in_rank.insert(m.in_rank.end(), in_rank, in_rank + gpus);
      m.x.insert(m.x.end(), mine.x + t * row_bytes, mine.x + (t + 1) * row_bytes);
      for (int64_t j = 0; j < num_scales; ++j) {
        const uint8_t* at = mine.scales + (t * mine.scale_strides[0] + j * mine.scale_strides[1]) * scale_size;
        m.scales.insert(m.scales.end(), at, at + scale_size);
      }
      for (int64_t k = 0; k < num_topk; ++k) {
        m.topk_idx.push_back(topk_at(mine.topk_idx, t, k));
        if (mine.has_weights) m.topk_weights.push_back(mine.topk_weights[t * num_topk + k]);
      }
    }
  }
  return messages;
}

}  // namespace

DispatchResult HostBuffer::dispatch_hierarchical(const DispatchArgs& args, std::shared_ptr<const Routes> cached,
                                                 const std::optional<HostLayout>& layout, DispatchPost& mine) {
  const int num_nodes = topology_.num_nodes;
  const int gpus = topology_.gpus_per_node;
  const int node = topology_.node_of(rank_);
  const int local = topology_.local_rank_of(rank_);
  const ep::DispatchShape& shape = mine.shape;
  const int64_t num_local_experts = mine.num_experts / num_ranks_;

  std::vector<int32_t> node_slot;  // [T, N]
  std::vector<NodeMessage> messages;
  prepare_or_fail(*host_group_, [&] { messages = pack_node_messages(args, mine, topology_, node_slot); });
  mine.node_messages = messages.data();

  // Network leg (and notify: every rank reads every peer's counts, as the flat routing does).
  std::shared_ptr<const Routes> routes = cached;
  std::vector<NodeMessage> relay(num_nodes);  // this rank's receive storage as forwarder, by source node
  int64_t num_recv = 0;
  std::exception_ptr overflow;  // num_worst_tokens too small: raised after the node leg
  std::exception_ptr error;
  // NOTE: an exchange that throws (a peer failed before it, or timed out) ends the call on every rank that came;
  // only an error after it must join the node leg.
  const auto posts = host_group_->exchange(&mine);  // throws kTimeout naming the missing ranks
  try {
    with_release(*host_group_, [&] {
      const auto& ptrs = posts;
      check_peers_present(ptrs, rank_, "dispatch");
      std::vector<const DispatchPost*> peers(num_ranks_);
      for (int s = 0; s < num_ranks_; ++s) peers[s] = static_cast<const DispatchPost*>(ptrs[s]);
      const DType topk_dtype = cached ? DType::kInt64 : args.topk_idx.dtype;
      num_recv = check_dispatch_posts(peers, mine, cached.get(), topk_dtype, rank_);
      try {
        check_worst_tokens(args.num_worst_tokens, num_recv, rank_);
      } catch (const Error&) {
        overflow = std::current_exception();
      }
      for (int m = 0; m < num_nodes; ++m) relay[m] = peers[topology_.rank_of(m, local)]->node_messages[node];
      if (cached) return;
      auto fresh = make_routes(peers, *layout, shape.num_tokens, num_recv, mine.num_experts, args.expert_alignment,
                               host_group_->seq(), rank_, alloc(DType::kInt32, {num_ranks_, num_ranks_}));
      fresh->node_slot = std::move(node_slot);
      // Rows of each forwarded record on this node's ranks: source s's rows on rank d start at the prefix of
      // the sources before s, and keep s's token order.
      const int32_t* prefix = fresh->rank_prefix_matrix.data_as<int32_t>();
      fresh->forward_rows.resize(num_nodes);
      for (int m = 0; m < num_nodes; ++m) {
        const int s = topology_.rank_of(m, local);
        const NodeMessage& message = relay[m];
        std::vector<int32_t> next(gpus);
        for (int g = 0; g < gpus; ++g) {
          const int d = topology_.rank_of(node, g);
          next[g] = s > 0 ? prefix[(s - 1) * num_ranks_ + d] : 0;
        }
        auto& rows = fresh->forward_rows[m];
        rows.assign(detail::checked_mul(message.num_records, gpus, "records * gpus_per_node"), -1);
        for (int64_t i = 0; i < message.num_records; ++i) {
          for (int g = 0; g < gpus; ++g) {
            if (message.in_rank[i * gpus + g]) rows[i * gpus + g] = next[g]++;
          }
        }
      }
      routes = std::move(fresh);
    });
  } catch (...) {
    error = std::current_exception();
  }
  if (error) fail_second_leg(*host_group_, error);

  // Node leg: pull this rank's records from the node's forwarders.
  DispatchResult result;
  RelayPost relay_post{&relay, &routes->forward_rows};
  const auto ptrs = host_group_->exchange(&relay_post);
  with_release(*host_group_, [&] {
    check_peers_present(ptrs, rank_, "dispatch (node leg)");
    if (overflow) return;  // forwarding is the peers' reads of this rank's post
    const int64_t num_rows = args.num_worst_tokens > 0 ? args.num_worst_tokens : num_recv;
    RecvWriter writer(result, args, shape, mine.scales_dtype, num_rows, num_local_experts, rank_, *this);
    const int64_t num_topk = shape.is_cached ? 0 : shape.num_topk;
    const int64_t num_scales = shape.is_fp8 ? args.x_scales.shape[1] : 0;
    const size_t scale_size = dtype_size(mine.scales_dtype);
    int64_t num_written = 0;
    for (int l = 0; l < gpus; ++l) {
      const auto* post = static_cast<const RelayPost*>(ptrs[topology_.rank_of(node, l)]);
      for (int m = 0; m < num_nodes; ++m) {
        const NodeMessage& message = (*post->relay)[m];
        const std::vector<int32_t>& rows = (*post->forward_rows)[m];
        for (int64_t i = 0; i < message.num_records; ++i) {
          const int32_t row = rows[i * gpus + local];
          if (row < 0) continue;
          EPX_CHECK(ErrorCode::kInternal, row < num_recv, "dispatch (node leg): row {} of rank {} is outside [0, {})",
                    row, rank_, num_recv);
          const uint8_t* scales = num_scales > 0 ? message.scales.data() + i * num_scales * scale_size : nullptr;
          writer.write(row, message.x.data() + i * writer.row_bytes(), scales, 1, message.src_idx[i]);
          for (int64_t k = 0; k < num_topk; ++k) {
            writer.write_topk(row, k, message.topk_idx[i * num_topk + k],
                              message.topk_weights.empty() ? 0.f : message.topk_weights[i * num_topk + k]);
          }
          ++num_written;
        }
      }
    }
    EPX_CHECK(ErrorCode::kInternal, num_written == num_recv,
              "dispatch (node leg): rank {} got {} rows from its node's forwarders, expected {}", rank_, num_written,
              num_recv);
    writer.pad(num_recv);
    finish_dispatch(result, routes, num_rows, args.num_worst_tokens);
  });
  if (overflow) std::rethrow_exception(overflow);
  return result;
}

CombineResult HostBuffer::combine_hierarchical(const CombineArgs& args, const HostDispatchHandle& handle,
                                               const CombinePost& mine) {
  const Routes& routes = *handle.routes;
  const int num_nodes = topology_.num_nodes;
  const int gpus = topology_.gpus_per_node;
  const int node = topology_.node_of(rank_);
  const int local = topology_.local_rank_of(rank_);
  const int64_t hidden = mine.hidden;
  const int64_t num_topk = mine.num_topk;

  // Node leg: as forwarder, reduce each forwarded record over the node's ranks (fp32, local rank ascending); with
  // NodePartials::kBFloat16 the x partial is then rounded to bf16 (the bytes that would cross), the weights not.
  const bool bf16_partials = options_.node_partials == NodePartials::kBFloat16;
  std::vector<std::vector<float>> partial_x(num_nodes), partial_w(num_nodes);
  std::exception_ptr error;
  const auto posts = host_group_->exchange(&mine);  // a throw here ends the call on every rank (see dispatch)
  try {
    with_release(*host_group_, [&] {
      const auto& ptrs = posts;
      check_peers_present(ptrs, rank_, "combine");
      std::vector<const CombinePost*> peers(num_ranks_);
      for (int r = 0; r < num_ranks_; ++r) peers[r] = static_cast<const CombinePost*>(ptrs[r]);
      check_combine_posts(peers, mine, rank_);
      for (int m = 0; m < num_nodes; ++m) {
        const std::vector<int32_t>& rows = routes.forward_rows[m];
        const int64_t num_records = static_cast<int64_t>(rows.size()) / gpus;
        partial_x[m].assign(detail::checked_mul(num_records, hidden, "records * hidden"), 0.f);
        if (mine.has_weights) partial_w[m].assign(num_records * num_topk, 0.f);
        for (int64_t i = 0; i < num_records; ++i) {
          float* acc = partial_x[m].data() + i * hidden;
          for (int g = 0; g < gpus; ++g) {
            const int32_t row = rows[i * gpus + g];
            if (row < 0) continue;
            const CombinePost& p = *peers[topology_.rank_of(node, g)];
            const uint16_t* src = p.x + static_cast<int64_t>(row) * hidden;
            for (int64_t h = 0; h < hidden; ++h) acc[h] += detail::bf16_to_float(src[h]);
            for (int64_t k = 0; k < num_topk && mine.has_weights; ++k) {
              partial_w[m][i * num_topk + k] += p.topk_weights[static_cast<int64_t>(row) * num_topk + k];
            }
          }
          for (int64_t h = 0; h < hidden && bf16_partials; ++h) acc[h] = detail::round_to_bf16(acc[h]);
        }
      }
    });
  } catch (...) {
    error = std::current_exception();
  }
  if (error) fail_second_leg(*host_group_, error);

  // Network leg: each token's partials from the forwarders (n, local) of its destination nodes, n ascending.
  CombineResult result;
  PartialPost partial_post{&partial_x, &partial_w};
  const auto ptrs = host_group_->exchange(&partial_post);
  with_release(*host_group_, [&] {
    check_peers_present(ptrs, rank_, "combine (network leg)");
    const int64_t num_tokens = routes.num_tokens;
    CombineOutput output(alloc(DType::kBFloat16, {num_tokens, hidden}),
                         mine.has_weights ? alloc(DType::kFloat32, {num_tokens, num_topk}) : Tensor(), args);
    float* out_w = output.out_w;
    std::vector<float> acc(hidden);
    for (int64_t t = 0; t < num_tokens; ++t) {
      // NOTE: fixed fp32 order: nodes ascending (each partial summed by local rank ascending), then bias_0, then
      // bias_1; the same as the flat order with one node or one rank per node (CombineResult).
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t k = 0; out_w != nullptr && k < num_topk; ++k) out_w[t * num_topk + k] = 0.f;
      for (int n = 0; n < num_nodes; ++n) {
        const int32_t slot = routes.node_slot[t * num_nodes + n];
        if (slot < 0) continue;
        const auto* post = static_cast<const PartialPost*>(ptrs[topology_.rank_of(n, local)]);
        const float* partial = (*post->x)[node].data() + static_cast<int64_t>(slot) * hidden;
        for (int64_t h = 0; h < hidden; ++h) acc[h] += partial[h];
        for (int64_t k = 0; out_w != nullptr && k < num_topk; ++k) {
          out_w[t * num_topk + k] += (*post->weights)[node][static_cast<int64_t>(slot) * num_topk + k];
        }
      }
      output.finish(t, acc);
    }
    result = std::move(output).result();
  });
  return result;
}

}  // namespace epx::host
