// Host backend: low-latency dispatch/combine through per-buffer mailboxes (see host_buffer.h).
#include "ep/host/host_low_latency.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "core/bf16.h"
#include "core/check.h"
#include "ep/host/host_buffer.h"
#include "epx/log.h"
#include "epx/routing.h"

namespace epx::host {

namespace {

struct BufferIds {
  std::mutex mutex;
  std::vector<uint64_t> next;  // [R]: low-latency buffers each rank has created
};

class HostLowLatencyHandle final : public LowLatencyHandle {
 public:
  explicit HostLowLatencyHandle(std::shared_ptr<LowLatencyState> state) : state(std::move(state)) {}
  std::shared_ptr<LowLatencyState> state;
};

std::shared_ptr<void> allocate_bytes(const std::shared_ptr<Allocator>& allocator, size_t bytes) {
  return allocator->allocate(bytes, Device::cpu(), nullptr);
}

}  // namespace

std::shared_ptr<LowLatencyMailbox> attach_mailbox(HostGroup& group) {
  const int num_ranks = group.num_ranks();
  auto ids = std::static_pointer_cast<BufferIds>(group.world_object("host_buffer/ids", [num_ranks] {
    auto made = std::make_shared<BufferIds>();
    made->next.assign(num_ranks, 0);
    return made;
  }));
  uint64_t id = 0;
  {
    std::lock_guard lock(ids->mutex);
    id = ids->next[group.rank()]++;
  }
  auto mailbox = std::static_pointer_cast<LowLatencyMailbox>(
      group.world_object(fmt::format("host_buffer/low_latency/{}", id), [num_ranks] {
        auto made = std::make_shared<LowLatencyMailbox>();
        made->posts.resize(num_ranks);
        return made;
      }));
  std::lock_guard lock(mailbox->mutex);
  ++mailbox->num_attached;
  return mailbox;
}

void detach_mailbox(LowLatencyMailbox& mailbox, int rank) {
  // NOTE: clearing only this rank's posts here lost them when a peer had not read them yet (a rank
  // that finished its last combine and destroyed its buffer made the peer wait out the timeout).
  std::lock_guard lock(mailbox.mutex);
  if (--mailbox.num_attached > 0) return;
  for (auto& queue : mailbox.posts) queue.clear();
}

void HostBuffer::post(std::shared_ptr<const LowLatencyPost> message) {
  {
    std::lock_guard lock(mailbox_->mutex);
    auto& mine = mailbox_->posts[rank_];
    mine.push_back(std::move(message));
    while (mine.size() > LowLatencyMailbox::kMaxPostsPerRank) mine.pop_front();
  }
  // NOTE: posts are immutable and published under the mutex; readers copy the shared_ptr under the
  // same mutex, so the data a reader sees is complete and stays alive while it reads.
  mailbox_->cv.notify_all();
}

template <typename Prepare>
void HostBuffer::prepare_or_post_failure(LowLatencyKind kind, Prepare&& prepare) {
  EPX_CHECK_ARG(mailbox_ != nullptr, "low-latency calls need BufferOptions::num_low_latency_bytes > 0");
  try {
    prepare();
  } catch (const std::exception& e) {
    auto message = std::make_shared<LowLatencyPost>();
    message->kind = kind;
    message->seq = ++ll_seq_;
    message->mask = mask_;
    message->failed = true;
    message->reason = e.what();
    post(std::move(message));
    throw;
  }
}

std::vector<std::shared_ptr<const LowLatencyPost>> HostBuffer::collect(uint64_t seq, int kind,
                                                                       const TensorView& wait_ns) {
  enum class Status { kPending, kFound, kGone };
  std::vector<std::shared_ptr<const LowLatencyPost>> found(num_ranks_);
  std::vector<Status> status(num_ranks_, Status::kPending);
  const auto start = std::chrono::steady_clock::now();
  std::vector<int64_t> waited(num_ranks_, -1);  // ns until the rank's post was there; -1 while pending
  auto scan = [&] {
    const int64_t now_ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
    bool pending = false;
    for (int r = 0; r < num_ranks_; ++r) {
      if (mask_[r] || status[r] != Status::kPending) continue;
      const auto& queue = mailbox_->posts[r];
      for (const auto& p : queue) {
        if (p->seq == seq) {
          found[r] = p;
          status[r] = Status::kFound;
          waited[r] = now_ns;
        }
      }
      if (status[r] == Status::kPending && !queue.empty() && queue.back()->seq > seq) status[r] = Status::kGone;
      pending = pending || status[r] == Status::kPending;
    }
    return !pending;
  };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(group_->timeout_ms());
  {
    std::unique_lock lock(mailbox_->mutex);
    mailbox_->cv.wait_until(lock, deadline, scan);
  }
  if (wait_ns.defined()) {
    const int64_t total_ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
    for (int r = 0; r < num_ranks_; ++r) {
      // A rank masked before the call adds nothing; one that never came, the whole wait.
      if (!mask_[r]) wait_ns.data_as<int64_t>()[r] += waited[r] >= 0 ? waited[r] : total_ns;
    }
  }
  const char* what = kind == static_cast<int>(LowLatencyKind::kDispatch) ? "dispatch" : "combine";
  std::vector<int> failed;
  std::string failures, newly_masked;
  for (int r = 0; r < num_ranks_; ++r) {
    if (mask_[r]) continue;
    if (status[r] == Status::kFound && found[r]->failed) {
      // NOTE: not masked: the peer is alive and in step; the group stays usable after this call.
      failed.push_back(r);
      failures += fmt::format("{}rank {}: {}", failures.empty() ? "" : "; ", r, found[r]->reason);
      continue;
    }
    const char* reason = nullptr;
    bool masked_here = false;  // the peer masked this rank (mask_rank there): masked back, the mask protocol, no error
    if (status[r] == Status::kPending) {
      reason = "did not post within the group timeout";
    } else if (status[r] == Status::kGone) {
      reason = "is too many calls ahead";
    } else if (static_cast<int>(found[r]->kind) != kind) {
      reason = "made a different call (out of step)";
    } else if (found[r]->mask[rank_]) {
      reason = "has masked this rank";
      masked_here = true;
    }
    if (reason == nullptr) continue;
    found[r] = nullptr;
    mask_[r] = true;
    if (!masked_here) newly_masked += fmt::format("{}rank {} {}", newly_masked.empty() ? "" : "; ", r, reason);
    log(LogLevel::kWarn,
        fmt::format("epx host rank {}: low-latency {} #{}: rank {} {}; masking it", rank_, what, seq, r, reason));
  }
  if (!newly_masked.empty() && options_.low_latency.raise_on_timeout) {
    pending_timeout_ +=
        fmt::format("{}low-latency {} #{}: {}", pending_timeout_.empty() ? "" : "; ", what, seq, newly_masked);
  }
  EPX_CHECK(ErrorCode::kPeerFailure, failed.empty(), "host rank {}: low-latency {} #{} failed on ranks {} ({})", rank_,
            what, seq, failed, failures);
  for (int r = 0; r < num_ranks_; ++r) {
    if (mask_[r]) found[r] = nullptr;
  }
  return found;
}

void HostBuffer::raise_pending_timeout() {
  if (pending_timeout_.empty()) return;
  const std::string what = std::move(pending_timeout_);
  pending_timeout_.clear();
  detail::raise(ErrorCode::kTimeout,
                "host rank {}: {}; masked, and this round's outputs lack their contributions "
                "(LowLatencyConfig::raise_on_timeout); unmask them once they are back",
                rank_, what);
}

LowLatencyDispatchResult HostBuffer::low_latency_dispatch(const LowLatencyDispatchArgs& args) {
  const Device cpu = Device::cpu();
  ep::LowLatencyShape shape;
  prepare_or_post_failure(LowLatencyKind::kDispatch, [&] {
    shape = ep::validate_low_latency_dispatch(args, num_ranks_, cpu);
    EPX_CHECK_ARG(ll_max_tokens_ == 0 || ll_max_tokens_ == args.max_tokens_per_rank,
                  "max_tokens_per_rank must be the same on every call of a buffer: {} before, {} now", ll_max_tokens_,
                  args.max_tokens_per_rank);
    // Checks every topk_idx value before anything is copied.
    const HostLayout layout = compute_layout_host(args.topk_idx, args.num_experts, num_ranks_);
    for (int64_t e = 0; e < args.num_experts; ++e) {
      EPX_CHECK_ARG(layout.num_tokens_per_expert[e] <= args.max_tokens_per_rank,
                    "topk_idx sends {} (token, slot) pairs to expert {}, more than max_tokens_per_rank = {} slots",
                    layout.num_tokens_per_expert[e], e, args.max_tokens_per_rank);
    }
  });
  const int64_t max_tokens = args.max_tokens_per_rank;
  const int64_t num_tokens = shape.num_tokens, hidden = shape.hidden, num_topk = shape.num_topk;
  const int64_t num_local_experts = shape.num_local_experts;
  ll_max_tokens_ = max_tokens;

  auto message = std::make_shared<LowLatencyPost>();
  message->kind = LowLatencyKind::kDispatch;
  message->seq = ++ll_seq_;
  message->mask = mask_;
  message->hidden = hidden;
  message->num_tokens = num_tokens;
  message->num_topk = num_topk;
  message->max_tokens = max_tokens;
  message->num_experts = args.num_experts;
  message->use_fp8 = args.use_fp8;
  const ep::LowLatencyScales scales = ep::LowLatencyScales::of(args, hidden);
  message->scale_format = scales.wire_ue8m0 ? ScaleFormat::kUE8M0 : ScaleFormat::kFloat32;
  std::vector<int64_t> topk(num_tokens * num_topk);  // [T, K]
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t k = 0; k < num_topk; ++k) topk[t * num_topk + k] = topk_at(args.topk_idx, t, k);
  }
  const int64_t num_blocks = hidden / kFp8BlockSize;
  const DType scale_dtype = scales.wire_ue8m0 ? DType::kUInt8 : DType::kFloat32;
  std::vector<uint8_t> x8, scales8;  // fp8: the quantized rows and their wire scales
  if (args.use_fp8) {
    x8.resize(num_tokens * hidden);
    scales8.resize(num_tokens * num_blocks * dtype_size(scale_dtype));
    quantize_fp8_host(args.x, TensorView::of(x8.data(), DType::kFloat8E4M3, {num_tokens, hidden}),
                      TensorView::of(scales8.data(), scale_dtype, {num_tokens, num_blocks}), message->scale_format);
  }
  std::vector<int32_t> node_slot;
  message->node_messages =
      ll_route_.pack(topk, num_tokens, num_topk, args.use_fp8 ? x8.data() : static_cast<const uint8_t*>(args.x.data),
                     hidden * (args.use_fp8 ? 1 : 2), scales8.data(),
                     args.use_fp8 ? num_blocks * dtype_size(scale_dtype) : 0, num_local_experts, node_slot);

  auto state = std::make_shared<LowLatencyState>();
  state->owner = this;
  state->kind = LowLatencyKind::kDispatch;
  state->seq = message->seq;
  state->epoch = ll_epoch_;
  state->shape = shape;
  state->max_tokens = max_tokens;
  state->num_experts = args.num_experts;
  state->use_fp8 = args.use_fp8;
  state->scale_format = message->scale_format;
  state->scales = scales;
  state->topk = std::move(topk);
  state->node_slot = std::move(node_slot);
  // Slot order inside an (expert, source rank) block: ascending token index, then ascending k.
  state->slot_idx.assign(num_tokens * num_topk, -1);
  std::vector<int32_t> next_slot(args.num_experts, 0);
  for (int64_t i = 0; i < num_tokens * num_topk; ++i) {
    if (state->topk[i] >= 0) state->slot_idx[i] = next_slot[state->topk[i]]++;
  }
  state->cumulative_recv_counts = args.cumulative_recv_counts;
  state->wait_recv_cost_ns = args.wait_recv_cost_ns;

  // Receive storage: the buffer set of this call (two alternate).
  state->set_idx = static_cast<int>(ll_num_dispatches_ % 2);
  state->dispatch_number = ++ll_num_dispatches_;
  LowLatencyRecvSet& set = recv_sets_[state->set_idx];
  const int64_t num_slots = num_ranks_ * max_tokens;
  if (set.x == nullptr || set.max_tokens != max_tokens || set.hidden != hidden ||
      set.num_local_experts != num_local_experts) {
    const auto& a = options_.allocator;
    set.max_tokens = max_tokens;
    set.hidden = hidden;
    set.num_local_experts = num_local_experts;
    set.x = allocate_bytes(a, num_local_experts * num_slots * hidden * 2);
    set.x_scales = allocate_bytes(a, num_local_experts * num_slots * (hidden / kFp8BlockSize) * 4);
    set.count = allocate_bytes(a, num_local_experts * 4);
    set.src_info = allocate_bytes(a, num_local_experts * num_slots * 4);
    set.layout_range = allocate_bytes(a, num_local_experts * num_ranks_ * 8);
  }
  set.owner_dispatch = state->dispatch_number;
  state->recv_x = set.x;
  state->recv_x_scales = set.x_scales;
  state->recv_count = set.count;
  state->recv_src_info = set.src_info;
  state->recv_layout_range = set.layout_range;

  LowLatencyDispatchResult result;
  const DType x_dtype = args.use_fp8 ? DType::kFloat8E4M3 : DType::kBFloat16;
  result.recv_x = Tensor::wrap(TensorView::of(set.x.get(), x_dtype, {num_local_experts, num_slots, hidden}), set.x);
  if (args.use_fp8) {
    result.recv_x_scales = Tensor::wrap(
        TensorView::of(set.x_scales.get(), scales.dtype, scales.shape(num_local_experts, num_slots)), set.x_scales);
  }
  result.recv_count = Tensor::wrap(TensorView::of(set.count.get(), DType::kInt32, {num_local_experts}), set.count);
  result.recv_src_info =
      Tensor::wrap(TensorView::of(set.src_info.get(), DType::kInt32, {num_local_experts, num_slots}), set.src_info);
  result.recv_layout_range = Tensor::wrap(
      TensorView::of(set.layout_range.get(), DType::kInt64, {num_local_experts, num_ranks_}), set.layout_range);
  result.handle = std::make_shared<HostLowLatencyHandle>(state);

  post(std::move(message));
  if (args.return_recv_hook) {
    result.recv_hook = [this, state] {
      if (!state->received) finish_dispatch_receive(state);
    };
  } else {
    finish_dispatch_receive(state);
  }
  return result;
}

LowLatencyCombineResult HostBuffer::low_latency_combine(const LowLatencyCombineArgs& args) {
  const Device cpu = Device::cpu();
  std::shared_ptr<const LowLatencyState> dispatch;
  prepare_or_post_failure(LowLatencyKind::kCombine, [&] {
    EPX_CHECK_ARG(args.handle != nullptr, "handle is required (from the low-latency dispatch being reversed)");
    const auto* handle = dynamic_cast<const HostLowLatencyHandle*>(args.handle.get());
    EPX_CHECK_ARG(handle != nullptr && handle->state->owner == this && handle->state->kind == LowLatencyKind::kDispatch,
                  "handle must come from a low-latency dispatch of this host buffer (rank {})", rank_);
    dispatch = handle->state;
    EPX_CHECK_ARG(dispatch->epoch == ll_epoch_,
                  "handle of low-latency dispatch #{} is from before clean_low_latency_buffer", dispatch->seq);
    EPX_CHECK_ARG(dispatch->received, "low-latency dispatch #{} has not completed: call its recv_hook first",
                  dispatch->seq);
    ep::validate_low_latency_combine(args, dispatch->shape, dispatch->max_tokens, num_ranks_, cpu);
    const int64_t num_tokens = dispatch->shape.num_tokens, num_topk = dispatch->shape.num_topk;
    for (int64_t t = 0; t < num_tokens; ++t) {
      for (int64_t k = 0; k < num_topk; ++k) {
        const int64_t e = topk_at(args.topk_idx, t, k);
        EPX_CHECK_ARG(e == dispatch->topk[t * num_topk + k], "topk_idx[{}][{}] = {} differs from the dispatch's {}", t,
                      k, e, dispatch->topk[t * num_topk + k]);
      }
    }
  });
  const int64_t num_tokens = dispatch->shape.num_tokens, num_topk = dispatch->shape.num_topk;
  const int64_t hidden = dispatch->shape.hidden, num_local_experts = dispatch->shape.num_local_experts;

  auto message = std::make_shared<LowLatencyPost>();
  message->kind = LowLatencyKind::kCombine;
  message->seq = ++ll_seq_;
  message->mask = mask_;
  message->hidden = hidden;
  message->dispatch_seq = dispatch->seq;
  message->num_local_experts = num_local_experts;
  message->block_offset.assign(num_local_experts * num_ranks_, 0);
  message->block_count.assign(num_local_experts * num_ranks_, 0);
  int64_t num_rows = 0;
  const int node = ll_route_.topology.node_of(rank_);
  for (int64_t i = 0; i < num_local_experts * num_ranks_; ++i) {
    // Source s's rows go back through its forwarder on this node (s itself when flat or on this node): nothing
    // when either is masked.
    const int s = static_cast<int>(i % num_ranks_);
    message->block_offset[i] = num_rows;
    message->block_count[i] = mask_[s] || mask_[ll_route_.forwarder(s, node)] ? 0 : dispatch->recv_block_count[i];
    num_rows += message->block_count[i];
  }
  message->rows.resize(num_rows * hidden);
  const int64_t num_slots = num_ranks_ * dispatch->max_tokens;
  for (int64_t e = 0; e < num_local_experts; ++e) {
    int64_t begin = 0;  // the packed row of source s's first pair: the prefix of the dispatch's counts
    for (int s = 0; s < num_ranks_; ++s) {
      const int64_t i = e * num_ranks_ + s;
      const auto* src = args.x.data_as<const uint16_t>() + (e * num_slots + begin) * hidden;
      std::copy(src, src + message->block_count[i] * hidden, message->rows.begin() + message->block_offset[i] * hidden);
      begin += dispatch->recv_block_count[i];
    }
  }

  // As a source: each node message's weights, for the forwarder that reduces the node's pairs.
  const auto* weights = args.topk_weights.data_as<const float>();
  const int num_nodes = ll_route_.topology.num_nodes;
  message->node_weights.resize(num_nodes);
  for (int n = 0; n < num_nodes; ++n) {
    std::vector<float>& node_weights = message->node_weights[n];  // records are in ascending token order
    for (int64_t t = 0; t < num_tokens; ++t) {
      if (dispatch->node_slot[t * num_nodes + n] < 0) continue;
      node_weights.insert(node_weights.end(), weights + t * num_topk, weights + (t + 1) * num_topk);
    }
  }

  auto state = std::make_shared<LowLatencyState>();
  state->owner = this;
  state->kind = LowLatencyKind::kCombine;
  state->seq = message->seq;
  state->epoch = ll_epoch_;
  state->shape = dispatch->shape;
  state->dispatch = dispatch;
  LowLatencyCombineResult result;
  result.x = args.out.defined() ? Tensor::wrap(args.out, nullptr) : alloc(DType::kBFloat16, {num_tokens, hidden});
  state->out = result.x.view();
  state->wait_recv_cost_ns = args.wait_recv_cost_ns;

  post(std::move(message));
  if (args.return_recv_hook) {
    result.recv_hook = [this, state] {
      if (!state->received) finish_combine_receive(state);
    };
  } else {
    finish_combine_receive(state);
  }
  return result;
}

}  // namespace epx::host
