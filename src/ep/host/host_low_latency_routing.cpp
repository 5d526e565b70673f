// Host backend, low-latency routing and receive sides: the flat routing and the hierarchical one across nodes
// (BufferOptions::low_latency_routing, docs/internode.md "Low-latency across nodes"); the reference of both.
//
// The flat routing is the hierarchical one on a topology of one node, so one code path serves both. N nodes of G
// ranks, rank (n, l) = n * G + l:
//   network leg  source (m, l) posts one message per node n: its tokens with an expert on n, in token order, with
//                their expert ids on n (LowLatencyNodeMessage). Node n's forwarder for it is f = (n, l); on its own
//                node the source is its own forwarder, so those pairs go straight to their ranks.
//   node leg     f writes each record into the receive slots of (expert, ORIGINAL source) on the ranks of n that
//                hold its experts, in the flat order (source rank, then token, then k): the results are the flat
//                routing's bit for bit.
//   combine      each expert rank returns its rows per (expert, source) block to the source's forwarder on its node;
//                f reduces them, with the weights the source sent it, into one fp32 partial per (token, node):
//                p_n = 0 + w * x over k ascending; the source adds 0 + p_0 + p_1 + ... and rounds once.
// NOTE: the posts never change and senders never wait, so a rank computes the node leg of its forwarders itself,
// from the posts of its call (what f received, and f's mask): a receive (or its hook) then waits only for posts
// made when the peers entered the call, as in the flat routing, never for a peer's hook. The data each step reads
// is exactly what that step's sender holds on the GPU (see the cuda plan in docs/internode.md).
#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "core/bf16.h"
#include "core/check.h"
#include "ep/host/host_buffer.h"

namespace epx::host {

bool LowLatencyRoute::reaches(const std::vector<std::shared_ptr<const LowLatencyPost>>& posts, int src, int dst) const {
  const auto open = [&](int a, int b) {
    return a == b || (posts[a] != nullptr && posts[b] != nullptr && !posts[a]->mask[b] && !posts[b]->mask[a]);
  };
  const int f = forwarder(src, topology.node_of(dst));
  return open(src, dst) && open(src, f) && open(f, dst);
}

std::vector<LowLatencyNodeMessage> LowLatencyRoute::pack(const std::vector<int64_t>& topk, int64_t num_tokens,
                                                         int64_t num_topk, const uint8_t* x, size_t row_bytes,
                                                         const uint8_t* scales, size_t scale_bytes,
                                                         int64_t num_local_experts,
                                                         std::vector<int32_t>& node_slot) const {
  const int num_nodes = topology.num_nodes;
  node_slot.assign(num_tokens * num_nodes, -1);
  std::vector<LowLatencyNodeMessage> messages(num_nodes);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int n = 0; n < num_nodes; ++n) {
      const int64_t* ids = topk.data() + t * num_topk;
      const auto on_node = [&](int64_t e) { return e >= 0 && node_of_expert(e, num_local_experts) == n; };
      if (std::none_of(ids, ids + num_topk, on_node)) continue;
      LowLatencyNodeMessage& m = messages[n];
      node_slot[t * num_nodes + n] = static_cast<int32_t>(m.num_records++);
      m.src_idx.push_back(static_cast<int32_t>(t));
      for (int64_t k = 0; k < num_topk; ++k) m.topk.push_back(on_node(ids[k]) ? ids[k] : -1);
      m.x.insert(m.x.end(), x + t * row_bytes, x + (t + 1) * row_bytes);
      m.scales.insert(m.scales.end(), scales + t * scale_bytes, scales + (t + 1) * scale_bytes);
    }
  }
  return messages;
}

namespace {

// One received row's scales (num_blocks in the wire format: exponent bytes or fp32) into recv_x_scales at
// (expert e, row) in the caller's format and layout (ep::LowLatencyScales).
void put_scales(const ep::LowLatencyScales& s, const uint8_t* wire, int64_t num_blocks, int64_t e, int64_t row,
                int64_t num_slots, uint8_t* out) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    if (s.out_fp32) {
      float v;
      if (s.wire_ue8m0) {
        v = ue8m0_to_float(wire[b]);
      } else {
        std::memcpy(&v, wire + b * 4, 4);
      }
      const int64_t i =
          s.column_major ? (e * num_blocks + b) * num_slots + row : (e * num_slots + row) * num_blocks + b;
      std::memcpy(out + i * 4, &v, 4);
    } else if (s.column_major) {  // word b / 4 of the row, byte b % 4 (little-endian int32)
      out[((e * s.units + b / 4) * num_slots + row) * 4 + b % 4] = wire[b];
    } else {
      out[(e * num_slots + row) * num_blocks + b] = wire[b];
    }
  }
}

}  // namespace

void HostBuffer::finish_dispatch_receive(const std::shared_ptr<LowLatencyState>& state) {
  EPX_CHECK_ARG(state->epoch == ll_epoch_,
                "the receive hook of low-latency dispatch #{} ran after clean_low_latency_buffer", state->seq);
  EPX_CHECK_ARG(recv_sets_[state->set_idx].owner_dispatch == state->dispatch_number,
                "the receive hook of low-latency dispatch #{} ran after two later dispatches reused its buffer set",
                state->seq);
  const auto posts = collect(state->seq, static_cast<int>(LowLatencyKind::kDispatch), state->wait_recv_cost_ns);
  const int64_t hidden = state->shape.hidden, num_local_experts = state->shape.num_local_experts;
  const int64_t max_tokens = state->max_tokens, num_slots = num_ranks_ * max_tokens;
  const int64_t num_blocks = hidden / kFp8BlockSize;
  const size_t row_bytes = hidden * (state->use_fp8 ? 1 : 2);
  const size_t scale_bytes = num_blocks * (state->scale_format == ScaleFormat::kUE8M0 ? 1 : 4);
  const int num_nodes = ll_route_.topology.num_nodes;
  for (int s = 0; s < num_ranks_; ++s) {
    const LowLatencyPost* p = posts[s].get();
    EPX_CHECK_ARG(
        p == nullptr || (p->hidden == hidden && p->max_tokens == max_tokens && p->num_experts == state->num_experts &&
                         p->use_fp8 == state->use_fp8 && (!p->use_fp8 || p->scale_format == state->scale_format)),
        "low-latency dispatch arguments differ between rank {} and rank {} (hidden, max_tokens_per_rank, "
        "num_experts, use_fp8 and scale_format must agree)",
        s, rank_);
    EPX_CHECK_ARG(p == nullptr || static_cast<int>(p->node_messages.size()) == num_nodes,
                  "low-latency routing differs between rank {} ({} nodes) and rank {} ({} nodes): "
                  "BufferOptions::low_latency_routing must be the same on every rank",
                  s, p == nullptr ? 0 : p->node_messages.size(), rank_, num_nodes);
  }
  auto* recv_x = static_cast<uint8_t*>(state->recv_x.get());
  auto* recv_scales = static_cast<uint8_t*>(state->recv_x_scales.get());
  auto* src_info = static_cast<int32_t*>(state->recv_src_info.get());
  auto* count = static_cast<int32_t*>(state->recv_count.get());
  auto* layout_range = static_cast<int64_t*>(state->recv_layout_range.get());
  std::fill(src_info, src_info + num_local_experts * num_slots, -1);
  std::vector<int32_t>& block_count = state->recv_block_count;
  block_count.assign(num_local_experts * num_ranks_, 0);
  const int64_t first_local = rank_ * num_local_experts;
  const int node = ll_route_.topology.node_of(rank_);
  // Packed rows: expert e's rows fill [0, recv_count[e]) by source rank, then token, then k; this loop visits
  // the pairs in exactly that order (a node message keeps its source's token order), so each pair takes the
  // expert's next row.
  std::vector<int32_t> next_row(num_local_experts, 0);
  for (int s = 0; s < num_ranks_; ++s) {
    // The node leg of forwarder (node, local index of s): s's message to this node, if its path is open.
    if (posts[s] == nullptr || !ll_route_.reaches(posts, s, rank_)) continue;  // its blocks stay empty
    const LowLatencyNodeMessage& m = posts[s]->node_messages[node];
    const int64_t num_topk = posts[s]->num_topk;
    for (int64_t i = 0; i < m.num_records; ++i) {
      for (int64_t k = 0; k < num_topk; ++k) {
        const int64_t e = m.topk[i * num_topk + k] - first_local;
        if (e < 0 || e >= num_local_experts) continue;
        ++block_count[e * num_ranks_ + s];
        const int64_t slot = e * num_slots + next_row[e]++;
        std::memcpy(recv_x + slot * row_bytes, m.x.data() + i * row_bytes, row_bytes);
        if (state->use_fp8)
          put_scales(state->scales, m.scales.data() + i * scale_bytes, num_blocks, e, next_row[e] - 1, num_slots,
                     recv_scales);
        src_info[slot] = m.src_idx[i];
      }
    }
  }
  for (int64_t e = 0; e < num_local_experts; ++e) {
    int32_t total = 0;
    for (int s = 0; s < num_ranks_; ++s) {
      const int32_t n = block_count[e * num_ranks_ + s];
      layout_range[e * num_ranks_ + s] = (static_cast<int64_t>(total) << 32) | n;
      total += n;
    }
    count[e] = total;
    if (state->cumulative_recv_counts.defined()) state->cumulative_recv_counts.data_as<int32_t>()[e] += total;
  }
  state->received = true;
}

void HostBuffer::finish_combine_receive(const std::shared_ptr<LowLatencyState>& state) {
  EPX_CHECK_ARG(state->epoch == ll_epoch_,
                "the receive hook of low-latency combine #{} ran after clean_low_latency_buffer", state->seq);
  const auto posts = collect(state->seq, static_cast<int>(LowLatencyKind::kCombine), state->wait_recv_cost_ns);
  const LowLatencyState& dispatch = *state->dispatch;
  const int64_t num_tokens = dispatch.shape.num_tokens, num_topk = dispatch.shape.num_topk;
  const int64_t hidden = dispatch.shape.hidden, num_local_experts = dispatch.shape.num_local_experts;
  // NOTE: checked before the blocks are indexed (with this rank's expert count). Every rank compares every
  // peer it did not mask, so a mismatch is raised on all of them alike.
  for (int r = 0; r < num_ranks_; ++r) {
    const LowLatencyPost* p = posts[r].get();
    EPX_CHECK_ARG(p == nullptr || (p->hidden == hidden && p->num_local_experts == num_local_experts &&
                                   p->dispatch_seq == dispatch.seq),
                  "low-latency combine: rank {} reverses dispatch #{} (hidden {}, {} local experts) but rank {} "
                  "reverses dispatch #{} (hidden {}, {} local experts); every rank must pass the handle of the same "
                  "dispatch",
                  r, p->dispatch_seq, p->hidden, p->num_local_experts, rank_, dispatch.seq, hidden, num_local_experts);
  }
  const int num_nodes = ll_route_.topology.num_nodes;
  const LowLatencyPost& mine = *posts[rank_];  // the weights this rank sent to its forwarders
  auto* out = state->out.data_as<uint16_t>();
  std::vector<float> acc(hidden), partial(hidden);
  // The pair (t, k)'s expert output row, or null when it contributes nothing (masked or cut path, not received, not
  // sent back).
  auto row_of = [&](int64_t t, int64_t k) -> const uint16_t* {
    const int64_t e = dispatch.topk[t * num_topk + k];
    const int d = static_cast<int>(e / num_local_experts);
    if (!ll_route_.reaches(posts, rank_, d)) return nullptr;
    const LowLatencyPost& p = *posts[d];
    const int64_t block = (e % num_local_experts) * num_ranks_ + rank_;
    const int32_t idx = dispatch.slot_idx[t * num_topk + k];
    if (idx >= p.block_count[block]) return nullptr;
    return p.rows.data() + (p.block_offset[block] + idx) * hidden;
  };
  if (options_.low_latency.expert_side_reduction && !ep::low_latency_hierarchical(options_, topology_)) {
    // LowLatencyConfig::expert_side_reduction: per expert rank d ascending, p_d = 0 + w * x over its pairs in
    // ascending k (fp32, a product then a sum), rounded to bf16; acc = 0 + p_0 + p_1 + ...; out = bf16(acc). The
    // cuda kernels compute p_d on rank d; the arithmetic is the same.
    for (int64_t t = 0; t < num_tokens; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      const int32_t record = dispatch.node_slot[t];  // one node: -1 when every entry of t is -1
      const float* weights = mine.node_weights[0].data() + static_cast<int64_t>(record < 0 ? 0 : record) * num_topk;
      for (int d = 0; d < num_ranks_ && record >= 0; ++d) {
        bool any = false;
        std::fill(partial.begin(), partial.end(), 0.f);
        for (int64_t k = 0; k < num_topk; ++k) {
          const int64_t e = dispatch.topk[t * num_topk + k];
          if (e < 0 || e / num_local_experts != d) continue;
          const uint16_t* row = row_of(t, k);
          if (row == nullptr) continue;
          any = true;
          const float w = weights[k];
          for (int64_t h = 0; h < hidden; ++h) {
            const float product = w * detail::bf16_to_float(row[h]);
            partial[h] += product;
          }
        }
        if (!any) continue;
        for (int64_t h = 0; h < hidden; ++h) acc[h] += detail::round_to_bf16(partial[h]);
      }
      for (int64_t h = 0; h < hidden; ++h) out[t * hidden + h] = float_to_bf16(acc[h]);
    }
    state->received = true;
    raise_pending_timeout();
    return;
  }
  const bool bf16_partials = options_.node_partials == NodePartials::kBFloat16;
  for (int64_t t = 0; t < num_tokens; ++t) {
    // NOTE: fixed fp32 order: per node n ascending, the forwarder's partial p_n = 0 + w * x over k ascending (a
    // product, then a sum; no fused multiply-add); then acc = 0 + p_0 + p_1 + ...; one rounding. One node: the
    // flat order (k ascending) bit for bit. NodePartials::kBFloat16: each p_n (this node's too) rounded to bf16
    // before it is added, which changes nothing with one node.
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int n = 0; n < num_nodes; ++n) {
      const int32_t record = dispatch.node_slot[t * num_nodes + n];
      if (record < 0) continue;  // no expert of t on node n: nothing crossed to it
      // Forwarder (n, local index of this rank): its node's pairs of this record.
      std::fill(partial.begin(), partial.end(), 0.f);
      const float* weights = mine.node_weights[n].data() + static_cast<int64_t>(record) * num_topk;
      for (int64_t k = 0; k < num_topk; ++k) {
        const int64_t e = dispatch.topk[t * num_topk + k];
        if (e < 0 || ll_route_.node_of_expert(e, num_local_experts) != n) continue;
        const uint16_t* row = row_of(t, k);  // null: masked, cut, not received or not sent back: contributes zero
        if (row == nullptr) continue;
        const float w = weights[k];
        for (int64_t h = 0; h < hidden; ++h) {
          const float product = w * detail::bf16_to_float(row[h]);
          partial[h] += product;
        }
      }
      for (int64_t h = 0; h < hidden; ++h) acc[h] += bf16_partials ? detail::round_to_bf16(partial[h]) : partial[h];
    }
    for (int64_t h = 0; h < hidden; ++h) out[t * hidden + h] = float_to_bf16(acc[h]);
  }
  state->received = true;
  raise_pending_timeout();
}

}  // namespace epx::host
