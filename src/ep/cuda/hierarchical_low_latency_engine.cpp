#include "ep/cuda/hierarchical_low_latency_engine.h"

#include <algorithm>

#include "core/check.h"
#include "core/cuda/cuda_util.h"
#include "core/limits.h"
#include "ep/normal_region.h"

namespace epx::cuda {
namespace {

// The grid cap of the waiting kernels (reduce, llh::combine) with a GPU to itself: the flat combine receive's 264.
// Ranks sharing a GPU get a share of 64 blocks each (at least 8): their spinning grids must leave room for the
// peers' kernels they wait for (docs/status.md: one GPU runs only small spinning grids of four ranks).
constexpr int kSpinBlocksAlone = 264;
constexpr int kSpinBlocksShared = 64;

// Whether `stream` is being captured into a CUDA graph (also an invalidated capture not ended yet).
bool is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &status), "cudaStreamIsCapturing (low-latency relay)");
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace

RelayOffsets make_relay_offsets(int num_nodes, int gpus_per_node, int64_t max_tokens, int64_t hidden,
                                int64_t num_local_experts, int partial_bytes) {
  const int64_t S = num_nodes - 1, M = max_tokens, H = hidden, K = kLowLatencyMaxTopk;
  // The largest message: bf16 rows, K = 16.
  const int64_t message = RelayRecord::make(H, false, false, kLowLatencyMaxTopk).message_bytes(M);
  RelayOffsets o{};
  int64_t offset = 0;
  auto take = [&](int64_t bytes) {
    const int64_t at = offset;
    offset = align_up(offset + bytes, 256);
    return at;
  };
  for (int set = 0; set < 2; ++set) {
    o.rows[set] = take(S * M * K * H * 2);
    o.row_signals[set] = take(S * gpus_per_node * num_local_experts * 8);
    o.relay[set] = take(S * message);
    o.node_slot[set] = take(M * num_nodes * 4);
    o.partial_recv[set] = take(S * M * H * partial_bytes);
  }
  o.pack = take(num_nodes * message);
  o.weights_send = take(S * relay_weights_bytes(M, kLowLatencyMaxTopk));
  o.weights_recv = take(S * relay_weights_bytes(M, kLowLatencyMaxTopk));
  o.partial_send = take(S * M * H * partial_bytes);
  o.total_bytes = offset;
  return o;
}

LowLatencyRelay::LowLatencyRelay(CudaGroup& group, int device, NodePartials node_partials)
    : group_(group), device_(device), topology_(group.topology()), rank_(group.rank()) {
  view_.bf16_partials = node_partials == NodePartials::kBFloat16;
  DeviceGuard guard(device_);
  check_cuda(preload_relay_kernels(), "cudaFuncGetAttributes (preload low-latency relay kernels)");
  check_cuda(cudaStreamCreateWithFlags(&comm_, cudaStreamNonBlocking), "cudaStreamCreate (low-latency relay)");
  for (cudaEvent_t* e :
       {&fork_, &inputs_read_, &dispatch_done_[0], &dispatch_done_[1], &combine_done_[0], &combine_done_[1]}) {
    check_cuda(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "cudaEventCreate (low-latency relay)");
  }
  exchange_ = make_byte_exchange(group_);
  for (int m = 0; m < topology_.num_nodes; ++m) {
    net_peers_.push_back(topology_.rank_of(m, topology_.local_rank_of(rank_)));
  }
  // Ranks of this process on this rank's GPU (processes are counted as one GPU each).
  std::vector<int> devices(group_.num_ranks());
  group_.all_gather_bytes(&device_, devices.data(), sizeof(int));
  const int sharing =
      group_.single_process() ? static_cast<int>(std::count(devices.begin(), devices.end(), device_)) : 1;
  view_.num_nodes = topology_.num_nodes;
  view_.gpus_per_node = topology_.gpus_per_node;
  view_.node = topology_.node_of(rank_);
  view_.local_rank = topology_.local_rank_of(rank_);
  view_.spin_blocks = sharing <= 1 ? kSpinBlocksAlone : std::max(8, kSpinBlocksShared / sharing);
}

LowLatencyRelay::~LowLatencyRelay() {
  DeviceGuard guard(device_);
  exchange_.reset();
  cudaStreamSynchronize(comm_);
  close_peer_regions(peers_map_);
  if (region_ != nullptr) cudaFree(region_);
  for (cudaEvent_t e :
       {fork_, inputs_read_, dispatch_done_[0], dispatch_done_[1], combine_done_[0], combine_done_[1]}) {
    cudaEventDestroy(e);
  }
  cudaStreamDestroy(comm_);
}

void LowLatencyRelay::ensure(const LowLatencyLayout& layout) {
  if (region_ != nullptr && layout.max_tokens_per_rank == max_tokens_ && layout.hidden == hidden_ &&
      layout.num_experts == num_experts_) {
    return;
  }
  DeviceGuard guard(device_);
  if (region_ != nullptr) {  // new shapes after clean_low_latency_buffer (the device is idle)
    close_peer_regions(peers_map_);
    check_cuda(cudaFree(region_), "cudaFree (low-latency relay region)");
    region_ = nullptr;
  }
  view_.off = make_relay_offsets(topology_.num_nodes, topology_.gpus_per_node, layout.max_tokens_per_rank,
                                 layout.hidden, layout.num_local_experts, view_.partial_bytes());
  const cudaError_t allocated = cudaMalloc(&region_, view_.off.total_bytes);
  if (allocated == cudaErrorStreamCaptureUnsupported || allocated == cudaErrorStreamCaptureInvalidated) {
    region_ = nullptr;
    detail::raise(
        ErrorCode::kInvalidArgument,
        "cuda rank {}: the first hierarchical low-latency dispatch of a buffer (and the first after "
        "clean_low_latency_buffer with other shapes) allocates and maps its relay region, collectively, so it "
        "cannot be captured into a CUDA graph: run one dispatch and combine eagerly before the capture ({})",
        rank_, cudaGetErrorString(allocated));
  }
  check_cuda(allocated, "cudaMalloc (low-latency relay region)");
  // NOTE: zeroed before the mapping below hands the address to the peers: relay signals compare against tags >= 1.
  check_cuda(cudaMemsetAsync(region_, 0, view_.off.total_bytes, comm_), "cudaMemsetAsync (low-latency relay region)");
  check_cuda(cudaStreamSynchronize(comm_), "cudaStreamSynchronize (low-latency relay region)");
  peers_map_ = open_peer_regions(group_, group_.single_process(), region_, device_, topology_.gpus_per_node);
  for (int r = 0; r < group_.num_ranks(); ++r) view_.bases[r] = peers_map_.ptrs[r];
  max_tokens_ = layout.max_tokens_per_rank;
  hidden_ = layout.hidden;
  num_experts_ = layout.num_experts;
}

void LowLatencyRelay::wait_exchanges() {
  DeviceGuard guard(device_);
  exchange_->wait_finished();
}

void LowLatencyRelay::fork(cudaStream_t stream) {
  // The previous call's exchanges (NCCL): a peer that never posted surfaces here. NOTE: not while `stream` is being
  // captured: the host cannot wait for captured work, and an event query during a ThreadLocal or Global capture is
  // prohibited (it fails and invalidates the capture). The exchanges recorded before the capture stay pending, so the
  // first eager call after it waits for them; captured exchanges are not bounded (they run when the graph runs).
  if (!is_capturing(stream)) exchange_->wait_finished();
  check_cuda(cudaEventRecord(fork_, stream), "cudaEventRecord (low-latency relay fork)");
  check_cuda(cudaStreamWaitEvent(comm_, fork_, 0), "cudaStreamWaitEvent (low-latency relay fork)");
}

void LowLatencyRelay::exchange(const char* send, char* recv, int64_t bytes, const char* what) {
  if (topology_.num_nodes == 1) return;  // the same on every rank
  const int node = topology_.node_of(rank_);
  std::vector<int64_t> sizes(net_peers_.size(), bytes);
  sizes[node] = 0;  // this node's records never leave the rank
  exchange_->run(net_peers_, send, sizes, recv, sizes, comm_, what);
}

void LowLatencyRelay::send_dispatch(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                    const LowLatencyDispatchLaunch& launch, cudaStream_t stream) {
  fork(stream);
  const RelayRecord rec = RelayRecord::make(layout.hidden, launch.use_fp8, launch.ue8m0, launch.num_topk);
  rec_[set] = rec;
  const RelayPackArgs pack{launch.x, launch.topk, launch.topk_int64, launch.num_tokens, launch.use_fp8, launch.ue8m0,
                           rec,      set};
  launch_relay_pack(peers, layout, view_, pack, comm_);
  // The inputs are read: the caller's stream may go on (and free or overwrite them), as after the flat send kernel.
  check_cuda(cudaEventRecord(inputs_read_, comm_), "cudaEventRecord (low-latency relay)");
  check_cuda(cudaStreamWaitEvent(stream, inputs_read_, 0), "cudaStreamWaitEvent (low-latency relay)");
  exchange(region_ + view_.off.pack, region_ + view_.off.relay[set], rec.message_bytes(layout.max_tokens_per_rank),
           "low-latency dispatch network leg");
  launch_relay_forward(peers, layout, view_, rec, set, comm_);
  check_cuda(cudaEventRecord(dispatch_done_[set], comm_), "cudaEventRecord (low-latency relay)");
}

void LowLatencyRelay::join_dispatch(int set, cudaStream_t stream) {
  check_cuda(cudaStreamWaitEvent(stream, dispatch_done_[set], 0), "cudaStreamWaitEvent (low-latency relay join)");
}

void LowLatencyRelay::send_combine(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                   const LowLatencyCombineLaunch& launch, cudaStream_t stream) {
  fork(stream);
  const RelayRowsArgs rows{launch.x, launch.num_topk, launch.dispatch_set, set, launch.send_parts, launch.dispatch_id};
  launch_relay_rows(peers, layout, view_, rows, comm_);
  const int64_t M = layout.max_tokens_per_rank;
  const int64_t weight_bytes = relay_weights_bytes(M, launch.num_topk);  // one message; rows past T unused
  const int num_slots = topology_.num_nodes - 1;
  if (num_slots > 0) {
    const RelayWeightsArgs weights{launch.topk_weights, launch.num_tokens, launch.num_topk};
    launch_relay_weights(peers, layout, view_, weights, comm_);
  }
  check_cuda(cudaEventRecord(inputs_read_, comm_), "cudaEventRecord (low-latency relay)");
  check_cuda(cudaStreamWaitEvent(stream, inputs_read_, 0), "cudaStreamWaitEvent (low-latency relay)");
  exchange(region_ + view_.off.weights_send, region_ + view_.off.weights_recv, weight_bytes,
           "low-latency combine weights leg");
  if (num_slots > 0) {
    const RelayReduceArgs reduce{rec_[launch.dispatch_set], launch.dispatch_set, set, launch.dispatch_id};
    launch_relay_reduce(peers, layout, view_, reduce, comm_);
  }
  exchange(region_ + view_.off.partial_send, region_ + view_.off.partial_recv[set],
           M * layout.hidden * view_.partial_bytes(), "low-latency combine network leg");
  check_cuda(cudaEventRecord(combine_done_[set], comm_), "cudaEventRecord (low-latency relay)");
}

void LowLatencyRelay::receive_combine(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                      const LowLatencyCombineLaunch& launch, cudaStream_t stream) {
  check_cuda(cudaStreamWaitEvent(stream, combine_done_[set], 0), "cudaStreamWaitEvent (low-latency relay join)");
  const RelaySumArgs sum{launch.topk,       launch.topk_int64, launch.topk_weights, launch.num_tokens,
                         launch.num_topk,   launch.out,        launch.dispatch_set, set,
                         launch.dispatch_id};
  launch_relay_sum(peers, layout, view_, sum, stream);
}

void LowLatencyRelay::clean() {
  if (region_ == nullptr) return;
  DeviceGuard guard(device_);
  check_cuda(cudaMemsetAsync(region_, 0, view_.off.total_bytes, comm_), "cudaMemsetAsync (clean_low_latency_buffer)");
  check_cuda(cudaStreamSynchronize(comm_), "cudaStreamSynchronize (clean_low_latency_buffer)");
}

}  // namespace epx::cuda
