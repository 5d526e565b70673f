// Host backend: low-latency dispatch/combine through per-buffer mailboxes (see host_buffer.h).
#include "ep/host/host_low_latency.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "core/bf16.h"
#include "core/check.h"
#include "epx/log.h"
#include "epx/routing.h"
#include "ep/host/host_buffer.h"

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

std::vector<std::shared_ptr<const LowLatencyPost>> HostBuffer::collect(uint64_t seq, int kind) {
  enum class Status { kPending, kFound, kGone };
  std::vector<std::shared_ptr<const LowLatencyPost>> found(num_ranks_);
  std::vector<Status> status(num_ranks_, Status::kPending);
  auto scan = [&] {
    bool pending = false;
    for (int r = 0; r < num_ranks_; ++r) {
      if (mask_[r] || status[r] != Status::kPending) continue;
      const auto& queue = mailbox_->posts[r];
      for (const auto& p : queue) {
        if (p->seq == seq) {
          found[r] = p;
          status[r] = Status::kFound;
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
  const char* what = kind == static_cast<int>(LowLatencyKind::kDispatch) ? "dispatch" : "combine";
  std::vector<int> failed;
  std::string failures;
  for (int r = 0; r < num_ranks_; ++r) {
    if (mask_[r]) continue;
    if (status[r] == Status::kFound && found[r]->failed) {
      // NOTE: not masked: the peer is alive and in step; the group stays usable after this call.
      failed.push_back(r);
      failures += fmt::format("{}rank {}: {}", failures.empty() ? "" : "; ", r, found[r]->reason);
      continue;
    }
    const char* reason = nullptr;
    if (status[r] == Status::kPending) {
      reason = "did not post within the group timeout";
    } else if (status[r] == Status::kGone) {
      reason = "is too many calls ahead";
    } else if (static_cast<int>(found[r]->kind) != kind) {
      reason = "made a different call (out of step)";
    } else if (found[r]->mask[rank_]) {
      reason = "has masked this rank";
    }
    if (reason == nullptr) continue;
    found[r] = nullptr;
    mask_[r] = true;
    log(LogLevel::kWarn,
        fmt::format("epx host rank {}: low-latency {} #{}: rank {} {}; masking it", rank_, what, seq, r, reason));
  }
  EPX_CHECK(ErrorCode::kPeerFailure, failed.empty(), "host rank {}: low-latency {} #{} failed on ranks {} ({})", rank_,
            what, seq, failed, failures);
  for (int r = 0; r < num_ranks_; ++r) {
    if (mask_[r]) found[r] = nullptr;
  }
  return found;
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
  message->topk.resize(num_tokens * num_topk);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t k = 0; k < num_topk; ++k) message->topk[t * num_topk + k] = topk_at(args.topk_idx, t, k);
  }
  if (args.use_fp8) {
    const int64_t num_blocks = hidden / kFp8BlockSize;
    const DType scale_dtype = scales.wire_ue8m0 ? DType::kUInt8 : DType::kFloat32;
    message->x.resize(num_tokens * hidden);
    message->scales.resize(num_tokens * num_blocks * dtype_size(scale_dtype));
    quantize_fp8_host(args.x, TensorView::of(message->x.data(), DType::kFloat8E4M3, {num_tokens, hidden}),
                      TensorView::of(message->scales.data(), scale_dtype, {num_tokens, num_blocks}),
                      message->scale_format);
  } else {
    const auto* src = static_cast<const uint8_t*>(args.x.data);
    message->x.assign(src, src + args.x.nbytes());
  }

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
  state->topk = message->topk;
  // Slot order inside an (expert, source rank) block: ascending token index, then ascending k.
  state->slot_idx.assign(num_tokens * num_topk, -1);
  std::vector<int32_t> next_slot(args.num_experts, 0);
  for (int64_t i = 0; i < num_tokens * num_topk; ++i) {
    if (state->topk[i] >= 0) state->slot_idx[i] = next_slot[state->topk[i]]++;
  }
  state->cumulative_recv_counts = args.cumulative_recv_counts;

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
  const auto posts = collect(state->seq, static_cast<int>(LowLatencyKind::kDispatch));
  const int64_t hidden = state->shape.hidden, num_local_experts = state->shape.num_local_experts;
  const int64_t max_tokens = state->max_tokens, num_slots = num_ranks_ * max_tokens;
  const int64_t num_blocks = hidden / kFp8BlockSize;
  const size_t row_bytes = hidden * (state->use_fp8 ? 1 : 2);
  const size_t scale_bytes = num_blocks * (state->scale_format == ScaleFormat::kUE8M0 ? 1 : 4);
  for (int s = 0; s < num_ranks_; ++s) {
    const LowLatencyPost* p = posts[s].get();
    EPX_CHECK_ARG(
        p == nullptr || (p->hidden == hidden && p->max_tokens == max_tokens && p->num_experts == state->num_experts &&
                         p->use_fp8 == state->use_fp8 && (!p->use_fp8 || p->scale_format == state->scale_format)),
        "low-latency dispatch arguments differ between rank {} and rank {} (hidden, max_tokens_per_rank, "
        "num_experts, use_fp8 and scale_format must agree)",
        s, rank_);
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
  // Packed rows: expert e's rows fill [0, recv_count[e]) by source rank, then token, then k; this loop visits
  // the pairs in exactly that order, so each pair takes the expert's next row.
  std::vector<int32_t> next_row(num_local_experts, 0);
  for (int s = 0; s < num_ranks_; ++s) {
    const LowLatencyPost* p = posts[s].get();
    if (p == nullptr) continue;  // masked: its blocks stay empty
    for (int64_t t = 0; t < p->num_tokens; ++t) {
      for (int64_t k = 0; k < p->num_topk; ++k) {
        const int64_t e = p->topk[t * p->num_topk + k] - first_local;
        if (e < 0 || e >= num_local_experts) continue;
        ++block_count[e * num_ranks_ + s];
        const int64_t slot = e * num_slots + next_row[e]++;
        std::memcpy(recv_x + slot * row_bytes, p->x.data() + t * row_bytes, row_bytes);
        if (state->use_fp8)
          put_scales(state->scales, p->scales.data() + t * scale_bytes, num_blocks, e, next_row[e] - 1, num_slots,
                     recv_scales);
        src_info[slot] = static_cast<int32_t>(t);
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
  for (int64_t i = 0; i < num_local_experts * num_ranks_; ++i) {
    message->block_offset[i] = num_rows;
    message->block_count[i] = mask_[i % num_ranks_] ? 0 : dispatch->recv_block_count[i];  // nothing to masked ranks
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

  auto state = std::make_shared<LowLatencyState>();
  state->owner = this;
  state->kind = LowLatencyKind::kCombine;
  state->seq = message->seq;
  state->epoch = ll_epoch_;
  state->shape = dispatch->shape;
  state->dispatch = dispatch;
  const auto* weights = args.topk_weights.data_as<const float>();
  state->topk_weights.assign(weights, weights + num_tokens * num_topk);
  LowLatencyCombineResult result;
  result.x = args.out.defined() ? Tensor::wrap(args.out, nullptr) : alloc(DType::kBFloat16, {num_tokens, hidden});
  state->out = result.x.view();

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

void HostBuffer::finish_combine_receive(const std::shared_ptr<LowLatencyState>& state) {
  EPX_CHECK_ARG(state->epoch == ll_epoch_,
                "the receive hook of low-latency combine #{} ran after clean_low_latency_buffer", state->seq);
  const auto posts = collect(state->seq, static_cast<int>(LowLatencyKind::kCombine));
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
  auto* out = state->out.data_as<uint16_t>();
  std::vector<float> acc(hidden);
  for (int64_t t = 0; t < num_tokens; ++t) {
    // NOTE: fixed fp32 order: k ascending, acc += w * x (a product, then a sum; no fused multiply-add).
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t k = 0; k < num_topk; ++k) {
      const int64_t e = dispatch.topk[t * num_topk + k];
      if (e < 0) continue;
      const LowLatencyPost* p = posts[e / num_local_experts].get();
      if (p == nullptr) continue;  // masked: contributes zero
      const int64_t block = (e % num_local_experts) * num_ranks_ + rank_;
      const int32_t idx = dispatch.slot_idx[t * num_topk + k];
      if (idx >= p->block_count[block]) continue;  // the expert's rank did not receive it (it masked us)
      const uint16_t* row = p->rows.data() + (p->block_offset[block] + idx) * hidden;
      const float w = state->topk_weights[t * num_topk + k];
      for (int64_t h = 0; h < hidden; ++h) {
        const float product = w * detail::bf16_to_float(row[h]);
        acc[h] += product;
      }
    }
    for (int64_t h = 0; h < hidden; ++h) out[t * hidden + h] = float_to_bf16(acc[h]);
  }
  state->received = true;
}

}  // namespace epx::host
