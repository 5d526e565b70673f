#include "ep/cuda/low_latency_engine.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/cuda/cuda_util.h"
#include "core/timeout.h"
#include "ep/low_latency_scales.h"
#include "epx/log.h"

namespace epx::cuda {
namespace {

class CudaLowLatencyHandle final : public LowLatencyHandle {
 public:
  const void* owner = nullptr;
  int set = 0;
  uint32_t dispatch_id = 0;  // the dispatch's number since the last clean (alike on every rank)
  ep::LowLatencyShape shape;
  int64_t max_tokens = 0;
};

// The kernels' pointer for LowLatency{Dispatch,Combine}Args::wait_recv_cost_ns (validated: [R] int64 on this
// device), or null. The hierarchical routing's kernels do not record waits.
unsigned long long* wait_cost_of(const TensorView& stats, bool hierarchical) {
  if (!stats.defined()) return nullptr;
  EPX_CHECK(ErrorCode::kUnsupported, !hierarchical,
            "wait_recv_cost_ns: the cuda hierarchical low-latency routing does not record wait times; the flat "
            "routing does (BufferOptions::low_latency_routing)");
  return static_cast<unsigned long long*>(stats.data);
}

// Calls `fn` once, however often the returned hook runs.
std::function<void()> once(std::function<void()> fn) {
  auto done = std::make_shared<bool>(false);
  return [fn = std::move(fn), done] {
    if (*done) return;
    *done = true;
    fn();
  };
}

}  // namespace

LowLatencyEngine::LowLatencyEngine(Group& group, bool single_process, int device, int64_t bytes,
                                   std::shared_ptr<Allocator> allocator, const LowLatencyConfig& config,
                                   CudaGroup* relay_group, NodePartials node_partials)
    : group_(group),
      device_(device),
      rank_(group.rank()),
      num_ranks_(group.num_ranks()),
      region_bytes_(bytes),
      allocator_(std::move(allocator)),
      config_(config) {
  if (relay_group == nullptr) {
    EPX_CHECK(ErrorCode::kUnsupported, num_ranks_ <= kLowLatencyFlatMaxRanks,
              "the cuda backend's flat low-latency routing supports up to {} ranks, got {}: use low_latency_routing "
              "kHierarchical (or kAuto with gpus_per_node < num_ranks), up to {} ranks",
              kLowLatencyFlatMaxRanks, num_ranks_, kLowLatencyMaxRanks);
  } else {
    EPX_CHECK(ErrorCode::kUnsupported,
              num_ranks_ <= kLowLatencyMaxRanks && group.topology().gpus_per_node <= kLowLatencyFlatMaxRanks,
              "the cuda backend's hierarchical low-latency routing supports up to {} ranks of up to {} GPUs per node, "
              "got {} ranks of {}",
              kLowLatencyMaxRanks, kLowLatencyFlatMaxRanks, num_ranks_, group.topology().gpus_per_node);
  }
  DeviceGuard guard(device_);
  char* raw = nullptr;
  check_cuda(cudaMalloc(&raw, region_bytes_), "cudaMalloc (low-latency region)");
  region_ = std::shared_ptr<char>(raw, [device = device_](char* p) {
    DeviceGuard g(device);
    cudaFree(p);
  });
  // NOTE: signals are compared against tags >= 1, so a zeroed region holds no valid signal.
  check_cuda(cudaMemset(raw, 0, region_bytes_), "cudaMemset (low-latency region)");
  check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&error_), sizeof(ErrorRecord),
                           cudaHostAllocMapped | cudaHostAllocPortable),
             "cudaHostAlloc (low-latency error record)");
  std::memset(error_, 0, sizeof(ErrorRecord));
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  const int gpus_per_node = relay_group != nullptr ? group_.topology().gpus_per_node : 0;
  peers_map_ = open_peer_regions(group_, single_process, raw, device_, gpus_per_node);
  peers_.gpus_per_node = gpus_per_node;
  peers_.rank = rank_;
  peers_.num_ranks = num_ranks_;
  for (int r = 0; r < num_ranks_; ++r) peers_.bases[r] = peers_map_.ptrs[r];
  ErrorRecord* error_device = nullptr;
  check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_device), error_, 0), "cudaHostGetDevicePointer");
  peers_.error = error_device;
  peers_.timeout_ns = static_cast<uint64_t>(detail::timeout_ns(group_.timeout_ms()));
  if (relay_group != nullptr)
    relay_ = std::make_unique<LowLatencyRelay>(*relay_group, device_, node_partials);  // collective
  {
    // Ranks on this rank's GPU, by the GPU's UUID (ranks of one process or of several), gathered whatever the
    // options (a collective must not depend on them: a rank with other options would otherwise hang here instead of
    // failing the agreement). With a shared GPU each rank's combine grid takes its share of the GPU's resident blocks
    // (shared_gpu_combine_grid: a receive that spins, or the expert-side reduction's send that waits for weights,
    // must leave room for the peers' blocks).
    cudaDeviceProp prop{};
    check_cuda(cudaGetDeviceProperties(&prop, device_), "cudaGetDeviceProperties");
    std::vector<cudaUUID_t> uuids(num_ranks_);
    group_.all_gather_bytes(&prop.uuid, uuids.data(), sizeof(cudaUUID_t));
    const int sharing = static_cast<int>(std::count_if(uuids.begin(), uuids.end(), [&](const cudaUUID_t& u) {
      return std::memcmp(&u, &prop.uuid, sizeof(cudaUUID_t)) == 0;
    }));
    if (relay_group == nullptr) shared_gpu_ = shared_gpu_combine_grid(sharing);
  }
  group_.barrier();
}

LowLatencyEngine::~LowLatencyEngine() {
  DeviceGuard guard(device_);
  try {
    // NCCL: a network exchange whose peer never posted would keep the device synchronize below waiting forever.
    if (relay_) relay_->wait_exchanges();
  } catch (...) {
  }
  cudaDeviceSynchronize();
  try {
    group_.barrier();  // peers may still write into this region until they finished their last call
  } catch (...) {
  }
  relay_.reset();
  close_peer_regions(peers_map_);
  cudaFreeHost(error_);
}

void LowLatencyEngine::ensure_layout(int64_t max_tokens, int64_t hidden, int64_t num_experts) {
  if (has_layout_) {
    EPX_CHECK_ARG(
        max_tokens == layout_.max_tokens_per_rank && hidden == layout_.hidden && num_experts == layout_.num_experts,
        "a low-latency buffer keeps the (max_tokens_per_rank, hidden, num_experts) of its first call: "
        "({}, {}, {}), got ({}, {}, {})",
        layout_.max_tokens_per_rank, layout_.hidden, layout_.num_experts, max_tokens, hidden, num_experts);
    return;
  }
  EPX_CHECK_ARG(max_tokens <= kLowLatencyMaxTokens, "max_tokens_per_rank must be <= {} on the cuda backend, got {}",
                kLowLatencyMaxTokens, max_tokens);
  const LowLatencyLayout layout = LowLatencyLayout::make(max_tokens, hidden, num_ranks_, num_experts);
  EPX_CHECK_ARG(layout.total_bytes <= region_bytes_,
                "num_low_latency_bytes ({}) is too small for max_tokens_per_rank {}, hidden {}, {} experts on {} "
                "ranks: need {} (see low_latency_buffer_size_hint)",
                region_bytes_, max_tokens, hidden, num_experts, num_ranks_, layout.total_bytes);
  layout_ = layout;
  has_layout_ = true;
}

void LowLatencyEngine::report_device_events() {
  if (error_->code == kErrNone) return;
  ErrorRecord e;
  std::memcpy(&e, error_, sizeof(e));
  error_->code = kErrNone;
  if (e.code == kErrHandleMismatch) {
    detail::raise(ErrorCode::kInvalidArgument,
                  "low-latency combine on rank {}: rank {} combined with the handle of another low-latency dispatch "
                  "(dispatch ids {} here, {} there, low {} bits); its rows for expert {} were left out of this rank's "
                  "output: every rank must pass the handle of the same dispatch",
                  rank_, e.peer, e.expected, e.observed, kCombineIdWidth, e.channel);
  }
  if (e.code == kErrExpertOverflow) {
    detail::raise(ErrorCode::kInvalidArgument,
                  "low-latency dispatch on rank {}: {} pairs chose expert {}, more than max_tokens_per_rank = {} "
                  "(a token chose the same expert twice); the excess pairs were dropped",
                  rank_, e.observed, e.channel, e.expected);
  }
  const std::string message = fmt::format(
      "epx cuda rank {}: low-latency {} waited past the timeout for rank {} (expert {}, expected tag {}, observed "
      "{:#x}); rank {} is now masked",
      rank_, e.where == kSiteLowLatencyDispatchRecv ? "dispatch" : "combine", e.peer, e.channel, e.expected,
      static_cast<uint64_t>(e.observed), e.peer);
  if (config_.raise_on_timeout) pending_timeout_ += (pending_timeout_.empty() ? "" : "; ") + message;
  log(LogLevel::kWarn, message);
}

void LowLatencyEngine::raise_pending_timeout() {
  if (pending_timeout_.empty()) return;
  const std::string what = std::move(pending_timeout_);
  pending_timeout_.clear();
  detail::raise(ErrorCode::kTimeout,
                "{}; the outputs of the calls since lack its contributions (LowLatencyConfig::raise_on_timeout); "
                "unmask it once it is back",
                what);
}

int* LowLatencyEngine::device_mask() const {
  return reinterpret_cast<int*>(region_.get() + layout_.control_offset + offsetof(LowLatencyControl, mask));
}

LowLatencyDispatchResult LowLatencyEngine::dispatch(const LowLatencyDispatchArgs& args) {
  const ep::LowLatencyShape shape = ep::validate_low_latency_dispatch(args, num_ranks_, group_.device());
  if (args.cumulative_recv_counts.defined()) {
    check_tensor(args.cumulative_recv_counts, "cumulative_recv_counts", DType::kInt32, {shape.num_local_experts});
    check_device(args.cumulative_recv_counts, "cumulative_recv_counts", group_.device());
  }
  ensure_layout(args.max_tokens_per_rank, shape.hidden, args.num_experts);
  DeviceGuard guard(device_);
  report_device_events();
  const int set = static_cast<int>(num_dispatches_++ % 2);
  const ep::LowLatencyScales scales = ep::LowLatencyScales::of(args, shape.hidden);
  const LowLatencyDispatchLaunch launch{
      args.x.data, args.topk_idx.data, args.topk_idx.dtype == DType::kInt64, shape.num_tokens,
      static_cast<int>(shape.num_topk), args.use_fp8, scales.wire_ue8m0, scales.out_fp32, scales.column_major,
      args.cumulative_recv_counts.defined() ? args.cumulative_recv_counts.data_as<int>() : nullptr,
      // The relay's forward writes rows per pair; M is the same on every rank (the layout).
      /*token_staged=*/relay_ == nullptr && layout_.max_tokens_per_rank >= config_.token_rows_min_tokens,
      // The flat routing's kernels only: the hierarchical receive follows the relay's event, not a kernel of ours.
      /*programmatic_launch=*/relay_ == nullptr && config_.programmatic_launch,
      /*pair_map=*/relay_ == nullptr && config_.expert_side_reduction,
      /*wait_cost=*/wait_cost_of(args.wait_recv_cost_ns, relay_ != nullptr)};
  auto stream = reinterpret_cast<cudaStream_t>(args.stream);
  if (relay_) {
    // Hierarchical: pack, network leg and forwarding on the relay's stream; the receive is the flat kernel's.
    relay_->ensure(layout_);
    relay_->send_dispatch(peers_, layout_, set, launch, stream);
    if (!args.return_recv_hook) {
      relay_->join_dispatch(set, stream);
      launch_low_latency_dispatch(ll::Phase::kRecv, peers_, layout_, set, launch, stream);
    }
  } else if (args.return_recv_hook) {
    launch_low_latency_dispatch(ll::Phase::kSend, peers_, layout_, set, launch, stream);
  } else {
    launch_low_latency_dispatch(ll::Phase::kBoth, peers_, layout_, set, launch, stream);
  }

  const LowLatencySet& s = layout_.sets[set];
  const int64_t e_local = layout_.num_local_experts, slots = num_ranks_ * layout_.max_tokens_per_rank;
  const Device dev = group_.device();
  char* base = region_.get();
  auto view = [&](int64_t offset, DType dtype, std::vector<int64_t> shape_) {
    return Tensor::wrap(TensorView::of(base + offset, dtype, shape_, dev), region_);
  };
  LowLatencyDispatchResult result;
  // The packed outputs the receive kernel fills (not the staging area the peers write).
  result.recv_x = view(s.recv_x, args.use_fp8 ? DType::kFloat8E4M3 : DType::kBFloat16, {e_local, slots, shape.hidden});
  if (args.use_fp8) {
    result.recv_x_scales = view(s.recv_x_scales, scales.dtype, scales.shape(e_local, slots));
  }
  result.recv_count = view(s.recv_count, DType::kInt32, {e_local});
  result.recv_src_info = view(s.recv_src_info, DType::kInt32, {e_local, slots});
  result.recv_layout_range = view(s.layout_range, DType::kInt64, {e_local, num_ranks_});
  auto handle = std::make_shared<CudaLowLatencyHandle>();
  handle->owner = this;
  handle->set = set;
  handle->dispatch_id = static_cast<uint32_t>(num_dispatches_);
  handle->shape = shape;
  handle->max_tokens = layout_.max_tokens_per_rank;
  result.handle = handle;
  if (args.return_recv_hook) {
    result.recv_hook = once([this, set, launch, stream] {
      DeviceGuard g(device_);
      if (relay_) relay_->join_dispatch(set, stream);
      launch_low_latency_dispatch(ll::Phase::kRecv, peers_, layout_, set, launch, stream);
    });
  }
  return result;
}

LowLatencyCombineResult LowLatencyEngine::combine(const LowLatencyCombineArgs& args) {
  const auto* handle = dynamic_cast<const CudaLowLatencyHandle*>(args.handle.get());
  EPX_CHECK_ARG(handle != nullptr && handle->owner == this,
                "handle must come from a low_latency_dispatch of this buffer");
  ep::validate_low_latency_combine(args, handle->shape, handle->max_tokens, num_ranks_, group_.device());
  DeviceGuard guard(device_);
  report_device_events();
  auto stream = reinterpret_cast<cudaStream_t>(args.stream);
  LowLatencyCombineResult result;
  const int64_t num_tokens = handle->shape.num_tokens;
  result.x = args.out.defined() ? Tensor::wrap(args.out, nullptr)
                                : Tensor::empty(DType::kBFloat16, {num_tokens, layout_.hidden}, group_.device(),
                                                allocator_, args.stream);
  const int set = static_cast<int>(num_combines_++ % 2);
  const LowLatencyCombineLaunch launch{args.x.data,
                                       args.topk_idx.data,
                                       args.topk_idx.dtype == DType::kInt64,
                                       args.topk_weights.data_as<const float>(),
                                       num_tokens,
                                       static_cast<int>(handle->shape.num_topk),
                                       result.x.data(),
                                       handle->set,
                                       config_.combine_send_parts,
                                       handle->dispatch_id,
                                       /*programmatic_launch=*/relay_ == nullptr && config_.programmatic_launch,
                                       /*expert_side=*/relay_ == nullptr && config_.expert_side_reduction,
                                       /*partial_send_blocks=*/shared_gpu_.send_blocks,
                                       /*recv_blocks=*/shared_gpu_.recv_blocks,
                                       /*wait_cost=*/wait_cost_of(args.wait_recv_cost_ns, relay_ != nullptr),
                                       /*solo_max_rows=*/config_.combine_solo_max_rows};
  if (relay_) {
    relay_->send_combine(peers_, layout_, set, launch, stream);
    if (!args.return_recv_hook) {
      relay_->receive_combine(peers_, layout_, set, launch, stream);
      raise_pending_timeout();
      return result;
    }
    result.recv_hook = once([this, set, launch, stream] {
      DeviceGuard g(device_);
      relay_->receive_combine(peers_, layout_, set, launch, stream);
      raise_pending_timeout();
    });
    return result;
  }
  if (!args.return_recv_hook) {
    launch_low_latency_combine(ll::Phase::kBoth, peers_, layout_, set, launch, stream);
    raise_pending_timeout();
    return result;
  }
  launch_low_latency_combine(ll::Phase::kSend, peers_, layout_, set, launch, stream);
  result.recv_hook = once([this, set, launch, stream] {
    DeviceGuard g(device_);
    launch_low_latency_combine(ll::Phase::kRecv, peers_, layout_, set, launch, stream);
    raise_pending_timeout();
  });
  return result;
}

void LowLatencyEngine::mask_rank(int rank) {
  EPX_CHECK_ARG(rank >= 0 && rank < num_ranks_ && rank != rank_,
                "mask_rank: rank must be in [0, {}) and not this rank ({}), got {}", num_ranks_, rank_, rank);
  DeviceGuard guard(device_);
  const int one = 1;
  check_cuda(cudaMemcpy(device_mask() + rank, &one, sizeof(int), cudaMemcpyHostToDevice), "cudaMemcpy (mask)");
}

void LowLatencyEngine::unmask_rank(int rank) {
  EPX_CHECK_ARG(rank >= 0 && rank < num_ranks_, "unmask_rank: rank must be in [0, {}), got {}", num_ranks_, rank);
  DeviceGuard guard(device_);
  const int zero = 0;
  check_cuda(cudaMemcpy(device_mask() + rank, &zero, sizeof(int), cudaMemcpyHostToDevice), "cudaMemcpy (mask)");
}

std::vector<bool> LowLatencyEngine::rank_mask() const {
  DeviceGuard guard(device_);
  int mask[kLowLatencyMaxRanks] = {};
  check_cuda(cudaMemcpy(mask, device_mask(), sizeof(int) * num_ranks_, cudaMemcpyDeviceToHost), "cudaMemcpy (mask)");
  std::vector<bool> out(num_ranks_);
  for (int r = 0; r < num_ranks_; ++r) out[r] = mask[r] != 0;
  return out;
}

void LowLatencyEngine::clean() {
  DeviceGuard guard(device_);
  // No peer may still write into this region (its last call's kernels) when it is zeroed, and none may
  // start the next call before every region is zero: a barrier on each side.
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize (clean_low_latency_buffer)");
  group_.barrier();
  check_cuda(cudaMemset(region_.get(), 0, region_bytes_), "cudaMemset (clean_low_latency_buffer)");
  if (relay_) relay_->clean();
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize (clean_low_latency_buffer)");
  error_->code = kErrNone;
  pending_timeout_.clear();  // the caller cleans after the failure: nothing left to report
  has_layout_ = false;
  num_dispatches_ = num_combines_ = 0;
  group_.barrier();
}

void LowLatencyEngine::clear_rank_mask() {
  DeviceGuard guard(device_);
  check_cuda(cudaMemset(device_mask(), 0, sizeof(int) * num_ranks_), "cudaMemset (mask)");
}

}  // namespace epx::cuda
