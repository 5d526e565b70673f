// Host backend: construction, rank mask, and the normal (high-throughput) dispatch/combine.
#include "ep/host/host_buffer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <optional>
#include <string>

#include "core/bf16.h"
#include "core/check.h"
#include "ep/backends.h"
#include "ep/combine_order.h"
#include "ep/host/host_low_latency.h"
#include "epx/routing.h"

namespace epx::host {

void check_peers_present(const std::vector<const void*>& ptrs, int rank, const char* what) {
  for (size_t r = 0; r < ptrs.size(); ++r) {
    EPX_CHECK(ErrorCode::kPeerFailure, ptrs[r] != nullptr,
              "{}: rank {} is out of step with rank {} (it made a different sequence of collective calls)", what, r,
              rank);
  }
}

std::vector<int32_t> count_tokens_per_node(const uint8_t* is_token_in_rank, int64_t num_tokens,
                                           const Topology& topology) {
  const int num_ranks = topology.num_ranks();
  std::vector<int32_t> per_node(topology.num_nodes, 0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int n = 0; n < topology.num_nodes; ++n) {
      bool any = false;
      for (int g = 0; g < topology.gpus_per_node; ++g) {
        any = any || is_token_in_rank[t * num_ranks + topology.rank_of(n, g)] != 0;
      }
      per_node[n] += any;
    }
  }
  return per_node;
}

int64_t check_dispatch_posts(const std::vector<const DispatchPost*>& peers, const DispatchPost& mine,
                             const Routes* cached, DType topk_dtype, int rank) {
  const ep::DispatchShape& shape = mine.shape;
  const int num_ranks = static_cast<int>(peers.size());
  int64_t num_recv = 0;
  for (int s = 0; s < num_ranks; ++s) {
    const DispatchPost* p = peers[s];
    EPX_CHECK_ARG(p->shape.is_cached == shape.is_cached && p->shape.hidden == shape.hidden &&
                      p->x_dtype == mine.x_dtype && (!shape.is_fp8 || p->scales_dtype == mine.scales_dtype) &&
                      p->num_experts == mine.num_experts && p->shape.num_topk == shape.num_topk &&
                      p->has_weights == mine.has_weights && (shape.is_cached || p->topk_idx.dtype == topk_dtype),
                  "dispatch arguments differ between rank {} and rank {} (cached mode, x hidden/dtype, x_scales "
                  "dtype, num_experts, topk_idx shape/dtype and topk_weights presence must agree)",
                  s, rank);
    // NOTE: every rank compares every peer, so a mismatch is raised on all ranks alike.
    EPX_CHECK_ARG(cached == nullptr || p->dispatch_id == mine.dispatch_id,
                  "cached dispatch: the handles of rank {} and rank {} come from different dispatches (collectives "
                  "#{} and #{})",
                  s, rank, p->dispatch_id, mine.dispatch_id);
    num_recv += p->num_tokens_per_rank[rank];
  }
  if (cached != nullptr) {
    EPX_CHECK_ARG(num_recv == cached->num_recv,
                  "cached dispatch: the ranks' handles come from different dispatches (rank {} expected {} rows, "
                  "got {})",
                  rank, cached->num_recv, num_recv);
  }
  return num_recv;
}

void check_worst_tokens(int64_t num_worst_tokens, int64_t num_recv, int rank) {
  EPX_CHECK_ARG(num_worst_tokens == 0 || num_recv <= num_worst_tokens,
                "num_worst_tokens = {} is smaller than the {} rows rank {} receives", num_worst_tokens, num_recv, rank);
}

std::shared_ptr<Routes> make_routes(const std::vector<const DispatchPost*>& peers, const HostLayout& layout,
                                    int64_t num_tokens, int64_t num_recv, int64_t num_experts, int expert_alignment,
                                    uint64_t dispatch_id, int rank, const Tensor& rank_prefix_matrix) {
  const int num_ranks = static_cast<int>(peers.size());
  const int64_t num_local_experts = num_experts / num_ranks;
  const int64_t first_local = rank * num_local_experts;
  auto fresh = std::make_shared<Routes>();
  fresh->num_tokens = num_tokens;
  fresh->num_recv = num_recv;
  fresh->num_experts = num_experts;
  fresh->dispatch_id = dispatch_id;
  fresh->is_token_in_rank = layout.is_token_in_rank;
  fresh->num_tokens_per_rank = layout.num_tokens_per_rank;
  // My token t's row on rank r: rows from ranks before me, then my earlier tokens sent to r.
  std::vector<int32_t> next_row(num_ranks, 0);
  for (int s = 0; s < rank; ++s) {
    for (int r = 0; r < num_ranks; ++r) next_row[r] += peers[s]->num_tokens_per_rank[r];
  }
  fresh->send_row.assign(num_tokens * num_ranks, -1);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int r = 0; r < num_ranks; ++r) {
      if (fresh->is_token_in_rank[t * num_ranks + r]) fresh->send_row[t * num_ranks + r] = next_row[r]++;
    }
  }
  fresh->recv_per_expert.assign(num_local_experts, 0);
  for (int64_t e = 0; e < num_local_experts; ++e) {
    int64_t pairs = 0;
    for (int s = 0; s < num_ranks; ++s) pairs += peers[s]->num_tokens_per_expert[first_local + e];
    fresh->recv_per_expert[e] = static_cast<int32_t>(round_up(pairs, expert_alignment));
  }
  fresh->rank_prefix_matrix = rank_prefix_matrix;
  auto* prefix = fresh->rank_prefix_matrix.data_as<int32_t>();
  for (int i = 0; i < num_ranks; ++i) {
    for (int j = 0; j < num_ranks; ++j) {
      prefix[i * num_ranks + j] = (i > 0 ? prefix[(i - 1) * num_ranks + j] : 0) + peers[i]->num_tokens_per_rank[j];
    }
  }
  return fresh;
}

void check_combine_posts(const std::vector<const CombinePost*>& peers, const CombinePost& mine, int rank) {
  for (size_t r = 0; r < peers.size(); ++r) {
    const CombinePost* p = peers[r];
    EPX_CHECK_ARG(p->hidden == mine.hidden && p->has_weights == mine.has_weights && p->num_topk == mine.num_topk,
                  "combine arguments differ between rank {} and rank {} (x hidden size, topk_weights presence and "
                  "width must agree)",
                  r, rank);
    // NOTE: the rows this rank reads from r are bounded by r's x only if r reverses the same dispatch.
    // Every rank compares every peer, so a mismatch is raised on all ranks alike.
    EPX_CHECK_ARG(p->dispatch_id == mine.dispatch_id,
                  "combine: the handles of rank {} and rank {} come from different dispatches (collectives #{} "
                  "and #{}, {} and {} rows)",
                  r, rank, p->dispatch_id, mine.dispatch_id, p->num_rows, mine.num_rows);
  }
}

HostBuffer::HostBuffer(std::shared_ptr<Group> group, HostGroup* host_group, const BufferOptions& options)
    : group_(std::move(group)),
      host_group_(host_group),
      options_(options),
      rank_(group_->rank()),
      num_ranks_(group_->num_ranks()),
      topology_(group_->topology()),
      hierarchical_(ep::normal_hierarchical(options, topology_, std::numeric_limits<int>::max())),
      ll_hierarchical_(ep::low_latency_hierarchical(options, topology_)),
      ll_route_{ll_hierarchical_ ? topology_ : Topology{1, num_ranks_}},
      mask_(num_ranks_, false) {
  if (options_.allocator == nullptr) options_.allocator = default_allocator();
  if (options_.num_low_latency_bytes > 0) mailbox_ = attach_mailbox(*host_group_);
}

HostBuffer::~HostBuffer() {
  if (mailbox_ != nullptr) detach_mailbox(*mailbox_, rank_);
}

Tensor HostBuffer::alloc(DType dtype, const std::vector<int64_t>& shape) const {
  return Tensor::empty(dtype, shape, Device::cpu(), options_.allocator);
}

void HostBuffer::mask_rank(int rank) {
  EPX_CHECK_ARG(rank >= 0 && rank < num_ranks_, "rank must be in [0, num_ranks = {}), got {}", num_ranks_, rank);
  EPX_CHECK_ARG(rank != rank_, "rank {} cannot mask itself", rank);
  mask_[rank] = true;
}

void HostBuffer::unmask_rank(int rank) {
  EPX_CHECK_ARG(rank >= 0 && rank < num_ranks_, "rank must be in [0, num_ranks = {}), got {}", num_ranks_, rank);
  mask_[rank] = false;
}

void HostBuffer::clear_rank_mask() { std::fill(mask_.begin(), mask_.end(), false); }

void HostBuffer::clean_low_latency_buffer() {
  // NOTE: between the barriers no rank reads the mailbox (every rank is here), so each drops its own posts
  // and restarts its sequence at 0: afterwards the ranks agree on it again, whatever happened before
  // (a rank that fell behind, masks), and no old post can match a new call's number.
  group_->barrier();
  if (mailbox_ != nullptr) {
    std::lock_guard lock(mailbox_->mutex);
    mailbox_->posts[rank_].clear();
  }
  ll_seq_ = 0;
  ++ll_epoch_;
  ll_max_tokens_ = 0;
  pending_timeout_.clear();  // the caller cleans after the failure: nothing left to report
  for (auto& set : recv_sets_) set.owner_dispatch = 0;
  clear_rank_mask();
  group_->barrier();
}

Layout HostBuffer::get_dispatch_layout(const TensorView& topk_idx, int64_t num_experts, Stream) {
  ep::validate_layout_args(topk_idx, num_experts, num_ranks_, Device::cpu());
  const int64_t num_tokens = topk_idx.shape[0];
  Layout layout;
  layout.num_tokens_per_rank = alloc(DType::kInt32, {num_ranks_});
  layout.num_tokens_per_expert = alloc(DType::kInt32, {num_experts});
  layout.is_token_in_rank = alloc(DType::kBool, {num_tokens, num_ranks_});
  compute_layout_host(topk_idx, num_experts, num_ranks_, layout.num_tokens_per_rank, layout.num_tokens_per_expert,
                      layout.is_token_in_rank);
  const auto per_node = count_tokens_per_node(layout.is_token_in_rank.data_as<uint8_t>(), num_tokens, topology_);
  layout.num_tokens_per_node = alloc(DType::kInt32, {topology_.num_nodes});
  std::copy(per_node.begin(), per_node.end(), layout.num_tokens_per_node.data_as<int32_t>());
  return layout;
}

DispatchResult HostBuffer::dispatch(const DispatchArgs& args) {
  const Device cpu = Device::cpu();
  ep::DispatchShape shape;
  // Routes: from the handle (cached) or from topk_idx, whose values are checked before any copy.
  std::shared_ptr<const Routes> cached;
  std::optional<HostLayout> layout;
  DispatchPost mine;
  prepare_or_fail(*host_group_, [&] {
    shape = ep::validate_dispatch(args, num_ranks_, cpu);
    ep::resolve_num_sms(args.num_sms, options_.num_sms);  // checked only: the host backend has no SMs
    if (shape.is_cached) {
      const auto* handle = dynamic_cast<const HostDispatchHandle*>(args.handle.get());
      EPX_CHECK_ARG(handle != nullptr && handle->owner == this,
                    "handle must come from a normal dispatch of this host buffer (rank {})", rank_);
      cached = handle->routes;
    } else {
      layout = compute_layout_host(args.topk_idx, args.num_experts, num_ranks_);
      if (args.layout != nullptr) {
        const auto same = [](const TensorView& t, const auto& v) {
          return v.empty() || std::memcmp(t.data, v.data(), v.size() * sizeof(v[0])) == 0;
        };
        EPX_CHECK_ARG(same(args.layout->num_tokens_per_rank, layout->num_tokens_per_rank) &&
                          same(args.layout->num_tokens_per_expert, layout->num_tokens_per_expert) &&
                          same(args.layout->is_token_in_rank, layout->is_token_in_rank),
                      "layout does not match topk_idx (pass the layout get_dispatch_layout computed for it)");
        if (args.layout->num_tokens_per_node.defined()) {
          check_tensor(args.layout->num_tokens_per_node, "layout.num_tokens_per_node", DType::kInt32,
                       {topology_.num_nodes});
          check_device(args.layout->num_tokens_per_node, "layout.num_tokens_per_node", cpu);
          EPX_CHECK_ARG(same(args.layout->num_tokens_per_node,
                             count_tokens_per_node(layout->is_token_in_rank.data(), shape.num_tokens, topology_)),
                        "layout.num_tokens_per_node does not match topk_idx (pass the layout get_dispatch_layout "
                        "computed for it)");
        }
      }
    }
  });
  const int64_t num_tokens = shape.num_tokens;
  const int64_t num_experts = cached ? cached->num_experts : args.num_experts;
  const int64_t num_local_experts = num_experts / num_ranks_;

  mine.shape = shape;
  mine.x_dtype = args.x.dtype;
  mine.x = static_cast<const uint8_t*>(args.x.data);
  if (shape.is_fp8) {
    mine.scales_dtype = args.x_scales.dtype;
    mine.scales = static_cast<const uint8_t*>(args.x_scales.data);
    mine.scale_strides[0] = args.x_scales.strides[0];
    mine.scale_strides[1] = args.x_scales.strides[1];
  }
  mine.num_experts = num_experts;
  if (cached) {
    mine.dispatch_id = cached->dispatch_id;
    mine.is_token_in_rank = cached->is_token_in_rank.data();
    mine.num_tokens_per_rank = cached->num_tokens_per_rank.data();
  } else {
    mine.topk_idx = args.topk_idx;
    mine.topk_weights = args.topk_weights.defined() ? args.topk_weights.data_as<const float>() : nullptr;
    mine.has_weights = args.topk_weights.defined();
    mine.is_token_in_rank = layout->is_token_in_rank.data();
    mine.num_tokens_per_rank = layout->num_tokens_per_rank.data();
    mine.num_tokens_per_expert = layout->num_tokens_per_expert.data();
  }

  if (hierarchical_) return dispatch_hierarchical(args, cached, layout, mine);

  DispatchResult result;
  const auto ptrs = host_group_->exchange(&mine);  // throws kTimeout naming the missing ranks
  with_release(*host_group_, [&] {
    check_peers_present(ptrs, rank_, "dispatch");
    std::vector<const DispatchPost*> peers(num_ranks_);
    for (int s = 0; s < num_ranks_; ++s) peers[s] = static_cast<const DispatchPost*>(ptrs[s]);
    const DType topk_dtype = cached ? DType::kInt64 : args.topk_idx.dtype;
    const int64_t num_recv = check_dispatch_posts(peers, mine, cached.get(), topk_dtype, rank_);
    check_worst_tokens(args.num_worst_tokens, num_recv, rank_);
    const int64_t num_rows = args.num_worst_tokens > 0 ? args.num_worst_tokens : num_recv;
    RecvWriter writer(result, args, shape, mine.scales_dtype, num_rows, num_local_experts, rank_, *this);
    // Rows by source rank, then source token index.
    int64_t row = 0;
    for (int s = 0; s < num_ranks_; ++s) {
      const DispatchPost& p = *peers[s];
      const size_t scale_size = dtype_size(p.scales_dtype);
      for (int64_t t = 0; t < p.shape.num_tokens; ++t) {
        if (!p.is_token_in_rank[t * num_ranks_ + rank_]) continue;
        const uint8_t* scales = shape.is_fp8 ? p.scales + t * p.scale_strides[0] * scale_size : nullptr;
        writer.write(row, p.x + t * writer.row_bytes(), scales, p.scale_strides[1], static_cast<int32_t>(t));
        for (int64_t k = 0; !cached && k < shape.num_topk; ++k) {
          writer.write_topk(row, k, topk_at(p.topk_idx, t, k),
                            p.has_weights ? p.topk_weights[t * shape.num_topk + k] : 0.f);
        }
        ++row;
      }
    }
    writer.pad(row);
    std::shared_ptr<const Routes> routes = cached;
    if (!cached) {
      routes = make_routes(peers, *layout, num_tokens, num_recv, num_experts, args.expert_alignment, host_group_->seq(),
                           rank_, alloc(DType::kInt32, {num_ranks_, num_ranks_}));
    }
    finish_dispatch(result, std::move(routes), num_rows, args.num_worst_tokens);
  });
  return result;
}

void HostBuffer::finish_dispatch(DispatchResult& result, std::shared_ptr<const Routes> routes, int64_t num_rows,
                                 int64_t num_worst_tokens) const {
  result.rank_prefix_matrix = routes->rank_prefix_matrix;
  const int64_t num_local_experts = static_cast<int64_t>(routes->recv_per_expert.size());
  result.recv_expert_counts = alloc(DType::kInt32, {num_local_experts});
  std::copy(routes->recv_per_expert.begin(), routes->recv_per_expert.end(),
            result.recv_expert_counts.data_as<int32_t>());
  if (num_worst_tokens == 0) result.num_recv_tokens_per_expert = routes->recv_per_expert;
  result.handle = std::make_shared<HostDispatchHandle>(this, std::move(routes), num_rows);
}

RecvWriter::RecvWriter(DispatchResult& result, const DispatchArgs& args, const ep::DispatchShape& shape,
                       DType scales_dtype, int64_t num_rows, int64_t num_local_experts, int rank,
                       const HostBuffer& buffer)
    : result_(result),
      num_rows_(num_rows),
      num_topk_(shape.is_cached ? 0 : shape.num_topk),
      row_bytes_(static_cast<size_t>(shape.hidden) * dtype_size(args.x.dtype)),
      num_scales_(shape.is_fp8 ? args.x_scales.shape[1] : 0),
      scale_size_(dtype_size(scales_dtype)),
      first_local_(rank * num_local_experts),
      num_local_experts_(num_local_experts),
      idx64_(!shape.is_cached && args.topk_idx.dtype == DType::kInt64) {
  result.recv_x = buffer.alloc(args.x.dtype, {num_rows, shape.hidden});
  if (shape.is_fp8) result.recv_x_scales = buffer.alloc(scales_dtype, {num_rows, num_scales_});
  result.recv_src_idx = buffer.alloc(DType::kInt32, {num_rows});
  if (!shape.is_cached) {
    result.recv_topk_idx = buffer.alloc(args.topk_idx.dtype, {num_rows, num_topk_});
    if (args.topk_weights.defined()) result.recv_topk_weights = buffer.alloc(DType::kFloat32, {num_rows, num_topk_});
  }
  recv_x_ = static_cast<uint8_t*>(result.recv_x.data());
  recv_scales_ = static_cast<uint8_t*>(result.recv_x_scales.data());
  recv_src_ = result.recv_src_idx.data_as<int32_t>();
  recv_w_ = result.recv_topk_weights.data_as<float>();
}

void RecvWriter::write(int64_t row, const uint8_t* x, const uint8_t* scales, int64_t scale_stride, int32_t src_idx) {
  std::memcpy(recv_x_ + row * row_bytes_, x, row_bytes_);
  for (int64_t j = 0; j < num_scales_; ++j) {
    std::memcpy(recv_scales_ + (row * num_scales_ + j) * scale_size_, scales + j * scale_stride * scale_size_,
                scale_size_);
  }
  recv_src_[row] = src_idx;
}

void RecvWriter::set_topk(int64_t i, int64_t value) {
  if (idx64_) {
    result_.recv_topk_idx.data_as<int64_t>()[i] = value;
  } else {
    result_.recv_topk_idx.data_as<int32_t>()[i] = static_cast<int32_t>(value);
  }
}

void RecvWriter::write_topk(int64_t row, int64_t k, int64_t expert, float weight) {
  const int64_t e = expert - first_local_;
  const bool local = expert >= 0 && e >= 0 && e < num_local_experts_;
  set_topk(row * num_topk_ + k, local ? e : -1);
  if (recv_w_ != nullptr) recv_w_[row * num_topk_ + k] = local ? weight : 0.f;
}

void RecvWriter::pad(int64_t first) {
  // Worst-token padding: src/topk -1, data and weights zero (the contract leaves the data unspecified).
  std::memset(recv_x_ + first * row_bytes_, 0, (num_rows_ - first) * row_bytes_);
  if (num_scales_ > 0) {
    std::memset(recv_scales_ + first * num_scales_ * scale_size_, 0, (num_rows_ - first) * num_scales_ * scale_size_);
  }
  for (int64_t i = first; i < num_rows_; ++i) {
    recv_src_[i] = -1;
    for (int64_t k = 0; k < num_topk_; ++k) {
      set_topk(i * num_topk_ + k, -1);
      if (recv_w_ != nullptr) recv_w_[i * num_topk_ + k] = 0.f;
    }
  }
}

CombineResult HostBuffer::combine(const CombineArgs& args) {
  const Device cpu = Device::cpu();
  const HostDispatchHandle* handle = nullptr;
  prepare_or_fail(*host_group_, [&] {
    EPX_CHECK_ARG(args.handle != nullptr, "handle is required (from the dispatch being reversed)");
    handle = dynamic_cast<const HostDispatchHandle*>(args.handle.get());
    EPX_CHECK_ARG(handle != nullptr && handle->owner == this,
                  "handle must come from a normal dispatch of this host buffer (rank {})", rank_);
    ep::validate_combine(args, handle->routes->num_tokens, handle->num_rows, cpu);
    ep::resolve_num_sms(args.num_sms, options_.num_sms);  // checked only
    if (hierarchical_) ep::refuse_combine_order_on_hierarchical(args);
  });
  const Routes& routes = *handle->routes;
  const int64_t num_tokens = routes.num_tokens;
  const int64_t hidden = args.x.shape[1];

  CombinePost mine;
  mine.dispatch_id = routes.dispatch_id;
  mine.num_rows = handle->num_rows;
  mine.x = args.x.data_as<const uint16_t>();
  mine.hidden = hidden;
  if (args.topk_weights.defined()) {
    mine.topk_weights = args.topk_weights.data_as<const float>();
    mine.has_weights = true;
    mine.num_topk = args.topk_weights.shape[1];
  }

  if (hierarchical_) return combine_hierarchical(args, *handle, mine);

  CombineResult result;
  const auto ptrs = host_group_->exchange(&mine);
  with_release(*host_group_, [&] {
    check_peers_present(ptrs, rank_, "combine");
    std::vector<const CombinePost*> peers(num_ranks_);
    for (int r = 0; r < num_ranks_; ++r) peers[r] = static_cast<const CombinePost*>(ptrs[r]);
    check_combine_posts(peers, mine, rank_);
    const int64_t num_topk = mine.num_topk;
    CombineOutput output(alloc(DType::kBFloat16, {num_tokens, hidden}),
                         mine.has_weights ? alloc(DType::kFloat32, {num_tokens, num_topk}) : Tensor(), args);
    float* out_w = output.out_w;
    std::vector<float> acc(hidden);
    const TensorView& order_topk = args.order_topk_idx;
    std::vector<int> order(num_ranks_), last(num_ranks_);
    for (int64_t t = 0; t < num_tokens; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      const int32_t* rows = routes.send_row.data() + t * num_ranks_;
      auto add_row = [&](int r) {
        const uint16_t* src = peers[r]->x + static_cast<int64_t>(rows[r]) * hidden;
        for (int64_t h = 0; h < hidden; ++h) acc[h] += detail::bf16_to_float(src[h]);
      };
      if (order_topk.defined()) {
        // DeepEP V2's order (CombineArgs::order_topk_idx): the biases, then the ranks by their last top-k slot.
        output.add_biases(t, acc);
        const int n = ep::deepep_v2_rank_order(
            num_ranks_, static_cast<int>(order_topk.shape[1]), routes.num_experts / num_ranks_,
            [&](int r) { return rows[r] >= 0; }, [&](int k) { return topk_at(order_topk, t, k); }, last.data(),
            order.data());
        for (int j = 0; j < n; ++j) add_row(order[j]);
        output.store(t, acc);
      } else {
        // NOTE: fixed fp32 order: ranks ascending, then bias_0, then bias_1 (see docs/host-backend.md).
        for (int r = 0; r < num_ranks_; ++r) {
          if (rows[r] >= 0) add_row(r);
        }
        output.finish(t, acc);
      }
      for (int64_t k = 0; out_w != nullptr && k < num_topk; ++k) {
        float w = 0.f;
        for (int r = 0; r < num_ranks_; ++r) {
          if (rows[r] >= 0) w += peers[r]->topk_weights[static_cast<int64_t>(rows[r]) * num_topk + k];
        }
        out_w[t * num_topk + k] = w;
      }
    }
    result = std::move(output).result();
  });
  return result;
}

std::unique_ptr<Buffer> create_host_buffer(std::shared_ptr<Group> group, const BufferOptions& options) {
  auto* host_group = dynamic_cast<HostGroup*>(group.get());
  EPX_CHECK_ARG(host_group != nullptr, "the host backend needs a group from create_host_groups");
  return std::make_unique<HostBuffer>(std::move(group), host_group, options);
}

}  // namespace epx::host
