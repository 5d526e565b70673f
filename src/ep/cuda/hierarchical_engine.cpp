#include "ep/cuda/hierarchical_engine.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>

#include "core/check.h"
#include "core/cuda/cuda_util.h"
#include "core/limits.h"
#include "core/timeout.h"
#include "ep/cuda/hierarchical_kernels.h"
#include "ep/cuda/hierarchical_plan.h"
#include "ep/cuda/normal_kernels.h"
#include "ep/validate.h"

namespace epx::cuda {

namespace {

class HierarchicalHandle final : public DispatchHandle {
 public:
  int64_t num_tokens() const override { return routes->num_tokens; }
  int64_t num_recv_tokens() const override { return routes->num_recv; }
  const Tensor& rank_prefix_matrix() const override { return routes->rank_prefix; }

  const void* owner = nullptr;
  std::shared_ptr<const HierarchicalRoutes> routes;
  int64_t num_rows = 0;  // rows of the dispatch's outputs
};

}  // namespace

HierarchicalEngine::HierarchicalEngine(CudaGroup& group, std::shared_ptr<Allocator> allocator, int num_sms,
                                       NodePartials node_partials)
    : group_(group),
      allocator_(std::move(allocator)),
      topology_(group.topology()),
      rank_(group.rank()),
      num_ranks_(group.num_ranks()),
      device_(group.device().index),
      num_sms_(std::max(1, num_sms)),
      bf16_partials_(node_partials == NodePartials::kBFloat16) {
  EPX_CHECK(ErrorCode::kUnsupported, num_ranks_ <= kHierarchicalMaxRanks,
            "the cuda backend's hierarchical routing supports up to {} ranks, got {}", kHierarchicalMaxRanks,
            num_ranks_);
  EPX_CHECK(ErrorCode::kUnsupported, topology_.gpus_per_node <= hier::kMaxGpusPerNode,
            "the cuda backend's hierarchical routing supports up to {} GPUs per node, got {}", hier::kMaxGpusPerNode,
            topology_.gpus_per_node);
  DeviceGuard guard(device_);
  check_cuda(hier::preload_hierarchical_kernels(), "cudaFuncGetAttributes (preload hierarchical kernels)");
  check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&error_), 2 * sizeof(ErrorRecord),
                           cudaHostAllocMapped | cudaHostAllocPortable),
             "cudaHostAlloc (error record)");
  std::memset(error_, 0, 2 * sizeof(ErrorRecord));
  check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_device_), error_, 0), "cudaHostGetDevicePointer");
  // [R] per rank, [E] per expert, [N] per node, then the caller's [N] per node (route_locally).
  check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&counts_host_),
                           sizeof(int32_t) * (kNormalMaxExperts + 3 * kHierarchicalMaxRanks), cudaHostAllocPortable),
             "cudaHostAlloc (counts)");
  exchange_ = make_byte_exchange(group_);
}

HierarchicalEngine::~HierarchicalEngine() {
  DeviceGuard guard(device_);
  exchange_.reset();
  cudaFreeHost(error_);
  cudaFreeHost(counts_host_);
}

Tensor HierarchicalEngine::empty(DType dtype, const std::vector<int64_t>& shape, Stream stream) const {
  return Tensor::empty(dtype, shape, group_.device(), allocator_, stream);
}

void HierarchicalEngine::add_tokens_per_node(Layout& layout, Stream stream) {
  DeviceGuard guard(device_);
  layout.num_tokens_per_node = empty(DType::kInt32, {topology_.num_nodes}, stream);
  hier::launch_node_scan(layout.is_token_in_rank.data_as<const uint8_t>(), layout.is_token_in_rank.size(0),
                         topology_.num_nodes, topology_.gpus_per_node, nullptr, nullptr,
                         layout.num_tokens_per_node.data_as<int32_t>(), static_cast<cudaStream_t>(stream));
  check_cuda(cudaGetLastError(), "node scan launch");
}

HierarchicalEngine::LayoutOutput HierarchicalEngine::run_layout(const TensorView& topk_idx, int64_t E,
                                                                ErrorRecord* error, cudaStream_t stream) {
  const int R = num_ranks_, N = topology_.num_nodes;
  const int64_t T = topk_idx.shape[0];
  const int64_t count_bytes = (4 * (R + E + N) + 255) / 256 * 256;
  LayoutOutput out;
  out.storage = empty(DType::kUInt8, {count_bytes + T * R}, stream);
  out.counts = out.storage.data_as<int32_t>();
  out.in_rank = out.storage.data_as<uint8_t>() + count_bytes;
  launch_layout(topk_idx.data, topk_idx.dtype == DType::kInt64, T, static_cast<int>(topk_idx.shape[1]), E, R,
                out.counts, out.counts + R, out.in_rank, error, rank_, stream);
  check_cuda(cudaGetLastError(), "layout launch");
  return out;
}

Layout HierarchicalEngine::get_dispatch_layout(const TensorView& topk_idx, int64_t num_experts, Stream stream) {
  ep::validate_layout_args(topk_idx, num_experts, num_ranks_, group_.device());
  EPX_CHECK_ARG(num_experts <= kNormalMaxExperts, "num_experts must be <= {} on the cuda backend, got {}",
                kNormalMaxExperts, num_experts);
  EPX_CHECK_ARG(topk_idx.shape[1] <= kNormalMaxTopk, "topk_idx has {} columns; the cuda backend allows <= {}",
                topk_idx.shape[1], kNormalMaxTopk);
  DeviceGuard guard(device_);
  const int R = num_ranks_;
  // NOTE: its own error record, never read: nothing waits for this kernel before the next dispatch clears the
  // dispatch's record on the host, and that dispatch finds a bad entry itself (route_locally runs the layout again).
  const LayoutOutput out = run_layout(topk_idx, num_experts, error_device_ + 1, static_cast<cudaStream_t>(stream));
  auto storage = std::make_shared<Tensor>(out.storage);
  const Device dev = group_.device();
  Layout layout;
  layout.num_tokens_per_rank = Tensor::wrap(TensorView::of(out.counts, DType::kInt32, {R}, dev), storage);
  layout.num_tokens_per_expert =
      Tensor::wrap(TensorView::of(out.counts + R, DType::kInt32, {num_experts}, dev), storage);
  layout.is_token_in_rank =
      Tensor::wrap(TensorView::of(out.in_rank, DType::kBool, {topk_idx.shape[0], R}, dev), storage);
  add_tokens_per_node(layout, stream);
  return layout;
}

void HierarchicalEngine::route_locally(const DispatchArgs& args, int64_t T, HierarchicalRoutes& routes) {
  const int R = num_ranks_, N = topology_.num_nodes;
  const int64_t E = args.num_experts;
  cudaStream_t stream = static_cast<cudaStream_t>(args.stream);
  std::memset(error_, 0, sizeof(ErrorRecord));  // the previous dispatch's kernels finished (its sync)
  const LayoutOutput layout = run_layout(args.topk_idx, E, error_device_, stream);
  int32_t* counts = layout.counts;  // [R] per rank, [E] per expert, [N] per node
  routes.is_token_in_rank = Tensor::wrap(TensorView::of(layout.in_rank, DType::kBool, {T, R}, group_.device()),
                                         std::make_shared<Tensor>(layout.storage));
  routes.node_slot = empty(DType::kInt32, {T, N}, stream);
  routes.node_tok = empty(DType::kInt32, {N, T}, stream);
  hier::launch_node_scan(layout.in_rank, T, N, topology_.gpus_per_node, routes.node_slot.data_as<int32_t>(),
                         routes.node_tok.data_as<int32_t>(), counts + R + E, stream);
  check_cuda(cudaGetLastError(), "node scan launch");
  const Tensor* given = args.layout != nullptr && args.layout->num_tokens_per_node.defined()
                            ? &args.layout->num_tokens_per_node
                            : nullptr;
  if (given != nullptr) {
    check_tensor(*given, "layout.num_tokens_per_node", DType::kInt32, {N});
    check_device(*given, "layout.num_tokens_per_node", group_.device());
  }
  check_cuda(cudaMemcpyAsync(counts_host_, counts, 4 * (R + E + N), cudaMemcpyDeviceToHost, stream),
             "cudaMemcpyAsync (counts)");
  if (given != nullptr) {
    check_cuda(cudaMemcpyAsync(counts_host_ + R + E + N, given->data(), 4 * N, cudaMemcpyDeviceToHost, stream),
               "cudaMemcpyAsync (layout.num_tokens_per_node)");
  }
  // NOTE: bounded, spinning like cudaStreamSynchronize (the counts are on the dispatch's critical path): the stream
  // may hold earlier work that never finishes. Thrown inside the dispatch's local checks, so every rank fails alike.
  const bool synced = detail::poll_until(
      detail::deadline_after_ms(group_.timeout_ms()),
      [&] {
        const cudaError_t status = cudaStreamQuery(stream);
        if (status != cudaErrorNotReady) check_cuda(status, "cudaStreamQuery (dispatch counts)");
        return status == cudaSuccess;
      },
      std::chrono::microseconds(0));
  EPX_CHECK(ErrorCode::kTimeout, synced,
            "cuda rank {}: the dispatch's layout counts did not reach the host within {} ms: earlier work on the "
            "stream does not finish",
            rank_, group_.timeout_ms());
  EPX_CHECK_ARG(
      given == nullptr || std::equal(counts_host_ + R + E, counts_host_ + R + E + N, counts_host_ + R + E + N),
      "layout.num_tokens_per_node does not match topk_idx (pass the layout get_dispatch_layout computed "
      "for it)");
  routes.per_rank.assign(counts_host_, counts_host_ + R);  // this rank's row; the others come with the headers
  routes.per_node.assign(counts_host_ + R + E, counts_host_ + R + E + N);
}

void HierarchicalEngine::wait_exchanges() {
  DeviceGuard guard(device_);
  exchange_->wait_finished();
}

DispatchResult HierarchicalEngine::dispatch(const DispatchArgs& args) {
  const int R = num_ranks_, N = topology_.num_nodes, G = topology_.gpus_per_node;
  cudaStream_t stream = static_cast<cudaStream_t>(args.stream);
  DeviceGuard guard(device_);
  // NOTE: counted before anything can throw: the count is the handle id every rank must agree on, and the wait below
  // fails on some ranks only (those whose exchange with a late peer hung), so a count after it would drift apart.
  const uint64_t call_id = ++call_seq_;
  exchange_->wait_finished();  // the previous call's exchanges (NCCL): a peer that never posted surfaces here

  // Local checks and, in a fresh dispatch, the layout (the one host sync). Errors wait for the header exchange.
  Header mine;
  ep::DispatchShape shape;
  std::shared_ptr<const HierarchicalHandle> cached;
  auto routes = std::make_shared<HierarchicalRoutes>();
  std::exception_ptr local_error;
  try {
    shape = ep::validate_dispatch(args, R, group_.device());
    ep::resolve_num_sms(args.num_sms, num_sms_);  // checked; the kernels size their grids themselves
    EPX_CHECK_ARG(shape.num_topk <= kNormalMaxTopk, "topk_idx has {} columns; the cuda backend allows <= {}",
                  shape.num_topk, kNormalMaxTopk);
    if (shape.is_cached) {
      cached = std::dynamic_pointer_cast<const HierarchicalHandle>(args.handle);
      EPX_CHECK_ARG(cached != nullptr && cached->owner == this, "handle was not made by this buffer");
    } else {
      EPX_CHECK_ARG(args.num_experts <= kNormalMaxExperts, "num_experts must be <= {} on the cuda backend, got {}",
                    kNormalMaxExperts, args.num_experts);
      route_locally(args, shape.num_tokens, *routes);
      if (error_->code == kErrInvalidTopk) mine.invalid_topk = 1;
    }
  } catch (...) {
    local_error = std::current_exception();
  }
  mine.failed = local_error != nullptr;
  mine.kind = shape.is_cached ? kCachedDispatch : kFreshDispatch;
  mine.hidden = shape.hidden;
  mine.x_dtype = static_cast<int32_t>(args.x.dtype);
  mine.scales_dtype = shape.is_fp8 ? static_cast<int32_t>(args.x_scales.dtype) : -1;
  mine.num_topk = static_cast<int32_t>(shape.num_topk);
  mine.has_weights = args.topk_weights.defined();
  mine.topk_dtype = shape.is_cached ? -1 : static_cast<int32_t>(args.topk_idx.dtype);
  mine.num_experts = cached ? cached->routes->num_experts : args.num_experts;
  mine.handle_id = cached ? cached->routes->id : 0;
  for (size_t i = 0; !local_error && !cached && i < routes->per_node.size(); ++i)
    mine.per_node[i] = routes->per_node[i];
  for (size_t i = 0; !local_error && !cached && i < routes->per_rank.size(); ++i)
    mine.per_rank[i] = routes->per_rank[i];
  std::vector<Header> all(R);
  group_.all_gather_bytes(&mine, all.data(), sizeof(Header));
  check_headers(all, mine, rank_, "dispatch", local_error);
  if (mine.invalid_topk) {  // this rank's own bad entry first, then a peer's
    const ErrorRecord e = *error_;
    std::memset(error_, 0, sizeof(ErrorRecord));
    detail::raise(ErrorCode::kInvalidArgument, "topk_idx[{}][{}] = {} is outside [-1, num_experts = {}) (rank {})",
                  e.peer, e.channel, e.observed, e.expected, rank_);
  }
  for (int s = 0; s < R; ++s) {
    EPX_CHECK(ErrorCode::kPeerFailure, !all[s].invalid_topk,
              "cuda rank {}: rank {} passed an invalid topk_idx entry to this dispatch; the dispatch failed on every "
              "rank before any data moved, the buffer stays usable",
              rank_, s);
  }

  // The routes: every rank's counts from the headers (fresh), or the handle's.
  const int64_t T = shape.num_tokens;
  const int64_t num_local_experts = mine.num_experts / R;
  if (cached) {
    routes = std::const_pointer_cast<HierarchicalRoutes>(cached->routes);
  } else {
    routes->id = call_id;
    routes->num_tokens = T;
    routes->num_experts = args.num_experts;
    routes->per_rank.assign(R * R, 0);
    routes->per_node.assign(R * N, 0);
    for (int s = 0; s < R; ++s) {
      std::copy(all[s].per_rank, all[s].per_rank + R, routes->per_rank.begin() + s * R);
      std::copy(all[s].per_node, all[s].per_node + N, routes->per_node.begin() + s * N);
    }
    // Per-expert counts of this rank's experts: every rank's layout counts (a second, larger all-gather).
    std::vector<int32_t> experts(args.num_experts * R);
    group_.all_gather_bytes(counts_host_ + R, experts.data(), sizeof(int32_t) * args.num_experts);
    routes->expert_counts_host.assign(num_local_experts, 0);
    for (int64_t e = 0; e < num_local_experts; ++e) {
      int64_t pairs = 0;
      for (int s = 0; s < R; ++s) pairs += experts[s * args.num_experts + rank_ * num_local_experts + e];
      const int64_t a = args.expert_alignment;
      routes->expert_counts_host[e] = static_cast<int32_t>((pairs + a - 1) / a * a);
    }
    std::vector<int32_t> prefix(R * R + num_local_experts);
    for (int i = 0; i < R; ++i) {
      for (int j = 0; j < R; ++j)
        prefix[i * R + j] = (i > 0 ? prefix[(i - 1) * R + j] : 0) + routes->per_rank[i * R + j];
    }
    for (int s = 0; s < R; ++s) routes->num_recv += routes->per_rank[s * R + rank_];
    std::copy(routes->expert_counts_host.begin(), routes->expert_counts_host.end(), prefix.begin() + R * R);
    routes->rank_prefix = empty(DType::kInt32, {R, R}, stream);
    routes->recv_expert_counts = empty(DType::kInt32, {num_local_experts}, stream);
    // NOTE: from pageable memory: the copy has read `prefix` when cudaMemcpyAsync returns.
    check_cuda(cudaMemcpyAsync(routes->rank_prefix.data(), prefix.data(), 4 * R * R, cudaMemcpyHostToDevice, stream),
               "cudaMemcpyAsync (rank prefix)");
    if (num_local_experts > 0) {
      check_cuda(cudaMemcpyAsync(routes->recv_expert_counts.data(), prefix.data() + R * R, 4 * num_local_experts,
                                 cudaMemcpyHostToDevice, stream),
                 "cudaMemcpyAsync (expert counts)");
    }
  }
  const int64_t num_recv = routes->num_recv;
  const int64_t num_rows = args.num_worst_tokens > 0 ? args.num_worst_tokens : num_recv;
  const bool overflow = num_recv > num_rows;  // raised after the node leg, so that the peers succeed
  const Legs legs(*routes, topology_, rank_);

  // Network leg: pack this rank's records per destination node, exchange with the forwarders (n, local).
  const int K = shape.is_cached ? 0 : static_cast<int>(shape.num_topk);
  const int64_t x_bytes = shape.hidden * static_cast<int64_t>(dtype_size(args.x.dtype));
  const hier::RecordLayout rec = hier::RecordLayout::make(x_bytes, shape.scale_bytes, K, args.topk_weights.defined());
  Tensor scales_copy;
  const char* scales = shape.is_fp8 ? static_cast<const char*>(args.x_scales.data) : nullptr;
  if (shape.is_fp8 && !args.x_scales.is_contiguous()) {
    const TensorView& s = args.x_scales;
    scales_copy = empty(s.dtype, {T, s.shape[1]}, stream);
    launch_gather_scales(s.data, s.strides[0], s.strides[1], static_cast<int>(dtype_size(s.dtype)), T, s.shape[1],
                         scales_copy.data(), stream);
    scales = static_cast<const char*>(scales_copy.data());
  }
  const Tensor net_send = empty(DType::kUInt8, {legs.net_msgs.start[N] * rec.bytes}, stream);
  hier::PackArgs pack{};
  pack.x = static_cast<const char*>(args.x.data);
  pack.scales = scales;
  pack.topk_idx = K > 0 ? args.topk_idx.data : nullptr;
  pack.topk_is_int64 = K > 0 && args.topk_idx.dtype == DType::kInt64;
  pack.weights = rec.has_weights ? args.topk_weights.data_as<const float>() : nullptr;
  pack.node_tok = routes->node_tok.data_as<const int32_t>();
  pack.num_tokens = T;
  pack.num_nodes = N;
  pack.gpus_per_node = G;
  pack.messages = legs.net_msgs;
  pack.rec = rec;
  pack.out = net_send.data_as<char>();
  pack.is_token_in_rank = routes->is_token_in_rank.data_as<const uint8_t>();
  const Tensor relay = empty(DType::kUInt8, {legs.num_relay * rec.bytes}, stream);
  hier::launch_pack(pack, stream);
  check_cuda(cudaGetLastError(), "pack launch");
  exchange_->run(legs.net_peers, net_send.data(), Legs::bytes(legs.net_send, rec.bytes), relay.data(),
                 Legs::bytes(legs.net_recv, rec.bytes), stream, "dispatch network leg");

  // Node leg: the forwarder sends each record to its flagged local ranks.
  if (!cached) {
    routes->fwd_pos = empty(DType::kInt32, {G, legs.num_relay}, stream);
    hier::launch_forward_scan(relay.data_as<const char>(), rec, legs.num_relay, G, routes->fwd_pos.data_as<int32_t>(),
                              stream);
  }
  const Tensor node_send = empty(DType::kUInt8, {legs.fwd_msgs.start[G] * rec.bytes}, stream);
  hier::launch_forward_pack(relay.data_as<const char>(), rec, legs.num_relay, G,
                            routes->fwd_pos.data_as<const int32_t>(), legs.fwd_msgs, node_send.data_as<char>(), stream);
  const Tensor node_recv = empty(DType::kUInt8, {num_recv * rec.bytes}, stream);
  exchange_->run(legs.node_peers, node_send.data(), Legs::bytes(legs.fwd_send, rec.bytes), node_recv.data(),
                 Legs::bytes(legs.fwd_recv, rec.bytes), stream, "dispatch node leg");
  check_cuda(cudaGetLastError(), "forward launch");
  EPX_CHECK_ARG(!overflow, "num_worst_tokens = {} is smaller than the {} rows rank {} receives", args.num_worst_tokens,
                num_recv, rank_);

  // Destination: the records into their rows (source rank, then token order), top-k remapped to local experts.
  DispatchResult result;
  result.recv_x = empty(args.x.dtype, {num_rows, shape.hidden}, stream);
  if (shape.is_fp8) result.recv_x_scales = empty(args.x_scales.dtype, {num_rows, args.x_scales.shape[1]}, stream);
  if (K > 0) {
    result.recv_topk_idx = empty(args.topk_idx.dtype, {num_rows, K}, stream);
    if (args.topk_weights.defined()) result.recv_topk_weights = empty(DType::kFloat32, {num_rows, K}, stream);
  }
  result.recv_src_idx = empty(DType::kInt32, {num_rows}, stream);
  hier::UnpackArgs unpack{};
  unpack.in = node_recv.data_as<const char>();
  unpack.rec = rec;
  unpack.blocks = legs.blocks;
  std::copy(legs.row_base, legs.row_base + hier::kMaxParts, unpack.row_base);
  unpack.num_recv = num_recv;
  unpack.num_rows = num_rows;
  unpack.expert_begin = rank_ * num_local_experts;
  unpack.num_local_experts = static_cast<int>(num_local_experts);
  unpack.out_x = result.recv_x.data_as<char>();
  unpack.out_scales = shape.is_fp8 ? result.recv_x_scales.data_as<char>() : nullptr;
  unpack.out_topk_idx = K > 0 ? result.recv_topk_idx.data() : nullptr;
  unpack.topk_is_int64 = K > 0 && args.topk_idx.dtype == DType::kInt64;
  unpack.out_weights = result.recv_topk_weights.defined() ? result.recv_topk_weights.data_as<float>() : nullptr;
  unpack.out_src_idx = result.recv_src_idx.data_as<int32_t>();
  hier::launch_unpack(unpack, stream);
  check_cuda(cudaGetLastError(), "unpack launch");

  auto handle = std::make_shared<HierarchicalHandle>();
  handle->owner = this;
  handle->routes = routes;
  handle->num_rows = num_rows;
  result.recv_expert_counts = routes->recv_expert_counts;
  result.rank_prefix_matrix = routes->rank_prefix;
  if (args.num_worst_tokens == 0) result.num_recv_tokens_per_expert = routes->expert_counts_host;
  result.handle = std::move(handle);
  return result;
}

CombineResult HierarchicalEngine::combine(const CombineArgs& args) {
  const int R = num_ranks_, N = topology_.num_nodes, G = topology_.gpus_per_node;
  cudaStream_t stream = static_cast<cudaStream_t>(args.stream);
  DeviceGuard guard(device_);
  ++call_seq_;  // before anything can throw (see dispatch)
  exchange_->wait_finished();
  Header mine;
  std::shared_ptr<const HierarchicalHandle> handle;
  std::exception_ptr local_error;
  try {
    handle = std::dynamic_pointer_cast<const HierarchicalHandle>(args.handle);
    EPX_CHECK_ARG(handle != nullptr && handle->owner == this, "handle was not made by this buffer's dispatch");
    ep::validate_combine(args, handle->routes->num_tokens, handle->num_rows, group_.device());
    ep::resolve_num_sms(args.num_sms, num_sms_);
    EPX_CHECK_ARG(!args.topk_weights.defined() || args.topk_weights.shape[1] <= kNormalMaxTopk,
                  "topk_weights has {} columns; the cuda backend allows <= {}", args.topk_weights.shape[1],
                  kNormalMaxTopk);
    ep::refuse_combine_order_on_hierarchical(args);
  } catch (...) {
    local_error = std::current_exception();
  }
  mine.failed = local_error != nullptr;
  mine.kind = kCombine;
  mine.hidden = local_error ? 0 : args.x.shape[1];
  mine.has_weights = args.topk_weights.defined();
  mine.num_topk = args.topk_weights.defined() ? static_cast<int32_t>(args.topk_weights.shape[1]) : 0;
  mine.handle_id = handle != nullptr ? handle->routes->id : 0;
  std::vector<Header> all(R);
  group_.all_gather_bytes(&mine, all.data(), sizeof(Header));
  check_headers(all, mine, rank_, "combine", local_error);

  const HierarchicalRoutes& routes = *handle->routes;
  const Legs legs(routes, topology_, rank_);
  const int64_t H = mine.hidden, T = routes.num_tokens;
  const int K = mine.num_topk;
  const int64_t node_bytes = hier::node_record_bytes(H, K),
                partial_bytes = hier::partial_record_bytes(H, K, bf16_partials_);

  // Node leg, reversed: the rows go back to the forwarders they came from, in the order they came.
  const Tensor node_send = empty(DType::kUInt8, {routes.num_recv * node_bytes}, stream);
  hier::CombinePackArgs pack{};
  pack.x = args.x.data_as<const uint16_t>();
  pack.weights = K > 0 ? args.topk_weights.data_as<const float>() : nullptr;
  pack.hidden = H;
  pack.num_topk = K;
  pack.blocks = legs.blocks;
  std::copy(legs.row_base, legs.row_base + hier::kMaxParts, pack.row_base);
  pack.out = node_send.data_as<char>();
  hier::launch_combine_pack(pack, stream);
  check_cuda(cudaGetLastError(), "combine pack launch");
  const Tensor node_recv = empty(DType::kUInt8, {legs.fwd_msgs.start[G] * node_bytes}, stream);
  exchange_->run(legs.node_peers, node_send.data(), Legs::bytes(legs.fwd_recv, node_bytes), node_recv.data(),
                 Legs::bytes(legs.fwd_send, node_bytes), stream, "combine node leg");

  // Forwarder: fp32 partials per forwarded record (local rank ascending; x rounded to bf16 with
  // NodePartials::kBFloat16), back over the network leg.
  const Tensor partials = empty(DType::kUInt8, {legs.num_relay * partial_bytes}, stream);
  hier::CombineReduceArgs reduce{};
  reduce.in = node_recv.data_as<const char>();
  reduce.messages = legs.fwd_msgs;
  reduce.fwd_pos = routes.fwd_pos.data_as<const int32_t>();
  reduce.num_records = legs.num_relay;
  reduce.gpus_per_node = G;
  reduce.hidden = H;
  reduce.num_topk = K;
  reduce.bf16 = bf16_partials_;
  reduce.out = partials.data_as<char>();
  hier::launch_combine_reduce_node(reduce, stream);
  check_cuda(cudaGetLastError(), "combine reduce launch");
  const Tensor net_recv = empty(DType::kUInt8, {legs.net_msgs.start[N] * partial_bytes}, stream);
  exchange_->run(legs.net_peers, partials.data(), Legs::bytes(legs.net_recv, partial_bytes), net_recv.data(),
                 Legs::bytes(legs.net_send, partial_bytes), stream, "combine network leg");

  // Source: sum over nodes ascending, biases, one rounding.
  CombineResult result;
  result.x = empty(DType::kBFloat16, {T, H}, stream);
  if (K > 0) result.topk_weights = empty(DType::kFloat32, {T, K}, stream);
  hier::CombineFinalArgs fin{};
  fin.in = net_recv.data_as<const char>();
  fin.messages = legs.net_msgs;
  fin.node_slot = routes.node_slot.data_as<const int32_t>();
  fin.num_tokens = T;
  fin.num_nodes = N;
  fin.hidden = H;
  fin.num_topk = K;
  fin.bf16 = bf16_partials_;
  fin.bias_0 = args.bias_0.defined() ? args.bias_0.data_as<const uint16_t>() : nullptr;
  fin.bias_1 = args.bias_1.defined() ? args.bias_1.data_as<const uint16_t>() : nullptr;
  fin.out = result.x.data_as<uint16_t>();
  fin.out_weights = K > 0 ? result.topk_weights.data_as<float>() : nullptr;
  hier::launch_combine_final(fin, stream);
  check_cuda(cudaGetLastError(), "combine final launch");
  return result;
}

}  // namespace epx::cuda
