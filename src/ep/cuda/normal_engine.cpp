#include "ep/cuda/normal_engine.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "core/check.h"
#include "core/cuda/cuda_util.h"
#include "core/limits.h"
#include "core/timeout.h"
#include "ep/call_shape.h"
#include "ep/early_copies.h"
#include "ep/validate.h"

namespace epx::cuda {

// A normal dispatch's handle: the routing's device tensors and its plan, for cached dispatches and combine.
class NormalDispatchHandle final : public DispatchHandle {
 public:
  int64_t num_tokens() const override { return plan.num_tokens; }
  int64_t num_recv_tokens() const override { return plan.num_recv; }
  const Tensor& rank_prefix_matrix() const override { return rank_prefix; }

  const void* owner = nullptr;  // the engine that made it
  uint64_t id = 0;              // NormalCallHooks::call_id of the dispatch that made it (alike on every rank)
  int64_t num_rows = 0;         // rows of the dispatch outputs
  DispatchPlan plan;
  Tensor is_token_in_rank;    // uint8 [T, R]
  Tensor excl_pos;            // int32 [R][T + 1]
  Tensor list_tok;            // int32 [R][T]
  Tensor chan_start;          // int32 [R][C + 1]
  Tensor recv_meta;           // int32 RecvMetaLayout
  Tensor recv_expert_counts;  // int32 [E_local]
  Tensor rank_prefix;         // int32 [R, R], written by notify
  Tensor num_tokens_per_expert;  // int32 [E]: the layout's, from begin_fresh until notify read it
};

namespace {

bool capturing(Stream stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &status), "cudaStreamIsCapturing");
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace

NormalEngine::NormalEngine(Group& group, int num_sms, int64_t num_normal_bytes, std::shared_ptr<Allocator> allocator,
                           const NormalConfig& config)
    : group_(group),
      allocator_(std::move(allocator)),
      rank_(group.rank()),
      num_ranks_(group.num_ranks()),
      device_(group.device().index),
      config_(config),
      timeline_(config.stage_timeline) {
  EPX_CHECK(ErrorCode::kUnsupported, num_ranks_ <= kNormalMaxRanks,
            "the cuda backend supports up to {} ranks per host, got {}", kNormalMaxRanks, num_ranks_);
  num_channels_ = std::clamp(num_sms / 2, 1, kNormalMaxChannels);
  num_sms_ = std::max(1, num_sms);
  EPX_CHECK_ARG(num_sms <= 2 * kNormalMaxChannels, "num_sms must be <= {} on the cuda backend, got {}",
                2 * kNormalMaxChannels, num_sms);
  int64_t bytes = num_normal_bytes;
  if (bytes == 0) bytes = normal_buffer_size_hint(8192, num_ranks_, num_sms);
  EPX_CHECK_ARG(bytes > kNormalSignalBytes, "num_normal_bytes must be > {} (signals) on the cuda backend, got {}",
                kNormalSignalBytes, bytes);
  region_bytes_ = align_up(bytes, 4096);

  DeviceGuard guard(device_);
  check_cuda(cudaMalloc(&region_, region_bytes_), "cudaMalloc (peer region)");
  check_cuda(cudaMemset(region_, 0, kNormalSignalBytes), "cudaMemset (signals)");
  check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&errors_), 2 * sizeof(ErrorRecord),
                           cudaHostAllocMapped | cudaHostAllocPortable),
             "cudaHostAlloc (error records)");
  std::memset(errors_, 0, 2 * sizeof(ErrorRecord));
  check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&errors_device_), errors_, 0),
             "cudaHostGetDevicePointer");
  check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&meta_host_), sizeof(int32_t) * 8192, cudaHostAllocPortable),
             "cudaHostAlloc (receive counts)");
  copy_ = std::make_unique<NormalCopyEngines>(config_.stream_signals, timeline_);
  // NOTE: load every protocol kernel now, before the buffer's barrier: with lazy loading a kernel's first
  // launch waits for the device to drain, which deadlocks against a peer's spinning kernel when ranks
  // share a process and a GPU (see preload_normal_kernels).
  check_cuda(preload_normal_kernels(), "cudaFuncGetAttributes (preload normal kernels)");

  comm_.rank = rank_;
  comm_.num_ranks = num_ranks_;
  comm_.num_channels = num_channels_;
  const NormalRegionLayout region = NormalRegionLayout::make(num_ranks_, num_channels_, region_bytes_);
  comm_.off_epoch = region.off_epoch;
  comm_.off_tail = region.off_tail;
  comm_.off_head = region.off_head;
  comm_.off_done = region.off_done;
  comm_.off_notify_flag = region.off_notify_flag;
  comm_.off_notify = region.off_notify;
  comm_.off_copy_counter = region.off_copy_counter;
  comm_.off_ce_tail = region.off_ce_tail;
  comm_.off_abort = region.off_abort;
  comm_.off_handle_id = region.off_handle_id;
  comm_.signal_bytes = kNormalSignalBytes;
  comm_.off_ring = region.off_ring;
  comm_.ring_bytes = region.ring_bytes;
  comm_.ring_slab_bytes = region.ring_slab_bytes;
  comm_.timeout_ns = static_cast<uint64_t>(detail::timeout_ns(group_.timeout_ms()));
  comm_.error = errors_device_;
}

NormalEngine::~NormalEngine() {
  DeviceGuard guard(device_);
  close_peer_regions(peer_regions_);
  copy_.reset();
  cudaFree(region_);
  cudaFreeHost(errors_);
  cudaFreeHost(meta_host_);
}

void NormalEngine::open_peers(bool single_process, int gpus_per_node) {
  peer_regions_ = open_peer_regions(group_, single_process, region_, device_, gpus_per_node);
  for (int r = 0; r < num_ranks_; ++r) comm_.peers[r] = peer_regions_.ptrs[r];
}

void NormalEngine::reset_signals(Stream stream) {
  check_cuda(cudaMemsetAsync(region_, 0, kNormalSignalBytes, stream), "cudaMemsetAsync (reset)");
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize (reset)");
  copy_->reset_tags();
  std::memset(errors_, 0, 2 * sizeof(ErrorRecord));
}

int64_t NormalEngine::ring_rows_for(int64_t row_bytes) const {
  const int64_t rows = comm_.ring_slab_bytes / row_bytes;
  EPX_CHECK_ARG(rows >= kNormalMinRingRows,
                "num_normal_bytes too small: rows of {} bytes need >= {} bytes of ring per rank and channel "
                "({} ranks, {} channels), have {} in all",
                row_bytes, kNormalMinRingRows * row_bytes, num_ranks_, num_channels_, comm_.ring_bytes);
  return std::min(rows, kNormalMaxRingRows);
}

Layout NormalEngine::get_dispatch_layout(const TensorView& topk_idx, int64_t num_experts, Stream stream,
                                         NormalCallHooks& hooks) {
  ep::validate_layout_args(topk_idx, num_experts, num_ranks_, group_.device());
  EPX_CHECK_ARG(num_experts <= kNormalMaxExperts, "num_experts must be <= {} on the cuda backend, got {}",
                kNormalMaxExperts, num_experts);
  DeviceGuard guard(device_);
  hooks.raise_recorded_errors();
  return compute_layout(topk_idx, num_experts, stream);
}

Layout NormalEngine::compute_layout(const TensorView& topk_idx, int64_t num_experts, Stream stream) {
  const int64_t T = topk_idx.shape[0];
  Layout layout;
  // One allocation for all three outputs (launch_layout zeroes the counts where its kernel needs it).
  const int64_t count_bytes = align_up(4 * (num_ranks_ + num_experts), 256);
  const Tensor all = empty(DType::kUInt8, {count_bytes + T * num_ranks_}, stream);
  auto storage = std::make_shared<Tensor>(all);
  auto* counts = all.data_as<int32_t>();
  layout.num_tokens_per_rank =
      Tensor::wrap(TensorView::of(counts, DType::kInt32, {num_ranks_}, group_.device()), storage);
  layout.num_tokens_per_expert =
      Tensor::wrap(TensorView::of(counts + num_ranks_, DType::kInt32, {num_experts}, group_.device()), storage);
  layout.is_token_in_rank = Tensor::wrap(
      TensorView::of(all.data_as<uint8_t>() + count_bytes, DType::kBool, {T, num_ranks_}, group_.device()), storage);
  launch_layout(topk_idx.data, topk_idx.dtype == DType::kInt64, T, static_cast<int>(topk_idx.shape[1]), num_experts,
                num_ranks_, layout.num_tokens_per_rank.data_as<int32_t>(),
                layout.num_tokens_per_expert.data_as<int32_t>(), layout.is_token_in_rank.data_as<uint8_t>(),
                errors_device_ + 1, rank_, stream);
  check_cuda(cudaGetLastError(), "layout kernel launch");
  return layout;
}

void NormalEngine::read_counts(const NormalDispatchHandle& h, Stream stream, const char* what) {
  check_cuda(cudaMemcpyAsync(meta_host_, h.recv_meta.data(), h.plan.meta.size() * sizeof(int32_t),
                             cudaMemcpyDeviceToHost, stream),
             "cudaMemcpyAsync (receive counts)");
  check_cuda(cudaStreamSynchronize(stream), what);
}

std::shared_ptr<NormalDispatchHandle> NormalEngine::begin_fresh(const DispatchArgs& args,
                                                                const ep::DispatchShape& shape, uint64_t shape_word,
                                                                NormalCallHooks& hooks) {
  const int64_t T = shape.num_tokens;
  Stream stream = args.stream;
  auto handle = std::make_shared<NormalDispatchHandle>();
  handle->owner = this;
  handle->id = hooks.call_id();
  const int num_local_experts = static_cast<int>(args.num_experts / num_ranks_);
  const int R = num_ranks_, C = num_channels_;
  handle->plan.num_tokens = T;
  handle->plan.meta = RecvMetaLayout{R, C, num_local_experts};
  if (args.layout != nullptr) {
    const Layout& l = *args.layout;
    check_tensor(l.is_token_in_rank, "layout->is_token_in_rank", DType::kBool, {T, num_ranks_});
    check_device(l.is_token_in_rank, "layout->is_token_in_rank", group_.device());
    check_tensor(l.num_tokens_per_expert, "layout->num_tokens_per_expert", DType::kInt32, {args.num_experts});
    check_device(l.num_tokens_per_expert, "layout->num_tokens_per_expert", group_.device());
    // The handle outlives the caller's layout: keep a copy of the routing.
    handle->is_token_in_rank = empty(DType::kBool, {T, num_ranks_}, stream);
    check_cuda(cudaMemcpyAsync(handle->is_token_in_rank.data(), l.is_token_in_rank.data(), T * num_ranks_,
                               cudaMemcpyDeviceToDevice, stream),
               "cudaMemcpyAsync (is_token_in_rank)");
    handle->num_tokens_per_expert = l.num_tokens_per_expert;
  } else {
    Layout l = compute_layout(args.topk_idx, args.num_experts, stream);
    handle->is_token_in_rank = l.is_token_in_rank;
    handle->num_tokens_per_expert = l.num_tokens_per_expert;
  }
  handle->excl_pos = empty(DType::kInt32, {R, T + 1}, stream);
  handle->list_tok = empty(DType::kInt32, {R, std::max<int64_t>(T, 1)}, stream);
  handle->chan_start = empty(DType::kInt32, {R, C + 1}, stream);
  launch_scan(handle->is_token_in_rank.data_as<uint8_t>(), T, R, C, handle->excl_pos.data_as<int32_t>(),
              handle->list_tok.data_as<int32_t>(), handle->chan_start.data_as<int32_t>(), stream);
  handle->recv_meta = empty(DType::kInt32, {handle->plan.meta.size()}, stream);
  handle->recv_expert_counts = empty(DType::kInt32, {num_local_experts}, stream);
  handle->rank_prefix = empty(DType::kInt32, {R, R}, stream);
  hooks.mark_enqueued();
  launch_advance_epoch(comm_, handle->id, shape_word, stream);
  return handle;
}

void NormalEngine::notify(NormalDispatchHandle& h, const DispatchArgs& args, unsigned early_mask, uint64_t shape_word,
                          NormalCallHooks& hooks) {
  Stream stream = args.stream;
  const int num_local_experts = h.plan.meta.num_local_experts;
  launch_notify(comm_, h.chan_start.data_as<int32_t>(), h.num_tokens_per_expert.data_as<const int32_t>(),
                num_local_experts, args.expert_alignment, h.plan.num_tokens,
                config_.whole_copies && config_.copy_engines, early_mask, shape_word, h.recv_meta.data_as<int32_t>(),
                h.recv_expert_counts.data_as<int32_t>(), h.rank_prefix.data_as<int32_t>(), stream);
  check_cuda(cudaGetLastError(), "notify launch");
  // The per-expert counts were notify's only use of the layout's counts (the caller's, or this call's own).
  h.num_tokens_per_expert = Tensor();
  if (args.num_worst_tokens == 0) {
    read_counts(h, stream, "cudaStreamSynchronize (notify)");
    // A timeout, or shapes that differ (every rank found it): no data kernel follows.
    if (errors_[0].code != kErrNone) hooks.raise_recorded_errors();
    h.plan.learn_counts(meta_host_, config_, rank_);
  }
}

unsigned NormalEngine::early_copy_mask(const DispatchArgs& args, const DispatchKernelArgs& k,
                                       int64_t slot_bytes) const {
  // Two ranks only: every sender then copies early to all of its destinations or to none, and the one writer into a
  // rank's staging is its peer, which the SM fallback can wait for (launch_wait_early_copies).
  if (num_ranks_ != 2 || config_.early_copies == EarlyCopies::kNever || !config_.copy_engines ||
      !config_.whole_copies || args.num_worst_tokens > 0) {
    return 0;
  }
  const int64_t T = k.num_tokens;
  if (T == 0 || T > slot_rows(slot_bytes, k) || capturing(args.stream)) return 0;
  if (config_.early_copies == EarlyCopies::kAuto &&
      !ep::expect_dense_peer(args.num_experts, args.topk_idx.shape[1], last_fresh_tokens_, last_fresh_peer_rows_)) {
    return 0;
  }
  return 1u << (1 - rank_);
}

void NormalEngine::choose_dispatch_path(NormalStep& step, const DispatchPlan& plan, const DispatchArgs& args,
                                        const DispatchKernelArgs& k) const {
  // Copy-engine path: staging per source holds the fields of the largest transfer (StageFields).
  // The fields are laid out for as many rows as the slot holds (slot_rows), so an early copy (laid out before
  // notify) and the rest of the call agree.
  step.slot_bytes = 0;
  if (args.num_worst_tokens == 0 && plan.counts_known() && plan.slot_capacity_bytes > 0 && !capturing(args.stream)) {
    const int64_t rows = slot_rows(plan.slot_capacity_bytes, k);
    if (plan.max_pair_rows <= rows) {
      step.fields = stage_fields(rows, k);
      step.slot_bytes = plan.slot_capacity_bytes;
    }
  }
  step.path = step.slot_bytes > 0 ? NormalPath::kCopyEngine : NormalPath::kSmRing;
}

void NormalEngine::choose_combine_path(NormalStep& step, const DispatchPlan& plan, int64_t H, int K,
                                       Stream stream) const {
  // Copy-engine staging per source: x rows, then the top-k weights rows from weights_offset.
  if (plan.counts_known() && !capturing(stream)) {
    step.weights_offset = align_up(plan.max_pair_rows * H * 2, 256);
    step.slot_bytes = plan.copy_slot_bytes(step.weights_offset + plan.max_pair_rows * K * 4);
  }
  step.path = step.slot_bytes > 0 ? NormalPath::kCopyEngine : NormalPath::kSmRing;
}

DispatchResult NormalEngine::dispatch(const DispatchArgs& args, NormalCallHooks& hooks) {
  // Plan: checks and sizes on the host, nothing enqueued.
  const ep::DispatchShape shape = ep::validate_dispatch(args, num_ranks_, group_.device());
  const int num_sms = ep::resolve_num_sms(args.num_sms, num_sms_);
  const int64_t T = shape.num_tokens, H = shape.hidden;
  const int64_t x_row_bytes = H * static_cast<int64_t>(dtype_size(args.x.dtype));
  EPX_CHECK_ARG(x_row_bytes % 16 == 0, "x rows must be a multiple of 16 bytes on the cuda backend, got hidden = {}", H);
  EPX_CHECK_ARG(shape.num_topk <= kNormalMaxTopk, "topk_idx has {} columns; the cuda backend allows <= {}",
                shape.num_topk, kNormalMaxTopk);
  std::shared_ptr<const NormalDispatchHandle> cached;
  if (shape.is_cached) {
    cached = std::dynamic_pointer_cast<const NormalDispatchHandle>(args.handle);
    EPX_CHECK_ARG(cached != nullptr && cached->owner == this, "handle was not made by this buffer");
  } else {
    EPX_CHECK_ARG(args.num_experts / num_ranks_ <= kNormalMaxLocalExperts,
                  "num_experts / num_ranks must be <= {} on the cuda backend, got {}", kNormalMaxLocalExperts,
                  args.num_experts / num_ranks_);
    EPX_CHECK_ARG(args.num_experts <= kNormalMaxExperts, "num_experts must be <= {} on the cuda backend, got {}",
                  kNormalMaxExperts, args.num_experts);
  }
  const int64_t scale_row_bytes = shape.scale_bytes;
  const int K = shape.is_cached ? 0 : static_cast<int>(shape.num_topk);
  NormalStep step;
  step.row_bytes = align_up(align_up(x_row_bytes + scale_row_bytes, 4) + 8 * K + 4, 16);
  step.ring_rows = ring_rows_for(step.row_bytes);
  Stream stream = args.stream;
  DeviceGuard guard(device_);
  ep::NormalCallShape call_shape;
  call_shape.kind = cached ? ep::NormalCallKind::kCachedDispatch : ep::NormalCallKind::kFreshDispatch;
  call_shape.x_dtype = args.x.dtype;
  call_shape.hidden = H;
  if (args.x_scales.defined()) {
    call_shape.scales_dtype = args.x_scales.dtype;
    call_shape.scale_columns = args.x_scales.shape[1];
  }
  call_shape.num_topk = K;
  call_shape.topk_int64 = !shape.is_cached && args.topk_idx.dtype == DType::kInt64;
  call_shape.has_weights = K > 0 && args.topk_weights.defined();
  call_shape.num_experts = cached ? 0 : args.num_experts;
  call_shape.fixed_rows = args.num_worst_tokens > 0;
  call_shape.captured = capturing(stream);
  const uint64_t shape_word = ep::encode_call_shape(call_shape);
  hooks.begin_collective(stream, /*keep_invalid_topk=*/cached == nullptr);
  timeline_.mark("call", stream);

  // The routing: the fresh dispatch's layout, scan and epoch; the cached handle's plan otherwise.
  std::shared_ptr<NormalDispatchHandle> handle;
  if (cached) {
    handle = std::make_shared<NormalDispatchHandle>(*cached);
    hooks.mark_enqueued();
    launch_advance_epoch(comm_, handle->id, shape_word, stream);
  } else {
    handle = begin_fresh(args, shape, shape_word, hooks);
  }
  DispatchPlan& plan = handle->plan;

  // Strided scales (e.g. column-major): one gather into a contiguous copy, which lives to the call's end
  // (its deleter frees on `stream` after the side streams joined it).
  Tensor scales_copy;
  const char* x_scales = static_cast<const char*>(args.x_scales.defined() ? args.x_scales.data : nullptr);
  if (args.x_scales.defined() && !args.x_scales.is_contiguous()) {
    const TensorView& s = args.x_scales;
    scales_copy = empty(s.dtype, {T, s.shape[1]}, stream);
    launch_gather_scales(s.data, s.strides[0], s.strides[1], static_cast<int>(dtype_size(s.dtype)), T, s.shape[1],
                         scales_copy.data(), stream);
    x_scales = static_cast<const char*>(scales_copy.data());
  }
  DispatchKernelArgs k{};
  k.x = static_cast<const char*>(args.x.data);
  k.x_scales = x_scales;
  k.topk_idx = shape.is_cached ? nullptr : args.topk_idx.data;
  k.topk_is_int64 = !shape.is_cached && args.topk_idx.dtype == DType::kInt64;
  k.topk_weights = args.topk_weights.defined() ? args.topk_weights.data_as<const float>() : nullptr;
  k.has_weights = K > 0 && args.topk_weights.defined();
  k.num_topk = K;
  k.num_local_experts = plan.meta.num_local_experts;
  k.num_tokens = T;
  k.x_row_bytes = x_row_bytes;
  k.scale_row_bytes = scale_row_bytes;
  k.list_tok = handle->list_tok.data_as<const int32_t>();
  k.chan_start = handle->chan_start.data_as<const int32_t>();
  k.recv_meta = handle->recv_meta.data_as<const int32_t>();
  k.worst_mode = args.num_worst_tokens > 0;
  k.ring_rows = step.ring_rows;
  k.row_bytes = step.row_bytes;
  k.handle_id = handle->id;
  k.shape_word = shape_word;

  // Early copies (fresh, two ranks): the whole-x copy to the peer starts now, before notify and its host sync, into
  // staging laid out from the buffer's size alone (slot_rows), as the copy-engine path lays it out after notify.
  const int64_t early_slot_bytes = slot_capacity_bytes(comm_.ring_bytes >> 10, num_ranks_);
  const unsigned early = cached ? 0u : early_copy_mask(args, k, early_slot_bytes);
  // NOTE: from here until the call joins the side streams they may read x, the scales copy and the packing stage: a
  // call that leaves by an exception joins them first, so the caller may free x once the stream passed the call.
  Tensor pack_stage;
  const JoinOnThrow join_on_throw(*copy_, stream);
  if (early != 0) {
    plan.early_mask = early;
    plan.dispatch_chunks = copy_chunks(T, config_.max_copy_chunks);
    step.fields = stage_fields(slot_rows(early_slot_bytes, k), k);
    step.slot_bytes = early_slot_bytes;
    copy_->send_dispatch(comm_, k, plan, step.fields, step.slot_bytes, nullptr, nullptr, num_sms, stream);
  }
  if (!cached) notify(*handle, args, early, shape_word, hooks);
  if (args.num_worst_tokens == 0 && plan.num_recv < 0) {
    // A cached dispatch without num_worst_tokens after a worst-token dispatch: learn the counts now.
    read_counts(*handle, stream, "cudaStreamSynchronize (counts)");
    plan.learn_counts(meta_host_, config_, rank_);
  }
  if (!cached && num_ranks_ == 2 && plan.counts_known()) {
    last_fresh_tokens_ = T;
    last_fresh_peer_rows_ = plan.send_rows.v[1 - rank_];
  }
  const int64_t N = args.num_worst_tokens > 0 ? args.num_worst_tokens : plan.num_recv;
  handle->num_rows = N;
  k.num_out_rows = N;
  const NormalStep early_step = step;
  choose_dispatch_path(step, plan, args, k);
  EPX_CHECK(ErrorCode::kInternal,
            early == 0 || step.path != NormalPath::kCopyEngine ||
                (step.slot_bytes == early_step.slot_bytes && step.fields.end == early_step.fields.end),
            "cuda rank {}: the early copies' staging ({} bytes) differs from the dispatch's ({} bytes)", rank_,
            early_step.fields.end, step.fields.end);
  // Sources that copied early into this rank's staging (this call only; a cached dispatch copies nothing early).
  const unsigned early_in = cached ? 0u : plan.early_sources();
  if (step.path == NormalPath::kSmRing && (early | early_in) != 0) {
    // A transfer did not fit the staging after all (a peer's tokens): the SM rings, whose memory the early copies
    // share, may start once every early copy landed. The copy-engine tags move on alike on both ranks.
    if (early != 0) {
      copy_->join(stream);
    } else {
      copy_->count_operation();
    }
    if (early_in != 0) launch_wait_early_copies(comm_, k.recv_meta, k.num_local_experts, copy_->tag(), stream);
  }

  // Run: only enqueues. The copy-engine send side comes first: the transfers need no outputs, and the host's
  // time before them counts.
  if (step.path == NormalPath::kCopyEngine && early == 0) {
    char *stage_x = nullptr, *stage_scales = nullptr;
    if (plan.num_packed_rows > 0) {
      pack_stage = empty(DType::kUInt8, {plan.num_packed_rows * (k.x_row_bytes + k.scale_row_bytes)}, stream);
      stage_x = static_cast<char*>(pack_stage.data());
      stage_scales = stage_x + plan.num_packed_rows * k.x_row_bytes;
    }
    copy_->send_dispatch(comm_, k, plan, step.fields, step.slot_bytes, stage_x, stage_scales, num_sms, stream);
  }
  DispatchResult result;
  result.recv_x = empty(args.x.dtype, {N, H}, stream);
  if (args.x_scales.defined()) result.recv_x_scales = empty(args.x_scales.dtype, {N, args.x_scales.shape[1]}, stream);
  if (!shape.is_cached) {
    result.recv_topk_idx = empty(args.topk_idx.dtype, {N, K}, stream);
    if (args.topk_weights.defined()) result.recv_topk_weights = empty(DType::kFloat32, {N, K}, stream);
  }
  result.recv_src_idx = empty(DType::kInt32, {N}, stream);
  k.out_x = static_cast<char*>(result.recv_x.data());
  k.out_scales = static_cast<char*>(result.recv_x_scales.defined() ? result.recv_x_scales.data() : nullptr);
  k.out_topk_idx = result.recv_topk_idx.defined() ? result.recv_topk_idx.data() : nullptr;
  k.out_topk_weights = result.recv_topk_weights.defined() ? result.recv_topk_weights.data_as<float>() : nullptr;
  k.out_src_idx = result.recv_src_idx.data_as<int32_t>();
  if (step.path == NormalPath::kCopyEngine) {
    launch_unpack_fields(comm_, k, step.fields, step.slot_bytes, copy_->tag(), num_sms, stream);
    timeline_.mark("unpack", stream);
    copy_->join(stream);
    timeline_.mark("end", stream);
    timeline_.print(rank_, "dispatch");
  } else {
    timeline_.discard();
    launch_dispatch(comm_, k, num_sms, stream);
  }
  check_cuda(cudaGetLastError(), "dispatch launch");

  result.recv_expert_counts = handle->recv_expert_counts;
  result.rank_prefix_matrix = handle->rank_prefix;
  if (args.num_worst_tokens == 0) result.num_recv_tokens_per_expert = plan.expert_counts_host;
  result.handle = handle;
  // A bad topk_idx found by the layout kernel: raised after the data kernels, so that no peer is left
  // waiting. With the host synchronization (num_worst_tokens == 0) notify told every rank, so the whole
  // call fails on every rank: kInvalidArgument on the rank with the bad input, kPeerFailure on the others.
  // Without it (worst-token mode, graph capture) only this rank learns, here or on its next call.
  if (errors_[1].code != kErrNone) hooks.raise_recorded_errors();
  if (cached == nullptr && args.num_worst_tokens == 0) {
    const int32_t failed = plan.meta_host[plan.meta.failed_source()];
    EPX_CHECK(ErrorCode::kPeerFailure, failed < 0,
              "cuda rank {}: rank {} passed an invalid topk_idx entry to this dispatch (its bad entries were "
              "dropped); the dispatch failed on every rank, the buffer stays usable",
              rank_, failed);
  }
  return result;
}

CombineResult NormalEngine::combine(const CombineArgs& args, NormalCallHooks& hooks) {
  // Plan: checks and sizes on the host, nothing enqueued.
  auto handle = std::dynamic_pointer_cast<const NormalDispatchHandle>(args.handle);
  EPX_CHECK_ARG(handle != nullptr && handle->owner == this, "handle was not made by this buffer's dispatch");
  ep::validate_combine(args, handle->plan.num_tokens, handle->num_rows, group_.device());
  const int num_sms = ep::resolve_num_sms(args.num_sms, num_sms_);
  const int64_t H = args.x.shape[1];
  EPX_CHECK_ARG(H % 8 == 0, "x hidden size must be a multiple of 8 on the cuda backend, got {}", H);
  const int K = args.topk_weights.defined() ? static_cast<int>(args.topk_weights.shape[1]) : 0;
  EPX_CHECK_ARG(K <= kNormalMaxTopk, "topk_weights has {} columns; the cuda backend allows <= {}", K, kNormalMaxTopk);
  NormalStep step;
  step.row_bytes = align_up(H * 2 + 4 * K, 16);
  step.ring_rows = ring_rows_for(step.row_bytes);
  Stream stream = args.stream;
  DeviceGuard guard(device_);
  hooks.begin_collective(stream, /*keep_invalid_topk=*/false);
  timeline_.mark("call", stream);
  const DispatchPlan& plan = handle->plan;
  const int64_t T = plan.num_tokens;
  CombineKernelArgs k{};
  k.x = args.x.data_as<const uint16_t>();
  k.topk_weights = K > 0 ? args.topk_weights.data_as<const float>() : nullptr;
  k.bias_0 = args.bias_0.defined() ? args.bias_0.data_as<const uint16_t>() : nullptr;
  k.bias_1 = args.bias_1.defined() ? args.bias_1.data_as<const uint16_t>() : nullptr;
  k.num_topk = K;
  k.hidden = H;
  k.num_tokens = T;
  k.is_token_in_rank = handle->is_token_in_rank.data_as<const uint8_t>();
  k.excl_pos = handle->excl_pos.data_as<const int32_t>();
  k.chan_start = handle->chan_start.data_as<const int32_t>();
  k.recv_meta = handle->recv_meta.data_as<const int32_t>();
  k.ring_rows = step.ring_rows;
  k.row_bytes = step.row_bytes;
  k.handle_id = handle->id;
  if (args.order_topk_idx.defined()) {
    k.order_topk = args.order_topk_idx.data;
    k.order_is_int64 = args.order_topk_idx.dtype == DType::kInt64;
    k.order_num_topk = static_cast<int>(args.order_topk_idx.shape[1]);
    k.order_stride_t = args.order_topk_idx.strides[0];
    k.order_stride_k = args.order_topk_idx.strides[1];
    k.experts_per_rank = plan.meta.num_local_experts;
  }
  ep::NormalCallShape call_shape;
  call_shape.kind = ep::NormalCallKind::kCombine;
  call_shape.x_dtype = args.x.dtype;
  call_shape.hidden = H;
  call_shape.num_topk = K;
  call_shape.has_weights = K > 0;
  call_shape.captured = capturing(stream);
  k.shape_word = ep::encode_call_shape(call_shape);
  hooks.mark_enqueued();
  launch_advance_epoch(comm_, handle->id, k.shape_word, stream);
  choose_combine_path(step, plan, H, K, stream);

  // Run: only enqueues. The copy-engine sends first: they need no outputs (as in dispatch).
  const JoinOnThrow join_on_throw(*copy_, stream);
  if (step.path == NormalPath::kCopyEngine) {
    copy_->send_combine(comm_, k, plan, step.slot_bytes, step.weights_offset, stream);
  }
  CombineResult result;
  result.x = empty(DType::kBFloat16, {T, H}, stream);
  if (K > 0) result.topk_weights = empty(DType::kFloat32, {T, K}, stream);
  k.out = result.x.data_as<uint16_t>();
  k.out_topk_weights = K > 0 ? result.topk_weights.data_as<float>() : nullptr;
  if (step.path == NormalPath::kCopyEngine) {
    launch_combine_reduce(comm_, k, step.slot_bytes, step.weights_offset, copy_->tag(), num_sms, stream);
    copy_->join(stream);
    timeline_.mark("reduce", stream);
    timeline_.print(rank_, "combine");
  } else {
    timeline_.discard();
    launch_combine(comm_, k, num_sms, stream);
  }
  check_cuda(cudaGetLastError(), "combine launch");
  return result;
}

}  // namespace epx::cuda
