// Host backend: construction, rank mask, and the normal (high-throughput) dispatch/combine.
#include "host/host_buffer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <string>

#include "core/bf16.h"
#include "core/check.h"
#include "ep/backends.h"
#include "epx/routing.h"
#include "host/host_low_latency.h"

namespace epx::host {

namespace {

// The routes of one fresh dispatch, shared by the handles of the cached dispatches that reuse them.
struct Routes {
  int64_t num_tokens = 0;  // T on this rank
  int64_t num_recv = 0;    // rows received (exact)
  int64_t num_experts = 0;
  uint64_t dispatch_id = 0;                  // HostGroup::seq() of the fresh dispatch: the same on every rank
  std::vector<uint8_t> is_token_in_rank;     // [T, R]
  std::vector<int32_t> num_tokens_per_rank;  // [R]
  std::vector<int32_t> send_row;             // [T, R]: the token's row on each destination, -1 if not sent
  std::vector<int32_t> recv_per_expert;      // [E_local], rounded up to the fresh dispatch's alignment
  Tensor rank_prefix_matrix;                 // int32 [R, R]: tokens ranks 0..i send to rank j
};

class HostDispatchHandle final : public DispatchHandle {
 public:
  HostDispatchHandle(const HostBuffer* owner, std::shared_ptr<const Routes> routes, int64_t num_rows)
      : owner(owner), routes(std::move(routes)), num_rows(num_rows) {}
  int64_t num_tokens() const override { return routes->num_tokens; }
  int64_t num_recv_tokens() const override { return routes->num_recv; }
  const Tensor& rank_prefix_matrix() const override { return routes->rank_prefix_matrix; }

  const HostBuffer* owner;
  std::shared_ptr<const Routes> routes;
  int64_t num_rows;  // rows of the outputs: num_recv, or num_worst_tokens
};

// What a rank publishes for a normal dispatch. Read-only for peers between exchange and release.
struct DispatchPost {
  ep::DispatchShape shape;
  DType x_dtype = DType::kBFloat16;
  DType scales_dtype = DType::kFloat32;
  const uint8_t* x = nullptr;
  const uint8_t* scales = nullptr;
  int64_t scale_strides[2] = {0, 0};  // in elements (any strides)
  TensorView topk_idx;
  const float* topk_weights = nullptr;
  bool has_weights = false;  // the pointer alone is null for T = 0
  int64_t num_experts = 0;
  uint64_t dispatch_id = 0;                        // cached mode: Routes::dispatch_id of the handle
  const uint8_t* is_token_in_rank = nullptr;       // [T, R]
  const int32_t* num_tokens_per_rank = nullptr;    // [R]
  const int32_t* num_tokens_per_expert = nullptr;  // [num_experts]; fresh mode only
};

struct CombinePost {
  uint64_t dispatch_id = 0;     // Routes::dispatch_id of the handle: every rank must reverse the same dispatch
  int64_t num_rows = 0;         // rows of x
  const uint16_t* x = nullptr;  // [rows, H]
  int64_t hidden = 0;
  const float* topk_weights = nullptr;  // [rows, K]
  bool has_weights = false;
  int64_t num_topk = 0;
};

// Runs body() between exchange and release; release happens even when body throws, so the peers
// are not left waiting. Errors are rethrown after the release.
template <typename Body>
void with_release(HostGroup& group, Body&& body) {
  std::exception_ptr error;
  try {
    body();
  } catch (...) {
    error = std::current_exception();
  }
  group.release();
  if (error) std::rethrow_exception(error);
}

// Runs prepare(), the work of a collective call before its rendezvous (validation). If it throws, this
// rank still takes part in the rendezvous with an error flag (HostGroup::fail), so that every peer
// raises Error(kPeerFailure) at once instead of timing out, and the ranks stay in step.
template <typename Prepare>
void prepare_or_fail(HostGroup& group, Prepare&& prepare) {
  try {
    prepare();
  } catch (const std::exception& e) {
    group.fail(e.what());
    throw;
  } catch (...) {
    group.fail("unknown error");
    throw;
  }
}

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

void check_peers_present(const std::vector<const void*>& ptrs, int rank, const char* what) {
  for (size_t r = 0; r < ptrs.size(); ++r) {
    EPX_CHECK(ErrorCode::kPeerFailure, ptrs[r] != nullptr,
              "{}: rank {} is out of step with rank {} (it made a different sequence of collective calls)", what, r,
              rank);
  }
}

}  // namespace

HostBuffer::HostBuffer(std::shared_ptr<Group> group, HostGroup* host_group, const BufferOptions& options)
    : group_(std::move(group)),
      host_group_(host_group),
      options_(options),
      rank_(group_->rank()),
      num_ranks_(group_->num_ranks()),
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
      }
    }
  });
  const int64_t num_tokens = shape.num_tokens;
  const int64_t hidden = shape.hidden;
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

  DispatchResult result;
  const auto ptrs = host_group_->exchange(&mine);  // throws kTimeout naming the missing ranks
  with_release(*host_group_, [&] {
    check_peers_present(ptrs, rank_, "dispatch");
    std::vector<const DispatchPost*> peers(num_ranks_);
    int64_t num_recv = 0;
    for (int s = 0; s < num_ranks_; ++s) {
      const auto* p = peers[s] = static_cast<const DispatchPost*>(ptrs[s]);
      EPX_CHECK_ARG(p->shape.is_cached == shape.is_cached && p->shape.hidden == hidden && p->x_dtype == args.x.dtype &&
                        (!shape.is_fp8 || p->scales_dtype == mine.scales_dtype) && p->num_experts == num_experts &&
                        p->shape.num_topk == shape.num_topk && p->has_weights == mine.has_weights &&
                        (shape.is_cached || p->topk_idx.dtype == args.topk_idx.dtype),
                    "dispatch arguments differ between rank {} and rank {} (cached mode, x hidden/dtype, x_scales "
                    "dtype, num_experts, topk_idx shape/dtype and topk_weights presence must agree)",
                    s, rank_);
      // NOTE: every rank compares every peer, so a mismatch is raised on all ranks alike.
      EPX_CHECK_ARG(!cached || p->dispatch_id == mine.dispatch_id,
                    "cached dispatch: the handles of rank {} and rank {} come from different dispatches (collectives "
                    "#{} and #{})",
                    s, rank_, p->dispatch_id, mine.dispatch_id);
      num_recv += p->num_tokens_per_rank[rank_];
    }
    if (cached) {
      EPX_CHECK_ARG(num_recv == cached->num_recv,
                    "cached dispatch: the ranks' handles come from different dispatches (rank {} expected {} rows, "
                    "got {})",
                    rank_, cached->num_recv, num_recv);
    }
    EPX_CHECK_ARG(args.num_worst_tokens == 0 || num_recv <= args.num_worst_tokens,
                  "num_worst_tokens = {} is smaller than the {} rows rank {} receives", args.num_worst_tokens, num_recv,
                  rank_);
    const int64_t num_rows = args.num_worst_tokens > 0 ? args.num_worst_tokens : num_recv;
    const int64_t num_topk = shape.num_topk;
    const size_t row_bytes = hidden * dtype_size(args.x.dtype);
    const int64_t num_scales = shape.is_fp8 ? args.x_scales.shape[1] : 0;
    const size_t scale_size = dtype_size(mine.scales_dtype);
    const size_t scale_row_bytes = shape.scale_bytes;

    result.recv_x = alloc(args.x.dtype, {num_rows, hidden});
    if (shape.is_fp8) result.recv_x_scales = alloc(mine.scales_dtype, {num_rows, num_scales});
    result.recv_src_idx = alloc(DType::kInt32, {num_rows});
    if (!cached) {
      result.recv_topk_idx = alloc(args.topk_idx.dtype, {num_rows, num_topk});
      if (mine.has_weights) result.recv_topk_weights = alloc(DType::kFloat32, {num_rows, num_topk});
    }
    auto* recv_x = static_cast<uint8_t*>(result.recv_x.data());
    auto* recv_scales = static_cast<uint8_t*>(result.recv_x_scales.data());
    auto* recv_src = result.recv_src_idx.data_as<int32_t>();
    auto* recv_w = result.recv_topk_weights.data_as<float>();
    const bool idx64 = !cached && args.topk_idx.dtype == DType::kInt64;
    auto set_topk = [&](int64_t i, int64_t value) {
      if (idx64) {
        result.recv_topk_idx.data_as<int64_t>()[i] = value;
      } else {
        result.recv_topk_idx.data_as<int32_t>()[i] = static_cast<int32_t>(value);
      }
    };

    // Rows by source rank, then source token index.
    const int64_t first_local = rank_ * num_local_experts;
    int64_t row = 0;
    for (int s = 0; s < num_ranks_; ++s) {
      const DispatchPost& p = *peers[s];
      for (int64_t t = 0; t < p.shape.num_tokens; ++t) {
        if (!p.is_token_in_rank[t * num_ranks_ + rank_]) continue;
        std::memcpy(recv_x + row * row_bytes, p.x + t * row_bytes, row_bytes);
        for (int64_t j = 0; j < num_scales; ++j) {
          const int64_t at = t * p.scale_strides[0] + j * p.scale_strides[1];
          std::memcpy(recv_scales + row * scale_row_bytes + j * scale_size, p.scales + at * scale_size, scale_size);
        }
        recv_src[row] = static_cast<int32_t>(t);
        for (int64_t k = 0; !cached && k < num_topk; ++k) {
          const int64_t e = topk_at(p.topk_idx, t, k) - first_local;
          const bool local = e >= 0 && e < num_local_experts;
          set_topk(row * num_topk + k, local ? e : -1);
          if (recv_w != nullptr) recv_w[row * num_topk + k] = local ? p.topk_weights[t * num_topk + k] : 0.f;
        }
        ++row;
      }
    }
    // Worst-token padding: src/topk -1, data and weights zero (the contract leaves the data unspecified).
    std::memset(recv_x + row * row_bytes, 0, (num_rows - row) * row_bytes);
    if (shape.is_fp8) std::memset(recv_scales + row * scale_row_bytes, 0, (num_rows - row) * scale_row_bytes);
    for (int64_t i = row; i < num_rows; ++i) {
      recv_src[i] = -1;
      for (int64_t k = 0; !cached && k < num_topk; ++k) {
        set_topk(i * num_topk + k, -1);
        if (recv_w != nullptr) recv_w[i * num_topk + k] = 0.f;
      }
    }

    std::shared_ptr<const Routes> routes = cached;
    if (!cached) {
      auto fresh = std::make_shared<Routes>();
      fresh->num_tokens = num_tokens;
      fresh->num_recv = num_recv;
      fresh->num_experts = num_experts;
      fresh->dispatch_id = host_group_->seq();
      fresh->is_token_in_rank = layout->is_token_in_rank;
      fresh->num_tokens_per_rank = layout->num_tokens_per_rank;
      // My token t's row on rank r: rows from ranks before me, then my earlier tokens sent to r.
      std::vector<int32_t> next_row(num_ranks_, 0);
      for (int s = 0; s < rank_; ++s) {
        for (int r = 0; r < num_ranks_; ++r) next_row[r] += peers[s]->num_tokens_per_rank[r];
      }
      fresh->send_row.assign(num_tokens * num_ranks_, -1);
      for (int64_t t = 0; t < num_tokens; ++t) {
        for (int r = 0; r < num_ranks_; ++r) {
          if (fresh->is_token_in_rank[t * num_ranks_ + r]) fresh->send_row[t * num_ranks_ + r] = next_row[r]++;
        }
      }
      fresh->recv_per_expert.assign(num_local_experts, 0);
      for (int64_t e = 0; e < num_local_experts; ++e) {
        int64_t pairs = 0;
        for (int s = 0; s < num_ranks_; ++s) pairs += peers[s]->num_tokens_per_expert[first_local + e];
        fresh->recv_per_expert[e] = static_cast<int32_t>(round_up(pairs, args.expert_alignment));
      }
      fresh->rank_prefix_matrix = alloc(DType::kInt32, {num_ranks_, num_ranks_});
      auto* prefix = fresh->rank_prefix_matrix.data_as<int32_t>();
      for (int i = 0; i < num_ranks_; ++i) {
        for (int j = 0; j < num_ranks_; ++j) {
          prefix[i * num_ranks_ + j] =
              (i > 0 ? prefix[(i - 1) * num_ranks_ + j] : 0) + peers[i]->num_tokens_per_rank[j];
        }
      }
      routes = std::move(fresh);
    }
    result.rank_prefix_matrix = routes->rank_prefix_matrix;
    result.recv_expert_counts = alloc(DType::kInt32, {num_local_experts});
    std::copy(routes->recv_per_expert.begin(), routes->recv_per_expert.end(),
              result.recv_expert_counts.data_as<int32_t>());
    if (args.num_worst_tokens == 0) result.num_recv_tokens_per_expert = routes->recv_per_expert;
    result.handle = std::make_shared<HostDispatchHandle>(this, routes, num_rows);
  });
  return result;
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

  CombineResult result;
  const auto ptrs = host_group_->exchange(&mine);
  with_release(*host_group_, [&] {
    check_peers_present(ptrs, rank_, "combine");
    std::vector<const CombinePost*> peers(num_ranks_);
    for (int r = 0; r < num_ranks_; ++r) {
      const auto* p = peers[r] = static_cast<const CombinePost*>(ptrs[r]);
      EPX_CHECK_ARG(p->hidden == hidden && p->has_weights == mine.has_weights && p->num_topk == mine.num_topk,
                    "combine arguments differ between rank {} and rank {} (x hidden size, topk_weights presence and "
                    "width must agree)",
                    r, rank_);
      // NOTE: the rows this rank reads from r are bounded by r's x only if r reverses the same dispatch.
      // Every rank compares every peer, so a mismatch is raised on all ranks alike.
      EPX_CHECK_ARG(p->dispatch_id == mine.dispatch_id,
                    "combine: the handles of rank {} and rank {} come from different dispatches (collectives #{} "
                    "and #{}, {} and {} rows)",
                    r, rank_, p->dispatch_id, mine.dispatch_id, p->num_rows, mine.num_rows);
    }
    result.x = alloc(DType::kBFloat16, {num_tokens, hidden});
    auto* out = result.x.data_as<uint16_t>();
    const auto* bias_0 = args.bias_0.defined() ? args.bias_0.data_as<const uint16_t>() : nullptr;
    const auto* bias_1 = args.bias_1.defined() ? args.bias_1.data_as<const uint16_t>() : nullptr;
    const int64_t num_topk = mine.num_topk;
    float* out_w = nullptr;
    if (mine.has_weights) {
      result.topk_weights = alloc(DType::kFloat32, {num_tokens, num_topk});
      out_w = result.topk_weights.data_as<float>();
    }
    std::vector<float> acc(hidden);
    for (int64_t t = 0; t < num_tokens; ++t) {
      // NOTE: fixed fp32 order: ranks ascending, then bias_0, then bias_1 (see docs/host-backend.md).
      std::fill(acc.begin(), acc.end(), 0.f);
      const int32_t* rows = routes.send_row.data() + t * num_ranks_;
      for (int r = 0; r < num_ranks_; ++r) {
        if (rows[r] < 0) continue;
        const uint16_t* src = peers[r]->x + static_cast<int64_t>(rows[r]) * hidden;
        for (int64_t h = 0; h < hidden; ++h) acc[h] += detail::bf16_to_float(src[h]);
      }
      for (int64_t h = 0; h < hidden && bias_0 != nullptr; ++h) acc[h] += detail::bf16_to_float(bias_0[t * hidden + h]);
      for (int64_t h = 0; h < hidden && bias_1 != nullptr; ++h) acc[h] += detail::bf16_to_float(bias_1[t * hidden + h]);
      for (int64_t h = 0; h < hidden; ++h) out[t * hidden + h] = float_to_bf16(acc[h]);
      for (int64_t k = 0; out_w != nullptr && k < num_topk; ++k) {
        float w = 0.f;
        for (int r = 0; r < num_ranks_; ++r) {
          if (rows[r] >= 0) w += peers[r]->topk_weights[static_cast<int64_t>(rows[r]) * num_topk + k];
        }
        out_w[t * num_topk + k] = w;
      }
    }
  });
  return result;
}

std::unique_ptr<Buffer> create_host_buffer(std::shared_ptr<Group> group, const BufferOptions& options) {
  auto* host_group = dynamic_cast<HostGroup*>(group.get());
  EPX_CHECK_ARG(host_group != nullptr, "the host backend needs a group from create_host_groups");
  return std::make_unique<HostBuffer>(std::move(group), host_group, options);
}

}  // namespace epx::host
